"""MLM training (Steps 1, 1b and 2) on the shared engine and loop of engine.py.

Step 1 (pretrain: BL_BASE, BL_SMALL, MINIJOINT) trains every parameter from a seeded init.
Step 1b (MINIPOST) and Step 2 (new-language embeddings) start from given full weights and train
only some parameters (`MLMJob.trainable`): the others are frozen and left out of checkpoints
(run.json says where they come from).

This module holds what is MLM-specific: the checks a user can get wrong (`validate_run`, before
any process group, file or directory exists), the tokenizer and encoded blocks
(`prepare_data`), the model or its pipeline form, one update over masked micro-batches
(`mlm_step`), and `train_mlm`, which steps.py calls with the starting weights it computed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from mmadapt import checkpoint, parallel
from mmadapt.config import CHANGEABLE_ON_RESUME, ModelConfig, TrainConfig, to_dict
from mmadapt.data import (MANIFEST, RAW_CORPUS_LIMIT_BYTES, TOKENIZER, VALID, MLMBatches, block_index,
                          block_index_path, check_corpus, check_prepared, corpus_fingerprint, file_sha256,
                          load_tokenizer, prepare, read_manifest, wait_for)
from mmadapt.engine import (build_engine, is_pipeline, load_ds_config, mean_over_ranks, train_loop,
                            trainable_by_names, warmup_linear_decay)
from mmadapt.flops import step_flops
from mmadapt.models.roberta.model import Padding


@dataclasses.dataclass(frozen=True)
class MLMJob:
    """What an MLM run trains. Defaults: Step 1, every parameter, from the model's seeded init."""
    step: str = "pretrain"  # one of flops.STEPS: the FLOP count logged, the progress-bar label
    # RobertaMLM parameter names, or name prefixes ending in ".", that are trained (None: all).
    trainable: tuple[str, ...] | None = None
    trainable_layers: int = 0  # Step 1b: l_t, for its FLOP count


@dataclasses.dataclass
class RunPaths:
    output_dir: Path
    corpus: Path | None  # raw text, prepared into <output_dir>/data (small corpora; None: data_path)
    ds_config: Path
    tokenizer: Path | None = None  # None: train one on the corpus (a data_path has its own)
    data_path: Path | None = None  # a dataset prepared by `mmadapt preprocess`

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recorded_defaults() -> dict:
    """Each config field's default as run.json records it, flattened ("model.head_weights",
    "train.decay_all", "finetune.lr", ...): what a run recorded before that field existed ran with."""
    from mmadapt.config import FinetuneConfig

    configs = {"model": to_dict(ModelConfig()), "train": to_dict(TrainConfig()), "finetune": to_dict(FinetuneConfig())}
    return _flat(json.loads(json.dumps(configs)))


def check_same_run(run_file: Path, expected: dict) -> None:
    """--resume continues the run recorded in `run_file`: every entry of `expected` (nested dicts
    compared leaf by leaf) must equal the recorded one, except config.CHANGEABLE_ON_RESUME. A
    config field the record lacks (it predates the field) matches the field's default."""
    saved = _flat(checkpoint.read_json(run_file, "run file"))
    mine = _flat(json.loads(json.dumps(expected)))  # tuples as lists, as run.json holds them
    defaults = None
    for key, value in mine.items():
        if key.rsplit(".", 1)[-1] in CHANGEABLE_ON_RESUME or saved.get(key) == value:
            continue
        if key not in saved:
            defaults = defaults or recorded_defaults()
            if key in defaults and defaults[key] == value:
                continue
        raise ValueError(f"--resume of a changed run: {key} is {value} here but {saved.get(key)} in {run_file}; "
                         "resume with the run's settings, or start a new --output_dir")


