"""The MLM training loop of Steps 1, 1b and 2, through DeepSpeed's engine.

Step 1 (pretrain: BL_BASE, BL_SMALL, MINIJOINT) trains every parameter from a seeded init.
Step 1b (MINIPOST) and Step 2 (new-language embeddings) start from given full weights and train
only some parameters (`Job.trainable`): the others get requires_grad=False, so autograd computes
no weight gradient for them, they are not handed to the optimizer (ZeRO shards and keeps state
for the trainable ones only), and checkpoints leave them out (run.json says where they come from).

The loop wraps the plain model (model.py) or its pipeline form (pipeline.py) in a DeepSpeed
engine; ZeRO stage and precision come from the JSON in ds_configs/, batch sizes and clipping from
TrainConfig. `validate_run` checks everything a user can get wrong before any process group, file
or directory is created.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mmadapt import checkpoint, parallel
from mmadapt.config import ModelConfig, OptimizerConfig, TrainConfig, to_dict
from mmadapt.data import MLMBatches, check_corpus, encode_corpus, load_tokenizer, train_tokenizer
from mmadapt.flops import step_flops

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclasses.dataclass
class Job:
    """What a run trains. Defaults: Step 1, every parameter, from the model's seeded init."""
    step: str = "pretrain"  # one of flops.STEPS: the FLOP count logged, the progress-bar label
    recipe: str = "custom"  # recorded in run.json
    # RobertaMLM parameter names, or name prefixes ending in ".", that are trained (None: all).
    trainable: tuple[str, ...] | None = None
    # Called on every rank with the run's tokenizer; returns full weights (RobertaMLM names) to
    # start from. Trainable parameters it omits keep the model's seeded init (MINIPOST's new layers).
    init: Callable[[Path], dict] | None = None
    frozen_from: dict | None = None  # where the frozen weights come from (run.json)
    info: dict = dataclasses.field(default_factory=dict)  # more run.json entries
    on_save: Callable[[int, str, int], None] | None = None  # rank 0, after each checkpoint: (step, tag, global batch)
    trainable_layers: int = 0  # Step 1b: l_t, for its FLOP count

    def is_trainable(self, name: str) -> bool:
        if self.trainable is None:
            return True
        return any(name == t or (t.endswith(".") and name.startswith(t)) for t in self.trainable)


@dataclasses.dataclass
class RunPaths:
    output_dir: Path
    corpus: Path
    ds_config: Path
    tokenizer: Path | None = None  # None: train one on the corpus

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"


