"""Presets, recipes, CLI overrides and the shipped DeepSpeed configs."""

import contextlib
import dataclasses
import io
import os
import sys
from pathlib import Path

import pytest

from mmadapt import cli
from mmadapt.cli import configs_from_args, pretrain_parser
from mmadapt.config import Layout, TrainConfig, apply_recipe, check_output_file, override
from mmadapt.models import PRESETS, find_preset
from mmadapt.engine import load_ds_config

REPO = Path(__file__).resolve().parents[1]


def test_recipes_follow_the_paper():
    base = PRESETS["roberta-base"][0]
    assert apply_recipe(base, "bl_base").head_layers == (12,)
    small = apply_recipe(base, "bl_small")
    assert (small.num_layers, small.head_layers) == (4, (4,))
    mj = apply_recipe(base, "minijoint")
    assert (mj.num_layers, mj.head_layers) == (12, (4, 12))
    assert apply_recipe(base, "minijoint", mini_layers=6).head_layers == (6, 12)
    with pytest.raises(ValueError, match="unknown recipe"):
        apply_recipe(base, "minipost")


def test_paper_schedule_in_roberta_base_preset():
    model, train = PRESETS["roberta-base"]
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.ffn_hidden_size,
            model.vocab_size, model.max_position_embeddings) == (12, 768, 12, 3072, 50_000, 512)
    assert (train.lr, train.lr_warmup_iters, train.train_iters, train.seq_length) == (7e-4, 10_000, 125_000, 512)
    # 2048 sequences per update on 64 data-parallel ranks.
    assert train.train_micro_batch_size_per_gpu * train.gradient_accumulation_steps * 64 == 2048


def test_flags_override_fields_by_name():
    args = pretrain_parser().parse_args(["--corpus", "x", "--output_dir", "y", "--recipe", "minijoint",
                                         "--mini_layers", "2", "--hidden_size", "32", "--lr", "0.1"])
    model, train = configs_from_args(args)
    assert (model.hidden_size, model.head_layers, train.lr) == (32, (2, 12), 0.1)
    assert model.num_attention_heads == PRESETS["tiny"][0].num_attention_heads


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_ds_config_loads(path, monkeypatch):
    import torch

    from mmadapt import parallel

    # as on a GPU: fp16 is refused off one (tests/test_bad_input.py, ds-config-fp16-off-a-gpu)
    monkeypatch.setattr(parallel, "device", lambda: torch.device("cuda", 0))
    cfg = load_ds_config(path, TrainConfig(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2))
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 2
    # The file says what it is: zero<stage>[_<precision>].json (tests and templates pick them by name)
    stage, _, precision = path.stem.removeprefix("zero").partition("_")
    assert cfg["zero_optimization"]["stage"] == int(stage)
    for dtype in ("bf16", "fp16"):
        assert bool(cfg.get(dtype, {}).get("enabled")) == (precision == dtype), (path.name, dtype)


def test_lr_schedule_warmup_then_linear_decay():
    from mmadapt.engine import warmup_linear_decay

    f = warmup_linear_decay(4, 10)
    assert [round(f(s), 4) for s in range(11)] == [0.25, 0.5, 0.75, 1.0, 1.0, 0.8333, 0.6667, 0.5, 0.3333, 0.1667, 0.0]


def test_num_layers_flag_sets_the_primary_depth_before_the_recipe():
    from mmadapt.cli import configs_from_args, pretrain_parser

    def cfg(*argv):
        return configs_from_args(pretrain_parser().parse_args(["--corpus", "x", "--output_dir", "y", *argv]))[0]

    assert cfg("--recipe", "minijoint", "--num_layers", "6").head_layers == (4, 6)
    assert cfg("--recipe", "bl_base", "--num_layers", "24").head_layers == (24,)
    small = cfg("--recipe", "bl_small", "--num_layers", "24", "--mini_layers", "3")
    assert (small.num_layers, small.head_layers) == (3, (3,))
    assert cfg("--recipe", "minijoint", "--head_layers", "2", "12").head_layers == (2, 12)
    # bl_small trains --mini_layers layers: a primary no deeper than them says which flag moves
    with pytest.raises(ValueError, match=r"^--mini_layers 4 must be in 1\.\.3 for a 4-layer primary model "
                       r"\(--num_layers; bl_small trains --mini_layers layers\): pass --mini_layers below 4, or a "
                       r"deeper --num_layers$"):
        cfg("--recipe", "bl_small", "--num_layers", "4")


def test_a_python_step_1_records_the_recipe_its_heads_make():
    """Without a recipe, Pretrain records the one its model's heads make (the CLI's default is
    bl_base): a run Step 2 adapts, not "custom", which no system does."""
    from mmadapt import steps

    tiny = PRESETS["tiny"][0]
    for recipe in ("bl_base", "minijoint"):
        assert steps.Pretrain(model=apply_recipe(tiny, recipe), train=TrainConfig()).recipe == recipe
    small = apply_recipe(tiny, "bl_small")
    assert steps.Pretrain(model=small, train=TrainConfig(), recipe="bl_small").recipe == "bl_small"
    assert steps.Pretrain(model=small, train=TrainConfig(), recipe="custom").recipe == "custom"


# --- every field's bounds, declared once (issue 41) --------------------------------------------------

def _configs():
    from mmadapt.config import FinetuneConfig, MiniModelConfig, ModelConfig, PreprocessConfig
    from mmadapt.demo import DemoConfig
    from mmadapt.sweep import SweepConfig

    return (ModelConfig, TrainConfig, FinetuneConfig, MiniModelConfig, PreprocessConfig, SweepConfig, DemoConfig)


