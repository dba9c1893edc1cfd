"""Llama-style causal language model with LM heads after any set of layers.

References: Touvron et al. 2023 (Llama, Llama 2): a pre-norm decoder with RMSNorm, rotary
positions, a SwiGLU feed-forward and no biases. Su et al. 2021 (RoFormer): rotary position
embedding, here in the non-interleaved ("rotate_half") form of transformers' Llama. Ainslie et
al. 2023 (GQA): ng key/value heads, each shared by nh / ng query heads. Shazeer 2020 (GLU
variants): SwiGLU, silu(x W_gate) * (x W_up). megatron-core's GPTModel: the tensor-parallel
layout (one fused QKV per key/value group, a fused gate/up projection) and the config names
(num_query_groups, add_qkv_bias, rotary_base, share_embeddings_and_output_weights). Qwen2 is this
model with a QKV bias. Marchisio et al. 2023 (mini-model adaptation): MINIJOINT adds a secondary
LM head after layer N, with its own final norm and the primary's output projection; the loss is
the mean of the heads' losses (or their weighted mean, ModelConfig.head_weights).

Numerics follow transformers' LlamaForCausalLM (RMSNorm in fp32, rotary tables in fp32 cast to
the activations' dtype, softmax in fp32 on the explicit path), so imported checkpoints give its
logits (tests/test_llama_model.py). As in the encoder (mmadapt/models/roberta/model.py),
tensor parallelism comes from megatron-core's layers at tensor_model_parallel_size > 1 and
plain torch layers of the same names and shapes at 1, every full weight is drawn from its own
seeded generator, and this file never imports DeepSpeed (pipeline.py wraps these modules).

Shapes (batch first throughout):
    b batch, s sequence, h hidden_size, nh attention heads, ng key/value (query) groups,
    np / gp heads / groups on this TP rank, r = nh / ng query heads per group, hd head dim,
    f ffn_hidden_size, fp = f / TP, m scored positions in the batch, V vocab_size, Vp = padded_vocab_size
    / TP (ModelConfig.padded_vocab_size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.models.layers import (Dropout, Linear, Padding, SplitVocabRows, WordEmbedding, attention_rng,
                                   column_linear, cpu_path, derive_seed, dropout, gathered, head_logits, head_losses,
                                   masked_positions, normal_init, padded_init, real_rows, row_linear,
                                   run_layers, tag_vocab_padding, to_tp_region, vocab_linear, vocab_rows)
from mmadapt.parallel import seeded
from mmadapt.tokens import PAD_ID


OUTPUT = "output_layer.weight"  # the untied output projection [V, h] (LlamaLM.output_layer)


def validated(config: ModelConfig) -> ModelConfig:
    """config.validate(), and what the decoder refuses on top of it (LlamaFamily.check)."""
    config.validate()
    if config.attention_impl == "varlen":
        raise ValueError("attention_impl 'varlen' is the encoder's way around padding; for the decoder use sdpa: "
                         "causal attention on right-padded rows needs no mask")
    return config


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019). Normalised in fp32 and cast back before the
    weight, as transformers' LlamaRMSNorm: in bf16 an imported checkpoint then rounds as it does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused RMS norm (one kernel forward and one backward, against five and their
        # backwards spelled out) of the fp32 activations, cast back, then the weight.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rotary_table(s: int, head_dim: int, base: float, like: torch.Tensor,
                 interpolation: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), each [s, hd], for positions 0..s-1, in `like`'s dtype and device: the
    sin's first half negated, as `rotate` multiplies it (once here, not per layer for q and for k:
    four launches of every layer's forward). With `interpolation`
    (ModelConfig.seq_len_interpolation_factor) position p turns as p / factor would.

    Built once per forward pass and handed to every layer (not cached on the module): it costs
    O(s * hd), nothing next to one layer's matmuls, and a cache keyed by (s, device, dtype)
    would be module state that dynamo guards on and that `.to()` and checkpoints must skip.
    Angles are computed in fp32 whatever the activations' dtype: in bf16, position * frequency
    would lose the position past a few hundred tokens."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=like.device) / head_dim)
    if interpolation is not None:
        # transformers' rope_type "linear" divides the frequencies, not the positions (megatron-core
        # divides the positions): the same angles, and this way rounded as transformers rounds them.
        inv_freq = inv_freq / interpolation
    freqs = torch.arange(s, dtype=torch.float32, device=like.device)[:, None] * inv_freq  # [s, hd/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [s, hd]: dimension i pairs with i + hd/2
    sin = angles.sin()
    sin[..., :head_dim // 2].neg_()  # exact: negated before or after the cast, the same bits
    return angles.cos().to(like.dtype), sin.to(like.dtype)


def config_rotary_table(config: ModelConfig, s: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_table` for s positions of a model of `config`."""
    return rotary_table(s, config.head_dim, config.rotary_base, like, config.seq_len_interpolation_factor)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate each (i, i + hd/2) pair of x [b, heads, s, hd] by its position's angle:
    x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] computed as roll(x) = [x2, x1]
    times a sin whose first half is negated (rope: `rotary_table`'s (cos, signed sin) [s, hd]).
    The activations get one copy (the roll) instead of a negation, two slices and a
    concatenation, bit for bit the same result."""
    cos, signed_sin = rope
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x = x + Drop(Attn(RMSNorm(x))); x = x + Drop(SwiGLU(RMSNorm(x))).

    No special case for the lowest trainable layer above frozen ones (MINIPOST Step 1b), unlike
    the post-LN encoder, whose QKV reads the frozen layer's output directly: there megatron's
    linear (TP > 1) computes an input gradient that nothing uses. Here every linear of a
    trainable layer reads a tensor that needs a gradient: QKV and fc1 read RMSNorm outputs,
    which need one for the norms' weights (Step 1b trains whole layers), attn_out and fc2 read
    products of trainable projections. (Frozen weights are megatron's frozen-weight path:
    input gradient only.)
    """

    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 1234):
        super().__init__()
        self.layer_number = layer_number  # 1-based, as in head_layers
        tp = config.tensor_model_parallel_size
        nh, ng, hd, h = config.num_attention_heads, config.query_groups, config.head_dim, config.hidden_size
        self.heads, self.groups, self.head_dim = nh // tp, ng // tp, hd  # np, gp, hd
        self.tp = tp
        self.attention_dropout = config.attention_dropout
        self.attention_impl = config.attention_impl
        init = normal_init(config.init_method_std)
        # megatron's scaled init of the two projections that write into the residual stream,
        # so that the stream's variance does not grow with depth.
        out_init = normal_init(config.init_method_std / math.sqrt(2 * config.num_layers))
        with seeded(derive_seed(seed, f"layers.{layer_number}")):
            # Rows laid out per key/value group as [ng, r + 2, hd] (the group's r query heads,
            # its key head, its value head), so the contiguous row block that a TP rank owns
            # holds whole groups: attention needs no communication.
            self.qkv = column_linear(config, h, (nh + 2 * ng) * hd, init, bias=config.add_qkv_bias)
            self.attn_out = row_linear(config, nh * hd, h, out_init, bias=False)
            # Rows interleaved, 2j = gate_j and 2j + 1 = up_j: any TP chunk of rows holds whole
            # (gate, up) pairs, so the full weight's layout does not depend on the TP size.
            self.fc1 = column_linear(config, h, 2 * config.ffn_hidden_size, init, bias=False)
            self.fc2 = row_linear(config, config.ffn_hidden_size, h, out_init, bias=False)
        self.input_layernorm = RMSNorm(h, config.layernorm_epsilon)
        self.post_attention_layernorm = RMSNorm(h, config.layernorm_epsilon)
        self.dropout = Dropout(config.hidden_dropout)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """Causal self-attention, x [b, s, h] -> [b, s, h]; rows [m]: the output projection at
        those flat positions of b * s alone -> [m, h]. No padding mask, ever: batches are
        unpadded (packed LM blocks) or right-padded (task batches), and in a right-padded row
        every real token precedes every pad, so the causal mask alone keeps real tokens from
        seeing padding. Pad positions do see real tokens, but no loss and no pooling reads their
        outputs. Hence SDPA always gets is_causal and no mask, which keeps its flash kernel
        eligible on a GPU."""
        b, s, _ = x.shape
        r = self.heads // self.groups
        qkv, _ = self.qkv(x)  # [b, s, (np + 2gp) hd]
        q, k, v = qkv.view(b, s, self.groups, r + 2, self.head_dim).split((r, 1, 1), dim=3)
        # Query head j of group g is head g * r + j: transformers' order (its repeat_kv).
        q = rotate(q.reshape(b, s, self.heads, self.head_dim).transpose(1, 2), rope)  # [b, np, s, hd]
        k = rotate(k.squeeze(3).transpose(1, 2), rope)  # [b, gp, s, hd]
        v = v.squeeze(3).transpose(1, 2)  # [b, gp, s, hd]
        p = self.attention_dropout if self.training else 0.0
        # Heads are partitioned across TP ranks, so their dropout masks come from the per-rank stream
        # (but inside a compiled graph at TP 1: layers.attention_rng).
        with attention_rng(x, self.tp):
            if self.attention_impl == "sdpa" and not (p and cpu_path(x)):
                ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=r > 1)
            else:  # "math": explicit matmuls, which torch's FLOP counter sees; and dropout on a CPU,
                # where SDPA's math fallback is these matmuls with torch's slower mask (layers.dropout)
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # [b, np, s, hd]
                scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, np, s, s]
                future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
                probs = scores.masked_fill(future, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
                ctx = dropout(probs, p) @ v  # [b, np, s, hd]
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        if rows is not None:
            ctx = gathered(ctx, rows)  # [m, np hd]
        out, _ = self.attn_out(ctx)
        return out  # [b, s, h] (or [m, h] at rows), summed over TP ranks

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        # fc1's rows interleave gate and up (2j, 2j + 1). Multiplying by two row-strided views of
        # its weight (a BLAS leading dimension, no copy) gives gate and up as contiguous tensors;
        # the two halves of one [b, s, 2fp] output would each be strided, and SiLU, the product
        # and their backwards run several times slower on strided tensors on a CPU. The same
        # FLOPs and weights. At TP > 1 this is ColumnParallelLinear's own forward on its
        # weight (no bias, no sequence parallelism): the identity to the TP region, then x W^T.
        x = to_tp_region(x, self.tp)
        gate = F.linear(x, self.fc1.weight[0::2])  # [b, s, fp]
        up = F.linear(x, self.fc1.weight[1::2])  # [b, s, fp]
        out, _ = self.fc2(F.silu(gate) * up)
        return out  # [b, s, h], summed over TP ranks

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h]; rope: `rotary_table` for s -> [b, s, h]. rows [m]: flat indices into
        b * s -> the output at those positions alone, [m, h]: the attention as for every position
        (the keys and values need them all), then the output projection, residual and MLP at the
        m rows only. For the last layer a head reads in evaluation (LlamaForTask.logits: each
        row's last real token); training runs every position, as its dropout draws over the
        whole layer."""
        attn = self.attention(self.input_layernorm(x), rope, rows)
        if rows is not None:
            x = gathered(x, rows)  # [m, h]
        x = x + self.dropout(attn)
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class LMHead(nn.Module):
    """This head's final RMSNorm, then the output projection (passed in: every head shares the
    primary's). Its only parameter is the norm's weight, initialised to ones: nothing to seed."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.tp, self.real_rows = config.tensor_model_parallel_size, real_rows(config)

    bias_rows = None  # the output projection has no bias

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, h] -> what the output projection reads [m, h]: the final RMSNorm."""
        return self.norm(x)

    def forward(self, x: torch.Tensor, output_rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [m, h], the hidden states of the scored positions only; output_rows: the output
        projection's row blocks (layers.vocab_rows) -> logits [m, Vp]."""
        return vocab_linear(to_tp_region(self.features(x), self.tp), output_rows, real=self.real_rows)


