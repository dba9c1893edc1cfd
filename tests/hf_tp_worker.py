"""Run by tests/test_hf.py and tests/test_llama_hf.py under `deepspeed --num_gpus 2`: the
primary-head logits of an imported run's model (its family's LM: RoBERTa's masked LM, the
decoder's causal LM) at tensor parallel 2 (vocab-parallel embedding and output projection,
column / row parallel layers), gathered over the vocabulary and saved by rank 0.

    deepspeed --num_gpus 2 tests/hf_tp_worker.py RUN IDS.pt OUT.pt [RUN IDS.pt OUT.pt ...]
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import parallel  # noqa: E402
from mmadapt.engine import load_full_weights  # noqa: E402
from mmadapt.models import get_family  # noqa: E402
from mmadapt.run import load_weights  # noqa: E402


def logits_at_tp2(run: Path, ids: torch.Tensor) -> torch.Tensor:
    """The run's primary-head logits [b, s, Vp] at tensor parallel 2, gathered over the vocabulary
    (Vp: ModelConfig.padded_vocab_size, V and the padding's -inf columns)."""
    from megatron.core import parallel_state

    cfg, state = load_weights(run)
    cfg = dataclasses.replace(cfg, tensor_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = get_family(cfg).build_lm(cfg).eval()
    load_full_weights(model, {n: n for n, _ in model.named_parameters()}, state, lambda name: True)
    # the decoder's output projection may be untied; the encoder's is its word embedding
    output_weight = model.output_weight if hasattr(model, "output_weight") else model.word_embeddings.weight
    with torch.no_grad():
        local = model.heads.heads[-1](model.hidden_states(ids)[-1], output_weight)
        # megatron's gather allocates on CUDA; the same over gloo: each rank's vocabulary slice in rank order
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)


def main() -> None:
    """Arguments: RUN IDS.pt OUT.pt, or several such triples (one process group for all)."""
    args = [Path(a) for a in sys.argv[1:] if not a.startswith("--local_rank")]
    parallel.init_parallel(2, 1)
    parallel.seed_everything(0)
    for run, ids_file, out_file in zip(args[0::3], args[1::3], args[2::3]):
        logits = logits_at_tp2(run, torch.load(ids_file))
        if torch.distributed.get_rank() == 0:
            torch.save(logits, out_file)


if __name__ == "__main__":
    try:
        main()
    finally:
        # as cli.run_process does: without it gloo's threads can outlive the interpreter and abort
        # a rank that finished ("terminate called without an active exception", exit -6)
        parallel.shutdown()
