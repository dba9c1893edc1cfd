"""Tensor parallel 2, pipeline parallel 2 and ZeRO-2 over 2 gloo ranks (and TP2 x PP2 over 4)
against one process.

All runs use the same seed and global batch of 16 blocks: the single-process reference uses 2
micro-batches of 8 (gradient accumulation); ZeRO-2 uses 2 data-parallel ranks of 8. Dropout is
off, so the only differences left are floating-point reduction orders.
"""

import json

import numpy as np
import pytest
import torch

from conftest import LAYOUTS, NO_DROPOUT, base_args, metrics, run_pretrain
from mmadapt.checkpoint import load_full_state_dict
from mmadapt.config import ModelConfig
from mmadapt.models.roberta import ROBERTA

pytestmark = pytest.mark.slow

STEPS = 3


def _args(corpus, tokenizer, out, *extra):
    # A clip that binds at every update: each layout's norm is over every stage's and tensor
    # rank's gradients, each counted once (engine.foreach_clip; ZeRO-2's own)
    return base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--train_iters", str(STEPS),
                     "--log_interval", "1", "--train_micro_batch_size_per_gpu", "8", "--gradient_clipping", "0.05",
                     *NO_DROPOUT, *extra)


@pytest.fixture(scope="module")
def reference(corpus, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_pretrain(1, *_args(corpus, tokenizer, out, "--ds_config", "ds_configs/zero0.json",
                           "--gradient_accumulation_steps", "2"))
    return out


def _heads(rows):
    return np.array([[r["head_losses"]["4"], r["head_losses"]["12"]] for r in rows])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_rank_layout_matches_single_process(layout, reference, corpus, tokenizer, tmp_path):
    nproc, extra = LAYOUTS[layout]
    run_pretrain(nproc, *_args(corpus, tokenizer, tmp_path, *extra))
    ref, got = metrics(reference), metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    # MINIJOINT's loss is the mean of its two heads' losses, in every layout.
    np.testing.assert_allclose([r["loss"] for r in got], _heads(got).mean(1), rtol=1e-6)
    # Training moved the weights, and every layout moved them the same way.
    init_like = load_full_state_dict(reference / "checkpoints")
    mine = load_full_state_dict(tmp_path / "checkpoints")
    assert sorted(mine) == sorted(init_like)
    for name, ref_w in init_like.items():
        torch.testing.assert_close(mine[name], ref_w, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name} differs")
    if layout in ("pp2", "tp2_pp2"):
        # The second head's layer (4) sits on stage 0; both heads run on stage 1 (pipeline.py).
        run = json.loads((tmp_path / "run.json").read_text())
        parts, layers = run["pipeline_parts"], ROBERTA.pipeline_layer_prefixes(ModelConfig(**run["model"]))
        assert parts[0] <= layers.index("layers.3.") < parts[1]  # transformer layer 4
        assert parts[1] <= layers.index("heads.") < parts[2]  # PipeMLMHeads on the last stage
        # The tied embedding's two copies (on stage 0, and the last stage's) stayed equal.
        tag = tmp_path / "checkpoints" / "step00000003"
        first = torch.load(tag / "layer_00-model_00-model_states.pt")["word_embeddings.weight"]
        last = torch.load(tag / f"layer_{layers.index(None):02d}-model_00-model_states.pt")["word_embeddings.weight"]
        torch.testing.assert_close(first, last, rtol=0, atol=0)


@pytest.fixture(scope="module")
def odd_reference(corpus, odd_tokenizer, tmp_path_factory):
    """One process at a 999-piece vocabulary."""
    out = tmp_path_factory.mktemp("single_odd")
    run_pretrain(1, *_args(corpus, odd_tokenizer, out, "--vocab_size", "999", "--ds_config", "ds_configs/zero0.json",
                           "--gradient_accumulation_steps", "2"))
    return out


@pytest.mark.parametrize("layout", ["tp2", "tp2_pp2"])
def test_a_vocabulary_padded_for_tensor_parallel_2_trains_as_the_unpadded_one(layout, odd_reference, corpus,
                                                                             odd_tokenizer, tmp_path):
    """A 999-piece vocabulary at tensor parallel 2 (padded to 1,000 rows, ModelConfig.padded_vocab_size:
    roberta-base's 50,265 and XLM-R's 250,002 at TP 4 are such vocabularies), alone and with
    pipeline parallel 2 (the tied embedding's copy on the last stage), against one process at
    999: the same losses (the padding row's logit is -inf, not in the softmax) and the same full
    weights, 999 rows each, from the ranks' checkpoint."""
    nproc, extra = LAYOUTS[layout]
    run_pretrain(nproc, *_args(corpus, odd_tokenizer, tmp_path, "--vocab_size", "999", *extra))
    ref, got = metrics(odd_reference), metrics(tmp_path)
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    mine, theirs = load_full_state_dict(tmp_path / "checkpoints"), load_full_state_dict(odd_reference / "checkpoints")
    assert sorted(mine) == sorted(theirs)
    for name, ref_w in theirs.items():
        torch.testing.assert_close(mine[name], ref_w, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name} differs")
    assert mine["word_embeddings.word_embeddings.weight"].shape[0] == 999
    tag = tmp_path / "checkpoints" / "step00000003"
    client = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert client["tp_vocab_padded_from"] == {"word_embeddings.word_embeddings.weight": 999,
                                              "heads.heads.0.bias": 999, "heads.heads.1.bias": 999}
    if layout == "tp2":
        rows = torch.load(tag / "mp_rank_01_model_states.pt", weights_only=False)["module"][
            "word_embeddings.word_embeddings.weight"]
        assert rows.shape[0] == 500 and not rows[-1].any()  # rows 500..999, the last padding: zero, never moved


def test_weights_changed_from_initialisation(reference, corpus, tokenizer, tmp_path):
    """Guards the comparison above against comparing two untrained models."""
    run_pretrain(1, *_args(corpus, tokenizer, tmp_path, "--ds_config", "ds_configs/zero0.json",
                           "--gradient_accumulation_steps", "2", "--train_iters", "1", "--lr", "1e-30"))  # lr > 0: ~init
    untrained = load_full_state_dict(tmp_path / "checkpoints")
    trained = load_full_state_dict(reference / "checkpoints")
    for name in ("word_embeddings.word_embeddings.weight", "layers.0.qkv.weight", "heads.heads.0.dense.weight"):
        assert not torch.allclose(untrained[name], trained[name]), name


SHM_PROBE = """
import os, torch, deepspeed.comm as dscomm
from mmadapt import parallel
parallel.init_parallel(1, 1)
t = torch.full((1000,), float(parallel.dist.get_rank() + 1))
dscomm.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce, after its names are gone
# One string, one write: the launcher runs python -u, where print's pieces are separate writes
# that two ranks could interleave.
print(f"rank {parallel.dist.get_rank()} sum {float(t[0])} buffer left {os.path.exists(parallel.shm_allreduce_buffer())}")
"""


def test_deepspeed_cpu_allreduce_buffers_leave_no_trace_in_dev_shm(tmp_path):
    """DeepSpeed's CPU all-reduce creates a 66 MB /dev/shm file per rank and never removes it;
    init_distributed unlinks them once every rank has mapped them, and the all-reduce still works."""
    import glob
    import re
    import subprocess

    from conftest import REPO, _port, child_env

    script = tmp_path / "probe.py"
    script.write_text(SHM_PROBE)
    port = _port()
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), str(script)],
                          capture_output=True, text=True, timeout=300, env=child_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d sum [\d.]+ buffer left (?:True|False)", proc.stdout))
    assert lines == ["rank 0 sum 3.0 buffer left False", "rank 1 sum 3.0 buffer left False"], proc.stdout[-2000:]
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


WORLD_OF_ONE_PROBE = """
import os, socket, torch
from mmadapt import parallel
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
port = taken.getsockname()[1]
# Another run already holds the port: the one left in the environment (when the test asks), and
# the one this process would pick free if it picked one (the race: a port found free is taken
# before torch's store binds it; mmadapt before 358e9e0 picked it with parallel.free_port).
if os.environ.get("PROBE_LEFT_PORT"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
parallel.free_port = lambda: port
parallel.init_parallel(1, 1)
t = torch.ones(2)
parallel.dist.all_reduce(t)
print("world", parallel.dist.get_world_size(), "sum", float(t.sum()), "any", parallel.any_rank(True))
"""


@pytest.mark.parametrize("left", ["", "1"])
def test_a_world_of_one_needs_no_port(left, tmp_path):
    """A plain `python` run (each demo worker is one) starts whatever ports other runs hold: two
    runs starting together once both picked the same free port and one failed, EADDRINUSE."""
    import subprocess
    import sys

    from conftest import REPO, child_env

    script = tmp_path / "probe.py"
    script.write_text(WORLD_OF_ONE_PROBE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=str(REPO), PROBE_LEFT_PORT=left))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 1 sum 2.0 any True" in proc.stdout, proc.stdout[-2000:]
