"""faults.py and the training loop's fault handling, in one process (the multi-process fault
injection is in test_resume.py): the run lock, DeepSpeed's stale extension lock, stop requests,
skipped optimizer steps and non-finite losses."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmadapt import engine as engine_module, faults
from mmadapt.config import TrainConfig
from mmadapt.engine import LoopJob, train_loop
from mmadapt.parallel import init_parallel


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, capsys):
    with faults.RunLock(tmp_path):
        held = json.loads((tmp_path / "run.lock").read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(ValueError, match=f"is being written by process {os.getpid()} on "):
            faults.RunLock(tmp_path).acquire()
    assert not (tmp_path / "run.lock").exists()
    dead = _dead_pid()
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "since": "x"}))
    with faults.RunLock(tmp_path):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert f"its holder (pid {dead}) is no longer running" in capsys.readouterr().err
    # Another host's lock cannot be checked from here: refused, naming the holder.
    (tmp_path / "run.lock").write_text(json.dumps({"host": "gpu42", "pid": dead, "since": "x"}))
    with pytest.raises(ValueError, match=f"process {dead} on gpu42 .*delete .*run.lock"):
        faults.RunLock(tmp_path).acquire()


def test_a_lock_whose_write_failed_is_removed_and_an_empty_one_named_as_such(tmp_path, monkeypatch):
    """A full disk failed the lock's write after its exclusive create: the empty lock it left
    refused every later start as 'process ? on ?' (a requeued job too), holder unknown."""
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(faults.json, "dump", full)
        with pytest.raises(OSError, match="No space left on device"):
            faults.RunLock(tmp_path).acquire()
    assert not (tmp_path / "run.lock").exists()
    (tmp_path / "run.lock").write_text("")  # one left all the same (a node lost mid-write)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'run.lock'} names no holder (empty or unreadable: a "
                                                   f"start whose write of it failed?): if no process is writing "
                                                   f"{tmp_path}, delete {tmp_path / 'run.lock'}")):
        faults.RunLock(tmp_path).acquire()


def test_a_dead_holders_lock_is_taken_over_under_the_takeover_mutex(tmp_path):
    """Two starters that find the same dead holder: the one that holds the takeover mutex removes
    the lock; the other removes nothing (before, it could remove the lock the first had just
    made, and both wrote the run) and is refused; a mutex left by a taker that died goes."""
    dead, lock, mutex = _dead_pid(), tmp_path / "run.lock", tmp_path / "run.lock.takeover"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "since": "x"}))
    mutex.mkdir()  # another starter is taking it over at this moment
    with pytest.raises(ValueError, match="another process took it at the same time"):
        faults.RunLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["pid"] == dead and mutex.is_dir()
    os.utime(mutex, (time.time() - 120, time.time() - 120))  # that starter died mid-takeover
    with faults.RunLock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not mutex.exists()


def test_a_requeued_slurm_job_takes_over_its_earlier_instances_lock(tmp_path, monkeypatch, capsys):
    """A lock held on another host by an earlier instance of this SLURM job (a lost node; the job
    requeued, SLURM_RESTART_COUNT one higher) is taken over; one held by this very instance, or
    by another job, is refused as any other host's."""
    lock = tmp_path / "run.lock"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock.write_text(json.dumps({"host": "gpu42", "pid": 7, "since": "x", "slurm": ["4242", 0]}))
    with faults.RunLock(tmp_path):
        assert json.loads(lock.read_text())["slurm"] == ["4242", 1]
    assert "its holder was SLURM job 4242 before it was requeued" in capsys.readouterr().err
    for other in (["4242", 1], ["99", 0]):
        lock.write_text(json.dumps({"host": "gpu42", "pid": 7, "since": "x", "slurm": other}))
        with pytest.raises(ValueError, match="process 7 on gpu42"):
            faults.RunLock(tmp_path).acquire()


def test_stale_extension_lock_is_removed_and_a_live_one_is_waited_for(tmp_path, capsys):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    os.utime(lock.parent, (old, old))
    assert faults.clear_stale_extension_lock(lock, stale_after_s=30) is not None
    assert not lock.exists() and "removed a stale lock" in capsys.readouterr().err
    # Held open by a live builder (torch's FileBaton keeps its descriptor): waited for, with a message.
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; fd = os.open({str(lock)!r}, "
                               "os.O_CREAT | os.O_EXCL); print('ok', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        os.utime(lock, (old, old))
        assert faults.clear_stale_extension_lock(lock, stale_after_s=30, poll_s=0.1, give_up_s=0.5) == "waiting"
        assert lock.exists()
        assert f"being built by process {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert faults.clear_stale_extension_lock(tmp_path / "none" / "lock") is None


def test_a_lock_held_for_a_moment_is_waited_for_only_that_moment(tmp_path, capsys, monkeypatch):
    """Every rank's load of DeepSpeed's extension takes the lock while ninja checks the build: a
    rank that finds a peer checking goes on when the lock goes (torch's 0.1 s spin), not after a
    5 s poll, which made a two-rank job with a 4 s rendezvous timeout fail in CI; and says nothing.
    The lock is released at the third wait of a fake clock: every wait is a spin."""
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    clock, waits = [100.0], []

    def sleep(seconds):
        waits.append(seconds)
        clock[0] += seconds
        if len(waits) == 3:
            lock.unlink()  # the peer's check ends

    monkeypatch.setattr(faults.time, "sleep", sleep)
    monkeypatch.setattr(faults.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(faults, "_open_by", lambda path: [4321])  # a live holder: not stale
    assert faults.clear_stale_extension_lock(lock) == "released"  # poll_s 5 s, as init_distributed calls it
    assert waits == [0.1, 0.1, 0.1]
    assert not lock.exists() and capsys.readouterr().err == ""


def test_a_stop_request_older_than_the_process_is_cleared_and_a_newer_one_kept(tmp_path, monkeypatch):
    """The previous job's STOP (older than this process) goes; one made since (SLURM's warning
    while this requeued job started) stays, for the loop to honour."""
    import psutil

    stop = tmp_path / "STOP"
    stop.touch()
    born = psutil.Process().create_time()
    os.utime(stop, (born - 60, born - 60))
    faults.clear_stale_stop(stop)
    assert not stop.exists()
    stop.touch()  # now: after this process started
    faults.clear_stale_stop(stop)
    assert stop.exists()
    faults.clear_stale_stop(tmp_path / "none")  # no request: nothing to do
    # under SLURM, one made after the job's current run began, before this process: kept
    os.utime(stop, (born - 30, born - 30))
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(born - 60)))
    faults.clear_stale_stop(stop)
    assert stop.exists()


def test_stop_request_from_a_signal_or_the_stop_file(tmp_path, capsys):
    with faults.StopRequest(tmp_path / "STOP") as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.reason == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing it on: no change, no exit
        assert stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: out at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with faults.StopRequest(tmp_path / "STOP") as stop:
        (tmp_path / "STOP").touch()
        deadline = time.time() + 10
        while stop.reason is None and time.time() < deadline:
            time.sleep(0.05)
        assert stop.reason == str(tmp_path / "STOP")
    assert "finishing this update" in capsys.readouterr().err


