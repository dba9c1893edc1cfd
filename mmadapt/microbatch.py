"""The micro-batch a CUDA device fits (TrainConfig.micro_batch_fill): each update's blocks on a
rank, re-split after the run's first update into the fewest micro-batches whose peak memory is
estimated to stay under a fraction of what the device leaves this process.

Why: the matmuls of a small micro-batch leave a GPU idle between launches. On an H200, roberta-base
Step 1 (bf16, s = 512) ran at 12.8% MFU with micro-batch 32 and 24.6% with 128, peaking at 24 GiB
of 141 (benchmarks/results/gpu_summary_h200_20261129.md). A cluster that accumulates gradients to
reach the paper's 2048-block batch asks for micro 32 x accumulation k; this trains the same
update as micro 32m x accumulation k/m for the largest m that fits.

What stays: the update. Its blocks are a pure function of (seed, update) (data.py); re-split,
each of a rank's micro-batches concatenates m consecutive ones of the requested split in order
(with replay text, their replay rows first, as ReplayBatches lays out one), and DeepSpeed
accumulates k/m of them (its set_train_micro_batch_size and set_train_batch_size: the loss is
scaled by the new accumulation), and its loss, a mean over the update's scored positions
(TrainConfig.calculate_per_token_loss, the default). What moves: rounding, the dropout draws,
past layers.LOGITS_BUDGET scored rows x vocabulary the heads' chunked loss (the same values),
and with calculate_per_token_loss false, each micro-batch's loss normalisation (the mean over its
own scored positions, which equals the requested split's only where every block scores the same
number: the decoder's score_fraction).

How it estimates (no formula of the model's activations to drift from it): the first update runs
at the requested split (with fp16, the first whose optimizer step was applied, so that its
states exist). `base` is the memory allocated before it (weights, DeepSpeed's buffers), `peak`
its peak, and `resident` what is allocated after it (plus the gradient buffers and optimizer
states it created). A micro-batch of d blocks is estimated to peak at resident + d (peak - base)
/ micro: the per-block figure charges everything the update allocated (gradients and optimizer
states too) to its blocks, so it over-counts where activations grow linearly with the blocks.
It counts allocated memory only: the 1 - fill left over is for what it does not see, the
caching allocator's fragmentation, communicators made later, a recompile's workspace. Every rank
takes the smallest of the ranks' choices (one all-reduce, once), from the third update of the
run on: the second update's batches are being prepared while the first runs (train.Prefetcher
prepares one update ahead, so a position's factor is fixed before its batches are made). The
first update at the new split is measured too; the run's log and run.json (`micro_batch_fit`)
give its peak beside the estimate. With `--fusion compile` the compiled layers meet the new
batch dimension once and compile again, with it dynamic.

Resume: run.json holds the choice from the moment it is made (a re-split, or the split as asked
where no larger micro-batch was predicted to fit: measured again after a resume, with the
optimizer's states then in its base or on another device, it could come out otherwise), and a
resumed run takes it from its first update on (no new measurement): it trains the updates the
run would have trained uninterrupted. A run that stopped before its first update at the new
split finished (out of memory, most likely) left it unconfirmed: the resumed run keeps the split
as asked and says so.
`--micro_batch_fill 0` on a resume returns to the split as asked.

Not applied: on a CPU (host memory is not the limit, and the tests' reference runs keep the split
they ask for), with pipeline stages (DeepSpeed's schedule holds its micro-batches), with ZeRO's
CPU offload (its optimizer keeps the accumulation it started with), with one micro-batch per
update (nothing to merge), at micro_batch_fill 0.
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
    `merged(requested split's, factor(position))`. `recorded`: run.json's `micro_batch_fit` from
    an earlier invocation of the run (None: none); `write`: stores the record (global rank 0)."""

    def __init__(self, engine, micro: int, accumulation: int, fill: float, memory: Memory | None,
                 dp_world: int, recorded: dict | None = None, write: Callable[[dict], None] = lambda record: None,
                 log: Callable[[str], None] = print):
        self.engine, self.micro, self.accumulation, self.fill = engine, micro, accumulation, fill
        self.memory, self.dp_world, self.write, self.log = memory, dp_world, write, log
        self.active = memory is not None and fill > 0 and accumulation > 1
        self.first = self.start = None  # the first update measured; the first at the new split
        self.m, self.base, self.applied, self.record = 1, 0, False, None
        if self.active and recorded is not None:
            self.first, self.record = -1, recorded  # chosen by an earlier invocation: nothing to measure
            split = f"{recorded['train_micro_batch_size_per_gpu']} x {recorded['gradient_accumulation_steps']}"
            if recorded.get("tried") and not recorded.get("confirmed"):
                self.active = False
                self.log(f"micro-batch: the re-split to {split} did not finish its first update (update "
                         f"{recorded['from_update']}) before this resume: {micro} x {accumulation} as asked from here")
            else:
                self.m, self.start = recorded["merged"], recorded["from_update"] - 1
                if self.m > 1:
                    self.log(f"micro-batch: {split} from update {recorded['from_update']}, as this run chose before "
                             "(run.json's micro_batch_fit; --micro_batch_fill 0 keeps the split as asked)")
                else:
                    self.log(f"micro-batch: {split} as asked, as this run chose before (no larger micro-batch was "
                             "predicted to fit; run.json's micro_batch_fit)")

    def factor(self, position: int) -> int:
        """How many of the requested micro-batches update `position`'s each hold."""
        return self.m if self.start is not None and position >= self.start else 1

    def before(self, position: int) -> None:
        if not self.active:
            return
        if self.first is None:
            self.first, self.base = position, self.memory.allocated()
            self.memory.reset_peak()
        elif self.start is not None and position >= self.start and not self.applied and self.m > 1:
            # at an update boundary of the split as asked, so one of the new split's too
            assert self.engine.micro_steps % self.accumulation == 0, self.engine.micro_steps
            micro = self.micro * self.m
            self.engine.set_train_micro_batch_size(micro)
            self.engine.set_train_batch_size(micro * (self.accumulation // self.m) * self.dp_world)
            self.applied = True
            self.memory.reset_peak()
            if not self.record.get("tried"):  # a resume that finds it tried and unconfirmed keeps the split asked
                self.record = {**self.record, "tried": True}
                self.write(self.record)

    def after(self, position: int) -> None:
        if not self.active:
            return
        if self.start is None and position >= self.first:
            if self.engine.was_step_applied():  # fp16 skips its first steps: their states are not there yet
                self._choose(position)
        elif self.applied and position == self.start and not self.record["confirmed"]:
            self.record = {**self.record, "confirmed": True, "peak_bytes": self.memory.peak()}
            self.write(self.record)
            self.log(f"micro-batch: update {position + 1} at {self.micro * self.m} x {self.accumulation // self.m} "
                     f"peaked at {self.record['peak_bytes'] / GIB:.2f} GiB (estimated "
                     f"{self.record['estimate_bytes'] / GIB:.2f})")

    def _choose(self, position: int) -> None:
        peak, resident, limit = self.memory.peak(), self.memory.allocated(), self.fill * self.memory.available()
        per_block = max(peak - self.base, 0) / self.micro
        m = torch.tensor([fitted_merge(self.micro, self.accumulation, resident, per_block, limit)],
                         device=self.engine.device)
        dist.all_reduce(m, op=dist.ReduceOp.MIN)  # every rank accumulates alike (one host wait, once)
        self.m, self.start = int(m.item()), position + 2
        micro, accumulation = self.micro * self.m, self.accumulation // self.m
        self.record = {"asked": [self.micro, self.accumulation], "merged": self.m,
                       "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                       "from_update": self.start + 1, "estimate_bytes": int(resident + micro * per_block),
                       "tried": self.m == 1, "confirmed": self.m == 1}
        # Kept split as asked too: a resume measures nothing again (after it, the optimizer's state
        # sits in its base, another device has other room: it could choose another split)
        self.write(self.record)
        if self.m == 1:
            self.log(f"micro-batch: {self.micro} x {self.accumulation} kept as asked (update {position + 1}: "
                     f"{peak / GIB:.1f} GiB at its peak, {resident / GIB:.1f} after it; no larger micro-batch is "
                     f"estimated to fit in the {limit / GIB:.1f} allowed)")
            return
        self.log(f"micro-batch: {self.micro} x {self.accumulation} accumulation re-split to {micro} x {accumulation} "
                 f"from update {self.start + 1} (update {position + 1}: {peak / GIB:.1f} GiB at its peak, "
                 f"{resident / GIB:.1f} after it; estimated {self.record['estimate_bytes'] / GIB:.1f} of "
                 f"{limit / GIB:.1f} allowed; --micro_batch_fill 0 keeps the split as asked)")
