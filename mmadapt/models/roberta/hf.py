"""RoBERTa-family Hugging Face checkpoints <-> the encoder family (exact on a trained model).

Hugging Face's RobertaForMaskedLM, XLMRobertaForMaskedLM and CamembertForMaskedLM are post-LN
encoders with learned positions, exact (erf) GELU and a tied output projection, so the
correspondence is exact (HF name -> mmadapt name, `b` = "roberta."):
    b.embeddings.word_embeddings          word_embeddings.word_embeddings  rows permuted so that
                                          the special tokens get mmadapt's ids (tokenizer.py)
    b.embeddings.position_embeddings      embeddings.position_embeddings   HF counts positions from
                                          padding_idx + 1 (514 rows for 512 tokens): rows from there
    b.embeddings.token_type_embeddings    added into every position row (one type; HF's tokenizers
                                          for these models give no token_type_ids)
    b.embeddings.LayerNorm                embeddings.layernorm
    b.pooler.dense                        pooler.dense    (a body: RobertaModel, XLMRobertaModel, ...)
    b.encoder.layer.i.attention.self.{query,key,value}  layers.i.qkv, per head [nh, 3, hd] rows
    b.encoder.layer.i.attention.output.dense / LayerNorm   layers.i.attn_out / attn_layernorm
    b.encoder.layer.i.intermediate.dense / output.dense    layers.i.fc1 / fc2
    b.encoder.layer.i.output.LayerNorm    layers.i.ffn_layernorm
    lm_head.dense / layer_norm / bias     heads.heads.0.dense / layernorm / bias (rows permuted);
                                          lm_head.decoder is the word embedding
    classifier.dense / out_proj           dense / out   (sequence classification)
    classifier                            out           (token classification)
    qa_outputs                            out           (question answering: start, end)
RobertaModel, XLMRobertaModel and CamembertModel (bodies) have no MLM head: they import
as headless runs (run.json `imported_from.headless`), with their pooler, until `mmadapt fit-head`
trains a head over them; export kind "body" writes such a class back (sentence-transformers).
Only padding positions are computed differently (HF gives them position padding_idx, mmadapt
its running position): no other position attends to them, so no other output changes.

mmadapt/hf.py reads and writes the directories; this module maps configs and weights only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmadapt.config import ModelConfig
from mmadapt.family import WORD, HFMapping, Implied, inverse_rows, transformers_config
from mmadapt.models.roberta.model import BIAS
from mmadapt.tokens import BOS_ID
ARCHITECTURES = {"RobertaForMaskedLM": "roberta", "XLMRobertaForMaskedLM": "xlm-roberta",
                 "CamembertForMaskedLM": "camembert", "RobertaModel": "roberta", "XLMRobertaModel": "xlm-roberta",
                 "CamembertModel": "camembert"}
# Bodies without an MLM head (sentence-transformers' checkpoints, and the encoder of a sequence
# classifier, hf_classifier.py): imported headless, with their pooler (transformers builds these
# classes with one); `mmadapt fit-head` gives them a head.
HEADLESS = ("RobertaModel", "XLMRobertaModel", "CamembertModel")
MODEL_TYPE = "roberta"  # what an mmadapt-pretrained encoder is exported as
CLASS_PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}
TASK_CLASSES = {None: "ForMaskedLM", "classify": "ForSequenceClassification", "tag": "ForTokenClassification",
                "span": "ForQuestionAnswering", "body": "Model"}  # body: the encoder alone (sentence-transformers)
# An exported mmadapt SentencePiece model lays every kind out as features.py does (templates in
# mmadapt's role names, mmadapt/hf.py); an imported tokenizer already does, and is kept.
ENCODER_LAYOUT = {"single": "{bos} $A {eos}", "pair": "{bos} $A {eos} {eos} $B {eos}",
                  "tokens": {"bos_token": "bos", "eos_token": "eos", "cls_token": "bos", "sep_token": "eos",
                             "unk_token": "unk", "pad_token": "pad", "mask_token": "mask"}}


def check_encoder_config(cfg: dict, model_dir, architectures: dict[str, str] = ARCHITECTURES) -> None:
    """What a post-LN encoder's config.json (RoBERTa's, BERT's: `architectures`, its family's
    classes) must say for mmadapt to compute it exactly, after what transformers checks."""
    transformers_config(cfg, model_dir)  # (read_hf_config has checked model_type)
    if not isinstance(cfg.get("pad_token_id"), int):
        raise ValueError(f"{model_dir}: config.json has no pad_token_id: an encoder's special tokens and (RoBERTa) "
                         "positions are counted from it")
    if cfg.get("hidden_size", 768) % cfg.get("num_attention_heads", 12):
        raise ValueError(f"{model_dir}: config.json's hidden_size {cfg.get('hidden_size', 768)} is not divisible by "
                         f"num_attention_heads {cfg.get('num_attention_heads', 12)}: it cannot describe a working "
                         "model")
    unsupported = [(k, cfg.get(k, d), want) for k, d, want in (
        ("hidden_act", "gelu", "gelu"), ("position_embedding_type", "absolute", "absolute"),
        ("is_decoder", False, False), ("add_cross_attention", False, False), ("tie_word_embeddings", True, True))
        if cfg.get(k, d) != want]
    if unsupported:
        k, got, want = unsupported[0]
        raise ValueError(f"{model_dir}: {k} is {got!r}; mmadapt's {cfg.get('model_type', 'encoder')} has {want!r} "
                         f"(import-hf supports {', '.join(architectures)} with exact GELU, absolute positions and a "
                         "tied output projection)")


# --- the weight correspondence (module docstring) ----------------------------------------------------

_LAYER = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_layernorm",
          "intermediate.dense": "fc1", "output.dense": "fc2", "output.LayerNorm": "ffn_layernorm"}


def _base_prefix(state: dict) -> str:
    key = next((k for k in state if k.endswith("embeddings.word_embeddings.weight")), None)
    if key is None:
        raise ValueError("the weights hold no embeddings.word_embeddings.weight: not a RoBERTa-family model")
    return key[:-len("embeddings.word_embeddings.weight")]


def getter(hf: dict[str, torch.Tensor]):
    """name -> the fp32 tensor of a Hugging Face state dict, or one line naming what it lacks."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"the weights lack {name}")
        return hf[name].float()
    return get