def test_every_numeric_field_declares_its_range():
    """A number (or a tuple of numbers) without a declared range would pass any value to the step."""
    import dataclasses
    from typing import get_type_hints

    from mmadapt.config import _tuple_item

    for cls in _configs():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _tuple_item(hints[f.name]) or next((a for a in getattr(hints[f.name], "__args__", ())
                                                       if a is not type(None)), hints[f.name])
            if kind in (int, float):
                assert "bounds" in f.metadata, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(train_iters=0), "--train_iters must be >= 1, got 0"),
    (lambda: TrainConfig(mask_prob=1.0), "--mask_prob must be in (0, 1), got 1.0"),
    (lambda: TrainConfig(lr=float("inf")), "--lr must be a finite number, got inf"),
    (lambda: TrainConfig(train_iters=5.0), "--train_iters takes a whole number, got 5.0"),
    (lambda: TrainConfig(seed=True), "--seed takes a whole number, got True"),
    (lambda: TrainConfig(extra_save_steps=(100, 0)), "--extra_save_steps must be >= 1, got 0"),
    (lambda: TrainConfig(embedding_init="fvt"), "--embedding_init must be one of overlap, subword_mean, normal"),
    (lambda: __import__("dataclasses").replace(TrainConfig(), gradient_accumulation_steps=0),
     "--gradient_accumulation_steps must be >= 1, got 0"),
    (lambda: PRESETS["tiny"][0].__class__(head_weights=(1.0, -1.0), head_layers=(4, 12)),
     "--head_weights must be >= 0, got -1.0"),
    (lambda: PRESETS["tiny"][0].__class__(head_layers=12), "--head_layers takes a list of values, got 12"),
    (lambda: __import__("mmadapt.config").config.MiniModelConfig(()), "--mini_layers needs at least one value"),
    (lambda: __import__("mmadapt.config").config.MiniModelConfig(new_layers="2"),
     "--new_layers takes a whole number, got '2'"),
    (lambda: __import__("mmadapt.steps").steps.Pretrain(model={}, train=TrainConfig()),
     "Pretrain.model takes a ModelConfig, got dict"),
    (lambda: __import__("mmadapt.steps").steps.Finetune(task="bible-genre", primary=None),
     "Finetune.primary takes a path, got None"),
    (lambda: __import__("mmadapt.run").run.RunSpec(output_dir=""), "RunSpec.output_dir takes a path, got ''"),
    (lambda: __import__("mmadapt.run").run.RunSpec(output_dir="  "), "RunSpec.output_dir takes a path, got '  '"),
    (lambda: __import__("mmadapt.run").run.RunSpec(output_dir="o", corpus=""), "RunSpec.corpus takes a path, got ''"),
    (lambda: __import__("mmadapt.run").run.RunSpec(output_dir="o", corpus=123), "RunSpec.corpus takes a path, got 123"),
    (lambda: __import__("mmadapt.steps").steps.Finetune(task="bible-genre", primary="p", eval_file=""),
     "Finetune.eval_file takes a non-empty string, got ''"),
    (lambda: TrainConfig(replay_data=" "), "--replay_data takes a non-empty string, got ' '"),
    (lambda: __import__("mmadapt.steps").steps.Pretrain(model=PRESETS["tiny"][0], train=TrainConfig(),
                                                        recipe="minijiont"),
     "recipe must be one of custom, bl_base, bl_small, minijoint, got 'minijiont'"),
    (lambda: __import__("mmadapt.steps").steps.Pretrain(
        model=__import__("mmadapt.config").config.apply_recipe(PRESETS["tiny"][0], "bl_base"), train=TrainConfig(),
        recipe="minijoint"), "recipe minijoint trains two heads or more; this model has heads after layers 12"),
    (lambda: __import__("mmadapt.steps").steps.Pretrain(
        model=__import__("mmadapt.config").config.apply_recipe(PRESETS["tiny"][0], "minijoint"), train=TrainConfig(),
        recipe="bl_small"),
     "recipe bl_small trains one head; this model has heads after layers 4, 12"),
    (lambda: __import__("mmadapt.adapt").adapt.AdaptEmbeddings(system="minipst", source="s", lang="de",
                                                               train=TrainConfig()),
     "system must be one of bl_base, bl_small, minijoint, minipost, got 'minipst'"),
    (lambda: __import__("mmadapt.steps").steps.Finetune(task="xnlii", primary="p"), "unknown task 'xnlii'"),
    (lambda: __import__("mmadapt.steps").steps.evaluate([], embeddings=["e"], eval_file="bible"),
     "finetuned takes a non-empty list of paths, got []"),
    (lambda: __import__("mmadapt.steps").steps.evaluate_plugin("p", embeddings=["e"], data="d", blocks=0),
     "blocks must be a whole number >= 1, got 0"),
    (lambda: __import__("mmadapt.steps").steps.evaluate(["f"], embeddings=["e"], eval_file=None),
     "eval_file takes a path (a str or Path; {lang} in it stands for each language), got None"),
    (lambda: __import__("mmadapt.steps").steps.evaluate_plugin("p", embeddings=["e"], data=3),
     "data takes a path (a str or Path; {lang} in it stands for each language), got 3"),
    # the command line's ranges, which the Python API lacked (a 0 plugin_eval_blocks failed extend at its summary,
    # after every stage had trained; RunSpec trained on data_path and dropped the corpus without a word)
    (lambda: __import__("mmadapt.adapt").adapt.AdaptEmbeddings(system="bl_base", source="s", lang="de",
                                                               train=TrainConfig(), vocab_size=4),
     "AdaptEmbeddings.vocab_size must be >= 8, got 4"),
    (lambda: __import__("mmadapt.steps").steps.Sweep(source="s", lang="de", train=TrainConfig(), vocab_size=0),
     "Sweep.vocab_size must be >= 8, got 0"),
    (lambda: __import__("mmadapt.extend").extend.Extend(model="m", lang="de", corpus="bible:de", output_dir="o",
                                                        plugin_eval_blocks=0),
     "Extend.plugin_eval_blocks must be >= 1, got 0"),
    # a RunSpec's layout was refused only when a step applied it; a depth of 0 when the source was read
    (lambda: Layout(tensor_model_parallel_size=0), "--tensor_model_parallel_size must be >= 1, got 0"),
    (lambda: Layout(pipeline_model_parallel_size="2"), "--pipeline_model_parallel_size takes a whole number, got '2'"),
    (lambda: Layout(fusion="bogus"), "--fusion must be one of auto, none, compile, cudagraphs, got 'bogus'"),
    (lambda: Layout(hidden_dropout=float("nan")), "--hidden_dropout must be a finite number, got nan"),
    (lambda: __import__("mmadapt.adapt").adapt.AdaptEmbeddings(system="minijoint", source="s", lang="de",
                                                               train=TrainConfig(), mini_layers=0),
     "AdaptEmbeddings.mini_layers must be >= 1, got 0"),
    (lambda: __import__("mmadapt.steps").steps.Sweep(source="s", lang="de", train=TrainConfig(), mini_layers=[4, 0]),
     "Sweep.mini_layers must be >= 1, got 0"),
    (lambda: __import__("mmadapt.extend").extend.Extend(model="m", lang="de", corpus="bible:de", output_dir="o",
                                                        vocab_size=7),
     "Extend.vocab_size must be >= 8, got 7"),
    # (a path of None was a TypeError from pathlib; a schedule's 0 named --save_interval, no flag of extend's)
    (lambda: __import__("mmadapt.extend").extend.Extend(model=None, lang="de", corpus="bible:de", output_dir="o"),
     "Extend.model takes a path, got None"),
    (lambda: __import__("mmadapt.extend").extend.Extend(model="m", lang="de", corpus="bible:de", output_dir="o",
                                                        head_iters=0),
     "Extend.head_iters must be >= 1, got 0"),
    (lambda: __import__("mmadapt.run").run.RunSpec(output_dir="o", data_path="d", corpus="bible:en"),
     "RunSpec takes one text: data_path (a prepared dataset) or corpus (raw text), not both"),
    (lambda: __import__("mmadapt.steps").steps.preprocess("bible:de", Path("o"), None, expand_from=Path("r")),
     "a vocabulary size is needed to train the target tokenizer the expansion adds"),
    (lambda: __import__("mmadapt.steps").steps.evaluate(["f"], embeddings=["e"], eval_file="bible", graft="false"),
     "graft takes True or False, got 'false'"),
    (lambda: __import__("mmadapt.steps").steps.evaluate(["f"], embeddings=["e"], eval_file="bible",
                                                        cfg=__import__("mmadapt.config").config.FinetuneConfig()),
     "cfg takes an EvaluateConfig, got FinetuneConfig"),
    (lambda: __import__("mmadapt.steps").steps.evaluate_plugin(["p", "q"], embeddings=["e"], data="d"),
     "primary takes one path, got ['p', 'q']"),
    (lambda: __import__("mmadapt.steps").steps.evaluate_plugin("p", embeddings=["e"], data="d",
                                                               allow_untrained_positions="no"),
     "allow_untrained_positions takes True or False, got 'no'"),
    (lambda: __import__("mmadapt.steps").steps.preprocess("bible:de", Path("o"), 8e3),
     "--vocab_size takes a whole number, got 8000.0"),
    (lambda: __import__("mmadapt.steps").steps.preprocess("bible:de", Path("o"), 5),
     "--vocab_size must be >= 8, got 5"),
    (lambda: __import__("mmadapt.steps").steps.preprocess("bible:de", Path("o"), 100, cfg=None),
     "cfg takes a PreprocessConfig, got NoneType"),
    (lambda: __import__("mmadapt.steps").steps.preprocess("bible:de", REPO / "mmadapt" / "data", 100,
                                                          expand_from=REPO / "mmadapt"),
     f"--output_dir {REPO}/mmadapt/data is inside --expand_from {REPO}/mmadapt: write it elsewhere"),
    # predict's loaders took a list of runs as its first, and graft="no" as True
    (lambda: __import__("mmadapt.predict").predict.load(["p", "q"]), "run takes one path, got ['p', 'q']"),
    (lambda: __import__("mmadapt.predict").predict.SentenceEncoder.load(["p", "q"]),
     "run takes one path, got ['p', 'q']"),
    # (SentenceEncoder.load took a device string as a torch.device: an AttributeError deep in)
    (lambda: __import__("mmadapt.predict").predict.SentenceEncoder.load("p", device="cuda:7"),
     "--device cuda:7: this machine has"),
    (lambda: __import__("mmadapt.predict").predict.load("p", embeddings=123), "embeddings takes one path, got 123"),
    (lambda: __import__("mmadapt.predict").predict.load("p", embeddings="e", graft="no"),
     "graft takes True or False, got 'no'"),
    (lambda: __import__("mmadapt.predict").predict.load("p", tag=5), "tag takes a checkpoint's tag"),
    (lambda: __import__("mmadapt.steps").steps.evaluate(["f"], embeddings=["e"], eval_file="bible", output=123),
     "output takes one path, got 123"),
    # the step functions' own arguments (an AttributeError deep in the step)
    (lambda: __import__("mmadapt.steps").steps.pretrain(run="x/p", step=__import__("mmadapt.steps").steps.Pretrain(
        model=__import__("mmadapt.config").config.apply_recipe(PRESETS["tiny"][0], "bl_base"), train=TrainConfig())),
     "run takes a RunSpec, got str 'x/p'"),
    (lambda: __import__("mmadapt.steps").steps.finetune(
        run=__import__("mmadapt.run").run.RunSpec(output_dir="x/f"), step=__import__("mmadapt.steps").steps.Pretrain(
            model=__import__("mmadapt.config").config.apply_recipe(PRESETS["tiny"][0], "bl_base"),
            train=TrainConfig())),
     "step takes a Finetune, got Pretrain"),
    (lambda: __import__("mmadapt.extend").extend.extend({"model": "m", "lang": "de"}), "ext takes an Extend, got dict"),
], ids=["range", "open-range", "finite", "int-not-float", "int-not-bool", "tuple-items", "choices", "replace",
        "model-tuple-items", "model-tuple-not-a-list", "empty-list", "type", "step-config-type", "step-path", "run-spec-path",
        "run-spec-blank-path", "run-spec-empty-corpus", "run-spec-corpus-type", "finetune-empty-eval-file",
        "blank-replay-data",
        "pretrain-recipe", "pretrain-recipe-heads", "pretrain-recipe-one-head", "adapt-system", "finetune-task",
        "evaluate-empty-list", "evaluate-plugin-blocks", "evaluate-eval-file", "evaluate-plugin-data",
        "adapt-vocab-size", "sweep-vocab-size", "extend-plugin-eval-blocks", "layout-tp-zero", "layout-pp-str",
        "layout-fusion", "layout-dropout-nan", "adapt-mini-layers-zero", "sweep-mini-layers-zero",
        "extend-vocab-size", "extend-model-none", "extend-head-iters-zero", "run-spec-two-texts",
        "preprocess-expand-no-size", "evaluate-graft-str", "evaluate-cfg-type", "plugin-two-primaries", "plugin-allow-str", "preprocess-vocab-float", "preprocess-vocab-small", "preprocess-cfg-type",
        "preprocess-output-inside-expand-from", "predict-two-runs", "encoder-two-runs", "encoder-device",
        "predict-embeddings-type",
        "predict-graft-str", "predict-tag-type", "evaluate-output-type", "step-run-type", "step-step-type",
        "extend-spec-type"])
