"""What one step hands the next: under bf16 the fp32 master weights, not their bf16 rounding;
and a TP=1 model needs no process group (evaluation, export, notebooks)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from conftest import REPO, VOCAB, child_env
from mmadapt import checkpoint, steps
from mmadapt.config import apply_recipe
from mmadapt.models import PRESETS
from mmadapt.family import WORD
from mmadapt.models.roberta import ROBERTA
from mmadapt.models.roberta.model import BIAS
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights


@pytest.fixture(scope="module")
def bf16_run(corpus, tokenizer, tmp_path_factory):
    """Step 1 under ds_configs/zero1_bf16.json in this process (DeepSpeed's CPU accelerator runs bf16)."""
    init_parallel(1, 1)
    out = tmp_path_factory.mktemp("bf16")
    model = dataclasses.replace(apply_recipe(PRESETS["tiny"][0], "minijoint"), vocab_size=VOCAB, num_layers=4,
                                head_layers=(2, 4))
    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=3, save_interval=3, log_interval=1,
                                train_micro_batch_size_per_gpu=4, seq_length=32, lr=1e-3)
    steps.pretrain(run=RunSpec(output_dir=out, corpus=corpus, ds_config=REPO / "ds_configs" / "zero1_bf16.json",
                               tokenizer=tokenizer), step=steps.Pretrain(model=model, train=train, recipe="minijoint"))
    return out



def test_bf16_run_hands_on_its_fp32_master_weights(bf16_run):
    """One replica under bf16 trains with DeepSpeed's BF16_Optimizer (engine.for_replicas): the
    weights handed on are its fp32 master copy as DeepSpeed itself reads it back from the
    checkpoint (safe_get_full_fp32_param of an engine that resumed it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from mmadapt.engine import for_replicas, load_ds_config
    from mmadapt.train import LMJob, lm_engine

    tag = checkpoint.latest_tag(bf16_run / "checkpoints")
    assert checkpoint.written_by(bf16_run / "checkpoints") == "BF16_Optimizer"
    handed = checkpoint.load_full_state_dict(bf16_run / "checkpoints", tag)
    module = torch.load(bf16_run / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module["layers.0.qkv.weight"].dtype == torch.bfloat16  # what DeepSpeed's module file holds
    cfg, _ = load_weights(bf16_run)
    train = dataclasses.replace(PRESETS["tiny"][1], train_micro_batch_size_per_gpu=4)
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero1_bf16.json", train), 1, bf16_run / "checkpoints")
    engine, names, _ = lm_engine(ROBERTA, cfg, train, ds, LMJob())
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    checkpoint.load(engine, bf16_run / "checkpoints", tag)
    master = {names[n]: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if names[n]}
    assert set(handed) == set(master)
    for name, value in master.items():
        assert handed[name].dtype == torch.float32, name
        assert torch.equal(handed[name], value.float()), name
    # ...and it is not the bf16 rounding: most weights are not representable in bf16.
    w = handed["layers.0.qkv.weight"]
    assert (w != w.bfloat16().float()).float().mean() > 0.9


def test_fp32_masters_of_tensor_parallel_ranks_merge_shards_and_keep_one_replicated_copy(tmp_path):
    """Each tensor-parallel rank's fp32 master file holds its shard of a split weight and its own
    copy of every replicated one (a LayerNorm, a row-parallel layer's bias, the position
    embedding): the full state concatenates the first and takes one copy of the second (it read
    a partition dim that a replicated weight has none of: KeyError, every bf16 run at TP > 1)."""
    d = tmp_path / "step00000001"
    d.mkdir()
    split, norm = torch.randn(4, 3), torch.randn(3)
    for rank in range(2):
        module = {"fc.weight": split[2 * rank:2 * rank + 2].bfloat16(), "norm.weight": norm.bfloat16()}
        torch.save({"module": module, "tp_partition_dims": {"fc.weight": 0}, "model_config": {}},
                   d / f"mp_rank_{rank:02d}_model_states.pt")
        torch.save({"fc.weight": split[2 * rank:2 * rank + 2], "norm.weight": norm}, d / f"fp32_tp{rank:02d}_pp00.pt")
    state = checkpoint.load_full_state_dict(tmp_path, "step00000001")
    assert torch.equal(state["fc.weight"], split) and torch.equal(state["norm.weight"], norm)


@pytest.mark.slow
def test_a_bf16_run_at_tensor_parallel_2_hands_on_its_fp32_master_weights(corpus, odd_tokenizer, tmp_path):
    """Step 1 under zero1_bf16.json on 2 tensor-parallel ranks, a 999-piece vocabulary padded to
    1,000 rows: its full state reads (fp32, 999 rows), and each weight is the fp32 master whose
    bf16 rounding the module file holds."""
    from conftest import base_args, run_pretrain

    run_pretrain(2, *base_args(corpus, odd_tokenizer, tmp_path, "--vocab_size", "999", "--recipe", "minijoint",
                               "--train_iters", "3", "--save_interval", "3", "--train_micro_batch_size_per_gpu", "8",
                               "--tensor_model_parallel_size", "2", "--ds_config", "ds_configs/zero1_bf16.json"))
    tag = tmp_path / "checkpoints" / "step00000003"
    state = checkpoint.load_full_state_dict(tmp_path / "checkpoints")
    assert state["word_embeddings.word_embeddings.weight"].shape == (999, 64) and state[BIAS].shape == (999,)
    dims = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["tp_partition_dims"]
    module = [torch.load(tag / f"mp_rank_{r:02d}_model_states.pt", weights_only=False)["module"] for r in (0, 1)]
    # one copy of a replicated weight stands for every rank's: they are the same, bit for bit
    masters = [torch.load(tag / f"fp32_tp{r:02d}_pp00.pt") for r in (0, 1)]
    replicated = [k for k in masters[0] if k not in dims]
    assert "embeddings.position_embeddings.weight" in replicated
    assert all(torch.equal(masters[0][k], masters[1][k]) for k in replicated)
    for name, value in state.items():
        assert value.dtype == torch.float32, name
        bf16 = torch.cat([m[name] for m in module], dims[name]) if name in dims else module[0][name]
        assert torch.equal(value.bfloat16(), bf16[:len(value)]), name


@pytest.mark.parametrize("replicas", [1, None])
def test_a_step_starts_from_exact_fp32_weights_under_bf16(bf16_run, replicas):
    """DeepSpeed builds its master copy from the module after casting it to bf16; the engine puts
    the given starting weights back, so Step 2 trains from Step 1's fp32 weights: under
    BF16_Optimizer (one replica, engine.for_replicas) and under ZeRO (the JSON as given)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from mmadapt.engine import for_replicas, load_ds_config
    from mmadapt.train import LMJob, lm_engine

    cfg, state = load_weights(bf16_run)
    cfg, init = ROBERTA.extract_minijoint(cfg, state)
    train = dataclasses.replace(PRESETS["tiny"][1], train_micro_batch_size_per_gpu=4)
    ds = load_ds_config(REPO / "ds_configs" / "zero1_bf16.json", train)
    if replicas:
        ds = for_replicas(ds, replicas)
    engine, _, _ = lm_engine(ROBERTA, cfg, train, ds, LMJob(step="adapt", trainable=(WORD, BIAS)), init)
    assert type(engine.optimizer).__name__ == ("BF16_Optimizer" if replicas else "DeepSpeedZeroOptimizer")
    params = dict(engine.module.named_parameters())
    for name in (WORD, BIAS):
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(safe_get_full_fp32_param(params[name]).cpu(), init[name]), name