def test_a_run_started_with_sigint_ignored_keeps_ignoring_it(tmp_path):
    """A background job of a shell script starts with SIGINT ignored (the script's Ctrl-C is not
    for it): the training loop's stop request caught it all the same, and the run stopped (75).
    SIGTERM still stops it; SIGINT stays ignored, inside and after."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with faults.StopRequest(tmp_path / "STOP") as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert stop.reason is None
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert stop.reason == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, old)


AFTER_STOP = """
import os, signal, sys, time
from mmadapt import faults
from mmadapt.cli import run_process

def command():
    with faults.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        raise faults.Stopped(8, "step00000008", stop.reason)

def stopped():  # the command's end, its checkpoint complete, then a second signal in the teardown
    try:
        command()
    except faults.Stopped:
        pass
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(0.2)
    print("tore down", flush=True)
    return faults.EXIT_STOPPED

code = run_process(stopped)
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the process's own handlers back at the end
sys.exit(code)
"""


@pytest.mark.parametrize("second, code, said", [("SIGTERM", faults.EXIT_STOPPED, "tore down"),
                                                ("SIGINT", faults.EXIT_INTERRUPTED, "interrupted")])
def test_a_second_signal_after_a_stops_checkpoint_ends_nothing_half_way(second, code, said):
    """A stop's checkpoint is complete and the process tears down (cli.run_process): another
    SIGTERM (a launcher passing it on, a repeated scancel) changes nothing, the exit stays 75 for
    the SLURM templates to requeue (it died with 143); a second Ctrl-C ends the process at once in
    one line (it raised inside the teardown: a traceback)."""
    proc = subprocess.run([sys.executable, "-c", AFTER_STOP, second], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert said in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


class FakeEngine:
    """What train_loop asks of DeepSpeed's engine, for updates that are applied or skipped."""
    device = torch.device("cpu")

    def __init__(self):
        self.applied = True

    def was_step_applied(self) -> bool:
        return self.applied

    def get_lr(self):
        return [0.1]

    def save_checkpoint(self, ckpt_dir, tag, client_state, **kw):
        os.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
        with open(os.path.join(ckpt_dir, tag, "client.json"), "w") as f:
            json.dump(client_state, f)

    def bfloat16_enabled(self):
        return False

    fp16_enabled = bfloat16_enabled


def _loop(tmp_path, engine, step_fn, total=10**6, **loop):
    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False)
    cfg = TrainConfig(**{"log_interval": 1, "save_interval": 10**6, **loop})
    return train_loop(engine, step_fn, job, cfg, total, run_dir=tmp_path, resume=False)


def test_consecutive_skipped_steps_are_a_divergence(tmp_path):
    engine, positions = FakeEngine(), []

    def step(position):
        positions.append(position)
        engine.applied = position < 3  # three updates, then every step overflows
        return torch.tensor([2.0])

    with pytest.raises(faults.Diverged, match="5 optimizer steps in a row were skipped .*after update 3"):
        _loop(tmp_path, engine, step, max_skipped_steps=4)
    assert positions == list(range(8))  # skipped steps consume data
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_the_progress_line_shows_a_loss_beside_its_own_update(tmp_path, capsys):
    """Each loss the bar shows stands beside the count of the update it is of: set_postfix refreshed
    the line before the bar counted the update (0/3 loss=<update 1's>)."""
    losses = iter([5.0, 4.0, 3.0])
    _loop(tmp_path, FakeEngine(), lambda position: torch.tensor([next(losses)]), total=3)
    shown = re.findall(r"(\d)/3 .*?loss=(\d\.\d+)", capsys.readouterr().err.replace("\r", "\n"))
    assert shown and all(float(loss) == 6.0 - int(count) for count, loss in shown), shown


def test_a_sigterm_after_the_last_checkpoint_stops_through_a_broad_except(tmp_path, monkeypatch):
    """stopped_after_checkpoint raises Stopped from the SIGTERM handler inside whatever code runs:
    inside checkpoint.load_pt (an extension's summary reading an artifact), whose `except
    Exception` turned it into 'cannot be read ... it is truncated or not a PyTorch file; restore
    or recreate it', exit 2, about an intact file. A BaseException, as Ctrl-C's, it goes through;
    and the handler before the block is back after it."""
    from conftest import sigterm_before
    from mmadapt import checkpoint

    torch.save({"w": torch.zeros(1)}, tmp_path / "embeddings.pt")
    monkeypatch.setattr(checkpoint.torch, "load", sigterm_before(torch.load))  # it lands while torch reads the file
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(faults.Stopped, match="stopped by SIGTERM at update 4: checkpoint step00000004 is complete"):
        with faults.stopped_after_checkpoint(4, "step00000004"):
            checkpoint.load_pt(tmp_path / "embeddings.pt", "Step-2 artifact file")
    assert signal.getsignal(signal.SIGTERM) is before


def test_steps_skipped_before_a_stop_still_count_after_its_resume(tmp_path, monkeypatch):
    """A stop after two skipped fp16 steps saves at the update before them, their batches
    consumed; the resumed run counts them: its third skip in a row is the fifth, a divergence
    at max_skipped_steps 4, as in one run."""
    engine, positions = FakeEngine(), []

    def step(position):
        positions.append(position)
        engine.applied = position < 2
        if position == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the stop request arrives during update 3's second skip
        return torch.tensor([1.0])

    with pytest.raises(faults.Stopped):
        _loop(tmp_path, engine, step, max_skipped_steps=4)
    saved = json.loads((tmp_path / "checkpoints" / "step00000002" / "client.json").read_text())
    assert (saved["step"], saved["position"], saved["skipped_in_a_row"]) == (2, 4, 2)
    monkeypatch.setattr(engine_module.checkpoint, "resume", lambda engine, ckpt_dir, strict: saved)
    positions.clear()
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False)
    with pytest.raises(faults.Diverged, match="5 optimizer steps in a row were skipped .*after update 2"):
        train_loop(engine, step, job, TrainConfig(log_interval=1, save_interval=10**6, max_skipped_steps=4), 10**6,
                   run_dir=tmp_path, resume=True)
    assert positions == [4, 5, 6]


def test_skipped_steps_do_not_count_as_updates(tmp_path):
    engine = FakeEngine()
    losses = {0: 1.0, 1: 100.0, 2: 2.0, 3: 100.0, 4: 100.0, 5: 3.0}

    def step(position):
        engine.applied = losses[position] < 100  # 1, 3, 4 overflow
        return torch.tensor([losses[position]])

    rows = _loop(tmp_path, engine, step, total=3, log_interval=2)
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 1.5), (3, 3.0)]  # means over applied updates only
    saved = json.loads((tmp_path / "checkpoints" / "step00000003" / "client.json").read_text())
    assert (saved["step"], saved["position"]) == (3, 6)  # three updates, six batches consumed


def test_skipped_steps_count_in_the_time_and_the_compute_of_a_checkpoint(tmp_path, monkeypatch):
    """An fp16 step skipped on an overflow ran its forward and backward: the log's seconds per
    update (what throughput and FLOP/s divide by) count it, and after_save is given the updates
    run (Step 2's artifact counts its FLOPs and tokens from them). Each update takes a second
    here, applied or not: the rate read 1.5 s (2 updates, 3 seconds) where the device ran 1 s
    per update."""
    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    engine, saved = FakeEngine(), []

    def step(position):
        clock[0] += 1.0
        engine.applied = position not in (1, 4)
        return torch.tensor([1.0])

    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False,
                  perf=lambda dt, rows: {"sec_per_update": dt},
                  after_save=lambda done, tag, run, rows, scheduled: saved.append((done, tag, run)))
    rows = train_loop(engine, step, job, TrainConfig(log_interval=2, save_interval=2), 4, run_dir=tmp_path,
                      resume=False)
    assert [(r["step"], r["sec_per_update"]) for r in rows] == [(2, 1.0), (4, 1.0)]
    assert saved == [(2, "step00000002", 3), (4, "step00000004", 6)]


