"""The decoder family: a Llama-style causal LM (model.py: RMSNorm, rotary positions, SwiGLU,
grouped-query attention, an optional QKV bias as Qwen2's, tied or untied output projection), its
pipeline stages (pipeline.py), FLOP counts (flops.py), presets (presets.py) and Hugging Face
mapping (hf.py: Llama, Qwen2 and Mistral checkpoints), bundled as the `llama` ModelFamily.

Its objective is causal: every position of a packed block is scored on the next piece, or a
seeded subset of them (TrainConfig.score_fraction; data.CausalBatches), so a mini-model's
embeddings are trained by next-token prediction. What Step 2 trains is the word embedding, and
the output projection too when it is untied: both are indexed by piece. Step 3 puts a classifier
on the last real token (LlamaForTask).
"""

from __future__ import annotations

from mmadapt.config import LoopConfig, ModelConfig, TrainConfig
from mmadapt.family import WORD, ModelFamily, OutputPath
from mmadapt.models.llama import flops, hf
from mmadapt.models.llama.presets import PRESETS, SMALL
from mmadapt.models.llama.model import (OUTPUT, TASK_KINDS, DecoderLayer, LlamaDecoder, LlamaForTask, LlamaLM,
                                        LMHeads, task_param_name, validated)
from mmadapt.objectives import CAUSAL


class LlamaFamily(ModelFamily):
    name = "llama"
    objective = CAUSAL
    task_kinds = TASK_KINDS
    presets = PRESETS
    small_preset = SMALL
    # mmadapt's SentencePiece models (and their exported form, a `tokenizers` Unigram); imported
    # Llama-2/Mistral (SentencePiece BPE with byte fallback) and Llama-3/Qwen2 (byte-level BPE).
    tokenizer_kinds = ("sentencepiece", "unigram", "bpe")
    compiled_kinds = (DecoderLayer, LMHeads)
    graphed_kinds = (DecoderLayer,)
    pipeline_ties = {"word": "word_embeddings."}  # the tied word embedding (pipeline.py)
    hf = hf.MAPPING

    def check(self, cfg: ModelConfig) -> None:
        validated(cfg)

    def check_loop(self, loop: LoopConfig) -> None:
        if isinstance(loop, TrainConfig) and loop.mask_prob != TrainConfig.mask_prob:
            raise ValueError(f"mask_prob {loop.mask_prob} is a masked-LM setting; the llama family scores next pieces "
                             "(a fraction of them: --score_fraction): drop --mask_prob")

    def build_lm(self, cfg: ModelConfig, seed: int = 1234) -> LlamaLM:
        return LlamaLM(cfg, seed=seed)

    def build_task_model(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234) -> LlamaForTask:
        return LlamaForTask(cfg, kind, num_labels, seed=seed)

    def build_body(self, cfg: ModelConfig, seed: int = 1234) -> LlamaDecoder:
        return LlamaDecoder(cfg, seed=seed)

    def build_pipeline(self, cfg: ModelConfig, seed: int, data_parallel_size: int):
        from mmadapt.models.llama import pipeline  # imports DeepSpeed: only where a pipeline is built

        return pipeline.to_pipeline(cfg, seed, data_parallel_size)

    def pipeline_layer_prefixes(self, cfg: ModelConfig) -> list[str | None]:
        # The order of pipeline.to_pipeline's layer list (its docstring): the untied output
        # layer's parameters are named as in LlamaLM already.
        last = None if cfg.share_embeddings_and_output_weights else ""
        return ["word_embeddings.", *(f"layers.{i}." for i in range(cfg.num_layers)), last, "heads."]

    def vocab_params(self, cfg: ModelConfig, train_output_bias: bool = True) -> tuple[str, ...]:
        # No output bias; an untied output projection is indexed by piece like the embedding.
        return (WORD,) if cfg.share_embeddings_and_output_weights else (WORD, OUTPUT)

    def artifact_keys(self) -> dict[str, str]:
        return {"word_embeddings": WORD, "output_layer": OUTPUT}

    def output_path(self, cfg: ModelConfig) -> OutputPath:
        return OutputPath(WORD if cfg.share_embeddings_and_output_weights else OUTPUT, None, "heads.heads.0.norm.weight",
                          None)

    def finetune_trainable(self, cfg: ModelConfig) -> tuple[str, ...]:
        return ("layers.", "norm.", "score.")

    def task_state(self, cfg: ModelConfig, state: dict) -> dict:
        # The classifier reads the primary head's final norm (LlamaForTask); the untied output
        # projection has no use there.
        names = {task_param_name("norm.weight", cfg): "norm.weight"}
        return {names.get(k, k): v for k, v in state.items()
                if (not k.startswith("heads.") or k in names) and k != OUTPUT}

    def step_flops(self, step: str, cfg: ModelConfig, s: int, p: float, paper: bool = False,
                   trainable_layers: int = 0) -> float:
        return flops.step_flops(step, cfg, s, paper, trainable_layers, p)


LLAMA = LlamaFamily()
