"""Pipeline parallelism: the RoBERTa MLM as a DeepSpeed PipelineModule.

The stage modules are the classes of model.py; only their `forward` is adapted to the tuple
that DeepSpeed passes between layers. Each stage builds only its own layers, and every layer
seeds its own initialisation (model.derive_seed), so a pipeline starts from exactly the weights
of the single-process `RobertaMLM` with the same seed.

Layer list (partitioned so that each stage gets an equal share of transformer layers):
    0   PipeWordEmbedding        tied key "word" (first stage)
    1   PipeEmbeddingPost
    2.. PipeTransformerLayer x num_layers
    -2  PipeWordEmbedding        tied key "word" (last stage): appends its weight to the tuple
                                 (an expanded vocabulary's two row blocks: its source and new rows)
    -1  PipeMLMHeads             returns the loss

Activation tuple between layers (and between stages):
    (hidden [b, s, h] float, input_ids [b, s] long, labels [b, s] long, *carried)
where `carried` holds, for each intermediate MLM head whose layer has already run, that layer's
output [b, s, h]. An intermediate head (MINIJOINT's layer N) may sit on an earlier stage than
the last: its layer's output is carried down the pipe and the head itself runs on the last
stage, next to the primary head, both projecting with the one tied embedding weight. Carrying
the full [b, s, h] (not only the m masked rows) keeps every p2p message a fixed shape, which
DeepSpeed's pipeline requires unless dynamic shapes are turned on. The cost is one extra
activation per micro-batch on each stage boundary after layer N.

DeepSpeed's tie makes the first and last stages hold a copy of the word embedding and
all-reduce its gradient between them after each backward pass, so the copies stay identical (an
expanded vocabulary's: the new rows' gradient; the source rows never change).
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from mmadapt.config import ModelConfig
from mmadapt.models.layers import WordEmbedding, attention_mask, trained_vocab_attrs, vocab_blocks
from mmadapt.models.pipe import PaddingQueue, ScoredQueue
from mmadapt.models.roberta.model import EmbeddingPost, MLMHeads, TransformerLayer


class PipeEmbeddingPost(EmbeddingPost):
    def forward(self, inputs):
        word_embeds, input_ids, labels = inputs
        return super().forward(word_embeds), input_ids, labels


class PipeTransformerLayer(PaddingQueue, TransformerLayer):
    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 1234):
        super().__init__(config, layer_number, seed)
        # Carry this layer's output down the pipe if an intermediate head reads it.
        self.carry = layer_number in config.heads_after and layer_number != config.num_layers
        self.init_queue()

    def forward(self, inputs):
        hidden, input_ids, labels, *carried = inputs
        # The mask first: next_padding is host bookkeeping that dynamo does not trace (a graph
        # break), and a bound super().forward on the stack there is a fresh object every call,
        # which torch 2.9's resume function guarded on: one recompile per micro-batch.
        mask = attention_mask(input_ids, self.next_padding(), self.attention_impl)
        hidden = super().forward(hidden, mask)
        # A new tuple, not carried.append: compiled (torch 2.11), dynamo's resume function after the
        # layer's graph break rebuilds the star-unpacked list `carried` as a tuple.
        return (hidden, input_ids, labels, *carried, *((hidden,) if self.carry else ()))


class PipeMLMHeads(ScoredQueue, MLMHeads):
    """Last layer: heads on (carried..., final hidden); stores each head's loss for logging."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        self.init_queue()
        self.blocks = vocab_blocks(config)

    def forward(self, inputs):
        hidden, _input_ids, labels, *rest = inputs
        carried, word_rows = rest[:-self.blocks], tuple(rest[-self.blocks:])
        masked_index, targets, split = self.next_scored(labels)
        loss, per_head = super().forward([*carried, hidden], masked_index, targets, word_rows, split)
        return self.record(loss, per_head)


class PipeWordEmbedding(WordEmbedding):
    """The tied word embedding, in both of its places.

    First stage: (input_ids, labels) -> (embeddings, input_ids, labels). Last stage: appends its
    weight's row blocks (layers.vocab_rows: one, or an expanded vocabulary's two) to the tuple for
    PipeMLMHeads. Its own `forward` (rather than a TiedLayerSpec
    forward_fn) makes DeepSpeed save it as a layer: layers given by forward_fn are skipped by
    PipelineModule.save_state_dict.
    """

    def forward(self, inputs):
        if len(inputs) == 2:
            input_ids, labels = inputs
            return super().forward(input_ids), input_ids, labels
        return (*inputs, *self.rows)


def to_pipeline(config: ModelConfig, seed: int, data_parallel_size: int,
                embedding: type = PipeEmbeddingPost) -> PipelineModule:
    """Build this rank's stage of the model. Topology matches parallel.init_parallel's groups.
    embedding: layer 1's class (BERT's adds token types: models/bert/pipeline.py)."""
    topology = PipeModelDataParallelTopology(num_pp=config.pipeline_model_parallel_size,
                                             num_mp=config.tensor_model_parallel_size,
                                             num_dp=data_parallel_size)
    tie = dict(tied_weight_attr=trained_vocab_attrs(config, "word_embeddings"))
    layers = [TiedLayerSpec("word", PipeWordEmbedding, config, seed, **tie),
              LayerSpec(embedding, config, seed)]
    layers += [LayerSpec(PipeTransformerLayer, config, i, seed) for i in range(1, config.num_layers + 1)]
    layers += [TiedLayerSpec("word", PipeWordEmbedding, config, seed, **tie),
               LayerSpec(PipeMLMHeads, config, seed)]
    pipe = PipelineModule(layers=layers, topology=topology, partition_method="type:PipeTransformerLayer")
    n = len(layers)
    # Embeddings must open the first stage and heads close the last one (weights 0 in the
    # balanced partition put them there as long as every stage owns a transformer layer).
    assert pipe.parts[1] >= 2 and pipe.parts[-2] <= n - 2, f"unexpected pipeline partition {pipe.parts}"
    return pipe
