"""Command line: `mmadapt <command>` and the scripts in launch/ share these entry points."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from mmadapt.config import PRESETS, RECIPES, ModelConfig, TrainConfig, add_dataclass_args, apply_recipe, override

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DS_CONFIG = REPO_ROOT / "ds_configs" / "zero1.json"
CACHE = Path(os.environ.get("MMADAPT_CACHE", Path.home() / ".cache" / "mmadapt"))


def resolve_corpus(spec: str) -> Path:
    """A path, or `bible:<lang>` for the packaged Bible (written once to the cache)."""
    if spec.startswith("bible:"):
        from mmadapt.corpora import write_bible_corpus

        lang = spec.split(":", 1)[1]
        path = CACHE / "bible" / f"{lang}.txt"
        return path if path.is_file() else write_bible_corpus(lang, path)
    return Path(spec)


def user_errors(main):
    """A command's ValueError (DataError included) is a user's mistake: one `error:` line on
    stderr and exit code 2. The commands check their inputs before they write anything."""
    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        try:
            return main(argv)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return wrapped


def pretrain_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain", description="Step 1: pretrain a source-language MLM "
                                "(BL_BASE, BL_SMALL or MINIJOINT) with DeepSpeed.")
    p.add_argument("--recipe", choices=RECIPES, default="bl_base", help="which of the paper's systems")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size and schedule")
    p.add_argument("--mini_layers", type=int, default=4, help="N: depth of the mini-model (MINIJOINT's "
                   "second head sits after layer N; BL_SMALL has N layers)")
    p.add_argument("--corpus", required=True, help="UTF-8 text, one sentence per line, blank line "
                   "between documents; or bible:<lang> for the packaged Bible (e.g. bible:en)")
    p.add_argument("--tokenizer", help="an existing SentencePiece .model (default: train one on the corpus)")
    p.add_argument("--output_dir", required=True, help="run directory: checkpoints, logs, tokenizer, data")
    p.add_argument("--ds_config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed JSON (ZeRO stage, precision)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    add_dataclass_args(p, ModelConfig)
    add_dataclass_args(p, TrainConfig)
    return p


def configs_from_args(args) -> tuple[ModelConfig, TrainConfig]:
    """Preset, then the shape flags (--num_layers sets the primary depth), then the recipe, then
    an explicit --head_layers."""
    import dataclasses

    model, train = PRESETS[args.preset]
    shape = override(model, argparse.Namespace(**{**vars(args), "head_layers": None}))
    model = apply_recipe(dataclasses.replace(shape, head_layers=None), args.recipe, args.mini_layers)
    if args.head_layers is not None:
        model = dataclasses.replace(model, head_layers=tuple(args.head_layers))
    return model, override(train, args)


@user_errors
def pretrain_main(argv=None) -> int:
    args = pretrain_parser().parse_args(argv)
    from mmadapt.train import RunPaths, pretrain

    model, train = configs_from_args(args)
    paths = RunPaths(output_dir=Path(args.output_dir), corpus=resolve_corpus(args.corpus),
                     ds_config=Path(args.ds_config), tokenizer=Path(args.tokenizer) if args.tokenizer else None)
    rows = pretrain(model, train, paths, resume=args.resume, recipe=args.recipe)
    if rows:
        first, last = rows[0], rows[-1]
        print(f"done: step {last['step']}, loss {first['loss']:.3f} -> {last['loss']:.3f} "
              f"(heads {', '.join(f'L{k}: {v:.3f}' for k, v in last['head_losses'].items())}); "
              f"run in {args.output_dir}")
    return 0


# --- Step 1b and Step 2: the model comes from an earlier run, only some fields may change ---------

# ModelConfig fields that Steps 1b and 2 may set; the architecture itself is the source model's.
_LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "hidden_dropout",
                  "attention_dropout", "attention_impl")


def _common_args(p: argparse.ArgumentParser, model_fields: tuple[str, ...]) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="training schedule "
                   "(the model's shape comes from the source run)")
    p.add_argument("--output_dir", required=True, help="run directory: checkpoints, logs, tokenizer, data")
    p.add_argument("--ds_config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed JSON (ZeRO stage, precision)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    add_dataclass_args(p, ModelConfig, only=model_fields)
    add_dataclass_args(p, TrainConfig)


def _source_tag(run_dir: Path, tag: str | None) -> str:
    from mmadapt import checkpoint

    tags = checkpoint.complete_tags(run_dir / "checkpoints")
    if tag is not None and tag not in tags:
        raise ValueError(f"{run_dir} has no complete checkpoint {tag}; it has {', '.join(tags)}")
    return tag or tags[-1]


def minipost_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build_minipost", description="Step 1b (MINIPOST): copy the bottom "
                                "N layers, embeddings and MLM head of a pretrained model, insert K new "
                                "layers and train only those with source-language MLM.")
    p.add_argument("--primary", required=True, help="the pretrain run directory of the primary model")
    p.add_argument("--primary_tag", help="its checkpoint to use (default: the newest complete one)")
    p.add_argument("--mini_layers", type=int, default=4, help="N: bottom layers copied (paper: 4)")
    p.add_argument("--new_layers", type=int, default=2, help="K: new layers trained on top (paper: 2)")
    p.add_argument("--corpus", help="source-language corpus (default: the primary run's corpus)")
    _common_args(p, _LAYOUT_FIELDS)
    return p


@user_errors
def minipost_main(argv=None) -> int:
    args = minipost_parser().parse_args(argv)
    from mmadapt.adapt import load_model, minipost_layout, minipost_trainable, read_run
    from mmadapt.train import Job, RunPaths, run

    primary = Path(args.primary).resolve()
    src = read_run(primary)
    tag = _source_tag(primary, args.primary_tag)
    cfg, _ = minipost_layout(ModelConfig(**src["model"]), {}, args.mini_layers, args.new_layers)
    model, train = override(cfg, args), override(PRESETS[args.preset][1], args)
    paths = RunPaths(output_dir=Path(args.output_dir), corpus=resolve_corpus(args.corpus or src["corpus"]),
                     ds_config=Path(args.ds_config), tokenizer=primary / "tokenizer" / "spm.model")

    def init(_tokenizer: Path) -> dict:
        return minipost_layout(*load_model(primary, tag), args.mini_layers, args.new_layers)[1]

    job = Job(step="minipost", recipe="minipost", trainable=minipost_trainable(args.mini_layers, args.new_layers),
              init=init, trainable_layers=args.new_layers,
              frozen_from={"run_dir": str(primary), "tag": tag, "mini_layers": args.mini_layers,
                           "new_layers": args.new_layers})
    rows = run(model, train, paths, job, resume=args.resume)
    if rows:
        print(f"done: {model.num_layers}-layer mini-model, step {rows[-1]['step']}, loss {rows[0]['loss']:.3f} -> "
              f"{rows[-1]['loss']:.3f}; run in {args.output_dir}")
    return 0


def adapt_parser() -> argparse.ArgumentParser:
    from mmadapt.adapt import SYSTEMS

    p = argparse.ArgumentParser(prog="adapt", description="Step 2: learn a new language's embeddings "
                                "(tied with the output projection) by MLM over a frozen model.")
    p.add_argument("--system", choices=SYSTEMS, required=True, help="minijoint/minipost: over the "
                   "mini-model; bl_base: over the full primary model; bl_small: over the 4-layer model")
    p.add_argument("--source", required=True, help="the run to adapt: a pretrain run (bl_base, bl_small, "
                   "minijoint) or a build_minipost run (minipost)")
    p.add_argument("--source_tag", help="its checkpoint to use (default: the newest complete one)")
    p.add_argument("--lang", required=True, help="target language code, recorded with the embeddings")
    p.add_argument("--corpus", help="target-language corpus (default: bible:<lang>, the packaged Bible)")
    p.add_argument("--tokenizer", help="an existing target-language SentencePiece .model (default: train "
                   "one with --vocab_size pieces on the corpus)")
    _common_args(p, _LAYOUT_FIELDS + ("vocab_size",))
    return p


@user_errors
def adapt_main(argv=None) -> int:
    args = adapt_parser().parse_args(argv)
    import torch

    from mmadapt import adapt as A
    from mmadapt.checkpoint import load_full_state_dict
    from mmadapt.flops import adapt_flops, device_days
    from mmadapt.model import derive_seed
    from mmadapt.train import Job, RunPaths, run

    source = Path(args.source).resolve()
    src = A.read_run(source)
    if src.get("recipe") not in A.SOURCE_RECIPES[args.system]:
        raise ValueError(f"--system {args.system} adapts a run with recipe "
                         f"{' or '.join(A.SOURCE_RECIPES[args.system])}, but {source} has recipe "
                         f"{src.get('recipe')}")
    tag = _source_tag(source, args.source_tag)
    src_cfg = ModelConfig(**src["model"])
    body_cfg, _ = A.adapt_body(args.system, src_cfg, {})
    model, train = override(body_cfg, args), override(PRESETS[args.preset][1], args)
    out = Path(args.output_dir)
    paths = RunPaths(output_dir=out, corpus=resolve_corpus(args.corpus or f"bible:{args.lang}"),
                     ds_config=Path(args.ds_config), tokenizer=Path(args.tokenizer) if args.tokenizer else None)
    info = {"system": args.system, "lang": args.lang}

    def init(tokenizer: Path) -> dict:
        _, state, shared = A.step2_start(args.system, source, tag, tokenizer, model.init_method_std,
                                         derive_seed(train.seed, f"embeddings.{args.lang}"))
        info.update(shared_pieces=shared, target_vocab_size=model.vocab_size)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"new {args.lang} embeddings: {shared} of {model.vocab_size} pieces copied from the "
                  f"source vocabulary, {model.vocab_size - shared} drawn from N(0, {model.init_method_std})")
        return state

    seq_flops = {p: adapt_flops(model, train.seq_length, train.mask_prob, paper=p) for p in (False, True)}

    def on_save(step: int, ckpt_tag: str, global_batch: int) -> None:
        sd = load_full_state_dict(paths.checkpoints, ckpt_tag)
        flops = seq_flops[False] * global_batch * step
        meta = {"system": args.system, "lang": args.lang, "step": step, "source": str(source),
                "source_tag": tag, "mini_layers": model.num_layers, "hidden_size": model.hidden_size,
                "vocab_size": model.vocab_size, "shared_pieces": info.get("shared_pieces"),
                "global_batch": global_batch, "seq_length": train.seq_length,
                "tokens": global_batch * train.seq_length * step, "flops": flops,
                "flops_paper": seq_flops[True] * global_batch * step, "v100_days": device_days(flops)}
        A.write_artifact(out / "embeddings" / ckpt_tag, sd[A.WORD].to(torch.float32),
                         sd[A.BIAS].to(torch.float32), out / "tokenizer" / "spm.model", meta)

    job = Job(step="adapt", recipe=args.system, trainable=A.ADAPT_TRAINABLE, init=init, info=info,
              on_save=on_save, frozen_from={"run_dir": str(source), "tag": tag, "system": args.system})
    rows = run(model, train, paths, job, resume=args.resume)
    if rows:
        print(f"done: {args.system} {args.lang} embeddings over {model.num_layers} layers, step {rows[-1]['step']}, "
              f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; artifacts in {out / 'embeddings'}")
    return 0


# --- Step 3 and Step 4 ----------------------------------------------------------------------------------

def finetune_parser() -> argparse.ArgumentParser:
    from mmadapt.config import FinetuneConfig
    from mmadapt.finetune import TASKS

    p = argparse.ArgumentParser(prog="finetune", description="Step 3: fine-tune the primary model of a "
                                "pretrain run on a source-language task, word embeddings frozen.")
    p.add_argument("--task", choices=sorted(TASKS), required=True, help="xnli/pawsx (pairs), mlqa/xquad "
                   "(extractive QA), pos (CoNLL-U), ner (CoNLL-2003), bible-genre (the demo's task)")
    p.add_argument("--primary", required=True, help="the pretrain run whose primary model is fine-tuned")
    p.add_argument("--primary_tag", help="its checkpoint to use (default: the newest complete one)")
    p.add_argument("--train_file", help="source-language training data in the task's format "
                   "(bible-genre: 'bible', the default)")
    p.add_argument("--eval_file", help="optional source-language evaluation data: its score is printed and "
                   "kept in run.json ({lang} is replaced by --source_lang)")
    p.add_argument("--source_lang", default="en", help="language of the training data")
    p.add_argument("--output_dir", required=True, help="run directory: checkpoint, logs, run.json")
    p.add_argument("--ds_config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed JSON (ZeRO stage, precision)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    add_dataclass_args(p, ModelConfig, only=_LAYOUT_FIELDS)
    add_dataclass_args(p, FinetuneConfig)
    return p


@user_errors
def finetune_main(argv=None) -> int:
    args = finetune_parser().parse_args(argv)
    from mmadapt.config import FinetuneConfig
    from mmadapt.finetune import finetune, get_task

    task = get_task(args.task)
    train_file = args.train_file or ("bible" if task.name == "bible-genre" else None)
    if train_file is None:
        raise ValueError(f"--train_file is required for {task.name} (see mmadapt/tasks.py for the data)")
    layout = {k: getattr(args, k) for k in _LAYOUT_FIELDS if getattr(args, k) is not None}
    out, _ = finetune(task, Path(args.primary).resolve(), args.primary_tag, train_file, args.source_lang,
                   override(FinetuneConfig(), args), layout, Path(args.ds_config), Path(args.output_dir),
                   args.eval_file)
    if int(os.environ.get("RANK", 0)) == 0:
        extra = f", {args.source_lang} score {out['source_score']:.1f}" if "source_score" in out else ""
        print(f"done: {task.name} on {out['train_examples']} examples, {out['updates']} updates, final loss "
              f"{out['final_loss']:.3f}{extra}; model in {args.output_dir}")
    return 0


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate", description="Step 4: swap target-language embeddings "
                                "(Step 2) into fine-tuned models (Step 3) and evaluate zero-shot; one "
                                "record per checkpoint, the input of `mmadapt report`.")
    p.add_argument("--finetuned", nargs="+", required=True, help="Step-3 run directories of one primary "
                   "model (e.g. one per seed): their scores are averaged")
    p.add_argument("--embeddings", nargs="+", required=True, help="Step-2 artifacts (<adapt run>/embeddings/"
                   "<tag>) or adapt run directories (all their artifacts: a score-versus-compute curve)")
    p.add_argument("--eval_file", required=True, help="target-language evaluation data; {lang} is replaced "
                   "by each artifact's language (bible-genre: 'bible')")
    p.add_argument("--output", required=True, help="JSON file of records {system, task, lang, step, flops, "
                   "score, ...}; must not exist yet")
    p.add_argument("--eval_batch_size", type=int, default=64, help="examples per forward pass")
    return p


@user_errors
def evaluate_main(argv=None) -> int:
    args = evaluate_parser().parse_args(argv)
    import json

    from mmadapt.finetune import evaluate_artifacts

    out = Path(args.output)
    if out.exists():
        raise ValueError(f"{out} already exists: choose a new --output (records are never overwritten)")
    records = evaluate_artifacts([Path(r) for r in args.finetuned], [Path(e) for e in args.embeddings],
                                 args.eval_file, args.eval_batch_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(f"{r['system']:10s} {r['task']} {r['lang']} step {r['step']:>7d}  {r['flops']:.3g} FLOPs  "
              f"{r['metric']} {r['score']:.2f}")
    print(f"{len(records)} records in {out}")
    return 0


# --- compute and results reports ---------------------------------------------------------------------

@user_errors
def flops_main(argv=None) -> int:
    import json

    from mmadapt.flops import DEVICE_TFLOPS
    from mmadapt.report import PAPER, flops_rows, format_flops_table, paper_rows

    p = argparse.ArgumentParser(prog="mmadapt flops", description="Training cost of every step of every "
                                "system (paper Appendix A.1: A1, A3, A4) and the exact counts.")
    p.add_argument("--paper", action="store_true", help="the paper's settings (RoBERTa-base, U=125,000, B=2048, "
                   "s=512, V=50,000, p=0.15), printed as JSON")
    p.add_argument("--json", action="store_true", help="JSON rows instead of a table")
    p.add_argument("--preset", choices=sorted(PRESETS), default="roberta-base", help="model shape and schedule")
    p.add_argument("--global_batch", type=int, help="sequences per update B (default: the paper's 2048 for "
                   "roberta-base, else micro-batch x accumulation of the preset on one rank)")
    p.add_argument("--mini_layers", type=int, default=4, help="N: mini-model depth")
    p.add_argument("--new_layers", type=int, default=2, help="K: MINIPOST's new layers")
    p.add_argument("--device", choices=sorted(DEVICE_TFLOPS), default="v100-paper",
                   help="throughput for the device-days of the exact count")
    add_dataclass_args(p, ModelConfig, only=("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                             "vocab_size"))
    add_dataclass_args(p, TrainConfig, only=("seq_length", "train_iters", "mask_prob"))
    args = p.parse_args(argv)
    if args.paper:
        rows = paper_rows()
    else:
        model, train = PRESETS[args.preset]
        model, train = override(model, args), override(train, args)
        model = ModelConfig(**{**vars(model), "head_layers": None}).validate()
        batch = args.global_batch or (PAPER["global_batch"] if args.preset == "roberta-base" else
                                      train.train_micro_batch_size_per_gpu * train.gradient_accumulation_steps)
        rows = flops_rows(model, train.train_iters, batch, train.seq_length, train.mask_prob,
                          args.mini_layers, args.new_layers, args.device)
    print(json.dumps(rows, indent=1) if args.json or args.paper else format_flops_table(rows))
    return 0


@user_errors
def report_main(argv=None) -> int:
    import json

    from mmadapt.report import report_markdown

    p = argparse.ArgumentParser(prog="mmadapt report", description="Evaluation results (Step 4 JSON) -> "
                                "final scores with retention and days to near-maximal performance.")
    p.add_argument("results", nargs="+", help="JSON files, each a list of {system, task, lang, step, flops, score}")
    p.add_argument("--output", help="also write the markdown here")
    p.add_argument("--plots", help="write curves.png (score vs Step-2 compute, as the paper's Figure 3) and "
                   "speedup.png (mean per-language speedup, as Figure 1) into this directory (needs matplotlib)")
    p.add_argument("--device", default="v100-paper", help="device whose days are reported")
    args = p.parse_args(argv)
    records = []
    for f in args.results:
        try:
            records += json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read results file {f}: {e}") from None
    missing = [k for k in ("system", "task", "lang", "flops", "score") for r in records[:1] if k not in r]
    if not records or missing:
        raise ValueError(f"{args.results[0]} holds no result records"
                         + (f" (a record lacks {missing[0]!r})" if missing else ""))
    md = report_markdown(records, device=args.device)
    if args.plots:
        from mmadapt.report import plot_curves, plot_speedup

        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        plot_curves(records, out / "curves.png", device=args.device)
        plot_speedup(records, out / "speedup.png", device=args.device)
    print(md)
    if args.output:
        Path(args.output).write_text(md + "\n")
    return 0


@user_errors
def demo_main(argv=None) -> int:
    from mmadapt.demo import main

    return main(argv)


@user_errors
def slurm_env_main(argv=None) -> int:
    from mmadapt.slurm import main as slurm_main

    return slurm_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"pretrain": pretrain_main, "build_minipost": minipost_main, "adapt": adapt_main,
                "finetune": finetune_main, "evaluate": evaluate_main, "demo": demo_main, "flops": flops_main,
                "report": report_main, "slurm-env": slurm_env_main}
    if not argv or argv[0] not in commands:
        print(f"usage: mmadapt {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
