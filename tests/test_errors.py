"""Every invalid input stops with a one-line message, exit code 2, before anything is written."""

import json
import os
from pathlib import Path

import pytest

from conftest import VOCAB
from mmadapt.cli import pretrain_main


def snapshot(path: Path):
    if not path.exists():
        return None
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def expect_error(capsys, out: Path, argv: list[str], message: str):
    before = snapshot(out)
    assert pretrain_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err, err
    assert len(err.splitlines()) == 1, err
    assert snapshot(out) == before


@pytest.fixture
def args(corpus, tokenizer, tmp_path):
    def make(*extra, out=None, recipe="minijoint", corpus=corpus, tokenizer=tokenizer):
        return ["--recipe", recipe, "--preset", "tiny", "--corpus", str(corpus), "--tokenizer", str(tokenizer),
                "--vocab_size", str(VOCAB), "--output_dir", str(out or tmp_path / "run"), *extra]
    return make


@pytest.mark.parametrize("extra, message", [
    (["--tensor_model_parallel_size", "3"], "num_attention_heads 4 is not divisible by tensor_model_parallel_size 3"),
    (["--head_layers", "13"], "head layer 13 is outside 1..num_layers=12"),
    (["--head_layers", "0", "12"], "--head_layers must be >= 1, got 0"),
    (["--pipeline_model_parallel_size", "13"], "pipeline_model_parallel_size 13 exceeds num_layers 12"),
    (["--vocab_size", "2000"], f"has {VOCAB} pieces but the model's vocab_size is 2000"),
    (["--seq_length", "1000"], "seq_length 1000 exceeds max_position_embeddings 128"),
    (["--pipeline_model_parallel_size", "2", "--ds_config", "ds_configs/zero2.json"], "ZeRO stage 2 does not combine"),
])
def test_invalid_configuration(capsys, args, tmp_path, extra, message):
    expect_error(capsys, tmp_path / "run", args(*extra), message)


def test_bl_small_pipeline_deeper_than_model(capsys, args, tmp_path):
    expect_error(capsys, tmp_path / "run", args("--pipeline_model_parallel_size", "5", recipe="bl_small"),
                 "pipeline_model_parallel_size 5 exceeds num_layers 4")


def test_missing_corpus(capsys, args, tmp_path):
    expect_error(capsys, tmp_path / "run", args(corpus=tmp_path / "nope.txt"), "nope.txt does not exist")


def test_empty_corpus(capsys, args, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    expect_error(capsys, tmp_path / "run", args(corpus=empty), "is empty")


def test_missing_tokenizer(capsys, args, tmp_path):
    expect_error(capsys, tmp_path / "run", args(tokenizer=tmp_path / "none.model"), "none.model does not exist")


def test_ds_config_with_batch_size(capsys, args, tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 32}))
    expect_error(capsys, tmp_path / "run", args("--ds_config", str(bad)), "sets train_batch_size")


