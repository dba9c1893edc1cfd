"""One data-parallel replica trains without ZeRO (engine.for_replicas) and with torch's fused
AdamW (engine.adamw): the same updates as ZeRO and as torch's reference AdamW loop, and a
checkpoint resumes under the optimizer that wrote it."""

import collections
import dataclasses
import json

import pytest
import torch

from conftest import REPO
from mmadapt import checkpoint
from mmadapt.config import LoopConfig
from mmadapt.engine import adamw, for_replicas, load_ds_config
from mmadapt.models import PRESETS, get_family
from mmadapt.parallel import init_parallel
from mmadapt.tokens import IGNORE_INDEX
from mmadapt.train import host_batch, lm_engine, lm_step, train_step

MODEL = dataclasses.replace(PRESETS["tiny"][0], num_layers=2, vocab_size=300, hidden_dropout=0.0, attention_dropout=0.0)


def train_config(clip: float):
    return dataclasses.replace(PRESETS["tiny"][1], train_micro_batch_size_per_gpu=4, seq_length=32, lr=1e-3,
                               lr_warmup_iters=1, train_iters=100, gradient_clipping=clip)


def batches(n: int = 3):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(5, MODEL.vocab_size, (4, 32), generator=g)
        labels = torch.where(torch.rand(4, 32, generator=g) < 0.15, ids, torch.full_like(ids, IGNORE_INDEX))
        out.append(host_batch(ids, labels))
    return out


def run(ds: dict, train, updates: int = 3):
    """(losses, final weights, optimizer class) of `updates` updates of MODEL under `ds`, each of
    train.gradient_accumulation_steps micro-batches."""
    init_parallel(1, 1)
    torch.manual_seed(0)
    engine, names, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
    k = train.gradient_accumulation_steps
    bs = batches(updates * k)
    losses = [train_step(engine, bs[i * k:(i + 1) * k], 1).item() for i in range(updates)]
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return losses, weights, type(engine.optimizer).__name__, engine


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_one_replica_without_zero_takes_zeros_updates(clip):
    """ZeRO-2 as the JSON says it, and the stage-0 run one replica gets instead: the same losses
    and weights after three updates, to rounding. Both step torch's fused AdamW, ZeRO over its
    flat partition and stage 0 tensor by tensor, with the same gradients and learning rates; on
    an AVX-512 AMD EPYC its CPU kernel computes exp_avg_sq of a tensor's last few elements (its
    scalar tail) one ulp apart from the vector body's, so one element of the 300-piece output bias
    moved by 1 ulp (an Intel machine gave equal weights bit for bit). With clipping the gradient
    norm is summed in another order: weights to 1e-6, 1.3e-7 measured."""
    train = train_config(clip)
    ds = load_ds_config(REPO / "ds_configs" / "zero2.json", train)
    zl, zw, zopt, zero = run(ds, train)
    ol, ow, oopt, one = run(for_replicas(ds, 1), train)
    assert (zopt, oopt) == ("DeepSpeedZeroOptimizer", "AdamW")
    # No all-reduce over a group of one (ZeRO reduces through it: kept there).
    assert (zero.enable_backward_allreduce, one.enable_backward_allreduce) == (True, False)
    # One replica clears only the trained tensors' gradients (build_engine); ZeRO clears its own.
    assert "zero_grad" in vars(one) and "zero_grad" not in vars(zero)
    # A few ulps; a missing weight decay (lr x 0.01 per update) would move weights by 1e-5 relative.
    tol = {"rtol": 1e-6, "atol": 1e-9} if clip == 0 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.tensor(ol), torch.tensor(zl), **tol)
    for n in zw:
        torch.testing.assert_close(ow[n], zw[n], **tol, msg=n)
    assert not torch.equal(ow["layers.0.qkv.weight"], run(ds, train, updates=0)[1]["layers.0.qkv.weight"])


