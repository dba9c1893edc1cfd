"""Pipeline parallelism: the decoder's causal LM as a DeepSpeed PipelineModule.

The stage modules are the classes of model.py; only their `forward` is adapted to the tuple
that DeepSpeed passes between layers. Each stage builds only its own layers, and every layer
seeds its own initialisation (layers.derive_seed), so a pipeline starts from exactly the
weights of the single-process `LlamaLM` with the same seed.

Layer list (partitioned so that each stage gets an equal share of decoder layers), l = num_layers:
    0      PipeWordEmbedding    first stage; tied key "word" when the output projection is tied
    1..l   PipeDecoderLayer
    l + 1  tied:   PipeWordEmbedding, tied key "word" (last stage): appends its weight to the tuple
           untied: PipeOutputLayer: appends output_layer's weight to the tuple
           (an expanded vocabulary's weight: its two row blocks, the source rows and the new rows)
    l + 2  PipeLMHeads          returns the loss

Activation tuple between layers (and between stages):
    (hidden [b, s, h] float, input_ids [b, s] long, labels [b, s] long, *carried)
where `carried` holds, for each intermediate LM head whose layer has already run, that layer's
output [b, s, h] (before its head's final norm). An intermediate head (MINIJOINT's layer N) may
sit on an earlier stage than the last: its layer's output is carried down the pipe and the head
itself runs on the last stage, next to the primary head, both projecting with the one output
weight. Carrying the full [b, s, h] (not only the scored rows) keeps every p2p message a fixed
shape, which DeepSpeed's pipeline requires unless dynamic shapes are turned on.

Tied, DeepSpeed makes the first and last stages hold a copy of the word embedding and all-reduce
its gradient between them after each backward pass, so the copies stay identical. Each decoder
layer builds its own rotary table (model.rotary_table): O(s * hd) next to the layer's O(s * h^2)
matmuls, and it keeps the table out of the tuple that crosses stages.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.models.layers import Dropout, WordEmbedding, trained_vocab_attrs, vocab_blocks, vocab_rows
from mmadapt.models.llama.model import DecoderLayer, LMHeads, config_rotary_table, output_layer, validated
from mmadapt.models.pipe import ScoredQueue


class PipeWordEmbedding(WordEmbedding):
    """The word embedding, in one place (untied) or both of its places (tied).

    First stage: (input_ids, labels) -> (embeddings, input_ids, labels), with the embedding
    dropout of LlamaDecoder. Last stage (tied): appends its weight to the tuple for PipeLMHeads.
    Its own `forward` (rather than a TiedLayerSpec forward_fn) makes DeepSpeed save it as a
    layer: layers given by forward_fn are skipped by PipelineModule.save_state_dict.
    """

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        self.embedding_dropout = Dropout(config.hidden_dropout)

    def forward(self, inputs):
        if len(inputs) == 2:
            input_ids, labels = inputs
            return self.embedding_dropout(super().forward(input_ids)), input_ids, labels
        return (*inputs, *self.rows)


class PipeOutputLayer(nn.Module):
    """The untied output projection (model.output_layer): appends its weight to the tuple."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        self.output_layer = output_layer(config, seed)

    def forward(self, inputs):
        return (*inputs, *vocab_rows(self.output_layer))


class PipeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 1234):
        super().__init__(config, layer_number, seed)
        self.rope_config = config  # for config_rotary_table
        # Carry this layer's output down the pipe if an intermediate head reads it.
        self.carry = layer_number in config.heads_after and layer_number != config.num_layers

    def forward(self, inputs):
        hidden, input_ids, labels, *carried = inputs
        hidden = super().forward(hidden, config_rotary_table(self.rope_config, hidden.shape[1], hidden))
        # A new tuple, not carried.append: compiled (torch 2.11), dynamo's resume function after the
        # layer's graph break rebuilds the star-unpacked list `carried` as a tuple.
        return (hidden, input_ids, labels, *carried, *((hidden,) if self.carry else ()))


class PipeLMHeads(ScoredQueue, LMHeads):
    """Last layer: heads on (carried..., final hidden); stores each head's loss for logging.
    The decoder layers need no queue (models/pipe.py): causal attention needs no padding mask."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.init_queue()
        self.blocks = vocab_blocks(config)

    def forward(self, inputs):
        hidden, _input_ids, labels, *rest = inputs
        carried, output_rows = rest[:-self.blocks], tuple(rest[-self.blocks:])
        masked_index, targets, split = self.next_scored(labels)
        loss, per_head = super().forward([*carried, hidden], masked_index, targets, output_rows, split)
        return self.record(loss, per_head)


def to_pipeline(config: ModelConfig, seed: int, data_parallel_size: int) -> PipelineModule:
    """Build this rank's stage of the model. Topology matches parallel.init_parallel's groups."""
    validated(config)
    topology = PipeModelDataParallelTopology(num_pp=config.pipeline_model_parallel_size,
                                             num_mp=config.tensor_model_parallel_size,
                                             num_dp=data_parallel_size)
    if config.share_embeddings_and_output_weights:
        tie = dict(tied_weight_attr=trained_vocab_attrs(config, "word_embeddings"))
        first = last = TiedLayerSpec("word", PipeWordEmbedding, config, seed, **tie)
    else:
        first, last = LayerSpec(PipeWordEmbedding, config, seed), LayerSpec(PipeOutputLayer, config, seed)
    layers = [first, *(LayerSpec(PipeDecoderLayer, config, i, seed) for i in range(1, config.num_layers + 1)),
              last, LayerSpec(PipeLMHeads, config)]
    pipe = PipelineModule(layers=layers, topology=topology, partition_method="type:PipeDecoderLayer")
    n = len(layers)
    # The embedding must open the first stage and the heads close the last one (weights 0 in
    # the balanced partition put them there as long as every stage owns a decoder layer).
    assert pipe.parts[1] >= 1 and pipe.parts[-2] <= n - 2, f"unexpected pipeline partition {pipe.parts}"
    return pipe
