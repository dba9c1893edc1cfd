"""Hugging Face interchange: checkpoints in as Step-1 sources, mmadapt's models out.

`import_hf` reads a local Hugging Face directory (config.json, model.safetensors or
pytorch_model.bin, tokenizer files) of an architecture some model family maps
(ModelFamily.hf: models/roberta/hf.py for RobertaForMaskedLM, XLMRobertaForMaskedLM and
CamembertForMaskedLM) and writes a run directory that every later step takes as a pretrain run
(recipe bl_base): run.json, one complete checkpoint `step00000000` in the family's names, and
the source tokenizer (mmadapt/tokenizer.py; its original files under tokenizer/hf/).

`export_hf` writes a directory that transformers' AutoModelFor... and AutoTokenizer load with no
custom code: a primary model (the LM), or a Step-3 model (its task's class), optionally with a
Step-2 artifact's embeddings and tokenizer swapped in.

This module reads and writes directories; each family's mapping translates configs and weights.
transformers, tokenizers and safetensors are imported here only (the `hf` extra).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mmadapt.adapt import artifact_state, read_artifact
from mmadapt.checkpoint import load_pt, staged_dir, write_weights_only
from mmadapt.config import ModelConfig, to_dict
from mmadapt.evaluate import artifact_primary, load_finetuned
from mmadapt.family import WORD
from mmadapt.models import FAMILIES, get_family
from mmadapt.run import RUN_TOKENIZER, checkpoint_tag, load_weights, read_run
from mmadapt.tokenizer import HFTokenizer, is_hf
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "sentencepiece.bpe.model", "vocab.json + merges.txt")


def _mappings() -> dict[str, object]:
    """Hugging Face architecture -> the family that maps it."""
    return {arch: family for family in FAMILIES.values() if family.hf is not None for arch in family.hf.ARCHITECTURES}


def supported() -> str:
    return ", ".join(_mappings())


SUPPORTED = supported()


# --- reading a Hugging Face directory ----------------------------------------------------------------

def read_hf_config(model_dir: Path) -> tuple[dict, object]:
    """config.json of a supported model and the family that maps it, checked for everything the
    family cannot express."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json); import-hf reads a "
                         f"local directory of {supported()}")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{model_dir / 'config.json'} is not JSON ({e.msg})") from None
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    family = _mappings().get(arch)
    if family is None or cfg.get("model_type") != family.hf.ARCHITECTURES[arch]:
        raise ValueError(f"{model_dir} holds a {arch or 'model without architectures'} (model_type "
                         f"{cfg.get('model_type')}); import-hf supports {supported()}")
    family.hf.check_config(cfg, model_dir)
    return cfg, family


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """A weight file's tensors; one that is cut short or damaged is one line naming it."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as e:
            raise ValueError(f"{path} cannot be read as safetensors ({str(e).splitlines()[0][:120]}): it is "
                             "truncated or damaged; download it again") from None
    return load_pt(path, "weight file", weights_only=True)


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


# --- import ------------------------------------------------------------------------------------------

def _fresh_output(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(f"{output_dir} already exists and is not empty: choose a new --output_dir "
                         "(nothing is overwritten)")


def import_hf(model_dir: str | os.PathLike, output_dir: str | os.PathLike) -> dict:
    """Write a Step-1 run directory from a Hugging Face model (module docstring). Every check
    comes before anything is written. -> the run's run.json."""
    model_dir, output_dir = Path(model_dir).resolve(), Path(output_dir)
    hf_cfg, family = read_hf_config(model_dir)
    mapping = family.hf
    _fresh_output(output_dir)
    hf_state = read_hf_weights(model_dir)
    tok = read_hf_tokenizer(model_dir)
    cfg = mapping.model_config(hf_cfg)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"{model_dir}: its tokenizer has {len(tok)} tokens but the model {cfg.vocab_size} "
                         "embedding rows")
    specials = mapping.special_ids(tok, model_dir)
    if specials[0] != hf_cfg["pad_token_id"]:
        raise ValueError(f"{model_dir}: config.json's pad_token_id {hf_cfg['pad_token_id']} is not the "
                         f"tokenizer's pad id {specials[0]}")
    hf_ids = mapping.hf_permutation(cfg.vocab_size, specials)
    try:
        state = mapping.from_hf(cfg, hf_state, hf_ids, hf_cfg["pad_token_id"])
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    _check_shapes(cfg, state, model_dir)

    arch = hf_cfg["architectures"][0]
    run = {"step": "pretrain", "recipe": "bl_base", "model": to_dict(cfg), "corpus": None, "data_path": None,
           "imported_from": {"model": str(model_dir), "architecture": arch, "model_type": hf_cfg["model_type"],
                             "special_ids": dict(zip(("pad", "unk", "bos", "eos", "mask"), specials))}}
    with staged_dir(output_dir) as tmp:
        write_weights_only(tmp / "checkpoints", 0, state, to_dict(cfg))
        (tmp / "tokenizer").mkdir()
        doc = HFTokenizer.document(tok.backend_tokenizer.to_str(), hf_ids, str(model_dir))
        (tmp / RUN_TOKENIZER).write_text(json.dumps(doc, ensure_ascii=False))
        tok.save_pretrained(str(tmp / "tokenizer" / "hf"))  # export-hf hands these back
        (tmp / "run.json").write_text(json.dumps(run, indent=2))
    return run


