"""The paper's steps as library functions: what the CLI, the launch/ scripts and the demo call.

    pretrain          Step 1: BL_BASE, BL_SMALL or MINIJOINT from a seeded init
    build_minipost    Step 1b: bottom N layers of a pretrained model + K new layers, only those trained
    adapt_embeddings  Step 2: new-language embeddings (tied to the output projection) over a frozen model
    sweep             Step 2 over each mini-model of a multi-depth MINIJOINT run, scored by the plug-in
                      metric against Step-2 compute: the cheapest depth that transfers
    finetune          Step 3: the primary model on a source-language task, word embeddings frozen
    evaluate          Step 4: swap each Step-2 artifact in, score zero-shot

Each takes config dataclasses and paths, checks everything a user can get wrong before any
side effect, computes what it records in run.json itself, and returns what it produced. The
training steps need torch.distributed: `parallel.init_parallel` is called once per process (here,
or earlier by the caller with the same layout) and its groups are never rebuilt. Evaluation
needs no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mmadapt import adapt as A
from mmadapt import checkpoint, parallel
from mmadapt.config import (DEFAULT_DS_CONFIG, LAYOUT_FIELDS, FinetuneConfig, MiniModelConfig, ModelConfig,
                            PreprocessConfig, TrainConfig, to_dict)
from mmadapt.corpora import resolve_corpus
from mmadapt.models.roberta.model import Padding
from mmadapt.sweep import SweepConfig
from mmadapt.train import MLMJob, RunPaths, check_same_run, prepare_data, train_mlm, validate_run


def _with_layout(cfg: ModelConfig, layout: dict | None, allowed: tuple[str, ...] = LAYOUT_FIELDS) -> ModelConfig:
    layout = {k: v for k, v in (layout or {}).items() if v is not None}
    bad = sorted(set(layout) - set(allowed))
    if bad:
        raise ValueError(f"{bad[0]} comes from the source run and cannot be changed here; settable: "
                         f"{', '.join(allowed)}")
    return dataclasses.replace(cfg, **layout)


def checkpoint_tag(run_dir: Path, tag: str | None) -> str:
    """`tag` if `run_dir` has it complete, else (tag None) its newest complete checkpoint."""
    tags = checkpoint.complete_tags(Path(run_dir) / "checkpoints")
    if tag is not None and tag not in tags:
        raise ValueError(f"{run_dir} has no complete checkpoint {tag}; it has {', '.join(tags) or 'none'}")
    if not tags:
        raise ValueError(f"{run_dir} has no complete checkpoint yet: let its run save one first")
    return tag or tags[-1]


@contextlib.contextmanager
def _start(model: ModelConfig, train: TrainConfig, paths: RunPaths, resume: bool, same: dict | None = None):
    """Checks, then the run directory's lock (global rank 0, held until the step returns), the
    prepared data (before any process group: see train.prepare_data), then the process groups:
    what every MLM step does before it can compute its starting weights. Yields (DeepSpeed
    config, tokenizer, prepared dataset). same: see train.validate_run."""
    if paths.corpus is not None:  # bible:<lang> -> the packaged Bible, written once
        paths.corpus = resolve_corpus(paths.corpus)
    ds_config = validate_run(model, train, paths, resume, same)
    with _run_lock(paths.output_dir):
        tok, data_dir = prepare_data(model, train, paths)
        parallel.init_parallel(model.tensor_model_parallel_size, model.pipeline_model_parallel_size)
        yield ds_config, tok, data_dir


@contextlib.contextmanager
def _run_lock(output_dir: Path):
    """Global rank 0 creates `output_dir` and holds its lock (faults.RunLock) meanwhile."""
    from mmadapt.faults import RunLock

    lock, created = RunLock(output_dir), not Path(output_dir).exists()
    if int(os.environ.get("RANK", 0)) == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        yield
    except ValueError:
        # A user's mistake found late (a corpus SentencePiece cannot train on, an unreadable
        # source checkpoint): a directory this call created and that holds no checkpoint goes.
        if lock.held and created and not checkpoint.has_checkpoints(Path(output_dir) / "checkpoints"):
            lock.release()
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


# --- data --------------------------------------------------------------------------------------------

def preprocess(corpus: Path, output_dir: Path, vocab_size: int, cfg: PreprocessConfig = PreprocessConfig(),
               tokenizer: Path | None = None) -> dict:
    """Prepare `corpus` once (data.prepare): what `--data_path` of every training step reads.
    A no-op when `output_dir` already holds it. -> the dataset's manifest. Needs no process group."""
    from mmadapt.data import prepare

    return prepare(resolve_corpus(corpus), output_dir, vocab_size, tokenizer=tokenizer, workers=cfg.workers,
                   tokenizer_sample_lines=cfg.tokenizer_sample_lines, seed=cfg.tokenizer_seed,
                   valid_fraction=cfg.valid_fraction)


