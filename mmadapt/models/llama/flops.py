"""Exact FLOP counts of the decoder (model.py), with the conventions of mmadapt/flops.py: a matmul
of [m, n] x [n, k] costs 2mnk; non-matmul work (RMSNorm, rotary, softmax, SiLU and the gate
product, embedding lookups) is not counted; counts are per sequence of s tokens for one update.
An LM head projects only a block's scored positions: every one by default (a causal LM predicts
each next token), or exactly m = round(p s) of them with TrainConfig.score_fraction p
(config.scored_positions; data.CausalBatches draws which). So every head term below has m rows
where the body's terms have s; the formulas write p = m / s.

With hidden h, nh query heads and ng key/value groups of head dim hd (nh hd = h; g = ng / nh),
feed-forward f, vocabulary V, l layers and H heads:

    linear(layer) = 2sh(nh + 2ng)hd [QKV] + 2sh^2 [out] + 4shf [gate/up] + 2shf [down]
                  = 4sh^2(1 + g) + 6shf        (= 24sh^2 with MHA, g = 1, and Llama's f = 8h/3)
    attn(layer)   = 2s^2h [QK^T] + 2s^2h [probs x V] = 4s^2h
    head          = 2pshV [output projection of the m = ps scored rows; the final norm is free]
    forward       = l (linear + attn) + H head

attn counts the full s x s square: that is what attention_impl "math" executes (every score,
then the causal mask) and what torch's FlopCounterMode sees. A causal flash kernel skips the
blocks above the diagonal, about half of attn, so on a GPU this overstates attention's share.
Grouped-query attention shrinks only the K and V projections: the products run over all nh
query heads, each against its group's key and value.

Backward, as in mmadapt/flops.py: a weight matmul needs one product for its input gradient and
one for its weight gradient; an attention product multiplies two activations and needs two
products for its inputs' gradients. So:

    pretrain (everything trains) = 3 forward
        = 72slh^2 (1 + s/(6h) + pHV/(12hl))                  (MHA, f = 8h/3)
    Step 2 (word embedding trains; untied: the output layer too; everything else frozen; one head)
        = l (2 linear + 3 attn) + 3 head                    (forward + input gradients down to the
          embedding, and the projection's weight gradient: tied, it is the embedding's)
        = 48slh^2 (1 + s/(4h) + pV/(8hl))                     (MHA, f = 8h/3)
    Step 1b of MINIPOST (the top l_t layers train; the layers below, embeddings and heads frozen)
        = forward + H_t head + 2 l_t (linear + attn)
      where H_t counts the heads after a trainable layer (one with its input below l - l_t has no
      backward at all). The lowest trainable layer costs a full backward: its QKV reads
      input_layernorm's output, which needs a gradient for that norm's weight (model.py's
      DecoderLayer), unlike the post-LN encoder's, whose QKV input gradient is skipped.

Scoring fewer positions leaves the body's terms as they are: the gather of the scored rows passes
zeros back to the others, and every layer's backward still runs over all s positions.

An expanded vocabulary (Step 2 --vocab_mode expand, cfg.frozen_vocab_size = F) projects onto all
V pieces and passes the input gradient through all of them, but computes the weight gradient of
the V - F new rows only (models/layers.vocab_linear): Step 2's third head term is 2psh(V - F).

The paper has no decoder; `paper=True` gives these steps in its conventions (Appendix A.1, as
models/roberta/flops.py does for the encoder): a frozen layer's backward counted as one forward
(Step 2: 2 l layer + 3 head, the analogue of A3) and the lowest trainable layer of Step 1b as
one layer (the analogue of A4), so the decoder's tables compare with the encoder's.
"""

from __future__ import annotations

from mmadapt.config import ModelConfig, scored_positions
from mmadapt.flops import STEPS


def layer_linear_flops(cfg: ModelConfig, s: int) -> int:
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size
    qkv = 2 * s * h * (cfg.num_attention_heads + 2 * cfg.query_groups) * hd
    out = 2 * s * cfg.num_attention_heads * hd * h
    return qkv + out + 4 * s * h * f + 2 * s * f * h


def layer_attn_flops(cfg: ModelConfig, s: int) -> int:
    return 4 * s * s * cfg.num_attention_heads * cfg.head_dim


