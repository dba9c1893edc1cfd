"""Where the time of one training update goes: torch.profiler over a few updates of one case of
throughput.py (the same engine, batches and settings), kernels grouped into matrix products,
attention, the optimizer step, copies and communication, and the rest (element-wise, norms,
dropout, reductions); the top kernels by device time beside them.

    python benchmarks/profile_update.py --real --dropout --only bl_base:pretrain   # GPU: roberta-base, bf16

On a CPU it profiles the CPU operators instead (no kernel names: the groups are by operator).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch
from common import (REPO, add_run_args, add_zero_arg, engine_update, mask_fraction, masked_batches, median_time,
                    real_batches, run_ds_config, setup, sync, table, write_results)
from host_cost import CUDA_LAUNCHES
from flops_validation import cases

from mmadapt.engine import zero_stage
from mmadapt.models import get_family
from mmadapt.train import LMJob, lm_engine

# Kernel (or CPU operator) names -> group; the first match wins.
GROUPS = [
    ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|ampere_|matmul|addmm|\bmm\b|linear|bmm"),
    ("attention", r"flash|fmha|attention|efficient_attention|sdpa"),
    # the loss's log-softmax (and attention's softmax where attention is not a fused kernel)
    ("softmax", r"softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies and casts", r"copy|memcpy|memset|cast|to_copy|cat|index|gather|scatter|fill"),
    ("communication", r"nccl|allreduce|reduce_scatter|all_gather|gloo"),
]


def busy_union_us(events) -> float:
    """Microseconds in which at least one of the kernel `events` ran (their time ranges merged)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, start, end = 0.0, None, None
    for a, b in spans:
        if end is None or a > end:
            busy += 0.0 if end is None else end - start
            start, end = a, b
        else:
            end = max(end, b)
    return busy + (0.0 if end is None else end - start)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, pat in GROUPS if re.search(pat, low)), "element-wise, norms, dropout, reductions")


# CUDA runtime calls in which the host waits for the device: each one drains the queue, so the
# host work after it runs with the device idle until the next kernel is issued.
WAITS = re.compile(r"^cu(da)?(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy)$")


def host_side(prof, n: int) -> tuple[dict, list[str]]:
    """The host's side of the profiled updates on a GPU: CUDA runtime calls that wait for the
    device (count and host time per update), kernel launches issued, and the operators with the
    most host time of their own (self CPU time: their Python-free C++ dispatch, not their kernels)."""
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    waits: dict[str, list[float]] = {}
    launches = 0
    own: dict[str, float] = {}
    for e in cpu:
        if WAITS.match(e.name):
            w = waits.setdefault(e.name, [0, 0.0])
            w[0] += 1
            w[1] += e.cpu_time_total
        elif CUDA_LAUNCHES.match(e.name):
            launches += 1
        elif not e.name.startswith("cuda") and not getattr(e, "is_user_annotation", False):
            own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total
    rows = [{"call": k, "per_update": c / n, "host_ms_per_update": us / n / 1e3} for k, (c, us) in
            sorted(waits.items(), key=lambda kv: -kv[1][1])]
    top = [{"op": k[:90], "host_ms_per_update": us / n / 1e3} for k, us in
           sorted(own.items(), key=lambda kv: -kv[1])[:10]]
    md = ["", f"Host side: {launches / n:.0f} kernel launches per update; CUDA calls that wait for the device:", "",
          table(rows, [("call", "call"), ("per_update", "per update"), ("host_ms_per_update", "host ms/update")])
          if rows else "(none)", "", "Operators with the most host time of their own (self CPU, per update):", "",
          table(top, [("op", "operator"), ("host_ms_per_update", "host ms/update")])]
    return {"kernel_launches_per_update": launches / n, "waits": rows, "top_own_host": top}, md


