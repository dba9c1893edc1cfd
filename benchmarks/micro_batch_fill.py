"""Whether --micro_batch_fill pays: the same updates, asked for as micro M x accumulation K, trained
as asked and as the fit re-splits them (mmadapt/microbatch.py), timed interleaved in one process.

    python benchmarks/micro_batch_fill.py            # GPU: roberta-base, s 512, micro 32 x 8, bf16, one replica
    python benchmarks/micro_batch_fill.py --only bl_base:pretrain --accumulation 4
    python benchmarks/micro_batch_fill.py --assume_room --repeats 2   # a CPU: the script's own check

For each case (Step 1 BL_BASE, Step 2 BL_BASE and MINIJOINT by default) two engines are built
from the same seed, both before anything trains (so the fit reads the memory the timed rounds
share). The fitted one runs first through the fit exactly as a run's loop drives it (`before`,
the requested micro-batches `merged` by `factor`, `lm_step`, `after`): its first update is
measured, the fit chooses, and from its third update on it trains the new split. Then both
train the same blocks (--real: the packaged Bible's), update for update, round by round
(common.interleaved_times).
Reported per case: the split chosen, ms per update and the ratio, utilisation against a matmul
measured here (and a vendor's bf16 peak on a GPU), and the device's peak memory during each
engine's updates: both engines are resident then (the fit chose with both there), so each figure
holds the other engine's weights and state too, and the fitted one's includes its first updates.
On a CPU the fit reads no memory and keeps the split (both rows alike), unless
--assume_room says every merge fits: then the figures are a CPU's, not a GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import statistics

import torch
from common import (
    REPO,
    SHAPES,
    add_run_args,
    interleaved_times,
    mask_fraction,
    masked_batches,
    real_batches,
    round_ratios,
    run_ds_config,
    setup,
    table,
    vendor,
    write_results,
)
from flops_validation import cases
from throughput import matmul_peak

from mmadapt import microbatch
from mmadapt.flops import DEVICE_TFLOPS
from mmadapt.microbatch import MicroBatchFit, merged
from mmadapt.models import get_family
from mmadapt.parallel import device
from mmadapt.train import LMJob, host_batch, lm_engine, lm_step

DEFAULT_CASES = ("bl_base:pretrain", "bl_base:adapt", "minijoint:adapt")
ROOM = microbatch.Memory(allocated=lambda: 0, peak=lambda: 0, reset_peak=lambda: None, available=lambda: 1)


class Trainer:
    """One engine's updates on the same K micro-batches, through the fit as train_lm drives it."""

    def __init__(self, engine, micro_batches: list, fill: float, memory, heads: int):
        self.engine, self.raw, self.heads, self.position = engine, micro_batches, heads, itertools.count()
        self.fit = MicroBatchFit(engine, len(micro_batches[0][0]), len(micro_batches), fill, memory, 1)
        self.host, self.peak = {}, 0

    def __call__(self) -> None:
        position = next(self.position)
        self.fit.before(position)
        k = self.fit.factor(position)
        if k not in self.host:
            self.host[k] = [host_batch(ids, labels, torch.cuda.is_available()) for ids, labels in merged(self.raw, k)]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        lm_step(self.engine, self.host[k], self.heads)
        self.fit.after(position)
        if torch.cuda.is_available():
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())

    def split(self) -> str:
        return f"{self.engine.train_micro_batch_size_per_gpu()} x {self.engine.gradient_accumulation_steps()}"