def layers_from_hf(cfg: ModelConfig, get, b: str) -> dict:
    """The transformer layers (and the pooler, ModelConfig.add_pooling_layer) under base prefix
    `b` -> mmadapt's names: q, k, v interleaved per head into the fused QKV."""
    nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    out = {}
    for i in range(cfg.num_layers):
        p = f"{b}encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (get(f"{p}attention.self.{n}.{kind}") for n in ("query", "key", "value"))
            out[f"layers.{i}.qkv.{kind}"] = torch.stack(
                [t.reshape(nh, hd, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(3 * h, *q.shape[1:])
            for src, dst in _LAYER.items():
                out[f"layers.{i}.{dst}.{kind}"] = get(f"{p}{src}.{kind}")
    if cfg.add_pooling_layer:
        out.update({f"pooler.dense.{t}": get(f"{b}pooler.dense.{t}") for t in ("weight", "bias")})
    return out


def layers_to_hf(cfg: ModelConfig, state: dict, b: str, pooler: bool) -> dict:
    """layers_from_hf's inverse; pooler: write the model's (a class that has one)."""
    nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    out = {}
    for i in range(cfg.num_layers):
        p = f"{b}encoder.layer.{i}."
        for t in ("weight", "bias"):
            qkv = state[f"layers.{i}.qkv.{t}"]
            q, k, v = qkv.reshape(nh, 3, hd, *qkv.shape[1:]).unbind(1)
            for n, x in zip(("query", "key", "value"), (q, k, v)):
                out[f"{p}attention.self.{n}.{t}"] = x.reshape(h, *qkv.shape[1:])
            for src, dst in _LAYER.items():
                out[f"{p}{src}.{t}"] = state[f"layers.{i}.{dst}.{t}"]
    if pooler:
        out.update({f"{b}pooler.dense.{t}": state[f"pooler.dense.{t}"] for t in ("weight", "bias")})
    return out


def body_implied(cfg: ModelConfig, b: str, positions: int, hf_cfg: dict) -> dict[str, Implied]:
    """Every tensor of an encoder body (RoBERTa's, BERT's) under base prefix `b`, its pooler
    where the class has one (ModelConfig.add_pooling_layer): its shape from config.json's fields
    (`positions`: its max_position_embeddings)."""
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size
    H, V, F, P = ((h, f"hidden_size {h}"), (v, f"vocab_size {v}"), (f, f"intermediate_size {f}"),
        (positions, f"max_position_embeddings {positions}"))
    out = {b + "embeddings.word_embeddings.weight": (V, H), b + "embeddings.position_embeddings.weight": (P, H),
           b + "embeddings.LayerNorm.weight": (H,), b + "embeddings.LayerNorm.bias": (H,)}
    if "type_vocab_size" in hf_cfg:
        out[b + "embeddings.token_type_embeddings.weight"] = ((hf_cfg["type_vocab_size"], "type_vocab_size "
                                                              f"{hf_cfg['type_vocab_size']}"), H)
    if cfg.add_pooling_layer:
        out.update({b + "pooler.dense.weight": (H, H), b + "pooler.dense.bias": (H,)})
    out = {k: Implied(d) for k, d in out.items()}
    layer = {"attention.output.dense.weight": (H, H), "intermediate.dense.weight": (F, H),
             "intermediate.dense.bias": (F,), "output.dense.weight": (H, F),
             **{f"attention.self.{q}.weight": (H, H) for q in ("query", "key", "value")},
             **{f"{m}.bias": (H,) for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                                             "attention.output.dense", "output.dense")},
             **{f"{m}.{t}": (H,) for m in ("attention.output.LayerNorm", "output.LayerNorm")
                for t in ("weight", "bias")}}
    for i in range(cfg.num_layers):
        out.update({f"{b}encoder.layer.{i}.{k}": Implied(d, f"num_hidden_layers {cfg.num_layers}")
                    for k, d in layer.items()})
    return out


def head_implied(cfg: ModelConfig, names: dict[str, str]) -> dict[str, Implied]:
    """The MLM head's tensors (`names`: dense, layernorm, bias -> the class's names)."""
    H, V = (cfg.hidden_size, f"hidden_size {cfg.hidden_size}"), (cfg.vocab_size, f"vocab_size {cfg.vocab_size}")
    return {**{f"{names['dense']}.{t}": Implied((H, H) if t == "weight" else (H,)) for t in ("weight", "bias")},
            **{f"{names['layernorm']}.{t}": Implied((H,)) for t in ("weight", "bias")},
            names["bias"]: Implied((V,))}


def headless_note(hf_cfg: dict, with_head: str) -> str:
    """Why a body class's files that hold an MLM head are refused, and the fix."""
    return (f"config.json names a {hf_cfg['architectures'][0]}, a body without an MLM head, but the weights hold one: "
            f"set architectures to [\"{with_head}\"] in config.json to import it with its head")


def encoder_config(cfg: ModelConfig, kind: str | None, labels: list[str] | None, ids: dict[str, int],
                   model_type: str, class_prefix: str, **shape):
    """A post-LN encoder's transformers config (RoBERTa's and BERT's) of the class
    `class_prefix` + TASK_CLASSES[kind]; `shape`: what the family counts its own way (positions,
    token types)."""
    import transformers

    extra = {}
    if kind in ("classify", "tag"):
        extra = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
        if kind == "classify":
            extra["problem_type"] = "single_label_classification"
    elif kind == "span":
        extra = {"num_labels": 2}
    return transformers.AutoConfig.for_model(
        model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        initializer_range=cfg.init_method_std, layer_norm_eps=cfg.layernorm_epsilon,
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
        architectures=[class_prefix + TASK_CLASSES[kind]], tie_word_embeddings=True, **shape, **extra)


class RobertaMapping(HFMapping):
    """The encoder's correspondence (module docstring), as family.HFMapping declares it."""
    architectures = ARCHITECTURES
    headless = HEADLESS
    positive_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "max_position_embeddings", "type_vocab_size")
    # what transformers leaves out: an old checkpoint's position-id buffer (always), a pooler (a
    # ...ForMaskedLM has none; a body class reads its own)
    ignored = (r"(^|\.)embeddings\.position_ids$", r"(^|\.)pooler\.")
    layer_name = r"encoder\.layer\.(\d+)\."
    head_prefixes = ("lm_head.",)
    # transformers' config class gives these where config.json leaves them out (RoBERTa's, XLM-R's
    # and CamemBERT's: pad 1, 512 positions, LayerNorm epsilon 1e-12, its sizes; BERT's through
    # its own): a config.json without intermediate_size loads there, and read as given here it
    # was a KeyError
    defaulted = ("pad_token_id", "max_position_embeddings", "layer_norm_eps", "num_hidden_layers", "hidden_size",
                 "num_attention_heads", "intermediate_size", "vocab_size")

    def as_loaded(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_cfg: dict) -> tuple[ModelConfig, str | None]:
        """A body saved without its pooler's weights (transformers and sentence-transformers load it
        with a fresh pooler, which mean pooling never reads) is imported without one."""
        if cfg.add_pooling_layer and not any(n.endswith("pooler.dense.weight") for n in hf):
            return (dataclasses.replace(cfg, add_pooling_layer=False),
                    "its weights hold no pooler: imported without one (export-hf writes the body without one too)")
        return cfg, None

    def model_kwargs(self, cfg: ModelConfig, kind: str | None) -> dict:
        return {"add_pooling_layer": cfg.add_pooling_layer} if kind == "body" else {}

    def check_config(self, cfg: dict, model_dir) -> None:
        """config.json of one of ARCHITECTURES, checked for everything the encoder cannot express."""
        check_encoder_config(cfg, model_dir)
        if cfg.get("max_position_embeddings", 512) <= cfg["pad_token_id"] + 1:
            raise ValueError(f"{model_dir}: config.json's max_position_embeddings {cfg.get('max_position_embeddings', 512)} "
                             f"leaves no position after the {cfg['pad_token_id'] + 1} rows a RoBERTa-family model skips "
                             "(pad_token_id + 1): it cannot describe a working model")

    def model_config(self, cfg: dict, model_dir=None) -> ModelConfig:
        offset = cfg["pad_token_id"] + 1
        return ModelConfig(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                           num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
                           vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"] - offset,
                           hidden_dropout=cfg.get("hidden_dropout_prob", 0.1),
                           attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
                           layernorm_epsilon=cfg["layer_norm_eps"],
                           init_method_std=cfg.get("initializer_range", 0.02),
                           add_pooling_layer=self.is_headless(cfg)).validate()

    def special_ids(self, tok, cfg: dict, vocab_size: int, model_dir: Path) -> tuple[list[int], dict]:
        """The source ids of mmadapt's special tokens, in mmadapt's order (pad, unk, <s>, </s>, <mask>):
        the tokens a RoBERTa-family tokenizer puts at a sequence's start (cls) and end (sep); and
        what run.json records of them (role -> source id). The pad must be config.json's (HF's
        positions count from it)."""
        roles = {"pad": tok.pad_token_id, "unk": tok.unk_token_id, "<s>": tok.cls_token_id, "</s>": tok.sep_token_id,
                 "<mask>": tok.mask_token_id}
        missing = [k for k, v in roles.items() if v is None]
        if missing:
            raise ValueError(f"{model_dir}: its tokenizer has no {missing[0]} token; an encoder's tokenizer has a pad, "
                             "unk, cls (<s>, [CLS]), sep (</s>, [SEP]) and mask token")
        ids = list(roles.values())
        if len(set(ids)) != len(ids):
            raise ValueError(f"{model_dir}: its tokenizer gives two special tokens one id ({roles})")
        if ids[0] != cfg["pad_token_id"]:
            raise ValueError(f"{model_dir}: config.json's pad_token_id {cfg['pad_token_id']} is not the "
                             f"tokenizer's pad id {ids[0]}")
        return ids, dict(zip(("pad", "unk", "bos", "eos", "mask"), ids))

    def from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_ids: list[int], hf_cfg: dict) -> dict:
        """A RobertaForMaskedLM-family state dict (or a body's: no head) -> RobertaMLM's (tensor-parallel size 1)."""
        pad_token_id = hf_cfg["pad_token_id"]
        b = _base_prefix(hf)
        perm = torch.tensor(hf_ids)
        get = getter(hf)
        word = get(b + "embeddings.word_embeddings.weight")
        if "lm_head.decoder.weight" in hf and not torch.equal(get("lm_head.decoder.weight"), word):
            raise ValueError("lm_head.decoder.weight differs from the word embeddings: transformers loads this model "
                             "untied, and mmadapt's output projection is always tied")
        offset = pad_token_id + 1
        pos = get(b + "embeddings.position_embeddings.weight")[offset:offset + cfg.max_position_embeddings]
        out = {WORD: word[perm], "embeddings.position_embeddings.weight": pos + get(b + "embeddings.token_type_embeddings.weight")[0],
               "embeddings.layernorm.weight": get(b + "embeddings.LayerNorm.weight"),
               "embeddings.layernorm.bias": get(b + "embeddings.LayerNorm.bias"),
               **layers_from_hf(cfg, get, b)}
        if self.is_headless(hf_cfg):
            return {k: v.contiguous() for k, v in out.items()}
        for kind in ("weight", "bias"):
            out[f"heads.heads.0.dense.{kind}"] = get(f"lm_head.dense.{kind}")
            out[f"heads.heads.0.layernorm.{kind}"] = get(f"lm_head.layer_norm.{kind}")
        bias = get("lm_head.bias")
        if "lm_head.decoder.bias" in hf:  # what transformers' head adds: lm_head.bias itself, unless they differ
            bias = get("lm_head.decoder.bias")
        out[BIAS] = bias[perm]
        return {k: v.contiguous() for k, v in out.items()}

    def to_hf(self, cfg: ModelConfig, state: dict, kind: str | None, hf_ids: list[int] | None, ids: dict,
              model_type: str | None = None) -> dict:
        """RobertaMLM's (kind None; "body": the encoder alone, with its pooler if it has one) or
        RobertaForTask's state dict -> the matching HF class's. hf_ids: mmadapt id -> the exported
        tokenizer's id (None: the same ids); ids: its pad, bos and eos ids (HF counts positions from
        the pad's)."""
        pad_token_id, h = ids["pad"], cfg.hidden_size
        b = "" if kind == "body" else "roberta."
        word = inverse_rows(hf_ids, state[WORD].float())
        pos = state["embeddings.position_embeddings.weight"].float()
        out = {b + "embeddings.word_embeddings.weight": word,
               b + "embeddings.position_embeddings.weight": torch.cat([pos.new_zeros(pad_token_id + 1, h), pos]),
               b + "embeddings.token_type_embeddings.weight": pos.new_zeros(1, h),
               b + "embeddings.LayerNorm.weight": state["embeddings.layernorm.weight"],
               b + "embeddings.LayerNorm.bias": state["embeddings.layernorm.bias"],
               **layers_to_hf(cfg, state, b, pooler=kind == "body" and cfg.add_pooling_layer)}
        for t in ("weight", "bias"):
            if kind is None:
                out[f"lm_head.dense.{t}"] = state[f"heads.heads.0.dense.{t}"]
                out[f"lm_head.layer_norm.{t}"] = state[f"heads.heads.0.layernorm.{t}"]
            elif kind not in ("body", "classify"):
                out[f"{'classifier' if kind == 'tag' else 'qa_outputs'}.{t}"] = state[f"out.{t}"]
        out.update({hf: state[name] for name, hf in self.task_head_names(kind).items()})  # classify's head
        if kind is None:
            out["lm_head.bias"] = inverse_rows(hf_ids, state[BIAS].float())
            out["lm_head.decoder.weight"], out["lm_head.decoder.bias"] = word, out["lm_head.bias"]
        return {k: v.float().contiguous() for k, v in out.items()}

    def task_head_names(self, kind: str) -> dict[str, str]:
        """RobertaForSequenceClassification's head: dense -> tanh -> out_proj over <s>."""
        if kind != "classify":
            return {}
        return {f"{mine}.{t}": f"classifier.{theirs}.{t}" for mine, theirs in (("dense", "dense"), ("out", "out_proj"))
                for t in ("weight", "bias")}

    def hf_config(self, cfg: ModelConfig, kind: str | None, labels: list[str] | None, ids: dict[str, int], model_type: str):
        """The transformers config of `model_type`'s class for `kind` (None: the masked LM) that
        holds `cfg`; ids: the exported tokenizer's pad, bos and eos ids."""
        return encoder_config(cfg, kind, labels, ids, model_type, CLASS_PREFIX[model_type],
                              max_position_embeddings=cfg.max_position_embeddings + ids["pad"] + 1, type_vocab_size=1)

    def tokenizer_layout(self, kind: str | None, imported: bool, cfg: ModelConfig,
                         text_layout: dict | None = None, task_start: tuple[int, ...] = (BOS_ID,)) -> dict | None:
        # an encoder's rows start with <s> alone (task_start)
        return None if imported else ENCODER_LAYOUT

    def export_model_type(self, model_type: str | None, cfg: ModelConfig, own_tokenizer: bool) -> str:
        return model_type or MODEL_TYPE

    def import_note(self, cfg: dict, model_dir=None) -> None:
        return None  # nothing of an encoder is cut at import

    def implied(self, cfg: ModelConfig, hf: dict, hf_cfg: dict) -> dict[str, Implied]:
        """Every tensor of a ...ForMaskedLM config (of a body class: no head, a pooler): its shape
        from config.json's fields."""
        out = body_implied(cfg, _base_prefix(hf), hf_cfg["max_position_embeddings"], hf_cfg)
        if not self.is_headless(hf_cfg):
            out.update(head_implied(cfg, {"dense": "lm_head.dense", "layernorm": "lm_head.layer_norm",
                                          "bias": "lm_head.bias"}))
        return out

    def unused_note(self, name: str, cfg: ModelConfig, hf_cfg: dict) -> str | None:
        note = super().unused_note(name, cfg, hf_cfg)
        if note is not None:
            return note
        if name.startswith("lm_head.") and self.is_headless(hf_cfg):
            return headless_note(hf_cfg, "XLMRobertaForMaskedLM" if hf_cfg["model_type"] == "xlm-roberta"
                                 else "RobertaForMaskedLM")
        return None


MAPPING = RobertaMapping()
