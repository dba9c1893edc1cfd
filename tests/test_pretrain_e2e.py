"""The acceptance run: MINIJOINT at the tiny preset, 2 ranks, on the real English Bible."""

import math
import subprocess

import pytest

from conftest import REPO, child_env, launch_cmd, metrics
from mmadapt.heldout import unigram_logprobs

pytestmark = pytest.mark.slow


def test_minijoint_tiny_two_ranks_learns_english(tmp_path):
    out = tmp_path / "minijoint"
    cmd = launch_cmd(2, "--recipe", "minijoint", "--preset", "tiny", "--corpus", "bible:en", "--output_dir", str(out),
                     launcher="deepspeed")  # the users' launcher, end to end
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=child_env(MMADAPT_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = metrics(out)
    assert rows[-1]["step"] == 200
    # The tiny preset starts each head's bias at the corpus's unigram log-frequencies, so the first
    # logged loss is already near the unigram cross-entropy: learning English is getting below it,
    # which only context can do.
    logp = unigram_logprobs(out / "data", 2000)
    unigram = float(-(logp.exp() * logp).sum())
    first, last = rows[0]["head_losses"], rows[-1]["head_losses"]
    for head in ("4", "12"):
        assert first[head] < math.log(2000)  # below a uniform guess over the 2,000 pieces
        assert last[head] < unigram - 0.1, (head, unigram, first[head], last[head])  # seen: 0.26 and 0.21
    assert rows[-1]["tokens_per_s"] > 0 and rows[-1]["flops_per_s"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [p.name for p in sorted((out / "checkpoints").glob("step*/COMPLETE"))] == ["COMPLETE", "COMPLETE"]
    assert "done: step 200" in proc.stdout
