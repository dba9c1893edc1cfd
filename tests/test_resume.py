"""Stop/resume and crash recovery reproduce an uninterrupted run exactly (dropout on)."""

import json
import random
import signal
import subprocess
import time

import pytest

from conftest import PRETRAIN, REPO, VOCAB, base_args, child_env, launch_cmd, metrics, run_pretrain

from mmadapt.run import FINISHED, RunRecord, checkpoint_tag, read_run, run_progress

pytestmark = pytest.mark.slow

STEPS = 8

# Fault injection from the test side: launch/pretrain.py with checkpoint.py's last write (the
# COMPLETE marker) of one tag replaced by SIGKILL, i.e. after DeepSpeed and the RNG files wrote.
KILL_IN_SAVE = """
import os, runpy, sys
from mmadapt import checkpoint
write = checkpoint.atomic_write
def dying_write(path, text):
    if path.name == "COMPLETE" and path.parent.name == os.environ["KILL_BEFORE_COMPLETE"]:
        os.kill(os.getpid(), 9)
    write(path, text)
checkpoint.atomic_write = dying_write
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _args(corpus, tokenizer, out, *extra):
    return base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--train_iters", str(STEPS),
                     "--log_interval", "1", "--train_micro_batch_size_per_gpu", "4", "--seq_length", "32",
                     *extra)


def losses(run_dir):
    return [(r["step"], r["loss"], r["head_losses"]) for r in metrics(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(corpus, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    run_pretrain(1, *_args(corpus, tokenizer, out))
    assert [s for s, _, _ in losses(out)] == list(range(1, STEPS + 1))
    return losses(out)


def test_stop_and_resume_matches_uninterrupted(uninterrupted, corpus, tokenizer, tmp_path):
    paused = run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--exit_interval", "3"), code=76)
    assert paused.stderr.strip().splitlines()[-1] == (
        f"paused at update 3 of {STEPS} (--exit_interval): checkpoint step00000003 is complete; run the same command "
        "with --resume to go on")
    assert "done:" not in paused.stdout
    assert [s for s, _, _ in losses(tmp_path)] == [1, 2, 3]
    # a pause is not the step's return: not finished, though its checkpoint is the newest
    assert read_run(tmp_path)[FINISHED] is None and run_progress(tmp_path, 3) == "resume"
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume"))
    assert losses(tmp_path) == uninterrupted  # exact: same data, masks, dropout and optimizer state
    assert read_run(tmp_path)[FINISHED] == f"step{STEPS:08d}" and run_progress(tmp_path, STEPS) == "done"


def test_a_stop_between_two_log_lines_resumes_to_the_same_lines(corpus, tokenizer, tmp_path):
    """A stop at update 3 of log windows of 2: the checkpoint carries update 3's loss, so the
    resumed run's line at 4 averages updates 3 and 4, as the uninterrupted run's does."""
    def go(out, *extra, code=0):
        run_pretrain(1, *_args(corpus, tokenizer, out, "--log_interval", "2", *extra), code=code)

    go(tmp_path / "full")
    go(tmp_path / "part", "--exit_interval", "3", code=76)
    assert [s for s, _, _ in losses(tmp_path / "part")] == [2]
    go(tmp_path / "part", "--resume")
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert [s for s, _, _ in losses(tmp_path / "full")] == [2, 4, 6, 8]
    # what a --resume on another number of data-parallel ranks is refused by (run.check_same_run)
    assert json.loads((tmp_path / "part" / "run.json").read_text())["data_parallel_size"] == 1


def test_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(uninterrupted, corpus, tokenizer,
                                                                             tmp_path):
    script = tmp_path / "pretrain_killed_in_save.py"
    script.write_text(KILL_IN_SAVE.format(script=PRETRAIN))
    proc = subprocess.run(launch_cmd(1, *_args(corpus, tokenizer, tmp_path / "run", "--save_interval", "1"),
                                     script=str(script)),
                          cwd=REPO, capture_output=True, text=True,
                          env=child_env(KILL_BEFORE_COMPLETE="step00000003", PYTHONPATH=str(REPO)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    tmp_path = tmp_path / "run"
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "step00000003").is_dir() and not (ckpt / "step00000003" / "COMPLETE").exists()
    assert (ckpt / "latest").read_text() == "step00000002"
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume", "--save_interval", "1"))
    assert losses(tmp_path) == uninterrupted
    assert (ckpt / "step00000003" / "COMPLETE").is_file()


def test_decoder_scoring_a_fraction_resumes_exactly_after_a_sigkill(corpus, tokenizer, tmp_path):
    """A 2-layer decoder scoring a quarter of each block's positions (--score_fraction 0.25), killed
    while saving update 3: its resume draws the same positions (a function of the seed and the
    sample index alone, tests/test_data.py) and ends with the uninterrupted run's losses."""
    def args(out, *extra):
        return ["--preset", "llama-tiny", "--num_layers", "2", "--corpus", str(corpus), "--tokenizer", str(tokenizer),
                "--vocab_size", str(VOCAB), "--output_dir", str(out), "--train_iters", "6", "--log_interval", "1",
                "--train_micro_batch_size_per_gpu", "4", "--seq_length", "32", "--score_fraction", "0.25", *extra]

    run_pretrain(1, *args(tmp_path / "full"))
    script = tmp_path / "pretrain_killed_in_save.py"
    script.write_text(KILL_IN_SAVE.format(script=PRETRAIN))
    proc = subprocess.run(launch_cmd(1, *args(tmp_path / "run", "--save_interval", "1"), script=str(script)),
                          cwd=REPO, capture_output=True, text=True,
                          env=child_env(KILL_BEFORE_COMPLETE="step00000003", PYTHONPATH=str(REPO)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    run_pretrain(1, *args(tmp_path / "run", "--resume", "--save_interval", "1"))
    assert [s for s, _, _ in losses(tmp_path / "full")] == list(range(1, 7))
    assert losses(tmp_path / "run") == losses(tmp_path / "full")


def test_sigkill_at_a_random_moment(uninterrupted, corpus, tokenizer, tmp_path):
    out = tmp_path / "run"  # (the slowed script sits in tmp_path)
    seed = random.randrange(10**6)
    delay = random.Random(seed).uniform(0.0, 1.5)
    # Each update slowed by 0.22 s: the 7 after the first checkpoint outlast the longest delay on
    # any machine, so the kill lands inside the run (asserted), not after it ended.
    proc = subprocess.Popen(launch_cmd(1, *_args(corpus, tokenizer, out, "--save_interval", "1"),
                                       script=_slow_script(tmp_path)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env(STEP_SLEEP="0.22", PYTHONPATH=str(REPO)))
    first = out / "checkpoints" / "step00000001" / "COMPLETE"
    _wait_for(first.exists, proc, "its first checkpoint")
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and _rows(out) < STEPS, f"the run ended before the kill ({delay:.3f}s)"
    run_pretrain(1, *_args(corpus, tokenizer, out, "--resume", "--save_interval", "1"))
    assert losses(out) == uninterrupted, f"kill delay {delay:.3f}s (seed {seed})"


# --- faults: signals, divergence, a second writer, damaged checkpoints ------------------------------

# launch/pretrain.py with every update slowed down (so a test can signal it mid-run) and, when
# MARK_PIDS is set, each rank's pid written there.
SLOW_STEPS = """
import os, runpy, sys, time
from mmadapt import train
step = train.lm_step
def slow_step(*a, **k):
    time.sleep(float(os.environ["STEP_SLEEP"]))
    return step(*a, **k)
train.lm_step = slow_step
if os.environ.get("MARK_PIDS"):
    open(os.path.join(os.environ["MARK_PIDS"], str(os.getpid())), "w").close()
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _slow_script(tmp_path):
    script = tmp_path / "pretrain_slow.py"
    script.write_text(SLOW_STEPS.format(script=PRETRAIN))
    return str(script)


def _wait_for(predicate, proc, what, timeout=300):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rows(run_dir):
    f = run_dir / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


def test_sigterm_saves_at_the_current_update_and_resume_matches(uninterrupted, corpus, tokenizer, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(1, *_args(corpus, tokenizer, out), script=_slow_script(tmp_path)), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(STEP_SLEEP="0.5", PYTHONPATH=str(REPO)))
    _wait_for(lambda: _rows(out) >= 3, proc, "three logged updates")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = int(err.strip().splitlines()[-1].split("at update ")[1].split(":")[0])
    assert 3 <= stopped_at < STEPS and "Traceback" not in err
    assert (out / "checkpoints" / f"step{stopped_at:08d}" / "COMPLETE").is_file()
    assert [s for s, _, _ in losses(out)] == list(range(1, stopped_at + 1))
    run_pretrain(1, *_args(corpus, tokenizer, out, "--resume"))
    assert losses(out) == uninterrupted


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(corpus, tokenizer, tmp_path):
    import torch

    from mmadapt.checkpoint import latest_tag, load_full_state_dict

    proc = subprocess.run(launch_cmd(1, *_args(corpus, tokenizer, tmp_path, "--lr", "1e6", "--lr_warmup_iters", "1",
                                                "--save_interval", "1")),
                          cwd=REPO, capture_output=True, text=True, env=child_env())
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: diverged: pretrain: the loss (or its gradient) is not finite at update "), last
    bad = int(last.split("at update ")[1].split(" ")[0])
    ckpt = tmp_path / "checkpoints"
    assert latest_tag(ckpt) == f"step{bad - 1:08d}"  # nothing at or after the bad update is marked complete
    assert all(torch.isfinite(v).all() for v in load_full_state_dict(ckpt).values())


def test_a_second_writer_is_refused(corpus, tokenizer, tmp_path, capsys):
    from mmadapt.cli import pretrain_main

    out = tmp_path / "run"
    # 200 updates: the writer is still writing (its lock held, no checkpoint yet) however long this
    # process takes to reach the lock on a loaded machine; the SIGTERM below ends it
    args = _args(corpus, tokenizer, out, "--train_iters", "200")
    proc = subprocess.Popen(launch_cmd(1, *args, script=_slow_script(tmp_path)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env(STEP_SLEEP="1", PYTHONPATH=str(REPO)))
    try:
        _wait_for(lambda: _rows(out) >= 1, proc, "the first logged update")
        before = sorted(p.name for p in out.iterdir())
        assert pretrain_main([*args, "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {out} is being written by process {proc.pid} on ") and "\n" not in err, err
        assert sorted(p.name for p in out.iterdir()) == before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    assert proc.returncode == 75 and not (out / "run.lock").exists()


def test_damaged_newest_checkpoint_falls_back_and_keep_last_prunes(uninterrupted, corpus, tokenizer, tmp_path):
    from mmadapt.checkpoint import complete_tags

    ckpt = tmp_path / "checkpoints"
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--save_interval", "1", "--keep_last", "2",
                           "--exit_interval", "4"), code=76)
    assert complete_tags(ckpt) == ["step00000003", "step00000004"]
    model_file = ckpt / "step00000004" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated, as by a full disk
    proc = run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume", "--save_interval", "1", "--keep_last", "2"))
    assert f"checkpoint step00000004 is damaged ({model_file} has 1000 bytes" in proc.stderr
    assert losses(tmp_path) == uninterrupted
    assert complete_tags(ckpt) == [f"step{STEPS - 1:08d}", f"step{STEPS:08d}"]
    # a kill inside the last save's prune (an older tag's COMPLETE gone, its files whole): the
    # finished run saves no more, so its --resume finishes the prune
    cut = ckpt / f"step{STEPS - 1:08d}"
    (cut / "COMPLETE").unlink()
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume", "--save_interval", "1", "--keep_last", "2"))
    assert complete_tags(ckpt) == [f"step{STEPS:08d}"] and not cut.exists()
    assert losses(tmp_path) == uninterrupted


def test_a_refused_resume_of_a_finished_run_leaves_its_record(corpus, tokenizer, tmp_path, capsys):
    """A --resume of a finished run whose every checkpoint is damaged is refused before anything
    is written. It was refused only where the checkpoint loads, after RunRecord.write had cleared
    the record's FINISHED: restored, the finished run read as one to resume (run_progress), which
    the demo, extend and sweep decide by."""
    from mmadapt.cli import pretrain_main

    out = tmp_path / "run"
    run_pretrain(1, *_args(corpus, tokenizer, out, "--train_iters", "2"))
    for model_file in (out / "checkpoints").glob("step*/mp_rank_00_model_states.pt"):
        model_file.write_bytes(model_file.read_bytes()[:1000])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert pretrain_main([*_args(corpus, tokenizer, out, "--train_iters", "2"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: every complete checkpoint in ") and "\n" not in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert read_run(out)[FINISHED] == "step00000002"


def test_sigterm_to_the_deepspeed_launcher_stops_every_rank(corpus, tokenizer, tmp_path):
    import psutil

    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen(launch_cmd(2, *_args(corpus, tokenizer, out, "--train_iters", "200"),
                                       script=_slow_script(tmp_path), launcher="deepspeed"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env(STEP_SLEEP="0.3", MARK_PIDS=str(pids), PYTHONPATH=str(REPO)))
    _wait_for(lambda: _rows(out) >= 2, proc, "two logged updates", timeout=600)
    ranks = [psutil.Process(int(p.name)) for p in pids.iterdir()]
    assert len(ranks) == 2
    launcher = ranks[0].parent()  # deepspeed.launcher.launch, the runner's child
    assert "deepspeed.launcher.launch" in " ".join(launcher.cmdline())
    proc.send_signal(signal.SIGTERM)  # DeepSpeed's runner dies at once and passes nothing on
    assert proc.wait(timeout=60) == -signal.SIGTERM
    gone, alive = psutil.wait_procs(ranks, timeout=120)
    assert not alive, f"ranks still running: {[p.pid for p in alive]}"
    # The orphaned launcher polls its ranks once a second, then waits up to 30 s for their
    # process trees (deepspeed/launcher/launch.py): it may outlive them by seconds, not forever.
    gone, alive = psutil.wait_procs([launcher], timeout=45)
    assert not alive, f"deepspeed.launcher.launch (pid {launcher.pid}) still running 45 s after its ranks"
    from mmadapt.checkpoint import complete_tags

    tags = complete_tags(out / "checkpoints")
    assert len(tags) == 1 and 2 <= int(tags[0][4:]) < 200, tags


def test_keep_last_counts_only_the_tags_up_to_the_one_just_saved(tmp_path):
    """After a resume that passed over a damaged newest tag (200) to 100, the next save (150)
    prunes among the tags up to itself: the damaged one, newer, neither counts as the newest nor
    is deleted (with it counted, keep_last 1 deleted 100 and 150, every intact tag)."""
    from mmadapt.checkpoint import complete_tags, prune

    for tag in ("step00000100", "step00000150", "step00000200"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "COMPLETE").write_text("{}")
    (tmp_path / "step00000050").mkdir()  # incomplete and older: deleted with the old complete ones
    prune(tmp_path, 1, "step00000150")
    assert complete_tags(tmp_path) == ["step00000150", "step00000200"]
    assert not (tmp_path / "step00000050").exists() and not (tmp_path / "step00000100").exists()
    prune(tmp_path, 2, "step00000150")  # within keep_last: nothing goes
    assert complete_tags(tmp_path) == ["step00000150", "step00000200"]
    # a prune killed after an old tag's COMPLETE went (its files whole): within keep_last, it goes
    (tmp_path / "step00000120").mkdir()
    (tmp_path / "step00000120" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    prune(tmp_path, 2, "step00000150")
    assert complete_tags(tmp_path) == ["step00000150", "step00000200"] and not (tmp_path / "step00000120").exists()


def test_keep_last_keeps_intact_tags_a_damaged_one_does_not_count_as(tmp_path):
    """A resume fell back from a damaged tag (3) to 2; the saves after it passed the damaged one,
    which then counted as one of the keep_last newest: keep_last 2 at save 4 deleted the intact
    2, leaving one usable checkpoint."""
    import json

    from mmadapt.checkpoint import complete_tags, prune

    for n in (2, 3, 4):
        tag = tmp_path / f"step{n:08d}"
        tag.mkdir()
        (tag / "model.pt").write_bytes(b"x" * 100)
        (tag / "COMPLETE").write_text(json.dumps({"step": n, "files": {"model.pt": 100}}))
    (tmp_path / "step00000003" / "model.pt").write_bytes(b"x" * 10)  # damaged
    prune(tmp_path, 2, "step00000004")
    assert complete_tags(tmp_path) == ["step00000002", "step00000003", "step00000004"]
    prune(tmp_path, 1, "step00000004")  # older than the newest intact one: the damaged one goes too
    assert complete_tags(tmp_path) == ["step00000004"]


def test_what_a_cut_short_start_leaves_is_still_a_run(tmp_path):
    """A directory holding only what a run writes before its run.json (SLURM's STOP file, come
    while the run started; an atomic write's temporary file) is the run's, not somebody's other
    files; a staged artifact cut short (`.<tag>.tmp<pid>`, its tensors and no meta.json) is no
    artifact; and a staged directory replacing another leaves the new one whole."""
    from mmadapt.artifact import ARTIFACT_FILE, artifact_dirs
    from mmadapt.checkpoint import refuse_overwrite, staged_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").write_text("")
    (run / ".run.json.tmp4242").write_text("{")
    refuse_overwrite(run, resume=True)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds other files \(notes.txt\) and no mmadapt run"):
        refuse_overwrite(run, resume=True)

    emb = tmp_path / "adapt" / "embeddings"
    for name in ("step00000000", ".step00000200.tmp4242"):
        (emb / name).mkdir(parents=True)
        (emb / name / ARTIFACT_FILE).write_bytes(b"x")
    assert artifact_dirs([tmp_path / "adapt"]) == [emb / "step00000000"]
    with staged_dir(emb / "step00000000", replace=True) as tmp:
        (tmp / "new").write_text("1")
    assert sorted(p.name for p in (emb / "step00000000").iterdir()) == ["new"]
    assert sorted(p.name for p in emb.iterdir()) == [".step00000200.tmp4242", "step00000000"]


def test_a_staged_directory_fills_a_link_to_an_empty_directory(tmp_path):
    """--output_dir a symbolic link to an empty directory: filled where it points, the link kept,
    nothing beside it (rmdir of the link failed after the body had written the whole output,
    which stayed as `.<name>.tmp<pid>`); a move that fails leaves no staged copy either."""
    from mmadapt.checkpoint import staged_dir

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    with staged_dir(tmp_path / "link") as tmp:
        (tmp / "config.json").write_text("{}")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(OSError), staged_dir(tmp_path / "full") as tmp:  # not empty: rmdir refuses
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "link", "target"]
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]


def test_tensorboard_drops_the_events_of_updates_a_run_trains_again(tmp_path):
    """MetricsLog on global rank 0: a run that starts again from update 0 (it stopped before its
    first checkpoint) drops the events the stopped one wrote, as it empties metrics.jsonl (they
    were kept: TensorBoard drew two curves over the same updates); one resumed from update 10
    keeps the events up to 10 and drops the later ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmadapt.engine import MetricsLog

    def run(start: int, losses: dict[int, float]) -> None:
        # each attempt in a second of its own, as a job's are: TensorBoard reads the event files in
        # name order, the second they were opened first (within one second a process-wide counter,
        # compared as text: 10 before 9)
        time.sleep(1.01 - time.time() % 1)
        log = MetricsLog(tmp_path, start)
        for step, loss in losses.items():
            log.write({"step": step, "loss": loss}, {"loss/total": loss})
        log.close()

    def curve() -> dict[int, float]:
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        return {e.step: e.value for e in events.Scalars("loss/total")}

    run(0, {10: 5.0, 20: 4.0})
    run(0, {10: 3.0})  # started again: the first attempt's 10 and 20 go
    assert curve() == {10: 3.0}
    run(0, {10: 3.0, 20: 2.5, 30: 2.0})
    run(20, {30: 1.5})  # resumed from the checkpoint of update 20: 30 is trained again
    assert curve() == {10: 3.0, 20: 2.5, 30: 1.5}
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [10, 20, 30]


def test_a_resume_where_every_complete_checkpoint_is_damaged_is_refused(tmp_path, capsys, monkeypatch):
    """checkpoint.resume: with no complete tag the run starts at update 0 (None); with complete
    tags that are all damaged it is refused in one line, before anything loads (it started at
    update 0, which emptied metrics.jsonl and would overwrite the tags); with one intact tag
    under a damaged newer one, that one is chosen (the load itself is test_damaged_newest...)."""
    from mmadapt import checkpoint

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    assert checkpoint.resume(None, ckpt) is None
    assert "no complete checkpoint" in capsys.readouterr().err
    for tag in ("step00000002", "step00000004"):
        (ckpt / tag).mkdir()
        (ckpt / tag / "model.pt").write_bytes(b"x" * 10)
        (ckpt / tag / "COMPLETE").write_text(json.dumps({"files": {"model.pt": 11}}))
    with pytest.raises(ValueError) as e:
        checkpoint.resume(None, ckpt)
    assert str(e.value) == (f"--resume: every complete checkpoint in {ckpt} is damaged (the newest, step00000004: "
                            f"{ckpt / 'step00000004' / 'model.pt'} has 10 bytes, 11 when it was saved): restore its "
                            "files and resume, or start a new --output_dir")
    assert capsys.readouterr().err == ""
    (ckpt / "step00000002" / "COMPLETE").write_text(json.dumps({"files": {"model.pt": 10}}))
    loaded = []
    monkeypatch.setattr(checkpoint, "load", lambda engine, d, tag, strict: loaded.append(tag))
    checkpoint.resume(None, ckpt)
    assert loaded == ["step00000002"]
    assert capsys.readouterr().err.startswith("checkpoint step00000004 is damaged (")


def test_a_checkpoint_pruned_before_or_while_it_is_read_is_said_so(tmp_path, monkeypatch):
    """load_full_state_dict: a tag chosen complete that its run's --keep_last prunes (prune:
    COMPLETE first, then the files) before or while a later step reads it is refused in one line
    that says so. Before: a tag gone read as "not an mmadapt checkpoint, or it was damaged", and
    one pruned after its model file was read gave that file's bf16 copies for the fp32 masters,
    silently."""
    import shutil

    import torch
    from mmadapt import checkpoint

    tag = tmp_path / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.save({"module": {"w": (w + 0.001).to(torch.bfloat16)}, "tp_partition_dims": {}},
               tag / "mp_rank_00_model_states.pt")
    torch.save({"w": w}, tag / "fp32_tp00_pp00.pt")
    (tag / "COMPLETE").write_text(json.dumps({"files": checkpoint._files(tag)}))
    assert torch.equal(checkpoint.load_full_state_dict(tag.parent, tag.name)["w"], w)
    kept = {f.name: f.read_bytes() for f in tag.iterdir()}
    real = checkpoint.load_pt
    # pruned after the first read (the client state: the module's read then fails) or the second
    # (the module's: the fp32 masters are gone and its bf16 copies were taken, silently)
    for reads in (1, 2):
        tag.mkdir(exist_ok=True)
        for name, data in kept.items():
            (tag / name).write_bytes(data)
        calls = []

        def pruned_after(path, *a, **k):
            out = real(path, *a, **k)
            calls.append(path)
            if len(calls) == reads:
                (tag / "COMPLETE").unlink()
                shutil.rmtree(tag)
            return out
        monkeypatch.setattr(checkpoint, "load_pt", pruned_after)
        with pytest.raises(ValueError) as e:
            checkpoint.load_full_state_dict(tag.parent, tag.name)
        assert str(e.value) == (f"checkpoint {tag} was deleted while it was read (a run's --keep_last deletes its "
                                "older checkpoints as it trains): name a checkpoint the run keeps, or let it finish "
                                "or raise its --keep_last")
    # gone before it was read: pruned where the run kept a newer tag, else not (a finished run's)
    with pytest.raises(ValueError) as e:
        checkpoint.load_full_state_dict(tag.parent, tag.name)
    assert str(e.value) == f"checkpoint {tag} does not exist: restore it"
    (tag.parent / "step00000008").mkdir()
    (tag.parent / "step00000008" / "COMPLETE").write_text("{}")
    with pytest.raises(ValueError, match=f"^checkpoint {tag} does not exist \\(a run's --keep_last deletes"):
        checkpoint.load_full_state_dict(tag.parent, tag.name)
    # a tag named (a sweep's depths read the one the first chose) older than every tag the run keeps:
    # pruned, perhaps, where the run records a --keep_last
    with pytest.raises(ValueError) as e:
        checkpoint_tag(tmp_path, "step00000004")
    assert str(e.value) == f"{tmp_path} has no complete checkpoint step00000004; it has step00000008"
    (tmp_path / "run.json").write_text(json.dumps({"train": {"keep_last": 1}}))
    with pytest.raises(ValueError) as e:
        checkpoint_tag(tmp_path, "step00000004")
    assert str(e.value) == (f"{tmp_path} has no complete checkpoint step00000004 (pruned by its --keep_last?); it "
                            "has step00000008")
    with pytest.raises(ValueError) as e:
        checkpoint_tag(tmp_path, "step00000012")
    assert str(e.value) == f"{tmp_path} has no complete checkpoint step00000012; it has step00000008"


def test_a_run_stopped_at_its_last_update_is_resumed_not_kept(tmp_path):
    """run_progress: a run whose newest checkpoint is its last update is 'done' only where its
    step returned (run.json's FINISHED at that tag): one stopped there before what follows the
    last update was written (fit-head's report and the source files it copies, an expanded
    Step 2's report) is 'resume', which sweep, extend and the demo run again (they kept it, and
    what it lacked was never written). A record from before FINISHED: the checkpoint alone."""
    ckpt = tmp_path / "checkpoints"
    assert run_progress(tmp_path, 4) == "new"
    (ckpt / "step00000004").mkdir(parents=True)
    (ckpt / "step00000004" / "COMPLETE").write_text("{}")
    for record, state in (({FINISHED: None}, "resume"), ({FINISHED: "step00000002"}, "resume"),
                          ({FINISHED: "step00000004"}, "done"), ({}, "done")):
        (tmp_path / "run.json").write_text(json.dumps(record))
        assert run_progress(tmp_path, 4) == state, record
    assert run_progress(tmp_path, 8) == "resume"


def test_a_resumed_run_is_not_finished_until_its_step_returns_again(tmp_path):
    """RunRecord.write: a new record starts with FINISHED None; a resumed one keeps every field
    but FINISHED, which goes back to None (a run finished before, resumed and stopped at its last
    update, was 'done'), also where it predates FINISHED."""
    def recorded(run_dir):  # the record alone (run.read_run needs a checkpoint)
        return json.loads((run_dir / "run.json").read_text())

    record = RunRecord(tmp_path, {"step": "pretrain"})
    record.write(False, vocab=8)
    assert recorded(tmp_path) == {"step": "pretrain", "vocab": 8, FINISHED: None}
    record.finish(**{FINISHED: "step00000004"})
    record.write(True, vocab=9)
    assert recorded(tmp_path) == {"step": "pretrain", "vocab": 8, FINISHED: None}
    (tmp_path / "run.json").write_text(json.dumps({"step": "pretrain"}))
    record.write(True)
    assert recorded(tmp_path) == {"step": "pretrain", FINISHED: None}


def test_the_updates_run_to_a_checkpoint_count_skipped_steps(tmp_path):
    """checkpoint.work_run: a checkpoint's position (updates applied and fp16 steps skipped),
    what a Step-2 artifact recovered from it counts its FLOPs from; one saved without a position
    (write_weights_only: an import), its step."""
    import torch

    from mmadapt import checkpoint

    (tmp_path / "step00000002").mkdir()
    torch.save({"step": 2, "position": 3, "module": {}}, tmp_path / "step00000002" / "mp_rank_00_model_states.pt")
    assert checkpoint.work_run(tmp_path / "step00000002")[0] == 3
    # the rows its heads projected: unknown (None) in one saved before the count, then as saved
    assert checkpoint.work_run(tmp_path / "step00000002") == (3, None)
    torch.save({"step": 2, "position": 3, "module": {}, checkpoint.SCORED_ROWS: 57},
               tmp_path / "step00000002" / "mp_rank_00_model_states.pt")
    assert checkpoint.work_run(tmp_path / "step00000002") == (3, 57)
    tag = checkpoint.write_weights_only(tmp_path, 5, {}, {})
    assert checkpoint.work_run(tmp_path / tag)[0] == 5


def test_a_staged_directory_of_a_killed_process_is_removed_by_the_next(tmp_path):
    """A process killed while it staged a directory (an import: a copy of the whole model) left
    `.<name>.tmp<pid>@<host>` beside it for good; the next staging of the same directory removes
    it where that process is gone from this host, and leaves a live one's and another host's."""
    import os
    import socket
    import subprocess

    from mmadapt.checkpoint import staged_dir

    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    stale, live, other = (tmp_path / f".import.tmp{gone.pid}@{host}", tmp_path / f".import.tmp{os.getppid()}@{host}",
                          tmp_path / f".import.tmp{gone.pid}@elsewhere")
    for d in (stale, live, other):
        d.mkdir()
        (d / "weights").write_text("x")
    with staged_dir(tmp_path / "import") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["import", live.name, other.name])


def test_a_stage_inside_a_stage_is_filled_in_place_and_a_kill_leaves_only_the_outer_one(tmp_path):
    """export_hf stages its directory and write_hf stages what it fills: the inner stage sat beside
    the outer one as `..<name>.tmp<pid>@<host>.tmp<pid>@<host>`, which no rerun's clean-up names,
    so an export killed while it saved the weights left a whole model there for good. Now the
    inner stage is the outer one: a kill leaves that alone, and the next staging removes it."""
    import subprocess
    import sys

    script = ("import os, sys; from pathlib import Path; from mmadapt.checkpoint import staged_dir\n"
              "with staged_dir(Path(sys.argv[1])) as top:\n"
              "    with staged_dir(top) as inner:\n"
              "        (inner / 'model.safetensors').write_text('weights')\n"
              "        os._exit(137)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "export")])
    assert done.returncode == 137
    assert [p.name.count(".tmp") for p in tmp_path.iterdir()] == [1]  # the outer stage alone
    from mmadapt.checkpoint import staged_dir

    with staged_dir(tmp_path / "export") as top:
        with staged_dir(top) as inner:
            assert inner == top
            (inner / "config.json").write_text("{}")
        assert sorted(p.name for p in tmp_path.iterdir()) == [top.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json"]


def test_a_stops_artifact_is_no_curve_point_of_a_continued_run(tmp_path, capsys):
    """An adapt run given for all its artifacts (evaluate --embeddings <run>, the plug-in metric,
    a sweep): the artifact of an update it was stopped at (meta.json's off_schedule) is left out
    once the run went on past it, a point no other run of its schedule has, said on stderr; a run
    stopped and not continued keeps it (its newest state); named by its directory, it is scored."""
    import json

    from mmadapt.artifact import ARTIFACT_FILE, artifact_dirs

    def run(name, steps, off):
        emb = tmp_path / name / "embeddings"
        for step in steps:
            (emb / f"step{step:08d}").mkdir(parents=True)
            (emb / f"step{step:08d}" / ARTIFACT_FILE).write_bytes(b"x")
            meta = {"step": step, **({"off_schedule": True} if step in off else {})}
            (emb / f"step{step:08d}" / "meta.json").write_text(json.dumps(meta))
        return emb

    went_on, stopped = run("went_on", (0, 4, 6, 8), {0, 6}), run("stopped", (0, 4, 6), {6})  # 0: the start
    assert artifact_dirs([tmp_path / "went_on"]) == [went_on / f"step{s:08d}" for s in (0, 4, 8)]
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'went_on'}: step00000006 left out, saved where the run was stopped" in err, err
    assert artifact_dirs([tmp_path / "stopped"]) == [stopped / f"step{s:08d}" for s in (0, 4, 6)]
    assert artifact_dirs([went_on / "step00000006"]) == [went_on / "step00000006"]
    assert capsys.readouterr().err == ""