def test_a_stops_checkpoint_is_said_to_be_off_the_schedule(tmp_path):
    """after_save learns which checkpoint a stop saved (Step 2 marks its artifact off_schedule:
    a sweep's curve takes the schedule's points alone); the schedule's own are scheduled."""
    saved = []

    def step(position):
        if position == 6:  # during update 7: the loop stops after it
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.tensor([1.0])

    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False,
                  after_save=lambda done, tag, run, rows, scheduled: saved.append((done, scheduled)))
    with pytest.raises(faults.Stopped, match="at update 7"):
        train_loop(FakeEngine(), step, job, TrainConfig(log_interval=1, save_interval=5), 20, run_dir=tmp_path,
                   resume=False)
    assert saved == [(5, True), (7, False)]
    # A stop while every update so far was skipped (fp16 overflows from the first loss scale): its
    # checkpoint is update 0's, on the schedule; marked off it, a Step-2 run's start artifact was
    # left out of every curve once the run went on (artifact_dirs)
    engine, saved[:] = FakeEngine(), []
    (tmp_path / "b").mkdir()

    def skipped(position):
        engine.applied = False
        os.kill(os.getpid(), signal.SIGTERM)
        return torch.tensor([1.0])
    with pytest.raises(faults.Stopped, match="at update 0"):
        train_loop(engine, skipped, job, TrainConfig(log_interval=1, save_interval=5), 20, run_dir=tmp_path / "b",
                   resume=False)
    assert saved == [(0, True)]
    # An --exit_interval pause is off the schedule too (a flag a resume may change: a curve of the
    # same training held a point where one job of it paused); a pause on the schedule is on it
    saved[:] = []
    (tmp_path / "c").mkdir(), (tmp_path / "d").mkdir()
    with pytest.raises(faults.Paused):
        train_loop(FakeEngine(), lambda position: torch.tensor([1.0]), job,
                   TrainConfig(log_interval=1, save_interval=5, exit_interval=7), 20, run_dir=tmp_path / "c",
                   resume=False)
    assert saved == [(5, True), (7, False)]
    saved[:] = []
    with pytest.raises(faults.Paused):
        train_loop(FakeEngine(), lambda position: torch.tensor([1.0]), job,
                   TrainConfig(log_interval=1, save_interval=5, exit_interval=10), 20, run_dir=tmp_path / "d",
                   resume=False)
    assert saved == [(5, True), (10, True)]


def test_the_rows_projected_are_counted_through_skips_and_resumes(tmp_path, monkeypatch):
    """LoopJob.scored_rows: the rows the heads projected (here 10 + position in each update's
    batches, a skipped fp16 step's too) reach perf per update of each log window and after_save
    summed since update 0, kept in the checkpoint for a resume; a run resumed from a checkpoint
    written before the count passes None (its artifacts then count p of every position)."""
    engine, counted, saved, rates = FakeEngine(), [0], [], []

    def step(position):
        counted[0] += 10 + position
        engine.applied = position != 1
        return torch.tensor([1.0])

    def run(run_dir, total, resume):
        job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False,
                      perf=lambda dt, rows: rates.append(rows) or {}, scored_rows=lambda: counted[0],
                      after_save=lambda done, tag, run, rows, scheduled: saved.append((done, run, rows)))
        train_loop(engine, step, job, TrainConfig(log_interval=2, save_interval=2), total, run_dir=run_dir,
                   resume=resume)

    init_parallel(1, 1)
    run(tmp_path, 2, False)  # positions 0, 1 (skipped), 2: 10 + 11 + 12 rows in 3 timed updates
    assert (rates, saved) == ([11.0], [(2, 3, 33)])
    state = json.loads((tmp_path / "checkpoints" / "step00000002" / "client.json").read_text())
    assert state["scored_rows"] == 33
    (tmp_path / "legacy").mkdir()
    for run_dir, resumed_from, total in ((tmp_path, state, 60), (tmp_path / "legacy", {
            k: v for k, v in state.items() if k != "scored_rows"}, None)):
        monkeypatch.setattr(engine_module.checkpoint, "resume", lambda engine, ckpt_dir, strict: resumed_from)
        counted[0], rates[:], saved[:] = 0, [], []  # a new process: positions 3 and 4, 13 + 14 rows
        run(run_dir, 4, True)
        assert (rates, saved) == ([None if total is None else 13.5], [(4, 5, total)])


@pytest.mark.parametrize("fold", [None, 2])
def test_a_non_finite_loss_is_named_by_its_update(tmp_path, monkeypatch, fold):
    """The first non-finite update is named, also where the updates kept unchecked are folded on
    the device in between (engine.Unchecked: every 2 here; updates 4-5 and 6 apart)."""
    if fold is not None:
        monkeypatch.setattr(engine_module.Unchecked, "FOLD", fold)
    engine = FakeEngine()

    def step(position):
        return torch.tensor({4: [float("nan")], 5: [float("inf")]}.get(position, [1.0]))

    with pytest.raises(faults.Diverged, match=r"the loss \(or its gradient\) is not finite at update 5 "):
        _loop(tmp_path, engine, step, log_interval=3)
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3]


