"""Command line: `mmadapt <command>` and the scripts in launch/ share these entry points.

Each command parses its flags into the step's typed configs (a flag overrides the config field of
its own name) and calls the step in steps.py by keyword; nothing here trains or evaluates.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import gc
import json
import os
import sys
import textwrap
import traceback
from pathlib import Path

from mmadapt import checkpoint, faults, parallel, predict, steps
from mmadapt.bpb import BATCH_TOKENS, BPB_BYTES, MIN_BPB_BYTES
from mmadapt.config import (DEFAULT_DS_CONFIG, EMBEDDING_INITS, EXPAND_OUTPUT_STARTS, INVOKED_AS, LAYOUT_FIELDS,
                            MIN_VOCAB_SIZE, RECIPES, SYSTEMS, EvaluateConfig, FinetuneConfig, Layout, MiniModelConfig,
                            ModelConfig, Parser, PreprocessConfig, TrainConfig, add_dataclass_args, apply_recipe,
                            check_output_file, lang_code, override, whole_number)
from mmadapt.demo import main as demo_command
from mmadapt.flops import DEVICE_TFLOPS
from mmadapt.hf import SUPPORTED, export_hf, import_any
from mmadapt.report import (NO_ADAPTATION, PAPER, pyplot, adaptation_markdown, choose_baseline, flops_rows,
                            read_results, bpb_markdown, format_flops_table, paper_rows, plot_curves, plot_speedup,
                            report_markdown)
from mmadapt.models import FAMILIES, PRESETS, find_preset, import_plugins
from mmadapt.run import SOURCE_KINDS, STEP_ONE, RunSpec, read_source
from mmadapt.slurm import main as slurm_command
from mmadapt.sweep import SweepConfig
from mmadapt.tasks import TASKS



def model_presets() -> dict[str, ModelConfig]:
    """Every registered preset's model config (the defaults --help lists)."""
    return {name: model for name, (model, _) in PRESETS.items()}


def train_presets() -> dict[str, TrainConfig]:
    """Every registered preset's schedule."""
    return {name: train for name, (_, train) in PRESETS.items()}


def user_errors(main=None, *, resumes_itself: bool = False):
    """What a command's failures look like (faults.py lists the exit statuses): a user's mistake
    (ValueError, DataError included, or an OS error on a path the user gave) is one `error:`
    line and exit 2 (the steps check their inputs before they write anything); a write that the
    disk or file system failed (faults.IO_ERRNOS: full, over quota, an I/O error) one line and
    74; a divergence one line and exit 3; a stop on a signal one line and exit 75 (resume it); a
    pause at --exit_interval one line and 76 (resume it); Ctrl-C during start-up one line and 130.
    Anything else is an internal error: a traceback, exit 1. MMADAPT_DEBUG=1 shows the traceback
    of every failure. resumes_itself: a command with no --resume (sweep, extend, demo: the same
    command again goes on), which the stop, pause and damaged-run lines then do not name."""
    if main is None:
        return functools.partial(user_errors, resumes_itself=resumes_itself)

    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        def fail(code: int, message: str, every_rank: bool = True) -> int:
            if os.environ.get("MMADAPT_DEBUG") == "1":
                traceback.print_exc()
            if every_rank or parallel.is_rank0():
                print(message, file=sys.stderr, flush=True)
            return code

        try:
            import_plugins()  # families defined outside mmadapt (MMADAPT_IMPORT), before any flag is parsed
            return main(argv)
        except ValueError as e:
            if resumes_itself and isinstance(e, checkpoint.DamagedRun):  # its words are a --resume's
                return fail(faults.EXIT_USER, f"error: {e.detail}: restore its files and run the same command "
                                              "again, or start a new --output_dir")
            return fail(faults.EXIT_USER, f"error: {e}")
        except OSError as e:
            # a write to an open file (f.write, fsync) names no file; ENOSPC and EDQUOT are a write's alone
            # (EIO may be a read's: an input on a failing disk is no "free space, then resume")
            if e.filename is None and e.errno in faults.FULL_ERRNOS:
                return fail(faults.EXIT_IO, f"error: {e.strerror or e}: {DISK_FULL}")
            if e.filename is None:
                raise
            if isinstance(e, (FileExistsError, NotADirectoryError)) and Path(e.filename).is_file():
                return fail(faults.EXIT_USER, f"error: {e.filename} is a file where a directory is needed: choose "
                                              "another path")
            if e.errno in faults.IO_ERRNOS:  # (a full disk mid-run: what was complete before it stays)
                return fail(faults.EXIT_IO, f"error: {e.filename}: {e.strerror or e}")
            return fail(faults.EXIT_USER, f"error: {e.filename}: {e.strerror or e}")
        except faults.Diverged as e:
            return fail(faults.EXIT_DIVERGED, f"error: diverged: {e}", every_rank=False)
        except faults.Stopped as e:
            return fail(faults.EXIT_STOPPED, e.said(not resumes_itself), every_rank=False)
        except faults.Paused as e:
            return fail(faults.EXIT_PAUSED, e.said(not resumes_itself), every_rank=False)
        except faults.PeerFailed as e:
            return fail(1, f"error: {e}")
        except KeyboardInterrupt:
            return fail(faults.EXIT_INTERRUPTED, "interrupted", every_rank=False)
        except Exception as e:  # a library's own error for a full disk (safetensors' writer: SafetensorError)
            said = str(e)
            if not any(os.strerror(n) in said for n in faults.FULL_ERRNOS):  # (the OS's words, as Rust's quote them)
                raise
            return fail(faults.EXIT_IO, f"error: {said.strip().splitlines()[0][:200]}: {DISK_FULL}")
    return wrapped


