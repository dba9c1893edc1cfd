"""Model unit tests in one process (a gloo world of one)."""

import pytest
import torch

from conftest import heads_by_hand, masked_batch

from mmadapt.config import ModelConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.parallel import init_parallel
from mmadapt.tokens import IGNORE_INDEX


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_parallel(1, 1)


def tiny(**kw):
    return ModelConfig(**{**vars(PRESETS["tiny"][0]), "vocab_size": 500, **kw})


def batch(vocab=500, b=3, s=20, seed=0):
    return masked_batch(vocab, b, s, seed)


def test_roberta_base_parameter_count():
    """RoBERTa-base with a 50,000-piece vocabulary and 512 positions.

    Hugging Face's RobertaForMaskedLM (50,265 vocab, 514 positions, one token-type row) has
    124,697,433 parameters; ours has 265 fewer vocabulary rows (x768) and output-bias entries,
    2 fewer positions (x768) and no token-type row (768).
    """
    from mmadapt.models.layers import count_parameters
    from mmadapt.models.roberta.model import RobertaMLM

    expected = 124_697_433 - 265 * 768 - 265 - 2 * 768 - 768
    assert expected == 124_491_344
    assert count_parameters(RobertaMLM(PRESETS["roberta-base"][0])) == expected


def test_minijoint_loss_is_mean_of_heads_computed_separately():
    from mmadapt.models.roberta.model import RobertaMLM

    cfg = apply_recipe(tiny(hidden_dropout=0.0, attention_dropout=0.0), "minijoint", 4)
    model = RobertaMLM(cfg, seed=7)
    ids, labels = batch()
    loss, per_head = model(ids, labels)
    by_hand = heads_by_hand(model, ids, labels)
    torch.testing.assert_close(per_head, torch.stack(by_hand).detach())
    torch.testing.assert_close(loss, (by_hand[0] + by_hand[1]) / 2)


def test_lm_head_receives_exactly_the_masked_positions():
    from mmadapt.models.roberta.model import RobertaMLM

    cfg = apply_recipe(tiny(hidden_dropout=0.0, attention_dropout=0.0), "minijoint", 4)
    model = RobertaMLM(cfg, seed=7)
    ids, labels = batch()
    seen = []
    for head in model.heads.heads:
        head.dense.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
    model(ids, labels)
    hidden = dict(zip((4, 12), model.hidden_states(ids)))
    m = labels >= 0
    assert 0 < int(m.sum()) < m.numel()
    assert len(seen) == 2  # each head's dense layer ran once, as a module
    for rows, l in zip(seen, (4, 12)):
        assert rows.shape == (int(m.sum()), cfg.hidden_size)
        torch.testing.assert_close(rows, hidden[l][m])


def test_initialisation_depends_only_on_seed_and_module():
    """A module's weights must not depend on what was built before it (pipeline stages)."""
    from mmadapt.models.roberta.model import RobertaMLM, TransformerLayer

    model = RobertaMLM(tiny(), seed=3)
    torch.randn(1000)  # disturb the global RNG
    alone = TransformerLayer(tiny(), 5, seed=3)
    torch.testing.assert_close(alone.qkv.weight, model.layers[4].qkv.weight)
    assert not torch.equal(model.layers[3].qkv.weight, model.layers[4].qkv.weight)
    assert not torch.equal(RobertaMLM(tiny(), seed=4).layers[4].qkv.weight, alone.qkv.weight)


def test_math_and_sdpa_attention_agree_with_padding():
    from mmadapt.models.roberta.model import RobertaMLM

    ids, labels = batch()
    ids[0, 15:] = 0  # padding
    labels[0, 15:] = IGNORE_INDEX
    a = RobertaMLM(tiny(attention_impl="sdpa"), seed=1).eval()
    b = RobertaMLM(tiny(attention_impl="math"), seed=1).eval()
    torch.testing.assert_close(a(ids, labels)[1], b(ids, labels)[1], rtol=1e-5, atol=1e-5)
    # Padding is invisible: the unpadded prefix gives the same hidden states alone.
    full = a.hidden_states(ids)[0][0, :15]
    alone = a.hidden_states(ids[:1, :15])[0][0]
    torch.testing.assert_close(full, alone, rtol=1e-5, atol=1e-5)


