"""Models and tensors on the evaluation device: its precision, the host-to-device copy, and
parameters swapped in place. What every scoring path shares (held-out scoring, Step 4, predict);
none of it needs a process group.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm


def progress(items: list, label: str):
    """`items` with a progress bar on stderr (`label`: what is done to each): every scoring pass
    over Step-2 artifacts shows that it moves, however long the list."""
    return tqdm(items, desc=label, unit="artifact", mininterval=2.0, leave=False)


def eval_dtype(device: torch.device) -> torch.dtype:
    """Evaluation's precision: bf16 on a GPU, the precision mmadapt's GPU configs
    (ds_configs/*_bf16.json) train in, so the forward passes the model learned from, at half the
    memory traffic of fp32; fp32 on the CPU, the reference that the tests compare against (and
    CPUs without bf16 units emulate it slowly)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def on_eval_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` moved to `device` in `eval_dtype`, in eval mode, with no parameter needing a gradient."""
    return model.to(device, eval_dtype(device)).eval().requires_grad_(False)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device: on a GPU from pinned memory without blocking the host (the copy is queued
    on the stream, before the forward passes that read it); on the CPU, `t` itself."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@contextlib.contextmanager
def swapped(model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """`model` with its named parameters replaced by `tensors`, its own put back on exit.

    The Parameter objects are replaced, not copied into: a first dimension of another size (the
    target vocabulary) needs no rebuilt model, and the model's own weights are never written.
    `tensors` are on the model's device in its dtype already (artifact.artifact_embeddings)."""
    own = []
    try:
        for name, t in tensors.items():
            module, _, attr = name.rpartition(".")
            owner = model.get_submodule(module)
            old = getattr(owner, attr)
            assert t.device == old.device and t.dtype == old.dtype, (name, t.device, t.dtype)
            own.append((owner, attr, old))
            setattr(owner, attr, torch.nn.Parameter(t, requires_grad=False))
        yield model
    finally:
        for owner, attr, old in own:
            setattr(owner, attr, old)