# --- Step 1 -----------------------------------------------------------------------------------------

def _step2_only(train: TrainConfig, step: str) -> None:
    if not train.train_output_bias:
        raise ValueError(f"train_output_bias is a Step-2 setting; {step} trains its own parameters: drop the flag")


def pretrain(model: ModelConfig, train: TrainConfig, paths: RunPaths, recipe: str = "custom",
             resume: bool = False) -> list[dict]:
    """Step 1. `model` is already shaped by its recipe (config.apply_recipe). Returns the
    metrics rows of this invocation (global rank 0; empty elsewhere)."""
    _step2_only(train, "pretrain")
    with _start(model, train, paths, resume, {"recipe": recipe}) as (ds_config, _, data_dir):
        return train_mlm(model, train, paths, ds_config, data_dir, {"recipe": recipe}, MLMJob(), resume=resume)


# --- Step 1b ----------------------------------------------------------------------------------------

def build_minipost(primary: Path, output_dir: Path, train: TrainConfig, mini: MiniModelConfig = MiniModelConfig(),
                   layout: dict | None = None, ds_config: Path = DEFAULT_DS_CONFIG, corpus: Path | None = None,
                   primary_tag: str | None = None, resume: bool = False, data_path: Path | None = None) -> list[dict]:
    """Step 1b (MINIPOST): the bottom N layers, embeddings and primary MLM head of `primary`,
    K new layers on top, only those trained with source-language MLM (default data: the primary
    run's prepared dataset, encoded once for every source-language step)."""
    mini.one_depth("build_minipost")
    _step2_only(train, "build_minipost")
    primary = Path(primary).resolve()
    src = A.read_run(primary)
    tag = checkpoint_tag(primary, primary_tag)
    cfg, _ = A.minipost_layout(ModelConfig(**src["model"]), {}, mini.mini_layers, mini.new_layers)
    model = _with_layout(cfg, layout)
    if model.pipeline_model_parallel_size > 1:
        # Stage 0 would hold only frozen modules, and DeepSpeed's pipeline backward needs a
        # gradient on every stage. The mini-model is a fraction of the primary: it fits one device.
        raise ValueError("build_minipost does not use pipeline parallelism (the mini-model fits one device): use "
                         "--pipeline_model_parallel_size 1 with data or tensor parallelism")
    if data_path is None and corpus is None:
        data_path = Path(src["data_path"]) if src.get("data_path") else None
        if data_path is None and not src.get("corpus"):
            raise ValueError(f"{primary} was imported (mmadapt import-hf), so it has no pretraining data: pass "
                             "source-language text with --corpus or --data_path")
        corpus = None if data_path is not None else Path(src["corpus"])
    paths = RunPaths(output_dir=Path(output_dir), corpus=Path(corpus) if corpus else None, ds_config=Path(ds_config),
                     tokenizer=primary / "tokenizer" / "spm.model", data_path=Path(data_path) if data_path else None)
    info = {"recipe": "minipost", "frozen_from": {"run_dir": str(primary), "tag": tag, **dataclasses.asdict(mini)}}
    with _start(model, train, paths, resume, info) as (ds, _, data_dir):
        _, init = A.minipost_layout(*A.load_model(primary, tag), mini.mini_layers, mini.new_layers)
        job = MLMJob(step="minipost", trainable=A.minipost_trainable(mini.mini_layers, mini.new_layers),
                     trainable_layers=mini.new_layers)
        return train_mlm(model, train, paths, ds, data_dir, info, job, init, resume)