class LMHeads(nn.Module):
    """One LMHead per entry of heads_after; the loss is the mean of their losses, or their
    weighted mean with head_weights."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.loss_weights = config.loss_weights  # None: the plain mean
        self.tp = config.tensor_model_parallel_size
        self.heads = nn.ModuleList(LMHead(config) for _ in config.heads_after)

    def forward(self, hiddens: list[torch.Tensor], masked_index: torch.Tensor, targets: torch.Tensor,
                output_rows: tuple[torch.Tensor, ...], split: int | None = None):
        """hiddens: one [b, s, h] per head, in heads_after order; masked_index [m]: the scored
        positions as flat indices into b * s, targets [m]: their next tokens (`masked_positions`);
        output_rows: the output projection [Vp, h] as row blocks (layers.vocab_rows).

        Only the m scored rows are normed and projected. They are gathered by index, not by a
        boolean mask, so that m comes from the host: a boolean gather on the device would make
        the host wait for the device to count m.
        Returns (loss, per_head): the mean (or weighted mean) of the heads' losses, and each
        head's loss, detached (with `split`, two texts' losses after them: layers.head_losses).
        """
        return head_losses(self.heads, hiddens, masked_index, targets, output_rows, self.loss_weights, split)


def output_layer(config: ModelConfig, seed: int = 1234) -> nn.Module:
    """The untied output projection, weight [Vp, h]: its own seeded draw. Only its weight is
    used (LMHead projects with its row blocks), so that every head shares one matmul path, tied or
    not. An expanded vocabulary's holds its source rows and new rows apart (layers.SplitVocabRows)."""
    init = normal_init(config.init_method_std)
    with seeded(derive_seed(seed, "output_layer")):
        if config.frozen_vocab_size:
            return SplitVocabRows(config, init)
        layer = column_linear(config, config.hidden_size, config.padded_vocab_size, padded_init(init, config),
                              bias=False)
        tag_vocab_padding(layer.weight, config)
        return layer