# how a run goes on after a write that a full disk failed (what was complete before it is kept)
DISK_FULL = ("a write failed (the disk full or over quota): free space, then run the same command again (with "
             "--resume where the command takes it)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output_dir", required=True, help="run directory: checkpoints, logs, run.json")
    p.add_argument("--ds_config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed JSON (ZeRO stage, precision)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed


def _data_args(p: argparse.ArgumentParser, corpus_help: str) -> None:
    p.add_argument("--data_path", help="a dataset prepared once by `mmadapt preprocess` (shared by every run "
                   "on that corpus and tokenizer)")
    p.add_argument("--corpus", help=f"{corpus_help}; prepared into <output_dir>/data by the run itself (small "
                   "corpora only: larger ones go through mmadapt preprocess)")


def _path(value) -> Path | None:
    return Path(value) if value else None


def _run_spec(args, text_needed: bool = False) -> RunSpec:
    """The run description a command's flags give (those it has); --corpus and --data_path are
    two ways to give one text, refused together (and, where the command has no default text:
    text_needed, refused when neither is given)."""
    given = [getattr(args, name, None) is not None for name in ("corpus", "data_path")]
    if all(given) or (text_needed and not any(given)):
        raise ValueError("pass one of --data_path (a prepared dataset) and --corpus (raw text)")
    return RunSpec(output_dir=Path(args.output_dir), ds_config=Path(args.ds_config),
                   data_path=_path(getattr(args, "data_path", None)), corpus=getattr(args, "corpus", None),
                   tokenizer=_path(getattr(args, "tokenizer", None)), resume=getattr(args, "resume", False),
                   layout=Layout.of(args), prep=override(PreprocessConfig(), args))


def _done(output_dir, what: str) -> None:
    """Global rank 0: the line a training step ends with, from the run's whole log (metrics.jsonl:
    a resumed run's updates before the stop included; one resumed from its last save trained
    nothing in this process, yet its run did)."""
    log = Path(output_dir) / "metrics.jsonl"
    if not (parallel.is_rank0() and log.is_file()):
        return
    rows = [r for r in steps.logged_rows(Path(output_dir)) if "loss" in r]  # training rows (validation: valid_loss)
    if rows:
        first, last = rows[0], rows[-1]
        heads = ", ".join(f"L{k}: {v:.3f}" for k, v in last.get("head_losses", {}).items())
        texts = ", ".join(f"{k.removesuffix('_loss')} {v:.3f}" for k, v in last.items()
                          if k in ("source_loss", "target_loss") and v is not None)  # Step 2's replay
        print(f"done: step {last['step']}, loss {first['loss']:.3f} -> {last['loss']:.3f}"
              + (f" (heads {heads})" if len(last.get("head_losses", {})) > 1 else "")
              + (f" ({texts})" if texts else "") + f"; {what}")


# --- Step 1 --------------------------------------------------------------------------------------------

def pretrain_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pretrain", description="Step 1: pretrain a source-language MLM "
                                "(BL_BASE, BL_SMALL or MINIJOINT) with DeepSpeed.")
    p.add_argument("--recipe", choices=RECIPES, default="bl_base",
                   help="which of the paper's systems (bl_small: --mini_layers layers, the mini-model's depth; "
                        "--num_layers is the primary model's)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size and schedule")
    _data_args(p, "UTF-8 text, one sentence per line, blank line between documents; or bible:<lang> for "
               "the packaged Bible (e.g. bible:en)")
    p.add_argument("--tokenizer", help="an existing SentencePiece .model (default: train one on the corpus)")
    _run_args(p)
    add_dataclass_args(p, ModelConfig, defaults=model_presets())
    add_dataclass_args(p, TrainConfig, defaults=train_presets(), step=steps.Pretrain.name)
    add_dataclass_args(p, MiniModelConfig, only=("mini_layers",))
    return p


def configs_from_args(args) -> tuple[ModelConfig, TrainConfig]:
    """Preset (which picks the model family), then the shape flags (--num_layers sets the primary
    depth), then the recipe, then an explicit --head_layers."""
    if args.head_layers is not None and args.mini_layers is not None:
        raise ValueError("--head_layers places every head itself, --mini_layers places MINIJOINT's secondary heads: "
                         "pass one of them")
    if args.recipe == "bl_base" and args.mini_layers is not None:  # it shaped nothing, without a word
        raise ValueError("--mini_layers sets BL_SMALL's depth or MINIJOINT's secondary heads; bl_base trains one "
                         "head after its last layer (--num_layers): drop --mini_layers")
    _, model, train = find_preset(args.preset)
    model = apply_recipe(override(model, args), args.recipe, override(MiniModelConfig(), args).mini_layers)
    if args.head_layers is not None:
        model = dataclasses.replace(model, head_layers=tuple(args.head_layers))
    return model, override(train, args)


@user_errors
def pretrain_main(argv=None) -> int:
    args = pretrain_parser().parse_args(argv)
    model, train = configs_from_args(args)
    run = _run_spec(args, text_needed=True)
    steps.pretrain(run=run, step=steps.Pretrain(model=model, train=train, recipe=args.recipe))
    _done(args.output_dir, f"{args.recipe} in {args.output_dir}")
    return 0


# --- data: prepare once, train many ----------------------------------------------------------------------

def preprocess_parser() -> argparse.ArgumentParser:
    p = Parser(prog="preprocess", description="Prepare a corpus once for every run that trains "
                                "on it: a SentencePiece model (or --tokenizer) and the corpus encoded in parallel "
                                "into megatron-core's indexed dataset; pass --data_path to the training commands.")
    p.add_argument("--corpus", required=True, help="UTF-8 text, one sentence per line, blank line between "
                   "documents; or bible:<lang> for the packaged Bible")
    p.add_argument("--output_dir", required=True, help="the prepared dataset (a directory)")
    p.add_argument("--tokenizer", help="an existing SentencePiece .model, or an imported run's tokenizer/spm.model "
                   "(default: train one on a sample); its size is the vocabulary size")
    p.add_argument("--expand_from", help="a run whose vocabulary Step 2 --vocab_mode expand extends: encode with its "
                   "tokenizer plus the target's pieces it lacks (the target: --tokenizer, or one of --vocab_size "
                   "pieces trained on the corpus)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="without --tokenizer: whose vocab_size "
                   "to train")
    # the least a trained vocabulary holds, as adapt's, sweep's and extend's --vocab_size
    p.add_argument("--vocab_size", type=whole_number(MIN_VOCAB_SIZE), help="SentencePiece vocabulary size V (special "
                   "tokens included) (default: --tokenizer's size, else the --preset's: "
                   + ", ".join(f"{m.vocab_size} ({name})" for name, (m, _) in PRESETS.items())
                   + f") [>= {MIN_VOCAB_SIZE}]")
    add_dataclass_args(p, PreprocessConfig)
    return p


@user_errors
def preprocess_main(argv=None) -> int:
    args = preprocess_parser().parse_args(argv)  # steps.preprocess checks --vocab_size (0 was "unset")
    vocab = (args.vocab_size if args.vocab_size is not None else
             None if args.tokenizer else PRESETS[args.preset][0].vocab_size)
    steps.preprocess(Path(args.corpus), output_dir=Path(args.output_dir), vocab_size=vocab,
                     cfg=override(PreprocessConfig(), args), tokenizer=_path(args.tokenizer),
                     expand_from=_path(args.expand_from))
    return 0


# --- Step 1b and Step 2: the model comes from an earlier run, only its layout may change ----------------

def _primary_tag(p: argparse.ArgumentParser, default: str = "the newest complete one") -> None:
    p.add_argument("--primary_tag", help=f"its checkpoint to use (default: {default})")


def _primary_args(p: argparse.ArgumentParser, primary_help: str) -> None:
    """--primary (required) and --primary_tag, for the steps that start from one run."""
    p.add_argument("--primary", required=True, help=primary_help)
    _primary_tag(p)


