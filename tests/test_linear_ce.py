"""A head whose logits exceed layers.LOGITS_BUDGET projects and scores chunk by chunk
(layers.linear_cross_entropy): the same loss and gradients as the [m, Vp] logits path."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mmadapt.models import PRESETS, get_family
from mmadapt.models import layers
from mmadapt.models.layers import linear_cross_entropy, vocab_linear


def test_chunked_loss_and_gradients_equal_the_full_logits():
    """Two row blocks (a frozen source block and a trained new block, as an expanded vocabulary
    has them) with biases, 10 rows in chunks of 3: loss and every gradient against
    F.cross_entropy over the full logits, fp32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    source = torch.randn(20, 16, generator=g)  # frozen
    new = torch.randn(7, 16, generator=g, requires_grad=True)
    b_src, b_new = torch.randn(20, generator=g), torch.randn(7, generator=g, requires_grad=True)
    targets = torch.tensor([0, 5, 19, 20, 26, 3, 21, 7, 25, 1])
    ref = F.cross_entropy(vocab_linear(x, (source, new), (b_src, b_new)), targets, reduction="sum")
    ref_grads = torch.autograd.grad(2.5 * ref, (x, new, b_new))
    got = linear_cross_entropy(x, (source, new), (b_src, b_new), targets, chunk=3)
    got_grads = torch.autograd.grad(2.5 * got, (x, new, b_new))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # 2.2e-6 measured, on logits of std 4


def test_under_no_grad_it_computes_the_loss_alone():
    """An evaluation over the budget (no_grad: a parameter's requires_grad is still True) runs one
    matmul per chunk, the logits', and no gradient's; the same loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Matmuls.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 16, generator=g, requires_grad=True), torch.randn(20, 16, generator=g, requires_grad=True)
    targets = torch.arange(10)
    with Matmuls():
        trained = linear_cross_entropy(x, (w,), None, targets, chunk=3)
    assert Matmuls.n == 3 * 4  # 4 chunks: the logits, x's gradient, w's
    Matmuls.n = 0
    with torch.no_grad(), Matmuls():
        scored = linear_cross_entropy(x, (w,), None, targets, chunk=3)
    assert Matmuls.n == 4 and torch.equal(scored, trained.detach())


def test_the_flop_counter_sees_every_product():
    """FlopCounterMode (what tests/test_flops.py and a user check the exact count with) sees the
    logits' product and both gradients' over every chunk: 3 x 2·m·h·V. x's gradient went through
    addmm_, which it has no entry for, and a Qwen2-shaped Step 2 read 5% below its count."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    m, h, v = 10, 16, 20
    x, w = torch.randn(m, h, generator=g, requires_grad=True), torch.randn(v, h, generator=g, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(x, (w,), None, torch.arange(m), chunk=3).backward()
    assert counter.get_total_flops() == 3 * 2 * m * h * v


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny", "bert-tiny"])
def test_a_model_over_the_budget_takes_the_same_step(preset, monkeypatch):
    """A decoder (every next piece scored, untied output) and two encoders (masked pieces, tied
    projection + bias), two heads each, with the budget set below their logits: the loss, each
    head's loss and every parameter's gradient equal the unchunked model's (fp32, 1e-5)."""
    cfg = dataclasses.replace(PRESETS[preset][0], num_layers=2, vocab_size=300, hidden_dropout=0.0,
                              attention_dropout=0.0, head_layers=(1, 2))
    decoder = cfg.family == "llama"
    if decoder:
        cfg = dataclasses.replace(cfg, share_embeddings_and_output_weights=False)
    model = get_family(cfg).build_lm(cfg, 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 300, (3, 16), generator=g)
    labels = ids.clone() if decoder else torch.where(torch.rand(3, 16, generator=g) < 0.3, ids, -100)

    def step():
        model.zero_grad(set_to_none=True)
        loss, per_head = model(ids, labels)
        loss.backward()
        return loss.detach(), per_head, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_heads, ref_grads = step()
    m = int(labels.ge(0).sum())
    monkeypatch.setattr(layers, "LOGITS_BUDGET", m * 300 // 4)  # four chunks
    chunks = []
    monkeypatch.setattr(layers, "linear_cross_entropy",
                        lambda *a, **k: chunks.append(a[-1]) or linear_cross_entropy(*a, **k))
    got_loss, got_heads, got_grads = step()
    assert chunks == [m // 4] * 2  # both heads took the chunked path
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_heads, ref_heads, rtol=1e-6, atol=1e-6)
    assert set(got_grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(got_grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