def test_an_update_between_log_lines_dispatches_one_operator_of_its_own(tmp_path):
    """train_loop's own work on the device per update, between log lines: the running loss sum
    and nothing else (the finite check waits for the next read: engine.Unchecked)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dispatched, at_call = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                dispatched.append(func.__name__)
            return func(*args, **(kwargs or {}))

    losses = [torch.tensor([float(i)]) for i in range(8)]  # made before: the step dispatches nothing

    def step(position):
        at_call.append(len(dispatched))
        return losses[position]

    with Count():
        _loop(tmp_path, FakeEngine(), step, total=8, log_interval=100)
    assert [b - a for a, b in zip(at_call[1:], at_call[2:])] == [1] * 6, dispatched


def test_divergence_names_the_last_good_checkpoint_or_says_there_is_none(tmp_path):
    def nan_at(n):
        return lambda position: torch.tensor([float("nan") if position == n else 1.0])

    for d in ("none", "some"):
        (tmp_path / d).mkdir()
    with pytest.raises(faults.Diverged, match=r"No checkpoint was saved before it: lower --lr, .* and run the "
                                              r"command again \(without --resume\)"):
        _loop(tmp_path / "none", FakeEngine(), nan_at(2))
    with pytest.raises(faults.Diverged, match=r"Checkpoint step00000004 in .*checkpoints is the last good one, but "
                                              r"--resume would repeat this exactly: lower --lr, .* in a new --output_dir"):
        _loop(tmp_path / "some", FakeEngine(), nan_at(5), save_interval=2)


def test_exit_interval_pauses_with_its_own_exception_and_a_finished_run_does_not(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with pytest.raises(faults.Paused) as paused:
        _loop(tmp_path / "a", FakeEngine(), lambda position: torch.tensor([1.0]), total=10, exit_interval=4)
    assert (paused.value.step, paused.value.total, paused.value.tag) == (4, 10, "step00000004")
    assert str(paused.value) == ("paused at update 4 of 10 (--exit_interval): checkpoint step00000004 is complete; "
                                 "run the same command with --resume to go on")
    assert (tmp_path / "a" / "checkpoints" / "step00000004" / "COMPLETE").is_file()
    # The last update falling on a multiple of the interval is a finished run.
    rows = _loop(tmp_path / "b", FakeEngine(), lambda position: torch.tensor([1.0]), total=8, exit_interval=8)
    assert rows[-1]["step"] == 8 and faults.EXIT_PAUSED == 76


def test_a_step_that_resumes_by_itself_says_call_it_again_from_python_too(tmp_path):
    """extend() and steps.sweep() from Python, stopped or paused inside: the exception said
    'run the same command with --resume', which neither has."""
    from mmadapt import demo, extend, steps

    for raised, said in ((faults.Stopped(3, "step00000003", "SIGINT"), "run the same command again to continue"),
                         (faults.Paused(2, 4, "step00000002"), "run the same command again to go on")):
        def step(*a, **kw):
            raise raised
        with pytest.raises(type(raised)) as e:
            faults.resumes_itself(step)()
        assert str(e.value).endswith(said) and "--resume" not in str(e.value)
    assert all(getattr(f, "__wrapped__", None) for f in (extend.extend, steps.sweep, demo.Demo.run))
    # a divergence: its advice was a run's ('run the command again (without --resume)' after lowering
    # --lr, which the same extension refuses as another; warm-up and clipping flags extend lacks)
    situation = "adapt: the loss (or its gradient) is not finite at update 2 (of 8); stopped without saving it."

    for last_good, said in ((None, "No checkpoint was saved before it"),
                            (("step00000001", "x/2/checkpoints"), "Checkpoint step00000001 in x/2/checkpoints is the "
                                                                   "last good one, but the same command would repeat "
                                                                   "this")):
        def diverging():
            raise faults.Diverged(f"{situation} (a run's advice)", situation, last_good)
        with pytest.raises(faults.Diverged) as e:
            faults.resumes_itself(diverging)()
        assert str(e.value) == f"{situation} {said}: lower --lr and run the command into a new --output_dir"
        assert e.traceback[-1].name == "diverging"  # raised where it happened (MMADAPT_DEBUG=1 shows it)
    # the demo's, by the step that diverged (the training loop's Diverged.step, LoopJob's): Steps 1
    # and 3 have learning-rate flags of their own, Steps 1b and 2 none (it said to lower
    # --pretrain_lr or --finetune_lr, which change neither)
    for step, task, advice in (
            ("pretrain", None, "lower --pretrain_lr and run the command into a new --output_dir"),
            ("finetune", "bible-genre", "lower --finetune_lr and run the command into a new --output_dir"),
            ("minipost", None, "Steps 1b and 2 of the demo run at the model family preset's learning "
             "rate, which no demo flag changes: this is mmadapt's to fix"),
            ("adapt", None, "Steps 1b and 2 of the demo run at the model family preset's learning rate")):
        run_dir = tmp_path / f"{step}_run"
        run_dir.mkdir()
        init_parallel(1, 1)
        job = LoopJob(step=step, task=task, names={}, client_state={}, exclude_frozen=False)

        def diverging_demo():
            train_loop(FakeEngine(), lambda position: torch.tensor([float("nan")]), job,
                       TrainConfig(log_interval=1, save_interval=10**6), 8, run_dir, resume=False)
        with pytest.raises(faults.Diverged) as e:
            faults.resumes_itself(fix=demo._divergence_advice)(diverging_demo)()
        assert e.value.step == step
        assert str(e.value).startswith(f"{job.label}: the loss (or its gradient) is not finite at update 1 (of 8); "
                                       f"stopped without saving it. No checkpoint was saved before it: {advice}")


def test_a_command_that_resumes_by_itself_says_run_it_again(monkeypatch, tmp_path, capsys):
    """A pause, a stop or a damaged run under sweep, extend or demo (no --resume: the same command
    again goes on) said "run the same command with --resume" or "resume", which they refuse as an
    unrecognized argument."""
    from mmadapt import checkpoint, cli, extend, steps
    from mmadapt.config import TrainConfig

    monkeypatch.setattr(cli, "_schedule", lambda *a: TrainConfig())
    # (Extend's checks of --model: no model here)
    monkeypatch.setattr(extend, "Extend", type("Unchecked", (extend.Extend,), {"__post_init__": lambda self: None}))
    for raised, code, line in ((faults.Paused(2, 4, "step00000002"), faults.EXIT_PAUSED,
                                "paused at update 2 of 4 (--exit_interval): checkpoint step00000002 is complete; "
                                "run the same command again to go on"),
                               (faults.Stopped(3, "step00000003", "SIGTERM"), faults.EXIT_STOPPED,
                                "stopped by SIGTERM at update 3: checkpoint step00000003 is complete; run the same "
                                "command again to continue"),
                               # a run it goes on with whose every checkpoint is damaged (start_run)
                               (checkpoint.DamagedRun("every complete checkpoint in X is damaged (why)"),
                                faults.EXIT_USER, "error: every complete checkpoint in X is damaged (why): restore "
                                "its files and run the same command again, or start a new --output_dir")):
        monkeypatch.setattr(steps, "sweep", lambda run, step: (_ for _ in ()).throw(raised))
        monkeypatch.setattr(extend, "extend", lambda ext, tiny=False: (_ for _ in ()).throw(raised))
        monkeypatch.setattr(cli, "demo_command", lambda argv: (_ for _ in ()).throw(raised))
        for argv in (["sweep", "--source", str(tmp_path / "src"), "--lang", "de", "--output_dir", str(tmp_path / "o")],
                     ["extend", "--model", str(tmp_path / "model"), "--lang", "de", "--corpus", "bible:de",
                      "--output_dir", str(tmp_path / "o")],
                     ["demo"]):
            assert cli.main(argv) == code
            assert capsys.readouterr().err.strip() == line
        assert cli.user_errors(lambda argv=None: (_ for _ in ()).throw(raised))() == code  # a step's command
        assert capsys.readouterr().err.strip() == line.replace("command again", "command with --resume").replace(
            "restore its files and run the same command with --resume", "restore its files and resume").replace(
            "error: every", "error: --resume: every")


_ORPHAN_SCRIPT = '''
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from mmadapt import demo, faults

class Sleeper:
    """A demo job that trains nothing: it waits, as a training loop does, for a stop request,
    and stops as one does (faults.Stopped)."""
    def nap(self, path):
        with faults.StopRequest() as stop:
            open(path, "w").write(str(os.getpid()))
            while stop.reason is None:
                time.sleep(0.05)
            # written while the request holds SIGTERM: the kernel sends the parent-death signal
            # again as each thread of the killed demo exits, and one after the block (SIGTERM's
            # default action again) could kill this worker between creating the file and writing it
            open(path + ".stopped", "w").write(stop.reason)
        raise faults.Stopped(0, "step00000000", stop.reason)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(1, mp_context=context, initializer=demo._worker_init,
                               initargs=(1, os.getpid(), context.Event()))
    for path in (sys.argv[1], sys.argv[1] + "-next"):  # the second waits in the pool's queue
        pool.submit(demo._run_job, Sleeper(), demo.Job("nap", "nap", (path,), 1, path + ".log"))
    time.sleep(600)
'''


def test_a_demo_worker_stops_and_exits_when_the_demo_is_killed(tmp_path):
    """`mmadapt demo` trains its runs in worker processes: killed alone (SIGKILL: nothing of it
    runs after), it leaves no worker training for no one. The worker's run gets SIGTERM as from
    a launcher (a graceful stop: StopRequest says so), and the worker then exits, not taking the
    next job the pool had queued for it."""
    import psutil

    script, mark = tmp_path / "orphan.py", tmp_path / "worker"
    script.write_text(_ORPHAN_SCRIPT)
    demo = subprocess.Popen([sys.executable, str(script), str(mark)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 120
        while not (mark.is_file() and mark.read_text()) and time.monotonic() < deadline:
            assert demo.poll() is None, "the stand-in demo exited before its worker started"
            time.sleep(0.1)
        worker = psutil.Process(int(mark.read_text()))
        demo.kill()
        demo.wait()
        deadline = time.monotonic() + 30
        while not faults._gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert faults._gone(worker), "the worker outlived the demo by 30 s"
        assert (tmp_path / "worker.stopped").read_text() == "SIGTERM"
        assert not (tmp_path / "worker-next").exists(), "the orphaned worker started the next queued job"
    finally:  # nothing left running, whatever failed
        demo.kill()
        if mark.is_file() and mark.read_text():
            try:
                psutil.Process(int(mark.read_text())).kill()
            except psutil.Error:
                pass


def test_the_exceptions_a_demo_worker_raises_pickle_with_their_fields():
    """A demo worker's run sends its exception to the demo's process by pickle. An exception whose
    __init__ takes other arguments than its message did not unpickle there (TypeError), which broke
    the pool: it sent SIGTERM to every other worker and its shutdown could hang
    (ChangedRun, a refused run of a moved demo directory, was reported as a killed worker, exit 1;
    DamagedRun came back with its line wrapped twice). Every exception of mmadapt's with an
    __init__ of its own is among them."""
    import importlib
    import inspect
    import pickle
    import pkgutil

    import mmadapt
    from mmadapt.checkpoint import DamagedRun
    from mmadapt.data import NothingHeldOut
    from mmadapt.run import ChangedRun

    raised = (faults.Stopped(3, "step00000003", "SIGTERM"), faults.Paused(2, 10, "step00000002"),
              NothingHeldOut("none held out", 4), ChangedRun("lr is 1 here but 2 there", "resume with the run's"),
              DamagedRun("every complete checkpoint in X is damaged (why)"),
              faults.Diverged("adapt: not finite at update 2. Checkpoint s1 in x is the last good one: ...",
                              "adapt: not finite at update 2.", ("s1", "x"), "adapt"))
    for e in raised:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and vars(back) == vars(e)
    own = {c for m in pkgutil.walk_packages(mmadapt.__path__, "mmadapt.") if not m.name.endswith("__main__")
           for _, c in inspect.getmembers(importlib.import_module(m.name), inspect.isclass)
           if issubclass(c, BaseException) and c.__module__.startswith("mmadapt") and "__init__" in vars(c)}
    assert own == {type(e) for e in raised}, own


def test_ctrl_c_while_the_command_imports_is_one_line(monkeypatch, capsys):
    """The `mmadapt` command's entry (mmadapt.__main__): a Ctrl-C in the seconds mmadapt.cli
    imports torch, DeepSpeed and megatron-core says "interrupted" and exits 130, as one after
    them does, not their import traceback (the command spawned and interrupted at once printed
    61 lines through megatron.core's import)."""
    import importlib.abc

    from mmadapt import __main__ as entry

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mmadapt.cli":
                raise KeyboardInterrupt
    monkeypatch.delitem(sys.modules, "mmadapt.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert entry.main() == faults.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"
    # ... and every launch/ script's (deepspeed launch/*.py: each rank printed the traceback)
    import runpy

    from conftest import REPO

    for script in sorted((REPO / "launch").glob("*.py")):
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(script), run_name="__main__")
        assert e.value.code == 130 and capsys.readouterr().err == "interrupted\n", script


def _entry_with_a_stand_in_cli(tmp_path, import_body: str, ignore_sigint: bool = False):
    """faults.entry() in a process of its own whose `mmadapt.cli` is a stand-in: a module whose
    import runs `import_body` (indented code that sets module.run_process), where torch's import
    would be. -> the finished process."""
    from conftest import REPO, child_env

    script = tmp_path / "entry.py"
    script.write_text(
        "import importlib.abc, importlib.util, os, signal, sys, time\n"
        + ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if ignore_sigint else "") +
        "class Cli(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        return importlib.util.spec_from_loader(name, self) if name == 'mmadapt.cli' else None\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        + import_body +
        "        module.main = None\n"
        "sys.meta_path.insert(0, Cli())\n"
        "from mmadapt import faults\n"
        "sys.exit(faults.entry())\n")
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=child_env())


