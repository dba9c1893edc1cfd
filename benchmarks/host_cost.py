"""The host-side cost of one training update, per step and system, measured on any machine.

    python benchmarks/host_cost.py                          # this checkout, both shapes
    python benchmarks/host_cost.py --repo /tmp/old-checkout --tag d974fb8 --json_only

For each Step-1, Step-1b and Step-2 update of every system (benchmarks/flops_validation.cases),
at the *structure* of roberta-base and of Qwen2-0.5B (their depth, heads, query groups, biases,
tied or untied output, clipping), under a ds_configs/ JSON as a run of one replica applies it
(engine.for_replicas), one eager update through mmadapt's own `train_step` is counted three ways:

- **operators launched**: every ATen operator the update dispatches (a TorchDispatchMode sees the
  forward, the backward and DeepSpeed's work alike), split into the forward, backward, optimizer
  step (DeepSpeed's `engine.step`) and the rest (the loss reduced over replicas), and counted
  without the views and metadata ops that launch nothing. On a GPU each of the others is (at
  least) one kernel launch: the host pays ~5-10 us to issue one, and the device runs it
  asynchronously only while the host keeps ahead. Of them, the **device reads**: ops whose
  result the host reads (`.item()`, `bool(tensor)`, `nonzero`), each a wait for every queued
  kernel on a GPU, after which the host's next launches find the device idle.
- **Python calls**: function calls the update makes into DeepSpeed and into mmadapt, and of
  them the gradient hooks fired, one per trainable tensor where there are any: ZeRO's
  `grad_handling_hook`, and from 2026-12-01 mmadapt's own at one replica under bf16
  (engine.bucketed_bf16_grads, Python only: it launches nothing until a bucket is complete).
- **host time**: the update's wall time at the same structure with every size shrunk to the
  smallest measured (`--width` 2 channels per head, the decoder's rotary pairs' least; vocabulary
  64; 8 tokens x 1 sequence), where the time barely depends on the sizes any more: halving the
  tokens from 16 x 1 changed it by 0.90-1.15x, against 1.8-3.0x from the sizes used before
  (`--sizes` times an update at several sizes alternately, in one process:
  benchmarks/results/host_cost_sizes_zero1_cpu2_20261130.md). What is left is the time the host
  needs to issue the update, whatever the device. Every host_cost file before
  host_cost_zero1_cpu2_20261130b used 8 channels per head, vocabulary 1,000 and 32 x 2 tokens:
  there BL_BASE's Step-2 update is still ~0.35 GFLOP, and on two CPU cores most of its "host
  time" was that math, not the host's own work.

- **launches, profiled**: the same update under torch.profiler, counted so that a compiled update
  (`--fusion compile`) counts too: a TorchDispatchMode switches the compiled regions off, so it
  can only count eager updates. Counted: every outermost ATen call (one no other ATen call made)
  that is a kernel other than a view or metadata or calls one (aten::linear counts, as its addmm;
  aten::dropout at p = 0, which calls nothing, does not), and every kernel TorchInductor
  generated (`*_fused_*`; its CPU kernels are named in the trace by
  torch._inductor.config.cpp.enable_kernel_profile). An eager `aten::linear` is one launch here
  (its addmm) as in the dispatch count; the two counts of an eager update are set side by side in
  the table. On a CPU Inductor fuses into C++ loops what a GPU fuses into Triton kernels, by the
  same scheduler: the count is the CPU's, a guide to a GPU's, not a measure of it.

- **launches, CUDA runtime** (on a GPU): the CUDA runtime's kernel launches and CUDA graph replays
  (`cudaGraphLaunch`) during the update, as the profiler records them on the host: what the device
  was given, whatever issued it. The one count that sees `--fusion cudagraphs`, where a layer's
  kernels replay inside one graph launch and no operator is dispatched for them; where both
  checkouts have it, the comparison with the one before uses it.

Why these predict the GPU's idle and element-wise time: the count and order of the operators do
not depend on the sizes (a launch is a launch: `--sizes` counts the same launches at every size),
and a GPU step can never take less wall time than the host needs to issue it. At
roberta-base's real widths an update is ~1.5 TFLOP of matmuls (~3 ms at 500 TFLOP/s of bf16)
against the host time measured here; every element-wise operator besides is one more pass over
an activation in device memory. Fewer operators per update is the one change that cuts both.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Operators that launch nothing on a device: views (is_view) and these.
NO_LAUNCH = {"detach", "alias", "empty", "empty_strided", "lift_fresh", "_unsafe_view", "set_", "resize_",
             "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
             # torch.optim's step inside record_function: a profiler range on the host, no kernel
             "_record_function_enter_new", "_record_function_exit"}
PHASES = ("forward", "backward", "step", "other")
# Operators whose result the host reads: a device synchronization each on a GPU.
READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal"}
# The CUDA runtime calls that put work on the device, as torch.profiler records them on the host
# (with ProfilerActivity.CUDA): a kernel launch each, or a CUDA graph's replay (one call, however
# many kernels the graph holds).
CUDA_LAUNCHES = re.compile(r"^cu(da)?LaunchKernel|^cuLaunchKernelEx|^cudaLaunchKernelExC|^cudaGraphLaunch")


def shapes(PRESETS, find_preset, width: int, vocab: int):
    """name -> (the preset's model with every width shrunk, its schedule): the same layers, heads,
    query groups, biases and output tying, `width` channels per head."""
    out = {}
    for name, (model, train) in (("roberta-base", PRESETS["roberta-base"]), ("qwen2-0.5b", find_preset("qwen2-0.5b")[1:])):
        h = width * model.num_attention_heads
        out[name] = (dataclasses.replace(model, hidden_size=h, ffn_hidden_size=4 * h, vocab_size=vocab,
                                         max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                                         kv_channels=None), train)
    return out


class Counter:
    """ATen operators by phase (a TorchDispatchMode) and Python calls by package (sys.setprofile)."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.phase = "other"
        self.ops = collections.Counter()
        self.launches = collections.Counter()
        self.names = collections.Counter()
        self.py = collections.Counter()
        self.reads = 0

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops[counter.phase] += 1
                name = func.__name__.split(".")[0]
                if not (func.is_view or name in NO_LAUNCH):
                    counter.launches[counter.phase] += 1
                    counter.names[name] += 1
                    counter.reads += name in READS
                return func(*args, **(kwargs or {}))

        self.mode = Spy()
        self.torch = torch

    def profile(self, frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if "/deepspeed/" in f:
            self.py["deepspeed"] += 1
            if frame.f_code.co_name == "grad_handling_hook":
                self.py["grad_hooks"] += 1
        elif "/mmadapt/" in f:
            self.py["mmadapt"] += 1
            if frame.f_code.co_name == "bf16_grad_arrived":  # engine.bucketed_bf16_grads' hook
                self.py["grad_hooks"] += 1
        self.py["all"] += 1


@contextlib.contextmanager
def phased(engine, in_phase):
    """The engine's forward, backward and step (PHASES' first three), each run inside
    `in_phase(name)` (a context manager) while the block lasts."""
    def wrap(name, fn):
        def inner(*a, **k):
            with in_phase(name):
                return fn(*a, **k)
        return inner
    saved = engine.forward, engine.backward, engine.step
    engine.forward, engine.backward, engine.step = (wrap(n, f) for n, f in zip(PHASES, saved))
    try:
        yield
    finally:
        engine.forward, engine.backward, engine.step = saved


def counting(counter):
    """phased's `in_phase` that tells the counter the phase."""
    @contextlib.contextmanager
    def in_phase(name):
        counter.phase = name
        try:
            yield
        finally:
            counter.phase = "other"
    return in_phase


@functools.cache
def view_like(name: str) -> bool:
    """An ATen operator that launches nothing: a view (the schema of every overload that returns
    tensors aliases its input: aten::slice's TorchScript overloads over lists and strings, slice.t
    and slice.str, are no views, and counted every slice and narrow, DeepSpeed's flattening views
    among them, as a launch) or metadata (NO_LAUNCH)."""
    import torch

    op = name.removeprefix("aten::")
    if op in NO_LAUNCH:
        return True
    packet = getattr(torch.ops.aten, op, None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    tensors = [o for o in overloads if any("Tensor" in str(r.type) for r in o._schema.returns)]
    return bool(tensors) and all(o.is_view for o in tensors)


@functools.cache
def composite(name: str) -> bool:
    """An ATen operator whose work is all in the operators it calls (every functional overload has a
    CompositeImplicitAutograd kernel: aten::linear, aten::dropout, which at p = 0 calls nothing)."""
    import torch

    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    key, found = torch._C.DispatchKey.CompositeImplicitAutograd, []
    for o in packet.overloads():
        if not o.endswith("out"):
            try:
                found.append(getattr(packet, o).has_kernel_for_dispatch_key(key))
            except RuntimeError:  # an overload the dispatcher does not hold (TorchScript's list ops)
                pass
    return bool(found) and all(found)


def profiled_launches(engine, update) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Launches by phase of one update under torch.profiler (the docstring's "launches, profiled"),
    by operator, and on a GPU the CUDA runtime's launches by phase (the docstring's "launches,
    CUDA runtime"; empty elsewhere)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    gpu = torch.cuda.is_available()
    with phased(engine, lambda name: record_function(f"phase::{name}")), \
            profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        update()
        if gpu:
            torch.cuda.synchronize()
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name.removeprefix("phase::"))
             for e in events if e.name.startswith("phase::")]
    is_aten = lambda e: e.name.startswith("aten::")

    def outermost(e):
        p = e.cpu_parent
        while p is not None and not is_aten(p):
            p = p.cpu_parent
        return p is None

    def does_work(e):  # itself a kernel that is not a view, or calling one
        return ((not view_like(e.name) and not composite(e.name))
                or any(does_work(c) for c in e.cpu_children if is_aten(c)))

    phase = lambda e: next((name for a, b, name in spans if a <= e.time_range.start <= b), "other")
    out, names, runtime = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if CUDA_LAUNCHES.match(e.name):
            runtime[phase(e)] += 1
        elif is_aten(e) and outermost(e) and does_work(e):
            out[phase(e)] += 1
            names[e.name] += 1
        elif "_fused_" in e.name and not is_aten(e):  # Inductor's (cpp_fused_*, triton_*_fused_*), not aten::_fused_*
            out[phase(e)] += 1
            names["inductor kernel"] += 1
    return out, names, runtime


def case_updates(args, width: int, vocab: int, seq_length: int, micro_batch: int):
    """For each shape and case asked for (--shapes, --cases), an engine of `args.repo`'s mmadapt
    built as a run builds it at these sizes -> yields (shape, system, step, cfg, engine, update),
    update() running one train_step on the next of four batches."""
    import torch

    repo = Path(args.repo).resolve()
    loaded = sys.modules.get("mmadapt")
    if loaded is None or Path(loaded.__file__).resolve().parent.parent != repo:  # that checkout's, imported once
        sys.path.insert(0, str(repo))
        for m in [m for m in sys.modules if m == "mmadapt" or m.startswith("mmadapt.")]:
            del sys.modules[m]
    from mmadapt.config import TrainConfig
    from mmadapt import engine as engine_module
    from mmadapt.engine import load_ds_config
    from mmadapt.models import PRESETS, find_preset, get_family
    from mmadapt.parallel import init_parallel
    from mmadapt.train import LMJob, lm_engine, train_step, host_batch

    sys.path.insert(0, str(HERE))
    from common import causal_batches, masked_batches
    from flops_validation import cases

    init_parallel(1, 1)
    gpu = torch.cuda.is_available()
    if args.fusion != "none":  # name Inductor's CPU kernels in the profiler's trace (before the first compile)
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
    s, b = seq_length, micro_batch
    for shape, (base, preset_train) in shapes(PRESETS, find_preset, width, vocab).items():
        if args.shapes and shape not in args.shapes:
            continue
        family = get_family(base)
        train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=b, train_iters=10**6, lr=1e-4,
                            lr_warmup_iters=1, gradient_clipping=preset_train.gradient_clipping,
                            adam_beta2=preset_train.adam_beta2)
        ds = load_ds_config(Path(args.repo) / "ds_configs" / ds_name(args), train)
        # What a run does with the JSON at one data-parallel replica (start_run), where the
        # checkout has that step (before 2026-11-27 the JSON went to DeepSpeed as it was).
        ds = getattr(engine_module, "for_replicas", lambda ds, dp: ds)(ds, 1)
        batches = (masked_batches(base, b, s, train.mask_prob, 4) if family.objective.masked
                   else causal_batches(base, b, s, 4))
        for system, step, cfg, trainable in cases(base):
            if args.cases and f"{system}-{step}" not in args.cases:
                continue
            # Always named: since 2026-11-29 a config's default ('auto') compiles on a GPU. A
            # checkout from before fusion existed has no such field and is measured eager.
            if any(f.name == "fusion" for f in dataclasses.fields(cfg)):
                cfg = dataclasses.replace(cfg, fusion=args.fusion)
            engine, _, _ = lm_engine(family, cfg, train, ds, LMJob(step=step, trainable=trainable, trainable_layers=2))
            hb = [host_batch(ids, labels, gpu) for ids, labels in batches]
            heads = len(cfg.heads_after)

            def update(engine=engine, hb=hb, heads=heads, k=iter(range(10**9))):
                train_step(engine, [hb[next(k) % len(hb)]], heads)
            yield shape, system, step, cfg, engine, update
            del engine, update


def timed(update, n: int) -> list[float]:
    """Wall seconds of each of n updates (on a GPU, until the device is done)."""
    import torch

    gpu, times = torch.cuda.is_available(), []
    for _ in range(n):
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        update()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def measure(args) -> list[dict]:
    import torch

    gpu = torch.cuda.is_available()
    rows = []
    for shape, system, step, cfg, engine, update in case_updates(args, *sizes_of(args)):
        for _ in range(args.warmup):
            update()
        profiled, profiled_names, runtime = profiled_launches(engine, update)
        counter = Counter()
        if args.fusion == "none":  # compiled regions do not run under a TorchDispatchMode
            with phased(engine, counting(counter)), counter.mode:
                update()
        # sys.setprofile sees this thread alone: on CUDA autograd runs backward, and the gradient
        # hooks with it, on a device thread of its own, which counted no hook on a GPU (the H200's
        # grad hooks 0 under ZeRO-2, whose hooks must fire): this update's backward runs here
        sys.setprofile(counter.profile)
        try:
            with torch.autograd.set_multithreading_enabled(False):
                update()
        finally:
            sys.setprofile(None)
        times = timed(update, args.repeats)
        row = {"shape": shape, "system": system, "step": step, "layers": cfg.num_layers,
               "sizes": sizes_of(args),  # main checks --against's
               "trainable_tensors": sum(p.requires_grad for p in engine.module.parameters()),
               "fusion": args.fusion,
               "profiled": sum(profiled.values()), **{f"profiled_{p}": profiled[p] for p in PHASES},
               **({"runtime": sum(runtime.values()), **{f"runtime_{p}": runtime[p] for p in PHASES}}
                  if gpu else {}),
               **({"ops": sum(counter.ops.values()), "launches": sum(counter.launches.values()),
                   "reads": counter.reads,
                   **{f"launches_{p}": counter.launches[p] for p in PHASES}} if args.fusion == "none" else {}),
               "py_deepspeed": counter.py["deepspeed"], "grad_hooks": counter.py["grad_hooks"],
               "py_mmadapt": counter.py["mmadapt"], "py_all": counter.py["all"],
               "host_ms": 1e3 * statistics.median(times), "host_ms_min": 1e3 * min(times),
               "host_ms_max": 1e3 * max(times), "top_ops": counter.names.most_common(12),
               "top_profiled": profiled_names.most_common(16)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("top_")}), flush=True)
        del engine, update  # before case_updates builds the next
    return rows