# --- Step 2 -----------------------------------------------------------------------------------------

def adapt_embeddings(system: str, source: Path, lang: str, output_dir: Path, train: TrainConfig,
                     layout: dict | None = None, ds_config: Path = DEFAULT_DS_CONFIG, corpus: Path | None = None,
                     tokenizer: Path | None = None, vocab_size: int | None = None, source_tag: str | None = None,
                     resume: bool = False, data_path: Path | None = None, mini_layers: int | None = None
                     ) -> list[dict]:
    """Step 2: new `lang` embeddings and output bias over the frozen model of `system`, from
    the source run `source`. Writes an artifact (embeddings.pt, spm.model, meta.json) under
    <output_dir>/embeddings/<tag> at every checkpoint: what Step 4 swaps in.

    mini_layers (minijoint): the depth N of the source's mini-model to train over, one of its
    secondary heads (default: its only one; a run with several needs it, adapt.mini_depth).

    data_path: the target language's prepared dataset (mmadapt preprocess; its tokenizer is the
    target vocabulary); else corpus (default: the packaged Bible, bible:<lang>) with tokenizer,
    an existing target SentencePiece model (default: one trained on the corpus). vocab_size: the
    target vocabulary (default: the dataset's or tokenizer's size, else the source model's)."""
    from mmadapt.data import load_tokenizer, read_manifest

    if system not in A.SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(A.SYSTEMS)}")
    source = Path(source).resolve()
    src = A.read_run(source)
    if src.get("recipe") not in A.SOURCE_RECIPES[system]:
        raise ValueError(f"--system {system} adapts a run with recipe {' or '.join(A.SOURCE_RECIPES[system])}, "
                         f"but {source} has recipe {src.get('recipe')}")
    tag = checkpoint_tag(source, source_tag)
    src_cfg = ModelConfig(**src["model"])
    body_cfg, _ = A.adapt_body(system, src_cfg, {}, mini_layers)
    if vocab_size is None:
        if data_path is not None:
            vocab_size = read_manifest(data_path)["vocab_size"]
        elif tokenizer is not None and Path(tokenizer).is_file():
            vocab_size = load_tokenizer(tokenizer).get_piece_size()
        else:
            vocab_size = body_cfg.vocab_size
    model = dataclasses.replace(_with_layout(body_cfg, layout), vocab_size=vocab_size)
    out = Path(output_dir)
    paths = RunPaths(output_dir=out, corpus=None if data_path else Path(corpus or f"bible:{lang}"),
                     ds_config=Path(ds_config), tokenizer=Path(tokenizer) if tokenizer else None,
                     data_path=Path(data_path) if data_path else None)
    same = {"system": system, "lang": lang, "frozen_from": {"run_dir": str(source), "tag": tag, "system": system}}
    # Which mini-model (MINIJOINT): its depth, and every depth the source offers (artifact labels).
    depth = {"mini_layers": body_cfg.num_layers, "mini_depths": list(src_cfg.heads_after[:-1])} \
        if system == "minijoint" else {}
    with _start(model, train, paths, resume, same) as (ds, tok, data_dir):
        return _adapt(system, source, tag, lang, model, train, paths, ds, tok, data_dir, resume, same, depth)