def test_output_dir_with_another_runs_checkpoints(capsys, args, tmp_path):
    out = tmp_path / "old_run"
    (out / "checkpoints" / "step00000100").mkdir(parents=True)
    (out / "checkpoints" / "step00000100" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (out / "checkpoints" / "latest").write_text("step00000100")
    (out / "metrics.jsonl").write_text('{"step": 100}\n')
    expect_error(capsys, out, args(out=out), "already holds a run's checkpoints: pass --resume")


def test_resume_with_a_different_model(capsys, args, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    from mmadapt.config import apply_recipe, to_dict
    from mmadapt.models import PRESETS

    (out / "run.json").write_text(json.dumps({"model": to_dict(apply_recipe(PRESETS["tiny"][0], "bl_base"))}))
    expect_error(capsys, out, args("--resume", out=out), "--resume of a changed run: model.vocab_size is 1000 here but 2000")


@pytest.mark.parametrize("resume", [False, True])
def test_output_dir_holding_a_run_of_another_step(capsys, args, tmp_path, resume):
    """A directory holding another step's run (a Step-3 run, say) is refused as that: the line was
    'pass --resume to continue it', and with --resume 'a changed run: model.head_layers is ...'
    (fields of a config the other kind's run holds, and flags this command may not have)."""
    out = tmp_path / "task_run"
    (out / "checkpoints" / "step00000010").mkdir(parents=True)
    (out / "checkpoints" / "step00000010" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (out / "checkpoints" / "latest").write_text("step00000010")
    (out / "run.json").write_text(json.dumps({"step": "finetune", "model": {"head_layers": []}}))
    expect_error(capsys, out, args(*["--resume"] * resume, out=out),
                 f"--output_dir {out} holds a finetune run (Step 3: a task model), and this command writes a pretrain "
                 "or import-hf run (Step 1): choose a new --output_dir (nothing was changed)")


def test_world_size_not_divisible(capsys, args, tmp_path, monkeypatch):
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "3")
    expect_error(capsys, tmp_path / "run", args("--tensor_model_parallel_size", "2"), "3 ranks cannot hold")


def test_srun_tasks_count_as_a_world_only_without_one_described(monkeypatch):
    """srun's tasks with no launcher between (SLURM_STEP_NUM_TASKS, no WORLD_SIZE) are refused
    (test_bad_input); a task whose WORLD_SIZE says what it is (a launcher's rank, or 1: independent
    runs packed into one step, each into its own --output_dir) is taken as said, and an srun
    spelling that is not a count (a task list) or one task is a world of one."""
    from mmadapt.parallel import launched_world_size

    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    for world in ("1", "8"):
        monkeypatch.setenv("WORLD_SIZE", world)
        assert launched_world_size() == int(world)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"^srun started 4 tasks .*\(independent runs, one per task into its own "
                                         r"--output_dir: set WORLD_SIZE=1\)$"):
        launched_world_size()
    for tasks in ("1", "", "2(x3)"):
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", tasks)
        assert launched_world_size() == 1


# --- Step 1b and Step 2 ------------------------------------------------------------------------

def expect_cli_error(capsys, main, out: Path, argv: list[str], message: str):
    before = snapshot(out)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert snapshot(out) == before


def test_adapt_errors(capsys, primary_run, de_corpus, de_tokenizer, tmp_path):
    from conftest import adapt_args
    from mmadapt.cli import adapt_main

    out = tmp_path / "adapt"
    args = lambda system, source=primary_run, *extra: adapt_args(system, source, de_corpus, de_tokenizer, out, *extra)  # noqa: E731
    expect_cli_error(capsys, adapt_main, out, args("minipost"), "--system minipost adapts a run with recipe minipost")
    expect_cli_error(capsys, adapt_main, out, args("bl_small"), "but " + str(primary_run.resolve()) + " has recipe minijoint")
    expect_cli_error(capsys, adapt_main, out, args("minijoint", tmp_path / "nowhere"), "is not an mmadapt run directory")
    expect_cli_error(capsys, adapt_main, out, args("minijoint", primary_run, "--source_tag", "step00000007"),
                     "has no complete checkpoint step00000007")
    expect_cli_error(capsys, adapt_main, out, args("minijoint", primary_run, "--vocab_size", "999"),
                     f"has {VOCAB} pieces but the model's vocab_size is 999")
    expect_cli_error(capsys, adapt_main, out, args("minijoint", primary_run, "--tensor_model_parallel_size", "3"),
                     "num_attention_heads 4 is not divisible by tensor_model_parallel_size 3")
    # Step 2's output dir must not be the source run (a Step-1 run's).
    expect_cli_error(capsys, adapt_main, primary_run,
                     adapt_args("minijoint", primary_run, de_corpus, de_tokenizer, primary_run),
                     "holds a pretrain or import-hf run (Step 1), and this command writes an adapt run")


def test_build_minipost_errors(capsys, primary_run, tmp_path):
    from mmadapt.cli import minipost_main

    out = tmp_path / "mp"
    base = ["--primary", str(primary_run), "--output_dir", str(out)]
    expect_cli_error(capsys, minipost_main, out, base + ["--mini_layers", "12"], "mini_layers 12 must be in 1..11")
    expect_cli_error(capsys, minipost_main, out, base + ["--new_layers", "0"], "new_layers must be >= 1")
    (tmp_path / "not_a_run").mkdir()
    expect_cli_error(capsys, minipost_main, out, ["--primary", str(tmp_path / "not_a_run"), "--output_dir", str(out)],
                     "is not an mmadapt run directory")


def test_resume_into_checkpoints_this_user_cannot_write(capsys, args, tmp_path, monkeypatch):
    """A --resume whose checkpoints/ the user may not write is refused before the run starts (torch
    reported it mid-run as "Parent directory ... does not exist"). The tests run as root, whom
    os.access lets write anywhere, so it answers here as it would for another user."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p).name == "checkpoints" else real(p, mode))
    expect_error(capsys, out, args("--resume", out=out),
                 f"{out / 'checkpoints'} is not writable by this user: the run writes its checkpoints there")


def test_resume_under_a_ds_config_that_lacks_a_setting_of_the_run(tmp_path):
    """A DeepSpeed setting the run recorded and this --ds_config lacks is a change (bf16 trained,
    resumed under an fp32 JSON); one it records as off, or a bucket size, is not."""
    from mmadapt.run import check_same_run

    run_file = tmp_path / "run.json"
    mine = {"ds_config": {"zero_optimization": {"stage": 1}}}
    run_file.write_text(json.dumps({"ds_config": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}}))
    with pytest.raises(ValueError, match=r"ds_config.bf16.enabled is True in .* and unset in this --ds_config"):
        check_same_run(run_file, mine)
    run_file.write_text(json.dumps({"ds_config": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
                                                  "bf16": {"enabled": False}}}))
    check_same_run(run_file, mine)


def test_resume_on_another_number_of_data_parallel_ranks(tmp_path):
    """The global batch is micro-batch x accumulation x data-parallel ranks: a --resume on another
    number of them is a change; a run recorded before the key is not checked."""
    from mmadapt.run import check_same_run

    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"data_parallel_size": 4}))
    with pytest.raises(ValueError, match="data_parallel_size is 2 here but 4"):
        check_same_run(run_file, {"data_parallel_size": 2})
    check_same_run(run_file, {"data_parallel_size": 4})
    run_file.write_text(json.dumps({}))
    check_same_run(run_file, {"data_parallel_size": 2})
