"""What one training update moves through device memory outside its matmuls and attention, per
step and system at full size, counted on any machine: the work of a GPU's element-wise, norm,
dropout, copy, loss and optimizer kernels, which the FLOP count does not see.

    python benchmarks/device_traffic.py --real --dropout --compiled         # roberta-base, bf16, one replica
    python benchmarks/device_traffic.py --real --dropout --compiled --zero_as_given \\
        --profiles benchmarks/results/profile_*_h200_20261129.json          # beside measured profiles

Why: a Step-2 update of a mini-model saves FLOPs in proportion to depth, and on a GPU its wall
time follows only if the part of the update that does not depend on depth is small. That part is
mostly memory-bound (the embedding table's gradient and optimizer step, the vocabulary-wide loss):
its device time goes with bytes, not FLOPs. host_cost.py counts its launches; this counts its bytes.

How: one eager update through mmadapt's `train_step` (the engine, batches and DeepSpeed JSON of
throughput.py and profile_update.py) under a TorchDispatchMode that sees every ATen operator the
device would run, forward, backward and DeepSpeed's step alike. For each operator that is not a
view (nothing moves), a matrix product or attention (their device time goes with FLOPs: exact
FLOPs are flops.py's), it adds the bytes of the tensors it reads and of those it writes, as its
schema says: an argument marked written (`Tensor(a!)`) is written, one it only overwrites (the
destination of `copy_`, `zero_`, `fill_`, a random fill, an `out=`) is not read, a broadcast
input is read once (its storage, not its expanded size), a lookup or gather reads the rows it
returns, and `index_put_` the positions it writes. Collectives are the interconnect's, not
counted. This is the least traffic each kernel can have: a kernel that makes two passes (a
vocabulary-wide softmax) or rereads a tile moves more, and kernels of a few KiB cost their launch
latency instead (host_cost.py counts those).

The sizes: the update is counted at two micro-batches (`--micro_batches`, default 2 and 4
sequences of `--seq_length`) and every operator's bytes are extended linearly to `--at` (default
32: the GPU benchmarks' micro-batch). At a fixed sequence length every operator's bytes are
a + b x micro-batch (the optimizer's do not grow, the activations' grow in proportion); the
masked positions of an MLM batch are drawn, so the head's and loss's bytes carry that draw's noise.

`--compiled` counts each update under `--fusion compile` as well (the default on a GPU): the
eager operators outside the family's compiled kinds (the optimizer step, the embeddings; the
dispatch count tells apart what runs inside a compiled kind, in its forward or in the backward of
what that forward made) plus, each time a compiled graph runs, the bytes its Inductor kernels read
and write as Inductor's scheduler counts them (the same rule: each buffer once, at least; its
matrix products and attention left out). Inductor compiles here for the CPU, whose C++ kernels
are fused by the same scheduler as a GPU's Triton ones: a guide to a GPU's traffic, not a
measure of it. Two approximations: Inductor counts a buffer a kernel both reads and writes once
(the dispatch count, twice); and where two gradients of one tensor meet, autograd adds them under
whichever arrives second, so an add for a tensor used both inside and outside a compiled kind
(MINIJOINT's hidden state feeding a head and the next layer) may count as the compiled kind's,
~75 MB per such point at micro-batch 32.

`--profiles` sets the counted bytes beside device profiles of the same cases (profile_update.py's
JSON, same micro-batch and sequence length; a compiled profile beside the compiled count): there
the memory-bound device time is the busy time less the matrix products and the flash-attention
kernels (the group "attention" holds the loss's softmax too), and bytes / time is the bandwidth
those kernels reached. The closer one bandwidth fits every case, the better bytes predict that
device time; the results file shows how close it is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmadapt.models.layers import gpu_paths

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from host_cost import NO_LAUNCH, PHASES, counting, line, phased  # noqa: E402  (stdlib alone at its import)

# Allocations: nothing moves (host_cost's NO_LAUNCH and these).
ALLOCATE = NO_LAUNCH | {"empty_like", "new_empty", "new_empty_strided"}
# Device time goes with FLOPs for these, not bytes.
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot"}
ATTENTION = re.compile(r"^_?(scaled_dot_product|flash_attention|efficient_attention|_cudnn_attention)")
# Collectives: the interconnect's time, not device memory's (and nothing at one replica).
COMMUNICATION = re.compile(r"^_?(allreduce|allgather|all_gather|reduce_scatter|broadcast|all_to_all|send|recv)")
# Operators whose first argument is only written (its old values are never read).
OVERWRITES = {"copy_", "zero_", "fill_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
              "_foreach_zero_", "_foreach_copy_"}
# Arguments read in part, as many bytes as the operator writes: a lookup or gather reads the rows
# it returns, not the whole table; index_put_ reads and writes the positions its values go to.
READS_AS_MANY_AS_WRITTEN = {("embedding", "weight"), ("index_select", "self"), ("gather", "self"),
                            ("take_along_dim", "self")}
WRITES_AS_MANY_AS = {("index_put_", "self"): "values", ("index_put", "self"): "values"}
# Arguments a schema marks written that the kernel leaves alone in this use: the fused Adam(W)
# steps mark their gradients mutable (they unscale them only when given a grad_scale).
UNWRITTEN = {("_fused_adamw_", "grads"), ("_fused_adam_", "grads")}
# Arguments read in part: nll_loss gathers one log-probability per row of its [m, V] input (m
# values, not m x V), and its backward zero-fills the [m, V] gradient and scatters into it, never
# reading the log-probabilities it is given.
UNREAD = {("nll_loss_forward", "self"), ("nll_loss_backward", "self"), ("nll_loss2d_forward", "self"),
          ("nll_loss2d_backward", "self")}


def touched(t: torch.Tensor) -> int:
    """Bytes a kernel moves to read or write all of `t` once: its elements, or its storage where
    the view repeats elements (a broadcast, stride 0)."""
    n = t.numel()
    if n == 0:
        return 0
    held = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.element_size() * min(n, max(held, 1))


def category(name: str) -> str:
    return ("matmul" if name in MATMUL else "attention" if ATTENTION.match(name) else
            "communication" if COMMUNICATION.match(name) else "memory")


class Traffic:
    """Bytes read and written by every ATen operator an update dispatches, by phase and operator
    (key: phase, category, operator). A memory-bound operator that runs inside an instance of
    `kinds` (the family's compiled_kinds), in its forward or in the backward of what its forward
    made, is of the category "memory, compiled kinds": what --fusion compile hands to Inductor."""

    def __init__(self):
        traffic = self
        self.phase = "other"
        self.bytes = collections.Counter()
        self.calls = collections.Counter()
        self.inside = 0  # depth of compiled-kind forwards running
        self.ranges: list[tuple[int, int]] = []  # autograd sequence numbers of the nodes they made (open)
        self.paused = False

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                name = func.__name__.split(".")[0]
                if not (traffic.paused or func.is_view or name in ALLOCATE):
                    cat = category(name)
                    if cat == "memory" and traffic.in_compiled_kind():
                        cat = "memory, compiled kinds"
                    key = (traffic.phase, cat, name)
                    traffic.calls[key] += 1
                    traffic.bytes[key] += moved(func, name, args, kwargs, out)
                return out

        self.mode = Spy()

    def in_compiled_kind(self) -> bool:
        if self.inside:
            return True
        node = torch._C._current_autograd_node()  # the backward node running, if any
        if node is None:
            return False
        seq = node._sequence_nr()
        return any(a < seq < b for a, b in self.ranges)

    def sequence_now(self) -> int:
        """The autograd sequence number of a node made now (the next node's is one more)."""
        self.paused = True
        try:
            with torch.enable_grad():
                return torch.zeros((), requires_grad=True).mul(1).grad_fn._sequence_nr()
        finally:
            self.paused = False

    @contextlib.contextmanager
    def watching(self, model: torch.nn.Module, kinds: tuple[type, ...]):
        """Within it, the forwards of `model`'s instances of `kinds` (and the backward nodes they
        make) are told apart."""
        starts = []

        def enter(module, args):
            starts.append(self.sequence_now())
            self.inside += 1

        def leave(module, args, out):
            self.inside -= 1
            self.ranges.append((starts.pop(), self.sequence_now()))
        handles = [h for m in model.modules() if isinstance(m, kinds)
                   for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def moved(func, name: str, args, kwargs, out) -> int:
    """Bytes an operator reads and writes (the module docstring's rules)."""
    read, written, partial = {}, {}, []
    key = lambda t: (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
    values = {}
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        values[a.name] = value
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        writes = a.alias_info is not None and a.alias_info.is_write and (name, a.name) not in UNWRITTEN
        # out= arguments are keyword-only and marked written (out, values, indices, ...)
        only_written = writes and (a.kwarg_only or (i == 0 and name in OVERWRITES))
        for t in tensors:
            if (name, a.name) in READS_AS_MANY_AS_WRITTEN:
                partial.append(t)
            elif (name, a.name) in WRITES_AS_MANY_AS:
                continue  # below, once the values are known
            elif not only_written and (name, a.name) not in UNREAD:
                read[key(t)] = touched(t)
            if writes:
                written[key(t)] = touched(t)
    for (op, arg), other in WRITES_AS_MANY_AS.items():
        if op == name and isinstance(values.get(other), torch.Tensor):
            n = touched(values[other])
            written[("positions", arg)] = n
            if values.get("accumulate"):
                read[("positions", arg)] = n
    fresh = [r.alias_info is None for r in func._schema.returns]
    results = out if isinstance(out, (tuple, list)) and len(fresh) > 1 else (out,)
    for is_fresh, r in zip(fresh, results):
        if is_fresh:
            for t in tree_leaves(r):
                if isinstance(t, torch.Tensor):
                    written[key(t)] = touched(t)
    for t in partial:
        read[key(t)] = min(touched(t), sum(written.values()))
    return sum(read.values()) + sum(written.values())


@contextlib.contextmanager
def gpu_kernels():
    """The model's dropout and attention dispatched as on a GPU: inside layers.gpu_paths, and
    F.dropout as CUDA's dropout runs it (one native_dropout writing the output and a bool mask;
    a CPU's draws a mask in the input's dtype with bernoulli_, then scales and multiplies), and
    SDPA without its dropout (a CPU has no fused kernel with dropout and falls back to matmuls
    and a softmax; a GPU's flash kernel draws it inside, and its traffic is attention's)."""
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def native(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, True)[0] if training and p > 0 else x

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, **kwargs):
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=0.0, **kwargs)

    F.dropout, F.scaled_dot_product_attention = native, flash
    try:
        with gpu_paths():
            yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


def count(engine, update, kinds: tuple[type, ...] = ()) -> Traffic:
    """One eager update's traffic, after one uncounted update (the optimizer's state exists from
    then on), with the work inside instances of `kinds` told apart (Traffic)."""
    with gpu_kernels():
        update()
        traffic = Traffic()
        with phased(engine, counting(traffic)), traffic.watching(engine.module, kinds), traffic.mode:
            update()
    return traffic


def flop_bound(node) -> bool:
    """An Inductor scheduler node that calls a matrix product or attention (extern kernels)."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    if not isinstance(node, ExternKernelSchedulerNode):
        return False
    op = getattr(node.node, "op_overload", None)  # an ATen fallback's operator, or None
    name = (op.__name__.split(".")[0] if op is not None  # aten._scaled_dot_product_flash_attention_for_cpu
            else str(getattr(node.node, "python_kernel_name", "")).rsplit(".", 1)[-1])  # extern_kernels.mm
    return category(name) in ("matmul", "attention")  # the eager count's classes


# The Traffic that compiled graphs count into (inductor_bytes): a graph compiled for one engine
# runs again, from dynamo's cache, in the next engine's updates, and counts into that one's.
_COUNTING: list[Traffic | None] = [None]
_REAL_COMPILE_TO_MODULE: list = []


def _counted_compile_to_module(self):
    """GraphLowering.compile_to_module, whose module's `call` adds the graph's bytes (inductor_bytes)."""
    module = _REAL_COMPILE_TO_MODULE[0](self)
    nbytes = sum(n.get_read_write_buffers_sizes() for n in self.scheduler.nodes if not flop_bound(n))
    call = module.call

    def counted(*args, **kwargs):
        traffic = _COUNTING[0]
        if traffic is not None:
            key = (traffic.phase, "inductor", "compiled graphs")
            traffic.bytes[key] += nbytes
            traffic.calls[key] += 1
        return call(*args, **kwargs)
    module.call = counted
    return module


@contextlib.contextmanager
def inductor_bytes():
    """Within it, every graph TorchInductor compiles counts, each time it runs while a Traffic is
    in _COUNTING (in this process, from then on), the bytes its kernels read and write, as its
    scheduler counts them (the rule `moved` follows: each buffer a fused kernel reads or writes,
    once, at least; matrix products and attention left out), under (phase, "inductor",
    "compiled graphs"). Inductor's caches are off, so that every graph is compiled here."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as graph_module

    if not _REAL_COMPILE_TO_MODULE:
        _REAL_COMPILE_TO_MODULE.append(graph_module.GraphLowering.compile_to_module)
    graph_module.GraphLowering.compile_to_module = _counted_compile_to_module
    saved = inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache
    inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = False, False
    try:
        yield
    finally:
        graph_module.GraphLowering.compile_to_module = _REAL_COMPILE_TO_MODULE[0]
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = saved


def count_compiled(engine, update, warmup: int = 3) -> Traffic:
    """The bytes of one compiled update's Inductor kernels (inductor_bytes), after `warmup`
    updates. Every graph is compiled for the shapes it runs at (no automatic dynamic shapes, as
    fusion.py's runs have them): a graph with symbolic sizes would count its bytes at the sizes it
    was compiled for, whatever it runs at."""
    import torch._dynamo.config as dynamo_config

    traffic = Traffic()
    saved = dynamo_config.automatic_dynamic_shapes
    dynamo_config.automatic_dynamic_shapes = False
    try:
        with gpu_kernels(), inductor_bytes():
            for _ in range(warmup):
                update()
            _COUNTING[0] = traffic
            with phased(engine, counting(traffic)):
                update()
    finally:
        _COUNTING[0] = None
        dynamo_config.automatic_dynamic_shapes = saved
    return traffic


def extended(small: Traffic, large: Traffic, b_small: int, b_large: int, at: int) -> dict:
    """(phase, category, op) -> bytes at micro-batch `at`, linear in the micro-batch through the two
    counts, which must have run the same operators (a batch with padding and one without do not)."""
    keys = set(small.bytes) | set(large.bytes)
    if set(small.bytes) != set(large.bytes):
        odd = sorted(set(small.bytes) ^ set(large.bytes))
        raise ValueError(f"the updates at micro-batches {b_small} and {b_large} ran different operators "
                         f"({odd[:3]}): count batches that take the same path")
    slope = {k: (large.bytes[k] - small.bytes[k]) / (b_large - b_small) for k in keys}
    return {k: large.bytes[k] + slope[k] * (at - b_large) for k in keys}


def summary(bytes_at: dict, calls: collections.Counter) -> dict:
    """A case's row: memory-bound GB in all and by phase, operator counts by category, and GB and
    calls by "phase: operator" (memory-bound ones, and the compiled graphs where counted). With a
    compiled count: its estimate, the eager operators outside the compiled kinds plus Inductor's
    kernels, and the eager GB it stands in for."""
    gb = lambda pred: sum(v for k, v in bytes_at.items() if pred(k)) / 1e9
    memory = lambda k: k[1].startswith("memory")
    row = {"memory_gb": gb(memory),
           **{f"memory_gb_{p}": gb(lambda k, p=p: memory(k) and k[0] == p) for p in PHASES},
           "memory_ops": sum(c for k, c in calls.items() if memory(k)),
           "matmul_ops": sum(c for k, c in calls.items() if k[1] == "matmul"),
           "attention_ops": sum(c for k, c in calls.items() if k[1] == "attention")}
    if any(k[1] == "inductor" for k in bytes_at):
        row["compiled_kinds_gb"] = gb(lambda k: k[1] == "memory, compiled kinds")
        row["inductor_gb"] = gb(lambda k: k[1] == "inductor")
        row["compiled_gb"] = gb(lambda k: k[1] in ("memory", "inductor"))
        row["compiled_graph_calls"] = sum(c for k, c in calls.items() if k[1] == "inductor")
    row["by_op"] = by_operator(bytes_at, calls, memory)
    if "compiled_gb" in row:
        row["compiled_by_op"] = by_operator(bytes_at, calls, lambda k: k[1] in ("memory", "inductor"))
    return row


def by_operator(bytes_at: dict, calls: collections.Counter, keep) -> dict:
    """{"phase: operator": [GB, calls]} over the keys `keep` takes, largest first."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for key, v in bytes_at.items():
        if keep(key):
            phase, _, op = key
            out[f"{phase}: {op}"][0] += v / 1e9
            out[f"{phase}: {op}"][1] += calls[key]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def depth_fit(rows: list[dict], key: str) -> dict | None:
    """The Step-2 rows that have `key`, as a + b x layers -> {per_layer, at_no_depth}."""
    step2 = [r for r in rows if r["step"] == "adapt" and key in r]
    if len({r["layers"] for r in step2}) < 2:
        return None
    b, a = line([r["layers"] for r in step2], [r[key] for r in step2])
    return {"per_layer": b, "at_no_depth": a}


def fixed_by_op(rows: list[dict], key: str = "by_op") -> list[dict]:
    """Each operator's GB in the Step-2 rows' `key` (by_op: eager; compiled_by_op) as a + b x
    layers: the depth-independent part of a Step-2 update by operator (a), largest first."""
    step2 = [r for r in rows if r["step"] == "adapt"]
    if len({r["layers"] for r in step2}) < 2:
        return []
    out = []
    for op in dict.fromkeys(k for r in step2 for k in r[key]):
        b, a = line([r["layers"] for r in step2], [r[key].get(op, [0.0])[0] for r in step2])
        calls = [r[key].get(op, [0, 0])[1] for r in step2]
        out.append({"op": op, "at_no_depth": a, "per_layer": b, "calls": "-".join(map(str, sorted(set(calls))))})
    return sorted(out, key=lambda r: -r["at_no_depth"])


def measured_memory_ms(profile: dict) -> float:
    """A profile_update.py JSON's device ms per update outside the matrix products and the flash
    attention kernels (busy less the group 'matmul' less every listed kernel named flash/fmha)."""
    matmul = sum(g["ms_per_update"] for g in profile["groups"] if g["group"] == "matmul")
    flash = sum(t["ms_per_update"] for t in profile["top"] if re.search(r"flash|fmha", t["kernel"].lower()))
    return profile["busy_ms_per_update"] - matmul - flash


def main(argv=None) -> None:
    from common import (REPO, add_run_args, add_zero_arg, engine_update, masked_batches, real_batches, run_ds_config,
                        setup, table, write_results)
    from flops_validation import cases

    from mmadapt.models import get_family
    from mmadapt.train import LMJob, lm_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=2)
    ap.set_defaults(shape="roberta-base", seq_length=512)
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / "zero2_bf16.json"))
    add_zero_arg(ap)
    ap.add_argument("--micro_batches", default="2,4", help="the two micro-batches counted (sequences)")
    ap.add_argument("--at", type=int, default=32, help="the micro-batch the bytes are extended to")
    ap.add_argument("--only", nargs="+", metavar="SYSTEM:STEP", help="these cases (default: every one)")
    ap.add_argument("--profiles", nargs="*", default=[], help="profile_update.py JSONs of the same cases, set beside")
    ap.add_argument("--compiled", action="store_true", help="also count each update under --fusion compile: the "
                    "eager operators outside the compiled kinds and Inductor's kernels (its scheduler's bytes)")
    ap.add_argument("--note", default="")
    ap.add_argument("--row_json", help=argparse.SUPPRESS)  # a child's: count the one --only case, write its row here
    args = ap.parse_args(argv)
    b_small, b_large = (int(v) for v in args.micro_batches.split(","))
    base, train = setup(args)
    s = args.seq_length
    profiles = {}
    for path in args.profiles:
        p = json.loads(Path(path).read_text())
        if (p["micro_batch"], p["seq_length"]) != (args.at, s):
            ap.error(f"{path} profiled micro-batch {p['micro_batch']} x {p['seq_length']} tokens, not --at {args.at} "
                     f"x --seq_length {s}: give profiles of the size the bytes are extended to")
        profiles[(p["case"], p.get("fusion", "none"))] = p
        if p.get("fusion", "none") != "none" and not args.compiled:
            ap.error(f"{path} profiled a compiled update: count one too (--compiled)")
    if args.row_json:  # a child process: one case, its row to the parent
        ds_by_b = {}
        for b in (b_small, b_large):
            t = dataclasses.replace(train, train_micro_batch_size_per_gpu=b)
            ds_by_b[b] = (t, run_ds_config(Path(args.ds_config), t, args.zero_as_given))
        system, step, cfg, trainable = next(c for c in cases(base) if f"{c[0]}:{c[1]}" == args.only[0])
        counts = {}
        for b, (t, ds) in ds_by_b.items():
            batches = (real_batches if args.real else masked_batches)(base, b, s, t.mask_prob, 2)
            family, job = get_family(cfg), LMJob(step=step, trainable=trainable, trainable_layers=2)
            engine, _, _ = lm_engine(family, cfg, t, ds, job)
            counts[b] = count(engine, engine_update(engine, batches, len(cfg.heads_after)), family.compiled_kinds)
            del engine
            if args.compiled:
                engine, _, _ = lm_engine(family, dataclasses.replace(cfg, fusion="compile"), t, ds, job)
                fused = count_compiled(engine, engine_update(engine, batches, len(cfg.heads_after)))
                counts[b].bytes.update(fused.bytes)
                counts[b].calls.update(fused.calls)
                del engine
        bytes_at = extended(counts[b_small], counts[b_large], b_small, b_large, args.at)
        row = {"system": system, "step": step, "layers": cfg.num_layers, **summary(bytes_at, counts[b_large].calls)}
        Path(args.row_json).write_text(json.dumps(row))
        return
    # Each case in a process of its own: engines at full size, and the compiled graphs that keep
    # them alive, are several GiB each, and a process that built them all would not fit 24 GiB.
    child = [sys.executable, __file__, "--shape", args.shape, "--seq_length", str(s), "--ds_config", args.ds_config,
             "--micro_batches", args.micro_batches, "--at", str(args.at)] + [
        flag for flag, on in (("--real", args.real), ("--dropout", args.dropout), ("--compiled", args.compiled),
                              ("--zero_as_given", args.zero_as_given)) if on]
    rows = []
    for system, step, cfg, trainable in cases(base):
        case = f"{system}:{step}"
        if args.only and case not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            subprocess.run(child + ["--only", case, "--row_json", str(out)], check=True)
            row = json.loads(out.read_text())
        prof = profiles.get((case, "none"))
        if prof:
            row["measured_memory_ms"] = measured_memory_ms(prof)
            row["implied_tb_s"] = row["memory_gb"] / row["measured_memory_ms"]
        prof = profiles.get((case, "compile"))
        if prof:
            row["measured_compiled_memory_ms"] = measured_memory_ms(prof)
            row["compiled_implied_tb_s"] = row["compiled_gb"] / row["measured_compiled_memory_ms"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "by_op"}), flush=True)
    cols = [("system", "system"), ("step", "step"), ("layers", "layers"), ("memory_gb", "memory-bound GB"),
            ("memory_gb_forward", "fwd"), ("memory_gb_backward", "bwd"), ("memory_gb_step", "opt step"),
            ("memory_gb_other", "other"), ("memory_ops", "memory-bound ops"), ("matmul_ops", "matmuls"),
            ("attention_ops", "attention ops")]
    if profiles:
        cols += [("measured_memory_ms", "measured memory-bound ms"), ("implied_tb_s", "GB/ms = TB/s")]
    if args.compiled:
        cols += [("compiled_kinds_gb", "of it in compiled kinds"), ("inductor_gb", "Inductor's kernels GB"),
                 ("compiled_gb", "compiled: GB"), ("compiled_graph_calls", "compiled graph calls")]
        if any("measured_compiled_memory_ms" in r for r in rows):
            cols += [("measured_compiled_memory_ms", "measured compiled memory-bound ms"),
                     ("compiled_implied_tb_s", "GB/ms = TB/s")]
    how = (f"{Path(args.ds_config).name} {'as given' if args.zero_as_given else 'at one replica as a run applies it'}, "
           f"{base.hidden_size} wide, {'real Bible blocks' if args.real else 'random ids'}, "
           f"dropout {'on' if args.dropout else 'off'}, counted at micro-batches {b_small} and {b_large} x {s}, "
           f"extended to {args.at}")
    md = [f"# Bytes one update moves outside its matmuls and attention ({args.shape}, {how})", "",
          "`python benchmarks/device_traffic.py` (its docstring says what is counted): per update, the bytes "
          "read and written by every operator that is not a view, a matrix product or attention, by phase; "
          "the operator counts beside them.", "", table(rows, cols)]
    fits = [{"what": what, **fit} for what, key in (("memory-bound GB", "memory_gb"),
                                                    ("compiled: memory-bound GB", "compiled_gb"),
                                                    ("measured memory-bound ms", "measured_memory_ms"))
            if (fit := depth_fit(rows, key))]
    if fits:
        fixed = fixed_by_op(rows)
        by_op_cols = [("op", "phase: operator"), ("at_no_depth", "GB at no depth"), ("per_layer", "GB per layer"),
                      ("calls", "calls")]
        md += ["", "## The depth-independent part of a Step-2 update", "",
               "A least-squares line through the Step-2 rows (the same update at 4, 6 and 12 layers): "
               "per layer and at no depth.", "",
               table(fits, [("what", "per update"), ("per_layer", "per layer"), ("at_no_depth", "at no depth")]),
               "", "By operator, eager, the same line through each one's GB (the largest at no depth; calls: "
               "per update, at the depths counted):", "",
               table(fixed[:16], by_op_cols)]
        if all("compiled_by_op" in r for r in rows if r["step"] == "adapt"):
            md += ["", "Compiled (`--fusion compile`): the eager operators outside the compiled kinds and the "
                   "compiled graphs (the layers' and the MLM heads'):", "",
                   table(fixed_by_op(rows, "compiled_by_op")[:12], by_op_cols)]
    for r in rows:
        md += ["", f"### {r['system']} {r['step']}: the operators moving the most bytes", "",
               table([{"op": op, "gb": gb, "calls": c} for op, (gb, c) in list(r["by_op"].items())[:14]],
                     [("op", "phase: operator"), ("gb", "GB"), ("calls", "calls")])]
    if args.note:
        md += ["", args.note]
    name = "device_traffic" + ("_zero_as_given" if args.zero_as_given else "")
    settings = {"ds_config": Path(args.ds_config).name, "zero_as_given": args.zero_as_given, "real": args.real,
                "dropout": args.dropout, "compiled": args.compiled, "seq_length": s,
                "micro_batches": [b_small, b_large], "at": args.at, "profiles": args.profiles}
    paths = write_results(name, {"settings": settings, "rows": rows}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