def test_zero_offload_trains_as_zero2_does(tmp_path):
    """A JSON that offloads the optimizer state to the CPU (docs/cluster.md: trained as given) was
    refused by DeepSpeed inside deepspeed.initialize, a traceback: ZeRO-Offload takes no client
    optimizer unless zero_force_ds_cpu_optimizer is false, and mmadapt builds torch's AdamW. It
    trains now: three updates as ZeRO-2's, losses and weights."""
    train = train_config(0.0)
    ds = load_ds_config(REPO / "ds_configs" / "zero2.json", train)
    (tmp_path / "offload.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}))
    offload = load_ds_config(tmp_path / "offload.json", train)
    assert offload["zero_force_ds_cpu_optimizer"] is False and for_replicas(offload, 1) == offload
    for falsy in (False, 0, None):  # what DeepSpeed reads as false is taken (its true refused: test_bad_input)
        (tmp_path / "falsy.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu"}}, "zero_force_ds_cpu_optimizer": falsy}))
        assert load_ds_config(tmp_path / "falsy.json", train) == offload
    zl, zw, _, _ = run(ds, train)
    ol, ow, oopt, engine = run(offload, train)
    assert oopt == "DeepSpeedZeroOptimizer" and engine.zero_cpu_offload()
    torch.testing.assert_close(torch.tensor(ol), torch.tensor(zl), rtol=1e-6, atol=1e-9)
    for n in zw:
        torch.testing.assert_close(ow[n], zw[n], rtol=1e-6, atol=1e-9, msg=n)


