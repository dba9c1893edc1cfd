"""Stop/resume and crash recovery reproduce an uninterrupted run exactly (dropout on)."""

import random
import signal
import subprocess
import time

import pytest

from conftest import PRETRAIN, REPO, base_args, child_env, launch_cmd, metrics, run_pretrain

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
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--exit_interval", "3"))
    assert [s for s, _, _ in losses(tmp_path)] == [1, 2, 3]
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume"))
    assert losses(tmp_path) == uninterrupted  # exact: same data, masks, dropout and optimizer state


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


def test_sigkill_at_a_random_moment(uninterrupted, corpus, tokenizer, tmp_path):
    seed = random.randrange(10**6)
    delay = random.Random(seed).uniform(0.0, 1.5)
    proc = subprocess.Popen(launch_cmd(1, *_args(corpus, tokenizer, tmp_path, "--save_interval", "1")), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    first = tmp_path / "checkpoints" / "step00000001" / "COMPLETE"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--resume", "--save_interval", "1"))
    assert losses(tmp_path) == uninterrupted, f"kill delay {delay:.3f}s (seed {seed})"