def _check_shapes(cfg: ModelConfig, state: dict, where: Path) -> None:
    for n, shape in get_family(cfg).param_names(cfg).items():
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


def export_hf(output_dir: str | os.PathLike, primary: str | os.PathLike | None = None,
              finetuned: str | os.PathLike | None = None, embeddings: str | os.PathLike | None = None,
              primary_tag: str | None = None) -> dict:
    """Write a transformers directory: the primary model of `primary` (a pretrain or imported
    run; the family's LM) or the Step-3 model of `finetuned` (its task's class), with the Step-2
    artifact `embeddings` swapped in when given (its vocabulary-indexed tensors and tokenizer).
    Every check comes before anything is written. -> a summary {architecture, vocab_size, ...}."""
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
        run = read_run(primary_run)
        if run.get("step") == "adapt":
            raise ValueError(f"{primary_run} is a Step-2 run: export its artifact with --embeddings and "
                             "the primary model with --primary")
        cfg, state = load_weights(primary_run, checkpoint_tag(primary_run, primary_tag))
        cfg, state = get_family(cfg).primary_model(cfg, state)
        kind, tokenizer = None, primary_run / RUN_TOKENIZER
    if embeddings is not None:
        emb, tokenizer, meta = read_artifact(embeddings)
        if emb["word_embeddings"].shape[1] != cfg.hidden_size:
            raise ValueError(f"{embeddings} holds embeddings of hidden size {emb['word_embeddings'].shape[1]}, the "
                             f"model {cfg.hidden_size}: they were trained for another model")
        owner = artifact_primary(meta).resolve()
        if owner != primary_run.resolve():
            raise ValueError(f"{embeddings} holds embeddings for the primary model {owner}, not {primary_run}")
        # A task model has no output head: only the word embeddings are swapped into it.
        swap = artifact_state(emb, cfg) if kind is None else {WORD: emb["word_embeddings"]}
        state = {**state, **{name: t.to(state[name].dtype) for name, t in swap.items()}}
        cfg = ModelConfig(**{**to_dict(cfg), "vocab_size": emb["word_embeddings"].shape[0]})

    imported = json.loads((primary_run / "run.json").read_text()).get("imported_from")
    return write_hf(output_dir, cfg, state, kind, labels, Path(tokenizer),
                    imported["model_type"] if imported else None, embeddings)


def write_hf(output_dir: Path, cfg: ModelConfig, state: dict, kind: str | None, labels: list[str] | None,
             tokenizer: Path, model_type: str | None = None, embeddings=None) -> dict:
    """Write the family's LM (kind None) or task model full weights `state` with a run's
    `tokenizer` as a transformers directory of `model_type`'s class for `kind` (None: the
    family's own model type)."""
    import transformers

    family = get_family(cfg)
    if family.hf is None:
        raise ValueError(f"the {family.name} family has no Hugging Face mapping yet: export-hf writes encoders only")
    mapping = family.hf
    model_type = model_type or mapping.MODEL_TYPE
    output_dir = Path(output_dir)
    _fresh_output(output_dir)
    if is_hf(tokenizer):
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(Path(tokenizer).parent / "hf"), local_files_only=True)
        hf_ids = HFTokenizer.read(tokenizer).hf_ids.tolist()
    else:
        hf_tok, hf_ids = spm_to_hf(tokenizer, cfg.max_position_embeddings), None
    ids = {role: (hf_ids[i] if hf_ids else i) for role, i in
           (("pad", PAD_ID), ("bos", BOS_ID), ("eos", EOS_ID))}
    hf_state = mapping.to_hf(cfg, state, kind, hf_ids, ids["pad"])
    hf_cfg = mapping.hf_config(cfg, kind, labels, ids, model_type)
    arch = hf_cfg.architectures[0]
    model = getattr(transformers, arch)(hf_cfg)
    model.load_state_dict(hf_state, strict=True)
    with staged_dir(output_dir) as tmp:
        model.save_pretrained(str(tmp))
        hf_tok.save_pretrained(str(tmp))
    return {"architecture": arch, "vocab_size": cfg.vocab_size, "labels": labels, "output_dir": str(output_dir),
            "embeddings": str(embeddings) if embeddings else None}