def size_sweep(args) -> list[dict]:
    """Host ms of each case at each of --sizes (width per head, vocabulary, sequence length,
    micro-batch), every engine built first and then timed in alternating rounds of five updates,
    so that the machine's drift falls on every size alike; with the profiled launch count at each
    size (the same at every size: what the sizes change is the math alone)."""
    sizes = [tuple(int(v) for v in size.split(",")) for size in args.sizes]
    built = []
    for size in sizes:
        for shape, system, step, cfg, engine, update in case_updates(args, *size):
            for _ in range(args.warmup):
                update()
            profiled, _, _ = profiled_launches(engine, update)
            built.append({"shape": shape, "system": system, "step": step, "layers": cfg.num_layers,
                          "width_per_head": size[0], "vocab": size[1], "seq_length": size[2], "micro_batch": size[3],
                          "profiled": sum(profiled.values()), "update": update, "times": []})
    for _ in range(max(1, args.repeats // 5)):
        for b in built:
            b["times"] += timed(b["update"], 5)
    rows = []
    for b in built:
        times = b.pop("times")
        del b["update"]
        rows.append({**b, "host_ms": 1e3 * statistics.median(times), "host_ms_min": 1e3 * min(times),
                     "host_ms_max": 1e3 * max(times)})
    key = lambda r: (r["shape"], r["system"], r["step"])
    floor = {key(r): r["host_ms"] for r in rows}  # the last size asked for (the smallest, as the help says)
    for r in rows:
        r["over_floor"] = r["host_ms"] / floor[key(r)]
    return rows


def sweep_results(args, tag: str) -> None:
    """size_sweep's rows as a results file (host_cost_sizes_<ds config>[_<fusion>])."""
    sys.path.insert(0, str(HERE))
    from common import table, write_results

    rows = size_sweep(args)
    settings = settings_of(args, sizes=args.sizes)
    md = [f"# Host time of one update against the sizes of its math ({tag}, {ds_name(args)}, {mode_of(args)})", "",
          f"Settings: `{json.dumps(settings)}`. `python benchmarks/host_cost.py --sizes ...`: each update at each "
          "size (width per head, vocabulary, sequence length, micro-batch; the structure of the shape "
          "otherwise), every engine built first, then timed in alternating rounds of five updates; host ms: "
          "the median, min-max in the JSON. Launches, profiled: as host_cost counts them (the same at every "
          "size). Over floor: host ms against the last size given.",
          "", table(rows, [("shape", "shape"), ("system", "system"), ("step", "step"), ("layers", "layers"),
                           ("width_per_head", "width/head"), ("vocab", "vocab"), ("seq_length", "s"),
                           ("micro_batch", "micro-batch"), ("profiled", "launches, profiled"),
                           ("host_ms", "host ms (median)"), ("over_floor", "over floor")])]
    if args.note:
        md += ["", args.note]
    paths = write_results(results_name(args, "_sizes"), {"settings": settings, "checkout": tag, "rows": rows},
                          "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


def sizes_of(args) -> list[int]:
    """The sizes an update is measured at: width per head, vocabulary, sequence length, micro-batch."""
    return [args.width, args.vocab, args.seq_length, args.micro_batch]


def settings_of(args, **sizes) -> dict:
    """A results file's settings: the DeepSpeed JSON, fusion, `sizes`, repeats, Python."""
    return {"ds_config": ds_name(args), "fusion": args.fusion, **sizes, "repeats": args.repeats,
            "python": platform.python_version()}


def mode_of(args) -> str:
    return "eager" if args.fusion == "none" else f"--fusion {args.fusion}"


def results_name(args, kind: str = "") -> str:
    """host_cost<kind>_<ds config>[_<fusion>]"""
    fusion = "" if args.fusion == "none" else f"_{args.fusion}"
    return f"host_cost{kind}_{ds_name(args).removesuffix('.json')}{fusion}"


def ds_name(args) -> str:
    import torch

    return args.ds_config or ("zero2_bf16.json" if torch.cuda.is_available() else "zero1.json")


def line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x -> (b, a)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sum((xi - mx) ** 2 for xi in x)
    return b, my - b * mx


def depth_fit(rows: list[dict]) -> list[dict]:
    """Per shape, launches (by phase) and host ms of the Step-2 rows as a + b x layers."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        step2 = [r for r in rows if r["shape"] == shape and r["step"] == "adapt"]
        if len({r["layers"] for r in step2}) < 2:
            continue
        x = [r["layers"] for r in step2]
        mini = min(step2, key=lambda r: r["layers"])
        counts = ("launches", "profiled", "runtime")
        keys = [(k, k) for k in counts] + [(f"{k}_{p}", f"{k}, {p}") for k in counts for p in PHASES] + [
            ("host_ms", "host ms")]
        for key, what in [(k, w) for k, w in keys if k in mini]:
            b, a = line(x, [r[key] for r in step2])
            out.append({"shape": shape, "depths": "/".join(str(d) for d in sorted(set(x))), "what": what,
                        "per_layer": b, "at_no_depth": a,
                        "share_at_mini": a / mini[key] if mini[key] else float("nan")})
    return out


def machine() -> str:
    """The machine the rows are measured on (its device, CPU and host name): a comparison with
    --against holds only on the same one. Not common.hardware: this script imports nothing of a
    checkout before it measures one (--repo)."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    return f"{device}, {os.cpu_count()} CPUs, {platform.node()}"


def git_rev(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(HERE.parent), help="the checkout whose mmadapt is measured (default: this one)")
    ap.add_argument("--tag", help="a name for this checkout in the results (default: its git revision)")
    ap.add_argument("--against", metavar="JSON", help="a --json_only output of another checkout, set beside this one")
    ap.add_argument("--json_only", metavar="PATH", help="write the rows as JSON to PATH, no results file")
    ap.add_argument("--shapes", nargs="+", choices=("roberta-base", "qwen2-0.5b"))
    ap.add_argument("--cases", nargs="+", metavar="SYSTEM-STEP", help="only these updates (bl_base-adapt, "
                    "minipost-minipost, ...; default: every one of flops_validation.cases)")
    ap.add_argument("--ds_config", help="one of ds_configs/ (default: zero2_bf16.json on a GPU, as gpu_suite.sh "
                    "runs; zero1.json, the commands' default, on a CPU)")
    ap.add_argument("--fusion", choices=("none", "compile", "cudagraphs"), default="none",
                    help="ModelConfig.fusion of every measured model (compiled: counted by the profiler only; "
                    "cudagraphs: a GPU's, where the CUDA runtime's count sees each graph replayed as one launch)")
    # The smallest sizes measured, where the host time barely depends on them (--sizes; module docstring).
    ap.add_argument("--width", type=int, default=2, help="channels per attention head (even: the decoder's rotary "
                    "embedding pairs them)")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq_length", type=int, default=8)
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--sizes", nargs="+", metavar="W,V,S,B", help="instead: host ms of each case at each of these "
                    "sizes (width per head, vocabulary, sequence length, micro-batch), timed alternately, against "
                    "the last one given; a results file host_cost_sizes_*")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--note", default="", help="a paragraph for the results file (how the figures were taken)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    tag = args.tag or git_rev(Path(args.repo))
    if args.sizes:
        if args.json_only or args.against:
            ap.error("--sizes writes its own results file: without --json_only and --against")
        sweep_results(args, tag)
        return
    sizes = sizes_of(args)
    before = json.loads(Path(args.against).read_text()) if args.against else []
    if before and before[0].get("sizes") != sizes:  # checked before minutes of measuring
        got = before[0].get("sizes")
        ap.error(f"--against {args.against} was measured at sizes {got}, this run would be at {sizes}: measure both "
                 "at the same --width/--vocab/--seq_length/--micro_batch" if got else
                 f"--against {args.against} has no sizes (an older host_cost's): measure that checkout again "
                 "with this script (--repo CHECKOUT --json_only X)")
    if before and before[0].get("machine", machine()) != machine():
        ap.error(f"--against {args.against} was measured on {before[0]['machine']}, this run is on {machine()}: "
                 "measure both checkouts on one machine (--repo CHECKOUT --json_only X here)")
    settings = settings_of(args, width_per_head=args.width, vocab=args.vocab, seq_length=args.seq_length,
                           micro_batch=args.micro_batch)
    # Another fusion is a comparison it may make (today's compiled or graphed update against an eager
    # checkout: gpu_quick.sh); another DeepSpeed config is not
    if before and before[0].get("ds_config") != settings["ds_config"]:
        ap.error(f"--against {args.against} was measured with {before[0].get('ds_config') or 'an unrecorded'} "
                 f"DeepSpeed config, this run with {settings['ds_config']}: measure that checkout again with this "
                 "one (--repo CHECKOUT --json_only X)")
    rows = measure(args)
    for r in rows:
        r.update(checkout=tag, ds_config=settings["ds_config"], fusion=args.fusion, machine=machine())
    if args.json_only:
        Path(args.json_only).write_text(json.dumps(rows, indent=1))
        return
    sys.path.insert(0, str(HERE))
    from common import hardware, table, write_results
    old = {(r["shape"], r["system"], r["step"]): r for r in before}
    for r in rows:
        o = old.get((r["shape"], r["system"], r["step"]))
        if o and "profiled" in o:
            r["profiled_over_before"] = r["profiled"] / o["profiled"]
            r["host_ms_over_before"] = r["host_ms"] / o["host_ms"]
            if "runtime" in r and "runtime" in o:
                r["runtime_over_before"] = r["runtime"] / o["runtime"]
    dispatch = [("launches", "launches"), ("launches_forward", "fwd"), ("launches_backward", "bwd"),
                ("launches_step", "opt step"), ("launches_other", "other"), ("reads", "device reads")]
    cols = [("shape", "shape"), ("system", "system"), ("step", "step"), ("layers", "layers"),
            ("trainable_tensors", "trained tensors")] + dispatch * (args.fusion == "none") + [
            ("profiled", "launches, profiled"), ("profiled_forward", "fwd"), ("profiled_backward", "bwd"),
            ("profiled_step", "opt step"), ("profiled_other", "other"),
            ("grad_hooks", "grad hooks"), ("py_deepspeed", "DeepSpeed calls"), ("host_ms", "host ms (median)")]
    runtime = all("runtime" in r for r in rows)
    if runtime:
        cols[-3:-3] = [("runtime", "launches, CUDA runtime"), ("runtime_forward", "fwd"),
                       ("runtime_backward", "bwd"), ("runtime_step", "opt step"), ("runtime_other", "other")]
    if old:
        cols += [("profiled_over_before", "profiled / before")] + [("runtime_over_before", "runtime / before")] * (
            runtime and all("runtime_over_before" in r for r in rows)) + [("host_ms_over_before", "host ms / before")]
    md = [f"# Host-side cost of one training update ({tag}, {ds_name(args)}, {mode_of(args)})", "",
          f"Settings: `{json.dumps(settings)}`. `python benchmarks/host_cost.py` (its docstring says what is "
          "counted and why). Launches: ATen operators that are not views or metadata, per update, as a "
          "TorchDispatchMode sees them (eager only); launches, profiled: the same under torch.profiler, with "
          "TorchInductor's kernels (eager and compiled); launches, CUDA runtime (on a GPU): the kernel launches "
          "and CUDA graph replays the device was given; host ms: "
          f"median of {args.repeats} updates at the sizes above (min-max in the JSON).", "",
          table(rows, cols), ""] + ([args.note, ""] if args.note else [])
    cpu_bf16 = "bf16" in ds_name(args) and "cpu" in hardware()  # host ms then times the math, not the host
    if cpu_bf16:
        md += ["On a CPU, bf16 matmuls and element-wise kernels are far slower than fp32 ones: here host "
               "ms includes that math and is no measure of the host's own cost; the launch counts hold.", ""]
    md += ["## The depth-independent part of a Step-2 update", "",
          "A least-squares line through the Step-2 rows of each shape (the same update at the depths "
          "listed): what one more frozen layer costs, and what the update costs at no depth at all "
          "(embedding gather and its gradient's scatter, the head and loss, the optimizer step, the "
          "loss reduction).", "", table(depth_fit(rows), [("shape", "shape"), ("depths", "depths"),
                                                         ("what", "per update"), ("per_layer", "per layer"),
                                                         ("at_no_depth", "at no depth"),
                                                         ("share_at_mini", "share of the shallowest's")])]
    if old:
        md += ["", "## Against the checkout before", ""]
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for step, label in (("pretrain", "Step 1"), ("adapt", "Step 2")):
                got = [r for r in rows if r["shape"] == shape and r["step"] == step and "profiled_over_before" in r]
                if got:
                    # On a GPU the runtime's count, the one that sees a CUDA graph's replay.
                    counted = all("runtime_over_before" in r for r in got)
                    key, what = (("runtime_over_before", "launches (CUDA runtime)") if counted
                                 else ("profiled_over_before", "launches"))
                    worst_l = max(r[key] for r in got)
                    worst_t = max(r["host_ms_over_before"] for r in got)
                    host = ("host time not judged here (CPU bf16: it times the math)" if cpu_bf16 else
                            f"host time {'met' if worst_t <= 0.5 else 'NOT met'}")
                    md.append(f"- {shape}, {label}: {what} at most {worst_l:.2f} of before, host time at most "
                              f"{worst_t:.2f} (half or less: launches {'met' if worst_l <= 0.5 else 'NOT met'}, "
                              f"{host}; one run against one run, not paired: host_cost_ab_* pairs them)")
    if before:
        where = ("on this machine (checked)" if "machine" in before[0] else
                 "on a machine it did not record (older rows: compare only if it was this one)")
        md += ["", f"Before: {before[0]['checkout']} (`--against`), measured by this script with the same sizes and "
               f"DeepSpeed config (checked), fusion {before[0].get('fusion')}, in a run of its own, {where}.", "",
               table(before, [c for c in cols if c[0] in before[0]])]
    paths = write_results(results_name(args), {"settings": settings, "checkout": tag, "rows": rows, "before": before},
                          "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
