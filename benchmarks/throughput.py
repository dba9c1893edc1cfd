"""Measured speed of real DeepSpeed training updates, against a matmul peak measured in the same
run and against the analytic FLOP ratios.

    python benchmarks/throughput.py               # CPU: h=256, ~3 min on 2 cores
    python benchmarks/throughput.py --real --dropout     # real padded blocks, dropout on (as training)
    python benchmarks/throughput.py --shape roberta-base --ds_config ds_configs/zero2_bf16.json   # GPU
    python benchmarks/throughput.py --shape qwen2-0.5b --seq_length 2048 --micro_batch 4 \
        --only bl_base:pretrain minijoint:pretrain bl_base:adapt minijoint:adapt minipost:adapt   # the decoder

For each system and step (as in flops_validation.py) the median time of --repeats updates after
warm-up is taken (the Step-2 cases' engines are then kept and timed again in interleaved rounds,
which give the Step-2 time ratios); achieved FLOP/s uses the exact count (mmadapt/flops.py, checked against
FlopCounterMode by flops_validation.py). Utilisation is against the median speed of a large
matmul in the training dtype measured here (and, on a GPU, against the vendor's bf16 peak).
Targets (issue 5): Step-2 time ratio BL_BASE/MINIJOINT >= 0.9 x its exact FLOP ratio; achieved
FLOP/s of Step-1 and Step-2 updates >= 70% of the measured matmul peak on CPU at h >= 256.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch
from common import (
    REPO,
    SHAPES,
    add_run_args,
    add_zero_arg,
    causal_batches,
    engine_update,
    interleaved_times,
    mask_fraction,
    masked_batches,
    median_time,
    padding_fraction,
    real_batches,
    round_ratios,
    run_ds_config,
    setup,
    table,
    vendor,
    write_results,
)
from flops_validation import cases

from mmadapt.engine import zero_stage
from mmadapt.flops import DEVICE_TFLOPS
from mmadapt.parallel import device
from mmadapt.models import find_preset, get_family
from mmadapt.train import LMJob, lm_engine


def matmul_peak(dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Median FLOP/s of an n x n x n matmul on this device."""
    dev = device()
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    t, _ = median_time(lambda: a @ b, warmup=3, repeats=repeats)
    return 2 * n ** 3 / t


# The encoder shapes and a decoder's (its random blocks score every next piece; MINIJOINT's
# mini-model is the bottom third of its 24 layers).
THROUGHPUT_SHAPES = {**SHAPES, "qwen2-0.5b": find_preset("qwen2-0.5b")[1]}