def validate_run(model: ModelConfig, train: TrainConfig, paths: RunPaths, resume: bool,
                 same: dict | None = None) -> dict:
    """All user-facing checks, before any side effect. Returns the DeepSpeed config dict.
    same: more run.json entries a --resume must match (where a step's weights come from)."""
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
    if model.pipeline_model_parallel_size > 1 and model.tensor_model_parallel_size > 1 and len(model.heads_after) > 1:
        # With tensor parallelism DeepSpeed splits the first tensor sent between stages across the
        # TP ranks and asserts that no other tensor of the tuple needs a gradient; the carried
        # output of an intermediate head's layer does (pipeline.py), so send whole tensors.
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    if paths.data_path is not None:
        manifest = check_prepared(paths.data_path, model.vocab_size, paths.tokenizer)
        if train.eval_interval and not manifest.get("valid"):
            raise ValueError(f"--eval_interval needs validation data: {paths.data_path} was prepared without it "
                             "(mmadapt preprocess --valid_fraction 0.01 ... into a new --output_dir)")
    else:
        if paths.corpus is None:
            raise ValueError("no training data: pass --data_path (a dataset made by mmadapt preprocess) or --corpus")
        corpus = check_corpus(paths.corpus)
        if corpus.stat().st_size > RAW_CORPUS_LIMIT_BYTES:
            prepared = corpus.with_name(corpus.name + ".prepared")
            tok = f" --tokenizer {paths.tokenizer}" if paths.tokenizer else ""
            raise ValueError(f"corpus {corpus} is {corpus.stat().st_size / 2**30:.1f} GiB: prepare it once first with "
                             f"`mmadapt preprocess --corpus {corpus} --output_dir {prepared} --vocab_size "
                             f"{model.vocab_size}{tok}`, then pass --data_path {prepared}")
        if paths.tokenizer is not None:
            load_tokenizer(paths.tokenizer, model.vocab_size)
        if train.eval_interval:
            raise ValueError("--eval_interval needs validation data: prepare the corpus with mmadapt preprocess "
                             "--valid_fraction 0.01 and pass --data_path")
    checkpoint.refuse_overwrite(paths.output_dir, resume)
    run_file = paths.output_dir / "run.json"
    if resume and run_file.is_file():
        if paths.data_path is not None:
            data = {"data_path": str(Path(paths.data_path).resolve())}
        else:
            data = {"data_path": str((paths.output_dir / "data").resolve()), "corpus": str(paths.corpus.resolve())}
            manifest = paths.output_dir / "data" / MANIFEST
            if manifest.is_file() and corpus_fingerprint(paths.corpus) != read_manifest(manifest.parent)[
                    "corpus_fingerprint"]:
                raise ValueError(f"--resume: corpus {paths.corpus} changed since this run encoded it into "
                                 f"{manifest.parent}; resume with the original text, or start a new --output_dir")
        check_same_run(run_file, {"model": to_dict(model), "train": to_dict(train), **data, "ds_config": ds,
                                  **(same or {})})
        if paths.tokenizer is not None and (paths.output_dir / "tokenizer" / "spm.model").is_file() \
                and file_sha256(paths.tokenizer) != file_sha256(paths.output_dir / "tokenizer" / "spm.model"):
            raise ValueError(f"--resume with another tokenizer: {paths.tokenizer} is not the run's "
                             f"{paths.output_dir / 'tokenizer' / 'spm.model'}")
    return ds


def prepare_data(model: ModelConfig, train: TrainConfig, paths: RunPaths) -> tuple[Path, Path]:
    """-> (tokenizer, prepared dataset) of the run, with the block index for train.seq_length.

    Runs before any process group exists, so no rank waits in a collective (whose timeout would
    kill a job that prepares for longer): global rank 0 prepares a raw --corpus into
    <output_dir>/data (once; `mmadapt preprocess` does the same for large corpora, ahead of the
    job) and builds the block index, while the other ranks poll the file system. Like DeepSpeed's
    checkpoints, this assumes a file system that all nodes share."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    data_path = paths.data_path or paths.output_dir / "data"
    if paths.data_path is None:
        if rank0:
            prepare(paths.corpus, data_path, model.vocab_size, tokenizer=paths.tokenizer, seed=train.seed)
        wait_for(data_path / MANIFEST, f"the corpus in {data_path}")
    blocks = block_index_path(data_path, train.seq_length)
    if rank0:
        block_index(data_path, train.seq_length)
        if train.eval_interval:
            block_index(data_path, train.seq_length, VALID)
    wait_for(blocks, f"the block index {blocks}")
    return data_path / TOKENIZER, data_path


def build_mlm(model_cfg: ModelConfig, seed: int) -> tuple[torch.nn.Module, dict[str, str | None]]:
    """This rank's model (or pipeline stage) and its parameter names -> RobertaMLM names."""
    from mmadapt.models.roberta.model import RobertaMLM

    if model_cfg.pipeline_model_parallel_size > 1:
        from mmadapt.models.roberta.pipeline import pipeline_param_name, to_pipeline

        module = to_pipeline(model_cfg, seed, parallel.dp_world())
        return module, {n: pipeline_param_name(n, model_cfg) for n, _ in module.named_parameters()}
    module = RobertaMLM(model_cfg, seed=seed)
    return module, {n: n for n, _ in module.named_parameters()}


def mlm_engine(model_cfg: ModelConfig, train: TrainConfig, ds_config: dict, job: MLMJob = MLMJob(),
               init_state: dict | None = None):
    """-> (engine, names, tp_partition_dims). parallel.init_parallel must have run."""
    from mmadapt.fusion import apply_fusion

    module, names = build_mlm(model_cfg, train.seed)
    apply_fusion(module, model_cfg)
    engine, dims = build_engine(module, names, trainable_by_names(job.trainable), train, train.lr,
                                warmup_linear_decay(train.lr_warmup_iters, train.train_iters), ds_config,
                                init_state)
    return engine, names, dims


