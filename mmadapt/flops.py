"""Analytic FLOP counts (Marchisio et al. 2023, Appendix A.1, after Narayanan et al. 2021).

A matmul of [m, n] x [n, k] costs 2mnk FLOPs; non-matmul work (LayerNorm, softmax, GELU) is
not counted. Per sequence of s tokens, with hidden h, feed-forward f, vocabulary V, and a
fraction p of positions masked (only those reach the vocabulary projection):

    layer   = 2sh(3h) [QKV] + 2s^2h [QK^T] + 2s^2h [xV] + 2sh^2 [out] + 4shf [FFN]
            = 24sh^2 + 4s^2h                      when f = 4h   (paper's FLOP_layer)
    head    = p(2sh^2 + 2shV)                     per MLM head  (paper's FLOP_lm)
    forward = l * layer + heads * head            (A2 with one head)

Training with every parameter trainable costs 3 x forward (A1 with one head): each matmul's
backward computes one product for the input gradient and one for the weight gradient.
"""

from __future__ import annotations

from mmadapt.config import ModelConfig


def layer_flops(cfg: ModelConfig, s: int) -> float:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    return 8 * s * h * h + 4 * s * s * h + 4 * s * h * f


def head_flops(cfg: ModelConfig, s: int, p: float) -> float:
    h, v = cfg.hidden_size, cfg.vocab_size
    return p * (2 * s * h * h + 2 * s * h * v)


def forward_flops(cfg: ModelConfig, s: int, p: float) -> float:
    """Forward FLOPs of one sequence through all layers and every MLM head."""
    return cfg.num_layers * layer_flops(cfg, s) + len(cfg.head_layers) * head_flops(cfg, s, p)


def pretrain_step_flops(cfg: ModelConfig, global_batch: int, s: int, p: float) -> float:
    """FLOPs of one update of Step 1 (every parameter trainable): 3 x forward x B."""
    return 3 * global_batch * forward_flops(cfg, s, p)