def test_fused_adamw_takes_torchs_reference_steps():
    """engine.adamw (fused) against torch's single-tensor loop, five steps, two groups."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 11)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    loop = LoopConfig(weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-6)
    fused = adamw([{"params": a[::2], "weight_decay": 0.1}, {"params": a[1:2], "weight_decay": 0.0}], loop, 1e-2)
    ref = torch.optim.AdamW([{"params": b[::2], "weight_decay": 0.1}, {"params": b[1:2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.98), eps=1e-6, foreach=False)
    assert fused.defaults["fused"]
    for _ in range(5):
        g = [torch.randn(s) for s in shapes]
        for ps, opt in ((a, fused), (b, ref)):
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_what_for_replicas_changes():
    ds2 = {"zero_optimization": {"stage": 2, "overlap_comm": True}, "zero_allow_untested_optimizer": True,
           "gradient_clipping": 1.0}
    assert for_replicas(ds2, 2) == ds2  # ZeRO partitions over two replicas: kept
    assert for_replicas(ds2, 1) == {**ds2, "zero_optimization": {"stage": 0}}
    bf16 = {**ds2, "bf16": {"enabled": True}}
    assert for_replicas(bf16, 1) == {**bf16, "zero_optimization": {"stage": 1},
                                     "data_types": {"grad_accum_dtype": "fp32"}}
    bucketed = {**bf16, "zero_optimization": {**bf16["zero_optimization"], "reduce_bucket_size": 1000}}
    assert for_replicas(bucketed, 1)["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    fp16 = {**ds2, "fp16": {"enabled": True}}
    assert for_replicas(fp16, 1) == fp16  # no fp32 master mmadapt can reach without ZeRO
    assert for_replicas({"zero_optimization": {"stage": 0}}, 1) == {"zero_optimization": {"stage": 0}}
    # What only ZeRO gives, kept as given: offloading (to fit a model on one device), and gradients
    # accumulated in another precision than fp32
    offloaded = {**bf16, "zero_optimization": {**bf16["zero_optimization"], "offload_optimizer": {"device": "cpu"}}}
    assert for_replicas(offloaded, 1) == offloaded
    assert for_replicas({**ds2, "zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}, 1)[
        "zero_optimization"]["stage"] == 2
    not_offloaded = {**ds2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    assert for_replicas(not_offloaded, 1)["zero_optimization"] == {"stage": 0}
    bf16_accumulated = {**bf16, "data_types": {"grad_accum_dtype": "bf16"}}
    assert for_replicas(bf16_accumulated, 1) == bf16_accumulated


def test_a_run_converted_at_one_replica_resumes_converted_whatever_its_json_asks(tmp_path):
    """A run whose checkpoints one replica wrote without ZeRO (before offloading JSONs were kept
    as given) resumes without it: its tags hold that optimizer's state, not ZeRO's."""
    tag = tmp_path / "step00000002"
    tag.mkdir()
    (tag / "COMPLETE").write_text(json.dumps({"step": 2, "files": {}, "ds_optimizer": "BF16_Optimizer"}))
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                 "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    assert for_replicas(offloaded, 1)["zero_optimization"]["stage"] == 2  # a new run: as given
    assert for_replicas(offloaded, 1, tmp_path)["zero_optimization"] == {"stage": 1}


def test_a_checkpoint_resumes_under_the_optimizer_that_wrote_it(tmp_path):
    """A checkpoint written under ZeRO (before one replica ran without it, or with ZeRO asked
    for) resumes under ZeRO, and exactly; one written without it resumes without it."""
    train = train_config(0.0)
    ds = load_ds_config(REPO / "ds_configs" / "zero2.json", train)
    ref, _, _, _ = run(ds, train, updates=3)
    for given, optimizer in ((ds, "DeepSpeedZeroOptimizer"), (for_replicas(ds, 1), "AdamW")):
        ckpt = tmp_path / optimizer / "checkpoints"
        losses, _, _, engine = run(given, train, updates=2)
        names = {n: n for n, _ in engine.module.named_parameters()}
        checkpoint.save(engine, ckpt, 2, {}, names)
        assert checkpoint.written_by(ckpt) == optimizer
        resumed = for_replicas(ds, 1, ckpt)
        assert resumed == given
        init_parallel(1, 1)
        engine, _, _ = lm_engine(get_family(MODEL), MODEL, train, resumed)
        checkpoint.load(engine, ckpt, checkpoint.latest_tag(ckpt))
        assert train_step(engine, [batches(3)[2]], 1).item() == pytest.approx(ref[2], rel=1e-6)
    # A tag from before the optimizer was recorded was written under the JSON's ZeRO stage.
    complete = ckpt / checkpoint.latest_tag(ckpt) / "COMPLETE"
    record = json.loads(complete.read_text())
    record.pop("ds_optimizer")
    complete.write_text(json.dumps(record))
    assert checkpoint.written_by(ckpt) == "" and for_replicas(ds, 1, ckpt) == ds


def test_foreach_clipping_clips_as_deepspeed_does():
    """A stage-0 fp32 engine clips with engine.foreach_clip; DeepSpeed's own clip_grad_norm_ (what
    its clip_fp32_gradients calls) gives the same norms and, after three clipped updates, the same
    weights (1e-6: the norms are summed in another order)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    train = train_config(1.0)
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero1.json", train), 1)
    norms, weights = {}, {}
    for mine in (True, False):
        init_parallel(1, 1)
        torch.manual_seed(0)
        engine, _, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
        assert "clip_fp32_gradients" in vars(engine)  # the override is installed
        seen = norms.setdefault(mine, [])
        clip = (engine.clip_fp32_gradients if mine else
                lambda e=engine: clip_grad_norm_(parameters=e.module.parameters(), max_norm=1.0, mpu=e.mpu))
        engine.clip_fp32_gradients = lambda clip=clip, seen=seen: seen.append(float(clip()))
        for b in batches(3):
            train_step(engine, [b], 1)
        weights[mine] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert len(norms[True]) == 3 and min(norms[True]) > 1.0  # every update clipped
    assert norms[True] == pytest.approx(norms[False], rel=1e-6)
    for n in weights[False]:
        torch.testing.assert_close(weights[True][n], weights[False][n], rtol=1e-5, atol=1e-6, msg=n)


