"""A training micro-batch never makes the host wait for the device, and launches few host ops.

On a GPU, an op whose result the host reads (`.item()`, `bool(t)`, `nonzero` and the boolean
gathers built on it) blocks the host until every queued kernel has run, so the next kernels
cannot be queued behind them. On the CPU nothing waits, but the same ops still pass through
the dispatcher: a TorchDispatchMode sees every one of them, so this test catches on CPU what
`torch.cuda.set_sync_debug_mode("error")` catches on a GPU.
"""

import collections
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import benchmark_module
from mmadapt.models import PRESETS
from mmadapt.engine import for_replicas, load_ds_config
from mmadapt.models.layers import gpu_paths
from mmadapt.models.roberta.model import Padding, RobertaMLM, attention_mask
from mmadapt.parallel import init_parallel
from mmadapt.models.pipe import set_host_batches
from mmadapt.models.roberta.pipeline import PipeMLMHeads, PipeTransformerLayer
from mmadapt.tokens import IGNORE_INDEX, PAD_ID
from mmadapt.train import batch_to_device, host_batch, lm_engine
from mmadapt.models import get_family

REPO = Path(__file__).resolve().parents[1]
# The ATen ops whose result the host reads (each one a device synchronisation on a GPU).
SYNCING = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal"}


class SyncSpy(TorchDispatchMode):
    """Counts, by name, the ATen ops dispatched inside it that `keep(func, name)` selects (default:
    the SYNCING ones)."""

    def __init__(self, keep=lambda func, name: name in SYNCING):
        super().__init__()
        self.keep, self.seen = keep, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.keep(func, name):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def padded_batch(cfg, b: int = 16, s: int = 64, real: int = 50, seed: int = 0):
    """Blocks of `real` tokens then padding (as sentence-aligned blocks end), 15% masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (b, s), generator=g)
    ids[:, real:] = PAD_ID
    pick = (torch.rand(b, s, generator=g) < 0.15) & ids.ne(PAD_ID)
    labels = torch.where(pick, ids, torch.full_like(ids, IGNORE_INDEX))
    return ids, labels


def zero2_engine(fusion: str = "none"):
    """The tiny preset's 12-layer MINIJOINT model (heads after 4 and 12) under ZeRO-2."""
    init_parallel(1, 1)
    model, train = PRESETS["tiny"]
    model = dataclasses.replace(model, head_layers=(4, 12), fusion=fusion)
    eng, _, _ = lm_engine(get_family(model), model, train, load_ds_config(REPO / "ds_configs" / "zero2.json", train))
    return eng


@pytest.fixture(scope="module")
def engine():
    return zero2_engine()


def micro_batch(engine, batch):
    """Forward and backward of one micro-batch, as train.lm_step runs it."""
    b = batch_to_device(batch, engine.device)
    loss, _ = engine(b.input_ids, masked_index=b.masked_index, targets=b.targets, padding=b.padding)
    engine.backward(loss)
    return loss


def test_a_training_micro_batch_reads_nothing_back_from_the_device(engine):
    batch = host_batch(*padded_batch(engine.module.config))
    assert batch.padding == (True, 16 * 50, 50)
    with SyncSpy() as spy:
        micro_batch(engine, batch)
    assert not spy.seen, f"host reads inside a micro-batch: {dict(spy.seen)}"
    engine.step()

    # The spy does see them: the same micro-batch with labels on the device (the model finds
    # the masked positions itself) gathers by a boolean mask and asks whether there is padding.
    ids, labels = padded_batch(engine.module.config, seed=1)
    with SyncSpy() as spy:
        loss, _ = engine(ids, labels)
    assert spy.seen["nonzero"] >= 1 and spy.seen["_local_scalar_dense"] >= 3, spy.seen
    engine.backward(loss)
    engine.step()


