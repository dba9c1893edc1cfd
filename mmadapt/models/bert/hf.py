"""BERT Hugging Face checkpoints <-> the bert family (exact on a trained model).

transformers' BertForMaskedLM (mBERT, MiniLM, LaBSE-shaped models) and BertModel (a body
without an MLM head, as sentence-transformers ships them) are post-LN encoders with learned
positions from 0, token types, exact (erf) GELU and a tied output projection, so the
correspondence is exact (HF name -> mmadapt name; `b` = "bert.", "" for BertModel):
    b.embeddings.word_embeddings          word_embeddings.word_embeddings  rows permuted so that
                                          the special tokens get mmadapt's ids (tokenizer.py)
    b.embeddings.position_embeddings      embeddings.position_embeddings   (positions from 0: no offset)
    b.embeddings.token_type_embeddings    embeddings.token_type_embeddings (1 or 2 types)
    b.embeddings.LayerNorm                embeddings.layernorm
    b.encoder.layer.i....                 layers.i....   as RoBERTa's (models/roberta/hf.py)
    b.pooler.dense                        pooler.dense   (BertModel; BertForSequenceClassification's)
    cls.predictions.transform.dense       heads.heads.0.dense
    cls.predictions.transform.LayerNorm   heads.heads.0.layernorm
    cls.predictions.bias                  heads.heads.0.bias (rows permuted); cls.predictions.decoder
                                          is the word embedding (its bias is cls.predictions.bias)
    classifier                            out  (sequence classification, after the pooler; tagging)
    qa_outputs                            out  (question answering: start, end)
The mapping reads only what the class holds: a BertForMaskedLM file that also carries the
pre-training checkpoint's pooler and next-sentence head (`bert.pooler.*`, `cls.seq_relationship.*`,
as mBERT's does) leaves those unread, as transformers' BertForMaskedLM does (its load report lists
them as unexpected; the model it builds has no place for them): `ignored` declares them, and the
import's validator (mmadapt/hf.py) refuses any other tensor the mapping does not read. A BertModel is
imported headless (run.json `imported_from.headless`) until `mmadapt fit-head` trains a head.
"""

from __future__ import annotations

import torch

from mmadapt.config import ModelConfig
from mmadapt.family import WORD, Implied, inverse_rows
from mmadapt.models.roberta import hf as roberta_hf
from mmadapt.models.roberta.hf import (RobertaMapping, body_implied, encoder_config, getter, head_implied, headless_note,
                                       layers_from_hf, layers_to_hf)
from mmadapt.models.roberta.model import BIAS
from mmadapt.tokens import BOS_ID