def _adapt(system: str, source: Path, tag: str, lang: str, model: ModelConfig, train: TrainConfig, paths: RunPaths,
           ds: dict, tok: Path, data_dir: Path, resume: bool, same: dict, depth: dict) -> list[dict]:
    """adapt_embeddings once its checks passed and its process groups exist."""
    from mmadapt.flops import adapt_flops, device_days
    from mmadapt.models.roberta.model import derive_seed

    out = paths.output_dir
    _, init, shared = A.step2_start(system, source, tag, tok, model.init_method_std,
                                    derive_seed(train.seed, f"embeddings.{lang}"), depth.get("mini_layers"))
    if dist.get_rank() == 0:
        print(f"new {lang} embeddings: {shared} of {model.vocab_size} pieces copied from the source vocabulary, "
              f"{model.vocab_size - shared} drawn from N(0, {model.init_method_std})")
    info = {"recipe": system, **same, **depth, "shared_pieces": shared, "target_vocab_size": model.vocab_size}
    trainable = A.adapt_trainable(train.train_output_bias)
    seq_flops = {p: adapt_flops(model, train.seq_length, train.mask_prob, paper=p) for p in (False, True)}
    global_batch = train.train_micro_batch_size_per_gpu * train.gradient_accumulation_steps * parallel.dp_world()

    def write_artifact(step: int, ckpt_tag: str) -> None:
        sd = checkpoint.load_full_state_dict(paths.checkpoints, ckpt_tag)  # fp32 master weights
        flops = seq_flops[False] * global_batch * step
        meta = {"system": system, "lang": lang, "step": step, "source": str(source), "source_tag": tag,
                "mini_layers": model.num_layers, **depth, "hidden_size": model.hidden_size,
                "vocab_size": model.vocab_size, "train_output_bias": train.train_output_bias,
                "shared_pieces": shared, "global_batch": global_batch, "seq_length": train.seq_length,
                "tokens": global_batch * train.seq_length * step, "flops": flops,
                "flops_paper": seq_flops[True] * global_batch * step, "v100_days": device_days(flops)}
        # A frozen bias (train_output_bias false) is not in the checkpoint: it is still its start.
        bias = sd[A.BIAS] if A.BIAS in trainable else init[A.BIAS]
        A.write_artifact(out / "embeddings" / ckpt_tag, sd[A.WORD].float(), bias.float(), tok, meta)

    job = MLMJob(step="adapt", trainable=trainable)
    return train_mlm(model, train, paths, ds, data_dir, info, job, init, resume, after_save=write_artifact)


# --- Step 3 -----------------------------------------------------------------------------------------

