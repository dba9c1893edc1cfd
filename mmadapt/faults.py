"""What happens when things go wrong: the exit statuses, a graceful stop on SIGTERM/SIGINT (or
when the launcher dies), one live writer per run directory, and DeepSpeed's extension lock.

Exit statuses of every mmadapt command:
    0   done
    1   an internal error (a traceback: please report it)
    2   a user's mistake (one `error:` line; nothing was written)
    3   the run diverged (a non-finite loss, or too many consecutive skipped fp16 steps); the
        newest complete checkpoint is the last good one
    74  a write the disk or file system failed (full, over quota, an I/O error; EX_IOERR): one
        `error:` line (naming the file where the error does); what was complete before it is
        kept: free space, then run the same command with --resume (not requeued: it needs someone)
    75  stopped by a signal after saving a complete checkpoint at the current update: run the
        same command with --resume (75 is EX_TEMPFAIL, "try again": SLURM templates requeue on it)
    76  paused by --exit_interval before train_iters, after a complete checkpoint: run the same
        command with --resume to go on (a scheduler script tells it from 0, a finished run; the
        SLURM templates requeue on it too)
    130 interrupted: Ctrl-C during start-up (nothing to save yet), or a second Ctrl-C (no save:
        --resume continues from the newest complete checkpoint)
    1   an internal error (a traceback); on the other ranks of a job whose global rank 0 failed
        in its work after a checkpoint (PeerFailed), one line
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_INTERNAL, EXIT_USER, EXIT_DIVERGED, EXIT_STOPPED, EXIT_PAUSED, EXIT_INTERRUPTED = 1, 2, 3, 75, 76, 130
EXIT_IO = 74  # EX_IOERR: a write the disk or file system failed (full, over quota, an I/O error)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write's alone (a full disk, a quota)
IO_ERRNOS = (*FULL_ERRNOS, errno.EIO)  # what a run meets mid-way, not a mistake in its input


class Diverged(RuntimeError):
    """Training cannot go on from here; the newest complete checkpoint is the last good one.
    `situation`: what happened, and `last_good`: the newest complete checkpoint (None: none was
    saved), the line's parts before its advice (a command that continues its runs by itself
    words its own: resumes_itself); `step`: the training loop's (engine.LoopJob.step), which a
    command running several steps advises by (the demo's flags set some steps' rates alone)."""

    def __init__(self, line: str, situation: str | None = None, last_good: tuple[str, str] | None = None,
                 step: str | None = None):
        super().__init__(line)
        self.situation, self.last_good = situation, last_good  # last_good: (its tag, its checkpoints directory)
        self.step = step

    @classmethod
    def of_run(cls, situation: str, last_good: tuple[str, str] | None, fix: str,
               step: str | None = None) -> "Diverged":
        """A run's divergence and its advice: --resume is exact and refuses a changed --lr, so
        resuming the last good checkpoint would diverge again; `fix` (a lower --lr) in a new run,
        or, with no checkpoint saved, the same command again."""
        if last_good is None:
            advice = f"No checkpoint was saved before it: {fix} and run the command again (without --resume)"
        else:
            advice = (f"Checkpoint {last_good[0]} in {last_good[1]} is the last good one, but --resume would repeat "
                      f"this exactly: {fix} in a new --output_dir")
        return cls(f"{situation} {advice}", situation, last_good, step)

    def start_anew(self, fix) -> None:
        """Reword the advice (a run's: a new one, or --resume) for a command that continues its
        runs by itself: the same command again goes on from the last good checkpoint and repeats
        this, and with `fix` made (a lower learning rate) is refused as another extension, sweep
        or demo. fix: what to change, or a function of this exception that gives the whole advice
        (the demo's, by the step that diverged). The same exception: its traceback stays for
        MMADAPT_DEBUG=1."""
        if self.situation is not None:
            tag, where = self.last_good or (None, None)
            found = ("No checkpoint was saved before it" if tag is None else
                     f"Checkpoint {tag} in {where} is the last good one, but the same command would repeat this")
            advice = fix(self) if callable(fix) else f"{fix} and run the command into a new --output_dir"
            self.args = (f"{self.situation} {found}: {advice}",)


class Stopped(BaseException):
    """A signal (or the launcher's death) stopped the run after a complete checkpoint. A
    BaseException, as KeyboardInterrupt is: stopped_after_checkpoint raises it from a signal
    handler inside whatever code runs, and a broad `except Exception` there (load_pt's, a
    library's) turned it into that code's error (an intact artifact 'truncated', exit 2)."""

    def __init__(self, step: int, tag: str, reason: str):
        self.step, self.tag, self.reason = step, tag, reason
        super().__init__(self.said())

    def said(self, resume_flag: bool = True) -> str:
        """The line a command prints; resume_flag False: a command that resumes by itself (sweep,
        extend), which has no --resume."""
        return (f"stopped by {self.reason} at update {self.step}: checkpoint {self.tag} is complete; "
                f"run the same command {'with --resume' if resume_flag else 'again'} to continue")

    def __reduce__(self):  # pickled by its fields: a demo worker's run sends it to the demo's process
        return type(self), (self.step, self.tag, self.reason)


class PeerFailed(Exception):
    """Another rank failed where this one can go no further without it (global rank 0's work after
    a checkpoint, Step 2's artifact): every rank leaves together, this one with a line saying so."""


class Paused(Exception):
    """--exit_interval ended the run before its last update, after a complete checkpoint."""

    def __init__(self, step: int, total: int, tag: str):
        self.step, self.total, self.tag = step, total, tag
        super().__init__(self.said())

    def said(self, resume_flag: bool = True) -> str:
        """As Stopped.said."""
        return (f"paused at update {self.step} of {self.total} (--exit_interval): checkpoint {self.tag} is complete; "
                f"run the same command {'with --resume' if resume_flag else 'again'} to go on")

    def __reduce__(self):  # pickled by its fields (Stopped's)
        return type(self), (self.step, self.total, self.tag)


def sigint_ignored() -> bool:
    """Whether this process was started with SIGINT ignored (a background `&` job of a shell
    script: the script's Ctrl-C is not for it): entry, the training loop's StopRequest and
    interrupted_when leave it ignored, from start-up to the end."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _interrupted_while_importing(signum, frame) -> None:
    """SIGINT's handler while entry imports: leave at once, raising nothing. A KeyboardInterrupt
    raised inside an extension's initialisation (numpy's, as torch loads it) was swallowed there
    (the command then ran to its end), or broke numpy's import (a RecursionError), or aborted the
    process (pybind11: 'terminate called'); nothing is written while importing."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


def entry(command: str | None = None) -> int:
    """A process's entry (the `mmadapt` command, the launch/ scripts): mmadapt.cli imports torch,
    DeepSpeed and megatron-core, seconds in which a Ctrl-C printed their import traceback; it is
    one line ("interrupted", 130) there too, as cli.user_errors says it after. command: the name
    of the command's function in mmadapt.cli (None: `mmadapt`, which dispatches)."""
    # (only the main thread may set a handler)
    deferred = threading.current_thread() is threading.main_thread() and not sigint_ignored()
    previous = signal.signal(signal.SIGINT, _interrupted_while_importing) if deferred else None
    try:  # (import_module: `from mmadapt import cli` takes the package's attribute where it is imported already)
        cli = importlib.import_module("mmadapt.cli")
    except KeyboardInterrupt:  # raised by the import itself
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if deferred:
            signal.signal(signal.SIGINT, previous)
    return cli.run_process(cli.main if command is None else getattr(cli, command))


def resumes_itself(step=None, *, fix="lower --lr"):
    """A step that continues its runs by itself (sweep, extend, the demo: the same call again,
    no resume flag): a stop or pause inside it says so as it leaves, from Python too (the command
    line words its own line, cli.user_errors); a divergence says to make `fix` (the step's
    learning-rate flags, or a function of the exception: Diverged.start_anew) and start anew."""
    if step is None:  # @resumes_itself(fix=...)
        return functools.partial(resumes_itself, fix=fix)

    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except (Stopped, Paused) as e:
            e.args = (e.said(False),)
            raise
        except Diverged as e:
            e.start_anew(fix)
            raise
    return wrapped


# --- signals -------------------------------------------------------------------------------------

_LAUNCHERS = ("deepspeed", "torchrun", "torch.distributed.run", "torch.distributed.launch")


def launcher_ancestors() -> list:
    """The launcher processes above this one (DeepSpeed's runner and its per-node launch.py, or
    torchrun): the contiguous chain of parents whose command line names a launcher."""
    import psutil

    chain = []
    for parent in psutil.Process(os.getpid()).parents():
        try:
            cmd = " ".join(parent.cmdline())
        except psutil.Error:
            break
        if not any(l in cmd for l in _LAUNCHERS):
            break
        chain.append(parent)
    return chain


def _gone(proc) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE or not proc.is_running()  # is_running checks pid reuse
    except psutil.Error:
        return True


def stop_with_parent(parent: int) -> None:
    """Have this process sent SIGTERM when its parent (pid `parent`) exits, however it exits
    (SIGKILL too), so that a worker process stops as a launched rank does when its launcher
    goes (StopRequest: inside a training loop, a checkpoint at the current update; outside one,
    at once) instead of training on for no one. Linux (prctl PR_SET_PDEATHSIG); elsewhere
    nothing is set. The kernel's "parent" is the thread that started this process: start
    workers from a thread that lives as long as the parent (a pool's submit from the main
    thread, spawn context; a forkserver would be the parent instead)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it exited before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


STOP_FILE = "STOP"
# In a process that trains for another one (a demo worker): an Event (threading's or
# multiprocessing's) that process sets to stop this one's run as a signal would (stop_when)
_STOP_EVENT = None


def stop_when(event) -> None:
    """Have every StopRequest of this process stop its run once `event` is set."""
    global _STOP_EVENT
    _STOP_EVENT = event


@contextlib.contextmanager
def interrupted_when(event, poll: float = 0.1):
    """While active, `event` set (by another process: a demo stopping) raises KeyboardInterrupt in
    this process's main thread, where the work runs: for work with no update to save at (a demo's
    Step-4 scoring), which a StopRequest would leave running to its end. Main thread only. A real
    SIGINT sent to the main thread, which cuts a blocking call short (_thread.interrupt_main waits
    for the call to return). The interrupt comes inside the block or, where the work ended as it
    came, on leaving it: never later (the watcher is joined before this returns)."""
    lock, done, main = threading.Lock(), threading.Event(), threading.main_thread().ident

    def watch():
        while not done.wait(poll):
            with lock:
                if not done.is_set() and event.is_set():
                    done.set()
                    signal.pthread_kill(main, signal.SIGINT)

    # the SIGINT raises through it; where SIGINT is ignored (a demo run in the background of a
    # script: its workers inherit that) only the watcher's own, once `event` is set
    ignored = sigint_ignored()

    def only_ours(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
    old = signal.signal(signal.SIGINT, only_ours if ignored else signal.default_int_handler)
    watcher = threading.Thread(target=watch, daemon=True, name="interrupt-watch")
    watcher.start()
    try:
        yield
    finally:
        def stop_watching():
            with lock:
                done.set()
        # each to its end: a SIGINT (the watcher's, sent as the block ended, or another) runs its
        # handler as a call here begins and raised out of the finally, the handler left installed
        # (only_ours, with the event set: every later outside SIGINT raised). It is raised after.
        steps = [stop_watching, watcher.join, lambda: signal.signal(signal.SIGINT, old)]
        if ignored:  # first: ignored from here on
            steps.insert(0, lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        interrupted = _to_the_end(*steps)
        if interrupted is not None:
            raise interrupted


def _to_the_end(*steps) -> KeyboardInterrupt | None:
    """Run each of `steps`, again where a KeyboardInterrupt cut it short (raised by a SIGINT
    handler as the call began, before it did anything); returns the first such interrupt."""
    interrupted = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as e:
                interrupted = interrupted or e
    return interrupted


def clear_stale_stop(stop_file: Path) -> None:
    """Remove a stop request older than this job (the one that stopped the run's previous job,
    which died before removing it); keep one made since: SLURM's warning may come while the
    requeued job starts, and that request is this job's (global rank 0). This job began when
    this process did, or under SLURM when the job's current run did (SLURM_JOB_START_TIME: its
    batch script touches the file, perhaps before this process exists)."""
    import psutil

    began = psutil.Process().create_time()
    slurm = os.environ.get("SLURM_JOB_START_TIME", "")
    if slurm.isdigit():
        began = min(began, int(slurm))
    try:
        if stop_file.stat().st_mtime < began:
            stop_file.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


class StopRequest:
    """While active, any of these sets `reason` instead of killing the process: SIGTERM or
    SIGINT; the death of a launcher above this rank (DeepSpeed's runner does not pass signals on
    to its ranks, and a SIGKILL cannot be passed on; SIGINT not where the process was started
    with it ignored); a file `<run_dir>/STOP` (what the SLURM
    templates create when SLURM warns of the time limit: one node's shell can stop ranks on
    every node); an event another process sets (stop_when: a demo worker's run, when the demo
    stops). The training loop then agrees on it with the other ranks, saves at the current
    update and stops (engine.train_loop). A second SIGINT interrupts at once
    (KeyboardInterrupt); more SIGTERMs (a launcher passing one on) change nothing."""

    POLL_S = 1.0

    def __init__(self, stop_file: Path | None = None):
        self.reason: str | None = None
        self.stop_file = stop_file
        self._old: dict = {}
        self._done = threading.Event()

    def _request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            print(f"{reason}: finishing this update, then saving a checkpoint", file=sys.stderr, flush=True)

    def _handler(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._request(signal.Signals(signum).name)

    def _watch(self, launchers) -> None:
        while not self._done.wait(self.POLL_S):
            dead = next((p for p in launchers if _gone(p)), None)
            if dead is not None:
                self._request(f"the exit of launcher process {dead.pid}")
            elif self.stop_file is not None and self.stop_file.exists():
                self._request(f"{self.stop_file}")
            elif _STOP_EVENT is not None and _STOP_EVENT.is_set():
                self._request("the demo stopping")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                if s != signal.SIGINT or not sigint_ignored():
                    self._old[s] = signal.signal(s, self._handler)
        threading.Thread(target=self._watch, args=(launcher_ancestors(),), daemon=True, name="stop-watch").start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._done.set()
        if _HELD is not None and exc_type is not None and issubclass(exc_type, (Stopped, Paused)):
            # the checkpoint is complete and the process on its way out (stops_held_to_exit)
            for s, h in self._old.items():
                _HELD.setdefault(s, h)
                signal.signal(s, _after_stop)
            return
        for s, h in self._old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def stopped_after_checkpoint(step: int, tag: str):
    """Work after a run's last complete checkpoint that the same command with --resume redoes
    whole (Step 3's score of its --eval_file: minutes on XNLI's dev set): a SIGTERM (scancel,
    preemption) ends it as one in the training loop ends that, Stopped (exit 75, which the
    SLURM templates requeue), where the default action exited 143 saying nothing. Nothing is
    lost: the checkpoint is complete. SIGINT keeps its Ctrl-C (interrupted, 130)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Stopped(step, tag, signal.Signals(signum).name)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Stopped:
        if _HELD is not None:  # more SIGTERMs in the teardown change nothing (stops_held_to_exit)
            _HELD.setdefault(signal.SIGTERM, old)
            signal.signal(signal.SIGTERM, _after_stop)
            old = None
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


# A process's entry (stops_held_to_exit): the handlers a stop or pause put aside, restored once the
# process's teardown is over; None outside one (a command called in-process gets them back at once).
_HELD: dict | None = None


@contextlib.contextmanager
def stops_held_to_exit():
    """A process's entry (cli.run_process): once a training loop has stopped or paused after its
    checkpoint, the signals it caught stay caught until the block ends (the process groups torn
    down): more SIGTERMs change nothing (one in the teardown exited 143, not 75, and the SLURM
    templates did not requeue the run), and a second Ctrl-C ends the process at once with its one
    line (it raised inside the teardown: a traceback)."""
    global _HELD
    _HELD = {}
    try:
        yield
    finally:
        held, _HELD = _HELD, None
        for s, h in held.items():
            signal.signal(s, h)


def _after_stop(signum, frame) -> None:
    if signum == signal.SIGINT:
        sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)


# --- one writer per run directory ------------------------------------------------------------------

LOCK_NAME = "run.lock"
TAKEOVER_NAME = LOCK_NAME + ".takeover"  # RunLock._remove_dead's mutex, beside the lock


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's does; a zombie does not): how
    RunLock, checkpoint's staging directories and a preparation's shards tell a writer's leavings."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _slurm_instance() -> list | None:
    """[job id, restart count] of the SLURM job this process runs in (the count grows by one at
    every requeue of the same job id), None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return [job, int(os.environ.get("SLURM_RESTART_COUNT") or 0)] if job else None


def _requeued_from(theirs, mine) -> bool:
    """Whether a lock holder's SLURM instance `theirs` is an earlier run of this process's job `mine`."""
    return (isinstance(theirs, list) and isinstance(mine, list) and len(theirs) == 2 and theirs[0] == mine[0]
            and isinstance(theirs[1], int) and theirs[1] < mine[1])


class RunLock:
    """`<run_dir>/run.lock` ({host, pid, since, and under SLURM slurm: [job id, restart count]}),
    created exclusively by the process that writes the run (global rank 0), after every input
    check: a second writer is refused. A lock left by a dead process on this host is taken over
    with a message, and so is one of an earlier instance of this SLURM job (requeued: SLURM runs
    one at a time); any other lock held from another host cannot be checked from here, so it is
    refused with the holder named."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> "RunLock":
        slurm = _slurm_instance()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
              **({"slurm": slurm} if slurm else {})}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    holder = {}
                if (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                        and not pid_alive(holder["pid"])):
                    if self._remove_dead(holder):
                        print(f"taking over {self.path}: its holder (pid {holder['pid']}) is no longer running",
                              file=sys.stderr)
                    continue
                if _requeued_from(holder.get("slurm"), me.get("slurm")):
                    # SLURM runs one instance of a job at a time: an earlier one's lock is a dead
                    # holder's, whatever node it was on (a lost node's, which no host can check)
                    if self._remove_dead(holder):
                        print(f"taking over {self.path}: its holder was SLURM job {holder['slurm'][0]} before it "
                              "was requeued as this one", file=sys.stderr)
                    continue
                if not holder:  # (a lock written before its writer removed one it could not finish)
                    raise ValueError(f"{self.path} names no holder (empty or unreadable: a start whose write of it "
                                     f"failed?): if no process is writing {self.path.parent}, delete {self.path}")
                who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (since {holder.get('since', '?')})"
                raise ValueError(f"{self.path.parent} is being written by {who}: wait for it to finish, or if it "
                                 f"is no longer running, delete {self.path}")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except BaseException:  # (a full disk): an empty lock would refuse every later start, holder unknown
                self.path.unlink(missing_ok=True)
                raise
            self.held = True
            return self
        raise ValueError(f"could not take {self.path}: another process took it at the same time")

    TAKEOVER_STALE_S = 60  # a takeover takes milliseconds: a mutex this old is a dead taker's

    def _remove_dead(self, holder: dict) -> bool:
        """Remove the lock of `holder`, found dead, if it still holds it -> whether this call did.
        Under a mutex (a directory beside the lock, made atomically): of two starters that found
        the same dead holder, the second would otherwise remove the lock the first had just made,
        and both would write the run. One that finds the mutex taken removes nothing (its caller
        reads the lock again, and is refused by a live holder)."""
        mutex = self.path.with_name(TAKEOVER_NAME)
        try:
            os.mkdir(mutex)
        except FileExistsError:
            try:
                if time.time() - mutex.stat().st_mtime > self.TAKEOVER_STALE_S:
                    os.rmdir(mutex)
            except OSError:
                pass
            return False
        try:
            try:
                current = json.loads(self.path.read_text())
            except (OSError, ValueError):
                current = {}
            if current != holder:
                return False
            self.path.unlink(missing_ok=True)
            return True
        finally:
            os.rmdir(mutex)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- DeepSpeed's CPU extension -----------------------------------------------------------------------