def layer_flops(cfg: ModelConfig, s: int) -> int:
    """Forward FLOPs of one decoder layer for one sequence."""
    return layer_linear_flops(cfg, s) + layer_attn_flops(cfg, s)


def head_flops(cfg: ModelConfig, s: int, rows: int | None = None, p: float = 1.0) -> int:
    """Forward FLOPs of one LM head: the output projection of the scored positions of a block of s
    (scored_positions(s, p)) onto `rows` pieces (default: all V)."""
    return 2 * scored_positions(s, p) * cfg.hidden_size * (cfg.vocab_size if rows is None else rows)


def forward_flops(cfg: ModelConfig, s: int, p: float = 1.0) -> int:
    """Forward FLOPs of one sequence through all layers and every LM head."""
    return cfg.num_layers * layer_flops(cfg, s) + len(cfg.heads_after) * head_flops(cfg, s, p=p)


def pretrain_flops(cfg: ModelConfig, s: int, p: float = 1.0) -> int:
    """Step 1, everything trainable (MINIJOINT: every head's forward and backward)."""
    return 3 * forward_flops(cfg, s, p)


def adapt_flops(cfg: ModelConfig, s: int, paper: bool = False, p: float = 1.0) -> int:
    """Step 2 over one head: the word embedding trains (and an untied output layer), the body and
    the final norm are frozen but pass gradients down to the embedding."""
    if len(cfg.heads_after) != 1:
        raise ValueError("Step 2 trains over one LM head: pass the mini-model's config")
    # the projection's forward and input gradient, and the weight gradient of its trained rows
    head = 2 * head_flops(cfg, s, p=p) + head_flops(cfg, s, cfg.vocab_size - cfg.frozen_vocab_size, p)
    if paper:
        return 2 * cfg.num_layers * layer_flops(cfg, s) + head
    body = cfg.num_layers * (2 * layer_linear_flops(cfg, s) + 3 * layer_attn_flops(cfg, s))
    return body + head


def minipost_flops(cfg: ModelConfig, s: int, trainable_layers: int, paper: bool = False, p: float = 1.0) -> int:
    """Step 1b of MINIPOST: the top `trainable_layers` (l_t) of cfg.num_layers trainable, the
    layers below, the embeddings and the heads frozen."""
    l, lt = cfg.num_layers, trainable_layers
    if not 1 <= lt <= l:
        raise ValueError(f"trainable_layers {lt} must be in 1..num_layers={l}")
    heads_with_backward = sum(1 for after in cfg.heads_after if after > l - lt)
    layers = (2 * lt - 1) if paper else 2 * lt
    return forward_flops(cfg, s, p) + heads_with_backward * head_flops(cfg, s, p=p) + layers * layer_flops(cfg, s)


def score_flops(cfg: ModelConfig, s: int, p: float = 1.0) -> int:
    """One forward pass as evaluation runs it (heldout.Scorer: the plug-in metric, Step 2's
    calibrations): every layer but the last whole; the last one's QKV and attention for every
    position (the keys and values need them all), its output projection and MLP, and the heads,
    at the scored rows alone (scored_positions(s, p); model.py DecoderLayer's `rows`)."""
    h, hd, f, nh = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size, cfg.num_attention_heads
    qkv = 2 * s * h * (nh + 2 * cfg.query_groups) * hd
    last = qkv + layer_attn_flops(cfg, s) + scored_positions(s, p) * (2 * nh * hd * h + 6 * h * f)
    return (cfg.num_layers - 1) * layer_flops(cfg, s) + last + len(cfg.heads_after) * head_flops(cfg, s, p=p)


def step_flops(step: str, cfg: ModelConfig, s: int, paper: bool = False, trainable_layers: int = 0,
               p: float = 1.0) -> int:
    """Per-sequence FLOPs of one update of `step` (one of STEPS), p: the fraction of positions
    scored (TrainConfig.score_fraction); Step 1 is 3 forwards either way."""
    if step == "pretrain":
        return pretrain_flops(cfg, s, p)
    if step == "adapt":
        return adapt_flops(cfg, s, paper, p)
    if step == "minipost":
        return minipost_flops(cfg, s, trainable_layers, paper, p)
    if step == "score":  # a forward pass in evaluation, p: the fraction of positions scored
        return score_flops(cfg, s, p)
    raise ValueError(f"unknown step {step!r}; choose one of {', '.join(STEPS)}")
