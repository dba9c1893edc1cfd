"""FLOP accounting shared by every model family: devices, device-days, and the counter that
checks each family's exact functions.

Convention (Marchisio et al. 2023, Appendix A.1, after Narayanan et al. 2021): a matmul of
[m, n] x [n, k] costs 2mnk FLOPs; non-matmul work (normalisation, softmax, activations, biases,
embedding lookups) is not counted. Each family's FLOP functions (models/<family>/flops.py, reached
through `ModelFamily.step_flops`) return FLOPs per sequence for one update; multiply by the global
batch B (sequences per update) and the number of updates U: `total_flops`.
"""

from __future__ import annotations

# 1 V100-day at the paper's assumed 30 TFLOP/s sustained = 2.592 EFLOPs (paper, section 3).
PAPER_V100_TFLOPS = 30.0

# Sustained (paper) or dense vendor peak throughput per device, TFLOP/s.
DEVICE_TFLOPS = {
    "v100-paper": PAPER_V100_TFLOPS,  # the paper's assumption for its device-days
    "v100": 125.0,                   # fp16 tensor-core peak, SXM2
    "a100": 312.0,                   # bf16 dense peak
    "h100": 989.0,                   # bf16 dense peak, SXM
    "h200": 989.0,                   # bf16 dense peak, SXM (the H100's chip, more and faster memory)
    # the same chip at lower power (vendor datasheets' sparse figures halved)
    "h100-pcie": 756.0,
    "h100-nvl": 835.0,
    "h200-nvl": 835.0,
}

# What one update of a language-model step trains: everything (Step 1), MINIPOST's new layers
# (Step 1b), the new vocabulary's embeddings over a frozen body (Step 2), a new MLM head over a
# headless encoder's frozen body (mmadapt fit-head, a Step-1 cost: encoders only); and "score",
# one forward pass as evaluation runs it, which trains nothing (Step 2's calibrations: the last
# layer's work after its attention, and the head, at the scored positions alone).
STEPS = ("pretrain", "minipost", "adapt", "fit_head", "score")


def total_flops(per_sequence: float, global_batch: int, updates: int) -> float:
    return per_sequence * global_batch * updates


def flops_by_rows(per_sequence: float, by_rows: tuple[float, float] | None, sequences: float,
                  rows: float | None) -> float:
    """FLOPs of `sequences` sequences whose heads projected `rows` positions: exact by `by_rows`
    (ModelFamily.row_flops: per sequence with none projected, per projected row) where both are
    known, else `per_sequence` each (the step's count at a fraction p of every position)."""
    if rows is None or by_rows is None:
        return per_sequence * sequences
    return by_rows[0] * sequences + by_rows[1] * rows


def device_days(flops: float, device: str = "v100-paper") -> float:
    """Days of one device at the throughput of DEVICE_TFLOPS[device]."""
    if device not in DEVICE_TFLOPS:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TFLOPS)}")
    return flops / (DEVICE_TFLOPS[device] * 1e12 * 86400)


def counted_flops(fn) -> int:
    """FLOPs that torch's FlopCounterMode sees while `fn()` runs (matmuls only, as above).
    Count a model with attention_impl='math': the counter sees CPU SDPA as 0 FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
