"""Llama-family Hugging Face checkpoints <-> the decoder family (exact on a trained model).

transformers' LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM are the model of
model.py: pre-norm RMSNorm blocks, rotary positions (non-interleaved), SwiGLU, grouped-query
attention, a QKV bias in Qwen2, a tied or untied output projection. The correspondence
(HF name -> mmadapt name; layer i, `a` = "model.layers.i."):
    model.embed_tokens                   word_embeddings.word_embeddings  rows permuted so that
                                         the special roles get mmadapt's ids (`special_ids`)
    a.self_attn.{q,k,v}_proj (+ bias)    layers.i.qkv, rows per key/value group [ng, r + 2, hd]:
                                         the group's r query heads, its key head, its value head
    a.self_attn.o_proj                   layers.i.attn_out
    a.mlp.{gate,up}_proj                 layers.i.fc1, rows interleaved (2j gate_j, 2j + 1 up_j)
    a.mlp.down_proj                      layers.i.fc2
    a.{input,post_attention}_layernorm   layers.i.{input,post_attention}_layernorm
    model.norm                           heads.heads.0.norm (LM) or norm (sequence classification)
    lm_head                              output_layer, rows permuted (untied); the embedding (tied)
    score                                score (...ForSequenceClassification: LlamaForTask's head
                                         on the last non-pad token, as transformers pools)

What the family cannot compute exactly is refused (`check_config`): a rope type other than none
or "linear" (ModelConfig.seq_len_interpolation_factor), an activation other than SiLU, mlp_bias,
and (`from_hf`) Llama's
attention_bias unless its o_proj bias is zero (then it is Qwen2's QKV bias: how mmadapt exports a
Qwen2 body with another tokenizer). A head_dim other than hidden_size / num_attention_heads is
computed (megatron's kv_channels). Sliding-window attention (Mistral; Qwen2 with use_sliding_window) equals
causal attention on sequences no longer than the window, so the import caps
max_position_embeddings at the window (a longer --seq_length is then refused by validation).

mmadapt/hf.py reads and writes the directories; this module maps configs, special ids and
weights. transformers is imported where its config classes are needed (the `hf` extra).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mmadapt.config import ModelConfig
from mmadapt.family import WORD, HFMapping, Implied, inverse_permutation, transformers_config
from mmadapt.models.llama.model import OUTPUT, validated
from mmadapt.tokenizer import SPECIAL_ROLES, never_produced
from mmadapt.tokens import BOS_ID

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
SUPPORTED = ", ".join(ARCHITECTURES)
MODEL_TYPE = "llama"  # what an mmadapt-pretrained decoder is exported as (export_model_type)
CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
TASK_CLASSES = {None: "ForCausalLM", "classify": "ForSequenceClassification"}
ROPE_TYPES = ("default", "linear")
# The order in which roles claim the tokenizer's own tokens: the document separator first (what
# the decoder trains with), then the rest; a role left without one borrows a row (special_ids).
CLAIM_ORDER = ("eos", "bos", "unk", "pad", "mask")

# Exported tokenizers (mmadapt/hf.py): templates in mmadapt's role names. A causal LM's prompt
# starts with </s>, the document separator, as every text does in the blocks it trained on
# (data.CausalBatches: no <s> there); so </s> is its bos too, as GPT-2's <|endoftext|> is (an
# imported Llama's or Mistral's Step-2 vocabulary starts with <s> instead: tokenizer_layout). A
# classifier's rows are features.py's, started as its Step-3 run's were (task_start): start a </s>,
# start a </s> </s> b </s>, padded on the right (tokenizer_layout writes the templates).
# A decoder takes no token_type_ids.
PROMPT_LAYOUT = {"single": "{eos} $A", "pair": "{eos} $A {eos} $B", "padding_side": "left",
                 "tokens": {"bos_token": "eos", "eos_token": "eos", "unk_token": "unk", "pad_token": "pad"},
                 "model_input_names": ["input_ids", "attention_mask"]}
TASK_LAYOUT = {"padding_side": "right",
               "tokens": {"bos_token": "bos", "eos_token": "eos", "unk_token": "unk", "pad_token": "pad"},
               "model_input_names": ["input_ids", "attention_mask"]}


def _roles(ids) -> str:
    """mmadapt ids (a text's prefix, a task row's start) as a template's role names: '{eos} {bos}'."""
    return " ".join("{%s}" % SPECIAL_ROLES[i] for i in ids)


