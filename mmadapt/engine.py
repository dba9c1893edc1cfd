"""One engine builder and one training loop for every step that trains (1, 1b, 2 and 3).

`build_engine` wraps a plain model (model.py) or its pipeline form (pipeline.py) in DeepSpeed's
engine: parameters outside `trainable` get requires_grad=False (autograd computes no weight
gradient for them, the optimizer never sees them, ZeRO keeps no state for them), AdamW with no
decay on biases and LayerNorm (unless `decay_all`), linear warm-up then linear decay. ZeRO stage and precision come
from the JSON in ds_configs/, batch sizes and clipping from our config (`load_ds_config`).

`train_loop` runs the updates: a progress bar, TensorBoard and metrics.jsonl logging of the
losses averaged over the updates since the last log line (as fairseq and Megatron report them),
crash-safe checkpoints every `save_interval` updates (checkpoint.py), exact `--resume`, and
`exit_interval` for jobs that must end before a scheduler's time limit. The step-specific work
of one update is a function handed to the loop.

Under bf16/fp16 the module holds low-precision copies; the fp32 master weights live in the
optimizer. They go both ways here: a step that starts from given weights gets them bit for bit
in its master copy (`_set_fp32_master`), and every checkpoint also saves them (checkpoint.py),
so the next step starts from fp32 weights, not from their bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from mmadapt import checkpoint, parallel, quiet
from mmadapt.config import LoopConfig
from mmadapt.faults import STOP_FILE, Diverged, Paused, StopRequest, Stopped, clear_stale_stop
from mmadapt.mcore import compile_on_first_call

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load_ds_config(path: Path, cfg) -> dict:
    """Read a ds_configs/*.json and add what our config decides: `cfg` is a TrainConfig or a
    FinetuneConfig (both name the batch fields and the clipping as DeepSpeed does)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"DeepSpeed config {path} " + ("is a directory" if path.is_dir() else "does not exist")
                         + ": pass one of ds_configs/*.json")
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"DeepSpeed config {path} is not UTF-8 text (a JSON file is): pass one of "
                         "ds_configs/*.json") from None
    if not isinstance(ds, dict):
        raise ValueError(f"DeepSpeed config {path} holds a JSON {type(ds).__name__}, not an object: see ds_configs/")
    _check_sections(path, ds)
    stage = zero_stage(ds)
    if stage not in (0, 1, 2):
        raise ValueError(f"DeepSpeed config {path} uses ZeRO stage {stage}: mmadapt's later steps read checkpoints "
                         "of stages 0-2 only (a model replica fits one device here); use ds_configs/zero1.json or "
                         "zero2.json")
    trains_on = parallel.device().type
    if ds.get("fp16", {}).get("enabled") and trains_on != "cuda":  # DeepSpeed: "Type fp16 is not supported on
        # your device", after the model is built and with no fix
        raise ValueError(f"DeepSpeed config {path} enables fp16, which DeepSpeed trains on a GPU only (this process "
                         f"trains on {trains_on}): use ds_configs/zero2_bf16.json or zero2.json (a run "
                         "that trained with it resumes on a GPU)")
    clash = [k for k in _BATCH_KEYS if k in ds]
    if clash:
        raise ValueError(f"DeepSpeed config {path} sets {clash[0]}: batch sizes come from mmadapt's "
                         f"--train_micro_batch_size_per_gpu/--gradient_accumulation_steps; remove it")
    if "gradient_clipping" in ds:  # replaced below by the flag's value: a JSON's 1.0 would train unclipped, unsaid
        raise ValueError(f"DeepSpeed config {path} sets gradient_clipping: the clipping comes from mmadapt's "
                         "--gradient_clipping (each preset sets its own); remove it from the JSON")
    ds.update(train_micro_batch_size_per_gpu=cfg.train_micro_batch_size_per_gpu,
              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
              gradient_clipping=cfg.gradient_clipping)
    ds.setdefault("steps_per_print", 2**31 - 1)  # mmadapt logs; DeepSpeed's own prints are noise
    if _offloads(ds, "offload_optimizer"):
        # ZeRO-Offload refuses a client optimizer unless told otherwise (it wants its CPU Adam);
        # mmadapt's torch AdamW steps the offloaded fp32 partitions, the losses equal ZeRO-2's
        if ds.get("zero_force_ds_cpu_optimizer"):  # DeepSpeed's default, in its examples (refused where truthy)
            raise ValueError(f"DeepSpeed config {path} sets zero_force_ds_cpu_optimizer "
                             f"{json.dumps(ds['zero_force_ds_cpu_optimizer'])} beside offload_optimizer, which "
                             "refuses any optimizer but DeepSpeed's CPU Adam; mmadapt steps the offloaded state "
                             "with its torch AdamW: remove it from the JSON (or set it false)")
        ds["zero_force_ds_cpu_optimizer"] = False
    _check_with_deepspeed(path, ds)
    return ds


def _check_with_deepspeed(path: Path, ds: dict) -> None:
    """DeepSpeed's own reading of the config, before anything is written: a section it refuses
    ("amp") failed inside deepspeed.initialize, after the run had written its directory."""
    import pydantic  # DeepSpeed's configs are pydantic models
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    try:
        DeepSpeedConfig(ds)
    except DeepSpeedConfigError as e:
        raise ValueError(f"DeepSpeed config {path}: DeepSpeed refuses it ({str(e).splitlines()[0]})") from None
    except pydantic.ValidationError as e:  # a section's field of another type or name: its first, in one line
        where = ".".join(str(part) for part in e.errors()[0]["loc"])
        raise ValueError(f"DeepSpeed config {path}: DeepSpeed refuses it ({e.title}: {where}: "
                         f"{e.errors()[0]['msg']})") from None
    except Exception:  # read here without the job's world and mesh: deepspeed.initialize judges the rest
        pass


def _check_sections(path: Path, ds: dict) -> None:
    """The sections mmadapt reads before DeepSpeed does (the precision, the ZeRO stage), in
    DeepSpeed's shapes, and none that mmadapt's flags replace unsaid (the optimizer and its
    schedule: --lr, --lr_warmup_iters, --weight_decay, ... build them)."""
    if "bfloat16" in ds:  # DeepSpeed trains it as bf16; mmadapt's checks and optimizer path read "bf16" alone
        raise ValueError(f'DeepSpeed config {path} sets "bfloat16", DeepSpeed\'s older name for "bf16", which '
                         "mmadapt reads (the precision chooses the optimizer and the fp32 master weights a "
                         'checkpoint keeps): rename it "bf16"')
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"DeepSpeed config {path} sets {key}: mmadapt builds the optimizer and its schedule from "
                             "its own flags (--lr, --lr_warmup_iters, --weight_decay, --adam_beta2; each preset sets "
                             "its own), and would ignore it; remove it from the JSON")
    for key in ("bf16", "fp16", "zero_optimization"):
        if key in ds and not isinstance(ds[key], dict):
            raise ValueError(f"DeepSpeed config {path}: its {key} is {json.dumps(ds[key])}, where DeepSpeed reads an "
                             "object (" + ('{"stage": 1}' if key == "zero_optimization" else '{"enabled": true}')
                             + "): see ds_configs/")
    for key in ("bf16", "fp16"):
        if not isinstance(ds.get(key, {}).get("enabled", False), bool):
            raise ValueError(f"DeepSpeed config {path}: its {key}.enabled is {json.dumps(ds[key]['enabled'])}, not "
                             "true or false")
    stage = zero_stage(ds)
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise ValueError(f"DeepSpeed config {path}: its zero_optimization.stage is {json.dumps(stage)}, not a "
                         "number (0, 1 or 2)")
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise ValueError(f"DeepSpeed config {path} enables both bf16 and fp16: choose one (ds_configs/zero2_bf16.json "
                         "or zero2_fp16.json)")


def zero_stage(ds: dict) -> int:
    zero = ds.get("zero_optimization")
    return zero.get("stage", 0) if isinstance(zero, dict) else 0


def for_replicas(ds: dict, dp: int, ckpt_dir: Path | None = None) -> dict:
    """The DeepSpeed config a run of `dp` data-parallel replicas trains under.

    ZeRO stages 1 and 2 partition the optimizer state (and the gradients) over the replicas; with
    one replica they partition nothing, and still cost every update a gradient hook per trained
    tensor, copies into their buckets and flat partitions, and thousands of Python calls
    (benchmarks/host_cost.py: at roberta-base's structure ZeRO-1 takes a Step-1 update from 563
    operator launches to 1,072 and DeepSpeed's Python calls from 383 to 7,637). So one replica
    trains without them, in the same precision and with the same fp32 master weights:
      - fp32: stage 0, torch's fused AdamW on the module's own parameters;
      - bf16: DeepSpeed's BF16_Optimizer (what DeepSpeed runs for bf16 at stage 1 with fp32
        gradient accumulation): flat fp32 master weights and gradients, no ZeRO hooks (the
        gradients reach the flat buffer in buckets of the JSON's reduce_bucket_size elements,
        bucketed_bf16_grads);
      - fp16 keeps the JSON's stage: DeepSpeed's fp16 optimizer without ZeRO keeps no fp32
        master that mmadapt can read or set (engine._set_fp32_master, checkpoint.py).
    The run's record keeps the JSON as given (what the user chose, and what --resume compares).
    A JSON that asks for what only ZeRO gives (offloading the optimizer state or the parameters
    to the CPU or NVMe, to fit a model on one device), or for gradients accumulated in another
    precision than fp32, trains as given. At several replicas DeepSpeed accumulates a bf16 run's
    gradients in bf16 unless the JSON sets data_types.grad_accum_dtype (docs/cluster.md).
    ckpt_dir: a resumed run's checkpoints: one written under ZeRO resumes under ZeRO."""
    stage = zero_stage(ds)
    if dp != 1 or stage == 0 or ds.get("fp16", {}).get("enabled"):
        return ds
    bf16 = bool(ds.get("bf16", {}).get("enabled"))
    # rank 0's reading, for every rank: ranks that read a shared file system differently would
    # build different optimizers (and hang)
    written = parallel.rank0_decides(lambda: checkpoint.written_by(ckpt_dir)) if ckpt_dir is not None else None
    if written is not None and written != ("BF16_Optimizer" if bf16 else "AdamW"):
        return ds  # written under ZeRO
    if written is None and _needs_zero(ds):
        return ds  # a new run (a tag written without ZeRO resumes without it, whatever the JSON asks)
    out = dict(ds)
    if bf16:  # the bucket size sets bucketed_bf16_grads' buckets
        out["zero_optimization"] = {"stage": 1, **{k: v for k, v in ds["zero_optimization"].items()
                                                   if k == "reduce_bucket_size"}}
        out["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": "fp32"}
    else:
        out["zero_optimization"] = {"stage": 0}
    return out


def _needs_zero(ds: dict) -> bool:
    """Whether the JSON asks for what the one-replica paths of for_replicas do not give."""
    return (_offloads(ds, "offload_optimizer", "offload_param")
            or ds.get("data_types", {}).get("grad_accum_dtype", "fp32") != "fp32")


def _offloads(ds: dict, *sections: str) -> bool:
    """Whether the JSON's ZeRO offloads one of `sections` (offload_optimizer, offload_param) to a
    device (its "none" offloads nothing)."""
    zero = ds.get("zero_optimization", {})
    return any(isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none" for k in sections)


def param_groups(module: torch.nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Weight matrices, then biases and LayerNorm parameters (every tensor with fewer than 2 dims):
    no weight decay on the second group unless `decay_all` (fairseq's, and so the paper's, AdamW
    decays every parameter). Two groups either way: every pipeline stage needs the same groups."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": weight_decay if decay_all else 0.0}]


def warmup_linear_decay(warmup: int, total: int):
    """LambdaLR factor: linear warm-up over `warmup` updates, then linear decay to 0 at `total`."""
    def f(step: int) -> float:  # step = number of updates already taken
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def adamw(groups: list[dict], loop: LoopConfig, lr: float) -> torch.optim.AdamW:
    """torch's AdamW, fused: one kernel (a few on the CPU) updates every tensor of a group, where
    the default loop launches about nine per tensor (benchmarks/host_cost.py: 1,430 of a
    roberta-base Step-1 update's 1,987 launches without ZeRO). Under ZeRO or DeepSpeed's bf16
    optimizer it steps their flat fp32 partitions, as many tensors as groups."""
    return torch.optim.AdamW(groups, lr=lr, betas=(loop.adam_beta1, loop.adam_beta2), eps=loop.adam_eps,
                             fused=parallel.device().type in ("cuda", "cpu"))


def trainable_by_names(names: tuple[str, ...] | None) -> Callable[[str], bool]:
    """Parameter names, or name prefixes ending in ".", that are trained (None: all)."""
    if names is None:
        return lambda name: True
    return lambda name: any(name == t or (t.endswith(".") and name.startswith(t)) for t in names)


def _shard(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel slice of the full weight `full` of parameter `p` (a block of an
    expanded vocabulary knows its rows: models.layers.split_vocab)."""
    if hasattr(p, "vocab_rows"):
        return full[slice(*p.vocab_rows)]
    tp = parallel.tp_world()
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        if full.shape[0] == getattr(p, "vocab_padded_from", -1):  # a padded vocabulary: zero padding rows
            full = torch.cat([full, full.new_zeros(p.shape[0] * tp - full.shape[0], *full.shape[1:])])
        return full.chunk(tp, dim=p.partition_dim)[parallel.tp_rank()]
    return full


def load_full_weights(module: torch.nn.Module, names: dict[str, str | None], state: dict[str, torch.Tensor],
                      trainable: Callable[[str], bool]) -> None:
    """Copy this rank's slice of full weights into `module` (names: module name -> full name).
    A trainable parameter that `state` lacks keeps the module's seeded init (MINIPOST's new
    layers, a new task head); a frozen one must be there."""
    for n, p in module.named_parameters():
        full = state.get(names[n])
        if full is None:
            if not trainable(names[n]):
                raise ValueError(f"the starting weights lack {names[n]}, which this run keeps frozen")
            continue
        full = _shard(p, full)
        if full.shape != p.shape:
            raise ValueError(f"starting weight {names[n]} has shape {tuple(full.shape)}, the model "
                             f"expects {tuple(p.shape)} on this rank")
        with torch.no_grad():
            p.copy_(full)


def _set_fp32_master(engine, names: dict, state: dict) -> None:
    """DeepSpeed builds the fp32 master weights from the module after casting it to bf16/fp16;
    put the exact starting values back (collective over the data-parallel group)."""
    from deepspeed.utils import safe_set_full_fp32_param

    for n, p in engine.module.named_parameters():
        full = state.get(names.get(n))
        if p.requires_grad and full is not None and hasattr(p, "_hp_mapping"):
            safe_set_full_fp32_param(p, _shard(p, full).to(device=p.device, dtype=torch.float32))


def _clip_to(tensors: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale `tensors` in place by min(1, max_norm / (norm + 1e-6)), DeepSpeed's clip with its eps,
    decided on the device: where DeepSpeed would not scale (`if coef < 1`, a read of the device)
    this multiplies by exactly 1.0, which changes no bit."""
    torch._foreach_mul_(tensors, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def foreach_clip(engine) -> torch.Tensor:
    """DeepSpeed's clip_grad_norm_ (deepspeed.runtime.utils), as its engine calls it for fp32
    without ZeRO, with the per-tensor norms and the scaling as one foreach call each instead of
    two launches per trained tensor (benchmarks/host_cost.py: 340 of the optimizer step's 357
    in a Step-1 update at Qwen2-0.5B's structure). The same sum and reductions: a tensor-parallel
    rank counts its own slices and tensor rank 0 the replicated tensors, summed over the
    model-parallel group (a pipeline's: every stage and tensor rank), then averaged over the
    data-parallel one. Returns the total norm, as DeepSpeed's does.

    Not DeepSpeed's test of who counts a replicated tensor: under a pipeline its
    get_model_parallel_rank() is the rank over every stage and tensor rank, so only the first
    stage counted its tensors and the later stages' gradients were clipped by the first stage's
    norm. As ZeRO's norm does, tensor rank 0 of every stage counts them, and the last stage's copy
    of a tied embedding (ds_pipe_replicated) is not counted twice."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    mpu = engine.mpu
    params = [p for p in engine.module.parameters() if p.grad is not None]
    replicas = mpu is None or bwc_tensor_model_parallel_rank(mpu) == 0  # this rank counts replicated tensors
    counted = [p.grad.detach() for p in params if not getattr(p, "ds_pipe_replicated", False)
               and (replicas or is_model_parallel_parameter(p))]
    device = params[0].device if params else parallel.device()
    total = (torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted
             else torch.zeros((), device=device))
    # Over a group of one rank each reduction is the value itself (a sum of one, x / 1): skipped,
    # three launches of every clipped update at one replica without tensor or pipeline parallelism.
    if mpu is not None and dist.get_world_size(group=mpu.get_model_parallel_group()) > 1:
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
    total = total.pow(0.5)
    pg = groups._get_data_parallel_group()
    if dist.get_world_size(group=pg) > 1:
        total = total / float(dist.get_world_size(group=pg))
        dist.all_reduce(total, group=pg)
    if params:
        _clip_to([p.grad for p in params], engine.gradient_clipping(), total)
    return total


def without_timer_syncs(ds: dict) -> dict:
    """`ds` with DeepSpeed's throughput timer off unless the JSON configures it ("timers"). On by
    default, it synchronizes the device at every forward's start and every step's end (from the
    third update on) to time samples per second that mmadapt neither prints nor logs (it times
    its own updates, host-side, at log_interval): two drains of the device's queue per update, after
    each of which the host's next work runs with the device idle. Applied where the engine is
    built, not where the config is read, so run.json keeps the JSON as the user gave it."""
    return ds if "timers" in ds else {**ds, "timers": {"throughput": {"enabled": False}}}


def flat_bf16_grads(optimizer, is_pipe: bool) -> bool:
    """DeepSpeed's BF16_Optimizer (one replica under bf16, for_replicas) reading its own flat fp32
    gradient buffers, where it reads them tensor by tensor. Its step takes the gradient norm as one
    norm per trained tensor (and, when it clips, one multiply per tensor), and it adds each bf16
    gradient into its fp32 slot as a cast then an add: two launches per tensor, three when
    clipping (a roberta-base Step-1 update on the H200: 902 -> 598, benchmarks/results/
    host_cost_zero2_bf16_flatgrads_h200_20261129.md), each with its Python. Here
    the norm and the clip run over each group's flat buffer (the tensors' slots back to back, so the
    same sum of squares, in another order) and the add casts as it reads (the same values, bit for
    bit). Only where the per-tensor reading selects nothing: one tensor-parallel rank, no pipeline
    (whose tied copies the norm skips), no MoE or Muon groups. Returns whether it applied."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    # getattr: DeepSpeed 0.19.0 and earlier have no AutoEP folding (no such attribute), nor Muon
    if (not isinstance(optimizer, BF16_Optimizer) or is_pipe or parallel.tp_world() > 1 or optimizer.has_moe_layers
            or getattr(optimizer, "_uses_muon", False) or getattr(optimizer, "autoep_folding_tp_group", None)
            is not None or not hasattr(optimizer, "fp32_groups_actual_gradients_flat")):
        return False
    flats = optimizer.fp32_groups_actual_gradients_flat  # without the alignment padding

    def grads_for_norm(for_clipping: bool = False):
        # a tensor with no gradient this update holds zeros in its slot (clear_hp_grads): it adds nothing
        return list(flats) if for_clipping else (list(flats), {})

    @torch.no_grad()
    def update_hp_grad(lp, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
        if lp.grad is None:
            return
        hp = optimizer.fp32_groups_gradients[group_idx][param_idx]
        hp.add_(lp.grad.view(hp.shape))  # bf16 read as fp32 inside the add: exact, as .to(fp32) then add
        lp._hp_grad = hp
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer.get_grads_for_norm = grads_for_norm
    optimizer._update_hp_grad = update_hp_grad
    return True


def norm_of_no_gradient(optimizer) -> None:
    """DeepSpeed's BF16_Optimizer under a pipeline or tensor parallelism (where flat_bf16_grads
    does not apply) takes each rank's part of the gradient norm as torch.stack of its gradients'
    norms, over the trained tensors that hold a gradient, are no tied copy (a tied weight's copy
    on the last pipeline stage is counted on the first) and, unless tensor-parallel, sit on
    tensor-parallel rank 0. A rank with none stops the run there (torch.stack of an empty list):
    a tied decoder's last pipeline stage in Step 2, whose only trained tensor is its copy of the
    word embedding; a middle stage of frozen layers, whose placeholder (build_engine) never gets
    a gradient; a tensor-parallel rank other than 0 whose slice of an expanded vocabulary holds no
    new row (TP 4 and more), which trains only placeholders. Such a rank's list gets one zero,
    which adds nothing to the norm summed over the ranks."""
    get = optimizer.get_grads_for_norm

    def grads_for_norm(for_clipping: bool = False):
        grads = get(for_clipping)
        if not for_clipping and not grads[0]:
            grads = ([torch.zeros((), device=parallel.device())], grads[1])
        return grads

    optimizer.get_grads_for_norm = grads_for_norm


def bucketed_bf16_grads(optimizer, bucket_numel: int) -> bool:
    """Where flat_bf16_grads applied, at one replica: the bf16 gradients reach their fp32 slots a
    bucket at a time, one cat and one add for each run of slots that lie back to back (at most
    `bucket_numel` elements: the JSON's reduce_bucket_size, as ZeRO's buckets), once the last
    gradient of the run has arrived. DeepSpeed's default adds them tensor by tensor after the
    backward: a launch, and its Python, per trained tensor (153 of a roberta-base Step-1 update),
    with every bf16 gradient held until then; a bucket holds its own until its last arrives, and
    the cat copies one bucket. The same fp32 additions of the same values as DeepSpeed's, so the
    same bits. A bucket a backward leaves incomplete (a trained tensor that got no gradient) is
    added tensor by tensor when that backward ends. Not where the JSON sets the bf16
    immediate_grad_update (each gradient added and freed as it arrives, DeepSpeed's hooks: less
    memory held). Returns whether it applied."""
    from torch.autograd import Variable

    if optimizer.immediate_grad_update:
        return False
    # The engine's backward epilogue then adds nothing (BF16_Optimizer.update_hp_grads): run
    # before the flush at a backward's end (a direct loss.backward() queues it first), it would add
    # what the flush adds again.
    optimizer.immediate_grad_update = True
    # (fp32 slots back to back, their tensors as (group, index, bf16 tensor)), in each group's
    # order; the groups hold trained tensors only
    buckets: list[tuple[torch.Tensor, list[tuple[int, int, torch.nn.Parameter]]]] = []
    for i, group in enumerate(optimizer.bf16_groups):
        flat, offset, start, members = optimizer.fp32_groups_actual_gradients_flat[i], 0, 0, []
        for j, lp in enumerate(group):
            if members and offset + lp.numel() - start > bucket_numel:
                buckets.append((flat[start:offset], members))
                members = []
            start = start if members else offset
            members.append((i, j, lp))
            offset += lp.numel()
        if members:
            buckets.append((flat[start:offset], members))
    arrived: list[set[int]] = [set() for _ in buckets]
    task = [None]  # the autograd graph task (one per backward) whose end flushes what is left

    @torch.no_grad()
    def flush(b: int) -> None:
        slots, members = buckets[b]
        if len(arrived[b]) == len(members):  # bf16 read as fp32 inside the add; one tensor needs no cat
            slots.add_(torch.cat([lp.grad.view(-1) for _, _, lp in members]) if len(members) > 1
                       else members[0][2].grad.view(-1))
        else:  # each tensor's own add (flat_bf16_grads' update_hp_grad)
            for k in arrived[b]:
                i, j, lp = members[k]
                optimizer._update_hp_grad(lp, i, j, clear_lp_grads=False)
        for k in arrived[b]:
            i, j, lp = members[k]
            optimizer.fp32_groups_has_gradients[i][j] = True
            lp.grad = None  # the fp32 slot holds it now (as DeepSpeed's immediate_grad_update)
        arrived[b] = set()

    def end_of_backward() -> None:
        for b in range(len(buckets)):
            if arrived[b]:
                flush(b)

    def bf16_grad_arrived(b: int, k: int) -> None:  # the name benchmarks/host_cost.py counts
        # Once per backward, by its id: a backward that raised never runs its callback, and the
        # next one must still queue its own. (What it left arrived is still added: its bf16
        # gradients were zeroed by the engine's backward prologue, or hold the new ones.)
        current = torch._C._current_graph_task_id()
        if current != task[0]:
            task[0] = current
            Variable._execution_engine.queue_callback(end_of_backward)
        arrived[b].add(k)
        if len(arrived[b]) == len(buckets[b][1]):
            flush(b)

    for b, (_, members) in enumerate(buckets):
        for k, (i, j, lp) in enumerate(members):
            lp._hp_grad = optimizer.fp32_groups_gradients[i][j]
            optimizer._grad_acc_hooks.append(  # removed with DeepSpeed's (BF16_Optimizer.destroy)
                lp.register_post_accumulate_grad_hook(lambda _, b=b, k=k: bf16_grad_arrived(b, k)))
    return True


def _grads_to_none(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None


FOUND_INF = "mmadapt_found_inf"  # sync_free_bf16_step's device flag, on DeepSpeed's optimizer


def sync_free_bf16_step(optimizer) -> bool:
    """DeepSpeed's BF16_Optimizer.step (where flat_bf16_grads applied) without its reads of the
    device: it asks `bool(norm is not finite)` to skip the step and, when clipping, `if coef < 1`
    to clip, and each read waits for the whole backward to finish. The host can then queue nothing
    ahead: the optimizer's launches and the next forward's first ones find the device idle (a
    mini-model's Step-2 update, whose host time is close to its device time, pays that in full;
    not yet timed on a GPU). Here both stay on the device, as torch's GradScaler keeps its own:
    the clip is _clip_to's, and a non-finite norm reaches torch's fused AdamW as `found_inf`, which
    then leaves weights, moments and step counts as they were (DeepSpeed skips the step). The host learns of it at the loop's next read of the device: the flag is kept
    under FOUND_INF and train_loop treats it as a non-finite loss (a divergence under bf16, whose
    range is fp32's; a skipped step is an fp16 loss-scaling event). The norm is each group's flat
    buffer's (torch._foreach_norm, one launch) combined as DeepSpeed combines its tensors' norms.
    Only with torch's fused Adam(W) inside (engine.adamw on a CUDA or CPU device) and fp32
    gradient accumulation (engine.for_replicas). Returns whether it applied."""
    inner = optimizer.optimizer
    if (not isinstance(inner, torch.optim.Adam) or not all(g.get("fused") for g in inner.param_groups)
            or optimizer.grad_acc_dtype is not torch.float32):
        return False
    flats = optimizer.fp32_groups_actual_gradients_flat

    @torch.no_grad()
    def step(closure=None):
        if closure is not None:
            raise NotImplementedError(f"{type(optimizer).__name__} does not support closure.")
        optimizer.overflow = False  # known on the device only (FOUND_INF)
        norm = torch.stack(torch._foreach_norm(flats)).pow(2).sum().pow(0.5)
        # inf - inf and NaN - NaN are NaN, x - x is 0 otherwise: two launches where
        # torch.isfinite(norm).logical_not() takes five (isfinite is abs, ne, eq and mul)
        nonfinite = norm.sub(norm).ne(0).float()
        optimizer._global_grad_norm = norm
        setattr(optimizer, FOUND_INF, nonfinite)
        if optimizer.clip_grad > 0.0:
            _clip_to(flats, optimizer.clip_grad, norm)
        for param, grad in zip(optimizer.fp32_groups_flat_partition, optimizer.fp32_groups_gradient_flat_partition):
            param.grad = grad
        inner.found_inf = nonfinite  # read by torch's Adam.step (as GradScaler sets it)
        try:
            inner.step()
        finally:
            del inner.found_inf
        optimizer._lazy_init_hp_params_optimizer_state()
        optimizer.update_lp_params()
        # No clear_hp_grads here, where DeepSpeed's step has one: the engine calls the optimizer's
        # zero_grad right after every step under bf16 (_take_model_step, 0.19.0 and 0.19.8), which
        # clears them again: each group's whole fp32 gradient buffer was zeroed twice an update.

    optimizer.step = step
    return True


def found_inf(engine) -> torch.Tensor | None:
    """The last optimizer step's device flag (sync_free_bf16_step): 1.0 where its gradient norm
    was not finite and the step left everything as it was; None where the step is DeepSpeed's own,
    which tells the host at once (engine.was_step_applied)."""
    return getattr(getattr(engine, "optimizer", None), FOUND_INF, None)


PLACEHOLDER = "empty_group_placeholder_"  # build_engine's parameter of a group with nothing to train


def backward(engine, loss: torch.Tensor) -> None:
    """engine.backward(loss), dividing the loss by the gradient accumulation only where there is
    one: DeepSpeed divides by it always, and x / 1 (x to the bit) costs launches in every
    micro-batch: the division and its backward (DeepSpeed 0.19.8's hook on the model's output
    then divides that output's gradient by 1 once instead, where the loss is the output itself:
    one launch fewer)."""
    engine.backward(loss, scale_wrt_gas=engine.gradient_accumulation_steps() > 1)


def with_placeholders(loss: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """`loss` plus 0 x each placeholder of `module` (build_engine): the backward then gives each a
    zero gradient, so a rank whose only trainable parameters are placeholders (a tensor-parallel
    rank whose slice of an expanded vocabulary holds no new row) still has gradients for ZeRO to
    reduce; DeepSpeed's ZeRO-1/2 fails on a rank with none. The loss's value is unchanged."""
    extra = [p for n, p in module.named_parameters(recurse=False) if n.startswith(PLACEHOLDER)]
    return loss + 0.0 * sum(p.sum() for p in extra) if extra else loss


def set_trainable(module: torch.nn.Module, names: dict[str, str | None], trainable: Callable[[str], bool]) -> None:
    """Each parameter of `module` (names: its names -> the family's) requires a gradient where
    `trainable` says. build_engine sets it; a step sets it before fusion too, which replays only
    frozen layers as CUDA graphs (fusion.apply_fusion)."""
    for n, p in module.named_parameters():
        # numel: a rank whose slice of an expanded vocabulary holds no new rows has nothing to train
        p.requires_grad_(trainable(names[n]) and p.numel() > 0)


def build_engine(module: torch.nn.Module, names: dict[str, str | None], trainable: Callable[[str], bool],
                 loop: LoopConfig, lr: float, total: int, ds_config: dict, init_state: dict | None = None):
    """-> (engine, the tensor-parallel layout of every rank's parameters in full names: their
    `tp_partition_dims`, and `tp_vocab_padded_from`, the real rows of those a padded vocabulary
    pads (layers.tag_vocab_padding), where any is; a checkpoint's client state holds it).

    module: this rank's model (or pipeline stage); names: its parameter names -> the family's
    model names (None: a tied duplicate). AdamW at peak `lr` with loop's betas and decay, linear
    warm-up over loop.warmup_iters(total) updates, then linear decay to 0 at `total`.
    parallel.init_parallel must have run."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    is_pipe = isinstance(module, PipelineModule)
    if init_state is not None:
        load_full_weights(module, names, init_state, trainable)
    set_trainable(module, names, trainable)
    split = [(names[n], p) for n, p in module.named_parameters()
             if getattr(p, "tensor_model_parallel", False) and names[n] is not None]
    here = ({n: p.partition_dim for n, p in split},
            {n: p.vocab_padded_from for n, p in split if hasattr(p, "vocab_padded_from")})
    # Rank 0 writes the client state but holds only its own stage: merge every stage's.
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, here)
    layout = {"tp_partition_dims": {k: v for d, _ in every for k, v in d.items()}}
    padded = {k: v for _, d in every for k, v in d.items()}
    if padded:
        layout["tp_vocab_padded_from"] = padded
    groups = param_groups(module, loop.weight_decay, loop.decay_all)
    for i, group in enumerate(groups):
        if not group["params"]:
            # A pipeline stage with nothing of this kind to train (all of a middle stage in
            # Step 2). torch and DeepSpeed refuse empty parameter groups, and ZeRO all-reduces
            # each group's gradient norm across the stages, so every stage needs the same
            # groups: give this one a scalar that no forward uses. Its gradient is zero and
            # weight decay of a zero is zero, so AdamW leaves it at 0.
            # It belongs to no pipeline layer, so no checkpoint layer file holds it.
            placeholder = torch.nn.Parameter(torch.zeros(1, device=parallel.device()))
            module.register_parameter(f"{PLACEHOLDER}{i}", placeholder)
            group["params"] = [placeholder]
    optimizer = adamw(groups, loop, lr)
    warmup = loop.warmup_iters(total)
    if warmup > total and parallel.is_rank0():  # a preset's warm-up over a shorter run: accepted (tests, smoke runs), said
        print(f"note: the learning-rate warm-up ({warmup} updates, --lr_warmup_iters) is longer than the run ({total}): "
              f"the rate peaks at {total / warmup:.0%} of --lr and never decays; set --lr_warmup_iters below {total}",
              flush=True)
    past = [n for n in loop.extra_save_steps if n > total]
    if past and parallel.is_rank0():  # (under MMADAPT_TINY=1's caps, every one past a few updates)
        print(f"note: --extra_save_steps {' '.join(map(str, past))} {'is' if len(past) == 1 else 'are'} past the run's "
              f"last update ({total}): no checkpoint is saved there", flush=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(warmup, total))
    # compile_on_first_call: initialize imports DeepSpeed's Muon optimizer (to tell it apart),
    # whose kernels are wrapped in torch.compile at import: TorchInductor's import, deferred as in mcore.py.
    with quiet.deepspeed_prints(), compile_on_first_call():
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=without_timer_syncs(ds_config),
                                               mpu=None if is_pipe else parallel.DeepSpeedMPU())
    if parallel.dp_world() == 1 and not is_pipe and (engine.zero_optimization_stage() == 0
                                                     or isinstance(engine.optimizer, BF16_Optimizer)):
        # One replica has no gradient to average, but DeepSpeed's engine still runs its
        # all-reduce over the data-parallel group of one at every boundary: every gradient copied
        # into a flat buffer and back (a copy per trained tensor; 153 launches of a roberta-base
        # Step-1 update, benchmarks/host_cost.py). Under bf16 (BF16_Optimizer, which one replica
        # gets as ZeRO stage 1: for_replicas) it reduces the fp32 gradient buffers, cast to bf16
        # (DeepSpeed's communication_data_type) and back: at one replica that only rounds a
        # gradient accumulated over micro-batches to bf16. ZeRO's optimizers and the pipeline
        # engine reduce through this switch or on their own: they keep it.
        engine.enable_backward_allreduce = False
    if engine.gradient_clipping() > 0 and engine.zero_optimization_stage() == 0 and not (
            engine.bfloat16_enabled() or engine.fp16_enabled()):
        # DeepSpeed clips fp32 gradients without ZeRO tensor by tensor (foreach_clip says why)
        engine.clip_fp32_gradients = functools.partial(foreach_clip, engine)
    if engine.zero_optimization_stage() == 0 and not (is_pipe or engine.bfloat16_enabled() or engine.fp16_enabled()):
        # DeepSpeed's fp32 zero_grad sets every parameter's gradient to None at every update,
        # walking the module's tree for the frozen ones too: a Step-2 update trains 2 tensors of
        # ~200, and the walk took ~7% of a 4-layer mini-model's host time (benchmarks/host_cost.py).
        # Only trained tensors ever hold a gradient (their requires_grad is set once, above).
        trained = [p for p in module.parameters() if p.requires_grad]
        engine.zero_grad = functools.partial(_grads_to_none, trained)
    if flat_bf16_grads(engine.optimizer, is_pipe):
        sync_free_bf16_step(engine.optimizer)
        if parallel.dp_world() == 1:  # where nothing reduces the gradients between backward and step
            bucketed_bf16_grads(engine.optimizer, engine.zero_reduce_bucket_size())
    elif isinstance(engine.optimizer, BF16_Optimizer) and (is_pipe or parallel.tp_world() > 1):
        norm_of_no_gradient(engine.optimizer)  # where DeepSpeed's norm leaves tensors out
    if init_state is not None and (engine.bfloat16_enabled() or engine.fp16_enabled()):
        _set_fp32_master(engine, names, init_state)
    return engine, layout


def is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def mean_over_ranks(local: torch.Tensor, is_pipe: bool) -> torch.Tensor:
    """Average a per-rank loss tensor over the data-parallel replicas. In a pipeline only the
    last stage computes losses (the others hold zeros), so the sum runs over every rank."""
    if not is_pipe and parallel.dp_world() == 1:  # a sum over one rank, divided by 1: itself
        return local.detach()
    total = local.detach().clone()
    if is_pipe:
        dist.all_reduce(total)
        return total / (parallel.dp_world() * parallel.tp_world())
    dist.all_reduce(total, group=parallel.parallel_state.get_data_parallel_group())
    return total / parallel.dp_world()


def _step_of(line: str) -> float:
    """A metrics line's update (infinity for a line cut short by a kill: it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class MetricsLog:
    """metrics.jsonl and TensorBoard, on global rank 0. On resume from update `start`, the
    lines and events of later updates (written before a crash) are dropped."""

    def __init__(self, run_dir: Path, start: int):
        self.file, self.writer = run_dir / "metrics.jsonl", None
        if not parallel.is_rank0():
            return
        kept = [l for l in (self.file.read_text().splitlines() if self.file.is_file() and start else [])
                if _step_of(l) <= start]
        checkpoint.atomic_write(self.file, "".join(l + "\n" for l in kept))
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard drops the events of steps >= purge_step written before: a run that starts
        # again from update 0 (it stopped before its first checkpoint) drops all of them, as the
        # lines of metrics.jsonl, else its curves were drawn twice over the same updates
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1 if start else 0)

    def write(self, row: dict, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        with open(self.file, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _loss_row(step: int, mean: torch.Tensor, loss_names: tuple[str, ...] | None, prefix: str = "",
              loss_weights: tuple[float, ...] | None = None, split_names: tuple[str, str] | None = None
              ) -> tuple[dict, dict]:
    """A metrics row {step, <prefix>loss[, <prefix>head_losses]} and its TensorBoard scalars
    (under loss/ for training, valid/ for validation) from the per-head means [k]; the loss is
    their mean, or their weighted mean with `loss_weights` (normalised, as the model's).
    split_names: `mean` ends with two texts' (loss sum, count) pairs (layers.split_sums), logged
    as <name>_loss, the loss per scored piece of each (None where the logged updates held none)."""
    group = "valid" if prefix else "loss"
    if split_names is not None:
        mean, sums = mean[:-4], mean[-4:].tolist()
        split = {f"{name}_loss": sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else None
                 for i, name in enumerate(split_names)}
    total = mean.mean() if loss_weights is None else (mean * mean.new_tensor(loss_weights)).sum()
    row = {"step": step, f"{prefix}loss": total.item()}
    scalars = {f"{group}/{'loss' if prefix else 'total'}": row[f"{prefix}loss"]}
    if loss_names is not None:
        row[f"{prefix}head_losses"] = dict(zip(loss_names, mean.tolist()))
        scalars.update({f"{group}/head_layer{k}": v for k, v in row[f"{prefix}head_losses"].items()})
    if split_names is not None:
        row.update(split)
        scalars.update({f"{group}/{k.removesuffix('_loss')}": v for k, v in split.items() if v is not None})
    return row, scalars


def _diverged(job: "LoopJob", what: str, ckpt_dir: Path, fix: str) -> Diverged:
    """A divergence of `job` (`what` happened) with the run's advice (Diverged.of_run): the
    newest complete checkpoint in `ckpt_dir` is the last good one."""
    tag = checkpoint.latest_tag(ckpt_dir)
    return Diverged.of_run(f"{job.label}: {what}", None if tag is None else (tag, str(ckpt_dir)), fix, job.step)


class Unchecked:
    """Updates whose losses (and sync_free_bf16_step's flag) the host has not yet looked at: each
    update is kept as its tensors, and `first_nonfinite` examines them all at once, where the loop
    reads the device anyway (a log line, a checkpoint, a skipped step). Checking each update as it
    ended took 9-12 launches on every update (isfinite is four, then all, the flag's, a running
    minimum); keeping its tensors takes none. They are a few numbers each; past FOLD of them (a
    long log interval) they are reduced on the device to the first bad one's number, still
    without a read."""

    FOLD = 256

    def __init__(self):
        self.updates: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self.first: torch.Tensor | None = None  # [1] int64: the first bad update of those folded, or _FINITE

    def add(self, update: int, losses: torch.Tensor, skipped: torch.Tensor | None) -> None:
        """update: its number (1-based); losses [k] as step_fn returned them; skipped: found_inf's flag."""
        self.updates.append((update, losses, skipped))
        if len(self.updates) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        numbers, losses, flags = zip(*self.updates)
        bad = ~torch.stack(losses).isfinite().all(dim=1)  # [n]
        if any(f is not None for f in flags):
            zero = torch.zeros((), device=losses[0].device)
            bad |= torch.stack([zero if f is None else f.reshape(()) for f in flags]).ne(0)
        at = torch.tensor(numbers, dtype=torch.int64)
        if losses[0].device.type == "cuda":  # pinned, so that the copy does not wait for the device
            at = at.pin_memory().to(losses[0].device, non_blocking=True)
        first = torch.where(bad, at, _FINITE).min().reshape(1)
        self.first = first if self.first is None else torch.minimum(self.first, first)
        self.updates.clear()

    def first_nonfinite(self, device) -> int | None:
        """The first update since the last call whose loss or flag was not finite, on any rank
        (None: none). Collective: every rank calls it at the same point of the loop."""
        if self.updates:
            self._fold()
        first = self.first if self.first is not None else torch.full((1,), _FINITE, dtype=torch.int64, device=device)
        self.first = None
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return None if first.item() == _FINITE else int(first.item())


_FINITE = 2**62  # Unchecked.first_nonfinite's value while every loss has been finite
LOG_WINDOW = "log_window"  # a checkpoint's client state: the updates since the last log line (train_loop)
SKIPPED_IN_A_ROW = "skipped_in_a_row"  # a checkpoint's client state: fp16 steps skipped in a row before it


@dataclasses.dataclass
class LoopJob:
    """What train_loop needs to know of the job it runs, beyond LoopConfig's settings.

    step: the step it trains (one of flops.STEPS, or "finetune"), `task` that step's task where
    it has one: the progress bar and a divergence's line say both (`label`), a Diverged carries
    the step. names and client_state go into every checkpoint (checkpoint.save); exclude_frozen
    leaves frozen parameters out of them. loss_names: one per entry of step_fn's losses (the heads'
    layers; None: one loss); loss_weights: how they make the logged loss
    (ModelConfig.loss_weights; None: their mean). scored_rows() -> the positions this rank's
    heads projected (its batches' scored positions) over the updates this invocation ran, a
    host count (None: the job counts none). perf(seconds per update, scored rows per update
    summed over the data-parallel replicas, None where not counted) -> throughput fields of a log
    row. after_save(step, tag, run, rows): global rank 0, after each complete checkpoint; `run`
    counts the updates run to reach it (fp16 steps skipped on an overflow included: their forward
    and backward were computed, what FLOPs and tokens count) and `rows` the positions projected
    in them over every replica (None: not counted, or not since update 0: a checkpoint from
    before the count was resumed); `scheduled` (a keyword) False for a stop's or a pause's
    checkpoint off the schedule (LoopConfig.on_schedule) where the run's other checkpoints are.
    evaluate() -> this rank's validation losses [k] (as step_fn's), every `eval_interval`
    updates: logged as `valid_loss` (and `valid_head_losses`) rows. split_losses: step_fn's losses
    end with two texts' (loss sum, count) pairs (layers.split_sums), logged as <name>_loss
    (Step 2's replay: ("source", "target"))."""
    step: str
    names: dict
    client_state: dict
    exclude_frozen: bool
    loss_names: tuple[str, ...] | None = None
    loss_weights: tuple[float, ...] | None = None
    perf: Callable[[float, float | None], dict] | None = None
    after_save: Callable[[int, str, int, int | None], None] | None = None
    scored_rows: Callable[[], int] | None = None
    evaluate: Callable[[], torch.Tensor] | None = None
    eval_interval: int = 0
    split_losses: tuple[str, str] | None = None
    task: str | None = None

    @property
    def label(self) -> str:
        return self.step if self.task is None else f"{self.step} {self.task}"


def train_loop(engine, step_fn: Callable[[int], torch.Tensor], job: LoopJob, loop: LoopConfig, total: int,
               run_dir: Path, resume: bool) -> list[dict]:
    """Run updates until `total`. Returns the rows logged by this invocation (global rank 0; empty
    elsewhere). At a multiple of loop.exit_interval before `total`: save, then faults.Paused.

    step_fn(position) runs one update on the batches at data position `position` (0-based) and
    returns this rank's losses [k], before any reduction over ranks: they are summed on the
    device and reduced once per log line, so an update costs no device synchronisation.
    Updates count applied optimizer steps: a step DeepSpeed skips (an fp16 overflow) consumes
    its batches but advances neither the update count nor the schedule, so the schedule still
    ends at 0 after `total` updates; more than loop.max_skipped_steps in a row is a divergence.

    Faults (faults.py): a non-finite loss stops the run (faults.Diverged) before the next
    checkpoint could record it, so the newest complete checkpoint is the last good one.
    SIGTERM/SIGINT, the death of the launcher, on any rank, or a file <run_dir>/STOP: every rank
    finishes the update, saves a complete checkpoint and raises faults.Stopped. loop.keep_last
    > 0: only the newest keep_last complete checkpoints are kept."""
    is_pipe = is_pipeline(engine)
    ckpt_dir = run_dir / "checkpoints"
    start = position = 0
    rows, since, loss_sum, resumed, skipped = [], 0, None, None, 0
    # the rows the heads projected before this invocation (a resumed checkpoint's count; None:
    # unknown, from a checkpoint written before the count)
    rows_before = 0 if job.scored_rows is not None else None
    if resume:
        state = checkpoint.resume(engine, ckpt_dir, strict=not job.exclude_frozen)
        if state is not None:
            start, position = state["step"], state.get("position", state["step"])
            # fp16 steps skipped in a row just before the save (a stop's save after skips): they
            # count toward max_skipped_steps as in the uninterrupted run
            skipped = state.get(SKIPPED_IN_A_ROW, 0)
            if rows_before is not None:
                rows_before = state.get(checkpoint.SCORED_ROWS)
            resumed = checkpoint.tag_for(start)
            if parallel.is_rank0():  # a prune a kill cut short (a finished run saves, and prunes, no more)
                checkpoint.prune(ckpt_dir, loop.keep_last, resumed)
            # A stop between two log lines: the updates of that log window before it, so that the
            # next line averages the same updates as the uninterrupted run's (ranks that compute
            # no loss, a pipeline's first stages, hold none: mean_over_ranks sums over them)
            window = state.get(LOG_WINDOW)
            if window:
                loss_sum = torch.tensor(window["loss_sum"], device=engine.device)
                if is_pipe and not engine.is_last_stage():
                    loss_sum = torch.zeros_like(loss_sum)
                since = window["since"]
    rank0 = parallel.is_rank0()
    log = MetricsLog(run_dir, start)
    bar = tqdm(total=total, initial=start, disable=not rank0, desc=job.label, unit="upd", mininterval=2.0)
    # this process's updates of the log window, and the seconds of its evaluations and saves: its
    # throughput's (those seconds are not an update's)
    timed, t_last, t_aside = 0, time.perf_counter(), 0.0
    unchecked = Unchecked()
    done, saved = start, resumed

    def scored_so_far() -> int | None:
        """The rows projected since update 0, over every replica (collective: on every rank alike)."""
        return None if rows_before is None else rows_before + parallel.replicas_sum(job.scored_rows())

    window_rows = scored_so_far()  # at the log window's start

    def check_finite() -> None:
        first = unchecked.first_nonfinite(engine.device)
        if first is not None:
            fix = "lower --lr, raise the warm-up or enable gradient clipping"
            raise _diverged(job, f"the loss (or its gradient) is not finite at update {first} (of {total}); "
                                 "stopped without saving it.", ckpt_dir, fix)

    def save(scheduled: bool = True) -> str:
        check_finite()
        # the log window's updates so far, averaged over ranks as its line will be (collective)
        window = ({"since": since, "loss_sum": mean_over_ranks(loss_sum, is_pipe).tolist()}
                  if since and loss_sum is not None else None)
        scored = scored_so_far()
        tag = checkpoint.save(engine, ckpt_dir, done, {**job.client_state, "position": position, LOG_WINDOW: window,
                                                       SKIPPED_IN_A_ROW: skipped, checkpoint.SCORED_ROWS: scored},
                              job.names, exclude_frozen=job.exclude_frozen, keep_last=loop.keep_last)
        if job.after_save is not None:  # rank 0's work, agreed on (no other rank left in a collective)
            parallel.together(lambda: (job.after_save(done, tag, position, scored, scheduled=scheduled)
                                       if rank0 else None),
                              f"failed after {job.label}'s checkpoint {tag}")
        return tag

    stop_file = run_dir / STOP_FILE
    if rank0:
        clear_stale_stop(stop_file)  # the request that stopped the previous job of this run, not one of this job's
    dist.barrier()
    try:
        with StopRequest(stop_file) as stop:
            while done < total:
                lr = engine.get_lr()[0]  # the rate this update trains at: DeepSpeed steps the schedule in it
                local = step_fn(position).detach()
                position, timed = position + 1, timed + 1  # timed: a skipped update took its time too
                # Looked at with the next read of the device (check_finite): whether its loss, or
                # where the step skips on the device (sync_free_bf16_step) its gradient norm, is finite.
                unchecked.add(done + 1, local, found_inf(engine))
                if not engine.was_step_applied():  # a Python flag: DeepSpeed's overflow check already synced
                    check_finite()  # DeepSpeed also skips the steps of a non-finite loss: name that first
                    skipped += 1
                    if skipped > loop.max_skipped_steps:
                        raise _diverged(job, f"{skipped} optimizer steps in a row were skipped (gradient "
                                             f"overflow) after update {done}.", ckpt_dir, "lower --lr or use bf16")
                else:
                    skipped = 0
                    loss_sum = local if loss_sum is None else loss_sum + local
                    done, since = done + 1, since + 1
                    if done % loop.log_interval == 0 or done == total:
                        row, scalars = _loss_row(done, mean_over_ranks(loss_sum, is_pipe) / since, job.loss_names,
                                                 loss_weights=job.loss_weights, split_names=job.split_losses)
                        check_finite()
                        # On a GPU the host runs ahead of the device: the updates still queued are this
                        # window's (timed before they ran, they fell in no window and the rate read high;
                        # the loss read above waits for the last forward only, not its backward and step)
                        if engine.device.type == "cuda":
                            torch.cuda.synchronize(engine.device)
                        dt = (time.perf_counter() - t_last - t_aside) / timed
                        scored = scored_so_far()  # the window's projected rows: what its FLOPs count
                        per_update = None if scored is None else (scored - window_rows) / timed
                        row["lr"] = lr
                        row.update(job.perf(dt, per_update) if job.perf is not None else {})
                        scalars.update({"lr": row["lr"], **{f"perf/{k}": v for k, v in row.items()
                                                             if k not in ("step", "loss", "head_losses", "lr")
                                                             and not k.endswith("_loss")}})
                        if rank0:
                            rows.append(row)
                            log.write(row, scalars)
                            # shown by bar.update below, with this update's count (a refresh here showed
                            # the loss beside the count of the update before)
                            bar.set_postfix({"loss": f"{row['loss']:.3f}", **{
                                k: f"{v:.3f}" for k, v in row.items() if k.endswith("_loss") and v is not None}},
                                refresh=False)
                        loss_sum, since, timed, t_last, t_aside = None, 0, 0, time.perf_counter(), 0.0
                        window_rows = scored
                    evaluating = job.evaluate is not None and job.eval_interval and done % job.eval_interval == 0
                    exiting = loop.exit_interval > 0 and done % loop.exit_interval == 0
                    saving = loop.saves_at(done, total)  # (exiting's pauses among them)
                    if (evaluating or saving) and engine.device.type == "cuda":
                        # the updates still queued are theirs, not the evaluation's or the save's
                        torch.cuda.synchronize(engine.device)
                    t_eval = time.perf_counter()
                    if evaluating:
                        row, scalars = _loss_row(done, mean_over_ranks(job.evaluate(), is_pipe), job.loss_names,
                                                 prefix="valid_", loss_weights=job.loss_weights)
                        if rank0:
                            rows.append(row)
                            log.write(row, scalars)
                    bar.update(1)
                    if saving:  # (a pause alone is off the schedule: its Step-2 artifact no curve point)
                        saved = save(scheduled=loop.on_schedule(done, total))
                    t_aside += time.perf_counter() - t_eval
                    if exiting and done < total:
                        dist.barrier()  # leave with rank 0, once its after_save (Step 2's artifact) is written
                        raise Paused(done, total, saved)
                # Agree on a stop request every update, over gloo on the host (parallel.any_rank).
                if parallel.any_rank(stop.reason is not None):
                    # A complete checkpoint of this update is never written again, also where fp16
                    # steps were skipped since (their batches consumed): a stop's save races a kill
                    # deadline, and rewriting in place would lose the only copy. The resumed run
                    # replays those batches from the same loss scale and RNG states: the same skips.
                    # Off the schedule unless this update is on it (a scheduled save that skipped
                    # fp16 steps put off: update 0 of a run whose first updates were all skipped)
                    tag = saved if saved == checkpoint.tag_for(done) else save(scheduled=loop.on_schedule(done, total))
                    if rank0:
                        stop_file.unlink(missing_ok=True)
                    # Every rank leaves with rank 0, once its after_save is written: DeepSpeed's
                    # launcher SIGKILLs the rest of a node's ranks 30 s after one exits non-zero.
                    dist.barrier()
                    raise Stopped(done, tag, stop.reason or "a signal to another rank")
    finally:  # before the caller prints why it stopped
        bar.close()
        log.close()
    return rows
