"""RoBERTa's FLOP counts (Marchisio et al. 2023, Appendix A.1, after Narayanan et al. 2021).

Conventions as mmadapt/flops.py: 2mnk per matmul, nothing else counted. Per sequence of s tokens, with hidden h, feed-forward f,
vocabulary V, and a fraction p of positions masked (only those reach an MLM head):

    linear(layer) = 2sh(3h) [QKV] + 2sh^2 [out] + 4shf [FFN]  = 24sh^2 when f = 4h
    attn(layer)   = 2s^2h [QK^T] + 2s^2h [probs x V]          = 4s^2h
    layer         = linear + attn                            (paper's FLOP_layer)
    head          = p(2sh^2 [dense] + 2shV [tied projection]) (paper's FLOP_lm)
    forward       = l * layer + heads * head                 (A2 with one head)

Backward costs. A weight matmul y = xW needs one product for dL/dx and one for dL/dW. An
attention product (QK^T, probs x V) multiplies two activations and needs two products for its
input gradients, whatever is frozen. So:

    trainable layer:                 2 * layer               (2 linear + 2 attn)
    frozen layer that passes grads:  linear + 2 attn         (the paper's A3 counts one `layer`)
    frozen layer below every trainable parameter: nothing

Hence the paper's A3 (Step 2) undercounts by l * 4s^2h per sequence; the exact Step-2 count is
    48 U B s l h^2 (1 + s/(4h) + p/(12l) + pV/(8hl))        (f = 4h, one head)
against the paper's 48 U B s l h^2 (1 + s/(6h) + p/(12l) + pV/(8hl)). Both are kept: `paper=True`
reproduces the paper's tables, the default is what the model in model.py executes (checked
against torch's FlopCounterMode in tests/test_flops.py and benchmarks/flops_validation.py).

An expanded vocabulary (Step 2 --vocab_mode expand, cfg.frozen_vocab_size = F) projects onto all
V pieces and passes the input gradient through all of them, but computes the weight gradient of
the V - F new rows only (models/layers.vocab_linear): the projection's third product shrinks
from 2pshV to 2psh(V - F).
"""

from __future__ import annotations

from mmadapt.config import ModelConfig
from mmadapt.flops import STEPS


def layer_linear_flops(cfg: ModelConfig, s: int) -> float:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    return 8 * s * h * h + 4 * s * h * f


def layer_attn_flops(cfg: ModelConfig, s: int) -> float:
    return 4 * s * s * cfg.hidden_size


def layer_flops(cfg: ModelConfig, s: int) -> float:
    """Forward FLOPs of one transformer layer for one sequence (FLOP_layer)."""
    return layer_linear_flops(cfg, s) + layer_attn_flops(cfg, s)


def head_dense_flops(cfg: ModelConfig, s: int, p: float) -> float:
    return p * 2 * s * cfg.hidden_size ** 2


def head_proj_flops(cfg: ModelConfig, s: int, p: float, rows: int | None = None) -> float:
    """The tied projection onto `rows` pieces (default: all V)."""
    return p * 2 * s * cfg.hidden_size * (cfg.vocab_size if rows is None else rows)


def head_flops(cfg: ModelConfig, s: int, p: float) -> float:
    """Forward FLOPs of one MLM head (FLOP_lm)."""
    return head_dense_flops(cfg, s, p) + head_proj_flops(cfg, s, p)


def forward_flops(cfg: ModelConfig, s: int, p: float) -> float:
    """Forward FLOPs of one sequence through all layers and every MLM head (A2)."""
    return cfg.num_layers * layer_flops(cfg, s) + len(cfg.heads_after) * head_flops(cfg, s, p)


def pretrain_flops(cfg: ModelConfig, s: int, p: float, paper: bool = False) -> float:
    """Step 1, everything trainable: 3 x forward (A1; MINIJOINT: A1 plus its second head).
    The paper's count and the exact one agree here."""
    return 3 * forward_flops(cfg, s, p)