def finetune(task: str, primary: Path, output_dir: Path, cfg: FinetuneConfig = FinetuneConfig(),
             train_file: str | None = None, eval_file: str | None = None, source_lang: str = "en",
             layout: dict | None = None, ds_config: Path = DEFAULT_DS_CONFIG, primary_tag: str | None = None,
             resume: bool = False) -> tuple[dict, torch.nn.Module]:
    """Step 3: the primary model of a pretrain run + a new task head, everything but the word
    embeddings trained through the DeepSpeed engine (data parallel, ZeRO, megatron tensor
    parallel), with periodic checkpoints and exact --resume. Returns the run summary (as in
    run.json; with `source_score` when `eval_file` is given) and the trained module (this rank's
    tensor-parallel shard)."""
    from mmadapt import finetune as F
    from mmadapt.engine import load_ds_config

    # --- checks before any side effect
    t = F.get_task(task)
    train_file = train_file or ("bible" if t.name.startswith("bible-") else None)
    if train_file is None:
        raise ValueError(f"--train_file is required for {t.name} (see mmadapt/tasks.py for the data)")
    primary, output_dir = Path(primary).resolve(), Path(output_dir)
    src = A.read_run(primary)
    if src.get("step") != "pretrain":
        raise ValueError(f"{primary} is a {src.get('step')} run: fine-tune the primary model of a pretrain run")
    tag = checkpoint_tag(primary, primary_tag)
    model_cfg = _with_layout(dataclasses.replace(ModelConfig(**src["model"]), head_layers=(), head_weights=()),
                             layout).validate()
    if model_cfg.pipeline_model_parallel_size > 1:
        raise ValueError("fine-tuning does not use pipeline parallelism (a model replica fits one device): "
                         "use --pipeline_model_parallel_size 1 with data or tensor parallelism")
    cfg.validate(model_cfg)
    ds = load_ds_config(ds_config, cfg)
    parallel.check_world_size(int(os.environ.get("WORLD_SIZE", 1)), model_cfg.tensor_model_parallel_size, 1)
    checkpoint.refuse_overwrite(output_dir, resume)
    tokenizer = primary / "tokenizer" / "spm.model"
    examples = F.read_examples(t, train_file, source_lang, "train", cfg)
    labels = F.label_names(t, examples)
    metric = F.headline(t, labels, cfg)
    enc = F.encode(t, F.load_sp(tokenizer), examples, labels, cfg)
    eval_examples = F.read_examples(t, eval_file, source_lang, "test", cfg, labels) if eval_file else None
    lr = cfg.lr or t.lr

    parallel.init_parallel(model_cfg.tensor_model_parallel_size, 1)
    rank = dist.get_rank()
    global_batch = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * parallel.dp_world()
    updates = max(1, math.ceil(cfg.epochs * len(enc) / global_batch))
    summary = {"step": "finetune", "task": t.name, "labels": labels, "metric": metric, "source_lang": source_lang,
               "train": train_file, "train_examples": len(examples), "train_rows": len(enc), "updates": updates,
               "global_batch": global_batch, "lr": lr, "primary": {"run_dir": str(primary), "tag": tag},
               "model": to_dict(model_cfg), "finetune": to_dict(cfg), "ds_config": ds}
    run_file = output_dir / "run.json"
    if resume and run_file.is_file():
        check_same_run(run_file, summary)
    with _run_lock(output_dir):
        if rank == 0 and not (resume and run_file.is_file()):
            checkpoint.atomic_write(run_file, json.dumps(summary, indent=2))
        dist.barrier()
        return _finetune(t, cfg, model_cfg, primary, tag, output_dir, labels, metric, enc, eval_examples, lr,
                         updates, global_batch, summary, ds, resume)


def _finetune(t, cfg: FinetuneConfig, model_cfg: ModelConfig, primary: Path, tag: str, output_dir: Path,
              labels: list, metric: str, enc, eval_examples, lr: float, updates: int, global_batch: int,
              summary: dict, ds: dict, resume: bool) -> tuple[dict, torch.nn.Module]:
    """finetune once its checks passed, its process groups exist and its run.json is written."""
    from mmadapt import finetune as F
    from mmadapt.data import EpochOrder, micro_batch_range
    from mmadapt.engine import build_engine, train_loop, trainable_by_names, warmup_linear_decay
    from mmadapt.fusion import apply_fusion

    rank = dist.get_rank()

    # --- model: primary weights, a seeded task head, word embeddings frozen
    parallel.seed_everything(cfg.seed)
    _, state = F.primary_state(primary, tag)
    module = apply_fusion(F.task_model(model_cfg, t, len(labels), cfg.seed), model_cfg)
    names = {n: n for n, _ in module.named_parameters()}
    engine, dims = build_engine(module, names, trainable_by_names(F.FINETUNE_TRAINABLE), cfg, lr,
                                warmup_linear_decay(round(cfg.warmup_ratio * updates), updates), ds, state)
    del state
    order, dev = EpochOrder(len(enc), cfg.seed), engine.device

    def step_fn(step: int) -> torch.Tensor:
        loss_sum = torch.zeros(1, device=dev)
        for j in range(cfg.gradient_accumulation_steps):
            idx = [order(g) for g in micro_batch_range(step, j, cfg.train_micro_batch_size_per_gpu,
                                                       cfg.gradient_accumulation_steps, parallel.dp_rank(),
                                                       parallel.dp_world())]
            ids = enc.input_ids[idx]  # padding counted here, on the host: no device sync per micro-batch
            loss, _ = engine(ids.to(dev, non_blocking=True), enc.labels[idx].to(dev, non_blocking=True),
                             padding=Padding.of(ids))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach() / cfg.gradient_accumulation_steps
        return loss_sum

    train_loop(engine, step_fn, total=updates, run_dir=output_dir, resume=resume, log_interval=cfg.log_interval,
               save_interval=cfg.save_interval, exit_interval=cfg.exit_interval, keep_last=cfg.keep_last,
               max_skipped_steps=cfg.max_skipped_steps, perf=lambda seconds: {"examples_per_s": global_batch / seconds},
               client_state={"tp_partition_dims": dims, "model_config": to_dict(model_cfg)}, names=names,
               exclude_frozen=True, label=f"finetune {t.name}")
    if F.is_finished(output_dir):
        if rank == 0:
            rows = [json.loads(l) for l in (output_dir / "metrics.jsonl").read_text().splitlines()]
            summary["final_loss"] = rows[-1]["loss"] if rows else None
            if eval_examples is not None:
                # The source-language score of exactly the saved (fp32) model, on this rank alone:
                # a TP=1 model needs no process group, so the others just wait.
                scores = F.evaluate_scores(F.load_finetuned(output_dir), eval_examples, cfg)
                summary["source_score"], summary["source_scores"] = scores[metric], scores
            checkpoint.atomic_write(output_dir / "run.json", json.dumps(summary, indent=2))
        dist.barrier()
    return summary, engine.module


