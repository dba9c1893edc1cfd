"""BERT (Devlin et al. 2019; transformers' BertModel, BertForMaskedLM): RoBERTa's post-LayerNorm
encoder (models/roberta/model.py) with two differences, both in the embeddings and the task head:

  - token-type (segment) embeddings [type_vocab_size, h], added with the word and position
    embeddings before the embedding LayerNorm. A task pair's second segment is type 1
    (features.Framing(separators=1, token_types=True)); the language model's blocks are type 0
    throughout, as BERT's MLM over single segments;
  - the sequence classifier reads the pooler (dense -> tanh on the [CLS] state), as
    BertForSequenceClassification does: pooler -> dropout -> linear. An imported body's trained
    pooler is where it starts (ModelConfig.add_pooling_layer); otherwise the pooler is new.
Positions count from 0 (RoBERTa's from padding_idx + 1 are shifted at import, so both families'
modules count from 0), exact GELU, BERT's MLM head (transform dense -> GELU -> LayerNorm, decoder
tied to the word embedding, with a bias) is RoBERTa's MLMHead, and the layers are RoBERTa's
TransformerLayer: the same math under other Hugging Face names (models/bert/hf.py).

Shapes as in models/roberta/model.py: b batch, s sequence, h hidden_size, T type_vocab_size.
"""

from __future__ import annotations

import torch
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.models.layers import Padding, attention_mask, derive_seed, position_rows, run_layers
from mmadapt.models.roberta.model import EmbeddingPost, Pooler, RobertaEncoder, RobertaForTask, RobertaMLM
from mmadapt.parallel import seeded


class BertEmbeddingPost(EmbeddingPost):
    """Positions + token types + LayerNorm + dropout on top of the word embeddings."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        with seeded(derive_seed(seed, "token_type_embeddings")):
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
            nn.init.normal_(self.token_type_embeddings.weight, std=config.init_method_std)

    def forward(self, word_embeds: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """word_embeds [b, s, h], token_types [b, s] (None: type 0 everywhere) -> [b, s, h]. A
        one-type model reads type 0 whatever it is given (its second segment has no row of its own)."""
        positions = position_rows(self.position_embeddings, word_embeds.shape[1])  # [s, h]
        if token_types is None or self.token_type_embeddings.num_embeddings == 1:
            types = self.token_type_embeddings.weight[0]  # [h], broadcast over [b, s]
        else:
            types = self.token_type_embeddings(token_types)
        return self.dropout(self.layernorm(word_embeds + positions + types))


class BertEncoding:
    """The body's forward with token types (mixed into RoBERTa's encoder classes)."""
    embedding_post = BertEmbeddingPost

    def encode(self, input_ids: torch.Tensor, layers: tuple[int, ...], padding: Padding | None = None,
               token_types: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [b, s] (and token_types [b, s]) -> the output [b, s, h] of each layer in
        `layers` (1-based, ascending); rows: as RobertaEncoder.encode's."""
        mask = attention_mask(input_ids, padding, self.config.attention_impl)
        return run_layers(self.layers, self.embeddings(self.word_embeddings(input_ids), token_types), layers, mask,
                          rows=rows)


class BertEncoder(BertEncoding, RobertaEncoder):
    """Embeddings (with token types) and transformer layers: `build_body`."""


class BertMLM(BertEncoding, RobertaMLM):
    """BERT's masked LM with MLM heads after any set of layers (RobertaMLM's), the pooler where the
    model has one (ModelConfig.add_pooling_layer). Blocks carry no token types: type 0 throughout."""


class BertForTask(BertEncoding, RobertaForTask):
    """The body with a task head (RobertaForTask's kinds), token types given to the embeddings.
    kind "classify": BertForSequenceClassification's head, pooler -> dropout -> linear, logits [b, C];
    "tag" and "span" as RoBERTa's (dropout -> linear on every position, or start/end logits)."""

    def __init__(self, config: ModelConfig, kind: str, num_labels: int, seed: int = 1234):
        super().__init__(config, kind, num_labels, seed)
        if kind == "classify":
            self.dense = None  # the pooler is BERT's classifier's first layer
            self.pooler = Pooler(config, seed)

    def head(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "classify":
            return self.out(self.dropout(self.pooler(x)))  # [b, C]
        return super().head(x, input_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, padding: Padding | None = None,
                token_types: torch.Tensor | None = None):
        """-> (loss or None, logits); token_types [b, s] (features.Encoded.token_types)."""
        return self.task_loss(self.logits(input_ids, padding, token_types=token_types), labels)