def load_ds_config(path: Path, train: TrainConfig) -> dict:
    """Read a ds_configs/*.json and add what TrainConfig decides (batch sizes, clipping)."""
    if not path.is_file():
        raise ValueError(f"DeepSpeed config {path} does not exist: pass one of ds_configs/*.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    clash = [k for k in _BATCH_KEYS if k in cfg]
    if clash:
        raise ValueError(f"DeepSpeed config {path} sets {clash[0]}: batch sizes come from mmadapt's "
                         f"--train_micro_batch_size_per_gpu/--gradient_accumulation_steps; remove it")
    cfg.update(train_micro_batch_size_per_gpu=train.train_micro_batch_size_per_gpu,
               gradient_accumulation_steps=train.gradient_accumulation_steps,
               gradient_clipping=train.gradient_clipping)
    cfg.setdefault("steps_per_print", 2**31 - 1)  # mmadapt logs; DeepSpeed's own prints are noise
    return cfg


def validate_run(model: ModelConfig, train: TrainConfig, paths: RunPaths, resume: bool) -> dict:
    """All user-facing checks, before any side effect. Returns the DeepSpeed config dict."""
    model.validate()
    train.validate(model)
    ds = load_ds_config(paths.ds_config, train)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if model.pipeline_model_parallel_size > 1 and stage > 1:
        raise ValueError(f"ZeRO stage {stage} does not combine with DeepSpeed pipeline parallelism: "
                         "use ds_configs/zero1.json with --pipeline_model_parallel_size > 1")
    # Before any process group exists: the launcher's WORLD_SIZE (1 for a plain `python` run).
    parallel.check_world_size(int(os.environ.get("WORLD_SIZE", 1)), model.tensor_model_parallel_size,
                              model.pipeline_model_parallel_size)
    if model.pipeline_model_parallel_size > 1 and model.tensor_model_parallel_size > 1 and len(model.head_layers) > 1:
        # With tensor parallelism DeepSpeed splits the first tensor sent between stages across the
        # TP ranks and asserts that no other tensor of the tuple needs a gradient; the carried
        # output of an intermediate head's layer does (pipeline.py), so send whole tensors.
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    check_corpus(paths.corpus)
    if paths.tokenizer is not None:
        load_tokenizer(paths.tokenizer, model.vocab_size)
    if checkpoint.has_checkpoints(paths.checkpoints) and not resume:
        raise ValueError(f"{paths.output_dir} already holds checkpoints of another run: pass --resume to "
                         "continue it, or choose a new --output_dir")
    run_file = paths.output_dir / "run.json"
    if resume and run_file.is_file():
        saved = json.loads(run_file.read_text())["model"]
        mine = to_dict(model)
        mine["head_layers"] = list(mine["head_layers"])
        diff = [k for k in mine if saved.get(k) != mine[k]]
        if diff:
            raise ValueError(f"--resume with a different model: {diff[0]} is {mine[diff[0]]} here but "
                             f"{saved.get(diff[0])} in {run_file}")
    return ds


def prepare_data(model: ModelConfig, train: TrainConfig, paths: RunPaths) -> tuple[Path, Path]:
    """Tokenizer and encoded blocks, made by global rank 0 while the others wait. Like DeepSpeed's
    checkpoints, this assumes the output directory is on a file system all nodes share."""
    tok = paths.output_dir / "tokenizer" / "spm.model"
    data_dir = paths.output_dir / "data"
    if dist.get_rank() == 0:
        if paths.tokenizer is not None:
            if paths.tokenizer.resolve() != tok.resolve():
                tok.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(paths.tokenizer, tok)
        elif not tok.is_file():
            train_tokenizer(paths.corpus, tok.with_suffix(""), model.vocab_size, seed=train.seed)
        load_tokenizer(tok, model.vocab_size)
        encode_corpus(paths.corpus, tok, data_dir, train.seq_length)
    dist.barrier()
    return tok, data_dir


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and LayerNorm parameters (every tensor with fewer than 2 dims)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def warmup_linear_decay(warmup: int, total: int):
    """LambdaLR factor: linear warm-up over `warmup` updates, then linear decay to 0 at `total`."""
    def f(step: int) -> float:  # step = number of updates already taken
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def lr_lambda(train: TrainConfig):
    return warmup_linear_decay(train.lr_warmup_iters, train.train_iters)


def adamw(groups: list[dict], opt: OptimizerConfig, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)


def _load_full_weights(module: torch.nn.Module, names: dict[str, str], state: dict[str, torch.Tensor],
                       job: Job) -> None:
    """Copy this rank's slice of full weights into `module` (names: module name -> full name)."""
    tp, rank = parallel.tp_world(), parallel.tp_rank()
    for n, p in module.named_parameters():
        full = state.get(names[n])
        if full is None:
            if not job.is_trainable(names[n]):
                raise ValueError(f"the starting weights lack {names[n]}, which this run keeps frozen")
            continue
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            full = full.chunk(tp, dim=p.partition_dim)[rank]
        if full.shape != p.shape:
            raise ValueError(f"starting weight {names[n]} has shape {tuple(full.shape)}, the model "
                             f"expects {tuple(p.shape)} on this rank")
        with torch.no_grad():
            p.copy_(full)


def build_engine(model_cfg: ModelConfig, train: TrainConfig, ds_config: dict, job: Job | None = None,
                 init_state: dict | None = None):
    """-> (engine, is_pipeline, tp_partition_dims). parallel.init_parallel must have run."""
    import deepspeed

    from mmadapt.model import RobertaMLM
    from mmadapt.pipeline import pipeline_param_name, to_pipeline

    job = job or Job()
    is_pipe = model_cfg.pipeline_model_parallel_size > 1
    if is_pipe:
        module = to_pipeline(model_cfg, train.seed, parallel.dp_world())
        names = {n: pipeline_param_name(n, model_cfg) for n, _ in module.named_parameters()}
    else:
        module = RobertaMLM(model_cfg, seed=train.seed)
        names = {n: n for n, _ in module.named_parameters()}
    if init_state is not None:
        _load_full_weights(module, names, init_state, job)
    for n, p in module.named_parameters():
        p.requires_grad_(job.is_trainable(names[n]))
    dims = {names[n]: p.partition_dim for n, p in module.named_parameters()
            if getattr(p, "tensor_model_parallel", False) and names[n] is not None}
    # Rank 0 writes the client state but holds only its own stage: merge every stage's dims.
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dims)
    dims = {k: v for d in every for k, v in d.items()}
    groups = param_groups(module, train.weight_decay)
    for i, group in enumerate(groups):
        if not group["params"]:
            # A pipeline stage with nothing of this kind to train (all of a middle stage in
            # Step 2). torch and DeepSpeed refuse empty parameter groups, and ZeRO all-reduces
            # each group's gradient norm across the stages, so every stage needs the same
            # groups: give this one a scalar that no forward uses. Its gradient is zero and
            # weight decay of a zero is zero, so AdamW leaves it at 0.
            # It belongs to no pipeline layer, so no checkpoint layer file holds it.
            placeholder = torch.nn.Parameter(torch.zeros(1, device=parallel.device()))
            module.register_parameter(f"empty_group_placeholder_{i}", placeholder)
            group["params"] = [placeholder]
    optimizer = adamw(groups, train, train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, mpu=None if is_pipe else parallel.DeepSpeedMPU())
    return engine, is_pipe, dims