class HostBatch(NamedTuple):
    """One MLM micro-batch as the host prepares it: everything a step needs to know about the
    batch is computed here, on CPU tensors, so that no layer has to ask the device (a boolean
    gather or `.any()` on a device tensor blocks the host until the device catches up)."""
    input_ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s], -100 where not masked (the pipeline carries them)
    masked_index: torch.Tensor  # [m] flat indices into b * s of the masked positions
    targets: torch.Tensor  # [m]
    padding: Padding


def host_batch(input_ids: torch.Tensor, labels: torch.Tensor, pin: bool = False) -> HostBatch:
    """pin: page-locked copies, which the device reads asynchronously (non_blocking copies)."""
    from mmadapt.models.roberta.model import masked_positions

    b = HostBatch(input_ids, labels, *masked_positions(labels), Padding.of(input_ids))
    return b._replace(**{k: getattr(b, k).pin_memory() for k in _TENSORS}) if pin else b


_TENSORS = ("input_ids", "labels", "masked_index", "targets")


def to_device(batch: HostBatch, dev: torch.device) -> HostBatch:
    """Asynchronous when the host copy is pinned (`host_batch(..., pin=True)`): the step queues on."""
    return batch._replace(**{k: getattr(batch, k).to(dev, non_blocking=True) for k in _TENSORS})


class Prefetcher:
    """Builds the host batches of the next update (numpy indexing, masking, pinning) in a
    background thread while the device runs this one. `make(position)` must be a pure
    function of the position (MLMBatches is), so a resumed run sees the same batches."""

    def __init__(self, make: Callable[[int], list]):
        from concurrent.futures import ThreadPoolExecutor

        self.make, self.pool, self.ahead = make, ThreadPoolExecutor(1, thread_name_prefix="batches"), None

    def __call__(self, position: int) -> list:
        if self.ahead is not None and self.ahead[0] == position:
            out = self.ahead[1].result()
        else:
            out = self.make(position)
        self.ahead = (position + 1, self.pool.submit(self.make, position + 1))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _prepared(batches: list) -> list[HostBatch]:
    """(input_ids, labels) pairs become HostBatches; HostBatches stay as they are."""
    return [b if isinstance(b, HostBatch) else host_batch(*b) for b in batches]


def _pipe_batches(engine, batches: list[HostBatch], dev) -> iter:
    """Micro-batches as DeepSpeed's pipeline takes them, ((inputs...), labels), after handing
    this stage what the host knows about them (pipeline.set_host_batches)."""
    from mmadapt.models.roberta.pipeline import set_host_batches

    on_dev = [to_device(b, dev) for b in batches]
    set_host_batches(engine.module, [b.padding for b in batches], [(b.masked_index, b.targets) for b in on_dev])
    return iter([((b.input_ids, b.labels), b.labels) for b in on_dev])


def _pipe_head_losses(engine, num_heads: int) -> torch.Tensor:
    """Each head's loss over the micro-batches just run, on the last stage (which holds the
    heads); zeros on the other stages."""
    from mmadapt.models.roberta.pipeline import PipeMLMHeads

    heads = next((m for m in engine.module.modules() if isinstance(m, PipeMLMHeads)), None)
    per_head = torch.zeros(num_heads, device=engine.device)
    if heads is not None:
        per_head += torch.stack(heads.head_losses).mean(0)
        heads.head_losses.clear()
    return per_head


def mlm_step(engine, batches, num_heads: int) -> torch.Tensor:
    """One update over this rank's micro-batches. Returns this rank's loss of each head, the mean
    over its micro-batches (pipeline: zeros except on the last stage), not reduced over ranks."""
    dev = engine.device
    batches = _prepared(batches)
    if is_pipeline(engine):
        engine.train_batch(_pipe_batches(engine, batches, dev))
        return _pipe_head_losses(engine, num_heads)
    per_head = torch.zeros(num_heads, device=dev)
    for b in map(functools.partial(to_device, dev=dev), batches):
        loss, heads_loss = engine(b.input_ids, masked_index=b.masked_index, targets=b.targets,
                                  padding=b.padding)
        engine.backward(loss)
        engine.step()
        per_head += heads_loss / len(batches)
    return per_head