def _later_step_args(p: argparse.ArgumentParser, model_fields: tuple[str, ...], step: str) -> None:
    """A step over an earlier run: its schedule (--preset), run flags, layout and `step`'s TrainConfig flags."""
    p.add_argument("--preset", choices=sorted(PRESETS), help="training schedule (the model's shape comes from the "
                   "source run; default: its family's small preset, "
                   + ", ".join(f"{f.small_preset} for {f.name}" for f in FAMILIES.values()) + ")")
    _run_args(p)
    add_dataclass_args(p, ModelConfig, only=model_fields, defaults="the source run's")
    add_dataclass_args(p, TrainConfig, defaults=train_presets(), step=step)


def _schedule(args, source: str, kinds: tuple[str, ...] = SOURCE_KINDS) -> TrainConfig:
    """The TrainConfig of a step over the run `source` (of one of `kinds`, the step's own: a run
    of another is refused naming them): its --preset's schedule (default: the source family's
    small preset; another family's preset is refused) with the flags over it."""
    src = read_source(source, kinds=kinds)
    family = src.family
    preset = args.preset or family.small_preset
    owner, small, train = find_preset(preset)
    if owner is not family:
        raise ValueError(f"--preset {preset} is a {owner.name} preset, but {source} is a {family.name} run: drop "
                         f"--preset, or choose one of {', '.join(family.presets)}")
    width = src.cfg.hidden_size  # a preset's model is told by its width (a mini-model keeps its primary's)
    schedule = override(train, args)  # what the run trains (under MMADAPT_TINY=1: capped)
    if args.preset is None and width != small.hidden_size and parallel.is_rank0():
        # the default schedule is sized for the small preset's model (a CPU's), not for this one
        same = [name for name, (m, _) in family.presets.items() if m.hidden_size == width]
        print(f"note: {source} is {width} wide and the schedule is the {preset} preset's, sized for a CPU "
              f"({schedule.train_iters} updates of {schedule.train_micro_batch_size_per_gpu} x {schedule.seq_length}, "
              f"lr {schedule.lr:g}, with your flags): pass --preset {same[0] if same else 'NAME'} or the schedule's "
              "flags for one sized for it", flush=True)
    return schedule


def minipost_parser() -> argparse.ArgumentParser:
    p = Parser(prog="build_minipost", description="Step 1b (MINIPOST): copy the bottom "
                                "N layers, embeddings and MLM head of a pretrained model, insert K new "
                                "layers and train only those with source-language MLM.")
    _primary_args(p, "the primary model's run: a pretrain, import-hf or fit-head run")
    _data_args(p, "source-language corpus (default: the primary run's prepared data)")
    _later_step_args(p, LAYOUT_FIELDS, steps.BuildMinipost.name)
    add_dataclass_args(p, MiniModelConfig)
    return p


@user_errors
def minipost_main(argv=None) -> int:
    args = minipost_parser().parse_args(argv)
    step = steps.BuildMinipost(primary=Path(args.primary), train=_schedule(args, args.primary, STEP_ONE),
                               mini=override(MiniModelConfig(), args), primary_tag=args.primary_tag)
    steps.build_minipost(run=_run_spec(args), step=step)
    _done(args.output_dir, f"MINIPOST mini-model in {args.output_dir}")
    return 0


def fit_head_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fit-head", description="A headless encoder (import-hf of a BertModel, RobertaModel or "
               "XLMRobertaModel, or of a sentence-transformers directory) gets a new MLM head, trained over its frozen "
               "body on source-language text (only the head's parameters train): the run every later step takes.")
    _primary_args(p, "the headless run (mmadapt import-hf's --output_dir)")
    _data_args(p, "source-language corpus, encoded with the run's own tokenizer")
    _later_step_args(p, LAYOUT_FIELDS, steps.FitHead.name)
    return p


@user_errors
def fit_head_main(argv=None) -> int:
    args = fit_head_parser().parse_args(argv)
    step = steps.FitHead(primary=Path(args.primary), train=_schedule(args, args.primary, STEP_ONE),
                         primary_tag=args.primary_tag)
    steps.fit_head(run=_run_spec(args), step=step)
    _done(args.output_dir, f"MLM head over {args.primary} in {args.output_dir}")
    return 0


def adapt_parser() -> argparse.ArgumentParser:
    p = Parser(prog="adapt", description="Step 2: learn a new language's embeddings "
                                "(tied with the output projection) by MLM over a frozen model.")
    p.add_argument("--system", choices=SYSTEMS, required=True, help="minijoint/minipost: over the "
                   "mini-model; bl_base: over the full primary model; bl_small: over the N-layer model")
    p.add_argument("--source", required=True, help="the run to adapt: a pretrain run (bl_base, bl_small, "
                   "minijoint) or a build_minipost run (minipost)")
    p.add_argument("--source_tag", help="its checkpoint to use (default: the newest complete one)")
    p.add_argument("--lang", required=True, type=lang_code, help="target language code, recorded with the embeddings")
    _data_args(p, "target-language corpus (default: bible:<lang>, the packaged Bible)")
    p.add_argument("--tokenizer", help="with --corpus: an existing target-language SentencePiece .model "
                   "(default: train one with --vocab_size pieces on the corpus)")
    p.add_argument("--vocab_size", type=whole_number(MIN_VOCAB_SIZE), help="target vocabulary size V (default: the "
                   "--data_path's or --tokenizer's size, else the source model's)")
    _later_step_args(p, LAYOUT_FIELDS, steps.AdaptEmbeddings.name)
    add_dataclass_args(p, MiniModelConfig, only=("mini_layers",),
                       defaults="--system minijoint: the source run's secondary head, when it has only one")
    return p


@user_errors
def adapt_main(argv=None) -> int:
    args = adapt_parser().parse_args(argv)
    depth = None if args.mini_layers is None else MiniModelConfig(args.mini_layers).one_depth("adapt")
    step = steps.AdaptEmbeddings(system=args.system, source=Path(args.source), lang=args.lang,
                                 train=_schedule(args, args.source), vocab_size=args.vocab_size,
                                 source_tag=args.source_tag, mini_layers=depth)
    steps.adapt_embeddings(run=_run_spec(args), step=step)
    _done(args.output_dir, f"{args.system} {args.lang} embeddings, artifacts in {Path(args.output_dir) / 'embeddings'}")
    return 0