def _pipe_heads(engine):
    from mmadapt.pipeline import PipeMLMHeads

    return next((m for m in engine.module.modules() if isinstance(m, PipeMLMHeads)), None)


def train_step(engine, is_pipe: bool, batches, num_heads: int) -> torch.Tensor:
    """One update over this rank's micro-batches. Returns each head's loss, averaged over the
    micro-batches and data-parallel ranks, on every rank."""
    dev = engine.device
    if is_pipe:
        engine.train_batch(iter([((ids.to(dev), lab.to(dev)), lab.to(dev)) for ids, lab in batches]))
        heads = _pipe_heads(engine)
        per_head = torch.zeros(num_heads, device=dev)
        if heads is not None:  # last stage: its micro-batches' losses, summed over DP and TP ranks
            per_head += torch.stack(heads.head_losses).mean(0)
            heads.head_losses.clear()
        dist.all_reduce(per_head)
        return per_head / (parallel.dp_world() * parallel.tp_world())
    per_head = torch.zeros(num_heads, device=dev)
    for ids, lab in batches:
        loss, heads_loss = engine(ids.to(dev), lab.to(dev))
        engine.backward(loss)
        engine.step()
        per_head += heads_loss / len(batches)
    dist.all_reduce(per_head, group=parallel.parallel_state.get_data_parallel_group())
    return per_head / parallel.dp_world()


def pretrain(model_cfg: ModelConfig, train: TrainConfig, paths: RunPaths, resume: bool = False,
             recipe: str = "custom") -> list[dict]:
    """Run Step 1. Returns the metrics of this invocation (rank 0; empty on other ranks)."""
    return run(model_cfg, train, paths, Job(recipe=recipe), resume)


