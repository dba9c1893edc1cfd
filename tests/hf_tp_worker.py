"""Run by tests/test_hf.py under `deepspeed --num_gpus 2`: the primary-head logits of an imported
run's model at tensor parallel 2 (vocab-parallel embedding and output projection, column / row
parallel layers), gathered over the vocabulary and saved by rank 0.

    deepspeed --num_gpus 2 tests/hf_tp_worker.py RUN IDS.pt OUT.pt
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import parallel  # noqa: E402
from mmadapt.engine import load_full_weights  # noqa: E402
from mmadapt.models.roberta.model import RobertaMLM  # noqa: E402
from mmadapt.run import load_weights  # noqa: E402


def main() -> None:
    run, ids_file, out_file = (Path(a) for a in sys.argv[1:] if not a.startswith("--local_rank"))
    cfg, state = load_weights(run)
    cfg = dataclasses.replace(cfg, tensor_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
    parallel.init_parallel(2, 1)
    parallel.seed_everything(0)
    model = RobertaMLM(cfg).eval()
    load_full_weights(model, {n: n for n, _ in model.named_parameters()}, state, lambda name: True)
    from megatron.core import parallel_state

    with torch.no_grad():
        local = model.heads.heads[-1](model.hidden_states(torch.load(ids_file))[-1], model.word_embeddings.weight)
        # megatron's gather allocates on CUDA; the same over gloo: each rank's vocabulary slice in rank order
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)  # [b, s, V]
    if torch.distributed.get_rank() == 0:
        torch.save(logits, out_file)


if __name__ == "__main__":
    try:
        main()
    finally:
        # as cli.run_process does: without it gloo's threads can outlive the interpreter and abort
        # a rank that finished ("terminate called without an active exception", exit -6)
        parallel.shutdown()
