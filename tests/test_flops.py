"""FLOP accounting: the paper's numbers (Appendix A.1, section 3, footnote 2) and the exact counts
against torch's FlopCounterMode on the real model, for every system and step."""

import dataclasses

import pytest
import torch

from mmadapt.config import ModelConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.flops import counted_flops, device_days, total_flops
from mmadapt.models.roberta.flops import adapt_flops, forward_flops, layer_flops, minipost_flops, pretrain_flops
from mmadapt.models.roberta import ROBERTA
from mmadapt.models.roberta.model import RobertaMLM
from mmadapt.parallel import init_parallel
from mmadapt.tokens import IGNORE_INDEX
from mmadapt.family import WORD
from mmadapt.models.roberta.model import BIAS

U, B, S, P = 125_000, 2048, 512, 0.15
BASE = PRESETS["roberta-base"][0]


def eflops(per_sequence):
    return total_flops(per_sequence, B, U) / 1e18


def test_layer_count_by_hand():
    h, s = 768, 512
    assert layer_flops(BASE, s) == 24 * s * h * h + 4 * h * s * s
    assert forward_flops(BASE, s, P) == pytest.approx(12 * (24 * s * h * h + 4 * h * s * s)
                                                      + P * (2 * s * h * h + 2 * s * h * 50_000))


def test_pretraining_matches_paper():
    assert round(eflops(pretrain_flops(apply_recipe(BASE, "bl_base"), S, P)), 1) == 78.8
    assert round(eflops(pretrain_flops(apply_recipe(BASE, "bl_small"), S, P)), 1) == 29.3
    # Footnote 2: ~30.4 vs ~32.2 V100-days for BL_BASE vs MINIJOINT (second head).
    bl = total_flops(pretrain_flops(apply_recipe(BASE, "bl_base"), S, P), B, U)
    mj = total_flops(pretrain_flops(apply_recipe(BASE, "minijoint"), S, P), B, U)
    assert (round(device_days(bl), 1), round(device_days(mj), 1)) == (30.4, 32.2)
    assert device_days(2.592e18) == pytest.approx(1.0)


@pytest.mark.parametrize("layers, paper_eflops, paper_days", [(4, 21.1, 8.1), (6, 29.3, 11.3), (12, 54.1, 20.9)])
def test_step2_matches_paper_a3(layers, paper_eflops, paper_days):
    cfg = ROBERTA.one_head(BASE, layers)
    paper = total_flops(adapt_flops(cfg, S, P, paper=True), B, U)
    assert round(paper / 1e18, 1) == paper_eflops
    assert round(device_days(paper), 1) == paper_days
    # A3's closed form, and the exact count with attention products' backward at 2 forwards.
    h, l, V = 768, layers, 50_000
    closed = 48 * U * B * S * l * h * h
    assert paper == pytest.approx(closed * (1 + S / (6 * h) + P / (12 * l) + P * V / (8 * h * l)))
    assert total_flops(adapt_flops(cfg, S, P), B, U) == pytest.approx(
        closed * (1 + S / (4 * h) + P / (12 * l) + P * V / (8 * h * l)))


def test_minipost_step1b_matches_paper_a4():
    cfg = ROBERTA.one_head(BASE, 6)
    assert round(eflops(minipost_flops(cfg, S, P, trainable_layers=2, paper=True)), 1) == 21.6
    # The exact count: one more layer backward (2 attention-product backwards per trainable
    # layer, the lowest trainable layer's weight gradients and internal input gradients),
    # less its QKV input gradient.
    h, s = 768, S
    exact = minipost_flops(cfg, S, P, trainable_layers=2)
    paper = minipost_flops(cfg, S, P, trainable_layers=2, paper=True)
    assert exact - paper == pytest.approx(layer_flops(cfg, s) - 6 * s * h * h)


# --- exact functions against FlopCounterMode on the real model -------------------------------------

@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_parallel(1, 1)


def tiny(**kw) -> ModelConfig:
    base = {**vars(PRESETS["tiny"][0]), "vocab_size": 300, "attention_impl": "math", "hidden_dropout": 0.0,
            "attention_dropout": 0.0}
    return ModelConfig(**{**base, **kw})


def masked_batch(cfg, b=3, s=32, m=14):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (b, s), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    flat = torch.randperm(b * s, generator=g)[:m]
    labels.view(-1)[flat] = ids.view(-1)[flat]
    return ids, labels, m / (b * s)


def count_update(model, ids, labels):
    def step():
        loss, _ = model(ids, labels)
        loss.backward()
    return counted_flops(step)


def freeze(model, trainable):
    from mmadapt.engine import trainable_by_names

    is_trainable = trainable_by_names(trainable)
    for n, p in model.named_parameters():
        p.requires_grad_(is_trainable(n))


@pytest.mark.parametrize("recipe", ["bl_base", "bl_small", "minijoint"])
def test_pretrain_count_equals_exact(recipe):
    cfg = apply_recipe(tiny(), recipe)
    ids, labels, p = masked_batch(cfg)
    counted = count_update(RobertaMLM(cfg), ids, labels)
    assert counted == pytest.approx(ids.shape[0] * pretrain_flops(cfg, ids.shape[1], p), rel=1e-9)


