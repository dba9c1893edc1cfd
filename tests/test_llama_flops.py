"""The decoder's FLOP counts (mmadapt/models/llama/flops.py): every function against torch's
FlopCounterMode on the real model (attention_impl "math": attention as explicit matmuls it counts), with
the requires_grad pattern of each step, tied and untied, with and without grouped-query
attention, every position scored or a fraction p of them; and the closed forms of the docstring."""

import dataclasses

import numpy as np
import pytest
import torch

from mmadapt.config import scored_positions
from mmadapt.data import score_subset
from mmadapt.flops import counted_flops
from mmadapt.models.layers import new_rows_name
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.flops import (adapt_flops, forward_flops, head_flops, layer_attn_flops, layer_flops,
                                        layer_linear_flops, minipost_flops, pretrain_flops)
from mmadapt.models.llama.model import DecoderLayer, LlamaLM, rotary_table
from mmadapt.models.llama.presets import LLAMA_TINY as TINY
from mmadapt.config import ModelConfig
from mmadapt.models.llama.presets import QWEN2_0_5B

B, S = 2, 24


def tiny(**kw) -> ModelConfig:
    """4 layers of h 32, 4 heads of 8 (2 key/value groups unless told), ffn 48, V 160."""
    return dataclasses.replace(TINY, num_layers=4, hidden_size=32, ffn_hidden_size=48, vocab_size=160,
                               attention_impl="math", **kw)


SHAPES = {"gqa-tied": {}, "mha-tied": {"num_query_groups": None},
          "gqa-untied-bias": {"share_embeddings_and_output_weights": False, "add_qkv_bias": True},
          "mqa-untied": {"num_query_groups": 1, "share_embeddings_and_output_weights": False}}


def lm_batch(cfg):
    """ids [B, S] and a next-token target at every position (every position scored)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(5, cfg.vocab_size, (B, S), generator=g), torch.randint(5, cfg.vocab_size, (B, S), generator=g)


def count_update(model, ids, labels) -> int:
    def step():
        loss, _ = model(ids, labels)
        loss.backward()
    return counted_flops(step)


def linear_flops_only(fn) -> int:
    """FlopCounterMode's count of `fn()` with every fused-attention operator counted as 0: on
    torch 2.13 the counter has no formula for CPU SDPA anyway, and this keeps the linears' count
    true on a torch that adds one."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    def zero(*args, **kwargs) -> int:
        return 0
    zero._get_raw = True
    fused = {op: zero for op in flop_registry if "scaled_dot_product" in str(op)}
    fused[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = zero
    with FlopCounterMode(display=False, custom_mapping=fused) as counter:
        fn()
    return counter.get_total_flops()


def train_only(model, prefixes: tuple[str, ...]) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(prefixes))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_layer_and_one_head_forward(shape):
    cfg = tiny(**SHAPES[shape])
    layer = DecoderLayer(cfg, 1)
    x = torch.randn(B, S, cfg.hidden_size)
    rope = rotary_table(S, cfg.head_dim, cfg.rotary_base, x)
    with torch.no_grad():
        assert counted_flops(lambda: layer(x, rope)) == B * layer_flops(cfg, S)
        layer.attention_impl = "sdpa"  # what is left with SDPA's own count taken out is the linears
        assert linear_flops_only(lambda: layer(x, rope)) == B * layer_linear_flops(cfg, S)
    assert layer_attn_flops(cfg, S) == layer_flops(cfg, S) - layer_linear_flops(cfg, S)
    model = LlamaLM(cfg)
    with torch.no_grad():
        rows = torch.randn(B * S, cfg.hidden_size)
        assert counted_flops(lambda: model.heads.heads[0](rows, model.output_weight)) == B * head_flops(cfg, S)
        assert counted_flops(lambda: model(*lm_batch(cfg))) == B * forward_flops(cfg, S)


