"""layers.dropout, the CPU dropout whose mask comes from 16-bit uniforms (four per 64-bit draw of
torch's generator) instead of bernoulli_: its distribution, its reproducibility, its gradient, and
the CPU attention path that uses it in training."""

import dataclasses
import math

import pytest
import torch

from mmadapt.models import PRESETS
from mmadapt.models.layers import Dropout, dropout, gpu_paths
from mmadapt.models.roberta.model import RobertaMLM, TransformerLayer, attention_mask
from mmadapt.parallel import MODEL_PARALLEL_RNG, seed_everything
from mmadapt.tokens import PAD_ID
from test_host_sync import SyncSpy

N = 1 << 22


def every_op(func, name) -> bool:  # SyncSpy's selector: count them all
    return True


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_each_element_is_kept_with_probability_k_over_2_16_and_scaled_by_its_inverse(p):
    torch.manual_seed(0)
    y = dropout(torch.ones(N), p)
    k = round((1 - p) * 65536)
    q = k / 65536
    kept = y.ne(0)
    assert abs(q - (1 - p)) <= 2**-17
    assert torch.equal(y[kept], torch.full_like(y[kept], 65536 / k))  # E[y] = x exactly
    sigma = math.sqrt(q * (1 - q) / N)
    assert abs(kept.float().mean().item() - q) < 6 * sigma
    # The four 16-bit lanes of one 64-bit draw are independent: neighbours are both kept with q^2.
    words = kept.view(-1, 4)
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        both = (words[:, a] & words[:, b]).float().mean().item()
        assert abs(both - q * q) < 6 * math.sqrt(q * q * (1 - q * q) / (N // 4)), (a, b)


def test_the_mask_is_seeded_and_the_gradient_is_the_same_mask():
    x = torch.randn(3, 50, 64, requires_grad=True)

    def draw(seed):
        torch.manual_seed(seed)
        return dropout(x, 0.1)
    y = draw(1)
    assert torch.equal(y, draw(1)) and not torch.equal(y, draw(2))
    y.backward(torch.ones_like(y))
    scale = torch.tensor(65536 / round(0.9 * 65536))
    assert torch.equal(x.grad, torch.where(y.ne(0), scale, 0.0))  # d y / d x: the forward's mask
    assert torch.equal(y[y.ne(0)], (x * scale)[y.ne(0)])


def test_it_is_the_identity_off_training_and_f_dropout_at_the_edges():
    x = torch.randn(1000)
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))  # k = 0: F.dropout's zeros
    layer = Dropout(0.2).eval()
    assert layer(x) is x
    torch.manual_seed(3)
    y = layer.train()(x)
    torch.manual_seed(3)
    assert torch.equal(y, dropout(x, 0.2))


def test_a_cpu_training_update_draws_no_bernoulli_mask():
    """Hidden and attention dropout on a CPU both come from layers.dropout: no bernoulli_ and no
    SDPA (whose math fallback would draw one) in a training forward and backward."""
    cfg = dataclasses.replace(PRESETS["tiny"][0], num_layers=2, head_layers=(2,), hidden_dropout=0.1,
                              attention_dropout=0.1)
    model = RobertaMLM(cfg, seed=1).train()
    ids = torch.randint(5, cfg.vocab_size, (4, 32))
    ids[1, 20:] = PAD_ID
    labels = torch.where(torch.rand(ids.shape) < 0.2, ids, torch.full_like(ids, -100))
    labels[1, 20:] = -100
    with SyncSpy(keep=every_op) as spy:
        loss = model(ids, labels)[0]
        loss.backward()
    assert torch.isfinite(loss)
    assert "random_" in spy.seen
    assert not {"bernoulli_", "bernoulli", "native_dropout", "scaled_dot_product_attention",
                "_scaled_dot_product_attention_math"} & set(spy.seen), spy.seen
    with gpu_paths(), SyncSpy(keep=every_op) as gpu:  # what a GPU runs, for counting its launches (test_host_sync)
        model(ids, labels)[0].backward()
    assert "bernoulli_" in gpu.seen and "random_" not in gpu.seen


def test_cpu_attention_with_dropout_is_masked_softmax_attention_times_the_mask():
    """TransformerLayer.attention in training on a CPU: softmax(q k^T / sqrt(hd) + padding) times
    the dropout mask drawn from the same generator, then @ v; a row of padding alone stays finite."""
    cfg = dataclasses.replace(PRESETS["tiny"][0], num_layers=1, attention_dropout=0.25)
    layer = TransformerLayer(cfg, 1, seed=5).train()
    b, s, nh, hd = 3, 12, cfg.num_attention_heads, cfg.head_dim
    x = torch.randn(b, s, cfg.hidden_size)
    ids = torch.full((b, s), 7)
    ids[1, 9:] = PAD_ID
    ids[2, :] = PAD_ID  # no key to attend to
    mask = attention_mask(ids, None)
    seed_everything(11)
    out = layer.attention(x, mask)
    seed_everything(11)
    with MODEL_PARALLEL_RNG.fork("cpu"):  # attention dropout's stream (its heads are split across TP ranks)
        keep = dropout(torch.ones(b, nh, s, s), 0.25)  # the same draw: the attention's only one
    with torch.no_grad():
        qkv, _ = layer.qkv(x)
        q, k, v = qkv.view(b, s, nh, 3, hd).permute(3, 0, 2, 1, 4)  # each [b, nh, s, hd]
        scores = torch.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~mask, -1e30).softmax(-1)
        ctx = (probs * keep) @ v
        ref, _ = layer.attn_out(ctx.transpose(1, 2).reshape(b, s, nh * hd))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:2], ref[:2], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(out[:2], layer.eval().attention(x, mask)[:2])  # dropout did act


def test_building_a_model_leaves_the_cuda_generators_as_seed_everything_seeded_them(monkeypatch):
    """Dropout on a GPU draws from the CUDA generator, which seed_everything seeds alike on every
    tensor-parallel rank of a stage. Building a model (each module's weights seeded apart,
    parallel.seeded) and seeding the model-parallel stream draw on the CPU generator alone:
    torch.manual_seed there would reseed every CUDA generator too (to the last module's seed, or
    to this rank's model-parallel one), and a model built later on one rank (Step 2's scoring
    model) would move that rank's masks off its peers'."""
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeds.append)
    seed_everything(7)
    assert seeds == [7]  # the default streams, once (rank 0 of stage 0: its stage's seed)
    before = torch.get_rng_state()
    RobertaMLM(PRESETS["tiny"][0])
    assert seeds == [7] and torch.equal(torch.get_rng_state(), before)  # nor the CPU stream, restored