@pytest.mark.parametrize("layers", [4, 6, 12])
def test_step2_count_equals_exact(layers):
    """Step 2 over a frozen body: no weight-gradient matmul anywhere but the output projection."""
    cfg = ROBERTA.one_head(tiny(), layers)
    ids, labels, p = masked_batch(cfg)
    model = RobertaMLM(cfg)
    freeze(model, (WORD, BIAS))
    counted = count_update(model, ids, labels)
    b, s = ids.shape
    assert counted == pytest.approx(b * adapt_flops(cfg, s, p), rel=1e-9)
    assert counted != pytest.approx(b * adapt_flops(cfg, s, p, paper=True), rel=1e-3)
    # The body's share is exactly forward + input gradients: 2 x linear + 3 x attention per layer.
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    by_hand = b * (layers * (2 * (8 * s * h * h + 4 * s * h * f) + 3 * 4 * s * s * h)
                   + p * s * (2 * 2 * h * h + 3 * 2 * h * cfg.vocab_size))
    assert counted == pytest.approx(by_hand, rel=1e-9)


@pytest.mark.parametrize("heads", [(6,), (2, 6)], ids=["one head", "a head below the trained layers"])
def test_minipost_count_equals_exact(heads):
    """Step 1b's top two of six layers trained; a head after layer 2 sits over frozen layers only
    and runs no backward."""
    cfg = dataclasses.replace(ROBERTA.one_head(tiny(), 6), head_layers=heads)
    ids, labels, p = masked_batch(cfg)
    model = RobertaMLM(cfg)
    freeze(model, ROBERTA.minipost_trainable(4, 2))
    counted = count_update(model, ids, labels)
    assert counted == pytest.approx(ids.shape[0] * minipost_flops(cfg, ids.shape[1], p, 2), rel=1e-9)


def test_minipost_count_holds_over_megatron_cores_layers(monkeypatch):
    """Above tensor parallel 1 the layers are megatron-core's, whose ColumnParallelLinear computes
    its input gradient whether or not its input needs one; the lowest trained layer calls its
    weights through torch's linear instead, so the QKV input gradient (6sh^2) is skipped at every
    size, as counted. Counted on the model built from megatron-core's layers in one process (a
    tensor-parallel group of one rank: the products of every rank, which the exact count sums)."""
    from mmadapt.mcore import tensor_parallel
    from mmadapt.models.layers import mp_config
    from mmadapt.models.roberta import model as roberta_model

    def column(config, i, o, init, bias=True):
        return tensor_parallel.ColumnParallelLinear(i, o, config=mp_config(config), init_method=init, bias=bias,
                                                    gather_output=False)

    def row(config, i, o, init, bias=True):
        return tensor_parallel.RowParallelLinear(i, o, config=mp_config(config), init_method=init, bias=bias,
                                                 input_is_parallel=True, skip_bias_add=False)
    monkeypatch.setattr(roberta_model, "column_linear", column)
    monkeypatch.setattr(roberta_model, "row_linear", row)
    cfg = ROBERTA.one_head(tiny(), 6)
    ids, labels, p = masked_batch(cfg)
    init_parallel(1, 1)
    model = RobertaMLM(cfg)
    assert type(model.layers[4].qkv).__name__ == "ColumnParallelLinear"
    freeze(model, ROBERTA.minipost_trainable(4, 2))
    counted, (b, s) = count_update(model, ids, labels), ids.shape
    assert counted == pytest.approx(b * minipost_flops(dataclasses.replace(cfg, tensor_model_parallel_size=2), s, p, 2),
                                    rel=1e-9)
    # the layer's own call (what the model avoids) computes it
    x = torch.randn(b, s, cfg.hidden_size)
    own = counted_flops(lambda: model.layers[4].qkv(x)[0].sum().backward())
    assert own == 3 * 2 * b * s * cfg.hidden_size * 3 * cfg.hidden_size


@pytest.mark.parametrize("step", ["adapt", "pretrain"])
def test_a_count_by_projected_rows_equals_exact(step):
    """family.row_flops: an update's FLOPs as per sequence with no row projected plus per row the
    head projects (what Step 2's artifacts count from the rows the masking drew), against
    FlopCounterMode on batches of 14 and of 40 scored positions, and by hand for Step 2."""
    cfg = ROBERTA.one_head(tiny(), 4) if step == "adapt" else apply_recipe(tiny(), "minijoint")
    b, s = 3, 32
    base, per_row = ROBERTA.row_flops(step, cfg, s)
    for m in (14, 40):
        ids, labels, _ = masked_batch(cfg, b, s, m)
        model = RobertaMLM(cfg)
        if step == "adapt":
            freeze(model, (WORD, BIAS))
        assert count_update(model, ids, labels) == pytest.approx(b * base + m * per_row, rel=1e-9)
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    if step == "adapt":  # the body's forward and input gradients; the head's dense forward and input
        # gradient, the projection's forward, input gradient and weight gradient, per row
        assert base == pytest.approx(4 * (2 * (8 * s * h * h + 4 * s * h * f) + 3 * 4 * s * s * h))
        assert per_row == pytest.approx(2 * 2 * h * h + 3 * 2 * h * v)
    assert ROBERTA.row_flops(step, cfg, 1) is None


def test_a_scoring_pass_count_equals_exact():
    """Step "score" (Step 2's calibrations: heldout.Scorer's forward in evaluation) against
    FlopCounterMode on model.logits at the scored rows: the last layer's output projection and
    feed-forward run at those rows alone (14 of 96 positions), the rest of the model at every one."""
    cfg = ROBERTA.one_head(tiny(), 4)
    ids, labels, p = masked_batch(cfg)
    model = RobertaMLM(cfg).eval()
    rows = labels.view(-1).ge(0).nonzero().squeeze(1)
    with torch.no_grad():
        counted = counted_flops(lambda: model.logits(ids, rows=rows))
    b, s = ids.shape
    assert counted == pytest.approx(b * ROBERTA.step_flops("score", cfg, s, p), rel=1e-9)
    assert counted == pytest.approx(ROBERTA.scoring_flops(cfg, s, b, len(rows)), rel=1e-9)
    assert counted < b * forward_flops(cfg, s, p)