def test_host_batch_matches_what_the_model_would_find():
    cfg = PRESETS["tiny"][0]
    ids, labels = padded_batch(cfg)
    b = host_batch(ids, labels)
    assert torch.equal(b.targets, labels[labels.ge(0)])
    assert torch.equal(b.masked_index, labels.reshape(-1).ge(0).nonzero().squeeze(1))
    model = RobertaMLM(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0), seed=3).eval()
    with torch.no_grad():
        ref, ref_heads = model(ids, labels)
        got, got_heads = model(ids, masked_index=b.masked_index, targets=b.targets, padding=b.padding)
    assert torch.equal(ref, got) and torch.equal(ref_heads, got_heads)
    # No padding: no mask at all (what lets SDPA pick flash attention), same result as a mask of all True.
    full = torch.randint(5, cfg.vocab_size, (4, 64))
    assert host_batch(full, torch.full_like(full, IGNORE_INDEX)).padding == (False, 4 * 64, 64)
    assert attention_mask(full, None) is None and attention_mask(full, Padding(False, 256, 64), "varlen") is None
    with torch.no_grad():
        h_none = model.encode(full, (12,), padding=Padding(False, 256, 64))[0]
        h_mask = model.encode(full, (12,), padding=Padding(True, 256, 64))[0]
    torch.testing.assert_close(h_none, h_mask, rtol=1e-5, atol=1e-6)


def test_pipeline_stages_take_the_host_flags():
    """A pipeline stage's layers and heads use what set_host_batches hands them, in micro-batch
    order, and ask the device nothing."""
    cfg = dataclasses.replace(PRESETS["tiny"][0], hidden_dropout=0.0, attention_dropout=0.0, head_layers=(12,))
    layer, heads = PipeTransformerLayer(cfg, 1), PipeMLMHeads(cfg)
    stage = torch.nn.ModuleList([layer, heads])
    batches = [host_batch(*padded_batch(cfg, seed=k)) for k in range(2)]
    factors = (None, 0.5)  # train.per_token_factors': the heads scale the loss and what they log by it
    set_host_batches(stage, [b.padding for b in batches],
                     [(b.masked_index, b.targets, b.split, f) for b, f in zip(batches, factors)])
    assert list(layer.pending) == [b.padding for b in batches] and len(heads.pending) == 2
    word = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    hiddens = [torch.randn(*b.input_ids.shape, cfg.hidden_size) for b in batches]
    with SyncSpy() as spy, torch.no_grad():
        losses = [heads((*layer((h, b.input_ids, b.labels)), word)) for h, b in zip(hiddens, batches)]
    assert not spy.seen, dict(spy.seen)
    assert not heads.pending and not layer.pending
    logged = heads.head_losses[:2]
    # Each micro-batch was scored on its own masked positions: the same losses as when the
    # stage finds them on the device (nothing pending), times its factor.
    with torch.no_grad():
        for loss, per_head, h, b, f in zip(losses, logged, hiddens, batches, factors):
            alone = heads((*layer((h, b.input_ids, b.labels)), word))
            assert torch.equal(loss, alone if f is None else alone * f)
            assert torch.equal(per_head, heads.head_losses[-1] if f is None else heads.head_losses[-1] * f)


def host_ops_per_micro_batch(engine) -> int:
    from torch.profiler import ProfilerActivity, profile

    batch = host_batch(*padded_batch(engine.module.config, seed=2))
    for _ in range(3):  # warm (and, compiled, past the recompile for a symbolic m)
        micro_batch(engine, batch)
        engine.step()
    counts = []
    # The fewer of two: once, beside a second test worker, a compiled micro-batch's profile took
    # 8 s and counted 3,020 ops (compile work inside the window) where it counts about 750.
    for _ in range(2):
        with gpu_paths(), profile(activities=[ProfilerActivity.CPU]) as prof:  # the ops a GPU launches
            micro_batch(engine, batch)
        engine.step()
        counts.append(count_host_ops(prof.events()))
    return min(counts)


def test_host_ops_per_micro_batch(engine):
    """ATen calls the host makes for the forward and backward of one micro-batch of the 12-layer
    model under ds_configs/zero2.json (the reduction settings of zero2_bf16.json): each is a
    dispatch, most a kernel launch on a GPU. Measured here: 232 forward + 1,392 backward; with
    ZeRO-1 and contiguous gradients it was 266 + 2,977. What is left in eager mode is
    autograd's own work per parameter and per linear; --fusion compile removes most of it."""
    calls = host_ops_per_micro_batch(engine)
    assert calls <= 1700, f"{calls} host ops per micro-batch"


@pytest.mark.slow  # compiles the model (about a minute on 2 cores)
def test_host_ops_per_micro_batch_compiled():
    """The same micro-batch with --fusion compile: 110 forward + 643 backward here."""
    calls = host_ops_per_micro_batch(zero2_engine("compile"))
    assert calls <= 1500, f"{calls} host ops per micro-batch"


