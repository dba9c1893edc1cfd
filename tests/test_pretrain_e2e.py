"""The acceptance run: MINIJOINT at the tiny preset, 2 ranks, on the real English Bible."""

import math
import subprocess

import pytest

from conftest import REPO, child_env, launch_cmd, metrics

pytestmark = pytest.mark.slow


def test_minijoint_tiny_two_ranks_learns_english(tmp_path):
    out = tmp_path / "minijoint"
    cmd = launch_cmd(2, "--recipe", "minijoint", "--preset", "tiny", "--corpus", "bible:en", "--output_dir", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=child_env(MMADAPT_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = metrics(out)
    assert rows[-1]["step"] == 200
    start = math.log(2000)  # a uniform guess over the tiny preset's 2,000 pieces
    first, last = rows[0]["head_losses"], rows[-1]["head_losses"]
    for head in ("4", "12"):
        assert first[head] < start + 0.5
        assert last[head] < first[head] - 1.0, (head, first[head], last[head])
    assert rows[-1]["tokens_per_s"] > 0 and rows[-1]["flops_per_s"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [p.name for p in sorted((out / "checkpoints").glob("step*/COMPLETE"))] == ["COMPLETE", "COMPLETE"]
    assert "done: step 200" in proc.stdout