# --- config -------------------------------------------------------------------------------------------

def _rope(c, model_dir) -> dict:
    """The one rope parameter dict of config `c` (one per layer type in newer configs: all equal here)."""
    params = getattr(c, "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:
        if any(p != nested[0] for p in nested):
            raise ValueError(f"{model_dir}: its layer types use different rope parameters; mmadapt's rotary "
                             "positions are one table for every layer")
        params = nested[0]
    return {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0), **params}


def _qkv_bias(c) -> bool:
    """Qwen2 has a QKV bias; a Llama with attention_bias has one too, and an o_proj bias that must
    be zero (as mmadapt's export writes a Qwen2 body: export_model_type), which from_hf checks."""
    return c.model_type == "qwen2" or (c.model_type == "llama" and bool(getattr(c, "attention_bias", False)))


def sliding_window(c) -> int | None:
    """The attention window of config `c`, if any layer uses one (Mistral: sliding_window; Qwen2:
    layers from max_window_layers up when use_sliding_window, as layer_types lists them)."""
    if "sliding_attention" not in (getattr(c, "layer_types", None) or []) and c.model_type != "mistral":
        return None
    return getattr(c, "sliding_window", None)


# --- special ids ----------------------------------------------------------------------------------------

# --- the weight correspondence (module docstring) -------------------------------------------------------

_NORMS = ("input_layernorm", "post_attention_layernorm")