# --- Step 4 -----------------------------------------------------------------------------------------

def evaluate(finetuned: list[Path], embeddings: list[Path], eval_file: str, output: Path | None = None,
             eval_batch_tokens: int | None = None) -> list[dict]:
    """Step 4: zero-shot scores of every Step-2 artifact (or every artifact of an adapt run),
    averaged over the fine-tuned runs (seeds) of one primary model. Writes the records to
    `output` (which must not exist) when given. eval_batch_tokens None: each run's own. Needs no
    process group."""
    from mmadapt.finetune import evaluate_artifacts

    if output is not None and Path(output).exists():
        raise ValueError(f"{output} already exists: choose a new --output (records are never overwritten)")
    records = evaluate_artifacts([Path(r) for r in finetuned], [Path(e) for e in embeddings], eval_file,
                                 eval_batch_tokens)
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(records, indent=1) + "\n")
    return records


def evaluate_plugin(primary: Path, embeddings: list[Path], data: str, output: Path | None = None,
                    seq_length: int = 64, blocks: int = 256) -> list[dict]:
    """Step 4's plug-in MLM metric (plugin.py): every artifact through `primary`'s primary head,
    scored on the validation split of the dataset `data` ({lang}: each artifact's language)
    against the unigram reference. Writes the records to `output` (which must not exist) when
    given. Needs no process group."""
    from mmadapt.finetune import artifact_dirs
    from mmadapt.plugin import plugin_records

    if output is not None and Path(output).exists():
        raise ValueError(f"{output} already exists: choose a new --output (records are never overwritten)")
    A.read_run(primary)
    langs = {checkpoint.read_json(p / "meta.json", "Step-2 artifact file")["lang"]
             for p in artifact_dirs([Path(e) for e in embeddings])}
    records = plugin_records(Path(primary), [Path(e) for e in embeddings],
                             {lang: Path(data.replace("{lang}", lang)) for lang in langs}, seq_length, blocks)
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(records, indent=1) + "\n")
    return records


# --- beyond the paper: the depth sweep ------------------------------------------------------------

def _finished(run_dir: Path, iters: int) -> str:
    """'done' (its last checkpoint is update `iters`), 'resume' (an interrupted run) or 'new'."""
    ckpt = Path(run_dir) / "checkpoints"
    if checkpoint.latest_tag(ckpt) == checkpoint.tag_for(iters):
        return "done"
    return "resume" if checkpoint.has_checkpoints(ckpt) else "new"