def test_ctrl_c_that_an_import_swallows_still_interrupts(tmp_path, monkeypatch):
    """A Ctrl-C while torch loads numpy's extension was swallowed inside it (the command then ran
    to its end: `launch/pretrain.py` would train), or broke numpy's import, or aborted the process:
    a KeyboardInterrupt raised in C code. While entry imports, SIGINT's handler raises nothing: it
    leaves with "interrupted", 130. Here an import that swallows its KeyboardInterrupt stands in."""
    proc = _entry_with_a_stand_in_cli(tmp_path, (
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(2)\n"
        "        except KeyboardInterrupt:  # what an extension's C initialisation does with it\n"
        "            pass\n"
        "        module.run_process = lambda main: print('ran the command') or 0\n"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "interrupted\n")
    # and the command runs under the SIGINT handler entry found (its Ctrl-C is cli.user_errors')
    from mmadapt import cli

    seen, before = [], signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "run_process", lambda main: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    assert faults.entry() == 0 and seen == [before] and signal.getsignal(signal.SIGINT) is before


def test_a_process_that_ignores_sigint_still_ignores_it_while_the_command_imports(tmp_path):
    """A background job of a shell script starts with SIGINT ignored: entry's handler for the
    import made a Ctrl-C there exit 130, where the process ignored it before."""
    proc = _entry_with_a_stand_in_cli(tmp_path, (
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        ignored = lambda: signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "        module.run_process = lambda main: print('ran', ignored()) or 0\n"), ignore_sigint=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ran True\n", "")


def test_interrupted_when_interrupts_inside_its_block_alone():
    """faults.interrupted_when: the event set while the block runs raises KeyboardInterrupt there
    (a sleep is cut short); once the block is left, the event set later raises nothing; SIGINT's
    handler is restored either way."""
    import threading

    before = signal.getsignal(signal.SIGINT)
    stop, t0 = threading.Event(), time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with faults.interrupted_when(stop, poll=0.01):
            stop.set()
            time.sleep(30)
    assert time.monotonic() - t0 < 10 and signal.getsignal(signal.SIGINT) is before
    later = threading.Event()
    with faults.interrupted_when(later, poll=0.01):
        pass
    later.set()
    time.sleep(0.1)  # a watcher left running would interrupt this
    assert signal.getsignal(signal.SIGINT) is before
    # a demo worker of a demo started with SIGINT ignored (a background job: its workers inherit
    # that): a SIGINT from outside changes nothing (it raised, and stopped the demo); the event still
    # interrupts the block
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop, t0, survived = threading.Event(), time.monotonic(), False
        with pytest.raises(KeyboardInterrupt):
            with faults.interrupted_when(stop, poll=0.01):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
                survived = True
                stop.set()
                time.sleep(30)
        assert survived and time.monotonic() - t0 < 10 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        # an outside SIGINT while the block is left (the watcher joined): it raised there, past the
        # restore, and the handler stayed installed with the event set: every later SIGINT raised
        class Joining(threading.Thread):
            def join(self, *a):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                return super().join(*a)
        stop = threading.Event()
        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(faults.threading, "Thread", Joining)
            with faults.interrupted_when(stop, poll=0.01):
                stop.set()
                time.sleep(30)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # ignored
        # the watcher's SIGINT pending as the block is left: CPython runs its handler as
        # signal.signal begins, before the swap to SIG_IGN, which raised out of the finally and left
        # only_ours installed (1 in ~3,000 blocks): every later outside SIGINT raised
        real, sent = signal.signal, []

        def pending_first(signum, handler):
            if handler is signal.SIG_IGN and not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # the watcher's, as the block ends (its handler may run here)
            return real(signum, handler)
        stop = threading.Event()
        with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as mp:
            mp.setattr(faults.signal, "signal", pending_first)
            with faults.interrupted_when(stop, poll=0.01):
                stop.set()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # ignored
    finally:
        signal.signal(signal.SIGINT, before)


def _cpu_env() -> dict:
    """A stand-in demo's environment: this test's imports, and no GPU (where one is, workers_for runs
    the demo's runs in its own process, one at a time: no pool to test)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}


_FAILING_RUN_SCRIPT = '''
import os, sys, time
from pathlib import Path
from mmadapt import demo, faults

class Runs:
    """Stand-in demo runs: `nap` waits for a stop request as a training loop does; `score` works on
    with no update to save at, as a Step-4 scoring does; `fail` fails once the first nap trains
    and the scoring runs."""
    cfg = demo.DemoConfig(workers=3, threads=1)
    root = Path(sys.argv[1])

    def say(self, what):
        print(what, flush=True)

    def nap(self, name):
        with faults.StopRequest() as stop:
            (self.root / name).write_text("started")
            while stop.reason is None:
                time.sleep(0.05)
        (self.root / (name + ".stopped")).write_text(stop.reason)
        raise faults.Stopped(0, "step00000000", stop.reason)

    def score(self):
        (self.root / "scoring").write_text(str(os.getpid()))
        try:
            while True:
                time.sleep(0.05)
        except KeyboardInterrupt:
            (self.root / "scoring.interrupted").write_text("yes")
            raise

    def fail(self):
        while not ((self.root / "a").exists() and (self.root / "scoring").exists()):
            time.sleep(0.05)
        raise ValueError("boom")

if __name__ == "__main__":
    log = str(Runs.root / "run.log")
    jobs = [demo.Job("fails", "fail", (), 9, log), demo.Job("score", "score", (), 5, log, interrupt=True)]
    jobs += [demo.Job(n, "nap", (n,), 3 - i, log) for i, n in enumerate("abc")]
    try:
        demo.Demo.run_jobs(Runs(), jobs)
    except ValueError as e:
        print(f"raised {e}", flush=True)
'''


def test_a_failed_demo_run_stops_the_others_and_starts_no_queued_one(tmp_path):
    """With its runs in worker processes, one run's error stops the demo at once: the running
    training runs save and stop as on a signal, a running Step-4 scoring (no update to save at,
    no StopRequest to see the stop) is interrupted, no queued run starts, and the error (not the
    scoring's interruption) names the run's log (the pool's exit used to train every queued run
    first; the demo used to wait out the scoring)."""
    script = tmp_path / "fails.py"
    script.write_text(_FAILING_RUN_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env=_cpu_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "raised boom" in done.stdout
    assert f"fails failed; its log: {tmp_path / 'run.log'}" in done.stderr
    assert (tmp_path / "a.stopped").read_text() == "the demo stopping"
    assert (tmp_path / "scoring.interrupted").read_text() == "yes"
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists(), "a queued run started"


_KILLED_WORKER_SCRIPT = '''
import os, signal, sys, time
from pathlib import Path
from mmadapt import demo, faults

class Runs:
    """Stand-in demo runs: `nap` waits for a stop request as a training loop does; `dies` is
    SIGKILLed (the out-of-memory killer) once the nap trains."""
    cfg = demo.DemoConfig(workers=2, threads=1)
    root = Path(sys.argv[1])

    def say(self, what):
        print(what, flush=True)

    def nap(self):
        with faults.StopRequest() as stop:
            (self.root / "nap").write_text("started")
            while stop.reason is None:
                time.sleep(0.05)
        (self.root / "nap.stopped").write_text(stop.reason)
        raise faults.Stopped(0, "step00000000", stop.reason)

    def dies(self):
        while not (self.root / "nap").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    log = str(Runs.root / "run.log")
    # two more queued behind them: not begun, not named (a killed pool fails them too)
    jobs = [demo.Job("minijoint", "dies", (), 4, log), demo.Job("minipost", "nap", (), 3, log),
            demo.Job("bl_small", "nap", (), 2, log), demo.Job("bl_base", "nap", (), 1, log)]
    try:
        demo.Demo.run_jobs(Runs(), jobs)
    except faults.PeerFailed as e:
        print(f"raised {e}", flush=True)
'''


def test_a_demo_worker_killed_is_one_line_saying_to_run_the_demo_again(tmp_path):
    """A worker SIGKILLed (the out-of-memory killer) broke the pool: every unfinished run came back
    as BrokenProcessPool, the first of them named as the run that failed (one that was training
    well in the other worker) and a traceback, exit 1. It is one line: a worker was killed while
    it ran one of the unfinished runs; run the same command again. The other run saved and stopped."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_WORKER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env=_cpu_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("raised ")]
    assert len(said) == 1 and said[0].startswith("raised a demo worker process was killed (a signal, or the "
                                                 "out-of-memory killer) while it ran one of minijoint, minipost"), said
    # the last queued is named no more (the pool hands one call ahead to a worker: that one may be)
    assert "bl_base" not in said[0] and said[0].endswith(
        "; the other runs saved and stopped: run the same command again to continue every run from its newest "
        f"checkpoint (their logs: {tmp_path / 'logs'})"), said
    assert "failed; its log" not in done.stderr, done.stderr
    assert (tmp_path / "nap.stopped").is_file()  # the other run stopped as on a signal, not killed


_AFTER_SCRIPT = '''
import json, sys, time
from pathlib import Path
from mmadapt import demo

class Runs:
    """Stand-in demo runs: `slow` runs until a second after `quick` has run (in the other worker;
    in one process it gives up waiting after 3 s), `quick` at once; `reader` says whether the slow
    run's output existed when it started."""
    root = Path(sys.argv[1])
    cfg = demo.DemoConfig(workers=int(sys.argv[2]), threads=1)

    def say(self, what):
        print(what, flush=True)

    def slow(self):
        deadline = time.monotonic() + 3
        while not (self.root / "quick.out").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        (self.root / "slow.out").write_text("done")
        return "slow"

    def quick(self):
        (self.root / "quick.out").write_text("done")
        return "quick"

    def reader(self):
        return (self.root / "slow.out").is_file()

if __name__ == "__main__":
    log = str(Runs.root / "run.log")
    jobs = [demo.Job("slow", "slow", (), 2, log), demo.Job("quick", "quick", (), 1, log)]
    done = demo.Demo.run_jobs(Runs(), jobs, [demo.Job("reader", "reader", (), 1, log, after=("slow",))])
    print(json.dumps(done))
'''


@pytest.mark.parametrize("workers", [1, 2])
def test_a_demo_run_starts_after_the_runs_it_reads(tmp_path, workers):
    """Step 4 over a primary model reads its Step-2 and Step-3 runs: in worker processes it is
    queued once they are done, not when a worker frees (here: the quick run's, while the slow one
    still runs). What each run returned comes back by its label."""
    script = tmp_path / "after.py"
    script.write_text(_AFTER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(workers)], cwd=tmp_path,
                          capture_output=True, text=True, env=_cpu_env(),
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"slow": "slow", "quick": "quick", "reader": True}


def test_a_stop_after_skipped_steps_keeps_the_complete_checkpoint_as_it_is(tmp_path):
    """A stop right after fp16-skipped steps does not write the update's complete checkpoint
    again (a kill during the rewrite would lose it): the resumed run replays the skipped batches."""
    engine, saves = FakeEngine(), []
    write = engine.save_checkpoint
    engine.save_checkpoint = lambda ckpt_dir, tag, **kw: (saves.append(tag), write(ckpt_dir, tag, **kw))

    def step(position):
        engine.applied = position != 2  # update 2 saved, then its next step overflows
        if position == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.tensor([1.0])

    with pytest.raises(faults.Stopped) as stopped:
        _loop(tmp_path, engine, step, save_interval=2)
    assert saves == ["step00000002"]  # once, by the periodic save
    assert stopped.value.tag == "step00000002"
    client = json.loads((tmp_path / "checkpoints" / "step00000002" / "client.json").read_text())
    assert (client["step"], client["position"]) == (2, 2)  # the position of that save, before the skip
    assert (tmp_path / "checkpoints" / "step00000002" / "COMPLETE").is_file()


def test_a_log_row_times_its_updates_alone_at_the_rate_they_trained_at(tmp_path, monkeypatch):
    """A row's seconds per update leave out the evaluations and saves of its window (they used
    to be charged to the next row: every row after a checkpoint under-reported tokens/s), and
    its lr is the one its last update trained at (read after the update, it was the next one's:
    the last row said 0)."""
    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    engine = FakeEngine()
    engine.lr = 1.0
    engine.get_lr = lambda: [engine.lr]

    def step(position):
        clock[0] += 1.0  # an update: one second
        engine.lr += 1.0  # the schedule steps inside the update
        return torch.tensor([1.0])

    def evaluate():
        clock[0] += 100.0
        return torch.tensor([2.0])

    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False, evaluate=evaluate, eval_interval=2,
                  perf=lambda dt, rows: {"sec_per_update": dt},
                  after_save=lambda done, tag, run, rows, scheduled: clock.__setitem__(0, clock[0] + 1000.0))
    cfg = TrainConfig(log_interval=2, save_interval=2)
    rows = [r for r in train_loop(engine, step, job, cfg, 6, run_dir=tmp_path, resume=False) if "loss" in r]
    assert [(r["step"], r["sec_per_update"], r["lr"]) for r in rows] == [(2, 1.0, 2.0), (4, 1.0, 4.0), (6, 1.0, 6.0)]


def test_an_error_after_a_checkpoint_reaches_the_loop_that_saved(tmp_path):
    """Rank 0's work after a checkpoint (Step 2's artifact) failing stops the loop with that error,
    agreed over the ranks first (parallel.together), so that no other rank waits for it in a
    collective; the checkpoint itself is complete."""
    def fail(done, tag, run, rows, scheduled):
        raise OSError(28, "No space left on device")

    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False, after_save=fail)
    with pytest.raises(OSError, match="No space left on device"):
        train_loop(FakeEngine(), lambda position: torch.tensor([1.0]), job,
                   TrainConfig(log_interval=1, save_interval=2), 4, run_dir=tmp_path, resume=False)
    assert (tmp_path / "checkpoints" / "step00000002" / "COMPLETE").is_file()