class LlamaDecoder(nn.Module):
    """Word embedding and decoder layers: the body that every step shares (no final norm, no head)."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        self.config = validated(config)
        self.word_embeddings = WordEmbedding(config, seed)
        self.embedding_dropout = Dropout(config.hidden_dropout)  # megatron GPT's; Llama's is 0
        self.layers = nn.ModuleList(DecoderLayer(config, i, seed) for i in range(1, config.num_layers + 1))

    def encode(self, input_ids: torch.Tensor, layers: tuple[int, ...],
               padding: Padding | None = None, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> the output [b, s, h] of each layer in `layers` (1-based,
        ascending), before any final norm. padding is accepted so that every family is called
        alike, and unused: causal attention needs no padding mask (DecoderLayer.attention).
        rows [m]: flat indices into b * s at which alone the last of `layers` is wanted, [m, h]
        (layers.run_layers)."""
        if input_ids.shape[1] > self.config.max_position_embeddings:  # a host-side shape: no sync
            # Rotary positions run on past it, but an imported sliding-window model (Mistral) is
            # exactly causal only within its window, where the import capped the positions.
            raise ValueError(f"{input_ids.shape[1]} positions exceed the model's max_position_embeddings "
                             f"{self.config.max_position_embeddings}: cut the text into rows no longer than that")
        x = self.embedding_dropout(self.word_embeddings(input_ids))
        return run_layers(self.layers, x, layers, config_rotary_table(self.config, input_ids.shape[1], x), rows=rows)


