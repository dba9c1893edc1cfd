"""benchmarks/device_traffic.py: the bytes it counts per operator, against hand-computed ones,
and through a real update's optimizer step."""

from __future__ import annotations

import collections

import pytest
import torch

from conftest import benchmark_module
from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.engine import for_replicas, load_ds_config
from mmadapt.models import get_family
from mmadapt.parallel import init_parallel
from mmadapt.tokens import IGNORE_INDEX, NUM_SPECIAL
from mmadapt.train import LMJob, host_batch, lm_engine, train_step

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def traffic():
    return benchmark_module("device_traffic")


def counted(traffic, fn) -> collections.Counter:
    """Bytes by (category, operator) of what fn dispatches."""
    t = traffic.Traffic()
    with t.mode:
        fn()
    out = collections.Counter()
    for (_, cat, op), b in t.bytes.items():
        out[(cat, op)] += b
    return out


def test_bytes_follow_what_each_operator_reads_and_writes(traffic):
    a, b = torch.randn(4, 8), torch.randn(4, 8)  # 128 bytes each in fp32
    row = torch.randn(8)  # 32 bytes
    dst = torch.empty(4, 8, dtype=torch.bfloat16)  # 64 bytes
    assert counted(traffic, lambda: a + b) == {("memory", "add"): 3 * 128}
    assert counted(traffic, lambda: a.clone().add_(b)) == {("memory", "clone"): 2 * 128, ("memory", "add_"): 3 * 128}
    # A broadcast input is read once: its 8 elements, not the 32 it stands for.
    assert counted(traffic, lambda: a * row.expand(4, 8)) == {("memory", "mul"): 128 + 32 + 128}
    # A destination that is only overwritten is not read; the cast writes 2 bytes per element.
    assert counted(traffic, lambda: dst.copy_(a)) == {("memory", "copy_"): 128 + 64}
    assert counted(traffic, lambda: a.clone().zero_()) == {("memory", "clone"): 256, ("memory", "zero_"): 128}
    # Views and allocations move nothing; a reduction reads its input and writes its result.
    assert counted(traffic, lambda: a.view(-1)[:5].sum()) == {("memory", "sum"): 5 * 4 + 4}
    assert counted(traffic, lambda: torch.empty_like(a)) == {}
    # Matrix products are their own category (their time goes with FLOPs); so are collectives.
    assert set(counted(traffic, lambda: a @ b.t())) == {("matmul", "mm")}
    assert traffic.category("allreduce_") == "communication" and traffic.category("add_") == "memory"
    # out= arguments (keyword-only, written) are not read: a's 128 bytes in, 4 maxima and their indices out
    values, indices = torch.empty(4), torch.empty(4, dtype=torch.long)
    assert counted(traffic, lambda: torch.max(a, 1, out=(values, indices))) == {("memory", "max"): 128 + 16 + 32}
    # A lookup reads the rows it returns, not the table: 5 ids (int64) and 5 rows of 64 bytes, 5 rows out.
    table, ids = torch.randn(100, 16), torch.tensor([3, 1, 4, 1, 5])
    assert counted(traffic, lambda: torch.nn.functional.embedding(ids, table)) == {
        ("memory", "embedding"): 40 + 2 * 320}
    # index_put_ writes (and, accumulating, reads) the positions its values go to: 3 ids, 3 rows of 16 bytes.
    dst, rows, vals = torch.zeros(10, 4), torch.tensor([0, 2, 7]), torch.ones(3, 4)
    assert counted(traffic, lambda: dst.index_put_((rows,), vals)) == {("memory", "index_put_"): 24 + 48 + 48}
    assert counted(traffic, lambda: dst.index_put_((rows,), vals, accumulate=True)) == {
        ("memory", "index_put_"): 24 + 48 + 48 + 48}


def test_the_loss_reads_one_log_probability_per_row(traffic):
    """nll_loss gathers m values of its [m, V] input, and its backward writes the [m, V] gradient
    without reading the input it is handed for its shape."""
    m, v = 6, 50
    logp = torch.randn(m, v).log_softmax(-1).requires_grad_()
    target = torch.randint(0, v, (m,))

    def loss():
        torch.nn.functional.nll_loss(logp, target).backward()
    got = counted(traffic, loss)
    assert got[("memory", "nll_loss_forward")] == 8 * m + 4 + 4  # targets (int64) in; the loss and total weight out
    # grad_output and total weight (4 bytes each) and the targets read, the [m, V] gradient written
    assert got[("memory", "nll_loss_backward")] == 4 + 8 * m + 4 + 4 * m * v