def main(argv=None) -> None:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=16)
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / ("zero2_bf16.json" if gpu else "zero1.json")))
    add_zero_arg(ap)
    ap.add_argument("--attention_impl", default="sdpa", choices=("sdpa", "varlen", "math"))
    ap.add_argument("--fusion", default="none", choices=("none", "compile", "cudagraphs"))
    ap.add_argument("--only", default="bl_base:pretrain", metavar="SYSTEM:STEP", help="the case to profile")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    args = ap.parse_args(argv)
    base, train = setup(args)
    base = dataclasses.replace(base, attention_impl=args.attention_impl)  # fusion: setup's
    s, b = args.seq_length, args.micro_batch
    ds = run_ds_config(REPO / args.ds_config, train, args.zero_as_given)
    batches = (real_batches if args.real else masked_batches)(base, b, s, train.mask_prob, 4)
    p = mask_fraction(batches)
    system, step, cfg, trainable = next(c for c in cases(base) if f"{c[0]}:{c[1]}" == args.only)
    engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, LMJob(step=step, trainable=trainable, trainable_layers=2))
    update = engine_update(engine, batches, len(cfg.heads_after))
    wall, _ = median_time(update, args.warmup, args.repeats)  # unprofiled, as throughput.py times it
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.repeats):
            update()
        sync()
    # Device time per kernel on a GPU (events with a device type of CUDA); self CPU time of each
    # operator on a CPU. A range a library annotates (torch.optim's "Optimizer.step#AdamW.step")
    # shows on the GPU timeline as an event spanning the kernels inside it: counted, it put the
    # optimizer's time in twice, so annotations are left out and only kernels summed.
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA) == gpu
              and not getattr(e, "is_user_annotation", False)]
    key = (lambda e: e.device_time) if gpu else (lambda e: e.self_cpu_time_total)
    per_name: dict[str, float] = {}
    for e in events:
        per_name[e.name] = per_name.get(e.name, 0.0) + key(e)
    total = sum(per_name.values())  # microseconds over all profiled updates
    groups: dict[str, float] = {}
    for name, us in per_name.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    n = args.repeats
    group_rows = [{"group": g, "ms_per_update": us / n / 1e3, "share": us / total}
                  for g, us in sorted(groups.items(), key=lambda kv: -kv[1])]
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:args.top]
    top_rows = [{"kernel": name[:90], "group": group_of(name), "ms_per_update": us / n / 1e3, "share": us / total}
                for name, us in top]
    flops = b * get_family(cfg).step_flops(step, cfg, s, p, trainable_layers=2)
    busy_ms = total / n / 1e3
    # Kernels on overlapping streams (ZeRO's communication beside the math) count twice in the sum:
    # the device is busy for the union of their intervals, what its idle share is taken against
    union_ms = busy_union_us(events) / n / 1e3 if gpu else busy_ms
    host, host_md = host_side(prof, n) if gpu else ({}, [])
    md = [f"# One update of {system} {step}, profiled ({'cuda' if gpu else 'cpu'}, h={base.hidden_size}, s={s}, "
          f"batch {b}, attention {args.attention_impl}, fusion {args.fusion}, {args.ds_config.split('/')[-1]} "
          f"{'as given' if args.zero_as_given else 'at one replica as a run applies it'}: "
          f"ZeRO stage {zero_stage(ds)})", "",
          f"- {'device' if gpu else 'CPU operator'} time per update (kernels summed): {busy_ms:.2f} ms; exact FLOPs "
          f"{flops / 1e9:.1f} GFLOP, so {flops / (busy_ms / 1e3) / 1e12:.1f} TFLOP/s over the busy time",
          f"- wall time per update (median of {n}, unprofiled): {1e3 * wall:.2f} ms, {flops / wall / 1e12:.1f} TFLOP/s; "
          f"the device is busy {union_ms:.2f} ms of it (the union of the kernels' intervals: streams overlap) and "
          f"idles {max(0.0, 1 - union_ms / (1e3 * wall)):.0%} (launch gaps, host work, syncs)"
          if gpu else f"- wall time per update (median of {n}, unprofiled): {1e3 * wall:.2f} ms", "",
          table(group_rows, [("group", "group"), ("ms_per_update", "ms/update"), ("share", "share")]), "",
          table(top_rows, [("kernel", "kernel"), ("group", "group"), ("ms_per_update", "ms/update"),
                           ("share", "share")])] + host_md
    # eager SDPA keeps the plain name (the 2026-11-26 files); another setting is named in the file's
    name = f"profile_{system}_{step}" + ("" if args.attention_impl == "sdpa" else f"_{args.attention_impl}") + \
        ("" if args.fusion == "none" else f"_{args.fusion}") + ("_zero_as_given" if args.zero_as_given else "")
    paths = write_results(name, {"case": args.only, "seq_length": s, "micro_batch": b,
                                                       "attention_impl": args.attention_impl, "fusion": args.fusion,
                                                       "ds_config": args.ds_config, "zero_stage": zero_stage(ds),
                                                       "zero_as_given": args.zero_as_given,
                                                       "busy_ms_per_update": busy_ms,
                                                       "wall_ms_per_update": 1e3 * wall,
                                                       "exact_flops": flops, "groups": group_rows, "top": top_rows,
                                                       "host": host},
                          "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