def test_backward_reaches_every_parameter():
    from mmadapt.models.roberta.model import RobertaMLM

    model = RobertaMLM(apply_recipe(tiny(), "minijoint", 2), seed=1)
    ids, labels = batch()
    model(ids, labels)[0].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_frozen_positions_are_the_tables_rows_and_trained_ones_its_lookup():
    """layers.position_rows: a frozen table (Step 2 on) gives a view of its first s rows, the same
    numbers as the lookup; a trained one the lookup itself, whose backward sums each position's
    gradient over the batch as the lookup always has."""
    from mmadapt.models.layers import position_rows

    table = torch.nn.Embedding(10, 4)
    lookup = table(torch.arange(6))
    trained = position_rows(table, 6)
    assert trained.grad_fn is not None and "Embedding" in type(trained.grad_fn).__name__
    assert torch.equal(trained, lookup)
    table.weight.requires_grad_(False)
    frozen = position_rows(table, 6)
    assert frozen._base is table.weight and frozen.shape == (6, 4) and torch.equal(frozen, lookup)
    table.weight.requires_grad_(True)
    with torch.no_grad():
        assert position_rows(table, 6)._base is table.weight


@pytest.mark.parametrize("kind", ["span", "classify", "tag"])
def test_every_task_loss_is_computed_in_fp32_from_bf16_logits(kind):
    """A bf16 model's task loss (Step 3 under bf16) from fp32 logits: the span kind's start and
    end losses as the classify and tag kinds', not rounded to bf16's 8 bits."""
    import torch.nn.functional as F

    from mmadapt.models.roberta.model import RobertaForTask

    g = torch.Generator().manual_seed(0)
    n = {"span": 2, "classify": 3, "tag": 5}[kind]
    model = RobertaForTask(tiny(), kind, n, seed=0)
    shape, top = {"span": ((4, 16, 2), 16), "classify": ((4, 3), 3), "tag": ((4, 16, 5), 5)}[kind]
    logits = (4 * torch.randn(shape, generator=g)).bfloat16()
    labels = torch.randint(0, top, (4, 2) if kind == "span" else shape[:-1], generator=g)
    loss, _ = model.task_loss(logits, labels)
    ref = ((F.cross_entropy(logits[..., 0].float(), labels[:, 0]) + F.cross_entropy(logits[..., 1].float(), labels[:, 1]))
           / 2 if kind == "span" else F.cross_entropy(logits.reshape(-1, n).float(), labels.reshape(-1)))
    assert loss.dtype == torch.float32 and torch.equal(loss, ref)


def test_starting_weights_must_hold_every_frozen_parameter():
    """A frozen tensor missing from the starting weights is refused (it would stay at its random
    init, and Step 2 or MINIPOST would train over a random body); a missing trainable one keeps
    the module's seeded init (MINIPOST's new layers, a new task head)."""
    from mmadapt.engine import load_full_weights

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    names = {n: n for n, _ in module.named_parameters()}
    state = {n: torch.full_like(p, 0.5) for n, p in module.named_parameters()}
    seeded = module[1].weight.detach().clone()
    without_new = {n: t for n, t in state.items() if not n.startswith("1.")}
    load_full_weights(module, names, without_new, trainable=lambda n: n.startswith("1."))
    assert torch.equal(module[0].weight, state["0.weight"]) and torch.equal(module[1].weight, seeded)
    with pytest.raises(ValueError, match="^the starting weights lack 0.bias, which this run keeps frozen$"):
        load_full_weights(module, names, {n: t for n, t in state.items() if n != "0.bias"},
                          trainable=lambda n: n.startswith("1."))