def sweep(source: Path, lang: str, output_dir: Path, train: TrainConfig, data_path: Path,
          mini_layers: tuple[int, ...] | None = None, cfg: SweepConfig | None = None, layout: dict | None = None,
          ds_config: Path = DEFAULT_DS_CONFIG, source_tag: str | None = None) -> dict | None:
    """Step 2 over each mini-model of a MINIJOINT run (`mini_layers`, default: every secondary
    head) on `lang`, into <output_dir>/<N>/ (and, with cfg.ceiling, over its full primary model
    into <output_dir>/full/), every checkpoint scored with the plug-in MLM metric on the validation
    split of `data_path` (the prepared target dataset Step 2 trains on). Writes sweep.json (the
    records and the summary), sweep.md (table, cheapest depth) and sweep.png (needs matplotlib)
    into `output_dir`. A depth already trained is kept, an interrupted one resumed: run it
    again after a stop, or with more depths. Returns the summary (sweep.summarize) on global
    rank 0, None elsewhere."""
    from mmadapt.data import read_manifest
    from mmadapt.plugin import plugin_records
    from mmadapt.sweep import CEILING, plot_sweep, summarize, sweep_markdown

    cfg = (cfg or SweepConfig()).validate()
    source, out, data_path = Path(source).resolve(), Path(output_dir), Path(data_path)
    src = A.read_run(source)
    if src.get("recipe") != "minijoint":
        raise ValueError(f"the sweep compares the mini-models of a MINIJOINT run; {source} has recipe "
                         f"{src.get('recipe')}")
    src_cfg = ModelConfig(**src["model"])
    depths = tuple(mini_layers or src_cfg.heads_after[:-1])
    for n in depths:
        A.mini_depth(src_cfg, n)
    if list(depths) != sorted(set(depths)):
        raise ValueError(f"--mini_layers {' '.join(map(str, depths))} must be ascending without repeats")
    if not read_manifest(data_path).get("valid"):
        raise ValueError(f"{data_path} has no validation split for the plug-in metric: prepare it with mmadapt "
                         "preprocess --valid_fraction 0.03 into a new --output_dir (or pass --corpus with "
                         "--valid_fraction)")
    runs = {n: out / str(n) for n in depths}
    jobs = [("minijoint", n, run_dir) for n, run_dir in runs.items()]
    if cfg.ceiling:
        runs[CEILING] = out / CEILING
        jobs.append(("bl_base", None, runs[CEILING]))
    for system, n, run_dir in jobs:
        state = _finished(run_dir, train.train_iters)
        if state == "done":
            continue
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"sweep: Step 2 over {'the full model' if n is None else f'the {n}-layer mini-model'} -> {run_dir}",
                  flush=True)
        adapt_embeddings(system, source, lang, run_dir, train, layout, ds_config, source_tag=source_tag,
                         resume=state == "resume", data_path=data_path, mini_layers=n)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()  # rank 0 scores (the metric needs no process group)
        return None
    which = {str(run_dir.resolve()): n for n, run_dir in runs.items()}
    records = plugin_records(source, list(runs.values()), {lang: data_path}, train.seq_length, cfg.plugin_blocks)
    for r in records:
        r["mini_layers"] = which[str(Path(r["artifact"]).resolve().parent.parent)]
    summary = summarize(records, cfg.near_max)
    (out / "sweep.json").write_text(json.dumps({"source": str(source), "records": records, "summary": summary},
                                               indent=1) + "\n")
    (out / "sweep.md").write_text(sweep_markdown(summary, str(source)) + "\n")
    try:
        plot_sweep(summary, out / "sweep.png")
    except ValueError as e:  # matplotlib missing: the table still stands
        print(f"note: no sweep.png ({e})")
    if dist.is_initialized():
        dist.barrier()
    return summary
