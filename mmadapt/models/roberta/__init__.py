"""The encoder family: RoBERTa (model.py), its pipeline stages (pipeline.py), FLOP counts
(flops.py), presets (presets.py) and Hugging Face mapping (hf.py), bundled as the `roberta`
ModelFamily."""

from __future__ import annotations

from mmadapt.config import LoopConfig, ModelConfig, TrainConfig
from mmadapt.family import WORD, ModelFamily, OutputPath
from mmadapt.models.roberta import flops, hf
from mmadapt.models.roberta.presets import PRESETS, SMALL
from mmadapt.models.roberta.model import (BIAS, TASK_KINDS, MLMHeads, RobertaEncoder, RobertaForTask, RobertaMLM,
                                          TransformerLayer)
from mmadapt.objectives import MLM


class RobertaFamily(ModelFamily):
    name = "roberta"
    objective = MLM
    task_kinds = TASK_KINDS
    presets = PRESETS
    small_preset = SMALL
    # mmadapt's SentencePiece models; imported RoBERTa (byte-level BPE) and XLM-R/CamemBERT
    # (SentencePiece unigram, as a `tokenizers` Unigram) tokenizers.
    tokenizer_kinds = ("sentencepiece", "bpe", "unigram")
    # Each TransformerLayer and MLMHeads compiled in place (fusion.py; pipeline stage classes are
    # subclasses of these). Not each MLMHead: MLMHeads' graph holds them.
    compiled_kinds = (TransformerLayer, MLMHeads)
    graphed_kinds = (TransformerLayer,)
    pipeline_ties = {"word": "word_embeddings."}  # the tied word embedding (pipeline.py)
    hf = hf.MAPPING

    def check_loop(self, loop: LoopConfig) -> None:
        if isinstance(loop, TrainConfig) and loop.score_fraction != TrainConfig.score_fraction:
            raise ValueError(f"score_fraction {loop.score_fraction} is a causal-LM setting; the roberta family scores "
                             "its masked pieces (--mask_prob): drop --score_fraction")

    def build_lm(self, cfg: ModelConfig, seed: int = 1234) -> RobertaMLM:
        return RobertaMLM(cfg, seed=seed)

    def build_task_model(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234) -> RobertaForTask:
        return RobertaForTask(cfg, kind, num_labels, seed=seed)

    def build_body(self, cfg: ModelConfig, seed: int = 1234) -> RobertaEncoder:
        return RobertaEncoder(cfg, seed=seed)

    def build_pipeline(self, cfg: ModelConfig, seed: int, data_parallel_size: int):
        from mmadapt.models.roberta import pipeline  # imports DeepSpeed: only where a pipeline is built

        return pipeline.to_pipeline(cfg, seed, data_parallel_size)

    def pipeline_layer_prefixes(self, cfg: ModelConfig) -> list[str | None]:
        # The order of pipeline.to_pipeline's layer list (its docstring).
        return ["word_embeddings.", "embeddings.", *(f"layers.{i}." for i in range(cfg.num_layers)), None, "heads."]

    def vocab_params(self, cfg: ModelConfig, train_output_bias: bool = True) -> tuple[str, ...]:
        # The output bias is indexed by piece: the source's means nothing for most target pieces
        # (adapt.py). Frozen (the paper's setting), it stays at its start (adapt.StartRule).
        return (WORD, BIAS) if train_output_bias else (WORD,)

    def artifact_keys(self) -> dict[str, str]:
        return {"word_embeddings": WORD, "output_bias": BIAS}

    def output_path(self, cfg: ModelConfig) -> OutputPath:
        return OutputPath(WORD, BIAS, "heads.heads.0.layernorm.weight", "heads.heads.0.layernorm.bias")

    def output_biases(self, cfg: ModelConfig) -> tuple[str, ...]:
        return tuple(f"heads.heads.{i}.bias" for i in range(len(cfg.heads_after)))

    def head_scales(self, cfg: ModelConfig) -> tuple[str, ...]:
        return tuple(f"heads.heads.{i}.layernorm.weight" for i in range(len(cfg.heads_after)))

    def finetune_trainable(self, cfg: ModelConfig) -> tuple[str, ...]:
        # The body (positions and embedding LayerNorm included: they are language-independent)
        # and the task head.
        return ("embeddings.", "layers.", "dense.", "out.")

    def step_flops(self, step: str, cfg: ModelConfig, s: int, p: float, paper: bool = False,
                   trainable_layers: int = 0) -> float:
        return flops.step_flops(step, cfg, s, p, paper, trainable_layers)


ROBERTA = RobertaFamily()
