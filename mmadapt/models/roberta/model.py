"""RoBERTa masked language model with MLM heads after any set of layers.

References: Liu et al. 2019 (RoBERTa; fairseq's `roberta.base`): learned positions, post-LayerNorm,
GELU, tied input embedding / output projection, MLM head = dense -> GELU -> LayerNorm -> tied
projection + bias. Marchisio et al. 2023 (mini-model adaptation): MINIJOINT adds a second head
after layer N; the loss is the mean of the heads' losses (or, with several secondary heads and
ModelConfig.head_weights, their weighted mean).

Tensor parallelism comes from megatron-core's layers, chosen at construction as megatron does
with its layer specs: with `tensor_model_parallel_size` > 1 vocab-parallel embedding and
cross-entropy, column-parallel QKV / FFN-in, row-parallel attention-out / FFN-out; with 1 the
plain torch layers of the same names and shapes, so a TP=1 model builds and runs with no process
group at all (evaluation, export, notebooks). Both draw each full weight from the same seeded
generator, so every layout starts from the same full weights. This file never imports DeepSpeed;
pipeline parallelism wraps these modules in `mmadapt/pipeline.py`.

Shapes (batch first throughout):
    b batch, s sequence, h hidden_size, nh heads, np heads on this TP rank, hd head dim,
    m masked positions in the batch, V vocab_size, Vp = padded_vocab_size / tensor_model_parallel_size
    (ModelConfig.padded_vocab_size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.models.layers import (Dropout, Jagged, Padding, WordEmbedding, attention_mask, attention_rng,
                                   column_linear, cpu_path, derive_seed, dropout, gathered, head_logits, head_losses,
                                   masked_positions, normal_init, position_rows, real_rows, row_linear, run_layers,
                                   split_vocab, tag_vocab_padding, to_tp_region, varlen_attention, vocab_linear)
from mmadapt.parallel import seeded
from mmadapt.tokens import PAD_ID


class EmbeddingPost(nn.Module):
    """Learned positions + LayerNorm + dropout on top of the token embeddings."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        with seeded(derive_seed(seed, "position_embeddings")):
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            nn.init.normal_(self.position_embeddings.weight, std=config.init_method_std)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.dropout = Dropout(config.hidden_dropout)

    def forward(self, word_embeds: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        positions = position_rows(self.position_embeddings, word_embeds.shape[1])  # [s, h]
        return self.dropout(self.layernorm(word_embeds + positions))


class TransformerLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + Drop(Attn(x))); x = LN(x + Drop(FFN(x)))."""

    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 1234):
        super().__init__()
        self.layer_number = layer_number  # 1-based, as in head_layers
        tp = self.tp = config.tensor_model_parallel_size
        self.num_heads_per_partition = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.attention_impl = config.attention_impl
        init, h = normal_init(config.init_method_std), config.hidden_size
        with seeded(derive_seed(seed, f"layers.{layer_number}")):
            # QKV output is laid out per head as [nh, 3, hd], so the contiguous column block that
            # a TP rank owns holds complete (q, k, v) triples of its own heads.
            self.qkv = column_linear(config, h, 3 * h, init)
            self.attn_out = row_linear(config, h, h, init)
            self.fc1 = column_linear(config, h, config.ffn_hidden_size, init)
            self.fc2 = row_linear(config, config.ffn_hidden_size, h, init)
        self.attn_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.ffn_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.dropout = Dropout(config.hidden_dropout)

    def attention(self, x: torch.Tensor, mask: "torch.Tensor | Jagged | None",
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; rows [m]: the output projection at those flat positions of
        b * s alone -> [m, h] (every query attends as before: the keys and values need every position)."""
        b, s, _ = x.shape
        if x.requires_grad or not self.qkv.weight.requires_grad or not torch.is_grad_enabled():
            qkv, _ = self.qkv(x)  # [b, s, 3h/tp]
        else:
            # The lowest trainable layer above frozen ones (MINIPOST Step 1b): megatron's linear
            # would compute an input gradient (6sh^2 FLOPs) that nothing uses; torch's skips it.
            qkv = F.linear(to_tp_region(x, self.tp), self.qkv.weight, self.qkv.bias)
        # Split on the (q, k, v) axis where it lies, then transpose: the backward stacks the three
        # gradients straight into qkv's layout [b, s, np, 3, hd] (one copy). Unbinding a permuted
        # leading axis stacked them as [3, b, np, s, hd] and copied again to make that contiguous.
        qkv = qkv.view(b, s, self.num_heads_per_partition, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each [b, np, s, hd]
        p = self.attention_dropout if self.training else 0.0
        # Heads are partitioned across TP ranks, so their dropout masks come from the per-rank stream
        # (but inside a compiled graph at TP 1: layers.attention_rng).
        with attention_rng(x, self.tp):
            if isinstance(mask, Jagged):
                ctx = varlen_attention(q, k, v, mask, p)
            elif self.attention_impl in ("sdpa", "varlen") and not (p and cpu_path(x)):
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            else:  # "math", or dropout on a CPU: SDPA has no CPU kernel with dropout, and its math
                # fallback is these matmuls with torch's slower mask (layers.dropout).
                scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, np, s, s]
                if mask is not None:  # added, as transformers' eager attention does: its backward is
                    # the identity (masked_fill's is another fill), and an all-padding row stays finite
                    bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)  # [b, 1, 1, s]
                    scores = scores + bias.masked_fill_(~mask, torch.finfo(scores.dtype).min)
                ctx = dropout(scores.softmax(-1), p) @ v  # [b, np, s, hd]
        ctx = ctx.transpose(1, 2).reshape(b, s, self.num_heads_per_partition * self.head_dim)
        if rows is not None:
            ctx = gathered(ctx, rows)  # [m, h/tp]
        out, _ = self.attn_out(ctx)  # [b, s, h] or [m, h], summed over TP ranks
        return out

    def forward(self, x: torch.Tensor, mask: "torch.Tensor | Jagged | None" = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h]; mask: `attention_mask`'s (None: no padding) -> [b, s, h].
        rows [m]: flat indices into b * s -> the output at those positions alone, [m, h]: the
        attention as for every position, then the output projection, FFN and LayerNorms at the m
        rows only (3/4 of a layer's matmuls skipped elsewhere). For the last layer a head reads in
        evaluation (`head_rows`): in training the dropout would draw other masks than the whole
        layer's, so training runs every position."""
        attn = self.attention(x, mask, rows)
        if rows is not None:
            x = gathered(x, rows)  # [m, h]
        x = self.attn_layernorm(x + self.dropout(attn))
        f, _ = self.fc1(x)  # [b, s, ffn/tp] (or [m, ...] at rows)
        f, _ = self.fc2(F.gelu(f))  # [b, s, h]
        return self.ffn_layernorm(x + self.dropout(f))


# The primary head's output bias [V] in a one-head model: indexed by vocabulary piece, so Step 2
# trains it with the new embeddings (adapt.py).
BIAS = "heads.heads.0.bias"


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm, then the tied projection (passed in) + this head's bias."""

    def __init__(self, config: ModelConfig, name: str, seed: int = 1234):
        super().__init__()
        h = config.hidden_size
        with seeded(derive_seed(seed, name)):
            self.dense = nn.Linear(h, h)
            nn.init.normal_(self.dense.weight, std=config.init_method_std)
            nn.init.zeros_(self.dense.bias)
        self.layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.tp, self.real_rows = config.tensor_model_parallel_size, real_rows(config)
        if config.frozen_vocab_size:  # an expanded vocabulary: source rows and new rows apart (layers.py)
            self.bias, self.new_bias = split_vocab(torch.zeros(config.vocab_size), config)
        else:
            # [Vp], this rank's slice of the (padded) vocabulary
            self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size // self.tp))
            if self.tp > 1:
                set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)
                tag_vocab_padding(self.bias, config)

    @property
    def bias_rows(self) -> tuple[nn.Parameter, ...]:
        return (self.bias, self.new_bias) if hasattr(self, "new_bias") else (self.bias,)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, h] -> what the tied projection reads [m, h]: dense -> GELU -> LayerNorm."""
        return self.layernorm(F.gelu(self.dense(x)))

    def forward(self, x: torch.Tensor, word_rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [m, h] hidden states of the masked positions only; word_rows: the tied projection's
        row blocks (layers.vocab_rows) -> logits [m, Vp]."""
        return vocab_linear(to_tp_region(self.features(x), self.tp), word_rows, self.bias_rows, self.real_rows)