def test_the_python_api_is_refused_as_the_command_line_is(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_python_api_refuses_an_output_inside_an_input(tmp_path):
    """Every step called from Python refuses an output directory inside a directory it reads, as
    the command line does as it parses (config.output_inside_an_input), before anything is
    written: it wrote a run inside its source run, or an extension inside the model directory."""
    from mmadapt import adapt, extend, steps
    from mmadapt.run import RunSpec

    src, data = tmp_path / "src", tmp_path / "data"
    src.mkdir(), data.mkdir()
    (src / "config.json").write_text("{}")
    tiny, train = PRESETS["tiny"][0], TrainConfig()
    calls = {
        "pretrain": (lambda out: steps.pretrain(RunSpec(output_dir=out, data_path=data),
                                                steps.Pretrain(model=tiny, train=train)), data, "data_path"),
        "build_minipost": (lambda out: steps.build_minipost(RunSpec(output_dir=out),
                                                            steps.BuildMinipost(primary=src, train=train)), src,
                           "primary"),
        "fit_head": (lambda out: steps.fit_head(RunSpec(output_dir=out), steps.FitHead(primary=src, train=train)),
                     src, "primary"),
        "finetune": (lambda out: steps.finetune(RunSpec(output_dir=out), steps.Finetune(task="bible-genre",
                                                                                        primary=src)), src, "primary"),
        "adapt": (lambda out: adapt.adapt_embeddings(RunSpec(output_dir=out), adapt.AdaptEmbeddings(
            system="bl_base", source=src, lang="de", train=train)), src, "source"),
        "sweep": (lambda out: steps.sweep(RunSpec(output_dir=out, data_path=data),
                                          steps.Sweep(source=src, lang="de", train=train)), src, "source"),
        "extend": (lambda out: extend.Extend(model=src, lang="de", corpus="bible:de", output_dir=out), src, "model"),
    }
    for name, (call, inside, flag) in calls.items():
        out = inside / "out" / name
        with pytest.raises(ValueError) as e:
            call(out)
        assert str(e.value) == (f"--output_dir {out} is inside --{flag} {inside}: write it elsewhere (what a command "
                                "reads is left as it is)"), (name, str(e.value))
        assert not (inside / "out").exists(), name


def test_the_python_api_refuses_a_text_the_step_does_not_read(tmp_path):
    """A RunSpec text (data_path, corpus, tokenizer) a step does not read is refused before
    anything is written, as its command has no such flag: finetune dropped all three and
    build_minipost, fit-head and sweep the tokenizer, without a word."""
    from mmadapt import steps
    from mmadapt.run import RunSpec

    src, out, train = tmp_path / "src", tmp_path / "out", TrainConfig()
    calls = {
        "finetune": (lambda run: steps.finetune(run, steps.Finetune(task="bible-genre", primary=src)),
                     "finetune reads no RunSpec {} (it reads the task's files with the primary run's tokenizer)"),
        "build_minipost": (lambda run: steps.build_minipost(run, steps.BuildMinipost(primary=src, train=train)),
                           "build_minipost reads no RunSpec {} (its text is encoded with the primary run's tokenizer)"),
        "fit_head": (lambda run: steps.fit_head(run, steps.FitHead(primary=src, train=train)),
                     "fit-head reads no RunSpec {} (its text is encoded with the primary run's tokenizer)"),
        "sweep": (lambda run: steps.sweep(run, steps.Sweep(source=src, lang="de", train=train)),
                  "sweep reads no RunSpec {} (the vocabulary is the prepared dataset's, or one trained on the corpus)"),
    }
    given = {"data_path": tmp_path / "data", "corpus": "bible:en", "tokenizer": tmp_path / "spm.model"}
    for name, (call, message) in calls.items():
        for field in ("data_path", "corpus", "tokenizer") if name == "finetune" else ("tokenizer",):
            with pytest.raises(ValueError) as e:
                call(RunSpec(output_dir=out, **{field: given[field]}))
            assert str(e.value) == message.format(field) + ": drop it", (name, str(e.value))
            assert not out.exists(), name


def test_numpy_numbers_become_python_numbers():
    """A sweep over np.arange gives NumPy scalars: taken as the numbers they are, and recorded as
    JSON numbers (run.json); a NumPy float where a whole number is declared is still refused."""
    import json

    import numpy as np

    train = TrainConfig(train_iters=np.int64(400), lr=np.float32(0.5), extra_save_steps=(np.int32(5), 7))
    assert (train.train_iters, train.lr, train.extra_save_steps) == (400, 0.5, (5, 7))
    assert json.loads(json.dumps(dataclasses.asdict(train)))["extra_save_steps"] == [5, 7]
    with pytest.raises(ValueError, match="--train_iters takes a whole number"):
        TrainConfig(train_iters=np.float64(5.0))
    # the steps' own whole-number arguments too (evaluate's eval_batch_tokens refused np.int64(4096) as not one)
    from mmadapt.config import whole_arg

    assert type(whole_arg(np.int64(4096), "eval_batch_tokens", 1)) is int
    with pytest.raises(ValueError, match=r"eval_batch_tokens must be a whole number >= 1, got np.float64\(4096.0\)"):
        whole_arg(np.float64(4096), "eval_batch_tokens", 1)
    assert Layout(tensor_model_parallel_size=np.int64(2)).tensor_model_parallel_size == 2


def test_help_shows_each_flags_range():
    text = " ".join(pretrain_parser().format_help().split())  # argparse wraps lines
    assert "[>= 1]" in text and "[in (0, 1)]" in text and "[one of sdpa, varlen, math]" in text


def test_a_path_given_as_text_becomes_a_path():
    from mmadapt import steps

    assert steps.Finetune(task="bible-genre", primary="runs/x").primary == Path("runs/x")
    # its files a Path or a str, as steps.evaluate takes them (kept as text: '{lang}' and 'bible' are no paths)
    step = steps.Finetune(task="xnli", primary="p", train_file=Path("t.tsv"), eval_file=Path("xnli/{lang}.tsv"))
    assert (step.train_file, step.eval_file) == ("t.tsv", "xnli/{lang}.tsv")
    # a file per language (Step 4's eval_file, the plug-in metric's data): a Path is read as its text,
    # {lang} replaced as in a str (a Path's replace() is a rename: it failed after every model loaded)
    from mmadapt.config import spec_arg

    assert spec_arg(Path("xnli/{lang}.tsv"), "eval_file").replace("{lang}", "de") == "xnli/de.tsv"


def test_each_step_owns_its_settings():
    """TrainConfig's Step-2 fields (config.STEP2) are offered as flags by adapt and sweep alone, and
    a config of another step that sets one is refused in one line naming it (the Python API's
    check, StepSpec); left at their defaults they are no step's business."""
    import dataclasses as dc

    from mmadapt import cli, steps
    from mmadapt.config import STEP2

    owned = [f.name for f in dc.fields(TrainConfig) if f.metadata.get("owner") is STEP2]
    assert set(owned) == {"train_output_bias", "embedding_init", "vocab_mode", "expand_output_start",
                          "expand_source_nats", "replay_data", "replay_fraction", "plugin_eval_blocks",
                          "primary_calibration"}
    for parser, offered in ((cli.pretrain_parser(), False), (cli.minipost_parser(), False),
                            (cli.fit_head_parser(), False), (cli.adapt_parser(), True), (cli.sweep_parser(), True)):
        flags = {a.dest for a in parser._actions}
        assert all((name in flags) == offered for name in owned), parser.prog
    model = PRESETS["tiny"][0]
    steps.Pretrain(model=model, train=TrainConfig())
    for name, value in (("embedding_init", "normal"), ("replay_data", "data/en"), ("plugin_eval_blocks", 8),
                        ("train_output_bias", False), ("primary_calibration", "scale")):
        train = dc.replace(TrainConfig(), **{name: value})
        for make in (lambda: steps.Pretrain(model=model, train=train),
                     lambda: steps.FitHead(primary=Path("runs/x"), train=train),
                     lambda: steps.BuildMinipost(primary=Path("runs/x"), train=train)):
            with pytest.raises(ValueError, match=f"^{name} is a Step-2 setting, which [a-z_-]+ does not use: drop it$"):
                make()
        steps.AdaptEmbeddings(system="bl_base", source=Path("runs/x"), lang="de", train=train)


def test_replay_data_alone_takes_the_measured_default_fraction():
    """--replay_data without --replay_fraction replays REPLAY_FRACTION of every batch (the value
    chosen from the expand sweep); without --replay_data there is no replay; a fraction of 0 with
    replay data, or one without it, is refused in one line when the config is validated."""
    from mmadapt.config import REPLAY_FRACTION

    model = PRESETS["tiny"][0]
    assert REPLAY_FRACTION == 0.5
    assert TrainConfig(replay_data="data/en").replay_fraction == REPLAY_FRACTION
    assert TrainConfig(replay_data="data/en", replay_fraction=0.1).replay_fraction == 0.1
    assert not TrainConfig().replay_fraction  # unset: no replay
    # a preset's schedule (made without replay text) takes the default when replay text is set on
    # it, as `adapt --replay_data` (the example in its --help) sets it over --preset's schedule
    preset = PRESETS["tiny"][1]
    assert dataclasses.replace(preset, replay_data="data/en").replay_fraction == REPLAY_FRACTION
    from mmadapt import cli

    args = cli.adapt_parser().parse_args(["--system", "bl_base", "--source", "runs/x", "--lang", "de",
                                         "--output_dir", "out", "--replay_data", "data/en"])
    assert override(preset, args).replay_fraction == REPLAY_FRACTION
    for bad in (TrainConfig(seq_length=64, replay_data="data/en", replay_fraction=0.0),
                TrainConfig(seq_length=64, replay_fraction=0.25)):
        with pytest.raises(ValueError, match="--replay_fraction needs --replay_data") as e:
            bad.validate(model)
        assert "\n" not in str(e.value)


def test_a_run_recorded_with_replay_fraction_0_resumes(tmp_path):
    """Runs recorded before an unset replay_fraction stayed unset hold 0.0 where they had no replay
    text: a --resume of one reads it as the same (run.SAME_ON_RESUME); a recorded fraction that
    replayed is a changed run."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"
    for saved, ok in ((0.0, True), (None, True), (0.5, False)):
        record.write_text(json.dumps({"train": {"replay_fraction": saved, "seed": 1}}))
        if ok:
            check_same_run(record, {"train": {"replay_fraction": None, "seed": 1}})
        else:
            with pytest.raises(ValueError, match="train.replay_fraction is None here but 0.5"):
                check_same_run(record, {"train": {"replay_fraction": None, "seed": 1}})


def test_a_resume_names_the_training_file_however_it_is_spelt(tmp_path, monkeypatch):
    """finetune recorded --train_file as given and compared the text: the same file as ./t.csv, or
    from another directory (a requeued job), was refused as a changed run. run.json now holds its
    absolute path, and a --resume compares files (a record of a relative one: from where it
    runs); another file is still refused. Step 2's --replay_data alike (./data/en/ was refused)."""
    import json

    from mmadapt.run import check_same_run

    monkeypatch.chdir(tmp_path)
    record = tmp_path / "run.json"
    for saved in ("t.csv", str(tmp_path / "t.csv")):
        record.write_text(json.dumps({"train_file": saved}))
        for given in ("t.csv", "./t.csv", str(tmp_path / "t.csv"), f"{tmp_path}/sub/../t.csv"):
            check_same_run(record, {"train_file": given})
        with pytest.raises(ValueError, match="train_file is other.csv here but"):
            check_same_run(record, {"train_file": "other.csv"})
    # a link to it (or a linked directory, /scratch for /lustre) is the same file
    (tmp_path / "t.csv").write_text("text,label\n")
    (tmp_path / "link.csv").symlink_to(tmp_path / "t.csv")
    (tmp_path / "linked").symlink_to(tmp_path, target_is_directory=True)
    for given in ("link.csv", str(tmp_path / "linked" / "t.csv")):
        check_same_run(record, {"train_file": given})
    # Step 2's --replay_data, a dataset directory (its content: the record's replay_digest)
    for saved in ("data/en", str(tmp_path / "data" / "en")):
        record.write_text(json.dumps({"train": {"replay_data": saved}}))
        for given in ("data/en", "./data/en/", str(tmp_path / "data" / "en")):
            check_same_run(record, {"train": {"replay_data": given}})
        with pytest.raises(ValueError, match="train.replay_data is data/fr here but"):
            check_same_run(record, {"train": {"replay_data": "data/fr"}})


def test_a_resume_of_another_system_is_refused_by_its_system(tmp_path):
    """--resume with another --system (bl_base over a MINIJOINT run's record): named by what
    differs first, the system, not by the model shape that follows from it."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"
    record.write_text(json.dumps({"model": {"num_layers": 4}, "step": "adapt", "system": "minijoint"}))
    with pytest.raises(ValueError, match="changed run: system is bl_base here but minijoint in "):
        check_same_run(record, {"model": {"num_layers": 12}, "step": "adapt", "system": "bl_base"})


def test_a_run_recorded_before_per_token_losses_resumes_as_it_trained(tmp_path):
    """A run recorded before calculate_per_token_loss (2026-12-02) took the mean of its
    micro-batches' means: resumed with today's default, its updates would change weighting midway.
    It resumes with false; with true only where it had one micro-batch on one rank (the same math);
    a run recorded with the field is checked as any other."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"
    per_token = {"data_parallel_size": 2, "train": {"gradient_accumulation_steps": 1, "calculate_per_token_loss": True}}
    means = {**per_token, "train": {**per_token["train"], "calculate_per_token_loss": False}}
    record.write_text(json.dumps({"data_parallel_size": 2, "train": {"gradient_accumulation_steps": 1}}))
    check_same_run(record, means)
    with pytest.raises(ValueError, match="recorded before train.calculate_per_token_loss existed: it trained with "
                                         "false; resume with --calculate_per_token_loss false"):
        check_same_run(record, per_token)
    record.write_text(json.dumps({"data_parallel_size": 1, "train": {"gradient_accumulation_steps": 1}}))
    check_same_run(record, {**per_token, "data_parallel_size": 1})
    check_same_run(record, {**means, "data_parallel_size": 1})
    # a record from before data_parallel_size (2026-12-01) may have run on several ranks
    record.write_text(json.dumps({"train": {"gradient_accumulation_steps": 1}}))
    check_same_run(record, {**means, "data_parallel_size": 1})
    with pytest.raises(ValueError, match="it trained with false"):
        check_same_run(record, {**per_token, "data_parallel_size": 1})
    record.write_text(json.dumps({"train": {"gradient_accumulation_steps": 4}}))
    with pytest.raises(ValueError, match="it trained with false"):
        check_same_run(record, {**per_token, "data_parallel_size": 1, "train": {**per_token["train"],
                                                                                 "gradient_accumulation_steps": 4}})
    record.write_text(json.dumps(per_token))
    with pytest.raises(ValueError, match="train.calculate_per_token_loss is False here but True"):
        check_same_run(record, means)


def test_a_step3_run_recorded_before_per_token_losses_resumes_as_it_trained(tmp_path):
    """Step 3 gained calculate_per_token_loss on 2026-12-04 (a tag task's words; before, the mean
    of its micro-batches' means): a tag task recorded before resumes with false, or with true at
    one micro-batch on one rank; a classify or span task scored one per row, alike under both."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"

    def step3(task: str, value: bool | None, accumulation: int = 2) -> dict:
        cfg = {"gradient_accumulation_steps": accumulation,
               **({} if value is None else {"calculate_per_token_loss": value})}
        return {"task": task, "data_parallel_size": 1, "finetune": cfg}

    record.write_text(json.dumps(step3("tag", None)))
    check_same_run(record, step3("tag", False))
    with pytest.raises(ValueError, match="recorded before finetune.calculate_per_token_loss existed: it trained "
                                         "with false; resume with --calculate_per_token_loss false"):
        check_same_run(record, step3("tag", True))
    record.write_text(json.dumps(step3("pos", None, accumulation=1)))
    check_same_run(record, step3("pos", True, accumulation=1))
    for task in ("classify", "xquad"):
        record.write_text(json.dumps(step3(task, None)))
        check_same_run(record, step3(task, True))
    record.write_text(json.dumps(step3("tag", True)))
    with pytest.raises(ValueError, match="finetune.calculate_per_token_loss is False here but True"):
        check_same_run(record, step3("tag", False))


def test_a_step_1b_run_recorded_before_its_source_fingerprint_resumes(tmp_path):
    """build_minipost and fit-head record the fingerprint of the weights they build on since
    2026-11-27 (af5e080); a --resume of a run recorded before was refused as a changed run
    ("frozen_from.fingerprint is <hash> here but None"), and could never be continued. Another
    recorded fingerprint is still a changed run."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"
    mine = {"recipe": "minipost", "frozen_from": {"run_dir": "/runs/base", "tag": "step00000010", "fingerprint": "ab"}}
    record.write_text(json.dumps({"recipe": "minipost", "frozen_from": {"run_dir": "/runs/base",
                                                                        "tag": "step00000010"}}))
    check_same_run(record, mine)
    record.write_text(json.dumps({**mine, "frozen_from": {**mine["frozen_from"], "fingerprint": "cd"}}))
    with pytest.raises(ValueError, match="frozen_from.fingerprint is ab here but cd"):
        check_same_run(record, mine)


def test_a_run_resumes_under_other_bucket_sizes_but_not_another_zero_stage(tmp_path):
    """A run recorded under zero1_bf16.json before it set reduce_bucket_size resumes under the
    file as it is now (bucket sizes group the reduction, they do not change what is trained:
    config.CHANGEABLE_ON_RESUME); another ZeRO stage is a changed run."""
    import json

    from mmadapt.run import check_same_run

    record = tmp_path / "run.json"
    before = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    record.write_text(json.dumps({"ds_config": before}))  # zero1_bf16.json as it was until 2026-12-01
    now = json.loads((REPO / "ds_configs" / "zero1_bf16.json").read_text())
    assert now["zero_optimization"]["reduce_bucket_size"] == 40_000_000
    check_same_run(record, {"ds_config": now})
    with pytest.raises(ValueError, match="ds_config.zero_optimization.stage is 2 here but 1"):
        check_same_run(record, {"ds_config": {**now, "zero_optimization": {"stage": 2}}})


def test_mmadapt_tiny_shrinks_sizes_and_nothing_else(monkeypatch):
    """MMADAPT_TINY=1 (config.tiny_sizes): a preset becomes its family's small one, the sizes a
    command line or a preset gives are capped (a smaller one given is kept), every other flag is
    as written; flops, which only computes, is not shrunk; unset, nothing changes."""
    from mmadapt import cli
    from mmadapt.config import TINY_CAPS, PreprocessConfig

    argv = ["--recipe", "minijoint", "--preset", "qwen2-0.5b", "--data_path", "d", "--output_dir", "o",
            "--train_iters", "3", "--lr", "0.01"]
    model, train = cli.configs_from_args(cli.pretrain_parser().parse_args(argv))
    assert (model.hidden_size, train.train_iters, train.seq_length) == (896, 3, 2048)  # as written
    monkeypatch.setenv("MMADAPT_TINY", "1")
    model, train = cli.configs_from_args(cli.pretrain_parser().parse_args(argv))
    small = find_preset("llama-tiny")[1]
    assert (model.family, model.hidden_size, model.num_layers) == ("llama", small.hidden_size, small.num_layers)
    assert (train.train_iters, train.lr, train.seq_length, train.train_micro_batch_size_per_gpu) == (
        3, 0.01, TINY_CAPS["seq_length"], TINY_CAPS["train_micro_batch_size_per_gpu"])
    assert model.head_layers == (4, 12)  # the recipe, over the small shape
    ns = cli.preprocess_parser().parse_args(["--corpus", "c.txt", "--output_dir", "o", "--vocab_size", "50000",
                                             "--workers", "32"])
    assert (ns.vocab_size, override(PreprocessConfig(), ns).workers) == (2000, TINY_CAPS["workers"])
    ns = cli.adapt_parser().parse_args(["--system", "bl_base", "--source", "s", "--lang", "de", "--output_dir", "o"])
    assert override(TrainConfig(train_iters=50_000, lr_warmup_iters=500), ns).train_iters == TINY_CAPS["train_iters"]
    assert ns.vocab_size is None  # unset stays unset: the prepared data's vocabulary decides
    from mmadapt.sweep import SweepConfig
    ns = cli.sweep_parser().parse_args(["--source", "s", "--lang", "de", "--output_dir", "o"])
    assert override(SweepConfig(), ns).bpb_bytes == TINY_CAPS["bpb_bytes"] < SweepConfig.bpb_bytes  # by default too
    # a QA fine-tune's question fits beside its context at the capped seq_length (64 pieces of question were refused)
    from mmadapt.config import FinetuneConfig
    ns = cli.finetune_parser().parse_args(["--task", "xquad", "--primary", "p", "--train_file", "f",
                                           "--output_dir", "o"])
    ft = override(FinetuneConfig(), ns)
    assert ft.max_query_length == TINY_CAPS["max_query_length"] and ft.seq_length >= ft.max_query_length + 8
    from mmadapt.tasks import check_task_fields, get_task
    ns = cli.finetune_parser().parse_args(["--task", "xnli", "--primary", "p", "--train_file", "f",
                                           "--output_dir", "o"])
    check_task_fields(get_task("xnli"), override(FinetuneConfig(), ns))  # the capped default is no QA flag given
    with pytest.raises(ValueError, match="--max_query_length is for question answering"):
        check_task_fields(get_task("xnli"), override(FinetuneConfig(), cli.finetune_parser().parse_args(
            ["--task", "xnli", "--primary", "p", "--train_file", "f", "--output_dir", "o", "--max_query_length", "9"])))
    printed = []
    for tiny in ("1", "0"):
        monkeypatch.setenv("MMADAPT_TINY", tiny)
        with contextlib.redirect_stdout(out := io.StringIO()):
            cli.main(["flops", "--preset", "roberta-base", "--json"])
        printed.append(out.getvalue())
    assert printed[0] == printed[1] and '"v100_days": 8.1' in printed[0]  # roberta-base's, not tiny's


def _config_only_model(tmp_path: Path) -> Path:
    """A directory Extend takes for a Hugging Face model (its config.json) where nothing reads
    weights: the checks made as an Extend is made, claim, the command line's parsing."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_mmadapt_tiny_caps_the_sample_extend_trains_its_vocabulary_on(monkeypatch, tmp_path):
    """extend prepares its target corpus with a PreprocessConfig of its own: under MMADAPT_TINY=1
    its tokenizer sampled 2,000,000 lines where preprocess samples TINY_CAPS' 50,000; the
    preparation now takes the Extend's sample size, capped as preprocess's is."""
    from mmadapt import cli, data, extend, steps
    from mmadapt.config import TINY_CAPS, PreprocessConfig

    model = _config_only_model(tmp_path)
    seen = []
    monkeypatch.setattr(extend, "extend", lambda ext, tiny=False: seen.append(ext))
    argv = ["extend", "--model", str(model), "--lang", "de", "--corpus", "bible:de",
            "--output_dir", str(tmp_path / "o")]
    for tiny, lines in (("0", PreprocessConfig.tokenizer_sample_lines), ("1", TINY_CAPS["tokenizer_sample_lines"])):
        monkeypatch.setenv("MMADAPT_TINY", tiny)
        assert cli.main(argv) == 0 and seen[-1].tokenizer_sample_lines == lines
    assert (seen[-1].adapt_iters, seen[-1].corpus) == (8, "bible:de")  # the flags' caps, as before
    prepared, asked = [], []
    monkeypatch.setattr(steps, "preprocess", lambda *a, cfg, **kw: prepared.append(cfg))
    # ... and trains it with byte fallback where the model's own tokenizer has it (replace mode)
    monkeypatch.setattr(data, "has_byte_fallback", lambda path: asked.append(path) or True)
    extend._prepared(seen[-1], model, say=lambda line: None)
    assert prepared[0].tokenizer_sample_lines == TINY_CAPS["tokenizer_sample_lines"]
    assert prepared[0].byte_fallback and asked == [model / "tokenizer" / "spm.model"]
    assert not (tmp_path / "o").exists()


def test_mmadapt_tiny_caps_the_sample_a_step_trains_a_raw_corpuss_vocabulary_on(monkeypatch, tmp_path):
    """A step given a raw --corpus trains its vocabulary (Step 1 as preprocess would; Step 2's
    --vocab_mode expand the target's, merged) with a default PreprocessConfig: 2,000,000 lines
    under MMADAPT_TINY=1 too, and the CPU count's threads whatever was asked. They take
    RunSpec.prep, which the command line builds as preprocess builds its config."""
    import types

    from mmadapt import cli, expand, train
    from mmadapt.config import TINY_CAPS, ModelConfig, PreprocessConfig
    from mmadapt.run import RunSpec

    argv = ["--recipe", "bl_base", "--corpus", "bible:en", "--output_dir", str(tmp_path / "o")]
    for tiny, lines in (("0", PreprocessConfig.tokenizer_sample_lines), ("1", TINY_CAPS["tokenizer_sample_lines"])):
        monkeypatch.setenv("MMADAPT_TINY", tiny)
        run = cli._run_spec(cli.pretrain_parser().parse_args(argv))
        assert run.prep.tokenizer_sample_lines == lines
    seen = []

    def stop(*args, **kwargs):
        seen.append(kwargs)
        raise InterruptedError

    run = RunSpec(output_dir=tmp_path / "o", corpus="bible:de",
                  prep=PreprocessConfig(tokenizer_sample_lines=300, tokenizer_threads=1))
    monkeypatch.setattr(train, "prepare", stop)
    with pytest.raises(InterruptedError):
        train.TextData().prepare(run, ModelConfig(), TrainConfig(seed=7), None)
    monkeypatch.setattr(expand, "train_tokenizer", stop)
    source = types.SimpleNamespace(tokenizer=tmp_path / "spm.model", cfg=ModelConfig())
    with pytest.raises(InterruptedError):
        expand.merged_vocabulary(run, source, vocab_size=None, seed=7, manifest=None)
    cfg = seen[0]["cfg"]
    assert (cfg.tokenizer_sample_lines, cfg.tokenizer_seed, cfg.tokenizer_threads) == (300, 7, 1)  # the step's seed
    assert (seen[1]["max_sentences"], seen[1]["seed"], seen[1]["threads"]) == (300, 7, 1)


def test_an_extension_recorded_before_a_field_existed_continues_at_its_default(tmp_path):
    """extend.json holds an extension's arguments; one written before a field existed (e.g.
    plugin_eval_blocks) ran at that field's default: the same call continues it, another value of
    the field is a different extension and is refused in one line, nothing written."""
    import json

    from mmadapt.extend import Extend, claim

    model = _config_only_model(tmp_path)
    ext = Extend(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "ext")
    assert claim(ext) is True
    # a corpus given as a Path is the same extension as its text (329d755 refused a Path)
    assert dataclasses.replace(ext, corpus=Path(ext.corpus)).corpus == ext.corpus
    record = json.loads((ext.output_dir / "extend.json").read_text())
    del record["plugin_eval_blocks"], record["tokenizer_sample_lines"]
    (ext.output_dir / "extend.json").write_text(json.dumps(record))
    assert claim(ext) is False
    with pytest.raises(ValueError, match="with plugin_eval_blocks 256, not 8: continue it with the same arguments"):
        claim(dataclasses.replace(ext, plugin_eval_blocks=8))
    # but the sample of a record from before tokenizer_sample_lines: the same command under
    # MMADAPT_TINY=1 now caps it (50,000), where the record's call sampled the default
    assert claim(dataclasses.replace(ext, tokenizer_sample_lines=50_000)) is False
    assert sorted(p.name for p in ext.output_dir.iterdir()) == ["extend.json"]
    # the CLI's range of --bpb_bytes holds from Python too, before anything is written
    with pytest.raises(ValueError, match="^bpb_bytes 0: the summary scores at least 256 held-out bytes$"):
        Extend(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "none", bpb_bytes=0)
    assert not (tmp_path / "none").exists()


def test_an_extension_made_under_mmadapt_tiny_is_told_apart_from_other_arguments(tmp_path, monkeypatch):
    """The same command without MMADAPT_TINY=1 on an extension made with it (the README's first
    try) was refused naming a capped size the user never gave ('head_iters 8, not 200: continue
    it with the same arguments'), then, with that given, a size no flag sets. The refusal now
    names MMADAPT_TINY, both ways; with it as it was, the same command continues."""
    from mmadapt import cli, extend

    model, seen = _config_only_model(tmp_path), []
    monkeypatch.setattr(extend, "extend", lambda ext, tiny=False: seen.append((ext, tiny)))

    def call(out: str, tiny: bool) -> bool:  # the command line's Extend, claimed as extend claims it
        monkeypatch.setenv("MMADAPT_TINY", "1" if tiny else "0")
        assert cli.main(["extend", "--model", str(model), "--lang", "de", "--corpus", "bible:de", "--output_dir",
                         str(tmp_path / out)]) == 0
        return extend.claim(*seen[-1])
    assert call("o", tiny=True) is True
    record = (tmp_path / "o" / "extend.json").read_text()
    with pytest.raises(ValueError, match=r"^\S+/o holds an extension made with MMADAPT_TINY=1 \(adapt_iters 8 there, "
                                         r"600 here\): continue it with MMADAPT_TINY=1 and the same arguments, or "
                                         r"choose a new --output_dir$"):
        call("o", tiny=False)
    assert call("o", tiny=True) is False and (tmp_path / "o" / "extend.json").read_text() == record
    # a field it does not cap, changed too: that is the news (MMADAPT_TINY=1 would not continue it)
    monkeypatch.setenv("MMADAPT_TINY", "0")
    with pytest.raises(ValueError, match=r"^\S+/o holds the extension of \S+ with lr 0.001, not 0.0005: continue it "
                                         "with the same arguments"):
        extend.claim(dataclasses.replace(seen[-2][0], lr=5e-4))
    assert call("p", tiny=False) is True
    with pytest.raises(ValueError, match=r"made without MMADAPT_TINY=1 \(adapt_iters 600 there, 8 here\): continue "
                                         "it without MMADAPT_TINY=1"):
        call("p", tiny=True)
    # A Python call's sizes are as given, whatever the environment: recorded as not capped (it was
    # recorded as tiny at 600 updates, and the command line under MMADAPT_TINY=1 then said
    # 'adapt_iters 600, not 8: continue it with the same arguments', which it had)
    monkeypatch.setenv("MMADAPT_TINY", "1")
    assert extend.claim(extend.Extend(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "q")) is True
    with pytest.raises(ValueError, match=r"made without MMADAPT_TINY=1 \(adapt_iters 600 there, 8 here\): continue "
                                         "it without MMADAPT_TINY=1"):
        call("q", tiny=True)


def test_a_step_1b_flag_under_bl_base_is_refused_before_the_import(tmp_path, monkeypatch):
    """--minipost_iters with --system bl_base says nothing about the model: it was refused after
    the output directory was claimed and the whole model imported (minutes for a large one).
    extend refuses it before it claims anything; the command line's default (capped under
    MMADAPT_TINY=1) is not given, a Python call's 8 is, whatever the environment (it was let
    through under MMADAPT_TINY=1, recorded, and the same call without it refused as another)."""
    from mmadapt import cli, extend
    from mmadapt.extend import Extend

    model = _config_only_model(tmp_path)
    given = dict(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "ext", system="bl_base")
    with pytest.raises(ValueError, match="^--minipost_iters 2 is for Step 1b, which --system bl_base does not run: "
                                         "drop it$"):
        extend.extend(Extend(**given, minipost_iters=2))
    assert Extend(**given).minipost_iters == 500
    monkeypatch.setenv("MMADAPT_TINY", "1")
    with pytest.raises(ValueError, match="^--minipost_iters 8 is for Step 1b"):
        extend.extend(Extend(**given, minipost_iters=8))
    assert not (tmp_path / "ext").exists()
    claimed = []

    def claim(ext, tiny):
        claimed.append((ext.minipost_iters, tiny))
        raise ValueError("claimed")
    monkeypatch.setattr(extend, "claim", claim)
    args = ["extend", "--model", str(model), "--lang", "de", "--corpus", "bible:de", "--system", "bl_base"]
    assert cli.main([*args, "--output_dir", str(tmp_path / "ext")]) == 2 and claimed == [(8, True)]


def test_an_extension_killed_while_it_claimed_its_directory_is_claimed_again(tmp_path):
    """`claim` writes extend.json atomically: a kill before the rename left the directory holding
    `.extend.json.tmp<pid>` alone, and the same command was then refused ('not an extend
    directory') for good. A dead process's temporary is removed and the directory claimed; a live
    one's (another extension claiming it now) and any other file still refuse."""
    import os
    import subprocess

    from mmadapt.extend import Extend, claim

    model = _config_only_model(tmp_path)
    ext = Extend(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "ext")
    ext.output_dir.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    (ext.output_dir / f".extend.json.tmp{gone.pid}").write_text('{"model": "half of it')
    assert claim(ext) is True and claim(ext) is False
    assert sorted(p.name for p in ext.output_dir.iterdir()) == ["extend.json"]
    live = Extend(model=model, lang="de", corpus="bible:de", output_dir=tmp_path / "live")
    live.output_dir.mkdir()
    (live.output_dir / f".extend.json.tmp{os.getppid()}").write_text("{")
    with pytest.raises(ValueError, match="is not an extend directory"):
        claim(live)
    assert len(list(live.output_dir.iterdir())) == 1
    # a continued extension: what a kill left of its later records' writes (never read) goes too,
    # a live writer's stays
    for name in ("sources.json", "exports.json", "graft.json", "summary.json"):
        (ext.output_dir / f".{name}.tmp{gone.pid}").write_text("{")
    (ext.output_dir / f".graft.json.tmp{os.getppid()}").write_text("{")
    assert claim(ext) is False
    assert sorted(p.name for p in ext.output_dir.iterdir()) == [f".graft.json.tmp{os.getppid()}", "extend.json"]


def test_an_output_file_under_a_directory_one_cannot_write_is_refused_first(tmp_path, monkeypatch):
    """evaluate scored everything, then failed to make --output's directory (a raw OSError not
    naming the flag, every score lost): the nearest existing directory must be writable up front.
    (As root every directory is writable: os.access stands in for another user's view.)"""
    from mmadapt import config

    check_output_file(tmp_path / "new" / "r.json", "--output")  # creatable: accepted
    monkeypatch.setattr(config.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ValueError, match=rf"^--output {tmp_path}/new/r.json cannot be written: {tmp_path} is not "
                                         "writable by you; choose another path$"):
        check_output_file(tmp_path / "new" / "r.json", "--output")


def test_a_flag_is_its_whole_name_and_a_list_flag_is_given_once(capsys):
    """argparse took any unique prefix of a flag (--lr_warm for --lr_warmup_iters; adapt's --source
    given to finetune became --source_lang, a run trained); a list flag given twice kept its last
    list alone (--mini_layers 2 4 ... --mini_layers 6: depth 6). A single value given again
    replaces the one before (argparse's rule: a command line's override)."""
    base = ["--output_dir", "o"]
    for parser, argv, said in (
            (cli.pretrain_parser, [*base, "--lr_warm", "5"], "unrecognized arguments: --lr_warm 5"),
            (cli.finetune_parser, ["--task", "classify", "--primary", "p", "--train_file", "f", *base, "--source", "s"],
             "unrecognized arguments: --source s"),
            (cli.pretrain_parser, [*base, "--mini_layers", "2", "4", "--mini_layers", "6"],
             "--mini_layers is given twice: give all its values at once"),
            (cli.pretrain_parser, [*base, "--extra_save_steps=5", "--extra_save_steps", "7"],
             "--extra_save_steps is given twice")):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert cli.pretrain_parser().parse_args([*base, "--train_iters", "3", "--train_iters", "5"]).train_iters == 5


@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf", "nan", "1e14"])
def test_a_collective_timeout_that_is_no_positive_number_is_refused_before_anything_runs(value, capsys, monkeypatch):
    """MMADAPT_DIST_TIMEOUT_S was read with float() at import: 'abc' a traceback from every command
    (--help too), '-5' and 'inf' a traceback after the corpus was prepared, 'nan' a line naming no
    variable."""
    from mmadapt.config import dist_timeout_s

    monkeypatch.setenv("MMADAPT_DIST_TIMEOUT_S", value)
    with pytest.raises(SystemExit) as e:
        cli.pretrain_parser().parse_args(["--output_dir", "o"])
    assert e.value.code == 2 and (f"MMADAPT_DIST_TIMEOUT_S is '{value}': set it to a positive number of seconds "
                                  "up to 31,536,000 (default 1800), or unset it") in capsys.readouterr().err
    monkeypatch.setenv("MMADAPT_DIST_TIMEOUT_S", " 90 ")
    assert dist_timeout_s() == 90.0
    monkeypatch.setenv("MMADAPT_DIST_TIMEOUT_S", "")
    assert dist_timeout_s() == 1800.0


def test_a_run_from_python_with_a_bad_collective_timeout_is_refused_as_it_starts_its_ranks():
    """With no command's parser before it (the Python API), a bad MMADAPT_DIST_TIMEOUT_S ('1h')
    raised at import; read as 1800 s it would have run 30 minutes where an hour was meant."""
    import subprocess

    code = ("from mmadapt import parallel\ntry:\n    parallel.init_distributed()\nexcept ValueError as e:\n"
            "    print(e)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MMADAPT_DIST_TIMEOUT_S": "1h"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("MMADAPT_DIST_TIMEOUT_S is '1h': set it to a positive number of seconds"), out


def test_an_empty_cache_variable_is_an_unset_one():
    """MMADAPT_CACHE= (a variable set from an unset one) read as '.': the Bible written into the
    directory the command was started in."""
    import subprocess

    code = "from mmadapt.corpora import CACHE; from pathlib import Path; print(CACHE == Path.home() / '.cache/mmadapt')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MMADAPT_CACHE": " "}, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "True"