def run(model_cfg: ModelConfig, train: TrainConfig, paths: RunPaths, job: Job, resume: bool = False) -> list[dict]:
    """Train `job`. Returns the metrics of this invocation (rank 0; empty on other ranks)."""
    ds_config = validate_run(model_cfg, train, paths, resume)
    parallel.init_parallel(model_cfg.tensor_model_parallel_size, model_cfg.pipeline_model_parallel_size)
    rank = dist.get_rank()
    run_info = {"step": job.step, "recipe": job.recipe, "model": to_dict(model_cfg), "train": to_dict(train),
                "corpus": str(paths.corpus), "ds_config": ds_config, "frozen_from": job.frozen_from,
                "trainable": list(job.trainable) if job.trainable is not None else None, **job.info}
    if rank == 0:
        paths.output_dir.mkdir(parents=True, exist_ok=True)
        (paths.output_dir / "run.json").write_text(json.dumps(run_info, indent=2))
    dist.barrier()
    tok, data_dir = prepare_data(model_cfg, train, paths)
    init_state = job.init(tok) if job.init is not None else None
    parallel.seed_everything(train.seed)
    engine, is_pipe, dims = build_engine(model_cfg, train, ds_config, job, init_state)
    del init_state
    if rank == 0:  # what the job learnt while starting (e.g. shared pieces), and for pipelines
        run_info.update(job.info)  # which stage owns what (layer list: pipeline.py docstring)
        if is_pipe:
            run_info["pipeline_parts"] = [int(x) for x in engine.module.parts]
        (paths.output_dir / "run.json").write_text(json.dumps(run_info, indent=2))
    batches = MLMBatches(data_dir, train.seq_length, model_cfg.vocab_size, train.seed, train.mask_prob,
                         train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps,
                         parallel.dp_rank(), parallel.dp_world())

    partial = job.trainable is not None  # checkpoints hold only the trained parameters
    start = 0
    tag = checkpoint.latest_tag(paths.checkpoints) if resume else None
    if tag is not None:
        start = checkpoint.load(engine, paths.checkpoints, tag, strict=not partial)["step"]
    metrics_file = paths.output_dir / "metrics.jsonl"
    if rank == 0:  # drop metrics of steps after the checkpoint we resume from
        kept = [l for l in (metrics_file.read_text().splitlines() if metrics_file.is_file() and start else [])
                if json.loads(l)["step"] <= start]
        metrics_file.write_text("".join(l + "\n" for l in kept))

    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(paths.output_dir / "tensorboard"), purge_step=start + 1 if start else None)
    from tqdm import tqdm

    bar = tqdm(total=train.train_iters, initial=start, disable=rank != 0, desc=job.step, unit="upd",
               mininterval=2.0)
    update_flops = batches.global_batch * step_flops(job.step, model_cfg, train.seq_length, train.mask_prob,
                                                     trainable_layers=job.trainable_layers)
    tokens_per_step = batches.global_batch * train.seq_length
    client = {"tp_partition_dims": dims, "model_config": to_dict(model_cfg)}
    out, t_last, steps_since = [], time.perf_counter(), 0
    for step in range(start, train.train_iters):
        per_head = train_step(engine, is_pipe, batches.step_batches(step), len(model_cfg.head_layers))
        done, steps_since = step + 1, steps_since + 1
        if done % train.log_interval == 0 or done == train.train_iters:
            dt = (time.perf_counter() - t_last) / steps_since
            t_last, steps_since = time.perf_counter(), 0
            row = {"step": done, "loss": per_head.mean().item(),
                   "head_losses": {str(l): v for l, v in zip(model_cfg.head_layers, per_head.tolist())},
                   "lr": engine.get_lr()[0], "tokens_per_s": tokens_per_step / dt,
                   "flops_per_s": update_flops / dt, "flops_total": update_flops * done}
            if rank == 0:
                out.append(row)
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
                writer.add_scalar("loss/total", row["loss"], done)
                for l, v in row["head_losses"].items():
                    writer.add_scalar(f"loss/head_layer{l}", v, done)
                writer.add_scalar("lr", row["lr"], done)
                writer.add_scalar("perf/tokens_per_s", row["tokens_per_s"], done)
                writer.add_scalar("perf/achieved_flops_per_s", row["flops_per_s"], done)
                writer.add_scalar("perf/achieved_flops_per_s_per_device", row["flops_per_s"] / dist.get_world_size(), done)
                bar.set_postfix(loss=f"{row['loss']:.3f}")
        bar.update(1)
        exiting = train.exit_interval > 0 and done % train.exit_interval == 0
        if (done % train.save_interval == 0 or done in train.extra_save_steps or done == train.train_iters
                or exiting):
            tag = checkpoint.save(engine, paths.checkpoints, done, client, exclude_frozen=partial)
            if rank == 0 and job.on_save is not None:
                job.on_save(done, tag, batches.global_batch)
        if exiting:
            break
    bar.close()
    if writer is not None:
        writer.close()
    return out
