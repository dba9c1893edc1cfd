"""A vocabulary padded for tensor parallelism (ModelConfig.padded_vocab_size): the size, the init,
the -inf logits of the padding rows, and the full state dict without them. The training runs at
tensor parallel 2 against one process are in tests/test_parallel.py (slow)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mmadapt.checkpoint import load_full_state_dict
from mmadapt.config import ModelConfig
from mmadapt.models.layers import normal_init, padded_init, vocab_linear
from mmadapt.models.roberta import ROBERTA


def tiny(vocab_size: int, tp: int = 1, **changes) -> ModelConfig:
    return dataclasses.replace(ROBERTA.presets["tiny"][0], vocab_size=vocab_size, tensor_model_parallel_size=tp,
                               **changes)


@pytest.mark.parametrize("vocab, tp, padded", [(999, 1, 999), (999, 2, 1000), (1000, 2, 1000), (250_002, 4, 250_004),
                                               (50_265, 4, 50_268), (5, 4, 8)])
def test_padded_size_is_the_next_multiple_of_the_tensor_parallel_size(vocab, tp, padded):
    assert tiny(vocab, tp).padded_vocab_size == padded


def test_an_odd_vocabulary_is_taken_at_tensor_parallel_2_and_an_expanded_one_is_refused():
    tiny(50_265, 2).validate()  # roberta-base's vocabulary: refused before padding
    tiny(1000, 2, frozen_vocab_size=900).validate()
    with pytest.raises(ValueError, match="vocab_size 999 of an expanded vocabulary is not divisible by "
                                         "tensor_model_parallel_size 2"):
        tiny(999, 2, frozen_vocab_size=900).validate()


def test_padded_init_draws_the_real_rows_as_the_unpadded_layer_and_zeros_the_padding():
    init = normal_init(0.02)
    torch.manual_seed(3)
    unpadded = torch.empty(999, 64)
    init(unpadded)
    torch.manual_seed(3)
    padded = torch.full((1000, 64), 7.0)
    padded_init(init, tiny(999, 2))(padded)
    assert torch.equal(padded[:999], unpadded)
    assert torch.equal(padded[999:], torch.zeros(1, 64))
    assert padded_init(init, tiny(1000, 2)) is init  # nothing to pad


def test_padding_logits_are_minus_inf_and_leave_the_loss_and_gradients_of_the_real_vocabulary():
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    targets = torch.tensor([0, 2, 1, 2, 0, 1])
    # the reference: 3 pieces, no padding
    xr, wr, br = (t[:3].clone().requires_grad_() if t is not x else t.clone().requires_grad_() for t in (x, w, b))
    F.cross_entropy(vocab_linear(xr, wr, br), targets).backward()
    # the same 3 pieces and 2 padding rows (of any value: a rank's padding after a bad init, say)
    xp, wp, bp = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    logits = vocab_linear(xp, wp, bp, real=3)
    assert torch.isneginf(logits[:, 3:]).all() and torch.isfinite(logits[:, :3]).all()
    F.cross_entropy(logits, targets).backward()
    torch.testing.assert_close(xp.grad, xr.grad)
    torch.testing.assert_close(wp.grad[:3], wr.grad)
    torch.testing.assert_close(bp.grad[:3], br.grad)
    assert not wp.grad[3:].any() and not bp.grad[3:].any()
    # unmasked, the padding rows would take part in the softmax
    assert not torch.isneginf(vocab_linear(x, w, b)).any()
    # a rank whose rows are all padding (5 pieces at TP 4: 2 rows a rank, the last rank's both padding)
    assert torch.isneginf(vocab_linear(x, w[:2], b[:2], real=0)).all()
    assert [real_rows_at(5, 4, rank) for rank in range(4)] == [2, 2, 1, 0]
    assert real_rows_at(999, 1, 0) is None and real_rows_at(1000, 2, 1) is None  # nothing padded


def real_rows_at(vocab: int, tp: int, rank: int) -> int | None:
    """layers.real_rows on tensor-parallel rank `rank` of `tp`."""
    import mmadapt.models.layers as L

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(L, "tp_rank", lambda: rank)
        return L.real_rows(tiny(vocab, tp))


def test_a_full_weight_is_padded_with_zeros_for_a_rank(monkeypatch):
    """engine._shard: the full [999, 4] weight padded to 1,000 rows before the even split; a
    full weight of another size is not padded (load_full_weights then names the mismatch)."""
    from mmadapt import engine, parallel

    monkeypatch.setattr(parallel, "tp_world", lambda: 2)
    full = torch.randn(999, 4)
    p = torch.nn.Parameter(torch.zeros(500, 4))
    p.tensor_model_parallel, p.partition_dim, p.vocab_padded_from = True, 0, 999
    monkeypatch.setattr(parallel, "tp_rank", lambda: 0)
    assert torch.equal(engine._shard(p, full), full[:500])
    monkeypatch.setattr(parallel, "tp_rank", lambda: 1)
    assert torch.equal(engine._shard(p, full), torch.cat([full[500:], torch.zeros(1, 4)]))
    assert engine._shard(p, torch.randn(998, 4)).shape == (499, 4)


def test_the_full_state_dict_of_a_padded_checkpoint_holds_the_real_rows(tmp_path):
    """Two tensor-parallel shards of a 5-piece vocabulary padded to 6 rows (3 a rank) and of a
    column-parallel weight that is no vocabulary (never cut, though its rows number 6 too)."""
    emb, other = torch.randn(6, 4), torch.randn(6, 4)
    emb[5] = 0
    d = tmp_path / "step00000001"
    d.mkdir()
    for rank in range(2):
        module = {"word_embeddings.weight": emb[3 * rank:3 * rank + 3], "fc.weight": other[3 * rank:3 * rank + 3],
                  "layernorm.weight": torch.ones(4)}
        torch.save({"module": module, "tp_partition_dims": {"word_embeddings.weight": 0, "fc.weight": 0},
                    "tp_vocab_padded_from": {"word_embeddings.weight": 5}, "model_config": {}},
                   d / f"mp_rank_{rank:02d}_model_states.pt")
    # bf16 training's fp32 master weights, per rank: they replace the module's, then lose their padding too
    master = torch.randn(6, 4)
    for rank in range(2):
        torch.save({"word_embeddings.weight": master[3 * rank:3 * rank + 3]}, d / f"fp32_tp{rank:02d}_pp00.pt")
    state = load_full_state_dict(tmp_path, "step00000001")
    assert torch.equal(state["word_embeddings.weight"], master[:5])
    for rank in range(2):
        (d / f"fp32_tp{rank:02d}_pp00.pt").unlink()
    state = load_full_state_dict(tmp_path, "step00000001")
    assert torch.equal(state["word_embeddings.weight"], emb[:5])
    assert state["word_embeddings.weight"].untyped_storage().nbytes() == 5 * 4 * 4  # not a view of the 6 rows
    assert torch.equal(state["fc.weight"], other) and torch.equal(state["layernorm.weight"], torch.ones(4))