def main(argv=None) -> None:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=8)
    ap.add_argument("--accumulation", type=int, default=8, help="micro-batches asked for per update (K)")
    ap.add_argument("--fill", type=float, default=0.8, help="the fitted engine's micro_batch_fill")
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / ("zero2_bf16.json" if gpu else "zero1.json")))
    ap.add_argument("--only", nargs="+", metavar="SYSTEM:STEP", default=list(DEFAULT_CASES), help="cases to run")
    ap.add_argument("--assume_room", action="store_true", help="the fit reads no memory and merges all K (a CPU run "
                    "of the script: its figures are not a GPU's)")
    ap.add_argument("--vendor", choices=sorted(DEVICE_TFLOPS), default=vendor(),
                    help="GPU vendor peak to compare with (default: this GPU's, by its name)")
    args = ap.parse_args(argv)
    base, train = setup(args)
    family = get_family(base)
    s, b, k = args.seq_length, args.micro_batch, args.accumulation
    train = dataclasses.replace(train, train_micro_batch_size_per_gpu=b, gradient_accumulation_steps=k)
    ds = run_ds_config(REPO / args.ds_config, train)
    dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32
    peak = matmul_peak(dtype, 8192 if gpu else 2048)
    micro_batches = (real_batches if args.real else masked_batches)(base, b, s, train.mask_prob, k)
    p = mask_fraction(micro_batches)
    memory = ROOM if args.assume_room else microbatch.device_memory(device())
    rows = []
    for system, step, cfg, trainable in cases(base):
        if f"{system}:{step}" not in args.only:
            continue
        job = LMJob(step=step, trainable=trainable, trainable_layers=2)
        heads = len(cfg.heads_after)
        # Both engines first: the fit then reads the memory the timed rounds will share.
        given = Trainer(lm_engine(family, cfg, train, ds, job)[0], micro_batches, 0.0, None, heads)
        fitted = Trainer(lm_engine(family, cfg, train, ds, job)[0], micro_batches, args.fill, memory, heads)
        for _ in range(3):  # measured, chosen, switched
            fitted()
        times = interleaved_times({"given": given, "fitted": fitted}, args.warmup, args.repeats)
        flops = k * b * family.step_flops(step, cfg, s, p, trainable_layers=2)
        for name, trainer in (("given", given), ("fitted", fitted)):
            t = statistics.median(times[name])
            row = {"system": system, "step": step, "run": name, "split": trainer.split(), "ms_per_update": 1e3 * t,
                   "utilisation": flops / t / peak, "times_s": times[name]}
            if gpu:
                row["vendor_utilisation"] = flops / t / (DEVICE_TFLOPS[args.vendor] * 1e12)
                row["peak_memory_gib"] = trainer.peak / 2**30
            rows.append(row)
        # round by round: the two took one update each per round, so a drift moves both alike
        ratio, (least, most) = round_ratios(times["fitted"], times["given"])
        rows[-1]["fitted_over_given"], rows[-1]["fitted_over_given_range"] = ratio, f"{least:.3f}-{most:.3f}"
        del fitted, given
        gc.collect()
    cols = [("system", "system"), ("step", "step"), ("run", "run"), ("split", "micro x accumulation"),
            ("ms_per_update", "ms/update"), ("utilisation", "of matmul peak"), ("fitted_over_given", "fitted / given"),
            ("fitted_over_given_range", "over the rounds")]
    if gpu:
        cols[-2:-2] = [("vendor_utilisation", f"of {args.vendor} bf16 peak"),
                       ("peak_memory_gib", "device peak GiB (both engines held)")]
    md = [f"# The micro-batch fit ({device()}, {str(dtype).split('.')[-1]}, h={base.hidden_size}, "
          f"V={base.vocab_size}, s={s}, asked for as micro {b} x {k}, fill {args.fill}"
          f"{', --assume_room: every merge taken to fit' if args.assume_room else ''}; "
          f"matmul peak measured here: {peak / 1e12:.4g} TFLOP/s)", "",
          "`python benchmarks/micro_batch_fill.py` (its docstring says how). Median of "
          f"{args.repeats} updates of each, interleaved round by round after {args.warmup} untimed; fitted / given is "
          "the median of the rounds' ratios, its range beside it (a difference inside that range is a tie).", "",
          table(rows, cols)]
    paths = write_results("micro_batch_fill", {
        "shape": {"hidden_size": base.hidden_size, "vocab_size": base.vocab_size, "seq_length": s},
        "asked": {"micro": b, "accumulation": k}, "fill": args.fill, "assume_room": args.assume_room,
        "real": args.real, "ds_config": args.ds_config, "matmul_peak_flops": peak, "rows": rows}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