def main(argv=None) -> None:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=16, shapes=THROUGHPUT_SHAPES)
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / ("zero2_bf16.json" if gpu else "zero1.json")))
    add_zero_arg(ap)
    ap.add_argument("--attention_impl", default="sdpa", choices=("sdpa", "varlen", "math"),
                    help="ModelConfig.attention_impl of every model")
    ap.add_argument("--fusion", default="none", choices=("none", "compile", "cudagraphs"),
                    help="ModelConfig.fusion of every model")
    ap.add_argument("--only", nargs="+", metavar="SYSTEM:STEP", help="run only these cases (e.g. bl_base:pretrain "
                    "minijoint:adapt); default: all seven")
    ap.add_argument("--vendor", choices=sorted(DEVICE_TFLOPS), default=vendor(),
                    help="GPU vendor peak to compare with (default: this GPU's, by its name)")
    args = ap.parse_args(argv)
    base, train = setup(args, THROUGHPUT_SHAPES)
    family = get_family(base)
    if args.real and not family.objective.masked:
        ap.error(f"--real reads the encoders' masked blocks; the {args.shape} decoder runs on random blocks: drop --real")
    base = dataclasses.replace(base, attention_impl=args.attention_impl)  # fusion: setup's
    s, b = args.seq_length, args.micro_batch
    ds = run_ds_config(REPO / args.ds_config, train, args.zero_as_given)
    dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float16 if ds.get("fp16", {}).get(
        "enabled") else torch.float32
    peak = matmul_peak(dtype, 8192 if gpu else 2048)
    batches = (causal_batches(base, b, s, 4) if not family.objective.masked else
               (real_batches if args.real else masked_batches)(base, b, s, train.mask_prob, 4))
    p, pad = mask_fraction(batches), padding_fraction(batches)
    rows, kept = [], {}  # kept: the Step-2 updates, timed again side by side below
    for system, step, cfg, trainable in cases(base):
        if args.only and f"{system}:{step}" not in args.only:
            continue
        held = torch.cuda.memory_allocated() if gpu else 0  # the kept Step-2 engines': not this case's
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        engine, _, _ = lm_engine(family, cfg, train, ds, LMJob(step=step, trainable=trainable, trainable_layers=2))
        update = engine_update(engine, batches, len(cfg.heads_after))
        t, times = median_time(update, args.warmup, args.repeats)
        flops = b * family.step_flops(step, cfg, s, p, trainable_layers=2)
        row = {"system": system, "step": step, "layers": cfg.num_layers, "ms_per_update": 1e3 * t,
               "tokens_per_s": b * s / t, "achieved_tflops": flops / t / 1e12, "utilisation": flops / t / peak,
               "exact_gflop": flops / 1e9, "times_s": times}
        if gpu:
            row["vendor_utilisation"] = flops / t / (DEVICE_TFLOPS[args.vendor] * 1e12)
            row["peak_memory_gib"] = (torch.cuda.max_memory_allocated() - held) / 2**30
        rows.append(row)
        if step == "adapt":
            kept[(system, step)] = update
        else:
            del engine, update
            gc.collect()  # the next case's model must not share the device with this one's
    # The Step-2 time ratios (the target's) from the kept engines timed in rounds of one update
    # each (common.interleaved_times), a ratio the median of the rounds' with their range: one case
    # timed after another's moved a ratio by up to a fifth on a shared machine. Step 1's ratios stay
    # the ratios of the cases' medians (their engines are too large to keep side by side).
    rounds = interleaved_times(kept, args.warmup, args.repeats) if len(kept) > 1 else {}
    by = {(r["system"], r["step"]): r for r in rows}
    pairs = [(("bl_base", "adapt"), ("minijoint", "adapt")), (("bl_base", "adapt"), ("minipost", "adapt")),
             (("minijoint", "pretrain"), ("bl_base", "pretrain")), (("bl_base", "pretrain"), ("bl_small", "pretrain"))]
    ratios = []
    for x, y in pairs:
        if x not in by or y not in by:
            continue
        paired = x in rounds and y in rounds
        measured, (least, most) = (round_ratios(rounds[x], rounds[y]) if paired else
                                   (by[x]["ms_per_update"] / by[y]["ms_per_update"], [None, None]))
        exact = by[x]["exact_gflop"] / by[y]["exact_gflop"]
        ratios.append({"pair": f"{x[0]} {x[1]} / {y[0]} {y[1]}", "measured_time_ratio": measured,
                       "timing": f"paired rounds ({least:.3f}-{most:.3f})" if paired else "case medians",
                       "exact_flop_ratio": exact, "measured_over_exact": measured / exact})
    del kept
    gc.collect()
    step2 = next((r["measured_over_exact"] for r in ratios if r["pair"] == "bl_base adapt / minijoint adapt"),
                 float("nan"))
    if not rows:
        ap.error(f"--only {' '.join(args.only)} names no case: name them as SYSTEM:STEP (bl_base:adapt, ...)")
    # a target whose cases --only left out is not measured: None, and no verdict printed
    step2 = None if step2 != step2 else step2
    min_util = min((r["utilisation"] for r in rows if r["step"] in ("pretrain", "adapt")), default=None)
    targets = {"step2_ratio_over_exact": step2, "step2_ratio_target_met": None if step2 is None else step2 >= 0.9,
               "min_utilisation_steps_1_and_2": min_util,
               "utilisation_target_met": None if min_util is None else min_util >= 0.7}
    cols = [("system", "system"), ("step", "step"), ("layers", "layers"), ("ms_per_update", "ms/update"),
            ("tokens_per_s", "tokens/s"), ("achieved_tflops", "achieved TFLOP/s"), ("utilisation", "of matmul peak")]
    if gpu:
        cols += [("vendor_utilisation", f"of {args.vendor} bf16 peak"), ("peak_memory_gib", "peak GiB")]
    data = (f"real Bible blocks, {pad:.1%} padding" if args.real else "random ids, no padding") + (
        f", dropout {'on' if args.dropout else 'off'}, attention {args.attention_impl}, fusion {args.fusion}, "
        f"ZeRO stage {zero_stage(ds)}"
        f"{' (the JSON as given)' if args.zero_as_given else ' (one replica, as a run applies it)'}")
    md = [f"# Training throughput ({device()}, {str(dtype).split('.')[-1]}, h={base.hidden_size}, V={base.vocab_size}, "
          f"s={s}, batch {b}, {data}; matmul peak measured here: {peak / 1e12:.4g} TFLOP/s)", "", table(rows, cols), "",
          table(ratios, [("pair", "pair"), ("measured_time_ratio", "measured time ratio"), ("timing", "timed as"),
                         ("exact_flop_ratio", "exact FLOP ratio"), ("measured_over_exact", "measured / exact")]), "",
          "Peak GiB: the most a case held above what was held before it (the Step-2 engines already built stay, "
          "to be timed side by side)." if gpu else "",
          f"- Step-2 BL_BASE/MINIJOINT measured ratio / exact FLOP ratio: {step2:.3f} (target >= 0.9: "
          f"{'met' if targets['step2_ratio_target_met'] else 'NOT met'})" if step2 is not None else
          "- Step-2 BL_BASE/MINIJOINT ratio: not measured (--only left out bl_base:adapt or minijoint:adapt)",
          f"- lowest utilisation of a Step-1/Step-2 update: {min_util:.1%} of the measured matmul peak (target >= 70%: "
          f"{'met' if targets['utilisation_target_met'] else 'NOT met'})" if min_util is not None else
          "- utilisation of a Step-1/Step-2 update: not measured (--only named neither step)"]
    name = "throughput" + ("" if args.shape in SHAPES else "_" + args.shape.replace(".", "_")) + \
        ("_real" if args.real else "") + ("_dropout" if args.dropout else "") + \
        ("" if args.attention_impl == "sdpa" else f"_{args.attention_impl}") + \
        ("" if args.fusion == "none" else f"_{args.fusion}") + \
        ("" if b == ap.get_default("micro_batch") else f"_mb{b}") + \
        ("_zero_as_given" if args.zero_as_given else "")  # a micro-batch or ZeRO sweep keeps each file
    paths = write_results(name, {"shape": {"hidden_size": base.hidden_size, "vocab_size": base.vocab_size,
                                           "seq_length": s, "micro_batch": b, "dtype": str(dtype)},
                                 "data": {"real": args.real, "padding_fraction": pad, "mask_fraction": p,
                                          "dropout": args.dropout}, "ds_config": args.ds_config,
                                 "attention_impl": args.attention_impl, "fusion": args.fusion,
                                 "zero_stage": zero_stage(ds), "zero_as_given": args.zero_as_given,
                                 "matmul_peak_flops": peak, "rows": rows, "ratios": ratios,
                                 "targets": targets}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