def test_a_checkpoint_a_full_disk_cut_short_is_one_line_the_complete_ones_kept(tmp_path, monkeypatch, capsys):
    """A full disk fails torch's zip writer with a RuntimeError (not an OSError): it reached the
    user as an internal error, a traceback and exit 1. Now an OSError naming the tag and the space
    left (mmadapt's commands: one line, exit 74); the tag before it complete, this one not."""
    from mmadapt import checkpoint
    saves = []

    def save(obj, f, *a, **k):
        saves.append(f)
        if len(saves) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7708800 vs 7708692")
        return real(obj, f, *a, **k)
    real = torch.save
    monkeypatch.setattr(checkpoint.torch, "save", save)
    init_parallel(1, 1)
    job = LoopJob(step="test", names={}, client_state={}, exclude_frozen=False)
    with pytest.raises(OSError) as e:
        train_loop(FakeEngine(), lambda position: torch.tensor([1.0]), job,
                   TrainConfig(log_interval=1, save_interval=2), 4, run_dir=tmp_path, resume=False)
    assert e.value.filename == str(tmp_path / "checkpoints" / "step00000004")
    assert re.fullmatch(r"could not write checkpoint step00000004 \([\d,]+ MiB free there; torch: \[enforce fail at "
                        r"inline_container\.cc:672\] \. unexpected pos 7708800 vs 7708692\): the complete checkpoints "
                        r"before it are kept; free space, then run the same command again \(with --resume where the command "
                        r"takes it\)", e.value.strerror), e.value.strerror
    assert checkpoint.complete_tags(tmp_path / "checkpoints") == ["step00000002"]
    # a command: one line and EX_IOERR (74), not 2 (a mistake in the input, nothing written) nor requeued
    from mmadapt.cli import user_errors

    capsys.readouterr()
    for error in (e.value, OSError(28, "No space left on device", "run/log.jsonl")):
        assert user_errors(lambda argv: (_ for _ in ()).throw(error))([]) == faults.EXIT_IO == 74
        assert capsys.readouterr().err == f"error: {error.filename}: {error.strerror}\n"
    # a write to an open file (f.write, fsync: no file name), as a full disk fails it
    assert user_errors(lambda argv: (_ for _ in ()).throw(OSError(28, "No space left on device")))([]) == 74
    assert capsys.readouterr().err == ("error: No space left on device: a write failed (the disk full or over quota): "
                                       "free space, then run the same command again (with --resume where the "
                                       "command takes it)\n")
    # a library's own error for it (safetensors' writer raises SafetensorError, no OSError)
    class SafetensorError(Exception):
        pass
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert user_errors(lambda argv: (_ for _ in ()).throw(full))([]) == 74
    assert capsys.readouterr().err.startswith("error: Error while serializing: I/O error: No space left on device "
                                              "(os error 28): a write failed (the disk full or over quota)")
    with pytest.raises(SafetensorError, match="header too large"):  # another of its errors is what it was
        user_errors(lambda argv: (_ for _ in ()).throw(SafetensorError("header too large")))([])
    # an I/O error with no file name may be a read's (an input on a failing disk): not said to be a write
    with pytest.raises(OSError, match="Input/output error"):
        user_errors(lambda argv: (_ for _ in ()).throw(OSError(5, "Input/output error")))([])
    monkeypatch.setattr(checkpoint.torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    (tmp_path / "b").mkdir()
    with pytest.raises(RuntimeError, match="^other$"):  # any other error is what it was
        train_loop(FakeEngine(), lambda position: torch.tensor([1.0]), job,
                   TrainConfig(log_interval=1, save_interval=2), 4, run_dir=tmp_path / "b", resume=False)


@pytest.mark.parametrize("error, says, aside", [
    (RuntimeError("unpickling stack underflow"), "(unpickling stack underflow): move it aside", True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out of memory", False),
    (PermissionError(13, "Permission denied"), "the file system failed to read it", False),
])
def test_a_checkpoint_that_fails_to_load_is_moved_aside_only_for_damage(tmp_path, monkeypatch, error, says, aside):
    """checkpoint.resume: a complete tag whose files have their saved sizes but that fails to load.
    Damaged content: move it aside (the one before it is resumed). Out of memory or a file system
    that failed to read it: the checkpoint is good, and moving it aside would throw its updates
    away: the line says to resume again, and the tag is left where it is."""
    from mmadapt import checkpoint

    tag = tmp_path / "step00000002"
    tag.mkdir()
    (tag / "COMPLETE").write_text(json.dumps({"files": {}}))

    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint, "load", load)
    with pytest.raises(ValueError) as e:
        checkpoint.resume(None, tmp_path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"checkpoint {tag} cannot be read") and says in line
    assert ("move it aside to resume" in line) is aside and ("resume again" in line) is not aside
    assert tag.is_dir()


TOGETHER_PROBE = """
import os
from mmadapt import parallel
from mmadapt.faults import PeerFailed

rank = int(os.environ["RANK"])
print(f"rank {rank} value {parallel.together(lambda: rank + 10, 'could not read a checkpoint')}", flush=True)


def read():
    if rank == 1:  # this rank's node no longer sees the checkpoint rank 0 chose
        raise ValueError("run/checkpoints/global_step4 does not exist")
    return "weights"


try:
    parallel.together(read, "could not read run's checkpoint global_step4")
except (ValueError, PeerFailed) as e:
    print(f"rank {rank} {type(e).__name__}: {e}", flush=True)
parallel.shutdown()  # as every command's process does (cli.run_process): gloo's threads ended before Python's
"""


@pytest.mark.slow
def test_a_complete_marker_killed_in_its_write_leaves_the_tag_whole_when_written_again(tmp_path):
    """A kill inside COMPLETE's atomic write left `.COMPLETE.tmp<pid>@<host>` in the tag; the
    rerun's save listed it among the tag's files, then its own write of COMPLETE removed it (a
    dead writer's), and the tag read as damaged ('... is missing') from then on."""
    from mmadapt.checkpoint import damaged, tag_for, write_weights_only

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    tag = tmp_path / tag_for(2)
    tag.mkdir()
    (tag / f".COMPLETE.tmp{gone.pid}@{socket.gethostname()}").write_text('{"step": 2, "fi')
    write_weights_only(tmp_path, 2, {"w": torch.zeros(2)}, {})
    assert damaged(tag) is None and sorted(p.name for p in tag.iterdir()) == ["COMPLETE",
                                                                              "mp_rank_00_model_states.pt"]
    # a tag saved so before the mend: whole, though its COMPLETE lists the temporary
    listed = json.loads((tag / "COMPLETE").read_text())
    listed["files"][f".COMPLETE.tmp{gone.pid}@{socket.gethostname()}"] = 15
    (tag / "COMPLETE").write_text(json.dumps(listed))
    assert damaged(tag) is None
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"cut")
    assert "mp_rank_00_model_states.pt has 3 bytes" in damaged(tag)