def extension_lock_path(name: str = "deepspeed_shm_comm") -> Path:
    """The file lock torch's JIT build of DeepSpeed's extension `name` waits on."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def _open_by(path: Path) -> list[int]:
    """Pids of the processes on this host with `path` open (torch's builder keeps it open)."""
    import psutil

    target, pids = os.path.realpath(path), []
    for proc in psutil.process_iter(["pid"]):
        try:
            if any(f.path == target for f in proc.open_files()):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def clear_stale_extension_lock(path: Path | None = None, stale_after_s: float = 30.0, poll_s: float = 5.0,
                               give_up_s: float | None = None, spin_s: float = 0.1) -> str | None:
    """torch's extension builder holds a lock file while it compiles and removes it when done; a
    process killed mid-build leaves it, and every later process would wait on it forever with no
    output. Before DeepSpeed loads its extension: a lock that no process on this host holds
    open, older than `stale_after_s` (a build on another host sharing this directory keeps it
    younger: its compiler writes beside it), is removed with a message; otherwise it is waited
    for. Every rank's load takes the lock for a moment, while ninja finds the build up to date,
    so the file is polled every `spin_s` (torch's own FileBaton spin): a rank that finds a peer
    checking goes on when the check ends, not a `poll_s` later, which a short rendezvous timeout
    would not survive. The holders are looked up every `poll_s`, and from the second look on it
    says who we wait for (every 30 s). Returns what was done (None: no lock)."""
    path = path or extension_lock_path()
    start, next_look, next_say, seen = time.monotonic(), 0.0, poll_s, False
    while path.exists():
        seen = True
        waited = time.monotonic() - start
        if waited >= next_look:
            holders = _open_by(path)
            try:
                age = time.time() - max(p.stat().st_mtime for p in [path, *path.parent.iterdir()])
            except FileNotFoundError:
                continue
            if not holders and age > stale_after_s:
                path.unlink(missing_ok=True)
                msg = (f"removed a stale lock {path}: no process holds it (a process killed while building "
                       "DeepSpeed's extension left it)")
                print(msg, file=sys.stderr, flush=True)
                return msg
            if waited >= next_say:
                who = f"process {', '.join(map(str, holders))}" if holders else "a process on another host, or none"
                print(f"waiting for {path}: DeepSpeed's extension is being built by {who}", file=sys.stderr,
                      flush=True)
                next_say = waited + 30.0
            next_look = waited + poll_s
        if give_up_s is not None and waited >= give_up_s:
            return "waiting"
        time.sleep(spin_s)
    return "released" if seen else None
