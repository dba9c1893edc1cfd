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
all-reduce its gradient between them after each backward pass, so the copies stay identical.
"""

from __future__ import annotations

import collections

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from mmadapt.config import ModelConfig
from mmadapt.models.roberta.model import (EmbeddingPost, MLMHeads, Padding, TransformerLayer, WordEmbedding, attention_mask,
                           masked_positions)


class PipeEmbeddingPost(EmbeddingPost):
    def forward(self, inputs):
        word_embeds, input_ids, labels = inputs
        return super().forward(word_embeds), input_ids, labels


class PipeTransformerLayer(TransformerLayer):
    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 1234):
        super().__init__(config, layer_number, seed)
        # Carry this layer's output down the pipe if an intermediate head reads it.
        self.carry = layer_number in config.heads_after and layer_number != config.num_layers
        # The Padding of each micro-batch to come, in order, counted on the host
        # (set_host_batches): a stage runs its forward passes in micro-batch order. Empty:
        # count it on the device.
        self.pending: collections.deque = collections.deque()

    def forward(self, inputs):
        hidden, input_ids, labels, *carried = inputs
        hidden = super().forward(hidden, self._next_mask(input_ids))
        if self.carry:
            carried.append(hidden)
        return (hidden, input_ids, labels, *carried)

    # Host-side bookkeeping stays out of compiled graphs (fusion.py compiles this module): traced,
    # it would make dynamo guard on each micro-batch's Padding, a recompile for every new one.
    @torch.compiler.disable
    def _next_mask(self, input_ids: torch.Tensor):
        padding = self.pending.popleft() if self.pending else None
        return attention_mask(input_ids, padding, self.attention_impl)


class PipeMLMHeads(MLMHeads):
    """Last layer: heads on (carried..., final hidden); stores each head's loss for logging."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__(config, seed)
        self.head_losses: list[torch.Tensor] = []  # one [num heads] tensor per micro-batch
        # (masked_index, targets) of the micro-batches to come, in order, prepared on the host
        # (set_host_batches): the last stage runs its forward passes in micro-batch order.
        self.pending: collections.deque = collections.deque()

    def forward(self, inputs):
        hidden, _input_ids, labels, *carried, word_weight = inputs
        masked_index, targets = self._next_masked(labels)
        loss, per_head = super().forward([*carried, hidden], masked_index, targets, word_weight)
        self._record(per_head)
        return loss

    # Out of compiled graphs, as PipeTransformerLayer._next_mask (traced, the list's length
    # would be guarded on: a recompile per micro-batch).
    @torch.compiler.disable
    def _next_masked(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pending.popleft() if self.pending else masked_positions(labels)

    @torch.compiler.disable
    def _record(self, per_head: torch.Tensor) -> None:
        self.head_losses.append(per_head)


class PipeWordEmbedding(WordEmbedding):
    """The tied word embedding, in both of its places.

    First stage: (input_ids, labels) -> (embeddings, input_ids, labels). Last stage: appends its
    weight to the tuple for PipeMLMHeads. Its own `forward` (rather than a TiedLayerSpec
    forward_fn) makes DeepSpeed save it as a layer: layers given by forward_fn are skipped by
    PipelineModule.save_state_dict.
    """

    def forward(self, inputs):
        if len(inputs) == 2:
            input_ids, labels = inputs
            return super().forward(input_ids), input_ids, labels
        return (*inputs, self.weight)


def set_host_batches(pipe: PipelineModule, padding: list[Padding], masked: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand this rank's stage what the host knows about the micro-batches of the next
    train_batch / eval_batch, in their order, so that no layer asks the device: each one's
    Padding, for the transformer layers, and its (masked_index, targets) on the device, for the
    heads of the last stage."""
    for m in pipe.modules():
        if isinstance(m, (PipeTransformerLayer, PipeMLMHeads)):
            m.pending.clear()
            m.pending.extend(padding if isinstance(m, PipeTransformerLayer) else masked)


def to_pipeline(config: ModelConfig, seed: int, data_parallel_size: int) -> PipelineModule:
    """Build this rank's stage of the model. Topology matches parallel.init_parallel's groups."""
    topology = PipeModelDataParallelTopology(num_pp=config.pipeline_model_parallel_size,
                                             num_mp=config.tensor_model_parallel_size,
                                             num_dp=data_parallel_size)
    tie = dict(tied_weight_attr=["word_embeddings.weight"])
    layers = [TiedLayerSpec("word", PipeWordEmbedding, config, seed, **tie),
              LayerSpec(PipeEmbeddingPost, config, seed)]
    layers += [LayerSpec(PipeTransformerLayer, config, i, seed) for i in range(1, config.num_layers + 1)]
    layers += [TiedLayerSpec("word", PipeWordEmbedding, config, seed, **tie),
               LayerSpec(PipeMLMHeads, config, seed)]
    pipe = PipelineModule(layers=layers, topology=topology, partition_method="type:PipeTransformerLayer")
    n = len(layers)
    # Embeddings must open the first stage and heads close the last one (weights 0 in the
    # balanced partition put them there as long as every stage owns a transformer layer).
    assert pipe.parts[1] >= 2 and pipe.parts[-2] <= n - 2, f"unexpected pipeline partition {pipe.parts}"
    return pipe


def pipeline_param_name(name: str, config: ModelConfig) -> str | None:
    """Map a PipelineModule parameter name to the RobertaMLM name (None: a tied duplicate).

    PipelineModule names layers by their index in the list above ("3.qkv.weight") and tied
    modules as "tied_modules.word.<attr>".
    """
    if name.startswith("tied_modules.word."):
        return "word_embeddings." + name[len("tied_modules.word."):]
    idx, rest = name.split(".", 1)
    idx = int(idx)
    if idx == 1:
        return f"embeddings.{rest}"
    if 2 <= idx < 2 + config.num_layers:
        return f"layers.{idx - 2}.{rest}"
    if idx == 3 + config.num_layers:
        return f"heads.{rest}"
    raise AssertionError(f"unexpected pipeline parameter {name}")
