"""Hugging Face interchange: RoBERTa-family masked LMs in as Step-1 sources, mmadapt's models out.

`import_hf` reads a local Hugging Face directory (config.json, model.safetensors or
pytorch_model.bin, tokenizer files) of RobertaForMaskedLM, XLMRobertaForMaskedLM or
CamembertForMaskedLM and writes a run directory that every later step takes as a pretrain run
(recipe bl_base): run.json, one complete checkpoint `step00000000` in RobertaMLM's names, and
the source tokenizer (mmadapt/tokenizer.py; its original files under tokenizer/hf/).

`export_hf` writes a directory that transformers' AutoModelFor... and AutoTokenizer load with no
custom code: a primary model (masked LM), or a Step-3 model (sequence classification, token
classification, question answering), optionally with a Step-2 artifact's embeddings and
tokenizer swapped in.

Both architectures are post-LN encoders with learned positions, exact (erf) GELU and a tied
output projection, so the correspondence is exact (HF name -> mmadapt name, `b` = "roberta."):
    b.embeddings.word_embeddings          word_embeddings.word_embeddings  rows permuted so that
                                          the special tokens get mmadapt's ids (tokenizer.py)
    b.embeddings.position_embeddings      embeddings.position_embeddings   HF counts positions from
                                          padding_idx + 1 (514 rows for 512 tokens): rows from there
    b.embeddings.token_type_embeddings    added into every position row (one type; HF's tokenizers
                                          for these models give no token_type_ids)
    b.embeddings.LayerNorm                embeddings.layernorm
    b.encoder.layer.i.attention.self.{query,key,value}  layers.i.qkv, per head [nh, 3, hd] rows
    b.encoder.layer.i.attention.output.dense / LayerNorm   layers.i.attn_out / attn_layernorm
    b.encoder.layer.i.intermediate.dense / output.dense    layers.i.fc1 / fc2
    b.encoder.layer.i.output.LayerNorm    layers.i.ffn_layernorm
    lm_head.dense / layer_norm / bias     heads.heads.0.dense / layernorm / bias (rows permuted);
                                          lm_head.decoder is the word embedding
    classifier.dense / out_proj           dense / out   (sequence classification)
    classifier                            out           (token classification)
    qa_outputs                            out           (question answering: start, end)
Only padding positions are computed differently (HF gives them position padding_idx, mmadapt
its running position): no other position attends to them, so no other output changes.

transformers, tokenizers and safetensors are imported here only (the `hf` extra).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mmadapt.config import ModelConfig, to_dict
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID

ARCHITECTURES = {"RobertaForMaskedLM": "roberta", "XLMRobertaForMaskedLM": "xlm-roberta",
                 "CamembertForMaskedLM": "camembert"}
CLASS_PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}
TASK_CLASSES = {None: "ForMaskedLM", "classify": "ForSequenceClassification", "tag": "ForTokenClassification",
                "span": "ForQuestionAnswering"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "sentencepiece.bpe.model", "vocab.json + merges.txt")
WORD, BIAS = "word_embeddings.word_embeddings.weight", "heads.heads.0.bias"
SUPPORTED = ", ".join(ARCHITECTURES)


# --- reading a Hugging Face directory ----------------------------------------------------------------

def read_hf_config(model_dir: Path) -> dict:
    """config.json of a supported model, checked for everything mmadapt's model cannot express."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json); import-hf reads a "
                         f"local directory of {SUPPORTED}")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{model_dir / 'config.json'} is not JSON ({e.msg})") from None
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES or cfg.get("model_type") != ARCHITECTURES[arch]:
        raise ValueError(f"{model_dir} holds a {arch or 'model without architectures'} (model_type "
                         f"{cfg.get('model_type')}); import-hf supports {SUPPORTED}")
    unsupported = [(k, cfg.get(k, d), want) for k, d, want in (
        ("hidden_act", "gelu", "gelu"), ("position_embedding_type", "absolute", "absolute"),
        ("is_decoder", False, False), ("tie_word_embeddings", True, True))
        if cfg.get(k, d) != want]
    if unsupported:
        k, got, want = unsupported[0]
        raise ValueError(f"{model_dir}: {k} is {got!r}; mmadapt's RoBERTa has {want!r} (import-hf supports "
                         f"{SUPPORTED} with exact GELU, absolute positions and a tied output projection)")
    return cfg


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    found = next((f for f in WEIGHT_FILES if (model_dir / f).is_file()), None)
    if found is None:
        raise ValueError(f"{model_dir} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    if found.endswith(".index.json"):
        shards = sorted(set(json.loads((model_dir / found).read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ValueError(f"{model_dir}: {found} names the weight file {missing[0]}, which is missing")
        state = {}
        for s in shards:
            state.update(_load_weight_file(model_dir / s))
        return state
    return _load_weight_file(model_dir / found)


def read_hf_tokenizer(model_dir: Path):
    """The directory's fast tokenizer (transformers converts a SentencePiece or vocab/merges one)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "sentencepiece.bpe.model")) and \
            not all((model_dir / f).is_file() for f in ("vocab.json", "merges.txt")):
        raise ValueError(f"{model_dir} has no tokenizer files: expected one of {', '.join(TOKENIZER_FILES)}")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; the user needs one line
        raise ValueError(f"{model_dir}: transformers cannot load its tokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"{model_dir}: its tokenizer ({type(tok).__name__}) has no fast (tokenizers) form")
    return tok


def special_ids(tok, model_dir: Path) -> list[int]:
    """The source ids of mmadapt's special tokens, in mmadapt's order (pad, unk, <s>, </s>, <mask>):
    the tokens a RoBERTa-family tokenizer puts at a sequence's start (cls) and end (sep)."""
    roles = {"pad": tok.pad_token_id, "unk": tok.unk_token_id, "<s>": tok.cls_token_id, "</s>": tok.sep_token_id,
             "<mask>": tok.mask_token_id}
    missing = [k for k, v in roles.items() if v is None]
    if missing:
        raise ValueError(f"{model_dir}: its tokenizer has no {missing[0]} token; a RoBERTa-family tokenizer "
                         "has <pad>, <unk>, <s>, </s> and <mask>")
    ids = list(roles.values())
    if len(set(ids)) != len(ids):
        raise ValueError(f"{model_dir}: its tokenizer gives two special tokens one id ({roles})")
    return ids


def hf_permutation(vocab_size: int, specials: list[int]) -> list[int]:
    """mmadapt id -> source id: the special tokens first (tokens.py's ids), then every other row
    in the source's order."""
    taken = set(specials)
    return specials + [i for i in range(vocab_size) if i not in taken]


def model_config(cfg: dict) -> ModelConfig:
    offset = cfg["pad_token_id"] + 1
    return ModelConfig(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                       num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
                       vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"] - offset,
                       hidden_dropout=cfg.get("hidden_dropout_prob", 0.1),
                       attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
                       layernorm_epsilon=cfg.get("layer_norm_eps", 1e-5),
                       init_method_std=cfg.get("initializer_range", 0.02)).validate()


# --- the weight correspondence (module docstring) ----------------------------------------------------

_LAYER = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_layernorm",
          "intermediate.dense": "fc1", "output.dense": "fc2", "output.LayerNorm": "ffn_layernorm"}


def _base_prefix(state: dict) -> str:
    key = next((k for k in state if k.endswith("embeddings.word_embeddings.weight")), None)
    if key is None:
        raise ValueError("the weights hold no embeddings.word_embeddings.weight: not a RoBERTa-family model")
    return key[:-len("embeddings.word_embeddings.weight")]


def from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_ids: list[int], pad_token_id: int) -> dict:
    """A RobertaForMaskedLM-family state dict -> RobertaMLM's (tensor-parallel size 1)."""
    b = _base_prefix(hf)
    nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    perm = torch.tensor(hf_ids)

    def get(name):
        if name not in hf:
            raise ValueError(f"the weights lack {name}")
        return hf[name].float()

    word = get(b + "embeddings.word_embeddings.weight")
    if "lm_head.decoder.weight" in hf and not torch.equal(hf["lm_head.decoder.weight"].float(), word):
        raise ValueError("lm_head.decoder.weight differs from the word embeddings: mmadapt's output projection is "
                         "tied, this model's is not")
    offset = pad_token_id + 1
    pos = get(b + "embeddings.position_embeddings.weight")[offset:offset + cfg.max_position_embeddings]
    out = {WORD: word[perm], "embeddings.position_embeddings.weight": pos + get(b + "embeddings.token_type_embeddings.weight")[0],
           "embeddings.layernorm.weight": get(b + "embeddings.LayerNorm.weight"),
           "embeddings.layernorm.bias": get(b + "embeddings.LayerNorm.bias")}
    for i in range(cfg.num_layers):
        p = f"{b}encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (get(f"{p}attention.self.{n}.{kind}") for n in ("query", "key", "value"))
            out[f"layers.{i}.qkv.{kind}"] = torch.stack(
                [t.reshape(nh, hd, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(3 * h, *q.shape[1:])
            for src, dst in _LAYER.items():
                out[f"layers.{i}.{dst}.{kind}"] = get(f"{p}{src}.{kind}")
    for kind in ("weight", "bias"):
        out[f"heads.heads.0.dense.{kind}"] = get(f"lm_head.dense.{kind}")
        out[f"heads.heads.0.layernorm.{kind}"] = get(f"lm_head.layer_norm.{kind}")
    out[BIAS] = get("lm_head.bias")[perm]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(cfg: ModelConfig, state: dict, kind: str | None, hf_ids: list[int] | None, pad_token_id: int) -> dict:
    """RobertaMLM's (kind None) or RobertaForTask's state dict -> the matching HF class's.
    hf_ids: mmadapt id -> the exported tokenizer's id (None: the same ids)."""
    nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    b = "roberta."
    word = state[WORD].float()
    if hf_ids is not None:
        inverse = torch.empty(len(hf_ids), dtype=torch.long)
        inverse[torch.tensor(hf_ids)] = torch.arange(len(hf_ids))
        word = word[inverse]
    pos = state["embeddings.position_embeddings.weight"].float()
    out = {b + "embeddings.word_embeddings.weight": word,
           b + "embeddings.position_embeddings.weight": torch.cat([pos.new_zeros(pad_token_id + 1, h), pos]),
           b + "embeddings.token_type_embeddings.weight": pos.new_zeros(1, h),
           b + "embeddings.LayerNorm.weight": state["embeddings.layernorm.weight"],
           b + "embeddings.LayerNorm.bias": state["embeddings.layernorm.bias"]}
    for i in range(cfg.num_layers):
        p = f"{b}encoder.layer.{i}."
        for t in ("weight", "bias"):
            qkv = state[f"layers.{i}.qkv.{t}"]
            q, k, v = qkv.reshape(nh, 3, hd, *qkv.shape[1:]).unbind(1)
            for n, x in zip(("query", "key", "value"), (q, k, v)):
                out[f"{p}attention.self.{n}.{t}"] = x.reshape(h, *qkv.shape[1:])
            for src, dst in _LAYER.items():
                out[f"{p}{src}.{t}"] = state[f"layers.{i}.{dst}.{t}"]
    for t in ("weight", "bias"):
        if kind is None:
            out[f"lm_head.dense.{t}"] = state[f"heads.heads.0.dense.{t}"]
            out[f"lm_head.layer_norm.{t}"] = state[f"heads.heads.0.layernorm.{t}"]
        elif kind == "classify":
            out[f"classifier.dense.{t}"] = state[f"dense.{t}"]
            out[f"classifier.out_proj.{t}"] = state[f"out.{t}"]
        else:
            out[f"{'classifier' if kind == 'tag' else 'qa_outputs'}.{t}"] = state[f"out.{t}"]
    if kind is None:
        bias = state[BIAS].float()
        out["lm_head.bias"] = bias if hf_ids is None else bias[inverse]
        out["lm_head.decoder.weight"], out["lm_head.decoder.bias"] = word, out["lm_head.bias"]
    return {k: v.float().contiguous() for k, v in out.items()}


# --- import ------------------------------------------------------------------------------------------

def _fresh_output(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(f"{output_dir} already exists and is not empty: choose a new --output_dir "
                         "(nothing is overwritten)")


def _publish(tmp: Path, output_dir: Path) -> None:
    """Move a finished directory into place: a reader never sees half of it."""
    if output_dir.is_dir():
        output_dir.rmdir()  # empty: checked by _fresh_output
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, output_dir)


def import_hf(model_dir: str | os.PathLike, output_dir: str | os.PathLike) -> dict:
    """Write a Step-1 run directory from a Hugging Face RoBERTa-family masked LM (module
    docstring). Every check comes before anything is written. -> the run's run.json."""
    from mmadapt.checkpoint import write_weights_only
    from mmadapt.tokenizer import HFTokenizer

    model_dir, output_dir = Path(model_dir).resolve(), Path(output_dir)
    hf_cfg = read_hf_config(model_dir)
    _fresh_output(output_dir)
    hf_state = read_hf_weights(model_dir)
    tok = read_hf_tokenizer(model_dir)
    cfg = model_config(hf_cfg)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"{model_dir}: its tokenizer has {len(tok)} tokens but the model {cfg.vocab_size} "
                         "embedding rows")
    specials = special_ids(tok, model_dir)
    if specials[0] != hf_cfg["pad_token_id"]:
        raise ValueError(f"{model_dir}: config.json's pad_token_id {hf_cfg['pad_token_id']} is not the "
                         f"tokenizer's pad id {specials[0]}")
    hf_ids = hf_permutation(cfg.vocab_size, specials)
    try:
        state = from_hf(cfg, hf_state, hf_ids, hf_cfg["pad_token_id"])
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    _check_shapes(cfg, state, model_dir)

    arch = hf_cfg["architectures"][0]
    run = {"step": "pretrain", "recipe": "bl_base", "model": to_dict(cfg), "corpus": None, "data_path": None,
           "imported_from": {"model": str(model_dir), "architecture": arch, "model_type": hf_cfg["model_type"],
                             "special_ids": dict(zip(("pad", "unk", "bos", "eos", "mask"), specials))}}
    tmp = output_dir.with_name(f".{output_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_weights_only(tmp / "checkpoints", 0, state, to_dict(cfg))
    (tmp / "tokenizer").mkdir()
    doc = HFTokenizer.document(tok.backend_tokenizer.to_str(), hf_ids, str(model_dir))
    (tmp / "tokenizer" / "spm.model").write_text(json.dumps(doc, ensure_ascii=False))
    tok.save_pretrained(str(tmp / "tokenizer" / "hf"))  # export-hf hands these back
    (tmp / "run.json").write_text(json.dumps(run, indent=2))
    _publish(tmp, output_dir)
    return run


def _check_shapes(cfg: ModelConfig, state: dict, where: Path) -> None:
    from mmadapt.models.roberta.model import RobertaMLM

    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in RobertaMLM(cfg).named_parameters()}
    for n, shape in want.items():
        if n not in state or tuple(state[n].shape) != shape:
            got = tuple(state[n].shape) if n in state else "nothing"
            raise ValueError(f"{where}: mmadapt's {n} needs shape {shape}, the weights give {got}")


# --- export ------------------------------------------------------------------------------------------

def spm_to_hf(spm_path: Path, model_max_length: int):
    """An mmadapt SentencePiece model (unigram, special ids of tokens.py) as a transformers fast
    tokenizer with the same ids: <s> text </s> for one text, <s> a </s></s> b </s> for a pair,
    as features.py encodes them."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    proto = pb.ModelProto()
    proto.ParseFromString(Path(spm_path).read_bytes())
    if proto.trainer_spec.model_type != 1:
        raise ValueError(f"{spm_path} is not a unigram SentencePiece model (as mmadapt trains them)")
    tok = Tokenizer(Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=proto.trainer_spec.unk_id,
                            byte_fallback=False))
    if proto.normalizer_spec.precompiled_charsmap:
        tok.normalizer = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
    # SentencePiece drops extra whitespace and marks each word's start with '▁'.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    # control pieces (<pad>, <s>, </s>) and user-defined ones (<mask>) are whole tokens, never split
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in proto.pieces
                            if p.type in (3, 4)])
    s, e = proto.pieces[BOS_ID].piece, proto.pieces[EOS_ID].piece
    tok.post_processor = processors.TemplateProcessing(single=f"{s} $A {e}", pair=f"{s} $A {e} {e} $B {e}",
                                                       special_tokens=[(s, BOS_ID), (e, EOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=s, eos_token=e, cls_token=s, sep_token=e,
                                   unk_token=proto.pieces[UNK_ID].piece, pad_token=proto.pieces[PAD_ID].piece,
                                   mask_token=proto.pieces[MASK_ID].piece, model_max_length=model_max_length)


def _run_json(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


def export_hf(output_dir: str | os.PathLike, primary: str | os.PathLike | None = None,
              finetuned: str | os.PathLike | None = None, embeddings: str | os.PathLike | None = None,
              primary_tag: str | None = None) -> dict:
    """Write a transformers directory: the primary model of `primary` (a pretrain or imported
    run; a masked LM) or the Step-3 model of `finetuned` (its task's class), with the Step-2
    artifact `embeddings` swapped in when given (word embeddings, output bias, tokenizer).
    Every check comes before anything is written. -> a summary {architecture, vocab_size, ...}."""
    from mmadapt import adapt as A
    from mmadapt.finetune import artifact_primary, load_finetuned, swap_embeddings
    from mmadapt.steps import checkpoint_tag

    if (primary is None) == (finetuned is None):
        raise ValueError("pass one of --primary (a pretrain run: a masked LM) and --finetuned (a fine-tuning run: "
                         "its task model)")
    output_dir = Path(output_dir)
    _fresh_output(output_dir)
    labels = None
    if finetuned is not None:
        ft = load_finetuned(finetuned)
        cfg, state, kind, labels, tokenizer = ft.cfg, ft.state, ft.task.kind, ft.labels, ft.tokenizer
        primary_run = Path(ft.run["primary"]["run_dir"])
    else:
        primary_run = Path(primary).resolve()
        run = A.read_run(primary_run)
        if run.get("step") == "adapt":
            raise ValueError(f"{primary_run} is a Step-2 run: export its artifact with --embeddings and "
                             "the primary model with --primary")
        cfg, state = A.primary_model(*A.load_model(primary_run, checkpoint_tag(primary_run, primary_tag)))
        kind, tokenizer = None, primary_run / "tokenizer" / "spm.model"
    if embeddings is not None:
        emb, tokenizer, meta = A.read_artifact(embeddings)
        if emb["word_embeddings"].shape[1] != cfg.hidden_size:
            raise ValueError(f"{embeddings} holds embeddings of hidden size {emb['word_embeddings'].shape[1]}, the "
                             f"model {cfg.hidden_size}: they were trained for another model")
        owner = artifact_primary(meta).resolve()
        if owner != primary_run.resolve():
            raise ValueError(f"{embeddings} holds embeddings for the primary model {owner}, not {primary_run}")
        state = swap_embeddings(state, emb)
        if kind is None:
            state = {**state, BIAS: emb["output_bias"].float()}
        cfg = ModelConfig(**{**to_dict(cfg), "vocab_size": emb["word_embeddings"].shape[0]})

    imported = _run_json(primary_run).get("imported_from")
    return write_hf(output_dir, cfg, state, kind, labels, Path(tokenizer),
                    imported["model_type"] if imported else "roberta", embeddings)


def write_hf(output_dir: Path, cfg: ModelConfig, state: dict, kind: str | None, labels: list[str] | None,
             tokenizer: Path, model_type: str = "roberta", embeddings=None) -> dict:
    """Write RobertaMLM's (kind None) or RobertaForTask's full weights `state` with a run's
    `tokenizer` as a transformers directory of `model_type`'s class for `kind`."""
    from mmadapt.tokenizer import HFTokenizer, is_hf

    output_dir = Path(output_dir)
    _fresh_output(output_dir)
    if is_hf(tokenizer):
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(Path(tokenizer).parent / "hf"), local_files_only=True)
        hf_ids = HFTokenizer.read(tokenizer).hf_ids.tolist()
    else:
        hf_tok, hf_ids = spm_to_hf(tokenizer, cfg.max_position_embeddings), None
    ids = {role: (hf_ids[i] if hf_ids else i) for role, i in
           (("pad", PAD_ID), ("bos", BOS_ID), ("eos", EOS_ID))}
    hf_state = to_hf(cfg, state, kind, hf_ids, ids["pad"])

    import transformers

    arch = CLASS_PREFIX[model_type] + TASK_CLASSES[kind]
    extra = {}
    if kind in ("classify", "tag"):
        extra = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
        if kind == "classify":
            extra["problem_type"] = "single_label_classification"
    elif kind == "span":
        extra = {"num_labels": 2}
    hf_cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_position_embeddings + ids["pad"] + 1, type_vocab_size=1,
        initializer_range=cfg.init_method_std, layer_norm_eps=cfg.layernorm_epsilon,
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"], architectures=[arch],
        tie_word_embeddings=True, **extra)
    model = getattr(transformers, arch)(hf_cfg)
    model.load_state_dict(hf_state, strict=True)
    tmp = output_dir.with_name(f".{output_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    hf_tok.save_pretrained(str(tmp))
    _publish(tmp, output_dir)
    return {"architecture": arch, "vocab_size": cfg.vocab_size, "labels": labels, "output_dir": str(output_dir),
            "embeddings": str(embeddings) if embeddings else None}