def count_host_ops(events) -> int:
    """Outermost ATen / c10d calls (those no other ATen call made)."""
    def outermost(e):
        p = e.cpu_parent
        while p is not None and not p.name.startswith(("aten::", "c10d::")):
            p = p.cpu_parent
        return p is None
    return sum(1 for e in events if e.name.startswith(("aten::", "c10d::")) and outermost(e))


def test_the_host_cost_benchmark_counts_launches_by_phase():
    """benchmarks/host_cost.py's profiled count (the one that also sees compiled updates), on an
    update whose launches are known: the forward is a linear (one addmm; its weight's transpose
    and the input's view launch nothing), a transpose made contiguous (one copy) and a GELU; the
    backward the loss's sum, its seed gradient (ones_like), GELU's gradient, the linear's two
    matmuls and its bias's sum (the first backward stores the gradients: no accumulation); the
    step one in-place add, an RMS norm (one launch, though ATen's calls another op named
    `aten::_fused_rms_norm`) and a kernel Inductor would have generated (its name in the trace,
    `*_fused_*`), which counts as one launch. Two CUDA runtime calls in the step (a graph's replay,
    a kernel launch) are the runtime's count, not operators."""
    host_cost = benchmark_module("host_cost")
    assert host_cost.view_like("aten::transpose") and host_cost.view_like("aten::view")
    assert host_cost.view_like("aten::detach") and not host_cost.view_like("aten::addmm")
    assert not host_cost.view_like("aten::copy_")
    # views with TorchScript overloads that are not (slice.t over lists, split.str): counted every
    # slice and narrow as a launch, DeepSpeed's flattening views among them
    assert all(host_cost.view_like(f"aten::{op}") for op in ("slice", "narrow", "split"))

    lin = torch.nn.Linear(4, 4)
    x, buffer = torch.randn(2, 4, requires_grad=True), torch.zeros(4)

    class Update:  # the three methods host_cost wraps on a DeepSpeed engine
        def forward(self, x):
            buffer[1:3].narrow(0, 0, 1)  # views: no launch
            return torch.nn.functional.gelu(lin(x.view(2, 4)).t().contiguous())

        def backward(self, y):
            y.sum().backward()

        def step(self):
            with torch.no_grad():
                lin.weight.add_(1.0)
                torch.nn.functional.rms_norm(lin.weight, (4,))  # calls aten::_fused_rms_norm: one launch
            with torch.profiler.record_function("graph_0_cpp_fused_add_0"):
                pass
            # On a GPU the CUDA runtime's calls are host events of these names (ProfilerActivity.CUDA):
            # a graph replay and a kernel launch, counted apart from the operators.
            for call in ("cudaGraphLaunch", "cudaLaunchKernel"):
                with torch.profiler.record_function(call):
                    pass

    engine = Update()

    def update():
        engine.backward(engine.forward(x))
        engine.step()

    by_phase, names, runtime = host_cost.profiled_launches(engine, update)
    assert by_phase["forward"] == 3, names  # linear, contiguous (its clone), gelu
    assert names == {"aten::linear": 1, "aten::contiguous": 1, "aten::gelu": 1, "aten::sum": 2, "aten::ones_like": 1,
                     "aten::gelu_backward": 1, "aten::mm": 2, "aten::add_": 1, "aten::rms_norm": 1,
                     "inductor kernel": 1}, names
    assert by_phase == {"forward": 3, "backward": 6, "step": 3}, by_phase
    assert runtime == {"step": 2}, runtime
    assert engine.forward.__func__ is Update.forward  # the wrapping is undone