@pytest.mark.parametrize("shape", sorted(SHAPES) + ["minijoint"])
def test_pretrain_count_equals_exact(shape):
    cfg = tiny(head_layers=(1, 4)) if shape == "minijoint" else tiny(**SHAPES[shape])
    assert count_update(LlamaLM(cfg), *lm_batch(cfg)) == B * pretrain_flops(cfg, S)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_step2_count_equals_exact(shape):
    cfg = tiny(**SHAPES[shape])
    model = LlamaLM(cfg)
    train_only(model, ("word_embeddings.", "output_layer."))
    assert count_update(model, *lm_batch(cfg)) == B * adapt_flops(cfg, S)


@pytest.mark.parametrize("shape, trainable", [("gqa-tied", 2), ("gqa-untied-bias", 1), ("mha-tied", 4),
                                              ("minijoint", 2)])
def test_minipost_count_equals_exact(shape, trainable):
    """Top layers trainable; for MINIJOINT, the head after layer 1 sits below them: no backward."""
    cfg = tiny(head_layers=(1, 4)) if shape == "minijoint" else tiny(**SHAPES[shape])
    model = LlamaLM(cfg)
    train_only(model, tuple(f"layers.{i}." for i in range(cfg.num_layers - trainable, cfg.num_layers)))
    assert count_update(model, *lm_batch(cfg)) == B * minipost_flops(cfg, S, trainable)


def test_closed_forms():
    s, h, l, V = 512, 96, 6, 1000
    mha = ModelConfig(family="llama", num_layers=l, hidden_size=h, num_attention_heads=4, ffn_hidden_size=8 * h // 3,
                      vocab_size=V)
    assert layer_linear_flops(mha, s) == 24 * s * h * h
    assert pretrain_flops(mha, s) == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l)))
    assert adapt_flops(mha, s) == pytest.approx(48 * s * l * h * h * (1 + s / (4 * h) + V / (8 * h * l)))
    # the paper's counts (every artifact's flops_paper, report's eflops_paper): a frozen layer's
    # backward as its forward, attention included (A3); MINIPOST's 2 l_t - 1 layers (A4)
    assert adapt_flops(mha, s, paper=True) == pytest.approx(48 * s * l * h * h * (1 + s / (6 * h) + V / (8 * h * l)))
    assert minipost_flops(mha, s, 2, paper=True) == forward_flops(mha, s) + head_flops(mha, s) + 3 * layer_flops(mha, s)
    # Qwen2-0.5B: g = 2 / 14 of the key/value projections, f = 4864.
    q = QWEN2_0_5B
    h, f, g = q.hidden_size, q.ffn_hidden_size, 2 / 14
    assert layer_linear_flops(q, s) == pytest.approx(4 * s * h * h * (1 + g) + 6 * s * h * f)
    assert minipost_flops(q, s, 2) == forward_flops(q, s) + head_flops(q, s) + 4 * layer_flops(q, s)


def test_bad_step_shapes_are_refused():
    with pytest.raises(ValueError, match="one LM head"):
        adapt_flops(tiny(head_layers=(1, 4)), S)
    with pytest.raises(ValueError, match="trainable_layers 5 must be in 1..num_layers=4"):
        minipost_flops(tiny(), S, 5)


# --- a sampled fraction p of the positions scored (TrainConfig.score_fraction) ---------------------------

def scored_batch(cfg, p: float):
    """ids [B, S] and labels with exactly scored_positions(S, p) positions of each row scored, drawn as
    data.CausalBatches draws them."""
    ids, targets = lm_batch(cfg)
    rng = np.random.default_rng(0)
    labels = np.stack([score_subset(row, rng, scored_positions(S, p)) for row in targets.numpy()])
    return ids, torch.from_numpy(labels)


def expanded(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, frozen_vocab_size=cfg.vocab_size - 40)


# p = 0.3 scores round(7.2) = 7 of 24 positions: the count is the drawn one, not p * s
@pytest.mark.parametrize("shape, p", [("gqa-tied", 0.3), ("gqa-untied-bias", 0.25), ("tied-expand", 0.25),
                                      ("untied-expand", 0.3)])