def adapt_flops(cfg: ModelConfig, s: int, p: float, paper: bool = False) -> float:
    """Step 2: embeddings (tied with the output projection) and the output bias trainable, body and
    head dense frozen. One head (the mini-model's, or the primary model's). A3 when paper=True."""
    if len(cfg.heads_after) != 1:
        raise ValueError("Step 2 trains over one MLM head: pass the mini-model's config")
    attn_bwd = 1 if paper else 2
    lin, attn = layer_linear_flops(cfg, s), layer_attn_flops(cfg, s)
    body = cfg.num_layers * (2 * lin + (1 + attn_bwd) * attn)  # forward + input gradients
    # forward and input gradient of the dense layer and the projection, and the projection's
    # weight gradient (its trained rows)
    trained = cfg.vocab_size - cfg.frozen_vocab_size
    head = 2 * head_dense_flops(cfg, s, p) + 2 * head_proj_flops(cfg, s, p) + head_proj_flops(cfg, s, p, trained)
    return body + head


def minipost_flops(cfg: ModelConfig, s: int, p: float, trainable_layers: int, paper: bool = False) -> float:
    """Step 1b of MINIPOST: the top `trainable_layers` (l_t) of the cfg.num_layers (l) trainable,
    the bottom layers, embeddings and head frozen (A4 when paper=True).

    Exact: the heads above a trainable layer and the trainable layers pass gradients down (a
    head: one forward; a trainable layer: two), except that the lowest trainable layer needs no
    gradient for its input, so its QKV input-gradient product (6sh^2) is skipped. The paper
    counts that lowest layer as a single `layer`.
    """
    l, lt = cfg.num_layers, trainable_layers
    if not 1 <= lt <= l:
        raise ValueError(f"trainable_layers {lt} must be in 1..num_layers={l}")
    fwd = forward_flops(cfg, s, p)
    # a head over frozen layers only passes no gradient anywhere: no backward (as the decoder's count)
    head_bwd = sum(1 for after in cfg.heads_after if after > l - lt) * head_flops(cfg, s, p)
    if paper:
        return fwd + head_bwd + (2 * lt - 1) * layer_flops(cfg, s)
    qkv_dgrad = 6 * s * cfg.hidden_size ** 2
    return fwd + head_bwd + lt * 2 * layer_flops(cfg, s) - qkv_dgrad


def fit_head_flops(cfg: ModelConfig, s: int, p: float) -> float:
    """mmadapt fit-head: a new MLM head over a frozen body (and frozen tied embedding). The body
    runs forward only (nothing below the head trains); the head forward, then the projection's
    input gradient and the dense layer's weight gradient (its input, the body's output, needs
    none, nor does the frozen projection a weight gradient): forward + one more head."""
    return forward_flops(cfg, s, p) + len(cfg.heads_after) * head_flops(cfg, s, p)


def score_flops(cfg: ModelConfig, s: int, p: float) -> float:
    """One forward pass as evaluation runs it (heldout.Scorer: the plug-in metric, Step 2's
    calibrations): every layer but the last whole; the last one's QKV and attention for every
    position (the keys and values need them all), its output projection and feed-forward, and
    the heads, at the p s scored rows alone (model.py TransformerLayer's `rows`)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    last = 6 * s * h * h + layer_attn_flops(cfg, s) + p * s * (2 * h * h + 4 * h * f)
    return (cfg.num_layers - 1) * layer_flops(cfg, s) + last + len(cfg.heads_after) * head_flops(cfg, s, p)


def step_flops(step: str, cfg: ModelConfig, s: int, p: float, paper: bool = False,
               trainable_layers: int = 0) -> float:
    """Per-sequence FLOPs of one update of `step` (one of STEPS)."""
    if step == "pretrain":
        return pretrain_flops(cfg, s, p, paper)
    if step == "adapt":
        return adapt_flops(cfg, s, p, paper)
    if step == "minipost":
        return minipost_flops(cfg, s, p, trainable_layers, paper)
    if step == "fit_head":  # not in the paper: the exact count either way
        return fit_head_flops(cfg, s, p)
    if step == "score":  # a forward pass in evaluation, p: the fraction of positions scored
        return score_flops(cfg, s, p)
    raise ValueError(f"unknown step {step!r}; choose one of {', '.join(STEPS)}")
