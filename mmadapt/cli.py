"""Command line: `mmadapt <command>` and the scripts in launch/ share these entry points."""

from __future__ import annotations

import argparse
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
    model, train = PRESETS[args.preset]
    model = apply_recipe(model, args.recipe, args.mini_layers)
    return override(model, args), override(train, args)


def pretrain_main(argv=None) -> int:
    args = pretrain_parser().parse_args(argv)
    from mmadapt.train import RunPaths, pretrain

    try:
        model, train = configs_from_args(args)
        paths = RunPaths(output_dir=Path(args.output_dir), corpus=resolve_corpus(args.corpus),
                         ds_config=Path(args.ds_config), tokenizer=Path(args.tokenizer) if args.tokenizer else None)
        rows = pretrain(model, train, paths, resume=args.resume, recipe=args.recipe)
    except ValueError as e:  # DataError is a ValueError: a user's mistake, one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rows:
        first, last = rows[0], rows[-1]
        print(f"done: step {last['step']}, loss {first['loss']:.3f} -> {last['loss']:.3f} "
              f"(heads {', '.join(f'L{k}: {v:.3f}' for k, v in last['head_losses'].items())}); "
              f"run in {args.output_dir}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"pretrain": pretrain_main}
    if not argv or argv[0] not in commands:
        print(f"usage: mmadapt {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