def sweep_parser() -> argparse.ArgumentParser:
    p = Parser(prog="sweep", description="Beyond the paper: Step 2 over each mini-model of a MINIJOINT run "
               "pretrained with several secondary heads (pretrain --recipe minijoint --mini_layers 2 4 6), every "
               "checkpoint scored by the plug-in metric (masked or next pieces, as the family trains); writes a "
               "table and a plot of gain against Step-2 "
               "compute per depth, naming the cheapest depth that reaches near-maximal gain. Depths already "
               "trained in --output_dir are kept, interrupted ones resumed.")
    p.add_argument("--source", required=True, help="the MINIJOINT pretrain run")
    p.add_argument("--source_tag", help="its checkpoint to use (default: the newest complete one)")
    p.add_argument("--lang", required=True, type=lang_code, help="target language code")
    _data_args(p, "target-language corpus (bible:<lang>: the packaged Bible) with --valid_fraction held out for "
               "the metric")
    p.add_argument("--vocab_size", type=whole_number(MIN_VOCAB_SIZE), help="with --corpus: the target vocabulary size "
                   "V (default: the source model's)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="Step-2 training schedule (the model's shape comes from "
                   "the source run; default: its family's small preset)")
    p.add_argument("--output_dir", required=True, help="one Step-2 run per depth (<output_dir>/<N>), the "
                   "ceiling's (<output_dir>/full), sweep.md, sweep.json, sweep.png")
    p.add_argument("--ds_config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed JSON (ZeRO stage, precision)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    add_dataclass_args(p, MiniModelConfig, only=("mini_layers",), defaults="every secondary head of the source run")
    add_dataclass_args(p, SweepConfig)
    add_dataclass_args(p, PreprocessConfig, only=("valid_fraction", "workers"))
    add_dataclass_args(p, ModelConfig, only=LAYOUT_FIELDS, defaults="the source run's")
    add_dataclass_args(p, TrainConfig, defaults=train_presets(), step=steps.Sweep.name)
    return p


@user_errors(resumes_itself=True)
def sweep_main(argv=None) -> int:
    args = sweep_parser().parse_args(argv)
    step = steps.Sweep(source=Path(args.source), lang=args.lang, train=_schedule(args, args.source),
                       mini_layers=None if args.mini_layers is None else MiniModelConfig(args.mini_layers).mini_layers,
                       cfg=override(SweepConfig(), args), source_tag=args.source_tag,
                       prep=override(PreprocessConfig(), args), vocab_size=args.vocab_size)
    summary = steps.sweep(run=_run_spec(args), step=step)
    if summary is not None:
        best = summary["cheapest"]
        print(f"done: {len(summary['rows'])} Step-2 runs scored; cheapest depth reaching "
              f"{round(100 * summary['near_max'])}% of {summary['reference_from']}: "
              f"{'none' if best is None else f'N = {best}'}; table in {Path(args.output_dir) / 'sweep.md'}")
    return 0


# --- Step 3 and Step 4 ----------------------------------------------------------------------------------

def finetune_parser() -> argparse.ArgumentParser:
    p = Parser(prog="finetune", description="Step 3: fine-tune the primary model of a "
                                "pretrain run on a source-language task, word embeddings frozen.")
    p.add_argument("--task", choices=sorted(TASKS), required=True, help="xnli/pawsx (pairs), mlqa/xquad "
                   "(extractive QA), pos (CoNLL-U), ner (CoNLL-2003), bible-genre and bible-testament (a verse's "
                   "book genre, 5 classes, or testament, 2: the demo's tasks on the packaged Bible); your own data "
                   "in CSV, TSV or JSON Lines: classify (a text), pair (two texts), tag (tokens), columns named (or "
                   "numbered, in a file without a header line) by --text_column, --text_pair_column, --label_column")
    _primary_args(p, "the run whose primary model is fine-tuned: a pretrain, import-hf or fit-head run")
    p.add_argument("--train_file", help="source-language training data in the task's format "
                   "(bible-genre: 'bible', the default)")
    p.add_argument("--eval_file", help="optional source-language evaluation data: its score is printed and "
                   "kept in run.json ({lang} is replaced by --source_lang)")
    p.add_argument("--source_lang", default="en", help="language of the training data")
    _run_args(p)
    add_dataclass_args(p, ModelConfig, only=LAYOUT_FIELDS, defaults="the primary run's")
    add_dataclass_args(p, FinetuneConfig)
    return p


@user_errors
def finetune_main(argv=None) -> int:
    args = finetune_parser().parse_args(argv)
    step = steps.Finetune(task=args.task, primary=Path(args.primary), cfg=override(FinetuneConfig(), args),
                          train_file=args.train_file, eval_file=args.eval_file, source_lang=args.source_lang,
                          primary_tag=args.primary_tag)
    out, _ = steps.finetune(run=_run_spec(args), step=step)
    if parallel.is_rank0() and "final_loss" in out:
        print(finetune_summary(out, args.output_dir))
    return 0


def finetune_summary(record: dict, output_dir) -> str:
    """The line a fine-tuning run ends with, from its record (run.json): its source-language score
    beside the chance level, and every warning (a run that learned nothing says so here, not
    only in run.json)."""
    extra = (f", {record['source_lang']} {record['metric']} {record['source_score']:.1f}"
        if "source_score" in record else "")
    chance = record.get("source_chance")
    extra += f" (chance {chance['chance']:.1f})" if chance else ""
    warned = f"; WARNING: {'; '.join(record['warnings'])}" if record.get("warnings") else ""
    return (f"done: {record['task']} on {record['train_examples']} examples, {record['updates']} updates, final loss "
            f"{record['final_loss']:.3f}{extra}; model in {output_dir}{warned}")


def evaluate_parser() -> argparse.ArgumentParser:
    p = Parser(prog="evaluate", description="Step 4: swap target-language embeddings "
               "(Step 2) into fine-tuned models (Step 3) and evaluate zero-shot; or, with --plugin_data, into "
               "the primary model's MLM head (the plug-in MLM metric against the unigram reference, no task). "
               "One record per checkpoint, the input of `mmadapt report`.")
    p.add_argument("--finetuned", nargs="+", help="Step-3 run directories of one primary model (e.g. one per "
                   "seed): their scores are averaged")
    p.add_argument("--embeddings", nargs="+", required=True, help="Step-2 artifacts (<adapt run>/embeddings/"
                   "<tag>) or adapt run directories (all their artifacts: a score-versus-compute curve)")
    p.add_argument("--eval_file", help="target-language evaluation data; {lang} is replaced by each artifact's "
                   "language (bible-genre: 'bible')")
    p.add_argument("--plugin_data", help="plug-in MLM metric instead of a task: a prepared target dataset with a "
                   "validation split (mmadapt preprocess --valid_fraction), {lang} replaced by each artifact's "
                   "language; the one Step 2 trained on")
    p.add_argument("--primary", help="with --plugin_data: the run whose primary model the embeddings belong to")
    p.add_argument("--seq_length", type=whole_number(8), help="with --plugin_data: tokens per held-out block "
                   "(default: the blocks the primary model was pretrained on, 64 for an imported one; longer ones need "
                   "--allow_untrained_positions)")
    p.add_argument("--plugin_blocks", type=whole_number(1), default=256, help="with --plugin_data: held-out blocks "
                   "scored")
    p.add_argument("--bpb_bytes", type=whole_number(MIN_BPB_BYTES), default=BPB_BYTES, help="with --plugin_data: "
                   "bytes of raw held-out text scored in bits per byte (the scale every tokenizer shares: "
                   "docs/bits-per-byte.md)")
    p.add_argument("--graft", action="store_true", help="the embeddings were trained over a base model and --primary "
                   "(with --plugin_data) or the --finetuned runs' model (an imported classifier) was fine-tuned from it: "
                   "score them grafted into it (export-hf --graft's check first)")
    p.add_argument("--output", required=True, help="JSON file of records {system, task, lang, step, flops, "
                   "score, ...}; must not exist yet")
    add_dataclass_args(p, FinetuneConfig, only=("eval_batch_tokens",), defaults="each --finetuned run's own; with "
                       f"--plugin_data, the bits-per-byte rows' {BATCH_TOKENS}")
    add_dataclass_args(p, FinetuneConfig, only=("allow_untrained_positions",))
    add_dataclass_args(p, EvaluateConfig)
    return p


@user_errors
def evaluate_main(argv=None) -> int:
    args = evaluate_parser().parse_args(argv)
    if args.eval_batch_tokens is not None:
        FinetuneConfig(eval_batch_tokens=args.eval_batch_tokens)  # its declared range, refused naming the flag
    if args.plugin_data:
        if args.finetuned or args.eval_file:
            raise ValueError("--plugin_data scores the artifacts through the primary model, not fine-tuned runs on a "
                             "task: drop --finetuned/--eval_file (or --plugin_data, to score the task)")
        if not args.primary:
            raise ValueError("--plugin_data scores the artifacts through their primary model: pass --primary with the "
                             "run they were trained over (with --graft, the sibling they go into)")
        if args.no_adaptation_baseline is not None:
            raise ValueError("--no_adaptation_baseline scores fine-tuned runs on a task (--finetuned, --eval_file); "
                             "--plugin_data scores each run's start (update 0) instead: drop the flag")
        records = steps.evaluate_plugin(Path(args.primary), embeddings=args.embeddings, data=args.plugin_data,
                                        output=Path(args.output), seq_length=args.seq_length,
                                        blocks=args.plugin_blocks, bpb_bytes=args.bpb_bytes, graft=args.graft,
                                        allow_untrained_positions=bool(args.allow_untrained_positions),
                                        bpb_batch_tokens=(BATCH_TOKENS if args.eval_batch_tokens is None
                                                          else args.eval_batch_tokens))
    else:
        if not args.finetuned or not args.eval_file:
            raise ValueError("pass --finetuned and --eval_file (a task), or --primary and --plugin_data")
        # the flags of --plugin_data alone, told apart from their defaults by a parse without them
        probe = evaluate_parser()
        probe.set_defaults(plugin_blocks=None, bpb_bytes=None)
        given = vars(probe.parse_args(argv))
        stray = [f"--{k}" for k in ("primary", "seq_length", "plugin_blocks", "bpb_bytes") if given[k] is not None]
        if stray:
            raise ValueError(f"{stray[0]} sizes the plug-in score of --plugin_data; a task (--finetuned, --eval_file) "
                             "reads the fine-tuned runs' own: drop it")
        records = steps.evaluate(args.finetuned, embeddings=args.embeddings, eval_file=args.eval_file,
                                 output=Path(args.output), eval_batch_tokens=args.eval_batch_tokens,
                                 allow_untrained_positions=bool(args.allow_untrained_positions),
                                 cfg=override(EvaluateConfig(), args), graft=args.graft)
    for r in records:
        chance = "" if r.get("chance") is None else f" (chance {r['chance']:.2f})"
        flag = "  (!) see the fine-tune warnings above" if r.get("finetune_warnings") else ""
        when = "no adaptation" if r["system"] == NO_ADAPTATION else f"step {r['step']:>7d}"
        bits = f"  {r['bpb']:.3f} bits per byte (no adaptation {r['none_bpb']:.3f})" if "bpb" in r else ""
        print(f"{r['system']:10s} {r['task']} {r['lang']} {when}  {r['flops']:.3g} FLOPs  "
              f"{r['metric']} {r['score']:.2f}{chance}{bits}{flag}")
    for task in dict.fromkeys(r["task"] for r in records):
        bought = adaptation_markdown(records, task)
        print("\n" + bought if bought else "", end="")
        per_byte = bpb_markdown([r for r in records if r["task"] == task])
        print("\n" + per_byte if per_byte else "", end="")
    print(f"{len(records)} records in {args.output}")
    return 0


def predict_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mmadapt predict", description="Look at a run's predictions on your texts, one JSON object per "
               "input line (mmadapt/predict.py is the Python API behind it). A pretrain, build_minipost or import-hf "
               "run: the encoder's top pieces at each <mask> of a text, the decoder's top next pieces after it; "
               "with --embeddings, the run's primary model with a Step-2 artifact swapped in. A fine-tuning run: its "
               "label and probabilities (classify, pair), a tag per word (tag) or the answer (QA).")
    p.add_argument("--run", required=True, help="a pretrain, build_minipost, import-hf or finetune run directory")
    p.add_argument("--embeddings", help="a Step-2 artifact (<adapt run>/embeddings/<tag>) swapped in: the target "
                   "language's embeddings and tokenizer (zero-shot)")
    p.add_argument("--graft", action="store_true", help="with --embeddings trained over a base model: --run is a model "
                   "fine-tuned from it (an imported instruct or chat sibling, an imported classifier); checked as "
                   "export-hf --graft checks it, the distances on stderr (docs/huggingface.md)")
    p.add_argument("--input", default="-", help="one input per line (default: stdin): a text (tag: its words "
                   "separated by spaces), or for pair and QA models two fields separated by a tab (text TAB text_pair; "
                   "question TAB context); a .jsonl file: one object per line with those keys")
    p.add_argument("--jsonl", action="store_true", help="the input is JSON Lines whatever its name (stdin included)")
    p.add_argument("--output", help="write the JSON Lines here (must not exist yet; default, or -: stdout)")
    p.add_argument("--top_k", type=whole_number(1),
                   help=f"language models: pieces listed per position (default: {predict.TOP_K})")
    p.add_argument("--tag", help="a language model's checkpoint (default: with --embeddings, the one they were "
                   "trained over or for where the run holds it; else the newest complete one)")
    p.add_argument("--device", help="cpu or cuda[:i] (default: the GPU if there is one)")
    return p


@user_errors
def predict_main(argv=None) -> int:
    args = predict_parser().parse_args(argv)
    if args.output == "-":  # as --input -: the standard stream, not a file named '-'
        args.output = None
    if args.output and Path(args.output).exists():
        raise ValueError(f"{args.output} already exists: choose a new --output (nothing is overwritten)")
    if args.output:
        check_output_file(Path(args.output), "--output")
    kind = predict.kind_of(args.run)
    predict.check_top_k(args.run, kind, args.top_k)
    inputs = predict.read_inputs(args.input, kind, args.jsonl or None)  # before the weights: bad input is cheap
    model = predict.load(args.run, args.embeddings, tag=args.tag, device=args.device, graft=args.graft)
    rows = predict.predict_rows(model, inputs, args.top_k)  # refuses NaN or infinite outputs
    text = "".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows)
    if args.output:  # its directory may be new (check_output_file: one that can be created)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        checkpoint.publish_new(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