def bf16_ds(train, bucket: int | None = None, immediate: bool | None = None) -> dict:
    """zero2_bf16.json as a run of one replica trains under it (for_replicas), with this
    reduce_bucket_size and bf16 immediate_grad_update where given."""
    given = load_ds_config(REPO / "ds_configs" / "zero2_bf16.json", train)
    if bucket is not None:
        given["zero_optimization"]["reduce_bucket_size"] = bucket
    if immediate is not None:
        given["bf16"]["immediate_grad_update"] = immediate
    return for_replicas(given, 1)


@pytest.mark.parametrize("clip, accumulate, bucket", [(0.0, 1, None), (1.0, 1, None), (1.0, 2, None), (0.0, 2, 5000)])
def test_bf16_flat_gradients_take_deepspeeds_updates(clip, accumulate, bucket, monkeypatch):
    """One replica under bf16 (DeepSpeed's BF16_Optimizer) reading its flat fp32 gradient buffers
    (engine.flat_bf16_grads), stepping without reading the device (engine.sync_free_bf16_step) and
    adding its gradients into them a bucket at a time (engine.bucketed_bf16_grads: the JSON's
    40M elements hold this model whole; 5,000 make 12 buckets of its 33 tensors, 8 of them one
    tensor larger than the bucket, one of 22 small ones) against DeepSpeed's own tensor-by-tensor
    adding, reading and step: the same losses and weights after three updates, bit for bit without
    clipping (the fused cast-and-add is exact); with clipping the norm is summed in another order
    (weights to 1e-5 relative; the gradient norm itself to 1e-5: 1.8e-6 measured with two
    micro-batches accumulated per update, a case tested too)."""
    import mmadapt.engine as engine_mod

    train = dataclasses.replace(train_config(clip), gradient_accumulation_steps=accumulate)
    ds = bf16_ds(train, bucket)
    fl, fw, fopt, flat = run(ds, train)
    assert flat.zero_reduce_bucket_size() == (bucket or 40_000_000)
    skipped = []  # the optimizers build_engine would have handed to flat_bf16_grads
    monkeypatch.setattr(engine_mod, "flat_bf16_grads", lambda opt, pipe: skipped.append(opt))
    dl, dw, dopt, own = run(ds, train)
    assert (fopt, dopt) == ("BF16_Optimizer", "BF16_Optimizer") and skipped == [own.optimizer]
    assert flat.optimizer.get_grads_for_norm.__qualname__.startswith("flat_bf16_grads")
    assert own.optimizer.get_grads_for_norm.__qualname__ == "BF16_Optimizer.get_grads_for_norm"
    assert flat.optimizer.step.__qualname__.startswith("sync_free_bf16_step")  # build_engine applies both
    assert own.optimizer.step.__qualname__ == "BF16_Optimizer.step"
    exact = {"rtol": 0, "atol": 0}
    # the fp32 master weights; the module's bf16 copies may round a last bit apart where they differ
    masters = [torch.cat(o.optimizer.fp32_groups_flat_partition) for o in (flat, own)]
    torch.testing.assert_close(*masters, **(exact if clip == 0 else {"rtol": 1e-5, "atol": 1e-7}))
    torch.testing.assert_close(torch.tensor(fl), torch.tensor(dl), **(exact if clip == 0 else {"rtol": 1e-3, "atol": 0}))
    for n in fw:
        torch.testing.assert_close(fw[n], dw[n], **(exact if clip == 0 else {"rtol": 2**-7, "atol": 1e-6}), msg=n)
    norms = [torch.as_tensor(o.get_global_grad_norm()).float() for o in (flat, own)]
    torch.testing.assert_close(*norms, rtol=1e-5, atol=0)
    assert not torch.equal(fw["layers.0.qkv.weight"], run(ds, train, updates=0)[1]["layers.0.qkv.weight"])


def bf16_engine(bucket: int | None = None, immediate: bool | None = None):
    """MODEL's engine under bf16_ds (unclipped)."""
    init_parallel(1, 1)
    train = train_config(0.0)
    torch.manual_seed(0)
    return lm_engine(get_family(MODEL), MODEL, train, bf16_ds(train, bucket, immediate))[0]