def test_a_read_that_fails_on_one_rank_stops_every_rank_with_a_line_naming_it(tmp_path):
    """parallel.together: each rank's own value where every rank's read worked; where one rank's
    failed, that rank raises its own error and every other raises PeerFailed naming it, at once,
    none left to wait in the next collective for the timeout (two processes of one gloo job,
    no launcher to stop the others)."""
    from conftest import REPO, _port, child_env

    script = tmp_path / "probe.py"
    script.write_text(TOGETHER_PROBE)
    env = child_env(PYTHONPATH=str(REPO), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
                    MMADAPT_DIST_TIMEOUT_S="120")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    out = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in out]
    lines = [[l for l in o.splitlines() if l.startswith("rank ")] for o, _ in out]  # (DeepSpeed's own lines apart)
    assert lines[0] == ["rank 0 value 10", "rank 0 PeerFailed: rank(s) 1 could not read run's checkpoint "
                                      "global_step4 (their output says why)"], out[0]
    assert lines[1] == ["rank 1 value 11",
                                      "rank 1 ValueError: run/checkpoints/global_step4 does not exist"], out[1]


@pytest.mark.parametrize("step", ["adapt", "build_minipost", "fit-head", "finetune"])
def test_a_source_another_rank_could_not_read_stops_the_step_before_it_trains(step, primary_run, corpus, tokenizer,
                                                                              de_corpus, de_tokenizer, tmp_path,
                                                                              capsys, monkeypatch):
    """Every step that reads a source's weights on each rank reads them through
    parallel.together (after the checkpoint's choice, which goes through it too): where another
    rank could not read them, this rank stops there with PeerFailed's line and exit 1, nothing
    trained, instead of going on into DeepSpeed's initialize to wait for the timeout."""
    from conftest import adapt_args
    from mmadapt import checkpoint, parallel
    from mmadapt.cli import main
    from test_bad_input import Ctx

    source = Path(Ctx(tmp_path, corpus, tokenizer, primary_run).headless_run()) if step == "fit-head" else primary_run
    calls, real = [], parallel.together

    def together(work, what):
        calls.append(what)
        if len(calls) == 2:  # the weights, read once the checkpoint is chosen
            raise faults.PeerFailed(f"rank(s) 1 {what} (their output says why)")
        return real(work, what)

    monkeypatch.setattr(parallel, "together", together)
    out = tmp_path / "run"
    argv = {"adapt": ["adapt", *adapt_args("minijoint", primary_run, de_corpus, de_tokenizer, out)],
            "build_minipost": ["build_minipost", "--primary", str(primary_run), "--output_dir", str(out)],
            "fit-head": ["fit-head", "--primary", str(source), "--corpus", str(corpus), "--output_dir", str(out)],
            "finetune": ["finetune", "--task", "bible-genre", "--primary", str(primary_run), "--seq_length", "64",
                         "--output_dir", str(out)]}
    assert main(argv[step]) == 1
    tag = checkpoint.latest_tag(source / "checkpoints")
    assert calls == [f"could not read {source}'s checkpoint {tag}"] * 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: rank(s) 1 could not read {source}'s checkpoint "
                                                        f"{tag} (their output says why)")
    assert not checkpoint.has_checkpoints(out / "checkpoints")
