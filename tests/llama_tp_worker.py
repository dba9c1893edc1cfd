"""Run by tests/test_llama_model.py under `deepspeed --num_gpus 2`: LlamaLM at tensor parallel 2
(vocab-parallel embedding and cross-entropy, column-parallel QKV / gate-up / untied output
layer, row-parallel attention-out / down), gathered to full tensors and saved by rank 0:
its seeded initial weights, then, from the full weights the test gives, each head's loss and
every parameter's gradient for the test's batch.

    deepspeed --num_gpus 2 tests/llama_tp_worker.py IN.pt OUT.pt
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import parallel  # noqa: E402
from mmadapt.config import ModelConfig  # noqa: E402
from mmadapt.engine import load_full_weights  # noqa: E402
from mmadapt.models.llama.model import LlamaLM  # noqa: E402


def gather_full(p: torch.Tensor, like: torch.nn.Parameter) -> torch.Tensor:
    """The full tensor of `like`'s TP shards (`p`: this rank's value or gradient). megatron's own
    gather allocates on CUDA; the same over gloo."""
    if not getattr(like, "tensor_model_parallel", False):
        return p.detach().clone()
    from megatron.core import parallel_state

    parts = [torch.empty_like(p) for _ in range(parallel.tp_world())]
    torch.distributed.all_gather(parts, p.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=like.partition_dim)


def main() -> None:
    in_file, out_file = (Path(a) for a in sys.argv[1:] if not a.startswith("--local_rank"))
    given = torch.load(in_file)
    cfg = dataclasses.replace(ModelConfig(**given["config"]), tensor_model_parallel_size=2)
    parallel.init_parallel(2, 1)
    model = LlamaLM(cfg, seed=given["seed"])
    init = {n: gather_full(p, p) for n, p in model.named_parameters()}
    load_full_weights(model, {n: n for n, _ in model.named_parameters()}, given["state"], lambda name: True)
    loss, per_head = model(given["ids"], given["labels"])
    loss.backward()
    grads = {n: gather_full(p.grad, p) for n, p in model.named_parameters()}
    if torch.distributed.get_rank() == 0:
        torch.save({"init": init, "per_head": per_head, "grads": grads}, out_file)


if __name__ == "__main__":
    try:
        main()
    finally:
        # as cli.run_process does: without it gloo's threads can outlive the interpreter and abort
        # a rank that finished ("terminate called without an active exception", exit -6)
        parallel.shutdown()
