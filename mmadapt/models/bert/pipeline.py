"""BERT as a DeepSpeed PipelineModule: RoBERTa's stages (models/roberta/pipeline.py: the layer
list and the tuple passed between stages are documented there), with BERT's embeddings in
layer 1. Pretraining blocks carry no token types, so nothing new travels down the pipe: every
position is type 0."""

from __future__ import annotations

from deepspeed.pipe import PipelineModule

from mmadapt.config import ModelConfig
from mmadapt.models.bert.model import BertEmbeddingPost
from mmadapt.models.roberta import pipeline
from mmadapt.models.roberta.pipeline import PipeEmbeddingPost


class PipeBertEmbeddingPost(PipeEmbeddingPost, BertEmbeddingPost):
    """(word embeddings, input_ids, labels) -> (BERT's embeddings with type 0, input_ids, labels)."""


def to_pipeline(config: ModelConfig, seed: int, data_parallel_size: int) -> PipelineModule:
    return pipeline.to_pipeline(config, seed, data_parallel_size, embedding=PipeBertEmbeddingPost)