class MLMHeads(nn.Module):
    """One MLMHead per entry of `head_layers`; the loss is the mean of their losses, or their
    weighted mean with `head_weights`."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        self.head_layers = config.heads_after
        self.loss_weights = config.loss_weights  # None: the plain mean
        self.tp = config.tensor_model_parallel_size
        self.heads = nn.ModuleList(MLMHead(config, f"heads.{l}", seed) for l in config.heads_after)

    def forward(self, hiddens: list[torch.Tensor], masked_index: torch.Tensor, targets: torch.Tensor,
                word_rows: tuple[torch.Tensor, ...], split: int | None = None):
        """hiddens: one [b, s, h] per head, in head_layers order; masked_index [m]: the masked
        positions as flat indices into b * s; targets [m]: their original tokens (see
        `masked_positions`); word_rows: the word embedding's row blocks (layers.vocab_rows).

        Only the m masked positions are projected onto the vocabulary: this is the factor p in the
        FLOP count of the head, and it saves 1/p of the head's cost on shallow models. The rows
        are gathered by index, not by a boolean mask, so the m comes from the host: a boolean
        gather on the device would make the host wait for the device to count m.
        Returns (loss, per_head): the mean (or weighted mean) of the heads' losses, and each head's
        loss, detached (with `split`, two texts' losses after them: layers.head_losses).
        """
        return head_losses(self.heads, hiddens, masked_index, targets, word_rows, self.loss_weights, split)


class Pooler(nn.Module):
    """transformers' pooler: dense -> tanh on the first position's state [b, h] (BERT's
    next-sentence and sequence-classification input; an imported body carries its own)."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        h = config.hidden_size
        with seeded(derive_seed(seed, "pooler")):
            self.dense = nn.Linear(h, h)
            nn.init.normal_(self.dense.weight, std=config.init_method_std)
            nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, h]
        return torch.tanh(self.dense(x[:, 0]))