class LlamaMapping(HFMapping):
    """The decoder's correspondence (module docstring), as family.HFMapping declares it."""
    architectures = ARCHITECTURES
    positive_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings", "head_dim")
    ignored = (r"\.rotary_emb\.inv_freq$",)  # old checkpoints' rotary buffers: transformers recomputes them
    layer_name = r"^model\.layers\.(\d+)\."

    def check_config(self, cfg: dict, model_dir) -> None:
        """config.json of one of ARCHITECTURES, checked for everything the decoder cannot express."""
        c = transformers_config(cfg, model_dir)
        rope = _rope(c, model_dir)
        window = sliding_window(c)
        impossible = [
            (c.hidden_size % c.num_attention_heads,
             f"hidden_size {c.hidden_size} is not divisible by num_attention_heads {c.num_attention_heads}"),
            (c.num_attention_heads % c.num_key_value_heads,
             f"num_key_value_heads {c.num_key_value_heads} does not divide num_attention_heads {c.num_attention_heads}"),
            (not rope["rope_theta"] > 0, f"rope_theta is {rope['rope_theta']}; it must be > 0"),
            (rope["rope_type"] == "linear" and not rope.get("factor", 0) > 0,
             f"the linear rope scaling factor is {rope.get('factor')}; it must be > 0"),
            (not c.rms_norm_eps >= 0, f"rms_norm_eps is {c.rms_norm_eps}; it must be >= 0"),
            (window is not None and window < 1, f"sliding_window is {window}; it must be >= 1"),
        ]
        for bad, why in impossible:
            if bad:
                raise ValueError(f"{model_dir}: config.json's {why}: it cannot describe a working model")
        refused = [
            # ('swish': transformers' other name of SiLU, ACT2FN's same nn.SiLU)
            (c.hidden_act not in ("silu", "swish"), f"hidden_act is {c.hidden_act!r}; mmadapt's SwiGLU uses 'silu'"),
            (getattr(c, "mlp_bias", False), "mlp_bias is true; mmadapt's SwiGLU has no biases"),
            (rope["rope_type"] not in ROPE_TYPES,
             f"rope scaling type {rope['rope_type']!r} is not supported: mmadapt computes rotary positions with no "
             "scaling or with 'linear' scaling (position interpolation) exactly, and no other kind"),
            (rope.get("partial_rotary_factor", 1.0) != 1.0,
             f"partial_rotary_factor {rope.get('partial_rotary_factor')}: mmadapt rotates every dimension of a head"),
        ]
        for bad, why in refused:
            if bad:
                raise ValueError(f"{model_dir}: {why} (import-hf supports {SUPPORTED} as transformers defines them)")

    def model_config(self, cfg: dict, model_dir=None) -> ModelConfig:
        c = transformers_config(cfg, model_dir)
        rope = _rope(c, model_dir)
        window = sliding_window(c)
        positions = c.max_position_embeddings if window is None else min(window, c.max_position_embeddings)
        # a head size of its own (config.json's head_dim, not hidden_size / heads) is megatron's kv_channels
        head_dim = getattr(c, "head_dim", None)
        return validated(ModelConfig(
            family="llama", num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
            kv_channels=head_dim if head_dim and head_dim != c.hidden_size // c.num_attention_heads else None,
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
            ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size, max_position_embeddings=positions,
            hidden_dropout=0.0, attention_dropout=float(c.attention_dropout or 0.0), layernorm_epsilon=c.rms_norm_eps,
            init_method_std=c.initializer_range, add_qkv_bias=_qkv_bias(c),
            rotary_base=float(rope["rope_theta"]),
            seq_len_interpolation_factor=float(rope["factor"]) if rope["rope_type"] == "linear" else None,
            share_embeddings_and_output_weights=bool(c.tie_word_embeddings)))

    def special_ids(self, tok, cfg: dict, vocab_size: int, model_dir: Path) -> tuple[list[int], dict]:
        """The source ids of mmadapt's special roles, in mmadapt's order (pad, unk, <s>, </s>, <mask>),
        and what run.json records of them (per role: source id, its token, whether it was borrowed).

        eos is the tokenizer's eos (the document separator the decoder trains with), bos its bos, unk
        its unk, pad its pad unless another role holds that token (Qwen2's base models pad with
        their eos). A role the tokenizer lacks borrows a row that no text can produce, so that the
        permutation stays a bijection of the source's rows and the model exact, in this order:
        (a) embedding rows past the tokenizer's size, (b) the tokenizer's added special tokens with
        no role, (c) the tokens of bytes that never occur in UTF-8 (tokenizer.never_produced)."""
        vocab = tok.get_vocab()  # token -> id, added tokens included
        size = max(vocab.values()) + 1
        own = {"eos": tok.eos_token_id, "bos": tok.bos_token_id, "unk": tok.unk_token_id, "pad": tok.pad_token_id,
               "mask": tok.mask_token_id}
        ids: dict[str, int] = {}
        for role in CLAIM_ORDER:
            if own[role] is not None and own[role] not in ids.values():
                ids[role] = own[role]
        taken = set(own.values()) | set(ids.values())
        spare = [*range(size, vocab_size),
                 *(i for i, t in sorted(tok.added_tokens_decoder.items()) if t.special and i not in taken),
                 *(vocab[t] for t in never_produced(json.loads(tok.backend_tokenizer.to_str())) if t in vocab)]
        spare = [i for i in dict.fromkeys(spare) if i not in ids.values()]
        lacking = [r for r in SPECIAL_ROLES if r not in ids]
        if len(lacking) > len(spare):
            raise ValueError(f"{model_dir}: its tokenizer has no token of its own for {', '.join(lacking)} and only "
                             f"{len(spare)} rows that no text can produce (embedding rows past the tokenizer, unused "
                             "special tokens, byte pieces of non-UTF-8 bytes) to give them: add special tokens for them "
                             "to the tokenizer and rows to the model, or import a checkpoint that has them")
        ids.update(zip(lacking, spare))
        order = [ids[r] for r in SPECIAL_ROLES]
        record = {r: {"id": ids[r], "token": tok.convert_ids_to_tokens(ids[r]) if ids[r] < size else None,
                      "borrowed": r in lacking} for r in SPECIAL_ROLES}
        return order, record

    def from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_ids: list[int], hf_cfg: dict) -> dict:
        """A ...ForCausalLM state dict -> LlamaLM's (tensor-parallel size 1), `cfg` as_loaded's. Tensors
        the model does not use (an old checkpoint's rotary inv_freq buffers) are left out, as
        transformers ignores them (`ignored`); a tied checkpoint's lm_head.weight, equal to the
        embedding (as_loaded), is the embedding, as transformers ties it."""
        ng, r, hd = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim
        perm = torch.tensor(hf_ids)

        def get(name):
            if name not in hf:
                raise ValueError(f"the weights lack {name}")
            return hf[name].float()

        out = {WORD: get("model.embed_tokens.weight")[perm], "heads.heads.0.norm.weight": get("model.norm.weight")}
        if not cfg.share_embeddings_and_output_weights:
            out[OUTPUT] = get("lm_head.weight")[perm]
        for i in range(cfg.num_layers):
            a, ours = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
                q, k, v = (get(f"{a}self_attn.{p}_proj.{kind}") for p in "qkv")
                groups = [q.unflatten(0, (ng, r * hd)), k.unflatten(0, (ng, hd)), v.unflatten(0, (ng, hd))]
                out[f"{ours}qkv.{kind}"] = torch.cat(groups, dim=1).flatten(0, 1)
            out[ours + "attn_out.weight"] = get(a + "self_attn.o_proj.weight")
            if cfg.add_qkv_bias and hf_cfg["model_type"] == "llama" and get(a + "self_attn.o_proj.bias").any():
                raise ValueError(f"{a}self_attn.o_proj.bias is not zero (Llama's attention_bias): mmadapt's decoder has "
                                 "a bias on q, k and v only, as Qwen2")
            out[ours + "fc1.weight"] = torch.stack([get(a + "mlp.gate_proj.weight"), get(a + "mlp.up_proj.weight")],
                                                   dim=1).flatten(0, 1)
            out[ours + "fc2.weight"] = get(a + "mlp.down_proj.weight")
            for norm in _NORMS:
                out[f"{ours}{norm}.weight"] = get(f"{a}{norm}.weight")
        return {k: v.contiguous() for k, v in out.items()}

    def to_hf(self, cfg: ModelConfig, state: dict, kind: str | None, hf_ids: list[int] | None, ids: dict,
              model_type: str) -> dict:
        """LlamaLM's one-head (kind None) or LlamaForTask's state dict -> the matching HF class's of
        `model_type`. hf_ids: mmadapt id -> the exported tokenizer's id (None: the same ids). A QKV
        bias in a Llama: its attention_bias, with o_proj's bias zero."""
        ng, r, hd = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim
        inverse = None if hf_ids is None else inverse_permutation(hf_ids)
        rows = (lambda t: t) if inverse is None else (lambda t: t[inverse])
        word = rows(state[WORD].float())
        out = {"model.embed_tokens.weight": word}
        for i in range(cfg.num_layers):
            a, ours = f"model.layers.{i}.", f"layers.{i}."
            for t in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
                qkv = state[f"{ours}qkv.{t}"].unflatten(0, (ng, r + 2, hd))
                q, k, v = qkv.split((r, 1, 1), dim=1)
                for n, x in zip("qkv", (q, k, v)):
                    out[f"{a}self_attn.{n}_proj.{t}"] = x.flatten(0, 2)
            out[a + "self_attn.o_proj.weight"] = state[ours + "attn_out.weight"]
            if cfg.add_qkv_bias and model_type == "llama":
                out[a + "self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
            out[a + "mlp.gate_proj.weight"] = state[ours + "fc1.weight"][0::2]
            out[a + "mlp.up_proj.weight"] = state[ours + "fc1.weight"][1::2]
            out[a + "mlp.down_proj.weight"] = state[ours + "fc2.weight"]
            for norm in _NORMS:
                out[f"{a}{norm}.weight"] = state[f"{ours}{norm}.weight"]
        if kind is None:
            out["model.norm.weight"] = state["heads.heads.0.norm.weight"]
            out["lm_head.weight"] = word if cfg.share_embeddings_and_output_weights else rows(state[OUTPUT].float())
        else:
            out["model.norm.weight"] = state["norm.weight"]
            out["score.weight"] = state["score.weight"]
        return {k: v.float().contiguous() for k, v in out.items()}

    def hf_config(self, cfg: ModelConfig, kind: str | None, labels: list[str] | None, ids: dict[str, int], model_type: str):
        """The transformers config of `model_type`'s class for `kind` (None: the causal LM) that holds
        `cfg`; ids: the exported tokenizer's pad, bos and eos ids. No sliding window: mmadapt's model
        attends causally over its max_position_embeddings (an import capped them at the window)."""
        import transformers  # the hf extra

        if (model_type == "qwen2") != cfg.add_qkv_bias and model_type != "llama":
            raise ValueError(f"a {model_type} model {'always has' if model_type == 'qwen2' else 'has no'} QKV bias, and "
                             f"this one {'has' if cfg.add_qkv_bias else 'has not'}: export it as llama")
        rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
        if cfg.seq_len_interpolation_factor is not None:
            rope = {"rope_type": "linear", "rope_theta": cfg.rotary_base, "factor": cfg.seq_len_interpolation_factor}
        extra = ({"sliding_window": None} if model_type == "mistral" else
            {"use_sliding_window": False} if model_type == "qwen2" else {"attention_bias": cfg.add_qkv_bias})
        if kind == "classify":
            extra.update(id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
                         problem_type="single_label_classification")
        return transformers.AutoConfig.for_model(
            model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
            num_key_value_heads=cfg.query_groups, hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
            initializer_range=cfg.init_method_std, rms_norm_eps=cfg.layernorm_epsilon, rope_parameters=rope,
            attention_dropout=cfg.attention_dropout, tie_word_embeddings=cfg.share_embeddings_and_output_weights,
            pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
            architectures=[CLASS_PREFIX[model_type] + TASK_CLASSES[kind]], **extra)

    def tokenizer_layout(self, kind: str | None, imported: bool, cfg: ModelConfig,
                         text_layout: dict | None = None, task_start: tuple[int, ...] = (BOS_ID,)) -> dict | None:
        """The exported tokenizer's layout for `kind` (None: the causal LM); None: an imported
        tokenizer exported as it is (the source's own prompt layout, so that a round trip is exact).
        A Step-2 vocabulary of an imported decoder whose tokenizer puts ids before a text
        (`text_layout`'s prefix: Llama's and Mistral's <s>) trained on documents that start so
        (data.LayoutBatches): its prompt starts so too, and that role is its bos. A task model's
        rows start with its Step-3 run's `task_start` (features.Framing.start: </s> for a decoder
        mmadapt pretrained, an imported one's prefix; <s> for a run recorded before)."""
        if kind is not None:
            start = _roles(task_start)
            return {**TASK_LAYOUT, "single": f"{start} $A {{eos}}".strip(),
                    "pair": f"{start} $A {{eos}} {{eos}} $B {{eos}}".strip()}
        if imported:
            return None
        prefix = (text_layout or {}).get("prefix")
        if not prefix:
            return PROMPT_LAYOUT
        roles = _roles(prefix)
        return {**PROMPT_LAYOUT, "single": f"{roles} $A", "pair": f"{roles} $A {roles} $B",
                "tokens": {**PROMPT_LAYOUT["tokens"], "bos_token": SPECIAL_ROLES[prefix[0]]}}

    def export_model_type(self, model_type: str | None, cfg: ModelConfig, own_tokenizer: bool) -> str:
        """The model type to export as: the source's (None: an mmadapt-pretrained model, "llama"), except
        a Qwen2 with another tokenizer than its own (a Step-2 vocabulary): transformers' AutoTokenizer
        rebuilds any tokenizer of a qwen2 directory as Qwen2's byte-level BPE, so that model goes out as
        Llama with attention_bias (its o_proj bias zero: the same function, `to_hf`)."""
        if model_type is None or (model_type == "qwen2" and not own_tokenizer):
            return MODEL_TYPE
        return model_type

    def import_note(self, cfg: dict, model_dir=None) -> str | None:
        """What the import's summary line must say: the positions cut to a sliding window."""
        c = transformers_config(cfg, model_dir)
        window = sliding_window(c)
        if window is None or window >= c.max_position_embeddings:
            return None
        return (f"capped at its sliding window of {window} tokens, within which its attention is exactly causal "
                "attention; a longer --seq_length is refused")

    def as_loaded(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_cfg: dict) -> tuple[ModelConfig, str | None]:
        """transformers 5 ties lm_head.weight to the embedding under tie_word_embeddings true, unless
        the files hold an lm_head.weight that differs from it: then it loads the model untied (with a
        warning), and so does the import, saying so."""
        if not cfg.share_embeddings_and_output_weights or "lm_head.weight" not in hf:
            return cfg, None
        head, word = hf["lm_head.weight"], hf.get("model.embed_tokens.weight")
        if word is not None and head.shape == word.shape and torch.equal(head, word):
            return cfg, None
        return (dataclasses.replace(cfg, share_embeddings_and_output_weights=False),
                "untied: config.json's tie_word_embeddings is true, but the files hold an lm_head.weight of its own, "
                "which transformers loads as the output projection")

    def implied(self, cfg: ModelConfig, hf: dict, hf_cfg: dict) -> dict[str, Implied]:
        """Every tensor of a ...ForCausalLM config (as_loaded's): its shape from config.json's fields."""
        h, v, f, hd = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size, cfg.head_dim
        H, V, F = (h, f"hidden_size {h}"), (v, f"vocab_size {v}"), (f, f"intermediate_size {f}")
        Q = (cfg.num_attention_heads * hd, f"num_attention_heads {cfg.num_attention_heads} x head dim {hd}")
        KV = (cfg.query_groups * hd, f"num_key_value_heads {cfg.query_groups} x head dim {hd}")
        out = {"model.embed_tokens.weight": Implied((V, H)), "model.norm.weight": Implied((H,))}
        if not cfg.share_embeddings_and_output_weights:
            out["lm_head.weight"] = Implied((V, H), "tie_word_embeddings false: an output projection of its own")
        layer = {"self_attn.q_proj.weight": (Q, H), "self_attn.k_proj.weight": (KV, H), "self_attn.v_proj.weight": (KV, H),
                 "self_attn.o_proj.weight": (H, Q), "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H),
                 "mlp.down_proj.weight": (H, F), **{f"{n}.weight": (H,) for n in _NORMS}}
        if cfg.add_qkv_bias:
            layer.update({"self_attn.q_proj.bias": (Q,), "self_attn.k_proj.bias": (KV,), "self_attn.v_proj.bias": (KV,)})
            if hf_cfg["model_type"] == "llama":
                layer["self_attn.o_proj.bias"] = (H,)
        for i in range(cfg.num_layers):
            out.update({f"model.layers.{i}.{k}": Implied(d, f"num_hidden_layers {cfg.num_layers}")
                        for k, d in layer.items()})
        return out



MAPPING = LlamaMapping()