@pytest.mark.parametrize("bucket, immediate, ops", [(None, None, {"cat": 2, "add_": 2}),
                                                    (5000, None, {"cat": 1, "add_": 12}),
                                                    (None, True, {"add_": 33})])
def test_bf16_gradients_are_added_a_bucket_at_a_time(bucket, immediate, ops):
    """What one backward launches to add MODEL's 33 bf16 gradients into their fp32 slots
    (engine.bucketed_bf16_grads): the JSON's 40M elements make one bucket of each parameter group
    (one cat and one add each); 5,000 make 12 buckets, 11 of them one tensor (an add, no cat) and
    one of 22 small ones, the first added while the backward still runs. A JSON that sets
    immediate_grad_update keeps DeepSpeed's add per tensor as each arrives (it frees each bf16
    gradient at once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.order = collections.Counter(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            self.order.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    engine, count = bf16_engine(bucket, immediate), Count()
    backward = engine.backward

    def counted(loss, **kwargs):
        with count:
            return backward(loss, **kwargs)
    engine.backward = counted
    lm_step(engine, batches(1), 1)
    assert {k: v for k, v in count.ops.items() if k in ("cat", "add_")} == ops
    if bucket is not None:  # a bucket of the last layer is added while the backward goes on below it
        last_matmul = max(i for i, name in enumerate(count.order) if name in ("mm", "addmm", "bmm"))
        assert count.order.index("add_") < last_matmul


def test_a_bf16_backward_that_reaches_some_tensors_adds_exactly_their_gradients():
    """engine.bucketed_bf16_grads where a backward leaves buckets incomplete: every other trained
    tensor gets a gradient of ones (the loss is their sum), so most buckets of 5,000 elements lack
    a member. At the backward's end each fp32 slot holds exactly its tensor's gradient (1 or 0), a
    second backward adds as much again, and no bf16 gradient is left."""
    engine = bf16_engine(5000)
    opt = engine.optimizer
    params = [p for group in opt.bf16_groups for p in group]
    reached = {id(p) for p in params[::2]}
    for n in (1, 2):
        engine.backward(sum(p.float().sum() for p in params if id(p) in reached))
        assert all(p.grad is None for p in params)
        for i, group in enumerate(opt.bf16_groups):
            for j, p in enumerate(group):
                want = float(n) if id(p) in reached else 0.0
                slot = opt.fp32_groups_gradients[i][j]
                assert torch.equal(slot, torch.full_like(slot, want)), (i, j)


def test_one_replica_under_bf16_steps_on_its_fp32_accumulated_gradient(monkeypatch):
    """One replica under bf16 (BF16_Optimizer) accumulating two micro-batches: DeepSpeed's
    all-reduce over the group of one is off (build_engine), so the step reads the fp32 sum of the
    two bf16 gradients as it is. The all-reduce cast that buffer to bf16 (DeepSpeed's
    communication_data_type) and back, which rounded every element to a bf16 value."""
    train = dataclasses.replace(train_config(0.0), gradient_accumulation_steps=2)
    ds = bf16_ds(train)
    init_parallel(1, 1)
    torch.manual_seed(0)
    engine, _, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer" and not engine.enable_backward_allreduce
    seen, step = [], engine.optimizer.step

    def read_then_step(*args, **kwargs):
        seen.append(torch.cat([g.clone() for g in engine.optimizer.fp32_groups_actual_gradients_flat]))
        return step(*args, **kwargs)
    monkeypatch.setattr(engine.optimizer, "step", read_then_step)
    train_step(engine, batches(2), 1)
    (flat,) = seen
    assert flat.abs().sum() > 0
    assert not torch.equal(flat, flat.bfloat16().float())  # sums that bf16 cannot hold: not rounded


def test_the_flat_bf16_gradients_apply_under_a_deepspeed_without_autoep():
    """DeepSpeed 0.19.0 and earlier have no AutoEP folding: their BF16_Optimizer has no
    `autoep_folding_tp_group`, and reading it raised AttributeError in every one-replica bf16
    run's build (setup.py admits DeepSpeed 0.19.0). Without the attribute the flat path applies."""
    from mmadapt.engine import flat_bf16_grads

    engine = bf16_engine()
    vars(engine.optimizer).pop("autoep_folding_tp_group", None)  # under DeepSpeed 0.19.0 it is already absent
    assert flat_bf16_grads(engine.optimizer, is_pipe=False)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_non_finite_gradient_skips_the_bf16_step_on_the_device(clip, tmp_path, monkeypatch):
    """An infinite gradient (a finite loss) in the second of three updates under bf16 at one
    replica. DeepSpeed's own step sees it on the host and skips: weights, fp32 masters, Adam's
    moments and step counts as after the first update. engine.sync_free_bf16_step leaves the same
    state, bit for bit, without reading the device: the flag (engine.found_inf) says so, and
    train_loop stops there as diverged, naming the update, with nothing saved."""
    import mmadapt.engine as engine_mod
    from mmadapt.config import TrainConfig
    from mmadapt.engine import LoopJob, found_inf, train_loop
    from mmadapt.faults import Diverged

    train = train_config(clip)
    ds = bf16_ds(train)

    def two_updates():
        """(engine, its state before any update, after update 1, after update 2 whose gradient is
        infinite)"""
        init_parallel(1, 1)
        torch.manual_seed(0)
        engine, _, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
        opt, poison = engine.optimizer, [False]
        engine.module.layers[0].fc1.weight.register_hook(lambda g: g * float("inf") if poison[0] else g)

        def state():
            return {"masters": torch.cat(opt.fp32_groups_flat_partition).clone(),
                    "weights": [p.detach().clone() for p in engine.module.parameters()],
                    "moments": [t.clone() for s in opt.optimizer.state.values() for t in s.values()]}
        states = [state()]
        for k, b in enumerate(batches(2)):
            poison[0] = k == 1
            assert torch.isfinite(train_step(engine, [b], 1)).all()
            states.append(state())
        return engine, states

    mine, got = two_updates()
    assert mine.optimizer.step.__qualname__.startswith("sync_free_bf16_step")
    assert found_inf(mine).item() == 1.0 and mine.was_step_applied()  # the host was not told
    monkeypatch.setattr(engine_mod, "sync_free_bf16_step", lambda opt: False)
    own, ref = two_updates()
    assert found_inf(own) is None and not own.was_step_applied()  # DeepSpeed asked the device
    for states in (got, ref):
        assert not torch.equal(states[1]["masters"], states[0]["masters"])  # the first update trained
        assert len(states[1]["moments"]) == 3 * len(mine.optimizer.optimizer.param_groups)  # step, m, v
        torch.testing.assert_close(states[2], states[1], rtol=0, atol=0)  # the second changed nothing
    torch.testing.assert_close(got, ref, rtol=0, atol=0)

    # train_loop: the flag is a divergence at the update it belongs to, and nothing is saved.
    monkeypatch.undo()
    init_parallel(1, 1)
    torch.manual_seed(0)
    engine, _, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
    engine.module.layers[0].fc1.weight.register_hook(lambda g: g * float("inf") if len(seen) == 2 else g)
    seen = []

    def step_fn(position):
        seen.append(position)
        return lm_step(engine, [batches(3)[position]], 1)

    job = LoopJob(step="adapt", names={}, client_state={}, exclude_frozen=False)
    loop = TrainConfig(log_interval=1, save_interval=10**6)
    with pytest.raises(Diverged, match=r"adapt: the loss \(or its gradient\) is not finite at update 2 \(of 3\)"):
        train_loop(engine, step_fn, job, loop, 3, run_dir=tmp_path, resume=False)
    assert seen == [0, 1] and not (tmp_path / "checkpoints").exists()