class LlamaLM(LlamaDecoder):
    """The plain (non-pipelined) causal LM. Parallelism is applied around it (pipeline.py)."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        self.heads = LMHeads(config)
        if not config.share_embeddings_and_output_weights:
            self.output_layer = output_layer(config, seed)

    @property
    def output_weight(self) -> nn.Parameter:  # [Vp, h]; an expanded vocabulary's is `output_rows`
        (weight,) = self.output_rows
        return weight

    @property
    def output_rows(self) -> tuple[nn.Parameter, ...]:
        """The output projection [Vp, h] as row blocks (layers.vocab_rows)."""
        if self.config.share_embeddings_and_output_weights:
            return self.word_embeddings.rows
        return vocab_rows(self.output_layer)

    def hidden_states(self, input_ids: torch.Tensor, padding: Padding | None = None,
                      rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> the output [b, s, h] of each layer in heads_after (each head
        applies its own final norm; the last one at `rows` alone, [m, h], where given)."""
        return self.encode(input_ids, self.config.heads_after, padding, rows)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                masked_index: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                padding: Padding | None = None, split: int | None = None):
        """input_ids [b, s] and either labels [b, s] (the next token at each position; -100: not
        scored) or, prepared on the host so that the step never waits for the device,
        masked_index [m] and targets [m] (`masked_positions`) -> (loss, per_head [num heads]; with
        `split`, two texts' losses after them: layers.head_losses)."""
        if masked_index is None:
            masked_index, targets = masked_positions(labels)
        return self.heads(self.hidden_states(input_ids, padding), masked_index, targets, self.output_rows, split)

    def logits(self, input_ids: torch.Tensor, padding: Padding | None = None,
               rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> each head's next-piece logits [b, s, Vp] at every position, in
        heads_after order, for looking at the model (mmadapt/predict.py); training projects only
        the scored rows (LMHeads). rows [m]: flat indices into b * s -> each head's logits
        [m, Vp] at those positions alone (heldout.Scorer's scored positions)."""
        return head_logits(self.heads.heads, self.hidden_states(input_ids, padding, rows), self.output_rows, rows)


# --- task head (Step 3 fine-tuning, Step 4 zero-shot evaluation) ---------------------------------------

TASK_KINDS = ("classify",)


def task_param_name(name: str, config: ModelConfig) -> str:
    """Map a LlamaForTask parameter name to the LlamaLM name it loads from: the body's are the
    same; the final norm is the primary head's (the task head `score` has none, so its name
    stays and a pretrained state lacks it)."""
    return f"heads.heads.{len(config.heads_after) - 1}.norm.weight" if name == "norm.weight" else name


class LlamaForTask(LlamaDecoder):
    """The primary model's body and final norm with a linear `score` on the last real token of
    each row, as transformers' LlamaForSequenceClassification: causal attention makes that the
    only position that has read the whole sequence. Parameter names of the body are LlamaLM's
    (`task_param_name` maps the final norm), so a pretrained state dict loads and Step 4 swaps
    `word_embeddings.word_embeddings.weight` alone.

    kind "classify": logits [b, C]; labels [b]. Rows are right-padded (features.py), so the last
    real token is the rightmost non-PAD one. The head is replicated on tensor-parallel ranks.
    """

    def __init__(self, config: ModelConfig, kind: str, num_labels: int, seed: int = 1234):
        super().__init__(config, seed)
        if kind not in TASK_KINDS:
            raise ValueError(f"task kind must be one of {', '.join(TASK_KINDS)} for the decoder family, got {kind!r}")
        self.kind, self.num_labels = kind, num_labels
        self.norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        with seeded(derive_seed(seed, "score")):
            self.score = Linear(config.hidden_size, num_labels, normal_init(config.init_method_std), bias=False)

    def logits(self, input_ids: torch.Tensor, padding: Padding | None = None) -> torch.Tensor:
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)
        last = (positions * input_ids.ne(PAD_ID)).argmax(-1)  # [b], found on the device: no host wait
        pooled = torch.arange(b, device=input_ids.device) * s + last  # [b]: flat indices into b * s
        # In evaluation the last layer runs at those b rows alone (DecoderLayer.forward); training
        # runs every position, as its dropout draws over the whole layer.
        rows = None if self.training else pooled
        x = self.encode(input_ids, (self.config.num_layers,), padding, rows)[0]  # [b, s, h], or [b, h] at rows
        logits, _ = self.score(self.norm(gathered(x, pooled)))  # [b, h]: gathered unless run at the rows
        return logits  # [b, C]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, padding: Padding | None = None):
        """-> (loss or None, logits [b, C]). padding: as in LlamaDecoder.encode."""
        logits = self.logits(input_ids, padding)
        if labels is None:
            return None, logits
        return F.cross_entropy(logits.float(), labels), logits
