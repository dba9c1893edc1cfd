"""The paper's steps as library functions: what the CLI, the launch/ scripts and the demo call.

    preprocess        prepare a corpus once (tokenizer + encoded text) for every run that trains on it
    pretrain          Step 1: BL_BASE, BL_SMALL or MINIJOINT from a seeded init
    fit_head          a headless encoder (an imported BertModel, XLMRobertaModel, ...): a new MLM head over
                      its frozen body, so that every later step takes it (a Step-1 cost)
    build_minipost    Step 1b: bottom N layers of a pretrained model + K new layers, only those trained
    adapt_embeddings  Step 2: new-language embeddings over a frozen model (the mini-model or the full one)
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
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from mmadapt import checkpoint, parallel
from mmadapt.adapt import (ARTIFACT_FILE, body_config, read_artifact, step2_start_with_primary, step2_trainable,
                           write_artifact)
from mmadapt.checkpoint import check_output_file
from mmadapt.config import (SOURCE_RECIPES, SYSTEMS, Checked, EvaluateConfig, FinetuneConfig, MiniModelConfig,
                            ModelConfig, PreprocessConfig, TrainConfig, path_args, whole_arg)
from mmadapt.corpora import resolve_corpus
from mmadapt.data import MANIFEST, TEXT, TOKENIZER, EpochOrder, read_manifest, replay_blocks, wait_for
from mmadapt.data import prepare as prepare_corpus
from mmadapt.data import train_tokenizer
from mmadapt.engine import LoopJob, build_engine, train_loop, trainable_by_names
from mmadapt.evaluate import (artifact_dirs, artifact_primary, device_of, eval_set, evaluate_artifacts, load_finetuned,
                              score_set)
from mmadapt.family import ModelFamily
from mmadapt.finetune import (TaskData, TaskPlan, at_chance, check_positions, check_primary, is_finished, label_counts,
                              primary_state)
from mmadapt.flops import device_days
from mmadapt.fusion import apply_fusion
from mmadapt.models.layers import derive_seed, new_rows_name
from mmadapt.plugin import (PluginProbe, SourceProbe, heldout_batches, off_source_start, masked_loss, on_device, plugin_model,
                            plugin_records, primary_head_state, progress_line, source_text, unigram_logprobs,
                            unigram_loss)
from mmadapt.run import (RUN_TOKENIZER, RunSpec, Source, Started, load_checkpoint, pretrained_blocks, read_run,
                         read_source, require_head, require_kind, run_fingerprint, run_progress, start_run,
                         weights_fingerprint)
from mmadapt.sweep import CEILING, SweepConfig, plot_sweep, summarize, sweep_markdown
from mmadapt.tasks import chance_levels, get_task
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.tokenizer import pieces as tokenizer_pieces
from mmadapt.train import (MERGED_TOKENIZER, ExpandedText, LMJob, Replay, TextData, WithReplay, check_replay, client_state,
                           task_step, train_lm)
from mmadapt.vocab import Expansion, check_expansion, expand


# --- data --------------------------------------------------------------------------------------------

def preprocess(corpus: str | Path, output_dir: Path, vocab_size: int | None, cfg: PreprocessConfig = PreprocessConfig(),
               tokenizer: Path | None = None, expand_from: Path | None = None) -> dict:
    """Prepare `corpus` once (data.prepare): what `--data_path` of every training step reads.
    vocab_size None: `tokenizer`'s. A no-op when `output_dir` already holds it. -> the dataset's
    manifest. Needs no process group.

    expand_from: a run whose vocabulary Step 2 --vocab_mode expand extends (vocab.py): the corpus
    is encoded with that run's tokenizer plus the target's missing pieces, the target being
    `tokenizer` or, without it, a `vocab_size`-piece model trained on the corpus."""
    corpus = resolve_corpus(corpus)
    if expand_from is None:
        return prepare_corpus(corpus, output_dir, vocab_size, tokenizer=tokenizer, cfg=cfg)
    read_run(expand_from)
    with tempfile.TemporaryDirectory() as tmp:  # nothing lands in output_dir before data.prepare's checks
        if tokenizer is None:
            tokenizer = train_tokenizer(corpus, Path(tmp) / "target", vocab_size, seed=cfg.tokenizer_seed,
                                        max_sentences=cfg.tokenizer_sample_lines)
        expansion = expand(Path(expand_from) / RUN_TOKENIZER, tokenizer)
        merged = expansion.write(Path(tmp) / "merged.model")
        return prepare_corpus(corpus, output_dir, expansion.size, tokenizer=merged, cfg=cfg)


def _text_run(run: RunSpec) -> RunSpec:
    """The run with its raw corpus resolved (bible:<lang> -> the packaged Bible, written once)."""
    return run if run.corpus is None else dataclasses.replace(run, corpus=resolve_corpus(run.corpus))


def _step2_only(train: TrainConfig, step: str) -> None:
    if not train.train_output_bias:
        raise ValueError(f"train_output_bias is a Step-2 setting; {step} trains its own parameters: drop the flag")
    if train.plugin_eval_blocks:
        raise ValueError(f"plugin_eval_blocks is a Step-2 setting; {step} learns no new embeddings: drop the flag")
    if train.embedding_init != "overlap":
        raise ValueError(f"embedding_init is a Step-2 setting; {step} starts no new vocabulary: drop the flag")
    if train.vocab_mode != "replace":
        raise ValueError(f"vocab_mode is a Step-2 setting; {step} keeps its source's vocabulary: drop the flag")
    if train.expand_output_start != TrainConfig.expand_output_start:
        raise ValueError(f"expand_output_start is a Step-2 setting; {step} starts no new vocabulary: drop the flag")
    if train.expand_source_nats != TrainConfig.expand_source_nats:
        raise ValueError(f"expand_source_nats is a Step-2 setting; {step} starts no new vocabulary: drop the flag")
    if train.replay_fraction or train.replay_data is not None:
        raise ValueError(f"replay_data and replay_fraction are Step-2 settings; {step} trains on its own text only: "
                         "drop the flags")


# --- Step 1 -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pretrain(Checked):
    """Step 1. model: already shaped by its recipe (config.apply_recipe)."""
    model: ModelConfig
    train: TrainConfig
    recipe: str = "custom"


def pretrain(run: RunSpec, step: Pretrain) -> list[dict]:
    """Step 1. Returns the metrics rows of this invocation (global rank 0; empty elsewhere)."""
    _step2_only(step.train, "pretrain")
    run = _text_run(run)
    identity = {"recipe": step.recipe}
    with start_run(run, step.model, step.train, identity, TextData()) as started:
        init = _output_bias_start(started.family, step.model, started.data)
        return train_lm(started, run, step.model, step.train, init_state=init)


def _output_bias_start(family: ModelFamily, model: ModelConfig, data_path: Path) -> dict | None:
    """ModelConfig.output_bias_init unigram: every head's output bias [V] at the log-frequencies
    of the training text's pieces (the rest of the model keeps its seeded init: the engine
    starts a trainable parameter the state lacks from the module's own). A model whose output is
    the unigram distribution from the first update has no plateau to sit on: without it a
    12 x 64 post-LayerNorm model spends its first updates mapping every input to one vector
    that yields piece frequencies, and fine-tunes at chance from there (config.py, the tiny
    preset)."""
    if model.output_bias_init != "unigram":
        return None
    logp = unigram_logprobs(data_path, model.vocab_size)
    return {name: logp.clone() for name in family.output_biases(model)}


# --- Step 1b ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class BuildMinipost(Checked):
    """Step 1b (MINIPOST) from the pretrain run `primary` (its checkpoint `primary_tag`, default:
    the newest complete one). Default data: the primary run's prepared dataset, encoded once for
    every source-language step."""
    primary: Path
    train: TrainConfig
    mini: MiniModelConfig = dataclasses.field(default_factory=MiniModelConfig)
    primary_tag: str | None = None


def build_minipost(run: RunSpec, step: BuildMinipost) -> list[dict]:
    """Step 1b (MINIPOST): the bottom N layers, embeddings and primary head of the primary model,
    K new layers on top, only those trained on source-language text."""
    n, k = step.mini.one_depth("build_minipost"), step.mini.new_layers
    _step2_only(step.train, "build_minipost")
    source = read_source(step.primary, step.primary_tag)
    require_head(source, "build_minipost")
    primary, src, tag, family = source.path, source.record, source.tag, source.family
    model = run.layout.apply(family.minipost_config(source.cfg, n, k))
    if model.pipeline_model_parallel_size > 1:
        # Stage 0 would hold only frozen modules, and DeepSpeed's pipeline backward needs a
        # gradient on every stage. The mini-model is a fraction of the primary: it fits one device.
        raise ValueError("build_minipost does not use pipeline parallelism (the mini-model fits one device): use "
                         "--pipeline_model_parallel_size 1 with data or tensor parallelism")
    if run.data_path is None and run.corpus is None:
        if src.get("data_path"):
            run = dataclasses.replace(run, data_path=Path(src["data_path"]))
        elif src.get("corpus"):
            run = dataclasses.replace(run, corpus=Path(src["corpus"]))
        else:
            raise ValueError(f"{primary} was imported (mmadapt import-hf), so it has no pretraining data: pass "
                             "source-language text with --corpus or --data_path")
    run = _text_run(dataclasses.replace(run, tokenizer=primary / RUN_TOKENIZER))
    identity = {"recipe": "minipost",
                "frozen_from": {"run_dir": str(primary), "tag": tag, **dataclasses.asdict(step.mini)}}
    with start_run(run, model, step.train, identity, TextData()) as started:
        _, init = family.minipost_start(source.cfg, source.weights(), n, k)
        job = LMJob(step="minipost", trainable=family.minipost_trainable(n, k), trainable_layers=k)
        return train_lm(started, run, model, step.train, job, init)


# --- a headless encoder's MLM head (a Step-1 cost) ----------------------------------------------------

@dataclasses.dataclass
class FitHead:
    """A fresh MLM head over the frozen body of the headless run `primary` (an imported BertModel,
    RobertaModel or XLMRobertaModel: sentence-transformers' checkpoints), trained on
    source-language text (RunSpec.corpus or data_path) in the run's own tokenizer."""
    primary: Path
    train: TrainConfig
    primary_tag: str | None = None


HEAD_FIT_DIRS = ("tokenizer/hf", "sentence_transformers")  # what a head-fitted run keeps of its source's files
UNIGRAM_BLOCKS = 64  # blocks of the training text the head fit's unigram reference is scored on


def fit_head(run: RunSpec, step: FitHead) -> list[dict]:
    """Train only the head's parameters (dense, LayerNorm, output bias: the projection is the
    frozen word embedding) over the frozen body, its output bias started at the text's unigram
    log-frequencies and its last scale at zero (ModelFamily.head_scales: the head then starts at
    the unigram reference, and goes below it only by reading the body). The run it writes is a
    Step-1 run (recipe bl_base) that every later step takes; its checkpoints hold the head, the
    body is the headless run's (`frozen_from`)."""
    _step2_only(step.train, "fit-head")
    source = read_source(step.primary, step.primary_tag)
    if not source.headless:
        raise ValueError(f"{source.path} has its MLM head already: fit-head trains one for a headless run (import-hf of "
                         "a BertModel, RobertaModel or XLMRobertaModel, or of a sentence-transformers directory)")
    family, model = source.family, run.layout.apply(source.cfg)
    if model.pipeline_model_parallel_size > 1:
        raise ValueError("fit-head does not use pipeline parallelism (only the head trains): use "
                         "--pipeline_model_parallel_size 1 with data or tensor parallelism")
    if run.data_path is None and run.corpus is None:
        raise ValueError(f"{source.path} was imported, so it has no pretraining data: pass source-language text with "
                         "--corpus or --data_path")
    run = _text_run(dataclasses.replace(run, tokenizer=source.tokenizer))
    imported = {k: v for k, v in source.record["imported_from"].items() if k != "headless"}
    identity = {"recipe": "bl_base", "imported_from": imported,
                "frozen_from": {"run_dir": str(source.path), "tag": source.tag, "head_fit": True}}
    with start_run(run, model, step.train, identity, TextData()) as started:
        logp = unigram_logprobs(started.data, model.vocab_size)
        blocks = heldout_batches(started.data, step.train.seq_length, model.vocab_size, UNIGRAM_BLOCKS, 1,
                                 step.train.seed, family.objective, TEXT)
        unigram = unigram_loss(logp, blocks)
        init = {**source.weights(), **{name: logp.clone() for name in family.output_biases(model)},
                **{name: torch.zeros(model.hidden_size) for name in family.head_scales(model)}}
        job = LMJob(step="fit_head", trainable=(family.heads_prefix,))
        rows = train_lm(started, run, model, step.train, job, init, record={"unigram_loss": unigram})
        if parallel.is_rank0():
            head = plugin_model(family, *primary_head_state(run.output_dir))  # as every later step reads it
            heldout = masked_loss(head, on_device(blocks, device_of(head)))
            started.record.finish(**_head_fit_report(run, source.path, rows, heldout, unigram, family.step_flops(
                "fit_head", model, step.train.seq_length, step.train.mask_prob), step.train))
        return rows


def _head_fit_report(run: RunSpec, source: Path, rows: list[dict], heldout: float, unigram: float,
                     seq_flops: float, train: TrainConfig) -> dict:
    """Global rank 0, after the head fit: the source's tokenizer files and sentence-transformers
    modules copied beside the new head (export-hf hands them back), the fitted head's loss against
    the unigram reference (printed), and the fit's cost, a Step-1 cost.

    heldout (the fitted head's loss) and unigram (the reference's, already in run.json) are on the
    same UNIGRAM_BLOCKS blocks of the text, every selected position hidden as <mask> (the plug-in
    metric's scoring). The verdict reads them, not the last
    logged training loss: that is a mean over a few small batches under 80/10/10 masking, which
    moves by ~0.1 nats between log intervals and so cannot say which side of the reference the
    head is."""
    for sub in HEAD_FIT_DIRS:
        if (source / sub).is_dir() and not (run.output_dir / sub).exists():
            shutil.copytree(source / sub, run.output_dir / sub)
    losses = [r["loss"] for r in rows if "loss" in r]
    flops = seq_flops * train.global_batch(parallel.dp_world()) * train.train_iters
    report = {"flops": flops, "v100_days": device_days(flops)}
    below = heldout < unigram
    trained = f"training loss {losses[0]:.3f} -> {losses[-1]:.3f}; " if losses else ""
    print(f"head fit: {trained}on {UNIGRAM_BLOCKS} blocks of the text {heldout:.3f} against the unigram reference "
          f"{unigram:.3f}: " + ("below it (the head reads the body's context)" if below else
                                "not below it yet: train longer"), flush=True)
    report.update(final_loss=losses[-1] if losses else None, heldout_loss=heldout, below_unigram=below)
    return report


# --- Step 2 -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class AdaptEmbeddings(Checked):
    """Step 2: new `lang` embeddings over the frozen model of `system`, from the source run
    `source` (its checkpoint `source_tag`, default: the newest complete one).

    Data: RunSpec.data_path, the target language's prepared dataset (mmadapt preprocess; its
    tokenizer is the target vocabulary); else RunSpec.corpus (default: the packaged Bible,
    bible:<lang>) with RunSpec.tokenizer, an existing target SentencePiece model (default: one
    trained on the corpus). vocab_size: the target vocabulary (default: the dataset's or
    tokenizer's size, else the source model's). mini_layers (minijoint): the depth N of the
    source's mini-model to train over, one of its secondary heads (default: its only one; a run
    with several needs it, ModelFamily.minijoint_depth)."""
    system: str
    source: Path
    lang: str
    train: TrainConfig
    vocab_size: int | None = None
    source_tag: str | None = None
    mini_layers: int | None = None


def _target_vocab_size(run: RunSpec, body: ModelConfig, vocab_size: int | None) -> int:
    if vocab_size is not None:
        return vocab_size
    if run.data_path is not None:
        return read_manifest(run.data_path)["vocab_size"]
    if run.tokenizer is not None and run.tokenizer.is_file():
        return load_tokenizer(run.tokenizer).get_piece_size()
    return body.vocab_size


def _expanded_vocabulary(run: RunSpec, source: Source, vocab_size: int | None, seed: int
                         ) -> tuple[int, int, Expansion | None]:
    """--vocab_mode expand: (the merged vocabulary's size, the source's, and the merged tokenizer
    to build when the run prepares a raw corpus itself; None: the prepared dataset's is it). A
    raw corpus without --tokenizer: the target tokenizer is trained on it as replace mode trains
    one (`target_tokenizer`), `vocab_size` pieces (default: the source model's)."""
    if vocab_size is not None and (run.data_path is not None or run.tokenizer is not None):
        raise ValueError("--vocab_mode expand: the vocabulary is the source's with the target's new pieces "
                         "appended, its size follows from the tokenizers: drop --vocab_size")
    source_tokenizer = source.tokenizer
    if run.data_path is not None:
        manifest = read_manifest(run.data_path)  # a prepared dataset, or one line saying it is not
        size = check_expansion(source_tokenizer, run.data_path / TOKENIZER)
        return manifest["vocab_size"], size, None
    if run.tokenizer is not None:
        load_tokenizer(run.tokenizer)
        expansion = expand(source_tokenizer, run.tokenizer)
    else:
        expansion = _trained_expansion(run, source_tokenizer, vocab_size or source.cfg.vocab_size, seed)
    return expansion.size, expansion.source_size, expansion


def _trained_expansion(run: RunSpec, source_tokenizer: Path, vocab_size: int, seed: int) -> Expansion:
    """The source tokenizer merged with a `vocab_size`-piece target tokenizer trained on the raw
    corpus (data.train_tokenizer, seeded: every rank trains the same one), in a temporary
    directory. A --resume reads the merged tokenizer the run kept instead of training again."""
    kept = run.output_dir / MERGED_TOKENIZER
    if run.resume and kept.is_file():
        size = check_expansion(source_tokenizer, kept)
        return Expansion(kept.read_bytes(), size, tuple(tokenizer_pieces(kept)[size:]))
    with tempfile.TemporaryDirectory() as tmp:
        target = train_tokenizer(resolve_corpus(run.corpus), Path(tmp) / "target", vocab_size, seed=seed,
                                 max_sentences=PreprocessConfig().tokenizer_sample_lines)
        return expand(source_tokenizer, target)


def _replay(run: RunSpec, train: TrainConfig, source_tokenizer: Path, layout: ModelConfig) -> Replay | None:
    """Step 2's source-language replay (train.replay_fraction > 0), its text checked to be encoded
    with the tokenizer its ids need (train.check_replay) before any work, a target tokenizer trained
    from a raw corpus included; else None. The replay text must be in the run's vocabulary: expand,
    the source run's tokenizer (its ids are the merged vocabulary's first ones: the source's own
    segmentation, what the source model was trained on and its loss is measured on); replace, the
    target tokenizer (the new embeddings learn the source text's pieces too). layout: the run's
    model config (its parallel sizes)."""
    if not train.replay_fraction or train.replay_data is None:  # half of the pair: TrainConfig.validate says so
        return None
    if train.vocab_mode == "expand":
        tokenizer = source_tokenizer
    elif run.data_path is not None or run.tokenizer is not None:
        tokenizer = run.data_path / TOKENIZER if run.data_path is not None else run.tokenizer
    else:
        raise ValueError("--replay_data with --vocab_mode replace is source text in the target vocabulary, which this "
                         "run would only train: prepare the target data first (mmadapt preprocess) and pass "
                         "--data_path, or pass --tokenizer")
    replay = Replay(Path(train.replay_data), train.replay_fraction)
    check_replay(replay, tokenizer, layout, train)
    return replay


def _check_output_start(family: ModelFamily, train: TrainConfig, body: ModelConfig) -> None:
    """Refuse --embedding_init subword_mean where the bounded start would overwrite it (a tied
    decoder's new rows are its output rows)."""
    if train.vocab_mode != "expand" or train.expand_output_start == "embedding_init" \
            or train.embedding_init != "subword_mean":
        return
    path = family.output_path(body)
    if path.bias is None and path.matrix == family.word:
        raise ValueError("--embedding_init subword_mean with a tied decoder: its new rows are its output rows too, "
                         f"which --expand_output_start {train.expand_output_start} starts at the source rows' mean; pass "
                         "--expand_output_start embedding_init to start them at their splits' means instead")


def adapt_embeddings(run: RunSpec, step: AdaptEmbeddings) -> list[dict]:
    """Step 2. Writes an artifact (embeddings.pt, spm.model, meta.json) under
    <output_dir>/embeddings/<tag> at every checkpoint: what Step 4 swaps in."""
    source, body = _step2_source(step)
    run = _step2_data(run, step)
    replay = _replay(run, step.train, source.tokenizer, run.layout.apply(body))
    model, data, expanded = _step2_model(run, step, source, body)
    if replay is not None:
        data = WithReplay(data, replay)
    run, train, system = _text_run(run), step.train, step.system
    frozen_from = {"run_dir": str(source.path), "tag": source.tag, "system": system}
    # Which mini-model (MINIJOINT): its depth, and every depth the source offers (artifact labels).
    depth = {"mini_layers": body.num_layers, "mini_depths": list(source.cfg.heads_after[:-1])} \
        if system == "minijoint" else {}
    identity = {"recipe": system, "system": system, "lang": step.lang, "frozen_from": frozen_from, **depth}
    with start_run(run, model, train, identity, data) as started:
        tokenizer = started.data / TOKENIZER
        init, rows = _step2_start(source, step, tokenizer)
        if parallel.is_rank0():
            _say_start(step.lang, train.embedding_init, model, rows)
        writer = ArtifactWriter.of(run, step, source, model, init, tokenizer,
                                   {**depth, **expanded, **rows})
        writer.save_start()
        job = LMJob(step="adapt", trainable=writer.trainable, replay=replay)
        metrics = train_lm(started, run, model, train, job, init, after_save=writer,
                           record={**rows, **expanded, "target_vocab_size": model.vocab_size})
        final = run.output_dir / "embeddings" / checkpoint.tag_for(train.train_iters)
        if expanded and parallel.is_rank0() and final.is_dir():
            start = read_artifact(run.output_dir / "embeddings" / checkpoint.tag_for(0))[0]  # kept by a --resume
            started.record.finish(expand_report=_expand_report(final, start, step.lang, started.data,
                                                               train.seq_length, replay))
        return metrics


def _step2_start(source: Source, step: AdaptEmbeddings, tokenizer: Path) -> tuple[dict, dict]:
    """Step 2's start over the source's weights (adapt.step2_start; expand with the bounded
    start: calibrated on source text, plugin.off_source_start) and how its rows started (expand:
    and `new_mass_bound`, and the calibration's record)."""
    train = step.train
    body, init, rows, primary = step2_start_with_primary(
        step.system, source, None, tokenizer, derive_seed(train.seed, f"embeddings.{step.lang}"), step.mini_layers,
        train.embedding_init, train.vocab_mode, train.expand_output_start, train.expand_source_nats)
    if train.vocab_mode == "expand" and train.expand_output_start == "bounded":
        init, shift = off_source_start(source, train.replay_data, train.seq_length, body, init, primary,
                                       train.expand_source_nats, every_rank=True)
        rows.update(shift)
    return init, rows


def _step2_source(step: AdaptEmbeddings) -> tuple[Source, ModelConfig]:
    """The source run of `step` and the config of the model its system trains over (checked
    once: the system, the source's recipe, the mini-model's depth)."""
    if step.system not in SYSTEMS:
        raise ValueError(f"unknown system {step.system!r}; choose one of {', '.join(SYSTEMS)}")
    source = read_source(step.source, step.source_tag)
    require_head(source, "Step 2")
    recipe = source.record.get("recipe")
    if recipe not in SOURCE_RECIPES[step.system]:
        raise ValueError(f"--system {step.system} adapts a run with recipe {' or '.join(SOURCE_RECIPES[step.system])}, "
                         f"but {source.path} has recipe {recipe}")
    return source, body_config(source.family, step.system, source.cfg, step.mini_layers)


def _step2_data(run: RunSpec, step: AdaptEmbeddings) -> RunSpec:
    """The run with its default target text (the packaged Bible), checked for the plug-in probe."""
    if run.data_path is None and run.corpus is None:
        run = dataclasses.replace(run, corpus=f"bible:{step.lang}")
    if step.train.plugin_eval_blocks and (run.data_path is None or not read_manifest(run.data_path).get("valid")):
        raise ValueError("--plugin_eval_blocks scores held-out target text: pass --data_path, a dataset prepared with "
                         "mmadapt preprocess --valid_fraction 0.03 (a raw --corpus has no validation split)")
    return run


def _step2_model(run: RunSpec, step: AdaptEmbeddings, source: Source, body: ModelConfig
                 ) -> tuple[ModelConfig, TextData, dict]:
    """The model Step 2 runs (the body, laid out as the run says, with the new vocabulary's
    size), its data plan, and the record's expansion fields ({} in replace mode)."""
    if step.train.vocab_mode != "expand":
        vocab_size = _target_vocab_size(run, body, step.vocab_size)
        return dataclasses.replace(run.layout.apply(body), vocab_size=vocab_size), TextData(), {}
    _check_output_start(source.family, step.train, body)
    vocab_size, source_size, expansion = _expanded_vocabulary(run, source, step.vocab_size, step.train.seed)
    model = dataclasses.replace(run.layout.apply(body), vocab_size=vocab_size, frozen_vocab_size=source_size)
    data = TextData() if expansion is None else ExpandedText(expansion)
    return model, data, {"vocab_mode": "expand", "source_vocab_size": source_size,
                         "expand_output_start": step.train.expand_output_start}


@dataclasses.dataclass
class ArtifactWriter:
    """Step 2's `after_save`: at each checkpoint, the artifact Step 4 swaps in (adapt.write_artifact)
    under <output_dir>/embeddings/<tag>, with its meta.json (what, for how much compute, for which
    primary model) and, with TrainConfig.plugin_eval_blocks, its plug-in score (global rank 0,
    which alone saves artifacts)."""
    run_dir: Path
    family: ModelFamily
    model: ModelConfig
    init: dict  # the start: the frozen parameters an artifact takes from it (the bias with train_output_bias false)
    trainable: tuple[str, ...]
    tokenizer: Path
    meta: dict  # every artifact's meta.json fields
    seq_flops: dict[bool, float]  # per sequence, exact (False) and the paper's (True)
    primary: dict  # {"run_dir", "tag"} of the primary model the embeddings plug into
    probe: PluginProbe | None
    fingerprint: dict = dataclasses.field(default_factory=dict)  # the primary's, once per invocation

    @classmethod
    def of(cls, run: RunSpec, step: AdaptEmbeddings, source: Source, model: ModelConfig, init: dict,
           tokenizer: Path, extra: dict) -> "ArtifactWriter":
        train, family = step.train, source.family
        meta = {"system": step.system, "lang": step.lang, "source": str(source.path), "source_tag": source.tag,
                "body_layers": model.num_layers, **extra, "hidden_size": model.hidden_size,
                "vocab_size": model.vocab_size, "train_output_bias": train.train_output_bias,
                "embedding_init": train.embedding_init, "global_batch": train.global_batch(parallel.dp_world()),
                "seq_length": train.seq_length}
        if train.score_fraction != 1:  # scored a sample of the positions: its records say so (adapt.system_label)
            meta["score_fraction"] = train.score_fraction
        if train.replay_fraction:  # ordinary blocks of seq_length: counted in `tokens` and the FLOPs like the rest
            meta.update(replay_fraction=train.replay_fraction,
                        replay_blocks=replay_blocks(train.replay_fraction, meta["global_batch"]))
        if step.system == "minipost":  # the mini-model's N and K (its source's Step 1b)
            mini = MiniModelConfig(source.record["frozen_from"]["mini_layers"],
                                   source.record["frozen_from"]["new_layers"])
            meta.update(mini_layers=mini.one_depth("build_minipost"), new_layers=mini.new_layers)
        # The primary model these embeddings plug into (MINIPOST's: the run its mini-model was
        # built from), known by its weights' fingerprint: Step 4 matches it by content, not by path.
        primary = source.record["frozen_from"] if step.system == "minipost" else \
            {"run_dir": str(source.path), "tag": source.tag}
        # The progress signal: each artifact through the primary model it is for, against the
        # unigram reference of the held-out text.
        probe = PluginProbe(artifact_primary({"source": str(source.path)}), run.data_path, train.seq_length,
                            train.plugin_eval_blocks) if train.plugin_eval_blocks else None
        seq_flops = {p: family.step_flops("adapt", model, train.seq_length, family.scored_fraction(train), paper=p)
                     for p in (False, True)}
        return cls(run.output_dir, family, model, init, step2_trainable(family, model, train.train_output_bias),
                   tokenizer, meta, seq_flops, primary, probe)

    def __call__(self, update: int, ckpt_tag: str, sd: dict | None = None) -> None:
        sd = load_checkpoint(self.run_dir, ckpt_tag) if sd is None else sd  # fp32 master weights
        batch = self.meta["global_batch"]
        flops = self.seq_flops[False] * batch * update
        if not self.fingerprint:
            self.fingerprint["primary_fingerprint"] = run_fingerprint(self.primary["run_dir"], self.primary["tag"])
        meta = {**self.meta, "step": update, "tokens": batch * self.meta["seq_length"] * update, "flops": flops,
                **({"replay_tokens": self.meta["replay_blocks"] * self.meta["seq_length"] * update}
                   if "replay_blocks" in self.meta else {}),
                "flops_paper": self.seq_flops[True] * batch * update, "v100_days": device_days(flops),
                **self.fingerprint}
        tensors = self.tensors(sd)
        if self.probe is not None:
            scored = self.probe.score(tensors, meta)
            meta.update(scored)
            print(progress_line(update, scored), flush=True)
        write_artifact(self.run_dir / "embeddings" / ckpt_tag, tensors, self.tokenizer, meta)

    def save_start(self) -> None:
        """Step 2's start as the artifact of update 0 (the new rows as initialised, before any
        update: the start `init` as its state), what Step 4 and the plug-in metric score as "init
        only" beside the trained embeddings. Global rank 0 (which alone saves artifacts), once: a
        --resume keeps the one it finds."""
        tag = checkpoint.tag_for(0)
        if parallel.is_rank0() and not (self.run_dir / "embeddings" / tag / ARTIFACT_FILE).is_file():
            self(0, tag, self.init)

    def tensors(self, sd: dict) -> dict:
        """An artifact's tensors (adapt.write_artifact) from the checkpoint `sd` (the trained
        parameters' fp32 master weights) and the start (a frozen parameter, such as the bias
        with train_output_bias false, is not in the checkpoint: it is still its start). An
        expanded vocabulary's are whole: the source rows (frozen, as they started) then the new
        rows."""
        def value(name: str) -> torch.Tensor:
            return (sd[name] if name in self.trainable else self.init[name]).float()

        out = {}
        for key, name in self.family.artifact_keys().items():
            if name not in self.init:
                continue
            out[key] = torch.cat([self.init[name].float(), value(new_rows_name(name))]) \
                if self.model.frozen_vocab_size else value(name)
        return out


def _expand_report(artifact: Path, start: dict, lang: str, target_data: Path, seq_length: int,
                   replay: Replay | None) -> dict:
    """What every expanded-vocabulary run reports (printed, and in run.json): on held-out source
    text through the primary model (plugin.SourceProbe; the replay data's validation split when
    the run has one, else the source run's data), its loss with its own vocabulary, and the loss
    and the KL from its own distribution with the new pieces in its softmax, at update 0 (the
    start `start`, artifact tensors) and at the end (the final `artifact`); beside them the
    plug-in target metric at both, when the target data hold a validation split."""
    meta = read_artifact(artifact)[2]
    primary = artifact_primary(meta)
    text = source_text(primary, replay.data if replay is not None and read_manifest(replay.data).get("valid")
                       else None)
    report = {}
    if text is not None:
        probe = SourceProbe(primary, text, seq_length)
        first, last = probe.score(start, meta), probe.score(read_artifact(artifact)[0], meta)
        report = {"source_loss_before": probe.before, "source_loss_start": first["source_loss"],
                  "source_kl_start": first["source_kl"], "source_loss_after": last["source_loss"],
                  "source_kl_after": last["source_kl"], "source_text": probe.data, "scored_pieces": probe.scored}
        print(f"source language through the primary model ({probe.scored} pieces of {probe.data}): loss "
              f"{probe.before:.4f} with its own vocabulary; with the new pieces {first['source_loss']:.4f} at update 0 "
              f"(KL {first['source_kl']:.4f}), {last['source_loss']:.4f} at the end (KL {last['source_kl']:.4f})")
    if read_manifest(target_data).get("valid"):
        record = plugin_records(primary, [artifact], {lang: target_data}, seq_length)[0]
        report.update(plugin_gain=record["score"], plugin_loss=record["loss"], unigram_loss=record["unigram_loss"],
                      plugin_gain_start=record["start_gain"])
        print(f"{lang} through the primary model (plug-in): contextual gain {record['start_gain']:.3f} nats at update "
              f"0, {record['score']:.3f} at the end (loss {record['loss']:.3f}, unigram reference "
              f"{record['unigram_loss']:.3f})")
    else:
        print(f"note: no plug-in {lang} score: the target data hold no validation split (mmadapt preprocess "
              "--valid_fraction 0.03 --expand_from <source run>, then --data_path)")
    return report


def _say_start(lang: str, how: str, model: ModelConfig, rows: dict[str, float]) -> None:
    mean = f", {rows['subword_mean_pieces']} the mean of their source split" if how == "subword_mean" else ""
    if model.frozen_vocab_size:
        new = model.vocab_size - model.frozen_vocab_size
        print(f"{lang}: {new} new pieces after the source's {model.frozen_vocab_size} (frozen; only the new rows "
              f"train), {how}{mean}, {rows['random_pieces']} drawn from N(0, {model.init_method_std})")
        if "new_mass_calibrated" in rows:
            print(f"  their output side, calibrated on source text: they take {rows['new_mass_calibrated']:.4f} nats of "
                  f"its loss (the worst case at any position: {rows['new_mass_bound']:.3g})")
        else:
            print(f"  their output side: they take at most {rows['new_mass_bound']:.3g} nats of the source language's "
                  "loss at any position")
        return
    print(f"new {lang} embeddings ({how}): {rows['shared_pieces']} of {model.vocab_size} pieces copied from the "
          f"source vocabulary{mean}, {rows['random_pieces']} drawn from N(0, {model.init_method_std})")


# --- Step 3 -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Finetune(Checked):
    """Step 3: the primary model of the pretrain run `primary` (checkpoint `primary_tag`) on
    `task`, trained on `train_file` (bible tasks: "bible", the default) in `source_lang`;
    eval_file: optional source-language evaluation data, scored at the end into run.json."""
    task: str
    primary: Path
    cfg: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    train_file: str | None = None
    eval_file: str | None = None
    source_lang: str = "en"
    primary_tag: str | None = None


def finetune(run: RunSpec, step: Finetune) -> tuple[dict, torch.nn.Module]:
    """Step 3: the primary model + a new task head, everything but the word embeddings trained
    through the DeepSpeed engine (data parallel, ZeRO, megatron tensor parallel), with periodic
    checkpoints and exact --resume. Returns the run record (with `source_score` when an
    eval_file is given) and the trained module (this rank's tensor-parallel shard)."""
    cfg, task = step.cfg, get_task(step.task)
    source, model_cfg, train_file = _finetune_source(run, step, task)
    lr = cfg.lr or task.lr
    identity = {"step": "finetune", "primary": {"run_dir": str(source.path), "tag": source.tag}, "lr": lr}
    data = TaskData(task, source, train_file, step.eval_file, step.source_lang)
    with start_run(run, model_cfg, cfg, identity, data) as started:
        plan: TaskPlan = started.data
        weights = source.weights()
        # The primary model's fingerprint (its weights' content): what Step 4 matches the
        # artifacts' primary model by, so that a copy of the run is the same model.
        fresh = parallel.is_rank0() and not (run.resume and started.record.exists())
        started.record.write(run.resume, **({"primary": {**identity["primary"],
                                                         "fingerprint": weights_fingerprint(weights)}}
                                            if fresh else {}))
        if plan.positions and parallel.is_rank0():
            print(f"warning: {plan.positions}", flush=True)
        engine, job = _finetune_engine(started, model_cfg, cfg, task, lr, primary_state(source, weights)[1])
        del weights
        order = EpochOrder(len(plan.enc), cfg.seed)
        train_loop(engine, lambda position: task_step(engine, plan.enc, order, cfg, position), job, cfg,
                   plan.updates, run.output_dir, run.resume)
        record = started.record.identity
        if is_finished(run.output_dir):
            if parallel.is_rank0():
                record = started.record.finish(**_finetune_results(run.output_dir, task, plan, cfg))
            dist.barrier()
        return record, engine.module


def _finetune_source(run: RunSpec, step: Finetune, task) -> tuple[Source, ModelConfig, str]:
    """Step 3's checks before anything is written: the primary run, the model as this run lays it
    out (its heads dropped), the training file."""
    train_file = step.train_file or ("bible" if task.name.startswith("bible-") else None)
    if train_file is None:
        raise ValueError(f"--train_file is required for {task.name} (see mmadapt/readers.py for the data)")
    source = read_source(step.primary, step.primary_tag)
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
    module = apply_fusion(family.build_task_model(model_cfg, task.kind, len(plan.labels), cfg.seed), model_cfg,
                          family.compiled_kinds)
    names = {n: n for n, _ in module.named_parameters()}
    engine, dims = build_engine(module, names, trainable_by_names(family.finetune_trainable(model_cfg)), cfg, lr,
                                plan.updates, started.ds_config, state)
    global_batch = cfg.global_batch(parallel.dp_world())
    job = LoopJob(label=f"finetune {task.name}", names=names, client_state=client_state(family, model_cfg, dims),
                  exclude_frozen=True, perf=lambda seconds: {"examples_per_s": global_batch / seconds})
    return engine, job


def _finetune_results(run_dir: Path, task, plan: TaskPlan, cfg: FinetuneConfig) -> dict:
    """What a finished fine-tune adds to its record (global rank 0): its final loss, its
    source-language score on the eval file (exactly the saved fp32 model, on this rank alone: a
    TP=1 model needs no process group) and every warning (a run that learned nothing says so in
    its log, run.json and summary line, and Step 4 and `report` flag every record made from it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    results = {"final_loss": losses[-1] if losses else None}
    accuracy = chance = None
    if plan.eval_examples is not None:
        ft = load_finetuned(run_dir)
        evaluated = eval_set(task, load_tokenizer(ft.tokenizer), plan.eval_examples, ft.labels, cfg,
                             device_of(ft.model()), ft.family.framing)
        scores = score_set(ft, evaluated, cfg)
        chance = chance_levels(task, evaluated.enc, plan.eval_examples, ft.labels, cfg)
        accuracy = scores.get("accuracy")
        results.update(source_score=scores[plan.metric], source_scores=scores, source_chance=chance)
    warnings = ([plan.positions] if plan.positions else []) + \
        at_chance(task.kind, label_counts(task, plan.enc, plan.labels), losses, accuracy, chance)
    for w in warnings:
        print(f"warning: {w}", flush=True)
    return {**results, "warnings": warnings}


# --- Step 4 -----------------------------------------------------------------------------------------

def _write_records(records: list[dict], output: Path | None) -> list[dict]:
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(records, indent=1) + "\n")
    return records


def _refuse_existing(output: Path | None) -> None:
    if output is not None and Path(output).exists():
        raise ValueError(f"{output} already exists: choose a new --output (records are never overwritten)")
    if output is not None:
        check_output_file(output, "--output")


def evaluate(finetuned: list[Path], embeddings: list[Path], eval_file: str, output: Path | None = None,
             eval_batch_tokens: int | None = None, allow_untrained_positions: bool = False,
             cfg: EvaluateConfig = EvaluateConfig()) -> list[dict]:
    """Step 4: zero-shot scores of every Step-2 artifact (or every artifact of an adapt run: its
    start, update 0, and every checkpoint), averaged over the fine-tuned runs (seeds) of one
    primary model, and (cfg.no_adaptation_baseline) per language the same runs with no
    adaptation. Writes the records to `output` (which must not exist) when given.
    eval_batch_tokens None: each run's own. allow_untrained_positions: evaluate a run whose
    seq_length is past its primary model's pretraining blocks (with a warning; else refused,
    unless Step 3 allowed it). Needs no process group."""
    finetuned, embeddings = path_args(finetuned, "finetuned"), path_args(embeddings, "embeddings")
    eval_batch_tokens = whole_arg(eval_batch_tokens, "eval_batch_tokens", 1, optional=True)
    _refuse_existing(output)
    records = evaluate_artifacts(finetuned, embeddings, eval_file, eval_batch_tokens,
                                 {"allow_untrained_positions": True} if allow_untrained_positions else None,
                                 cfg.no_adaptation_baseline)
    return _write_records(records, output)


def evaluate_plugin(primary: Path, embeddings: list[Path], data: str, output: Path | None = None,
                    seq_length: int | None = None, blocks: int = 256, allow_untrained_positions: bool = False
                    ) -> list[dict]:
    """Step 4's plug-in metric (plugin.py): every artifact through `primary`'s primary head,
    scored on the validation split of the dataset `data` ({lang}: each artifact's language)
    against the unigram reference, in blocks of `seq_length` (default: the primary's pretraining
    blocks, 64 for an imported model; longer ones only with allow_untrained_positions). Writes
    the records to `output` (which must not exist) when given. Needs no process group."""
    primary, embeddings = path_args(primary, "primary")[0], path_args(embeddings, "embeddings")
    seq_length, blocks = whole_arg(seq_length, "seq_length", 8, optional=True), whole_arg(blocks, "blocks", 1)
    _refuse_existing(output)
    src = read_run(primary)
    require_kind(primary, src, "pretrain", "minipost")
    seq_length = seq_length or pretrained_blocks(src) or 64
    positions = check_positions(Path(primary), src, seq_length, allow_untrained_positions)
    if positions:
        print(f"warning: {positions}", flush=True)
    langs = {read_artifact(p)[2]["lang"] for p in artifact_dirs([Path(e) for e in embeddings])}
    records = plugin_records(Path(primary), [Path(e) for e in embeddings],
                             {lang: Path(data.replace("{lang}", lang)) for lang in langs}, seq_length, blocks)
    return _write_records(records, output)


# --- beyond the paper: the depth sweep ------------------------------------------------------------

@dataclasses.dataclass
class Sweep(Checked):
    """Step 2 over each mini-model of the MINIJOINT run `source` (`mini_layers`, default: every
    secondary head) on `lang`, every checkpoint scored with the plug-in metric on the validation
    split of the target data. The target data: RunSpec.data_path (a prepared dataset with a
    validation split), or RunSpec.corpus prepared into <output_dir>/data with `prep` (its
    valid_fraction > 0; vocab_size default: the source model's)."""
    source: Path
    lang: str
    train: TrainConfig
    mini_layers: tuple[int, ...] | None = None
    cfg: SweepConfig = dataclasses.field(default_factory=SweepConfig)
    source_tag: str | None = None
    prep: PreprocessConfig = dataclasses.field(default_factory=PreprocessConfig)
    vocab_size: int | None = None


def _sweep_data(run: RunSpec, step: Sweep, src_cfg: ModelConfig) -> Path:
    """The sweep's prepared target dataset (a raw corpus prepared by global rank 0 into
    <output_dir>/data, before any process group exists)."""
    if (run.corpus is None) == (run.data_path is None):
        raise ValueError("pass one of --data_path (a prepared target dataset with a validation split) and --corpus")
    if run.data_path is not None:
        data_path = run.data_path
    else:
        if step.prep.valid_fraction <= 0:
            raise ValueError("--corpus needs --valid_fraction (e.g. 0.03): the plug-in metric scores held-out text")
        data_path = run.output_dir / "data"
        if parallel.is_rank0():
            preprocess(run.corpus, data_path, step.vocab_size or src_cfg.vocab_size, step.prep)
        wait_for(data_path / MANIFEST, f"the {step.lang} corpus in {data_path}")
    if not read_manifest(data_path).get("valid"):
        raise ValueError(f"{data_path} has no validation split for the plug-in metric: prepare it with mmadapt "
                         "preprocess --valid_fraction 0.03 into a new --output_dir (or pass --corpus with "
                         "--valid_fraction)")
    return data_path


def sweep(run: RunSpec, step: Sweep) -> dict | None:
    """Step 2 over each depth into <output_dir>/<N>/ (and, with cfg.ceiling, over the full
    primary model into <output_dir>/full/). Writes sweep.json (the records and the summary),
    sweep.md (table, cheapest depth) and sweep.png (needs matplotlib) into the output directory.
    A depth already trained is kept, an interrupted one resumed: run it again after a stop, or
    with more depths. Returns the summary (sweep.summarize) on global rank 0, None elsewhere."""
    cfg = step.cfg  # its ranges were checked when it was made (config.check_declared)
    src = read_source(step.source, step.source_tag)
    source, out, src_cfg = src.path, run.output_dir, src.cfg
    if src.record.get("recipe") != "minijoint":
        raise ValueError(f"the sweep compares the mini-models of a MINIJOINT run; {source} has recipe "
                         f"{src.record.get('recipe')}")
    depths = tuple(step.mini_layers or src_cfg.heads_after[:-1])
    for n in depths:
        src.family.minijoint_depth(src_cfg, n)
    if list(depths) != sorted(set(depths)):
        raise ValueError(f"--mini_layers {' '.join(map(str, depths))} must be ascending without repeats")
    data_path = _sweep_data(run, step, src_cfg)
    runs = {n: out / str(n) for n in depths}
    jobs = [("minijoint", n, run_dir) for n, run_dir in runs.items()]
    if cfg.ceiling:
        runs[CEILING] = out / CEILING
        jobs.append(("bl_base", None, runs[CEILING]))
    for system, n, run_dir in jobs:
        state = run_progress(run_dir, step.train.train_iters)
        if state == "done":
            continue
        if parallel.is_rank0():
            print(f"sweep: Step 2 over {'the full model' if n is None else f'the {n}-layer mini-model'} -> {run_dir}",
                  flush=True)
        depth_run = RunSpec(output_dir=run_dir, ds_config=run.ds_config, data_path=data_path,
                            resume=state == "resume", layout=run.layout)
        adapt_embeddings(depth_run, AdaptEmbeddings(system=system, source=source, lang=step.lang, train=step.train,
                                                    source_tag=step.source_tag, mini_layers=n))
    if dist.is_initialized() and not parallel.is_rank0():
        dist.barrier()  # rank 0 scores (the metric needs no process group)
        return None
    which = {str(run_dir.resolve()): n for n, run_dir in runs.items()}
    records = plugin_records(source, list(runs.values()), {step.lang: data_path}, step.train.seq_length,
                             cfg.plugin_blocks)
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
