"""The BERT family: RoBERTa's post-LayerNorm encoder with token types, BERT's framing of a pair
(`[CLS] a [SEP] b [SEP]`, the second segment type 1) and BERT's pooled classifier (model.py),
its pipeline stages (pipeline.py), presets (presets.py) and Hugging Face mapping (hf.py:
BertForMaskedLM, and BertModel bodies as sentence-transformers ships them), bundled as the `bert`
ModelFamily. Derived from the roberta family: the objective (MLM), the mini-model surgery, the
FLOP counts (token-type and position lookups are additions, not matmuls: the counts are
RoBERTa's, checked on BERT's modules in tests/test_bert.py), what each step trains, and the
config fields it uses (a family uses its base's) are RoBERTa's."""

from __future__ import annotations

from mmadapt.config import ModelConfig
from mmadapt.features import Framing
from mmadapt.models.bert import hf
from mmadapt.models.bert.model import BertEncoder, BertForTask, BertMLM
from mmadapt.models.bert.presets import PRESETS, SMALL
from mmadapt.models.roberta import RobertaFamily


class BertFamily(RobertaFamily):
    name = "bert"
    presets = PRESETS
    small_preset = SMALL
    # [CLS] a [SEP] b [SEP] in mmadapt's ids: <s> a </s> b </s>, the second segment type 1
    framing = Framing(separators=1, token_types=True)
    # mmadapt's SentencePiece models and BERT's WordPiece tokenizers (cased or uncased: the
    # tokenizer's own normaliser runs wherever text is encoded)
    tokenizer_kinds = ("sentencepiece", "wordpiece")
    hf = hf.MAPPING

    def check(self, cfg: ModelConfig) -> None:
        if cfg.type_vocab_size not in hf.TOKEN_TYPES:
            raise ValueError(f"type_vocab_size {cfg.type_vocab_size}: BERT has 1 or 2 token types (a pair's second "
                             "segment is type 1)")

    def build_lm(self, cfg: ModelConfig, seed: int = 1234) -> BertMLM:
        return BertMLM(cfg, seed=seed)

    def build_task_model(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234) -> BertForTask:
        return BertForTask(cfg, kind, num_labels, seed=seed)

    def build_body(self, cfg: ModelConfig, seed: int = 1234) -> BertEncoder:
        return BertEncoder(cfg, seed=seed)

    def build_pipeline(self, cfg: ModelConfig, seed: int, data_parallel_size: int):
        from mmadapt.models.bert import pipeline  # imports DeepSpeed: only where a pipeline is built

        return pipeline.to_pipeline(cfg, seed, data_parallel_size)

    def finetune_trainable(self, cfg: ModelConfig) -> tuple[str, ...]:
        # The body (token types included), the pooler (the classifier's first layer) and the head.
        return ("embeddings.", "layers.", "pooler.", "out.")


BERT = BertFamily()
