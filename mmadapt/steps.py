"""The paper's steps as library functions: what the CLI, the launch/ scripts and the demo call.

    preprocess        prepare a corpus once (tokenizer + encoded text) for every run that trains on it
    pretrain          Step 1: BL_BASE, BL_SMALL or MINIJOINT from a seeded init
    fit_head          a headless encoder (an imported BertModel, XLMRobertaModel, ...): a new MLM head over
                      its frozen body, so that every later step takes it (a Step-1 cost)
    build_minipost    Step 1b: bottom N layers of a pretrained model + K new layers, only those trained
    adapt_embeddings  Step 2: new-language embeddings over a frozen model (the mini-model or the full one),
                      one straight path in adapt.py, which this module hands on
    sweep             Step 2 over each mini-model of a multi-depth MINIJOINT run, scored by the plug-in
                      metric against Step-2 compute: the cheapest depth that transfers
    finetune          Step 3: the primary model on a source-language task, word embeddings frozen
    evaluate          Step 4: swap each Step-2 artifact into fine-tuned models, score zero-shot
    evaluate_plugin   Step 4 without a task: the plug-in metric through the primary model

Every training step takes the same run description (`run.RunSpec`: where, on what data, with
which DeepSpeed config and layout, resumed or not) and its own config (`Pretrain`,
`BuildMinipost`, `AdaptEmbeddings`, `Finetune`, `Sweep`), by keyword. It checks everything a
user can get wrong before any side effect (`run.start_run`), computes what it records in
run.json itself, and returns what it produced. The training steps need torch.distributed:
start_run calls `parallel.init_parallel` once per process (or the caller did, with the same
layout) and its groups are never rebuilt. Evaluation needs no process group. No step names a
model class: the run's model family (models/) builds everything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from mmadapt import checkpoint, faults, parallel
from mmadapt.adapt import (AdaptEmbeddings, Step2Plan, adapt_embeddings, body_config, check_calibration,
                           check_output_start, final_artifact_written)
from mmadapt.artifact import artifact_dirs, meta_digests, read_artifact
from mmadapt.bpb import BATCH_TOKENS, BPB_BYTES, MIN_BPB_BYTES
from mmadapt.config import (MIN_VOCAB_SIZE, RECIPES, EvaluateConfig, FinetuneConfig, MiniModelConfig, ModelConfig,
                            PreprocessConfig, StepSpec, TrainConfig, _f, check_lang, check_output_file,
                            bool_arg, output_inside_an_input, path_arg, path_args, spec_arg, whole_arg)
from mmadapt.corpora import resolve_corpus
from mmadapt.data import (MANIFEST, TEXT, DataError, EpochOrder, check_own_tokenizer_kept, follows_byte_fallback,
                          read_manifest, read_tokenizer, wait_for)
from mmadapt.data import prepare as prepare_corpus
from mmadapt.data import train_tokenizer
from mmadapt.devices import device_of
from mmadapt.engine import LoopJob, build_engine, set_trainable, train_loop, trainable_by_names
from mmadapt.evaluate import eval_set, evaluate_artifacts, load_finetuned, score_set
from mmadapt.expand import expand
from mmadapt.family import ModelFamily
from mmadapt.finetune import (TaskData, TaskPlan, at_chance, check_positions, check_primary, is_finished, label_counts,
                              primary_state)
from mmadapt.flops import device_days, flops_by_rows
from mmadapt.fusion import apply_fusion
from mmadapt.heldout import (Text, heldout_batches, masked_loss, on_device, primary_head_state, reference_logprobs,
                             scoring_model, target_logprobs, unigram_logprobs, unigram_loss)
from mmadapt.plugin import plugin_records
from mmadapt.report import VERDICT_PIECES
from mmadapt.run import (RUN_FILE, RUN_TOKENIZER, STEP_ONE, ChangedRun, RunSpec, Source, Started, agreed_source,
                         check_layout, check_resumable, check_run, check_same_source, check_trained_positions,
                         pretrained_blocks, read_run, require_head, require_kind, resumed_tag, run_progress,
                         run_text_layout, sampled_fingerprint, start_run, weights_fingerprint)
from mmadapt.sweep import CEILING, SweepConfig, plot_sweep, summarize, sweep_markdown
from mmadapt.tasks import chance_levels, check_one_file_per_language, get_task
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.train import LMJob, TextData, client_state, task_step, train_lm

__all__ = ["AdaptEmbeddings", "BuildMinipost", "FitHead", "Finetune", "Pretrain", "Sweep", "adapt_embeddings",
           "build_minipost", "evaluate", "evaluate_plugin", "finetune", "fit_head", "preprocess", "pretrain", "sweep"]


# --- data --------------------------------------------------------------------------------------------

def preprocess(corpus: str | Path, output_dir: Path, vocab_size: int | None, cfg: PreprocessConfig = PreprocessConfig(),
               tokenizer: Path | None = None, expand_from: Path | None = None) -> dict:
    """Prepare `corpus` once (data.prepare): what `--data_path` of every training step reads.
    vocab_size None: `tokenizer`'s. A no-op when `output_dir` already holds it. -> the dataset's
    manifest. Needs no process group.

    expand_from: a run whose vocabulary Step 2 --vocab_mode expand extends (expand.py): the corpus
    is encoded with that run's tokenizer plus the target's missing pieces, the target being
    `tokenizer` or, without it, a `vocab_size`-piece model trained on the corpus."""
    output_dir = path_arg(output_dir, "output_dir")
    tokenizer = None if tokenizer is None else path_arg(tokenizer, "tokenizer")
    expand_from = None if expand_from is None else path_arg(expand_from, "expand_from")
    if not isinstance(cfg, PreprocessConfig):
        raise ValueError(f"cfg takes a PreprocessConfig, got {type(cfg).__name__}")
    if vocab_size is not None:
        vocab_size = ModelConfig(vocab_size=vocab_size).vocab_size  # its type and range, as every step refuses them
        if vocab_size < MIN_VOCAB_SIZE and tokenizer is None:  # one to train (SentencePiece would fail inside);
            # with a tokenizer, its own size is compared
            raise ValueError(f"--vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size} (SentencePiece's 4 special "
                             "pieces and room for the text's own)")
    if cfg.byte_fallback and (tokenizer is not None or expand_from is not None):  # it would go unread
        raise ValueError("--byte_fallback trains the vocabulary with byte pieces, and "
                         + ("--tokenizer gives one, with or without its own" if tokenizer is not None else
                            "--expand_from extends the run's, which keeps its own or none")
                         + ": drop --byte_fallback")
    inside = output_inside_an_input(output_dir, {"expand_from": expand_from})
    if inside:  # the run whose vocabulary is extended is read, never written into
        raise ValueError(inside)
    corpus = resolve_corpus(corpus)
    check_own_tokenizer_kept(output_dir, tokenizer, merged=expand_from is not None)
    if expand_from is None:
        return prepare_corpus(corpus, output_dir, vocab_size, tokenizer=tokenizer, cfg=cfg)
    if tokenizer is None and vocab_size is None:
        raise DataError("a vocabulary size is needed to train the target tokenizer the expansion adds: pass "
                        "--vocab_size (or --tokenizer)")
    require_kind(Path(expand_from), read_run(expand_from), "pretrain", "minipost")  # its vocabulary is its source's
    size = read_tokenizer(tokenizer).get_piece_size() if tokenizer is not None and vocab_size is not None else None
    if size is not None and size != vocab_size:  # the target's size is its tokenizer's, as without expand_from
        raise DataError(f"tokenizer {tokenizer} has {size} pieces but --vocab_size is {vocab_size}: drop --vocab_size "
                        "or pass a matching tokenizer")
    given = tokenizer
    with tempfile.TemporaryDirectory() as tmp:  # nothing lands in output_dir before data.prepare's checks
        if tokenizer is None:
            tokenizer = train_tokenizer(corpus, Path(tmp) / "target", vocab_size, seed=cfg.tokenizer_seed,
                                        max_sentences=cfg.tokenizer_sample_lines, threads=cfg.tokenizer_threads)
        target = "a target tokenizer trained on the corpus" if given is None else f"--tokenizer {given}"
        try:
            expansion = expand(Path(expand_from) / RUN_TOKENIZER, tokenizer)
        except ValueError as e:  # named as the user gave it, not as a file deleted by the time it is read
            if given is not None:
                raise
            raise ValueError(str(e).replace(f" {tokenizer} ", " trained on the corpus (--vocab_size) ")) from None
        merged = expansion.write(Path(tmp) / "merged.model")
        return prepare_corpus(corpus, output_dir, expansion.size, tokenizer=merged, cfg=cfg,
                              named=f"{expand_from}'s vocabulary expanded by {target}", target_trained=given is None)


# --- Step 1 -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pretrain(StepSpec):
    """Step 1. model: already shaped by its recipe (config.apply_recipe). recipe None: read from
    the model's heads, as run.json records it and Step 2 reads it: one head, bl_base (the CLI's
    default; a BL_SMALL run names its recipe); several, minijoint. "custom" records a run that no
    Step-2 system adapts."""
    name: ClassVar[str] = "pretrain"
    model: ModelConfig
    train: TrainConfig
    recipe: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.recipe is None:
            self.recipe = "bl_base" if len(self.model.heads_after) == 1 else "minijoint"
        if self.recipe not in ("custom", *RECIPES):
            raise ValueError(f"recipe must be one of custom, {', '.join(RECIPES)}, got {self.recipe!r}")
        heads = self.model.heads_after  # (one outside the layers: the model's own check says so, later)
        if ((len(heads) == 1) != (self.recipe in ("bl_base", "bl_small")) and self.recipe != "custom"
                and all(1 <= h <= self.model.num_layers for h in heads)):
            trains = "one head" if self.recipe != "minijoint" else "two heads or more"
            after = ", ".join(map(str, heads))
            fix = ("--recipe minijoint" if len(heads) > 1 else
                   "--recipe bl_base, or --head_layers with two layers or more")
            raise ValueError(f"recipe {self.recipe} trains {trains}; this model has heads after layers {after} "
                             f"(run.json would record it as {self.recipe}): pass {fix} (from Python: shape the model "
                             f"with config.apply_recipe(model, {self.recipe!r}))")


def pretrain(run: RunSpec, step: Pretrain) -> list[dict]:
    """Step 1. Returns the metrics rows of this invocation (global rank 0; empty elsewhere).
    run.layout's fields set, where given, the model's (as the later steps' do their source's)."""
    check_run(run, step, Pretrain)
    run = run.with_corpus_resolved()
    identity, model = {"step": "pretrain", "recipe": step.recipe}, run.layout.apply(step.model)
    with start_run(run, model, step.train, identity, TextData()) as started:
        init = _output_bias_start(started.family, model, started.data)
        return train_lm(started, run, model, step.train, init_state=init)


def _output_bias_start(family: ModelFamily, model: ModelConfig, data_path: Path) -> dict | None:
    """ModelConfig.output_bias_init unigram: every head's output bias [V] at the log-frequencies
    of the training text's pieces (the rest of the model keeps its seeded init: the engine
    starts a trainable parameter the state lacks from the module's own). A model whose output is
    the unigram distribution from the first update has no plateau to sit on: without it a
    12 x 64 post-LayerNorm model spends its first updates mapping every input to one vector
    that yields piece frequencies, and fine-tunes at chance from there (config.py, the tiny
    preset). Every piece counts here, </s> included, though no masked position is one: a start,
    not a reference; without the special pieces (heldout.target_logprobs) as many tiny-preset runs
    fine-tuned above chance (benchmarks/results/tiny_preset_bias_target_cpu2_20261202.md)."""
    if model.output_bias_init != "unigram":
        return None
    logp = unigram_logprobs(data_path, model.vocab_size)
    return {name: logp.clone() for name in family.output_biases(model)}


# --- Step 1b ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class BuildMinipost(StepSpec):
    """Step 1b (MINIPOST) from the pretrain run `primary` (its checkpoint `primary_tag`, default:
    the newest complete one). Default data: the primary run's prepared dataset, encoded once for
    every source-language step."""
    name: ClassVar[str] = "build_minipost"
    run_text: ClassVar[tuple[str, ...]] = ("data_path", "corpus")
    text_from: ClassVar[str] = "its text is encoded with the primary run's tokenizer"
    primary: Path
    train: TrainConfig
    mini: MiniModelConfig = dataclasses.field(default_factory=MiniModelConfig)
    primary_tag: str | None = None


def build_minipost(run: RunSpec, step: BuildMinipost) -> list[dict]:
    """Step 1b (MINIPOST): the bottom N layers, embeddings and primary head of the primary model,
    K new layers on top, only those trained on source-language text."""
    check_run(run, step, BuildMinipost)
    n, k = step.mini.one_depth("build_minipost"), step.mini.new_layers
    source = agreed_source(step.primary,
                           lambda: resumed_tag(run.output_dir, run.resume, step.primary, step.primary_tag),
                           kinds=STEP_ONE)  # a mini-model's bottom layers are no primary model's
    require_head(source, "build_minipost")
    check_trained_positions(source, step.train.seq_length, "build_minipost")
    primary, src, tag, family = source.path, source.record, source.tag, source.family
    model = run.layout.apply(family.minipost_config(source.cfg, n, k))
    if model.pipeline_model_parallel_size > 1:
        # Stage 0 would hold only frozen modules, and DeepSpeed's pipeline backward needs a
        # gradient on every stage. The mini-model is a fraction of the primary: it fits one device.
        raise ValueError("build_minipost does not use pipeline parallelism (the mini-model fits one device): use "
                         "--pipeline_model_parallel_size 1 with data or tensor parallelism")
    if run.data_path is None and run.corpus is None:
        if src.get("data_path"):
            if not Path(src["data_path"]).is_dir():  # the run (its data/ inside) moved since, or the data went
                raise ValueError(f"{primary} was pretrained on {src['data_path']}, which does not exist (moved since?): "
                                 "pass the source-language data with --data_path or --corpus")
            run = dataclasses.replace(run, data_path=Path(src["data_path"]))
        elif src.get("corpus"):
            run = dataclasses.replace(run, corpus=Path(src["corpus"]))
        else:
            raise ValueError(f"{primary} was imported (mmadapt import-hf), so it has no pretraining data: pass "
                             "source-language text with --corpus or --data_path")
    run = dataclasses.replace(run, tokenizer=primary / RUN_TOKENIZER).with_corpus_resolved()
    weights = source.agreed_weights()
    identity = {"step": "minipost", "recipe": "minipost",
                "frozen_from": {"run_dir": str(primary), "tag": tag, **dataclasses.asdict(step.mini),
                                "fingerprint": sampled_fingerprint(weights)}}
    with start_run(run, model, step.train, identity, TextData()) as started:
        _, init = family.minipost_start(source.cfg, weights, n, k)
        job = LMJob(step="minipost", trainable=family.minipost_trainable(n, k), trainable_layers=k,
                    text_layout=run_text_layout(src))
        return train_lm(started, run, model, step.train, job, init)


# --- a headless encoder's MLM head (a Step-1 cost) ----------------------------------------------------

@dataclasses.dataclass
class FitHead(StepSpec):
    """A fresh MLM head over the frozen body of the headless run `primary` (an imported BertModel,
    RobertaModel or XLMRobertaModel: sentence-transformers' checkpoints), trained on
    source-language text (RunSpec.corpus or data_path) in the run's own tokenizer."""
    name: ClassVar[str] = "fit-head"
    run_text: ClassVar[tuple[str, ...]] = ("data_path", "corpus")
    text_from: ClassVar[str] = "its text is encoded with the primary run's tokenizer"
    primary: Path
    train: TrainConfig
    primary_tag: str | None = None


HEAD_FIT_DIRS = ("tokenizer/hf", "sentence_transformers")  # what a head-fitted run keeps of its source's files
UNIGRAM_BLOCKS = 64  # blocks of the training text the head fit's unigram reference is scored on
# The least text the head fit's verdict is drawn from: distinct blocks (a short text's blocks
# repeat) and the masked pieces they score. A 3-line corpus gives one block and a few pieces, on
# which a head and the unigram reference differ by noise (0.002 nats) either way.
VERDICT_BLOCKS = 16  # (and VERDICT_PIECES, report's: the sweep's target reads it too)


def fit_head(run: RunSpec, step: FitHead) -> list[dict]:
    """Train only the head's parameters (dense, LayerNorm, output bias: the projection is the
    frozen word embedding) over the frozen body, its output bias started at the text's unigram
    log-frequencies and its last scale at `head_scale` (ModelFamily.head_scales: where the head's
    random logits have a spread of 1 nat about the unigram reference, so that the head reads the
    body from its first updates). The run it writes is a
    Step-1 run (recipe bl_base) that every later step takes; its checkpoints hold the head, the
    body is the headless run's (`frozen_from`)."""
    check_run(run, step, FitHead)
    source = agreed_source(step.primary,
                           lambda: resumed_tag(run.output_dir, run.resume, step.primary, step.primary_tag),
                           kinds=STEP_ONE)  # (a headless model is an import: Step 1)
    if not source.headless:
        raise ValueError(f"{source.path} has its MLM head already: fit-head trains one for a headless run (import-hf of "
                         "a BertModel, RobertaModel, XLMRobertaModel or CamembertModel, or of a sentence-transformers "
                         "directory)")
    family, model = source.family, run.layout.apply(source.cfg)
    if model.pipeline_model_parallel_size > 1:
        raise ValueError("fit-head does not use pipeline parallelism (only the head trains): use "
                         "--pipeline_model_parallel_size 1 with data or tensor parallelism")
    if run.data_path is None and run.corpus is None:
        raise ValueError(f"{source.path} was imported, so it has no pretraining data: pass source-language text with "
                         "--corpus or --data_path")
    run = dataclasses.replace(run, tokenizer=source.tokenizer).with_corpus_resolved()
    imported = {k: v for k, v in source.record["imported_from"].items() if k != "headless"}
    weights = source.agreed_weights()
    # the body's content, which every load of this run checks (run.load_weights): the run keeps the head only
    identity = {"step": "fit_head", "recipe": "bl_base", "imported_from": imported,
                "frozen_from": {"run_dir": str(source.path), "tag": source.tag, "head_fit": True,
                                "fingerprint": sampled_fingerprint(weights)}}
    with start_run(run, model, step.train, identity, TextData()) as started:
        # where the output bias starts: the pieces a masked position can be (heldout.target_logprobs)
        logp = target_logprobs(started.data, model.vocab_size, family.objective)
        blocks = distinct_blocks(heldout_batches(Text(started.data, step.train.seq_length, UNIGRAM_BLOCKS, 1,
                                                      step.train.seed, TEXT), model.vocab_size, family.objective))
        # the plug-in metric's reference: the pieces a masked position can be (not </s>)
        unigram = unigram_loss(reference_logprobs(started.data, model.vocab_size, family.objective), blocks)
        scale = head_scale(weights[family.word])
        init = {**weights, **{name: logp.clone() for name in family.output_biases(model)},
                **{name: torch.full((model.hidden_size,), scale) for name in family.head_scales(model)}}
        job = LMJob(step="fit_head", trainable=(family.heads_prefix,))
        rows = train_lm(started, run, model, step.train, job, init, record={"unigram_loss": unigram,
                                                                            "head_scale": scale})
        if parallel.is_rank0():  # a SIGTERM while the head is scored: Stopped (75), as Step 3's scoring
            with faults.stopped_after_checkpoint(step.train.train_iters, checkpoint.tag_for(step.train.train_iters)):
                head = scoring_model(family, *primary_head_state(run.output_dir))  # as every later step reads it
                heldout = masked_loss(head, on_device(blocks, device_of(head)))
                text = (len(blocks), sum(int(l.ge(0).sum()) for _, l in blocks))
                flops = (family.step_flops("fit_head", model, step.train.seq_length, step.train.mask_prob),
                         family.row_flops("fit_head", model, step.train.seq_length))
                started.record.finish(**_head_fit_report(run, source.path, logged_rows(run.output_dir),
                                                         (heldout, unigram, text), flops, step.train))
        return rows


def distinct_blocks(batches: list) -> list:
    """Held-out batches of one block each (ids [1, s], labels [1, s]) with every block whose text
    repeats an earlier one's dropped (the text: the labels at masked positions, the ids elsewhere)."""
    seen, out = set(), []
    for ids, labels in batches:
        key = torch.where(labels.ge(0), labels, ids).numpy().tobytes()
        if key not in seen:
            seen.add(key)
            out.append((ids, labels))
    return out


def head_scale(word: torch.Tensor) -> float:
    """The start of a fresh head's last scale (ModelFamily.head_scales), from the source's word
    embedding [V, h] (the head's output projection, tied): the scale at which the logits a normed
    output x_hat (||x_hat|| = sqrt(h)) gives a random row have standard deviation 1 nat,
    1 / (sqrt(h) std(word)). At 0 (the start before 2026-11-27) the head starts at the unigram
    reference, but Adam moves a scale about lr per update: all-MiniLM-L6-v2's head, 200 updates at
    lr 1e-3, ended 0.06 nats under the reference, its context barely read."""
    return float(1.0 / (word.shape[1] ** 0.5 * word.float().std()))


def logged_rows(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl: every update's log of the run, those of a process
    that was stopped and resumed included (train_lm returns this process's rows only: a fit
    resumed from a checkpoint of its last update trains nothing and returns none)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _head_fit_report(run: RunSpec, source: Path, rows: list[dict], scores: tuple,
                     flops: tuple[float, tuple[float, float] | None], train: TrainConfig) -> dict:
    """Global rank 0, after the head fit (rows: the run's logged rows, logged_rows): the source's
    tokenizer files and sentence-transformers modules copied beside the new head (export-hf hands
    them back), the fitted head's loss against the unigram reference (printed), and the fit's
    cost, a Step-1 cost.

    scores: (heldout, unigram, (blocks, pieces)): the fitted head's loss and the reference's
    (already in run.json) on the same distinct blocks of the text (at most UNIGRAM_BLOCKS), every
    selected position hidden as <mask> (the plug-in metric's scoring), and how many blocks and
    masked pieces that is. The verdict reads them (none under VERDICT_BLOCKS or VERDICT_PIECES:
    below_unigram None, "cannot judge"), not the last
    logged training loss: that is a mean over a few small batches under 80/10/10 masking, which
    moves by ~0.1 nats between log intervals and so cannot say which side of the reference the
    head is.

    flops: the fit's per sequence at mask_prob and by rows (ModelFamily.row_flops): its cost
    counts the updates run to its last checkpoint and the rows the head projected in them (at
    mask_prob of every position where the checkpoint does not know them, engine.LoopJob)."""
    for sub in HEAD_FIT_DIRS:
        if (source / sub).is_dir() and not (run.output_dir / sub).exists():  # staged: a copy cut short is none
            with checkpoint.staged_dir(run.output_dir / sub) as tmp:
                shutil.copytree(source / sub, tmp, dirs_exist_ok=True)
    losses = [r["loss"] for r in rows if "loss" in r]
    ckpt = run.output_dir / "checkpoints"
    updates, projected = checkpoint.work_run(ckpt / checkpoint.latest_tag(ckpt))
    (seq_flops, by_rows), batch = flops, train.global_batch(parallel.dp_world())
    cost = flops_by_rows(seq_flops, by_rows, batch * updates, projected)
    report = {"flops": cost, "v100_days": device_days(cost),
              **({"scored_rows": projected} if projected is not None and by_rows is not None else {})}
    heldout, unigram, (blocks, pieces) = scores
    enough = blocks >= VERDICT_BLOCKS and pieces >= VERDICT_PIECES
    below = (heldout < unigram) if enough else None
    trained = f"training loss {losses[0]:.3f} -> {losses[-1]:.3f}; " if losses else ""
    if not enough:
        verdict = (f"too little text to judge (at least {VERDICT_BLOCKS} distinct blocks and {VERDICT_PIECES} masked "
                   "pieces needed): fit it on a larger --corpus to know")
    else:
        verdict = "below it (the head reads the body's context)" if below else "not below it yet: train longer"
    print(f"head fit: {trained}on {blocks} distinct blocks of the text ({pieces} masked pieces) {heldout:.3f} against "
          f"the unigram reference {unigram:.3f}: {verdict}", flush=True)
    report.update(final_loss=losses[-1] if losses else None, heldout_loss=heldout, below_unigram=below)
    return report


# --- Step 3 -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Finetune(StepSpec):
    """Step 3: the primary model of the pretrain run `primary` (checkpoint `primary_tag`) on
    `task`, trained on `train_file` (bible tasks: "bible", the default) in `source_lang`;
    eval_file: optional source-language evaluation data, scored at the end into run.json."""
    name: ClassVar[str] = "finetune"
    run_text: ClassVar[tuple[str, ...]] = ()
    text_from: ClassVar[str] = "it reads the task's files with the primary run's tokenizer"
    task: str
    primary: Path
    cfg: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    train_file: str | None = None
    eval_file: str | None = None
    source_lang: str = "en"
    primary_tag: str | None = None

    def __post_init__(self):
        for name in ("train_file", "eval_file"):  # a Path as its text, as steps.evaluate takes one ('bible' is none)
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        super().__post_init__()
        get_task(self.task)  # an unknown task refused when the step is made, as the command's choices do


def finetune(run: RunSpec, step: Finetune) -> tuple[dict, torch.nn.Module]:
    """Step 3: the primary model + a new task head, everything but the word embeddings trained
    through the DeepSpeed engine (data parallel, ZeRO, megatron tensor parallel), with periodic
    checkpoints and exact --resume. Returns the run record (with `source_score` when an
    eval_file is given) and the trained module (this rank's tensor-parallel shard)."""
    check_run(run, step, Finetune)
    cfg, task = step.cfg, get_task(step.task)
    source, model_cfg, train_file = _finetune_source(run, step, task)
    lr = cfg.lr or task.lr
    identity = {"step": "finetune", "primary": {"run_dir": str(source.path), "tag": source.tag}, "lr": lr}
    data = TaskData(task, source, train_file, step.eval_file, step.source_lang)
    with start_run(run, model_cfg, cfg, identity, data) as started:
        plan: TaskPlan = started.data
        weights = source.agreed_weights()
        # The primary model's fingerprint (its weights' content): what Step 4 matches the
        # artifacts' primary model by, so that a copy of the run is the same model; a --resume
        # over a primary changed since is refused.
        # (The full hash of every weight, which records compare, computed only where it is
        # recorded; a resume checks the sampled one, the same cost at any size, on every rank.)
        resumed = run.resume and started.record.exists()
        if resumed:
            check_same_source(run, {"primary.sampled_fingerprint": lambda: sampled_fingerprint(weights),
                                    "primary.fingerprint": lambda: weights_fingerprint(weights)}, source.path)
        started.record.write(run.resume, **({"primary": {**identity["primary"],
                                                         "fingerprint": weights_fingerprint(weights),
                                                         "sampled_fingerprint": sampled_fingerprint(weights)}}
                                            if parallel.is_rank0() and not resumed else {}))
        if plan.positions and parallel.is_rank0():
            print(f"warning: {plan.positions}", flush=True)
        if plan.global_batch > len(plan.enc) and parallel.is_rank0():
            # every update then reads some rows twice (EpochOrder goes round): the gradient of a
            # batch of the rows, at the compute (and memory) of the larger one
            print(f"note: a global batch of {plan.global_batch} rows is more than the {len(plan.enc)} training rows: "
                  "each update reads rows more than once, at that compute and memory; lower "
                  "--train_micro_batch_size_per_gpu to the rows or fewer", flush=True)
        engine, job = _finetune_engine(started, model_cfg, cfg, task, lr, primary_state(source, weights)[1])
        del weights
        order = EpochOrder(len(plan.enc), cfg.seed)
        per_token = cfg.calculate_per_token_loss and task.kind == "tag"  # a classify or span task scores one per row
        train_loop(engine, lambda position: task_step(engine, plan.enc, order, cfg, position, per_token), job, cfg,
                   plan.updates, run.output_dir, run.resume)
        record = started.record.identity
        # as rank 0 sees it: a rank whose view of the final checkpoint lags (another node's cache)
        # skipped the barrier rank 0 then waited in until the collective timeout
        if parallel.rank0_decides(lambda: is_finished(run.output_dir)):
            if parallel.is_rank0():
                # the file source_score is on (not the run's identity: a --resume may score another)
                with faults.stopped_after_checkpoint(plan.updates, checkpoint.tag_for(plan.updates)):
                    record = started.record.finish(**_finetune_results(run.output_dir, task, plan, cfg,
                                                                       started.record.read()),
                                                   **({"source_eval_file": step.eval_file} if step.eval_file else {}))
            dist.barrier()
        return record, engine.module


def _finetune_source(run: RunSpec, step: Finetune, task) -> tuple[Source, ModelConfig, str]:
    """Step 3's checks before anything is written: the primary run, the model as this run lays it
    out (its heads dropped), the training file."""
    train_file = step.train_file or ("bible" if task.name.startswith("bible-") else None)
    if train_file is None:
        raise ValueError(f"--train_file is required for {task.name} (see mmadapt/readers.py for the data)")
    source = agreed_source(step.primary,
                           lambda: resumed_tag(run.output_dir, run.resume, step.primary, step.primary_tag, "primary"),
                           kinds=STEP_ONE)  # (a run of another kind refused naming Step 1 alone)
    check_primary(source)
    model_cfg = run.layout.apply(dataclasses.replace(source.cfg, head_layers=(), head_weights=()))
    family = source.family
    if task.kind not in family.task_kinds:
        raise ValueError(f"{task.name} is a {task.kind} task; the {family.name} family fine-tunes "
                         f"{', '.join(family.task_kinds)}")
    if model_cfg.pipeline_model_parallel_size > 1:
        raise ValueError("fine-tuning does not use pipeline parallelism (a model replica fits one device): "
                         "use --pipeline_model_parallel_size 1 with data or tensor parallelism")
    return source, model_cfg, train_file


def _finetune_engine(started: Started, model_cfg: ModelConfig, cfg: FinetuneConfig, task, lr: float, state: dict):
    """The task model (the primary weights `state`, a seeded task head, word embeddings frozen) in
    DeepSpeed's engine, and the loop's job. -> (engine, LoopJob)."""
    family, plan = started.family, started.data
    parallel.seed_everything(cfg.seed)
    module = family.build_task_model(model_cfg, task.kind, len(plan.labels), cfg.seed)
    names = {n: n for n, _ in module.named_parameters()}
    trainable = trainable_by_names(family.finetune_trainable(model_cfg))
    set_trainable(module, names, trainable)  # before fusion: it replays frozen layers alone as CUDA graphs
    apply_fusion(module, model_cfg, family.compiled_kinds, family.graphed_kinds)
    engine, layout = build_engine(module, names, trainable, cfg, lr, plan.updates, started.ds_config, state)
    global_batch = cfg.global_batch(parallel.dp_world())
    job = LoopJob(step="finetune", task=task.name, names=names, client_state=client_state(family, model_cfg, layout),
                  exclude_frozen=True, perf=lambda seconds, rows: {"examples_per_s": global_batch / seconds})
    return engine, job


def _finetune_results(run_dir: Path, task, plan: TaskPlan, cfg: FinetuneConfig, recorded: dict) -> dict:
    """What a finished fine-tune adds to its record (global rank 0): its final loss, its
    source-language score on the eval file (exactly the saved fp32 model, on this rank alone: a
    TP=1 model needs no process group) and every warning (a run that learned nothing says so in
    its log, run.json and summary line, and Step 4 and `report` flag every record made from it).
    `recorded`: the run's record. The headline its score is in replaces the recorded one: a
    --resume may change --metric (CHANGEABLE_ON_RESUME), and Step 4 reads it from there; one
    without an eval file takes it from the scores recorded before."""
    losses = [r["loss"] for r in logged_rows(run_dir) if "loss" in r]
    results = {"final_loss": losses[-1] if losses else None, "metric": plan.metric,
               "finetune": {**recorded["finetune"], "metric": cfg.metric}}
    if plan.metric in (recorded.get("source_scores") or {}):
        results["source_score"] = recorded["source_scores"][plan.metric]
    accuracy = chance = None
    if plan.eval_examples is not None:
        ft = load_finetuned(run_dir)
        evaluated = eval_set(task, load_tokenizer(ft.tokenizer), plan.eval_examples, ft.labels, cfg,
                             device_of(ft.model()), ft.framing)
        scores = score_set(ft, evaluated, cfg)
        chance = chance_levels(task, evaluated.enc, plan.eval_examples, ft.labels, cfg)
        accuracy = scores.get("accuracy")
        results.update(source_score=scores[plan.metric], source_scores=scores, source_chance=chance)
    warnings = (([plan.positions] if plan.positions else []) +
        at_chance(task.kind, label_counts(task, plan.enc, plan.labels), losses, accuracy, chance))
    for w in warnings:
        print(f"warning: {w}", flush=True)
    return {**results, "warnings": warnings}


# --- Step 4 -----------------------------------------------------------------------------------------

def _write_records(records: list[dict], output: Path | None) -> list[dict]:
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)  # whole or absent: a rerun refuses an existing one
        checkpoint.publish_new(Path(output), json.dumps(records, indent=1) + "\n")
    return records


def _refuse_existing(output: Path | None) -> None:
    if output is None:
        return
    output = path_arg(output, "output")
    if output.exists():
        raise ValueError(f"{output} already exists: choose a new --output (records are never overwritten)")
    check_output_file(output, "--output")


def evaluate(finetuned: list[Path], embeddings: list[Path], eval_file: str, output: Path | None = None,
             eval_batch_tokens: int | None = None, allow_untrained_positions: bool = False,
             cfg: EvaluateConfig = EvaluateConfig(), graft: bool = False) -> list[dict]:
    """Step 4: zero-shot scores of every Step-2 artifact (or every artifact of an adapt run: its
    start, update 0, and every checkpoint), averaged over the fine-tuned runs (seeds) of one
    primary model, and (cfg.no_adaptation_baseline) per language the same runs with no
    adaptation. Writes the records to `output` (which must not exist) when given.
    eval_batch_tokens None: each run's own. allow_untrained_positions: evaluate a run whose
    seq_length is past its primary model's pretraining blocks (with a warning; else refused,
    unless Step 3 allowed it). graft: the runs fine-tune a sibling of the model the embeddings
    were trained over (evaluate.graft_check). Needs no process group."""
    finetuned, embeddings = path_args(finetuned, "finetuned"), path_args(embeddings, "embeddings")
    eval_file = spec_arg(eval_file, "eval_file")
    eval_batch_tokens = whole_arg(eval_batch_tokens, "eval_batch_tokens", 1, optional=True)
    allow_untrained_positions = bool_arg(allow_untrained_positions, "allow_untrained_positions")
    graft = bool_arg(graft, "graft")
    if not isinstance(cfg, EvaluateConfig):
        raise ValueError(f"cfg takes an EvaluateConfig, got {type(cfg).__name__}")
    _refuse_existing(output)
    records = evaluate_artifacts(finetuned, embeddings, eval_file, eval_batch_tokens,
                                 {"allow_untrained_positions": True} if allow_untrained_positions else None,
                                 cfg.no_adaptation_baseline, graft)
    return _write_records(records, output)


def evaluate_plugin(primary: Path, embeddings: list[Path], data: str, output: Path | None = None,
                    seq_length: int | None = None, blocks: int = 256, allow_untrained_positions: bool = False,
                    bpb_bytes: int = BPB_BYTES, graft: bool = False, bpb_batch_tokens: int = BATCH_TOKENS
                    ) -> list[dict]:
    """Step 4's plug-in metric (plugin.py): every artifact through `primary`'s primary head,
    scored on the validation split of the dataset `data` ({lang}: each artifact's language)
    against the unigram reference, in blocks of `seq_length` (default: the primary's pretraining
    blocks, 64 for an imported model; longer ones only with allow_untrained_positions), and in
    bits per byte of the first `bpb_bytes` of its raw held-out text (bpb.py; at most
    `bpb_batch_tokens` positions per forward pass); graft: the
    embeddings were trained over a base of which `primary` is a fine-tuned sibling (graft.py). Writes
    the records to `output` (which must not exist) when given. Needs no process group."""
    primary, embeddings = path_arg(primary, "primary"), path_args(embeddings, "embeddings")
    data = spec_arg(data, "data")
    seq_length, blocks = whole_arg(seq_length, "seq_length", 8, optional=True), whole_arg(blocks, "blocks", 1)
    allow_untrained_positions = bool_arg(allow_untrained_positions, "allow_untrained_positions")
    graft = bool_arg(graft, "graft")
    _refuse_existing(output)
    src = read_run(primary)
    require_kind(primary, src, "pretrain", "minipost")
    seq_length = seq_length or pretrained_blocks(src) or 64
    positions = check_positions(Path(primary), src, seq_length, allow_untrained_positions)
    if positions:
        print(f"warning: {positions}", flush=True)
    langs = {read_artifact(p)[2]["lang"] for p in artifact_dirs([Path(e) for e in embeddings])}
    check_one_file_per_language(data, sorted(langs), "--plugin_data")  # a prepared dataset holds one language
    records = plugin_records(Path(primary), [Path(e) for e in embeddings],
                             {lang: Path(data.replace("{lang}", lang)) for lang in langs}, seq_length, blocks,
                             bpb_bytes=whole_arg(bpb_bytes, "bpb_bytes", MIN_BPB_BYTES), graft=graft,
                             bpb_batch_tokens=whole_arg(bpb_batch_tokens, "bpb_batch_tokens", 1))
    return _write_records(records, output)


# --- beyond the paper: the depth sweep ------------------------------------------------------------

@dataclasses.dataclass
class Sweep(StepSpec):
    """Step 2 over each mini-model of the MINIJOINT run `source` (`mini_layers`, default: every
    secondary head) on `lang`, every checkpoint scored with the plug-in metric on the validation
    split of the target data. The target data: RunSpec.data_path (a prepared dataset with a
    validation split), or RunSpec.corpus prepared into <output_dir>/data with `prep` (its
    valid_fraction > 0; vocab_size default: the source model's)."""
    name: ClassVar[str] = "sweep"
    run_text: ClassVar[tuple[str, ...]] = ("data_path", "corpus")
    text_from: ClassVar[str] = "the vocabulary is the prepared dataset's, or one trained on the corpus"
    source: Path
    lang: str
    train: TrainConfig
    mini_layers: tuple[int, ...] | None = _f(None, "the depths to sweep (default: every one)", flag=False, ge=1)
    cfg: SweepConfig = dataclasses.field(default_factory=SweepConfig)
    source_tag: str | None = None
    prep: PreprocessConfig = dataclasses.field(default_factory=PreprocessConfig)
    vocab_size: int | None = _f(None, "with a corpus: the target vocabulary's pieces", flag=False, ge=MIN_VOCAB_SIZE)

    def __post_init__(self):
        super().__post_init__()
        check_lang(self.lang)


def _sweep_data(run: RunSpec, step: Sweep, src: Source) -> Path:
    """The sweep's prepared target dataset (a raw corpus prepared by global rank 0 into
    <output_dir>/data while the others wait: parallel.rank0_prepares; with byte fallback where the
    source `src`'s tokenizer has it, as Step 2's own: adapt.Step2Plan; --vocab_mode expand: the
    source's vocabulary with the target's new pieces, as Step 2 merges it)."""
    if (run.corpus is None) == (run.data_path is None):
        raise ValueError("pass one of --data_path (a prepared target dataset with a validation split) and --corpus")
    if run.data_path is not None:
        default = PreprocessConfig()
        given = [flag for flag, set_ in (("--vocab_size", step.vocab_size is not None),
                                          ("--valid_fraction", step.prep.valid_fraction != default.valid_fraction),
                                          ("--workers", step.prep.workers != default.workers)) if set_]
        if given:  # they were ignored: the dataset's own vocabulary and split are what the sweep reads
            raise ValueError(f"{' and '.join(given)} prepare{'s' if len(given) == 1 else ''} a --corpus; --data_path "
                             f"{run.data_path} is prepared already: drop {'it' if len(given) == 1 else 'them'}")
        data_path = run.data_path
    else:
        if step.prep.valid_fraction <= 0:
            raise ValueError("--corpus needs --valid_fraction (e.g. 0.03): the plug-in metric scores held-out text")
        data_path = run.output_dir / "data"
        what = f"the {step.lang} corpus in {data_path}"
        prep = dataclasses.replace(step.prep, byte_fallback=follows_byte_fallback(data_path, src.tokenizer,
                                                                                  step.train.vocab_mode))
        expand_from = step.source if step.train.vocab_mode == "expand" else None  # the source's vocabulary, extended
        parallel.rank0_prepares(lambda: preprocess(run.corpus, data_path, step.vocab_size or src.cfg.vocab_size,
                                                   prep, expand_from=expand_from), what)
        wait_for(data_path / MANIFEST, what)
    if not read_manifest(data_path).get("valid"):
        raise ValueError(f"{data_path} has no validation split for the plug-in metric: prepare it with mmadapt "
                         "preprocess --valid_fraction 0.03 into a new --output_dir (or pass --corpus with "
                         "--valid_fraction)")
    return data_path


def _sweep_records(source: Path, runs: dict, step: Sweep, data_path: Path, kept: Path) -> tuple[list[dict], dict]:
    """Every checkpoint of the sweep's runs scored (plugin_records), each record with its
    `mini_layers` -> (the records, what they were scored from). A sweep.json written from the same
    source, data, checkpoints (their meta.json as they are now) and sizes gives its records again:
    a finished sweep run again scores nothing (scoring every checkpoint costs more than a small
    sweep's training); another depth, a resumed run or another --plugin_blocks / --bpb_bytes
    scores anew."""
    cfg = step.cfg
    # the artifacts of the schedule's checkpoints: artifact_dirs leaves out a stopped and continued
    # depth's artifact of the update it stopped at, a curve point the others lack (it moved time_to_target)
    arts = artifact_dirs(list(runs.values()))
    key = {"source": str(source.resolve()), "data": str(Path(data_path).resolve()),
           "artifacts": meta_digests(arts), "plugin_blocks": cfg.plugin_blocks, "bpb_bytes": cfg.bpb_bytes,
           "seq_length": step.train.seq_length,
           "reference": "scorable pieces"}  # heldout.reference_logprobs: records before it counted every piece
    if (old := checkpoint.kept_result(kept, key, "sweep results")) is not None:
        return old["records"], key
    which = {str(run_dir.resolve()): n for n, run_dir in runs.items()}
    records = plugin_records(source, arts, {step.lang: data_path}, step.train.seq_length, cfg.plugin_blocks,
                             bpb_bytes=cfg.bpb_bytes)
    for r in records:
        r["mini_layers"] = which[str(Path(r["artifact"]).resolve().parent.parent)]
    return records, key


def _refuse_another_sources_sweep(out: Path, source: Path, given, swept: str | None) -> None:
    """Refuse an --output_dir that holds a sweep over another run than `source` (resolved; `given`:
    as the user spelt it): its sweep.json (`swept`: the source it records, read already) or a
    depth's run.json naming a run that exists and is not this one. The depths this call trains are
    checked as resumed runs later; those it does not were not, so a sweep of another source with
    --mini_layers of its own replaced sweep.json and left two sources' depths side by side. A
    source that no longer exists where recorded (moved) is left to those checks."""
    recorded = [("sweep.json", swept)]
    for d in sorted(out.iterdir()) if out.is_dir() else ():
        if (d.name.isdigit() or d.name == CEILING) and (d / RUN_FILE).is_file():
            ref = checkpoint.read_json(d / RUN_FILE, "run file").get("frozen_from")
            recorded.append((f"{d.name}/", ref.get("run_dir") if isinstance(ref, dict) else None))
    for where, other in recorded:
        if isinstance(other, str) and Path(other).is_dir() and Path(other).resolve() != source:
            raise ValueError(f"--output_dir {out} holds a sweep over {other} (its {where}), not over --source "
                             f"{given}: choose a new --output_dir, or pass --source {other} (nothing is overwritten)")


@faults.resumes_itself
def sweep(run: RunSpec, step: Sweep) -> dict | None:
    """Step 2 over each depth into <output_dir>/<N>/ (and, with cfg.ceiling, over the full
    primary model into <output_dir>/full/). Writes sweep.json (the records and the summary),
    sweep.md (table, cheapest depth) and sweep.png (needs matplotlib) into the output directory.
    A depth already trained is kept, an interrupted one resumed: run it again after a stop, or
    with more depths. Returns the summary (sweep.summarize) on global rank 0, None elsewhere."""
    check_run(run, step, Sweep)
    cfg = step.cfg  # its ranges were checked when it was made (config.check_declared)
    # one checkpoint of the source for every depth: the one the depths trained so far read
    # (run.resumed_tag), though the source saved newer ones since, unless --source_tag names one
    def pinned() -> str | None:
        for d in sorted(run.output_dir.iterdir()) if step.source_tag is None and run.output_dir.is_dir() else ():
            if d.name.isdigit() or d.name == CEILING:
                tag = resumed_tag(d, True, step.source, None)
                if tag is not None:
                    return tag
        return step.source_tag
    src = agreed_source(step.source, pinned)
    source, out, src_cfg = src.path, run.output_dir, src.cfg
    if src.record.get("recipe") != "minijoint":
        raise ValueError(f"the sweep compares the mini-models of a MINIJOINT run; {source} has recipe "
                         f"{src.record.get('recipe')}: pretrain with --recipe minijoint --mini_layers N [M ...], or "
                         "over this model build one mini-model per depth (mmadapt build_minipost --mini_layers N) and "
                         "run mmadapt adapt --system minipost over each")
    depths = tuple(step.mini_layers or src_cfg.heads_after[:-1])
    for n in depths:
        src.family.minijoint_depth(src_cfg, n)
    if list(depths) != sorted(set(depths)):
        raise ValueError(f"--mini_layers {' '.join(map(str, depths))} must be ascending without repeats")
    # the full model is not calibrated to itself: its run keeps --primary_calibration's default
    # (adapt.check_calibration refuses another), the depths take the sweep's
    ceiling_train = dataclasses.replace(step.train, primary_calibration=TrainConfig.primary_calibration)

    def adapt_step(system: str, n: int | None) -> AdaptEmbeddings:
        return AdaptEmbeddings(system=system, source=source, lang=step.lang, train=ceiling_train
                               if system == "bl_base" else step.train, source_tag=src.tag, mini_layers=n)
    # each run's refusals that read no target data (its layout: fusion, ranks, DeepSpeed's config;
    # its positions, calibration and expansion start) before the corpus is prepared into the
    # output, as a run makes them before its data (they left <output_dir>/data, and a wait)
    check_trained_positions(src, step.train.seq_length, "Step 2")
    for system, n in [*(("minijoint", n) for n in depths), *((("bl_base", None),) if cfg.ceiling else ())]:
        each, body = adapt_step(system, n), body_config(src.family, system, src_cfg, n)
        check_layout(run.layout.apply(body), each.train, run.ds_config)
        check_calibration(each, each.train.vocab_mode == "expand", src.family)
        check_output_start(src.family, each.train, body)
    # a sweep's own entries (a stopped one's too: atomic writes' dot files): another directory's
    # files (its --source's, somebody's sweep.md or sweep.json, a depth's directory of other
    # files) are refused before anything is written
    checkpoint.check_output_dir(out)
    kept, previous = ("sweep.json",), {}
    if (out / "sweep.json").is_file():
        previous = checkpoint.read_json(out / "sweep.json", "sweep results")
        if not (isinstance(previous, dict) and {"source", "records", "summary"} <= previous.keys()):
            raise ValueError(f"--output_dir {out} holds a sweep.json that no sweep wrote: choose a new or empty "
                             "directory (nothing is overwritten)")
        kept = ("sweep.json", "sweep.md", "sweep.png")
    checkpoint.refuse_other_files(out, lambda name: name.isdigit() or name.startswith(".") or name in (
        CEILING, "data", *kept), "sweep")
    _refuse_another_sources_sweep(out, source, step.source, previous.get("source"))
    runs = {n: out / str(n) for n in depths}
    for run_dir in [*runs.values(), *([out / CEILING] if cfg.ceiling else [])]:
        checkpoint.refuse_other_than_a_run(run_dir)
    data_path = _sweep_data(run, step, src)
    jobs = [("minijoint", n, run_dir) for n, run_dir in runs.items()]
    if cfg.ceiling:
        runs[CEILING] = out / CEILING
        jobs.append(("bl_base", None, runs[CEILING]))

    def spec(system, n, run_dir, resume):
        return (RunSpec(output_dir=run_dir, ds_config=run.ds_config, data_path=data_path, resume=resume,
                        layout=run.layout), adapt_step(system, n))

    # Every depth trained before is this sweep's (source, language, data, schedule): checked for
    # all of them before any trains, so that a finished one is not taken for a changed sweep's
    # and a changed one is refused before the depths ahead of it have trained
    # What each depth holds, as rank 0 sees it: ranks whose views differed (another node's cached
    # listing of a directory an earlier job wrote) trained different depths, or one resumed and one new
    iters = step.train.train_iters
    states = parallel.rank0_decides(lambda: [(run_progress(d, iters), final_artifact_written(d, iters))
                                             for _, _, d in jobs])
    for (system, n, run_dir), (state, written) in zip(jobs, states):
        if state == "new":
            continue
        plan = Step2Plan.of(*spec(system, n, run_dir, True))
        # the schedule the run trains with (the ceiling's calibration is the default); the words
        # of both refusals are a --resume's, which a sweep is not given
        try:
            check_resumable(plan.run, plan.model, plan.step.train, plan.identity, plan.data)
            if not (state == "done" and written):  # a depth it resumes (a finished one's checkpoints are not read)
                checkpoint.intact_tag(run_dir / "checkpoints")
        except ChangedRun as e:
            raise ValueError(f"{run_dir} holds a Step-2 run of a sweep with other settings: {e.detail}; run "
                             "the sweep as it first ran, or choose a new --output_dir") from None
        except checkpoint.DamagedRun as e:
            raise ValueError(f"{e.detail}: restore its files and run the sweep again, or remove {run_dir} to "
                             "train that depth anew") from None
    for (system, n, run_dir), (state, written) in zip(jobs, states):
        if state == "done" and written:
            continue
        if parallel.is_rank0():
            print(f"sweep: Step 2 over {'the full model' if n is None else f'the {n}-layer mini-model'} -> {run_dir}",
                  flush=True)
        adapt_embeddings(*spec(system, n, run_dir, state != "new"))
    # Rank 0 scores alone (the metric needs no process group); the others are done. They do not
    # wait for it in a barrier: scoring every artifact of every depth can outlast the process
    # group's timeout (parallel.py: it covers a checkpoint write and an update), and NCCL's
    # watchdog would then abort the waiting ranks, and the launcher rank 0 with them.
    if dist.is_initialized() and not parallel.is_rank0():
        return None
    # a SIGTERM while it scores or writes its results: Stopped (75) as in a depth's loop, not 143
    # and no word (the same command again reads sweep.json's records back and writes the rest)
    with faults.stopped_after_checkpoint(step.train.train_iters, checkpoint.tag_for(step.train.train_iters)):
        records, key = _sweep_records(source, runs, step, data_path, out / "sweep.json")
        summary = summarize(records, cfg.near_max)
        # sweep.json is read back by the next sweep (kept_result): whole or not at all
        checkpoint.atomic_write(out / "sweep.json", json.dumps({"source": str(source), "records": records,
                                                                "summary": summary, "key": key}, indent=1) + "\n")
        checkpoint.atomic_write(out / "sweep.md", sweep_markdown(summary, str(source)) + "\n")
        try:
            plot_sweep(summary, out / "sweep.png")
        except ValueError as e:  # matplotlib missing: the table still stands
            print(f"note: no sweep.png ({e})")
    return summary
