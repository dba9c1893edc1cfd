"""Stop/resume and crash recovery reproduce an uninterrupted run exactly (dropout on)."""

import random
import signal
import subprocess
import time

import pytest

from conftest import REPO, base_args, child_env, launch_cmd, metrics, run_pretrain

STEPS = 8


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
    proc = subprocess.run(launch_cmd(1, *_args(corpus, tokenizer, tmp_path, "--save_interval", "1")), cwd=REPO,
                          capture_output=True, text=True, env=child_env(MMADAPT_TEST_KILL_IN_SAVE="3"))
    assert proc.returncode == -signal.SIGKILL
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
