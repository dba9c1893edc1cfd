"""The demo's shipped Step-1 models (mmadapt/demo_models): what they hold, that the demo's own
Step 1 reproduces their log, and that they install as runs every later step accepts."""

import json

import pytest
import torch

from conftest import PRETRAIN, REPO, child_env, metrics
from mmadapt.config import ModelConfig
from mmadapt.demo import DEMO_FAMILIES, RECIPES, Demo, DemoConfig, source_models
from mmadapt.models import get_family
from mmadapt.run import load_weights, read_run

SHIPPED_VOCAB = 2000


@pytest.mark.parametrize("family", DEMO_FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_model_is_a_complete_step1_run(recipe, family):
    shipped = source_models(family)
    blob = torch.load(shipped / f"{recipe}.pt", map_location="cpu", weights_only=False)
    run = blob["run"]
    assert run["recipe"] == recipe and run["step"] == "pretrain"
    assert run["train"]["train_iters"] == DemoConfig().pretrain_iters
    cfg = ModelConfig(**run["model"])
    assert cfg.family == family
    get_family(cfg).build_lm(cfg).load_state_dict(blob["state"], strict=True)
    log = [json.loads(l) for l in (shipped / f"{recipe}.metrics.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == run["train"]["train_iters"]
    assert log[-1]["loss"] < log[0]["loss"] - 1.0  # it learned well beyond its first updates


@pytest.mark.slow
@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_the_demos_step1_reproduces_the_shipped_log(family, tmp_path):
    """bl_small's first 50 updates, run by launch/pretrain.py with the demo's Step-1 settings on
    the English Bible encoded with the shipped tokenizer, give the shipped log's loss."""
    import subprocess
    import sys

    from mmadapt import steps
    from mmadapt.config import PreprocessConfig

    shipped = source_models(family)
    data = tmp_path / "en"
    steps.preprocess("bible:en", data, SHIPPED_VOCAB, PreprocessConfig(workers=1), tokenizer=shipped / "spm.model")
    cfg = DemoConfig(family=family)
    model, _ = Demo(cfg, tmp_path / "demo").source_settings("bl_small")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, PRETRAIN, "--recipe", "bl_small", "--preset", get_family(family).small_preset,
                           "--data_path", str(data), "--output_dir", str(out), "--vocab_size", str(SHIPPED_VOCAB),
                           "--init_method_std", str(model.init_method_std), "--output_bias_init",
                           model.output_bias_init, "--seq_length", str(cfg.seq_length),
                           "--train_micro_batch_size_per_gpu", str(cfg.pretrain_batch), "--lr", str(cfg.pretrain_lr),
                           "--train_iters", str(cfg.pretrain_iters), "--save_interval", str(cfg.pretrain_iters),
                           "--log_interval", "50", "--exit_interval", "50"],
                          cwd=REPO, capture_output=True, text=True, env=child_env(), timeout=900)
    assert proc.returncode == 76, proc.stderr[-3000:]  # paused by --exit_interval after 50 of 2000 updates
    log = [json.loads(l) for l in (shipped / "bl_small.metrics.jsonl").read_text().splitlines()]
    assert metrics(out)[0]["step"] == log[0]["step"] == 50
    assert metrics(out)[0]["loss"] == pytest.approx(log[0]["loss"], abs=0.01)


def test_installed_model_is_accepted_by_later_steps(tmp_path):
    from mmadapt import steps
    from mmadapt.config import PreprocessConfig
    from mmadapt.demo import install_source_model

    data = tmp_path / "en"
    steps.preprocess("bible:en", data, SHIPPED_VOCAB, PreprocessConfig(workers=1), tokenizer=source_models("roberta") / "spm.model")
    blob = torch.load(source_models("roberta") / "minijoint.pt", map_location="cpu", weights_only=False)
    run_dir = tmp_path / "minijoint"
    install_source_model("minijoint", run_dir, data, blob["run"]["model"], blob["run"]["train"])
    run = read_run(run_dir)
    assert run["data_path"] == str(data.resolve())
    cfg, state = load_weights(run_dir)
    assert cfg.heads_after == (4, 12) and all(torch.equal(state[k], v) for k, v in blob["state"].items())
    with pytest.raises(ValueError, match="pass --from_scratch"):
        install_source_model("minijoint", tmp_path / "other", data, {**blob["run"]["model"], "hidden_size": 32},
                             blob["run"]["train"])


def test_another_step1_seed_needs_from_scratch_and_is_refused_before_anything_is_written(tmp_path, capsys):
    from mmadapt.cli import main

    assert main(["demo", "--pretrain_seed", "2", "--output_dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: the shipped bl_base model was pretrained with seed 1234, this demo asks for 2: pass "
                       "--from_scratch to pretrain with these settings")
    assert not (tmp_path / "d").exists()
    Demo(DemoConfig(pretrain_seed=2), tmp_path / "d", from_scratch=True).check_sources()  # nothing to check
    Demo(DemoConfig(), tmp_path / "d").check_sources()  # the default is the shipped models' setting
    # for the decoder too: its models were pretrained with --fusion none, the default is now auto (how
    # a run runs, not what it trains: the demo refused to start)
    Demo(DemoConfig(family="llama"), tmp_path / "d").check_sources()


def test_a_demo_that_diverges_names_its_own_learning_rate_flags(tmp_path):
    """A demo pretraining from scratch at a learning rate that diverges said a run's advice: lower
    --lr, raise the warm-up or enable clipping (flags the demo lacks) and run the command again
    without --resume; with --pretrain_lr lowered, the same --output_dir is refused as another demo."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mmadapt", "demo", "--quick", "--from_scratch", "--pretrain_lr",
                           "1e6", "--pretrain_iters", "4", "--output_dir", str(tmp_path / "d")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=child_env(MMADAPT_TINY="1"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: diverged: pretrain: the loss (or its gradient) is not finite at update 3 (of 4); stopped without "
        "saving it. No checkpoint was saved before it: lower --pretrain_lr and run the command into a new "
        "--output_dir")


def test_family_dependent_settings_resolve_per_family_and_yield_to_the_command_line():
    """DemoConfig's None fields take their family's default (demo.FAMILY_DEFAULTS) when the demo
    is built; a value given on the command line is kept for either family."""
    from mmadapt.config import override
    from mmadapt.demo import QUICK, parser

    def seeds(*argv, base=DemoConfig()):
        return Demo(override(base, parser().parse_args(list(argv))), REPO / "unused").cfg.finetune_seeds

    assert seeds() == (1, 2, 3)
    assert seeds("--family", "llama") == (1, 2)
    assert seeds("--family", "llama", "--finetune_seeds", "4", "5", "6") == (4, 5, 6)
    assert seeds("--finetune_seeds", "7") == (7,)
    assert seeds("--family", "llama", base=QUICK) == (1,)
