"""The micro-batch a CUDA device fits (TrainConfig.micro_batch_fill): each update's blocks on a
rank, re-split after the run's first update into the fewest micro-batches whose peak memory
stays under a fraction of what the device leaves this process.

Why: the matmuls of a small micro-batch leave a GPU idle between launches. On an H200, roberta-base
Step 1 (bf16, s = 512) ran at 12.8% MFU with micro-batch 32 and 24.6% with 128, peaking at 24 GiB
of 141 (benchmarks/results/gpu_summary_h200_20261129.md). A cluster that accumulates gradients to
reach the paper's 2048-block batch asks for micro 32 x accumulation k; this trains the same
update as micro 32m x accumulation k/m for the largest m that fits.

What stays: the update. Its blocks are a pure function of (seed, update) (data.py); re-split,
each of a rank's micro-batches concatenates m consecutive ones of the requested split in order
(with replay text, their replay rows first, as ReplayBatches lays out one), and DeepSpeed
accumulates k/m of them (its set_train_micro_batch_size and set_train_batch_size: the loss is
scaled by the new accumulation). What moves: rounding, the dropout draws, and each micro-batch's
loss normalisation (the mean over its own scored positions, which equals the requested split's
only where every block scores the same number: the decoder's score_fraction).

How it measures (no formula of the model's activations to drift from it): the first update runs
at the requested split. `base` is the memory allocated before it (weights, DeepSpeed's buffers),
`peak` its peak, and `resident` what is allocated after it (plus the gradient buffers and
optimizer states it created). A micro-batch of d blocks is predicted to peak at most at
resident + d (peak - base) / micro: the per-block figure charges everything the update allocated
(gradients and optimizer states too) to its blocks, so it over-counts, and the prediction bounds
the peak from above while activations grow linearly with the blocks. Every rank takes the
smallest of the ranks' choices (one all-reduce, once), from the run's third update on: the second
update's batches are prepared while the first runs (train.Prefetcher). With `--fusion compile` the
compiled layers meet the new batch dimension once and compile again, with it dynamic.

Not applied: on a CPU (host memory is not the limit, and the tests' reference runs keep the split
they ask for), with pipeline stages (DeepSpeed's schedule holds its micro-batches), with one
micro-batch per update (nothing to merge), at micro_batch_fill 0. A resumed run fits again from
its own first update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

GIB = 2 ** 30


@dataclass
class Memory:
    """What the fit reads of a device's memory, in bytes."""
    allocated: Callable[[], int]
    peak: Callable[[], int]  # the most allocated since reset_peak
    reset_peak: Callable[[], None]
    available: Callable[[], int]  # what this process may hold: its allocator's reserve + the device's free memory


def device_memory(device: torch.device) -> Memory | None:
    """The CUDA allocator's counters of `device`; None elsewhere (no fit)."""
    if device.type != "cuda":
        return None
    return Memory(lambda: torch.cuda.memory_allocated(device), lambda: torch.cuda.max_memory_allocated(device),
                  lambda: torch.cuda.reset_peak_memory_stats(device),
                  lambda: torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device))


def fitted_merge(micro: int, accumulation: int, resident: float, per_block: float, limit: float) -> int:
    """The largest m dividing `accumulation` whose micro-batch of m * micro blocks is predicted to
    peak within `limit` (resident + m * micro * per_block); 1 when no larger one is."""
    fits = [m for m in range(1, accumulation + 1)
            if accumulation % m == 0 and resident + m * micro * per_block <= limit]
    return max(fits, default=1)


def merged(micro_batches: list[tuple], m: int) -> list[tuple]:
    """Consecutive groups of m micro-batches, each concatenated in order into one.

    micro_batches: (input_ids [b, s], labels [b, s]) on the host, or with replay (ReplayBatches)
    (input_ids, labels, r) whose first r rows are the replay text's -> the same with m * b rows;
    with replay the group's replay rows come first, then its target rows, each in order."""
    if m == 1:
        return micro_batches
    out = []
    for group in (micro_batches[i:i + m] for i in range(0, len(micro_batches), m)):
        if len(group[0]) == 2:
            out.append(tuple(torch.cat([g[j] for g in group]) for j in range(2)))
        else:
            rows = [g[2] for g in group]
            out.append((*(torch.cat([g[j][:r] for g, r in zip(group, rows)] + [g[j][r:] for g, r in zip(group, rows)])
                          for j in range(2)), sum(rows)))
    return out


class MicroBatchFit:
    """One run's fit (module docstring). The train loop calls `before(position)` and
    `after(position)` around each update and builds update `position`'s micro-batches as
    `merged(requested split's, factor(position))`."""

    def __init__(self, engine, micro: int, accumulation: int, fill: float, memory: Memory | None,
                 dp_world: int, log: Callable[[str], None] = print):
        self.engine, self.micro, self.accumulation, self.fill = engine, micro, accumulation, fill
        self.memory, self.dp_world, self.log = memory, dp_world, log
        self.active = memory is not None and fill > 0 and accumulation > 1
        self.first = self.start = None  # the run's first update; the first at the fitted split
        self.m, self.applied, self.base = 1, False, 0

    def factor(self, position: int) -> int:
        """How many of the requested micro-batches update `position`'s each hold."""
        return self.m if self.start is not None and position >= self.start else 1

    def before(self, position: int) -> None:
        if not self.active:
            return
        if self.first is None:
            self.first, self.base = position, self.memory.allocated()
            self.memory.reset_peak()
        elif position == self.start and self.m > 1:
            micro = self.micro * self.m
            self.engine.set_train_micro_batch_size(micro)
            self.engine.set_train_batch_size(micro * (self.accumulation // self.m) * self.dp_world)
            self.applied = True

    def after(self, position: int) -> None:
        if not self.active or position != self.first:
            return
        peak, resident, limit = self.memory.peak(), self.memory.allocated(), self.fill * self.memory.available()
        per_block = max(peak - self.base, 0) / self.micro
        m = torch.tensor([fitted_merge(self.micro, self.accumulation, resident, per_block, limit)],
                         device=self.engine.device)
        dist.all_reduce(m, op=dist.ReduceOp.MIN)  # every rank accumulates alike
        self.m, self.start = int(m.item()), position + 2
        if self.m > 1:
            self.log(f"micro-batch: {self.micro} x {self.accumulation} accumulation re-split to "
                     f"{self.micro * self.m} x {self.accumulation // self.m} from update {self.start + 1} "
                     f"(update {position + 1}: {peak / GIB:.1f} GiB at its peak, {resident / GIB:.1f} after it, of "
                     f"{limit / GIB:.1f} allowed; --micro_batch_fill 0 keeps the split as given)")

    def record(self) -> dict | None:
        """run.json's `micro_batch_fit` once the re-split has trained an update; None before."""
        if not self.applied:
            return None
        return {"train_micro_batch_size_per_gpu": self.micro * self.m,
                "gradient_accumulation_steps": self.accumulation // self.m, "from_update": self.start + 1}