def test_the_depth_fit_and_the_micro_batch_line(traffic):
    small, large = traffic.Traffic(), traffic.Traffic()
    small.bytes[("forward", "memory", "gelu")], large.bytes[("forward", "memory", "gelu")] = 10, 18
    small.bytes[("step", "memory", "_fused_adamw_")] = large.bytes[("step", "memory", "_fused_adamw_")] = 7
    at = traffic.extended(small, large, 2, 4, 32)
    assert at == {("forward", "memory", "gelu"): 18 + 28 * 4, ("step", "memory", "_fused_adamw_"): 7}
    large.bytes[("forward", "memory", "masked_fill")] = 5  # an operator one count ran and the other did not
    with pytest.raises(ValueError, match="ran different operators"):
        traffic.extended(small, large, 2, 4, 32)
    rows = [{"step": "adapt", "layers": n, "x": 3.0 + 2.0 * n} for n in (4, 6, 12)] + [
        {"step": "pretrain", "layers": 12, "x": 100.0}]
    fit = traffic.depth_fit(rows, "x")
    assert fit["per_layer"] == pytest.approx(2.0) and fit["at_no_depth"] == pytest.approx(3.0)


def test_an_updates_optimizer_step_moves_what_adamw_needs(traffic):
    """One fp32 Step-2 update of a small encoder through train_step, one replica under zero1.json:
    the fused AdamW step reads and writes each trainable parameter, its m and v (4 bytes each,
    read and written) and reads its gradient: 28 bytes per parameter, and its step count (4 bytes
    per tensor, read; torch increments it in a separate op)."""
    init_parallel(1, 1)
    cfg = ModelConfig(hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=300, num_layers=2,
                      max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, fusion="none")
    train = TrainConfig(seq_length=16, train_micro_batch_size_per_gpu=2, train_iters=10, lr=1e-3, lr_warmup_iters=1)
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero1.json", train), 1)
    family = get_family(cfg)
    engine, _, _ = lm_engine(family, cfg, train, ds, LMJob(step="adapt", trainable=family.vocab_params(cfg)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(NUM_SPECIAL, cfg.vocab_size, (2, 16), generator=g)
    labels = torch.where(torch.rand(2, 16, generator=g) < 0.3, ids, torch.full_like(ids, IGNORE_INDEX))
    batch = host_batch(ids, labels, False)
    t = traffic.count(engine, lambda: train_step(engine, [batch], 1))
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    adamw = sum(b for (phase, _, op), b in t.bytes.items() if phase == "step" and op == "_fused_adamw_")
    assert adamw == 28 * sum(p.numel() for p in trained) + 4 * len(trained)
    # The forward and backward moved bytes too, and the phases are the engine's.
    assert {k[0] for k in t.bytes} >= {"forward", "backward", "step"}


class Inner(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x) * 3


def test_work_inside_the_compiled_kinds_is_told_apart_forward_and_backward(traffic):
    """What runs in an instance of the compiled kinds, and the backward of what it made, is the
    category a compiled update hands to Inductor; the rest (here the doubling before it, the
    scaling by 5 after it and the loss's sum) stays eager, forward and backward."""
    inner = Inner()
    x = torch.randn(8, requires_grad=True)

    class Update:  # what count() wraps: an engine's forward, backward and step, and its module
        module = inner

        def forward(self, x):
            return (inner(x * 2) * 5).sum()

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

    engine = Update()
    t = traffic.count(engine, lambda: engine.backward(engine.forward(x)), (Inner,))
    cats = {(phase, op): cat for phase, cat, op in t.bytes}
    assert cats[("forward", "gelu")] == "memory, compiled kinds"
    assert cats[("backward", "gelu_backward")] == "memory, compiled kinds"
    assert cats[("forward", "sum")] == "memory"
    # the muls: x * 2 and * 5 outside, * 3 inside; their backward likewise
    inside = {k for k in t.bytes if k[1] == "memory, compiled kinds"}
    assert {(p, op) for p, _, op in inside} == {("forward", "gelu"), ("forward", "mul"), ("backward", "mul"),
                                                 ("backward", "gelu_backward")}
    assert t.calls[("forward", "memory", "mul")] == 2 and t.calls[("forward", "memory, compiled kinds", "mul")] == 1
    assert t.calls[("backward", "memory", "mul")] == 2 and t.calls[("backward", "memory, compiled kinds", "mul")] == 1


def test_inductor_kernels_count_what_they_read_and_write(traffic):
    """A compiled graph counts, each time it runs, the bytes of its generated kernels: a matrix
    product's output read once and the fused ReLU + 1 written once (the product itself left out,
    as in the eager count), 2 x 64 x 64 x 4 bytes per call."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    t = traffic.Traffic()
    with traffic.inductor_bytes():
        f = torch.compile(lambda a, b: (a @ b).relu() + 1, dynamic=False)
        f(a, b)
        traffic._COUNTING[0] = t
        try:
            f(a, b)
            f(a, b)
        finally:
            traffic._COUNTING[0] = None
    assert t.bytes == {("other", "inductor", "compiled graphs"): 2 * 2 * 64 * 64 * 4}
    assert t.calls == {("other", "inductor", "compiled graphs"): 2}
    # Attention is left out likewise: the doubling after it reads its output and writes its own.
    q = torch.randn(1, 2, 16, 8)
    t = traffic.Traffic()
    with traffic.inductor_bytes():
        g = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q) * 2, dynamic=False)
        g(q)
        traffic._COUNTING[0] = t
        try:
            g(q)
        finally:
            traffic._COUNTING[0] = None
    assert t.bytes == {("other", "inductor", "compiled graphs"): 2 * q.numel() * 4}