@pytest.mark.parametrize("timers", [None, {"throughput": {"enabled": True}}])
def test_updates_never_synchronize_the_device(timers, monkeypatch):
    """Five updates through train_step call the accelerator's synchronize (a full device drain on a
    GPU; DeepSpeed's throughput timer makes two per update by default) not once; a JSON that
    configures DeepSpeed's timers itself gets them, syncs and all."""
    from deepspeed.accelerator import get_accelerator

    from mmadapt.train import train_step

    init_parallel(1, 1)
    model, train = PRESETS["tiny"]
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero2.json", train), 1)
    if timers is not None:
        ds["timers"] = timers
    eng, _, _ = lm_engine(get_family(model), model, train, ds)
    syncs = []
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *a, **k: syncs.append(1))
    for seed in range(5):
        train_step(eng, [host_batch(*padded_batch(model, b=4, s=32, real=30, seed=seed))], 1)
    assert len(syncs) == (0 if timers is None else 2 * (5 - 2)), len(syncs)  # two per update from the third


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_bf16_update_reads_nothing_back_from_the_device(clip, monkeypatch):
    """Three updates of one replica under bf16 (DeepSpeed's BF16_Optimizer, engine.for_replicas),
    forward, backward and optimizer step, read nothing back from the device
    (engine.sync_free_bf16_step). DeepSpeed's own step reads its gradient norm once per update to
    skip a non-finite one, and once more to decide whether to clip: the spy sees those. fp32 at
    one replica (torch's fused AdamW, engine.foreach_clip) reads nothing either."""
    import mmadapt.engine as engine_mod
    from mmadapt.train import lm_step

    model, train = PRESETS["tiny"]
    train = dataclasses.replace(train, gradient_clipping=clip)
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero2_bf16.json", train), 1)
    batches = [host_batch(*padded_batch(model, b=4, s=32, real=30, seed=seed)) for seed in range(4)]
    fp32 = for_replicas(load_ds_config(REPO / "ds_configs" / "zero2.json", train), 1)
    reads = {}
    for mine in (True, False, "fp32"):
        if not mine:
            monkeypatch.setattr(engine_mod, "sync_free_bf16_step", lambda opt: False)
        init_parallel(1, 1)
        eng, _, _ = lm_engine(get_family(model), model, train, fp32 if mine == "fp32" else ds)
        assert type(eng.optimizer).__name__ == ("AdamW" if mine == "fp32" else "BF16_Optimizer")
        lm_step(eng, batches[:1], 1)  # the first step links the optimizer's state (once)
        with SyncSpy() as spy:
            for b in batches[1:]:
                lm_step(eng, [b], 1)
        reads[mine] = sum(spy.seen.values())
    assert reads == {True: 0, False: 3 * (1 if clip == 0 else 2), "fp32": 0}, reads


def test_a_frozen_encoder_layers_backward_copies_the_qkv_gradient_once():
    """The backward of one frozen encoder layer (Step 2's body) launches, besides its math, a
    single copy: the stack of the q, k and v gradients straight into the QKV output's layout. The
    split used to unbind a permuted leading axis, whose backward stacked them in another layout
    and copied that again to make it contiguous (a `clone` per layer)."""
    from mmadapt.models.roberta.model import TransformerLayer

    init_parallel(1, 1)
    cfg = dataclasses.replace(PRESETS["tiny"][0], hidden_dropout=0.0, attention_dropout=0.0)
    layer = TransformerLayer(cfg, 1).requires_grad_(False)
    x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
    y = layer(x)
    with SyncSpy(keep=lambda func, name: not func.is_view) as spy:  # every op that is not a view
        y.sum().backward()
    assert spy.seen == {"sum": 1, "ones_like": 1, "native_layer_norm_backward": 2, "mm": 4, "gelu_backward": 1,
                        "add": 2, "_scaled_dot_product_flash_attention_for_cpu_backward": 1, "stack": 1}, spy.seen


def test_a_weighted_two_text_micro_batch_copies_nothing_from_the_host():
    """MINIJOINT with --head_weights and Step 2's replay (two texts' losses): no tensor is made
    from host data inside the micro-batch (ATen's lift_fresh on a CPU): on a GPU each such tensor
    is a pageable host-to-device copy, which torch follows with a stream synchronisation. The
    weights and the two texts' counts used to be made so every micro-batch."""
    init_parallel(1, 1)
    model, _ = PRESETS["tiny"]
    cfg = dataclasses.replace(model, num_layers=4, head_layers=(2, 4), head_weights=(0.25, 0.75))
    mlm = RobertaMLM(cfg)
    ids, labels = padded_batch(cfg, b=4, s=32, real=30)
    b = host_batch(ids, labels, replay_rows=2)
    assert b.split is not None and 0 < b.split < len(b.targets)
    mlm(b.input_ids, masked_index=b.masked_index, targets=b.targets, padding=b.padding, split=b.split)  # warm
    with SyncSpy(keep=lambda func, name: name in SYNCING or name == "lift_fresh") as spy:
        loss, logged = mlm(b.input_ids, masked_index=b.masked_index, targets=b.targets, padding=b.padding,
                           split=b.split)
        loss.backward()
    assert not spy.seen, f"host data made into tensors, or read back, inside a micro-batch: {dict(spy.seen)}"
    assert logged.shape == (2 + 4,)  # each head's loss, then the two texts' (sum, count) pairs
    assert logged[3].item() == b.split and logged[5].item() == len(b.targets) - b.split