@torch.no_grad()
def mlm_eval(engine, batches, num_heads: int) -> torch.Tensor:
    """Each head's mean loss over `batches` with dropout off, this rank's (pipeline: the last
    stage's), not reduced over ranks. Consumes no random numbers: training resumes exactly."""
    dev = engine.device
    engine.eval()
    try:
        batches = _prepared(batches)
        if is_pipeline(engine):
            engine.eval_batch(_pipe_batches(engine, batches, dev), num_micro_batches=len(batches))
            return _pipe_head_losses(engine, num_heads)
        per_head = torch.zeros(num_heads, device=dev)
        for b in map(functools.partial(to_device, dev=dev), batches):
            per_head += engine(b.input_ids, masked_index=b.masked_index, targets=b.targets,
                               padding=b.padding)[1] / len(batches)
        return per_head
    finally:
        engine.train()


def train_step(engine, batches, num_heads: int) -> torch.Tensor:
    """mlm_step, averaged over the data-parallel replicas (every rank gets the result)."""
    return mean_over_ranks(mlm_step(engine, batches, num_heads), is_pipeline(engine))


def train_mlm(model_cfg: ModelConfig, train: TrainConfig, paths: RunPaths, ds_config: dict, data_dir: Path,
              run_info: dict, job: MLMJob = MLMJob(), init_state: dict | None = None, resume: bool = False,
              after_save: Callable[[int, str], None] | None = None) -> list[dict]:
    """Train an MLM job on the encoded blocks in `data_dir`, starting from `init_state` (full
    weights; None: the seeded init). run.json gets `run_info` and the training settings.
    Returns the metrics of this invocation (global rank 0; empty on other ranks)."""
    parallel.seed_everything(train.seed)
    engine, names, dims = mlm_engine(model_cfg, train, ds_config, job, init_state)
    run_file = paths.output_dir / "run.json"
    if dist.get_rank() == 0 and not (resume and run_file.is_file()):  # a resumed run's record stays as it is
        tok = paths.output_dir / "tokenizer" / "spm.model"  # what later steps read
        tok.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_dir / TOKENIZER, tok)
        info = {**run_info, "step": job.step, "model": to_dict(model_cfg), "train": to_dict(train),
                "data_path": str(data_dir.resolve()), "corpus": json.loads((data_dir / MANIFEST).read_text())["corpus"],
                "ds_config": ds_config,
                "trainable": list(job.trainable) if job.trainable is not None else None}
        if model_cfg.pipeline_model_parallel_size > 1:  # which stage owns what (pipeline.py docstring)
            info["pipeline_parts"] = [int(x) for x in engine.module.parts]
        checkpoint.atomic_write(run_file, json.dumps(info, indent=2))
    batches = MLMBatches(data_dir, train.seq_length, model_cfg.vocab_size, train.seed, train.mask_prob,
                         train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps,
                         parallel.dp_rank(), parallel.dp_world())
    update_flops = batches.global_batch * step_flops(job.step, model_cfg, train.seq_length, train.mask_prob,
                                                     trainable_layers=job.trainable_layers)
    tokens = batches.global_batch * train.seq_length
    world = dist.get_world_size()

    def perf(seconds: float) -> dict:
        return {"tokens_per_s": tokens / seconds, "flops_per_s": update_flops / seconds,
                "flops_per_s_per_device": update_flops / seconds / world}

    heads, pin = len(model_cfg.heads_after), engine.device.type == "cuda"
    evaluate = None
    if train.eval_interval:
        valid = MLMBatches(data_dir, train.seq_length, model_cfg.vocab_size, train.seed, train.mask_prob,
                           train.train_micro_batch_size_per_gpu, 1, parallel.dp_rank(), parallel.dp_world(), VALID)
        valid_batches = [host_batch(*valid.micro_batch(k, 0), pin) for k in range(train.eval_iters)]  # the same each time
        evaluate = functools.partial(mlm_eval, engine, valid_batches, heads)
    prefetch = Prefetcher(lambda position: [host_batch(ids, lab, pin) for ids, lab in batches.step_batches(position)])
    try:
        return train_loop(engine, lambda step: mlm_step(engine, prefetch(step), heads),
                          total=train.train_iters, run_dir=paths.output_dir, resume=resume,
                          log_interval=train.log_interval, save_interval=train.save_interval,
                          exit_interval=train.exit_interval, extra_save_steps=train.extra_save_steps,
                          keep_last=train.keep_last, max_skipped_steps=train.max_skipped_steps,
                          loss_names=tuple(str(l) for l in model_cfg.heads_after),
                          loss_weights=model_cfg.loss_weights, perf=perf,
                          client_state={"tp_partition_dims": dims, "model_config": to_dict(model_cfg)}, names=names,
                          exclude_frozen=job.trainable is not None, label=job.step, after_save=after_save,
                          evaluate=evaluate, eval_interval=train.eval_interval)
    finally:
        prefetch.close()