# A TP=1 MINIJOINT forward and backward; leaves `result` = (loss, a gradient's sum).
FORWARD_BACKWARD = """
import dataclasses, torch
from mmadapt.config import apply_recipe
from mmadapt.models import PRESETS
from mmadapt.models.roberta.model import RobertaMLM
cfg = dataclasses.replace(apply_recipe(PRESETS["tiny"][0], "minijoint"), hidden_dropout=0.0, attention_dropout=0.0)
model = RobertaMLM(cfg, seed=11)
g = torch.Generator().manual_seed(0)
ids = torch.randint(5, cfg.vocab_size, (2, 24), generator=g)
labels = torch.where(torch.rand(2, 24, generator=g) < 0.3, ids, -100)
loss, _ = model(ids, labels)
loss.backward()
result = (loss.item(), model.layers[0].qkv.weight.grad.abs().sum().item())
"""


def test_tp1_model_needs_no_process_group():
    fresh = FORWARD_BACKWARD + "import torch.distributed as dist\nassert not dist.is_initialized()\nprint(repr(result))"
    proc = subprocess.run([sys.executable, "-c", fresh], cwd=REPO, capture_output=True, text=True,
                          env=child_env(PYTHONPATH=str(REPO)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same model in a process that has its (trivial) process groups: the same numbers.
    init_parallel(1, 1)
    here: dict = {}
    exec(FORWARD_BACKWARD, here)
    assert repr(here["result"]) == proc.stdout.strip().splitlines()[-1]