class RobertaEncoder(nn.Module):
    """Embeddings and transformer layers: the body that every step shares (no output head)."""
    embedding_post = EmbeddingPost  # what follows the word embedding (BERT's adds token types)

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        self.config = config.validate()
        self.word_embeddings = WordEmbedding(config, seed)
        self.embeddings = self.embedding_post(config, seed)
        self.layers = nn.ModuleList(TransformerLayer(config, i, seed) for i in range(1, config.num_layers + 1))

    def encode(self, input_ids: torch.Tensor, layers: tuple[int, ...],
               padding: Padding | None = None, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> the output [b, s, h] of each layer in `layers` (1-based, ascending).
        padding: input_ids' Padding, counted on the host (None: ask the device). rows [m]: flat
        indices into b * s at which alone the last of `layers` is wanted ([m, h]; TransformerLayer)."""
        mask = attention_mask(input_ids, padding, self.config.attention_impl)
        return run_layers(self.layers, self.embeddings(self.word_embeddings(input_ids)), layers, mask, rows=rows)


class RobertaMLM(RobertaEncoder):
    """The plain (non-pipelined) model. Parallelism is applied around it (see pipeline.py, train.py)."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        self.heads = MLMHeads(config, seed)
        if config.add_pooling_layer:  # carried for import and export; the MLM loss never reads it
            self.pooler = Pooler(config, seed)

    def hidden_states(self, input_ids: torch.Tensor, padding: Padding | None = None,
                      rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> the output [b, s, h] of each layer in head_layers (the last one at
        `rows` alone, [m, h], where given: `encode`)."""
        return self.encode(input_ids, self.config.heads_after, padding, rows=rows)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                masked_index: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                padding: Padding | None = None, split: int | None = None):
        """input_ids [b, s] and either labels [b, s] (-100: not masked) or, prepared on the host so
        that the step never waits for the device (train.host_batch), masked_index [m] and
        targets [m] (`masked_positions`) and padding -> (loss, per_head [num heads]; with
        `split`, two texts' losses after them: layers.head_losses)."""
        if masked_index is None:
            masked_index, targets = masked_positions(labels)
        return self.heads(self.hidden_states(input_ids, padding, self.head_rows(masked_index)), masked_index,
                          targets, self.word_embeddings.rows, split)

    def head_rows(self, masked_index: torch.Tensor) -> torch.Tensor | None:
        """The flat positions at which alone the last layer runs: in evaluation (the plug-in
        metric, bits per byte), the scored ones [m]; in training None, every position (its dropout
        draws over the whole layer, and the FLOP counts of Steps 1 and 2 are of the whole layer)."""
        return None if self.training else masked_index

    def logits(self, input_ids: torch.Tensor, padding: Padding | None = None,
               rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] -> each head's logits [b, s, Vp] at every position, in head_layers
        order: what the loss scores at the masked positions, for looking at the model
        (mmadapt/predict.py). Training projects only the masked rows (MLMHeads).
        rows [m]: flat indices into b * s -> each head's logits [m, Vp] at those positions alone,
        the last layer run there alone (`encode`): what the scored positions of held-out text
        need (heldout.Scorer), without a [b * s, Vp] block of which they keep m rows."""
        hiddens = self.hidden_states(input_ids, padding, rows)
        return head_logits(self.heads.heads, hiddens, self.word_embeddings.rows, rows)


# --- task heads (Step 3 fine-tuning, Step 4 zero-shot evaluation) -----------------------------------

TASK_KINDS = ("classify", "tag", "span")  # sequence / sentence-pair classification, token tagging, extractive QA


class RobertaForTask(RobertaEncoder):
    """The primary model's body with a task head on its last layer. Parameter names of the body
    are RobertaMLM's, so a pretrained state dict loads as is (its MLM heads are not used) and
    Step 4 swaps `word_embeddings.word_embeddings.weight` alone.

    kind "classify": RoBERTa's sentence head on the <s> state: dropout -> dense -> tanh ->
        dropout -> linear, logits [b, C]; labels [b].
    kind "tag": dropout -> linear on every position, logits [b, s, C]; labels [b, s] (-100 on
        positions that carry no label: specials, padding, non-initial pieces of a word).
    kind "span": linear to (start, end) per position, logits [b, s, 2]; labels [b, 2] (the
        answer's first and last piece; 0 = the <s> position when the answer is not in this window).
        Padding positions get -inf so they are never predicted.
    The task head is replicated on tensor-parallel ranks (the layers' outputs are complete there).
    """

    def __init__(self, config: ModelConfig, kind: str, num_labels: int, seed: int = 1234):
        super().__init__(config, seed)
        if kind not in TASK_KINDS:
            raise ValueError(f"task kind must be one of {', '.join(TASK_KINDS)}, got {kind!r}")
        self.kind, self.num_labels = kind, num_labels
        h = config.hidden_size
        out = 2 if kind == "span" else num_labels
        with seeded(derive_seed(seed, "task_head")):
            self.dense = nn.Linear(h, h) if kind == "classify" else None
            self.out = nn.Linear(h, out)
            for lin in (self.dense, self.out):
                if lin is not None:
                    nn.init.normal_(lin.weight, std=config.init_method_std)
                    nn.init.zeros_(lin.bias)
        self.dropout = Dropout(config.hidden_dropout)

    def logits(self, input_ids: torch.Tensor, padding: Padding | None = None, **token_types) -> torch.Tensor:
        """input_ids [b, s] (token_types: BERT's) -> the kind's logits."""
        rows = self.head_rows(input_ids)
        x = self.encode(input_ids, (self.config.num_layers,), padding, rows=rows, **token_types)[0]
        return self.head(x if rows is None else x[:, None], input_ids)  # [b, s, h], or [b, 1, h] at <s>

    def head_rows(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The flat positions of input_ids [b, s] at which alone the last layer runs: in
        evaluation, a classifier's <s> ([b]: all its head reads); otherwise None (every position:
        the other kinds read them all, and training's dropout draws over the whole layer)."""
        if self.kind != "classify" or self.training:
            return None
        b, s = input_ids.shape
        return torch.arange(0, b * s, s, device=input_ids.device)

    def head(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The last layer's output x [b, s, h] -> the kind's logits."""
        if self.kind == "classify":
            return self.out(self.dropout(torch.tanh(self.dense(self.dropout(x[:, 0])))))  # [b, C]
        if self.kind == "tag":
            return self.out(self.dropout(x))  # [b, s, C]
        return self.out(x).masked_fill(input_ids.eq(PAD_ID)[..., None], float("-inf"))  # [b, s, 2]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, padding: Padding | None = None):
        """-> (loss or None, logits). The span loss is the mean of the start and end losses.
        padding: as in RobertaEncoder.encode."""
        return self.task_loss(self.logits(input_ids, padding), labels)

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor | None):
        """-> (the kind's loss, or None without labels; logits)."""
        if labels is None:
            return None, logits
        if self.kind == "span":  # in fp32 as the other kinds: a bf16 loss is rounded to 8 bits
            loss = (F.cross_entropy(logits[..., 0].float(), labels[:, 0])
                    + F.cross_entropy(logits[..., 1].float(), labels[:, 1])) / 2
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
        return loss, logits