def test_step2_count_at_a_score_fraction_equals_exact(shape, p):
    """Both Step-2 vocabulary modes: replace (every row trains) and expand (the new rows only)."""
    untied = {"share_embeddings_and_output_weights": False}
    cfg = {"tied-expand": lambda: expanded(tiny()), "untied-expand": lambda: expanded(tiny(**untied))}.get(
        shape, lambda: tiny(**SHAPES[shape]))()
    model = LlamaLM(cfg)
    trained = set(map(new_rows_name, LLAMA.vocab_params(cfg))) if cfg.frozen_vocab_size else set(
        LLAMA.vocab_params(cfg))
    for n, w in model.named_parameters():
        w.requires_grad_(n in trained)
    ids, labels = scored_batch(cfg, p)
    assert int(labels.ge(0).sum()) == B * scored_positions(S, p) < B * S
    counted = count_update(model, ids, labels)
    assert counted == B * adapt_flops(cfg, S, p=p) == B * LLAMA.step_flops("adapt", cfg, S, p)
    # only the head's terms shrink, by the unscored rows' share
    m = scored_positions(S, p)
    assert adapt_flops(cfg, S) - adapt_flops(cfg, S, p=p) == 3 * (S - m) * (head_flops(cfg, S) // S) - (
        0 if not cfg.frozen_vocab_size else (S - m) * 2 * cfg.hidden_size * cfg.frozen_vocab_size)


def test_pretrain_and_minipost_counts_at_a_score_fraction_equal_exact(p=0.3):
    cfg = tiny(head_layers=(1, 4))
    ids, labels = scored_batch(cfg, p)
    assert count_update(LlamaLM(cfg), ids, labels) == B * pretrain_flops(cfg, S, p)
    model = LlamaLM(cfg)
    train_only(model, ("layers.2.", "layers.3."))
    assert count_update(model, ids, labels) == B * minipost_flops(cfg, S, 2, p=p) == B * LLAMA.step_flops(
        "minipost", cfg, S, p, trainable_layers=2)


def test_scored_positions_and_the_closed_form_with_p():
    assert [scored_positions(32, p) for p in (1.0, 0.5, 0.25, 0.125, 0.01)] == [32, 16, 8, 4, 1]
    assert scored_positions(24, 0.3) == 7 and scored_positions(20, 0.125) == 3  # 2.5 rounds up
    s, h, l, V, p = 512, 96, 6, 1000, 0.25
    mha = ModelConfig(family="llama", num_layers=l, hidden_size=h, num_attention_heads=4, ffn_hidden_size=8 * h // 3,
                      vocab_size=V)
    assert adapt_flops(mha, s, p=p) == pytest.approx(48 * s * l * h * h * (1 + s / (4 * h) + p * V / (8 * h * l)))
    assert pretrain_flops(mha, s, p) == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + p * V / (12 * h * l)))


def test_a_count_by_projected_rows_equals_the_count_at_each_fraction():
    """family.row_flops (what Step 2's artifacts count from the rows projected): the decoder's
    steps at each score fraction, as the per-sequence count at scored_positions(s, p) rows."""
    cfg = tiny(head_layers=(1, 4))
    for step, k, one in (("pretrain", 0, cfg), ("minipost", 2, cfg), ("adapt", 0, LLAMA.one_head(cfg, 4))):
        base, per_row = LLAMA.row_flops(step, one, S, trainable_layers=k)
        for p in (1.0, 0.5, 0.3, 0.01):
            want = LLAMA.step_flops(step, one, S, p, trainable_layers=k)
            assert base + scored_positions(S, p) * per_row == pytest.approx(want, rel=1e-12)


def test_a_scoring_pass_count_equals_exact(p=0.3):
    """Step "score" (heldout.Scorer's forward in evaluation) against FlopCounterMode on
    model.logits at the scored rows: the last layer's output projection and MLP run at them alone."""
    cfg = LLAMA.one_head(tiny(), 4)
    ids, labels = scored_batch(cfg, p)
    model = LlamaLM(cfg).eval()
    rows = labels.view(-1).ge(0).nonzero().squeeze(1)
    with torch.no_grad():
        counted = counted_flops(lambda: model.logits(ids, rows=rows))
    assert counted == B * LLAMA.step_flops("score", cfg, S, p) == LLAMA.scoring_flops(cfg, S, B, len(rows))
    assert counted < B * forward_flops(cfg, S, p)