ARCHITECTURES = {"BertForMaskedLM": "bert", "BertModel": "bert"}
HEADLESS = ("BertModel",)
MODEL_TYPE = "bert"
TOKEN_TYPES = (1, 2)  # a type vocabulary mmadapt computes: segment 0, and the pair's second segment
# An exported mmadapt SentencePiece model laid out as BERT's tokenizer lays a text out
# (`[CLS] a [SEP] b [SEP]`, the second segment and its [SEP] type 1), in mmadapt's role names
# (mmadapt/hf.py); an imported BERT tokenizer already does, and is kept.
BERT_LAYOUT = {"single": "{bos} $A {eos}", "pair": "{bos} $A {eos} $B:1 {eos}:1",
               "tokens": {"cls_token": "bos", "sep_token": "eos", "unk_token": "unk", "pad_token": "pad",
                          "mask_token": "mask"},
               "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}  # the types reach the model
ONE_TYPE_LAYOUT = {**BERT_LAYOUT, "pair": "{bos} $A {eos} $B {eos}"}  # a model with one type row: type 0 throughout


class BertMapping(RobertaMapping):
    """BERT's correspondence (module docstring): RoBERTa's (its special ids, import note and
    positive fields) with BERT's names, token types and MLM head."""
    architectures = ARCHITECTURES
    headless = HEADLESS
    # what transformers' BertForMaskedLM leaves out of a pre-training checkpoint (module docstring),
    # and an old checkpoint's position-id buffer; BertModel reads its pooler
    ignored = (r"(^|\.)embeddings\.position_ids$", r"(^|\.)pooler\.", r"^cls\.seq_relationship\.")
    head_prefixes = ("cls.predictions.",)

    def export_model_type(self, model_type: str | None, cfg: ModelConfig, own_tokenizer: bool) -> str:
        return MODEL_TYPE

    def check_config(self, cfg: dict, model_dir) -> None:
        """An encoder's checks (exact GELU, absolute positions, an encoder, a tied output), then the types."""
        roberta_hf.check_encoder_config(cfg, model_dir, ARCHITECTURES)
        types = cfg.get("type_vocab_size", 2)
        if types not in TOKEN_TYPES:
            raise ValueError(f"{model_dir}: type_vocab_size is {types}; mmadapt's BERT has 1 or 2 token types (a pair's "
                             "second segment is type 1): import a model with at most 2")

    def model_config(self, cfg: dict, model_dir=None) -> ModelConfig:
        return ModelConfig(family="bert", num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                           num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
                           vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"],
                           type_vocab_size=cfg.get("type_vocab_size", 2),
                           hidden_dropout=cfg.get("hidden_dropout_prob", 0.1),
                           attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
                           layernorm_epsilon=cfg.get("layer_norm_eps", 1e-12),
                           init_method_std=cfg.get("initializer_range", 0.02),
                           add_pooling_layer=self.is_headless(cfg)).validate()

    def from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_ids: list[int], hf_cfg: dict) -> dict:
        """A BertForMaskedLM (or BertModel: no head) state dict -> BertMLM's (tensor-parallel size 1)."""
        headless = self.is_headless(hf_cfg)
        b, get, perm = roberta_hf._base_prefix(hf), getter(hf), torch.tensor(hf_ids)
        word = get(b + "embeddings.word_embeddings.weight")
        if "cls.predictions.decoder.weight" in hf and not torch.equal(get("cls.predictions.decoder.weight"), word):
            raise ValueError("cls.predictions.decoder.weight differs from the word embeddings: mmadapt's output "
                             "projection is tied, this model's is not")
        out = {WORD: word[perm],
               "embeddings.position_embeddings.weight": get(b + "embeddings.position_embeddings.weight"),
               "embeddings.token_type_embeddings.weight": get(b + "embeddings.token_type_embeddings.weight"),
               "embeddings.layernorm.weight": get(b + "embeddings.LayerNorm.weight"),
               "embeddings.layernorm.bias": get(b + "embeddings.LayerNorm.bias"),
               **layers_from_hf(cfg, get, b)}
        if not headless:
            bias = get("cls.predictions.bias")
            if "cls.predictions.decoder.bias" in hf and not torch.equal(get("cls.predictions.decoder.bias"), bias):
                raise ValueError("cls.predictions.decoder.bias differs from cls.predictions.bias: they are one bias")
            for t in ("weight", "bias"):
                out[f"heads.heads.0.dense.{t}"] = get(f"cls.predictions.transform.dense.{t}")
                out[f"heads.heads.0.layernorm.{t}"] = get(f"cls.predictions.transform.LayerNorm.{t}")
            out[BIAS] = bias[perm]
        return {k: v.contiguous() for k, v in out.items()}

    def to_hf(self, cfg: ModelConfig, state: dict, kind: str | None, hf_ids: list[int] | None, ids: dict,
              model_type: str | None = None) -> dict:
        """BertMLM's (kind None; "body": BertModel, with the pooler if the model has one) or
        BertForTask's state dict -> the matching transformers class's; hf_ids: mmadapt id -> the
        exported tokenizer's id (None: the same ids)."""
        b = "" if kind == "body" else "bert."
        word = inverse_rows(hf_ids, state[WORD].float())
        pooler = kind == "classify" or (kind == "body" and cfg.add_pooling_layer)
        out = {b + "embeddings.word_embeddings.weight": word,
               b + "embeddings.position_embeddings.weight": state["embeddings.position_embeddings.weight"],
               b + "embeddings.token_type_embeddings.weight": state["embeddings.token_type_embeddings.weight"],
               b + "embeddings.LayerNorm.weight": state["embeddings.layernorm.weight"],
               b + "embeddings.LayerNorm.bias": state["embeddings.layernorm.bias"],
               **layers_to_hf(cfg, state, b, pooler)}
        if kind is None:
            bias = inverse_rows(hf_ids, state[BIAS].float())
            for t in ("weight", "bias"):
                out[f"cls.predictions.transform.dense.{t}"] = state[f"heads.heads.0.dense.{t}"]
                out[f"cls.predictions.transform.LayerNorm.{t}"] = state[f"heads.heads.0.layernorm.{t}"]
            out.update({"cls.predictions.bias": bias, "cls.predictions.decoder.weight": word,
                        "cls.predictions.decoder.bias": bias})
        elif kind == "classify":  # the pooler went out with the layers (layers_to_hf)
            out.update({hf: state[name] for name, hf in self.task_head_names(kind).items() if name.startswith("out.")})
        elif kind != "body":
            name = "qa_outputs" if kind == "span" else "classifier"
            out.update({f"{name}.{t}": state[f"out.{t}"] for t in ("weight", "bias")})
        return {k: v.float().contiguous() for k, v in out.items()}

    def task_head_names(self, kind: str) -> dict[str, str]:
        """BertForSequenceClassification's head: the pooler (dense -> tanh over [CLS]) -> classifier."""
        if kind != "classify":
            return {}
        return {f"{mine}.{t}": f"{theirs}.{t}" for mine, theirs in (("pooler.dense", "bert.pooler.dense"),
                                                                     ("out", "classifier")) for t in ("weight", "bias")}

    def hf_config(self, cfg: ModelConfig, kind: str | None, labels: list[str] | None, ids: dict[str, int], model_type: str):
        """transformers' BertConfig of the Bert class for `kind` (None: BertForMaskedLM; "body": BertModel)."""
        return encoder_config(cfg, kind, labels, ids, MODEL_TYPE, "Bert", max_position_embeddings=cfg.max_position_embeddings,
                              type_vocab_size=cfg.type_vocab_size)

    def tokenizer_layout(self, kind: str | None, imported: bool, cfg: ModelConfig,
                         text_layout: dict | None = None, task_start: tuple[int, ...] = (BOS_ID,)) -> dict | None:
        # An encoder's rows start with <s> ([CLS]) alone (task_start). A model with one token
        # type reads a pair's second segment as type 0 (BertEmbeddings):
        # its tokenizer, imported or not, must give type 0 there, or transformers indexes a row
        # the model lacks.
        if cfg.type_vocab_size == 1:
            return ONE_TYPE_LAYOUT
        return None if imported else BERT_LAYOUT

    def implied(self, cfg: ModelConfig, hf: dict, hf_cfg: dict) -> dict[str, Implied]:
        """Every tensor of a BertForMaskedLM config (of a BertModel: no head, a pooler): its shape
        from config.json's fields (positions from 0: max_position_embeddings rows)."""
        out = body_implied(cfg, roberta_hf._base_prefix(hf), hf_cfg.get("max_position_embeddings", 512), hf_cfg)
        if not self.is_headless(hf_cfg):
            out.update(head_implied(cfg, {"dense": "cls.predictions.transform.dense",
                                          "layernorm": "cls.predictions.transform.LayerNorm", "bias": "cls.predictions.bias"}))
        return out

    def unused_note(self, name: str, cfg: ModelConfig, hf_cfg: dict) -> str | None:
        if name.startswith("cls.predictions.") and self.is_headless(hf_cfg):
            return headless_note(hf_cfg, "BertForMaskedLM")
        return super().unused_note(name, cfg, hf_cfg)


MAPPING = BertMapping()