# --- compute and results reports ---------------------------------------------------------------------

@user_errors
def flops_main(argv=None) -> int:
    p = Parser(prog="mmadapt flops", description="Training cost of every step of every "
                                "system (paper Appendix A.1: A1, A3, A4) and the exact counts.", tiny=False)
    p.add_argument("--paper", action="store_true", help="the paper's settings (RoBERTa-base, U=125,000, B=2048, "
                   "s=512, V=50,000, p=0.15), printed as JSON")
    p.add_argument("--json", action="store_true", help="JSON rows instead of a table")
    p.add_argument("--preset", choices=sorted(PRESETS), default="roberta-base", help="model shape and schedule")
    p.add_argument("--global_batch", type=whole_number(1), help="sequences per update B (default: the paper's 2048 for "
                   "roberta-base, else micro-batch x accumulation of the preset on one rank)")
    p.add_argument("--device", choices=sorted(DEVICE_TFLOPS), default="v100-paper",
                   help="throughput for the device-days of the exact count")
    add_dataclass_args(p, ModelConfig, only=("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                             "vocab_size"))
    add_dataclass_args(p, TrainConfig, only=("seq_length", "train_iters", "mask_prob", "score_fraction"))
    add_dataclass_args(p, MiniModelConfig)
    args = p.parse_args(argv)
    shape = [a.option_strings[0] for a in p._actions
             if a.dest not in ("help", "verbose", "paper", "json") and getattr(args, a.dest) != a.default]
    if args.paper and shape:  # the paper's rows are fixed: a shape or device given beside them would be dropped
        raise ValueError(f"--paper prints the paper's fixed settings: drop {', '.join(shape)}, or drop --paper for "
                         "the counts at your settings")
    if args.paper:
        rows = paper_rows()
    else:
        family, model, train = find_preset(args.preset)
        model, train = family.validate(override(model, args)), override(train, args)
        train.validate(model)
        family.check_loop(train)
        mini = override(MiniModelConfig(), args)
        batch = args.global_batch or (PAPER["global_batch"] if args.preset == "roberta-base" else
                                      train.global_batch(1))
        rows = flops_rows(family, model, train, batch, mini, args.device)
    print(json.dumps(rows, indent=1) if args.json or args.paper else format_flops_table(rows))
    return 0


@user_errors
def report_main(argv=None) -> int:
    p = Parser(prog="mmadapt report", description="Evaluation results (Step 4 JSON) -> "
                                "final scores with retention and days to near-maximal performance.")
    p.add_argument("results", nargs="+", help="JSON files, each a list of {system, task, lang, step, flops, score}")
    p.add_argument("--output", help="also write the markdown here")
    p.add_argument("--plots", help="write curves.png (score vs Step-2 compute, as the paper's Figure 3) and "
                   "speedup.png (mean per-language speedup, as Figure 1) into this directory (needs matplotlib)")
    p.add_argument("--device", default="v100-paper", help="device whose days are reported")
    p.add_argument("--baseline", help="the system retention, gains and the near-maximal target (95%% of its final "
                   "score) are measured against (default: bl_base; records without it: the system with the most "
                   "Step-2 compute, e.g. a ceiling minijoint:full, or the only system)")
    args = p.parse_args(argv)
    if args.output and any(Path(args.output).resolve() == Path(f).resolve() for f in args.results):
        raise ValueError(f"--output {args.output} is one of the results files it reads: choose another file")
    if args.output and Path(args.output).is_file():
        raise ValueError(f"{args.output} already exists: choose a new --output (nothing is overwritten)")
    if args.output:
        check_output_file(Path(args.output), "--output")
    if args.plots and Path(args.plots).exists() and not Path(args.plots).is_dir():
        raise ValueError(f"--plots {args.plots} is a file: name a directory for the plots")
    if args.output and args.plots:  # the table then lost under a plot, or its path wanted as the directory
        plots = Path(args.plots).resolve()
        if Path(args.output).resolve() in (plots, plots / "curves.png", plots / "speedup.png"):
            raise ValueError(f"--output {args.output} is where --plots {args.plots} writes: choose another file for "
                             "the table or another directory for the plots")
    if args.plots:
        pyplot()  # matplotlib's absence refused before anything is written
        check_output_file(Path(args.plots) / "curves.png", "--plots")
        made = [name for name in ("curves.png", "speedup.png") if (Path(args.plots) / name).exists()]
        if made:
            raise ValueError(f"--plots {args.plots} holds {' and '.join(made)} already: choose a new directory "
                             "(nothing is overwritten)")
    records = read_results(args.results)
    baseline = args.baseline
    if baseline is None:
        baseline, why = choose_baseline(records)
        if why:
            print(f"baseline: {baseline} ({why}; --baseline chooses another)", file=sys.stderr)
    md = report_markdown(records, baseline=baseline, device=args.device)
    if args.output:  # before the plots: a refused plot leaves the table written (its directory may be new)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        checkpoint.publish_new(Path(args.output), md + "\n")
    if args.plots:
        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        plot_curves(records, out / "curves.png", device=args.device, baseline=baseline)
        if not plot_speedup(records, out / "speedup.png", baseline=baseline, device=args.device):
            print(f"note: no speedup.png: no system has a speedup over {baseline} to plot (none but {baseline} reaches "
                  f"95% of its final score, or {baseline} reaches it with no Step-2 compute)", file=sys.stderr)
    print(md)
    return 0


@user_errors(resumes_itself=True)
def demo_main(argv=None) -> int:
    return demo_command(argv)


@user_errors
def slurm_env_main(argv=None) -> int:
    return slurm_command(argv)


# --- Hugging Face interchange ------------------------------------------------------------------------

@user_errors
def import_hf_main(argv=None) -> int:
    p = Parser(prog="mmadapt import-hf", description="A Hugging Face encoder (masked LM, or a body without a head) "
               "or causal LM (" + SUPPORTED + "), or a sentence-transformers directory of such an encoder, as a Step-1 "
               "run: what build_minipost --primary, adapt --system bl_base --source and finetune --primary take (a "
               "headless body after mmadapt fit-head).")
    p.add_argument("--model", required=True, help="a local Hugging Face model directory (config.json, "
                   "model.safetensors or pytorch_model.bin, tokenizer files), or a sentence-transformers directory "
                   "(modules.json, the transformer's files at the top or in its module's folder)")
    p.add_argument("--output_dir", required=True, help="the run directory to write (must not exist or be empty)")
    p.add_argument("--task", choices=[n for n, t in TASKS.items() if t.kind == "classify"],
                   help="a sequence classifier (BertForSequenceClassification, RobertaForSequenceClassification, ...): "
                   "the task whose labels it predicts; it is imported as a fine-tuning (Step-3) run, which evaluate and "
                   "export-hf --finetuned take (--graft: Step-2 embeddings of the base it was fine-tuned from)")
    p.add_argument("--roles_from", help="an import-hf run of the base model this one was fine-tuned from (the same "
                   "vocabulary): its tokens for mmadapt's special roles (pad, unk, <s>, </s>, <mask>) are taken, so that "
                   "Step-2 embeddings trained over the base graft into this model (an instruct model's eos, the end of "
                   "a turn, is another token than its base's; docs/huggingface.md)")
    args = p.parse_args(argv)
    run = import_any(Path(args.model), output_dir=Path(args.output_dir), task=args.task,
                     roles_from=_path(args.roles_from))
    m = run["model"]
    if run["step"] == "finetune":
        print(f"imported {run['imported_from']['architecture']} as a {run['task']} fine-tuning run: {m['num_layers']} "
              f"layers, hidden {m['hidden_size']}, vocabulary {m['vocab_size']}, labels {', '.join(run['labels'])}; "
              f"run in {args.output_dir} (its encoder in {args.output_dir}/body)")
        return 0
    note = run["imported_from"].get("note")
    if run["imported_from"].get("headless"):
        note = (f"{note}; " if note else "") + f"headless: fit an MLM head with mmadapt fit-head --primary {args.output_dir}"
    print(f"imported {run['imported_from']['architecture']}: {m['num_layers']} layers, hidden {m['hidden_size']}, "
          f"vocabulary {m['vocab_size']}, {m['max_position_embeddings']} positions"
          + (f" ({note})" if note else "") + f"; run in {args.output_dir}")
    return 0


@user_errors
def export_hf_main(argv=None) -> int:
    p = Parser(prog="mmadapt export-hf", description="Write a directory that transformers' "
                                "AutoModelFor... and AutoTokenizer load: a primary model (masked or causal LM) or a "
                                "fine-tuned task model, optionally with a Step-2 artifact swapped in (the "
                                "target-language model).")
    p.add_argument("--primary", help="a pretrain (or imported) run: export its primary model as its family's LM "
                   "(...ForMaskedLM or ...ForCausalLM)")
    _primary_tag(p, "with --embeddings, the one they were trained for where it is there; else the newest complete one")
    p.add_argument("--finetuned", help="a fine-tuning run: export its task model (sequence classification, "
                   "token classification or question answering, with its label names)")
    p.add_argument("--embeddings", help="a Step-2 artifact (<adapt run>/embeddings/<tag>): its word embeddings, "
                   "output bias or untied output projection, and tokenizer replace the model's (zero-shot "
                   "target-language model)")
    p.add_argument("--graft", action="store_true", help="with --primary or --finetuned, and --embeddings: the "
                   "embeddings were trained over a base model and the model is one fine-tuned from it (an instruct "
                   "or chat sibling, a classifier's body; the same architecture and vocabulary): checked, the "
                   "distance of its body from the base printed per layer, the embeddings grafted into it "
                   "(docs/huggingface.md)")
    p.add_argument("--output_dir", required=True, help="the directory to write (must not exist or be empty)")
    args = p.parse_args(argv)
    out = export_hf(Path(args.output_dir), primary=_path(args.primary), finetuned=_path(args.finetuned),
                    embeddings=_path(args.embeddings), primary_tag=args.primary_tag, graft=args.graft)
    print(f"exported {out['architecture']} (vocabulary {out['vocab_size']}) to {args.output_dir}")
    return 0


@user_errors(resumes_itself=True)
def extend_main(argv=None) -> int:
    from mmadapt.extend import SYSTEMS, Extend, extend

    d = Extend.__dataclass_fields__
    p = Parser(prog="mmadapt extend", description="One command from a Hugging Face directory to the extended model: "
               "import-hf, fit-head where the model is headless, Step 1b (the mini-model), Step 2 on your target "
               "corpus, export-hf (a transformers directory, and a sentence-transformers one for a sentence encoder). "
               "Every run stays in --output_dir; run it again to continue an interrupted extension (a finished one "
               "trains nothing and prints its result again).")
    p.add_argument("--model", required=True, help="a local Hugging Face or sentence-transformers model directory")
    p.add_argument("--lang", required=True, type=lang_code, help="the target language's code (recorded with the "
                   "embeddings)")
    p.add_argument("--corpus", required=True, help="target-language text, one sentence per line, blank line between "
                   "documents; or bible:<lang>, the packaged Bible")
    p.add_argument("--output_dir", required=True, help="new or empty, or an extension to continue")
    p.add_argument("--vocab_mode", choices=("replace", "expand"), default="replace", help="replace: a new target "
                   "vocabulary; expand: the source's with the target's pieces appended (default: replace)")
    p.add_argument("--embedding_init", choices=EMBEDDING_INITS, default=d["embedding_init"].default,
                   help="how the new rows start (adapt --embedding_init; default: %(default)s, FVT's split means)")
    p.add_argument("--expand_output_start", choices=EXPAND_OUTPUT_STARTS, default=d["expand_output_start"].default,
                   help="--vocab_mode expand: how the new pieces start on the output side (adapt "
                   "--expand_output_start; default: %(default)s; a tied decoder's new rows are its output rows, so "
                   "--embedding_init subword_mean needs embedding_init here)")
    p.add_argument("--vocab_size", type=whole_number(MIN_VOCAB_SIZE), default=d["vocab_size"].default,
                   help="the target vocabulary's pieces (default: %(default)s)")
    p.add_argument("--system", choices=SYSTEMS, default="minipost", help="Step 2 over MINIPOST's mini-model (cheap, "
                   "the default) or the full model (bl_base)")
    p.add_argument("--source_corpus", default=d["source_corpus"].default, help="source-language text for the head fit "
                   "and Step 1b (default: %(default)s)")
    for name, what in (("seq_length", "pieces per block in every stage"),
                       ("batch", "blocks per update in every stage (train_micro_batch_size_per_gpu)"),
                       ("head_iters", "fit-head's updates"), ("minipost_iters", "Step 1b's updates"),
                       ("adapt_iters", "Step 2's updates")):
        p.add_argument(f"--{name}", type=whole_number(8 if name == "seq_length" else 1), default=d[name].default,
                       help=what + " (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="every stage's peak learning rate (default: "
                   "%(default)s)")
    p.add_argument("--plugin_eval_blocks", type=whole_number(1), default=d["plugin_eval_blocks"].default,
                   help="held-out target blocks each Step-2 checkpoint is scored on through the primary model (adapt "
                   "--plugin_eval_blocks; default: %(default)s)")
    p.add_argument("--into", help="a model fine-tuned from --model (an instruct or chat sibling: the same architecture "
                   "and vocabulary): the new embeddings are grafted into it too (export-hf --graft), into "
                   "<output_dir>/export-into (docs/huggingface.md)")
    p.add_argument("--bpb_bytes", type=whole_number(MIN_BPB_BYTES), default=d["bpb_bytes"].default,
                   help="held-out target bytes the result is scored on in bits per byte, against the source model "
                   "with no adaptation (default: %(default)s; not part of the extension: a later call may change it)")
    args = p.parse_args(argv)
    ext = Extend(**{k: getattr(args, k) for k in d if hasattr(args, k)})
    # under MMADAPT_TINY=1 the sizes no flag gives too (TINY_CAPS: the target vocabulary's sample)
    tiny = getattr(args, "_tiny_sizes", False)
    extend(override(ext, args) if tiny else ext, tiny=tiny)
    return 0


# Every command, grouped by the step it serves, with its one-line purpose: the dispatch table of
# `mmadapt <command>` and what `mmadapt --help` prints.
COMMAND_GROUPS = (
    ("Start here", (
        ("demo", demo_main, "the whole method end to end: Steps 1-4 for BL_BASE, BL_SMALL, MINIJOINT and MINIPOST "
                            "on the packaged Bibles, a results table and plot (--quick: the short CI setting)"),
        ("extend", extend_main, "extend a Hugging Face model to a new language in one command: import, head fit, "
                                "mini-model, Step 2, export"))),
    ("Data (once per corpus)", (
        ("preprocess", preprocess_main, "a SentencePiece vocabulary and the corpus encoded once, for every run "
                                        "that trains on it (--data_path)"),)),
    ("Step 1: the source model", (
        ("pretrain", pretrain_main, "pretrain a source-language model as BL_BASE, BL_SMALL or MINIJOINT"),
        ("import-hf", import_hf_main, "a Hugging Face model (RoBERTa, XLM-R, BERT, Llama, Qwen2, Mistral; a "
                                      "sentence-transformers directory) as a Step-1 run, instead of pretraining"),
        ("fit-head", fit_head_main, "a new MLM head over a headless encoder's frozen body (a sentence-transformers "
                                    "or BertModel import), so that every later step takes it"))),
    ("Step 1b: MINIPOST's mini-model", (
        ("build_minipost", minipost_main, "copy the bottom N layers of a pretrained model and train K new layers on "
                                          "top"),)),
    ("Step 2: the new language", (
        ("adapt", adapt_main, "a new vocabulary's embeddings, trained over the frozen mini-model (or full model)"),
        ("sweep", sweep_main, "Step 2 over mini-models of several depths: the cheapest depth that transfers"))),
    ("Step 3: the task", (
        ("finetune", finetune_main, "fine-tune the primary model on a source-language task, word embeddings "
                                    "frozen"),)),
    ("Step 4: zero-shot transfer and results", (
        ("evaluate", evaluate_main, "swap Step-2 embeddings into fine-tuned models and score them zero-shot (or "
                                    "the plug-in MLM metric, no task)"),
        ("predict", predict_main, "look at a run's predictions on your texts: masked pieces, next pieces, labels, "
                                  "tags or answers, as JSON Lines"),
        ("report", report_main, "tables of scores, retention, days to near-maximal performance and speedups, "
                                "and plots, from evaluate's records"))),
    ("Tools", (
        ("flops", flops_main, "the training cost (FLOPs, device-days) of every step of every system"),
        ("export-hf", export_hf_main, "a primary or fine-tuned model, Step-2 embeddings swapped in, as a "
                                      "Hugging Face directory"),
        ("slurm-env", slurm_env_main, "SLURM's environment as DeepSpeed's multi-node launch (the sbatch "
                                      "templates' entry)"))),
)
COMMANDS = {name: main for _, group in COMMAND_GROUPS for name, main, _ in group}


def top_help() -> str:
    """`mmadapt --help`: every command with its purpose, grouped by step, and where to start."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: mmadapt <command> [flags]    (mmadapt <command> --help: the command's flags)", "",
             "Extend a pretrained language model to a new language cheaply, by mini-model adaptation",
             "(Marchisio et al. 2023). New here? Run `mmadapt demo --quick` first: every step on real text,",
             "in minutes; the README and docs/ say what each step does."]
    for title, group in COMMAND_GROUPS:
        lines += ["", f"{title}:"]
        for name, _, purpose in group:
            lines += textwrap.wrap(purpose, 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
    lines += ["", "Every command takes --verbose (or MMADAPT_VERBOSE=1): all that the libraries under mmadapt print;",
              "MMADAPT_DEBUG=1 adds a traceback to every error."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(top_help())
        return 0
    if not argv:
        print(top_help(), file=sys.stderr)
        return faults.EXIT_USER
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: unknown command {argv[0]!r}: {hint}mmadapt --help lists the commands", file=sys.stderr)
        return faults.EXIT_USER
    invoked = INVOKED_AS.set("mmadapt")
    try:
        return COMMANDS[argv[0]](argv[1:])
    finally:
        INVOKED_AS.reset(invoked)


def run_process(command=main) -> int:
    """A process's entry (the launch/ scripts, the `mmadapt` command): run one command, then
    tear its process groups down before the interpreter does (parallel.shutdown says why).
    Commands called in-process (tests, the sweep) keep their groups: they are built once per
    process. Commands that never join a job leave torch.distributed alone."""
    invoked = INVOKED_AS.set("launch" if command is not main else INVOKED_AS.get())
    # Everything imported so far (torch, DeepSpeed, megatron-core: millions of objects) lives as long
    # as the process: out of the collector's reach, so that a full collection scans only what the
    # command makes. DeepSpeed's bf16 optimizer collects 6 times at start-up (see_memory_usage with
    # force=True): 1.8 s of a tiny run here; each now takes milliseconds.
    gc.freeze()
    with faults.stops_held_to_exit():  # a stop's checkpoint is complete: a second signal now ends nothing half-way
        try:
            code = command()
        finally:
            INVOKED_AS.reset(invoked)
        parallel.shutdown(agreed=code in (0, faults.EXIT_DIVERGED, faults.EXIT_STOPPED, faults.EXIT_PAUSED))
    return code


if __name__ == "__main__":
    sys.exit(run_process())