def test_a_bf16_checkpoint_resumes_exactly(tmp_path):
    """One replica under bf16 (BF16_Optimizer with the flat gradients and the sync-free step):
    two updates, a checkpoint, a new engine that loads it, and the third update's loss and every
    fp32 master weight after it are those of three updates without the stop, bit for bit; the
    resumed engine steps with the sync-free step too."""
    train = train_config(1.0)
    ds = bf16_ds(train)
    ref, _, _, straight = run(ds, train, updates=3)
    ckpt = tmp_path / "checkpoints"
    _, _, _, engine = run(ds, train, updates=2)
    checkpoint.save(engine, ckpt, 2, {}, {n: n for n, _ in engine.module.named_parameters()})
    assert checkpoint.written_by(ckpt) == "BF16_Optimizer"
    init_parallel(1, 1)
    torch.manual_seed(1)  # not the run's seed: the checkpoint must bring everything back
    resumed, _, _ = lm_engine(get_family(MODEL), MODEL, train, ds)
    checkpoint.load(resumed, ckpt, checkpoint.latest_tag(ckpt))
    assert resumed.optimizer.step.__qualname__.startswith("sync_free_bf16_step")
    assert train_step(resumed, [batches(3)[2]], 1).item() == ref[2]
    masters = [torch.cat(e.optimizer.fp32_groups_flat_partition) for e in (resumed, straight)]
    torch.testing.assert_close(*masters, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def uneven_batches() -> list:
    """Two micro-batches of 4 rows, the second masking at most 2 positions a row."""
    first, second = batches(2)
    kept = second.labels.ge(0).cumsum(1).le(2)
    return [first, host_batch(second.input_ids, second.labels.where(kept, IGNORE_INDEX))]


def gradients_and_losses(monkeypatch, updates: list[list], per_token: bool) -> tuple[list[dict], list[float]]:
    """The gradients each optimizer step of MODEL is given, and the logged losses, over `updates`
    (each a list of micro-batches: the accumulation is its length), the weights never moving."""
    grads, losses = [], []
    for micro in updates:
        train = dataclasses.replace(train_config(0.0), gradient_accumulation_steps=len(micro))
        init_parallel(1, 1)
        torch.manual_seed(0)
        engine, _, _ = lm_engine(get_family(MODEL), MODEL, train,
                                 for_replicas(load_ds_config(REPO / "ds_configs" / "zero1.json", train), 1))
        monkeypatch.setattr(engine.optimizer, "step", lambda *a, engine=engine, **kw: grads.append(
            {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}))
        losses.append(train_step(engine, micro, 1, per_token).item())
    return grads, losses


def test_accumulated_micro_batches_leave_the_mean_gradient(monkeypatch):
    """engine.backward has DeepSpeed divide the loss by the accumulation only where it is more
    than 1 (scale_wrt_gas): one micro-batch per update leaves its own gradient, two accumulated
    ones (as means of their micro-batches, calculate_per_token_loss false) the mean of theirs
    (divided once: not their sum, not a quarter of it). DeepSpeed 0.19.0, setup.py's floor,
    divides nowhere else: there, never dividing gives the sum and fails this."""
    bs = batches(2)
    (one, two, both), _ = gradients_and_losses(monkeypatch, [bs[:1], bs[1:], bs], per_token=False)
    assert both.keys() == one.keys() and len(both) > 10
    for n in both:
        torch.testing.assert_close(both[n], (one[n] + two[n]) / 2, rtol=1e-5, atol=1e-8, msg=n)
    assert not torch.allclose(one["layers.0.qkv.weight"], two["layers.0.qkv.weight"])


def test_a_per_token_update_is_the_same_however_it_is_split(monkeypatch):
    """calculate_per_token_loss (the default): an update of two micro-batches that mask m1 and m2
    positions has the gradient and loss of one micro-batch of all their rows: each micro-batch's
    weighted m_i / (m1 + m2), by hand; as the mean of their means (false) it has not."""
    bs = uneven_batches()
    m1, m2 = (len(b.targets) for b in bs)
    assert m1 > 2 * m2 > 0  # else the two weightings would nearly agree
    merged = host_batch(torch.cat([b.input_ids for b in bs]), torch.cat([b.labels for b in bs]))
    (one, two, both, whole), losses = gradients_and_losses(monkeypatch, [bs[:1], bs[1:], bs, [merged]], True)
    for n in both:
        # atol: rounding of sums of ~0.3 (the largest entries) at fp32
        torch.testing.assert_close(both[n], (m1 * one[n] + m2 * two[n]) / (m1 + m2), rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(both[n], whole[n], rtol=1e-5, atol=1e-6, msg=n)
    assert losses[2] == pytest.approx((m1 * losses[0] + m2 * losses[1]) / (m1 + m2), rel=1e-6)
    assert losses[2] == pytest.approx(losses[3], rel=1e-6)
    (old,), (old_loss,) = gradients_and_losses(monkeypatch, [bs], per_token=False)
    assert not torch.allclose(old["layers.0.qkv.weight"], whole["layers.0.qkv.weight"], rtol=1e-4)
    assert old_loss != pytest.approx(losses[3], rel=1e-4)


def test_per_token_updates_log_each_replay_texts_loss_per_scored_piece():
    """With replay (its rows first in a micro-batch: the split), the two texts' logged (loss sum,
    count) pairs are not weighted by the loss factors: over two micro-batches of uneven counts
    their ratios are each text's loss per scored piece, as one micro-batch of all the rows logs
    them (weighted, each micro-batch's would count by its scored positions twice)."""
    from mmadapt.microbatch import merged

    bs = uneven_batches()
    micro = [(b.input_ids, b.labels, 2) for b in bs]  # 2 replay rows of 4 in each
    (ids, labels, rows), = merged(micro, 2)
    logged = []
    for update in ([host_batch(*m[:2], replay_rows=2) for m in micro], [host_batch(ids, labels, replay_rows=rows)]):
        train = dataclasses.replace(train_config(0.0), gradient_accumulation_steps=len(update))
        init_parallel(1, 1)
        torch.manual_seed(0)
        engine, _, _ = lm_engine(get_family(MODEL), MODEL, train,
                                 for_replicas(load_ds_config(REPO / "ds_configs" / "zero1.json", train), 1))
        logged.append(lm_step(engine, update, 1 + 4))
    two, one = logged
    assert two[0].item() == pytest.approx(one[0].item(), rel=1e-5)  # the update's loss
    for text in (1, 3):  # source, then target: sum / count
        assert (two[text] / two[text + 1]).item() == pytest.approx((one[text] / one[text + 1]).item(), rel=1e-5)


@pytest.mark.parametrize("config", ["zero2.json", "zero1_bf16.json"])
def test_every_file_of_a_checkpoint_is_flushed_to_disk_before_it_is_complete(tmp_path, monkeypatch, config):
    """Each rank fsyncs the files it wrote (DeepSpeed's, through its checkpoint engine, and
    mmadapt's own) before the barrier that lets COMPLETE be written: a node lost after COMPLETE
    must not leave a tag whose data were still in a write-back cache, the older tags pruned."""
    train = train_config(0.0)
    _, _, _, engine = run(load_ds_config(REPO / "ds_configs" / config, train), train, updates=1)
    flushed = []
    fsync_files = checkpoint._fsync_files
    monkeypatch.setattr(checkpoint, "_fsync_files", lambda paths: (flushed.extend(paths), fsync_files(paths)))
    names = {n: n for n, _ in engine.module.named_parameters()}
    tag = checkpoint.save(engine, tmp_path, 1, {}, names)
    files = {p.name for p in (tmp_path / tag).iterdir() if p.is_file() and p.name != "COMPLETE"}
    assert {p.name for p in map(type(tmp_path), flushed)} == files and len(files) >= 3, (flushed, files)
    assert not hasattr(engine.checkpoint_engine, "__dict__") or "save" not in vars(engine.checkpoint_engine)
