"""attention_impl "varlen" (jagged tensors of the real tokens) against "sdpa" with a mask and
"math": the same losses and gradients on padded batches, fp32 on CPU."""

import dataclasses

import pytest
import torch

from mmadapt.models import PRESETS
from mmadapt.models.roberta.model import Jagged, Padding, RobertaForTask, RobertaMLM, attention_mask
from mmadapt.parallel import seed_everything
from mmadapt.tokens import IGNORE_INDEX, PAD_ID
from mmadapt.train import host_batch

CFG = dataclasses.replace(PRESETS["tiny"][0], num_layers=4, head_layers=(2, 4), hidden_dropout=0.0,
                          attention_dropout=0.0)


def ragged_batch(lengths=(64, 50, 17, 33, 5, 64), s=64, seed=0):
    """Rows of different lengths (two without padding), 15% of real tokens masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, CFG.vocab_size, (len(lengths), s), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n:] = PAD_ID
    pick = (torch.rand(ids.shape, generator=g) < 0.15) & ids.ne(PAD_ID)
    return ids, torch.where(pick, ids, torch.full_like(ids, IGNORE_INDEX))


def loss_and_grads(impl: str, ids, labels, padding=None):
    model = RobertaMLM(dataclasses.replace(CFG, attention_impl=impl), seed=7)
    b = host_batch(ids, labels)
    loss, per_head = model(ids, masked_index=b.masked_index, targets=b.targets,
                           padding=b.padding if padding is None else padding)
    loss.backward()
    return loss.detach(), per_head, {n: p.grad for n, p in model.named_parameters()}


def test_jagged_layout_lists_the_real_tokens_in_order():
    ids, _ = ragged_batch()
    j = attention_mask(ids, Padding.of(ids), "varlen")
    assert isinstance(j, Jagged)
    assert torch.equal(j.token_index, ids.reshape(-1).ne(PAD_ID).nonzero().squeeze(1))
    assert j.offsets.tolist() == [0, 64, 114, 131, 164, 169, 233] and j.max_len == 64
    assert Padding.of(ids) == (True, 233, 64)


@pytest.mark.parametrize("ref", ["sdpa", "math"])
def test_varlen_matches_masked_attention(ref):
    ids, labels = ragged_batch()
    loss, heads, grads = loss_and_grads("varlen", ids, labels)
    ref_loss, ref_heads, ref_grads = loss_and_grads(ref, ids, labels)
    torch.testing.assert_close(heads, ref_heads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_varlen_without_padding_is_plain_attention():
    ids, labels = ragged_batch(lengths=(64, 64, 64))
    assert not Padding.of(ids).any
    loss, _, _ = loss_and_grads("varlen", ids, labels)
    ref, _, _ = loss_and_grads("sdpa", ids, labels)
    assert torch.equal(loss, ref)  # the same path: no mask, no packing


def test_varlen_task_model_scores_real_positions_as_sdpa():
    """Span logits (padding at -inf) and the classification head on <s> agree."""
    ids, _ = ragged_batch(seed=3)
    for kind, n in (("span", 2), ("classify", 3), ("tag", 5)):
        out = {impl: RobertaForTask(dataclasses.replace(CFG, attention_impl=impl), kind, n, seed=5).eval()(ids)[1]
               for impl in ("varlen", "sdpa")}
        real = ids.ne(PAD_ID)
        a, b = out["varlen"], out["sdpa"]
        if kind == "tag":
            a, b = a[real], b[real]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=kind)


def test_varlen_trains_with_dropout():
    """Attention dropout inside the jagged kernel: finite, seeded, and different from no dropout."""
    ids, labels = ragged_batch()
    cfg = dataclasses.replace(CFG, attention_impl="varlen", attention_dropout=0.1)

    def loss(seed, config=cfg):
        seed_everything(seed)  # attention dropout draws from the model-parallel stream
        model = RobertaMLM(config, seed=7).train()
        return model(ids, labels)[0]
    assert torch.isfinite(loss(1)) and torch.equal(loss(1), loss(1))
    assert not torch.equal(loss(1), loss(1, dataclasses.replace(cfg, attention_dropout=0.0)))
