"""Hugging Face interchange: checkpoints in as Step-1 sources, mmadapt's models out.

`import_hf` reads a local Hugging Face directory (config.json, model.safetensors or
pytorch_model.bin, tokenizer files) of an architecture some model family maps
(ModelFamily.hf: models/roberta/hf.py for RobertaForMaskedLM, XLMRobertaForMaskedLM and
CamembertForMaskedLM, models/llama/hf.py for LlamaForCausalLM, Qwen2ForCausalLM and
MistralForCausalLM) and writes a run directory that every later step takes as a pretrain run
(recipe bl_base): run.json, one complete checkpoint `step00000000` in the family's names, and
the source tokenizer (mmadapt/tokenizer.py; its original files under tokenizer/hf/).

`export_hf` writes a directory that transformers' AutoModelFor... and AutoTokenizer load with no
custom code: a primary model (the family's LM: masked or causal), or a Step-3 model (its task's
class), optionally with a Step-2 artifact's embeddings and tokenizer swapped in.

This module reads and writes directories; each family's mapping translates configs, special ids
and weights, and says how an exported tokenizer lays out a text (`tokenizer_layout`: a
`tokenizers` template over mmadapt's special roles). transformers, tokenizers and safetensors
are imported here and in the mappings only (the `hf` extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from mmadapt.artifact import (artifact_dir, artifact_primary, artifact_state, check_primary_unchanged, read_artifact,
                              same_primary, trained_for)
from mmadapt.checkpoint import check_output_dir, load_pt, read_json, staged_dir, write_weights_only
from mmadapt.config import ModelConfig, to_dict
from mmadapt.evaluate import load_finetuned
from mmadapt.graft import check_siblings, not_a_graft, nothing_to_graft, read_base
from mmadapt.family import HFMapping, Implied, ModelFamily, inverse_permutation
from mmadapt.models import FAMILIES
from mmadapt.run import RUN_TOKENIZER, read_source, require_head
from mmadapt.tokenizer import SPECIAL_ROLES, HFTokenizer, is_hf, sp_proto, unexportable
from mmadapt.tokens import BOS_ID
from mmadapt.tokenizer import kind as tokenizer_kind

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "sentencepiece.bpe.model", "tokenizer.model", "vocab.json + merges.txt",
                   "vocab.txt")
HALF_DTYPES = ("bfloat16", "float16")  # a source's dtype export-hf keeps (fp32 otherwise, as mmadapt trains)
GENERATION_CONFIG = "generation_config.json"  # a generative model's own settings (stop tokens, sampling)
# Its settings that name pieces by id, other than pad/bos/eos: meaningless over a replaced vocabulary
PIECE_ID_SETTINGS = ("suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                     "bad_words_ids", "sequence_bias", "decoder_start_token_id", "force_words_ids")


def half_dtype(hf_cfg: dict) -> str | None:
    """The half precision a model's config.json names (transformers 5's `dtype`, earlier
    `torch_dtype`), which export-hf writes it back in; None for fp32 or none named."""
    dtype = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    return dtype if dtype in HALF_DTYPES else None


def _mappings() -> dict[str, ModelFamily]:
    """Hugging Face architecture -> the family that maps it."""
    return {arch: family for family in FAMILIES.values() if family.hf is not None for arch in family.hf.architectures}


def supported() -> str:
    return ", ".join(_mappings())


SUPPORTED = supported()


# --- reading a Hugging Face directory ----------------------------------------------------------------

def json_file(path: Path, fix: str = ""):
    """The JSON value in `path` (a model directory's file), refused in one line naming it where it is
    not UTF-8 JSON (a download cut short; a file an editor saved as UTF-16, which transformers
    cannot read either). fix: what the line adds after the reason."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8 text: {e.reason}"
        raise ValueError(f"{path} is not JSON ({why}){fix}") from None


def config_json(model_dir: Path) -> dict:
    """A model directory's config.json, refused in one line unless it is a JSON object."""
    cfg = json_file(Path(model_dir) / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{Path(model_dir) / 'config.json'} holds a JSON {type(cfg).__name__}, not an object: it is "
                         "not a Hugging Face config (save_pretrained writes one)")
    return cfg


def read_hf_config(model_dir: Path) -> tuple[dict, object]:
    """config.json of a supported model and the family that maps it, checked for everything the
    family cannot express."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json); import-hf reads a "
                         f"local directory of {supported()}")
    cfg = config_json(model_dir)
    archs = cfg.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{model_dir / 'config.json'}: its architectures is {json.dumps(archs)}, not a list of class "
                         "names (as save_pretrained writes it): fix it, or leave it out (model_type then decides)")
    arch = archs[0] if archs else _architecture_of(cfg, model_dir)
    family = _mappings().get(arch)
    if family is not None and cfg.get("model_type") != family.hf.architectures[arch]:  # (a supported class)
        raise ValueError(f"{model_dir / 'config.json'}: its model_type is {cfg.get('model_type')!r} but its "
                         f"architectures names {arch} (model_type {family.hf.architectures[arch]!r}): fix "
                         "config.json, or save the model again (save_pretrained)")
    if family is None:
        raise ValueError(f"{model_dir} holds a {arch or 'model without architectures'} (model_type "
                         f"{cfg.get('model_type')}); import-hf supports {supported()}")
    cfg = {**_defaults(cfg["model_type"], family.hf.defaulted), **cfg,
           "architectures": [arch]}  # the class, named or read off the weights
    _check_config_values(cfg, family.hf, model_dir)
    family.hf.check_config(cfg, model_dir)
    return cfg, family


def _defaults(model_type: str, fields: tuple[str, ...]) -> dict:
    """`fields`' defaults in transformers' config class of `model_type` (what it loads where
    config.json leaves them out)."""
    if not fields:
        return {}
    import transformers

    made = transformers.CONFIG_MAPPING[model_type]()
    return {f: getattr(made, f) for f in fields}


def _architecture_of(cfg: dict, model_dir: Path) -> str | None:
    """The class of a config.json without `architectures` (transformers' Auto classes go by
    model_type): of the classes of that model type some family maps, the one its weights are of
    (HFMapping.architecture: a body where they hold no LM head). None: no family maps it."""
    for family in FAMILIES.values():
        if family.hf is not None and cfg.get("model_type") in family.hf.architectures.values():
            return family.hf.architecture(cfg["model_type"], weight_names(model_dir))
    return None


def weight_names(model_dir: Path) -> list[str]:
    """The names of the tensors a Hugging Face directory's weights hold: from safetensors headers
    or an index where there is one (nothing is loaded), else the whole pickle."""
    found = next((f for f in WEIGHT_FILES if (model_dir / f).is_file()), None)
    if found is None:
        raise ValueError(f"{model_dir} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    if found.endswith(".index.json"):
        return list(_weight_map(model_dir / found))
    if found.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(model_dir / found), "pt") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise ValueError(f"{model_dir / found} cannot be read as safetensors ({str(e).splitlines()[0][:120]}): "
                             "it is truncated or damaged; download it again") from None
    return list(_load_weight_file(model_dir / found))


# config.json's special-token ids: each must name a row of the vocabulary.
SPECIAL_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _check_config_values(cfg: dict, mapping: HFMapping, model_dir: Path) -> None:
    """config.json values that cannot describe a working model, refused naming the field: the
    mapping's sizes (whole numbers >= 1) and special-token ids outside the vocabulary."""
    for k in mapping.positive_fields:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{model_dir}: config.json's {k} is {v!r}; it must be a whole number >= 1 (the "
                             "config is damaged: fix it, or download the checkpoint again)")
    vocab = cfg.get("vocab_size")
    for k in SPECIAL_ID_FIELDS:
        for i in cfg.get(k) if isinstance(cfg.get(k), list) else [cfg.get(k)]:
            if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0
                                  or isinstance(vocab, int) and i >= vocab):
                raise ValueError(f"{model_dir}: config.json's {k} {i!r} is not a token id of its vocabulary "
                                 f"(0..{vocab - 1 if isinstance(vocab, int) else 'vocab_size - 1'}, vocab_size "
                                 f"{vocab}): fix config.json (the id, or a vocab_size that disagrees with the weights)")


def check_finite(state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse a checkpoint with a NaN or infinite weight, naming the first (in name order)."""
    for name in sorted(state):
        t = state[name]
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad, kind = int((~torch.isfinite(t)).sum()), "NaN" if bool(t.isnan().any()) else "infinite"
            raise ValueError(f"{where}: its weight {name} holds {bad} {kind} value{'s' if bad > 1 else ''} (of "
                             f"{t.numel()}): the checkpoint is damaged; download it again")


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


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint's index (`weight_map`: tensor name -> weight file), refused in one line
    where it is not one (a download cut short, a hand edit)."""
    found = json_file(index, ": it is truncated or damaged; download it again")
    shards = found.get("weight_map") if isinstance(found, dict) else None
    if not (isinstance(shards, dict) and shards and all(isinstance(v, str) and v for v in shards.values())):
        raise ValueError(f"{index} has no weight_map of tensor names to weight files: it is damaged; download it "
                         "again")
    return shards


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    found = next((f for f in WEIGHT_FILES if (model_dir / f).is_file()), None)
    if found is None:
        raise ValueError(f"{model_dir} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    if found.endswith(".index.json"):
        shards = sorted(set(_weight_map(model_dir / found).values()))
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
    one = ("tokenizer.json", "sentencepiece.bpe.model", "tokenizer.model", "vocab.txt")
    if (not any((model_dir / f).is_file() for f in one) and
            not all((model_dir / f).is_file() for f in ("vocab.json", "merges.txt"))):
        raise ValueError(f"{model_dir} has no tokenizer files: expected one of {', '.join(TOKENIZER_FILES)}")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; the user needs one line
        raise ValueError(f"{model_dir}: transformers cannot load its tokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"{model_dir}: its tokenizer ({type(tok).__name__}) has no fast (tokenizers) form")
    vocab = model_dir / "vocab.txt"
    if not (model_dir / "tokenizer.json").is_file() and vocab.is_file():
        # A WordPiece built from vocab.txt: transformers has been seen to build one of a few pieces
        # and no error; the file's lines are its size.
        lines = len(vocab.read_text(encoding="utf-8").splitlines())
        if len(tok) != lines:
            raise ValueError(f"{model_dir}: transformers built a tokenizer of {len(tok)} tokens from its vocab.txt of "
                             f"{lines} lines; save the tokenizer with tokenizer.json (tokenizer.save_pretrained)")
    return tok


# --- import ------------------------------------------------------------------------------------------

def _fresh_output(output_dir: Path) -> None:
    check_output_dir(output_dir)  # a file on its way, a directory this user cannot write
    if Path(os.path.abspath(output_dir)) == Path.cwd():  # written whole beside it, then moved into its place
        raise ValueError(f"--output_dir {output_dir} is the directory this command runs in, which the written "
                         "directory would take the place of: name a new one (--output_dir export)")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(f"{output_dir} already exists and is not empty: choose a new --output_dir "
                         "(nothing is overwritten)")


def import_hf(model_dir: str | os.PathLike, output_dir: str | os.PathLike,
              roles_from: str | os.PathLike | None = None) -> dict:
    """Write a Step-1 run directory from a Hugging Face model (module docstring). Every check
    comes before anything is written (`imported_state`, `check_parity`). roles_from: an imported
    run of the same vocabulary whose special roles this import takes (`roles_of`: a fine-tuned
    sibling of that base, to graft the base's embeddings into). -> the run's run.json."""
    model_dir, output_dir = Path(model_dir).resolve(), Path(output_dir)
    hf_cfg, family = read_hf_config(model_dir)
    mapping = family.hf
    _fresh_output(output_dir)
    hf_state = read_hf_weights(model_dir)
    check_finite(hf_state, model_dir)
    tok = read_hf_tokenizer(model_dir)
    _check_tokenizer_kind(family, tok, model_dir)
    try:
        cfg = mapping.model_config(hf_cfg)
    except ValueError as e:
        raise ValueError(f"{model_dir}: config.json describes a model mmadapt cannot build ({e})") from None
    if len(tok) > cfg.vocab_size:  # (before the weights' shapes are checked against config.json: either is wrong)
        raise ValueError(f"{model_dir}: its tokenizer has {len(tok)} tokens but config.json's vocab_size is "
                         f"{cfg.vocab_size}: where tokens were added to the tokenizer, resize the model to it "
                         "(model.resize_token_embeddings(len(tokenizer))) and save both again; where vocab_size is "
                         "wrong, set it to the word embeddings' rows")
    specials, record = (mapping.special_ids(tok, hf_cfg, cfg.vocab_size, model_dir) if roles_from is None else
                        roles_of(Path(roles_from), tok, cfg.vocab_size, model_dir))
    hf_ids = hf_permutation(cfg.vocab_size, specials)
    cfg, state, loaded = imported_state(family, cfg, hf_state, hf_ids, hf_cfg, model_dir)
    check_parity(family, cfg, state, tok, hf_ids, model_dir, hf_cfg)
    headless = mapping.is_headless(hf_cfg)
    arch = hf_cfg["architectures"][0]
    imported = {"model": str(model_dir), "architecture": arch, "model_type": hf_cfg["model_type"],
                "special_ids": record, "text_layout": text_layout(tok, hf_ids),
                **({"roles_from": str(Path(roles_from).resolve())} if roles_from is not None else {}),
                **({"headless": True} if headless else {})}
    if (dtype := half_dtype(hf_cfg)) is not None:  # its weights are read in fp32 (exactly); exported in this
        imported["dtype"] = dtype
    named = config_json(model_dir).get("architectures")
    read_off = None if named else (f"config.json names no architecture: read as {arch} (model_type "
                                   f"{hf_cfg['model_type']}, as transformers' Auto classes read it; its weights "
                                   f"{'hold no' if headless else 'hold an'} LM head)")
    note = "; ".join(n for n in (read_off, loaded, mapping.import_note(hf_cfg, model_dir)) if n)
    if note:
        imported["note"] = note
    run = {"step": "pretrain", "recipe": "bl_base", "model": to_dict(cfg), "corpus": None, "data_path": None,
           "imported_from": imported}
    with staged_dir(output_dir) as tmp:
        write_weights_only(tmp / "checkpoints", 0, state, to_dict(cfg))
        (tmp / "tokenizer").mkdir()
        doc = HFTokenizer.document(tok.backend_tokenizer.to_str(), hf_ids, str(model_dir))
        (tmp / RUN_TOKENIZER).write_text(json.dumps(doc, ensure_ascii=False))
        tok.save_pretrained(str(tmp / "tokenizer" / "hf"))  # export-hf hands these back
        if (model_dir / GENERATION_CONFIG).is_file():  # and these (an instruct model's stop tokens, write_hf)
            shutil.copyfile(model_dir / GENERATION_CONFIG, tmp / "tokenizer" / "hf" / GENERATION_CONFIG)
        elif (not family.objective.masked and tok.eos_token_id is not None  # a generating model (not an
              # encoder, whose config.json may name an eos its tokenizer has not)
              and (derived := _config_generation_ids(model_dir)).get("eos_token_id", tok.eos_token_id)
              != tok.eos_token_id):
            # none: transformers generates with config.json's stop tokens (a list, as Llama-3.1's),
            # where the export's config.json names the tokenizer's one eos: kept as transformers
            # derives them
            (tmp / "tokenizer" / "hf" / GENERATION_CONFIG).write_text(
                json.dumps({**derived, "_from_model_config": True}, indent=2) + "\n", encoding="utf-8")
        (tmp / "run.json").write_text(json.dumps(run, indent=2))
    return run


def _config_generation_ids(model_dir: Path) -> dict:
    """config.json's special ids that transformers' generation reads (GenerationConfig.from_model_config)."""
    cfg = config_json(model_dir)
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}


class OtherVocabulary(ValueError):
    """roles_of's refusal of a model whose vocabulary is not the --roles_from run's (no sibling
    of it: extend imports it on its own, and graft.check_siblings names what differs)."""


def roles_of(base_run: Path, tok, vocab_size: int, model_dir: Path) -> tuple[list[int], dict]:
    """import-hf --roles_from: the special ids (and their record) of the imported run `base_run`,
    for a model whose tokenizer `tok` is that run's source vocabulary with its `vocab_size` rows
    (refused in one line otherwise). An instruct model's tokenizer names the end of a turn as its
    eos where its base names the end of a document; imported alike, the two give every piece one
    id, so that Step-2 embeddings trained over the base go into the sibling (graft.py)."""
    what = f"--roles_from {base_run}"
    record = (read_json(base_run / "run.json", "imported run").get("imported_from") or {}
              if (base_run / "run.json").is_file() else {})
    if not record.get("special_ids") or not is_hf(base_run / RUN_TOKENIZER):
        raise ValueError(f"{what} is not an import-hf run of a Hugging Face model: name the run of the base model "
                         f"{model_dir} was fine-tuned from")
    base = HFTokenizer.read(base_run / RUN_TOKENIZER)
    if not base.same_vocabulary(tok.backend_tokenizer.get_vocab(with_added_tokens=True), vocab_size):
        raise OtherVocabulary(f"{what}: {model_dir} has another vocabulary than that run's model "
                              f"({len(base.hf_ids)} rows, {model_dir}'s {vocab_size}, or other tokens): drop "
                              "--roles_from, or name the run of the model it was fine-tuned from")
    ids = [int(h) for h in base.hf_ids[:len(SPECIAL_ROLES)]]
    # (a decoder family records each role as {id, token, borrowed}, an encoder as its id)
    return ids, {r: {**record["special_ids"][r], "id": h} if isinstance(record["special_ids"][r], dict) else h
                 for r, h in zip(SPECIAL_ROLES, ids)}


# --- sentence-transformers directories ----------------------------------------------------------------
# modules.json lists the modules: the transformer (its files at the top, or in its folder), then
# modules over its token states that mmadapt carries unchanged (pooling, a dense projection,
# normalisation: they read no vocabulary). A run keeps them in SENTENCE_TRANSFORMERS; export-hf
# writes them back around the new body and tokenizer.
SENTENCE_TRANSFORMERS = "sentence_transformers"
ST_CARRIED = ("Pooling", "Dense", "Normalize")
# Modules that hold no file: sentence-transformers builds them without their folder, and the Hub
# ships them so (all-MiniLM-L6-v2's modules.json names a 2_Normalize that is not there).
ST_FILELESS = ("Normalize",)
ST_FILES = ("modules.json", "config_sentence_transformers.json")  # the directory's own, beside the modules
# The transformer module's own file (max_seq_length, do_lower_case): sentence-transformers reads
# the first of these names whose content is not empty (older versions wrote one per model type;
# Hub models ship them); a run keeps the one read under the first name, which the export writes.
ST_CONFIG_NAMES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                   "sentence_camembert_config.json", "sentence_albert_config.json",
                   "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
ST_TRANSFORMER_FILES = ST_CONFIG_NAMES[:1]


def _module_path(path, transformer: bool) -> bool:
    """Whether modules.json's "path" names a folder inside the directory: a relative path without
    "..", which the transformer may leave empty (its files at the top) and a module after it may
    not (export-hf copies that folder: "", "." or "../x" would copy the directory into itself or
    write outside the output)."""
    if not isinstance(path, str):
        return False
    parts = Path(path).parts  # ("." and "./" have none: the directory itself, as "" is)
    return (bool(parts) or transformer) and not Path(path).is_absolute() and ".." not in parts


def read_sentence_transformers(st_dir: Path) -> tuple[Path, list[dict]]:
    """A sentence-transformers directory -> (its transformer's directory, modules.json's entries),
    refused in one line unless it is a transformer followed by modules mmadapt carries."""
    modules = json_file(st_dir / "modules.json")
    if isinstance(modules, list):
        bad = next((i for i, m in enumerate(modules)
                    if not isinstance(m, dict) or not isinstance(m.get("type"), str)
                    or not _module_path(m.get("path"), transformer=i == 0)), None)
        if bad is not None:
            raise ValueError(f"{st_dir / 'modules.json'}: its entry {bad} names no module type or no folder "
                             "inside the directory (an object with \"type\" and \"path\", as "
                             "sentence-transformers writes it): copy the directory as it was saved")
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules] if isinstance(modules, list) else []
    if not kinds or kinds[0] != "Transformer" or any(k not in ST_CARRIED for k in kinds[1:]):
        raise ValueError(f"{st_dir}: its modules.json lists {', '.join(kinds) or 'no modules'}; import-hf takes a "
                         f"sentence-transformers model of a Transformer followed by {', '.join(ST_CARRIED)} modules")
    for m, kind in zip(modules[1:], kinds[1:]):
        if not (st_dir / m["path"]).is_dir() and kind not in ST_FILELESS:
            raise ValueError(f"{st_dir}: its modules.json lists a {kind} module in {m['path']}/, which does not "
                             "exist: copy the whole sentence-transformers directory")
    return st_dir / modules[0]["path"], modules


def import_any(model_dir: str | os.PathLike, output_dir: str | os.PathLike, task: str | None = None,
               roles_from: str | os.PathLike | None = None) -> dict:
    """`mmadapt import-hf`: a sentence-transformers directory (modules.json), a sequence
    classifier (hf_classifier.py: a Step-3 run for `task`) or a transformers model (roles_from:
    import_hf's)."""
    from mmadapt.hf_classifier import import_classifier

    model_dir = Path(model_dir).resolve()
    kind = import_kind(model_dir)
    if roles_from is not None and kind != TRANSFORMERS:
        raise ValueError(f"--roles_from gives a language model its base's special roles; {model_dir} is {kind}, "
                         "whose roles are its tokenizer's: drop --roles_from")
    if kind == CLASSIFIER:
        return import_classifier(model_dir, output_dir, task)
    # (a sentence-transformers directory may keep its transformer in a module folder: no config.json on top)
    if task is not None and (kind == SENTENCE_TRANSFORMERS_DIR or (model_dir / "config.json").is_file()):
        raise ValueError(f"--task names what a sequence classifier predicts; {model_dir} is not one: drop --task")
    if kind == SENTENCE_TRANSFORMERS_DIR:
        return import_sentence_transformers(model_dir, Path(output_dir))
    return import_hf(model_dir, output_dir, roles_from)


# What a Trainer writes beside the model it saves (its state, arguments and metrics): no import reads them
TRAINER_LOGS = ("trainer_state.json", "training_args.bin")


def model_dir_files(model_dir: str | os.PathLike, known: dict | None = None) -> dict[str, dict]:
    """The files an import reads from a model directory -> {path in it: {"size", "mtime_ns",
    "sha256"}}: its top-level files and, for a sentence-transformers directory, those of the
    module folders modules.json names; hidden files, *.md (a model card edited changes no
    weight) and a Trainer's logs (TRAINER_LOGS) left out, and so are its checkpoint-*/ and runs/
    folders. Every file is hashed whole (a fine-tune that moved a few rows shows), except one
    whose size and mtime are those `known` (a former result) records: its hash is taken from
    there, so a repeated call costs a stat per file. `files_digest` makes one identity of it, the
    same for a copy anywhere."""
    from mmadapt.data import file_sha256

    root = Path(model_dir)
    folders = [root]
    try:
        modules = json.loads((root / "modules.json").read_text()) if (root / "modules.json").is_file() else []
        folders += [root / m["path"] for m in modules if isinstance(m, dict)
                    and _module_path(m.get("path"), transformer=False)]
    except (ValueError, TypeError):
        pass  # (the import refuses it in one line)
    out, known = {}, known or {}
    try:
        for folder in folders:
            paths = folder.iterdir() if folder == root else folder.rglob("*") if folder.is_dir() else ()
            for f in sorted(paths):
                rel = f.relative_to(root).as_posix()
                if rel in out or not f.is_file() or f.suffix == ".md" or f.name in TRAINER_LOGS or f.name.endswith(
                        "_results.json") or any(part.startswith(".") for part in rel.split("/")):
                    continue
                st = f.stat()
                seen = known.get(rel) or {}
                same = seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns
                out[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                            "sha256": seen["sha256"] if same and seen.get("sha256") else file_sha256(f)}
    except OSError as e:
        raise ValueError(f"{model_dir}: cannot read {e.filename} ({e.strerror}): make the model directory "
                         "readable") from None
    return out


def files_differ(then: dict[str, dict], now: dict[str, dict]) -> str:
    """The first of model_dir_files' paths whose content differs between two listings, said as
    '<path> changed', '<path> added' or '<path> gone'; '' where none does."""
    for rel in sorted(set(then) | set(now)):
        if rel not in then:
            return f"{rel} added"
        if rel not in now:
            return f"{rel} gone"
        if then[rel].get("sha256") != now[rel]["sha256"]:
            return f"{rel} changed"
    return ""


def files_digest(files: dict[str, dict]) -> str:
    """One sha256 of model_dir_files' paths and contents (not their times)."""
    return hashlib.sha256(json.dumps(sorted((rel, f["sha256"]) for rel, f in files.items())).encode()).hexdigest()


# What import_any reads a model directory as (import_kind)
CLASSIFIER, SENTENCE_TRANSFORMERS_DIR, TRANSFORMERS = ("a sequence classifier", "a sentence-transformers directory",
                                                        "a transformers model")


def import_kind(model_dir: Path) -> str:
    """What import_any imports `model_dir` as: CLASSIFIER (config.json names a sequence
    classifier), SENTENCE_TRANSFORMERS_DIR (modules.json) or TRANSFORMERS (a language model or
    an encoder body, import_hf)."""
    from mmadapt.hf_classifier import is_classifier

    if is_classifier(model_dir):
        return CLASSIFIER
    return SENTENCE_TRANSFORMERS_DIR if (model_dir / "modules.json").is_file() else TRANSFORMERS


def sentence_transformers_body(st_dir: Path) -> tuple[Path, list[dict], dict, ModelFamily]:
    """read_sentence_transformers, and its transformer's config.json and family -> (transformer's
    directory, modules.json's entries, config, family), refused in one line unless the
    transformer is an encoder's body (a BertModel: a family's HFMapping.headless)."""
    transformer, modules = read_sentence_transformers(st_dir)
    hf_cfg, family = read_hf_config(transformer)
    if not family.hf.is_headless(hf_cfg):
        bodies = sorted({a for f in FAMILIES.values() if f.hf is not None for a in f.hf.headless})
        raise ValueError(f"{st_dir}: its transformer is a {hf_cfg['architectures'][0]}; import-hf takes a "
                         f"sentence-transformers model whose transformer is an encoder's body ({', '.join(bodies)})")
    return transformer, modules, hf_cfg, family


def import_sentence_transformers(st_dir: Path, output_dir: Path) -> dict:
    """import_hf of the directory's transformer, with its other modules kept in the run
    (SENTENCE_TRANSFORMERS) and named in run.json (`imported_from.sentence_transformers`). Every
    check comes before anything is written. -> the run's run.json."""
    transformer, modules, hf_cfg, family = sentence_transformers_body(st_dir)
    _fresh_output(output_dir)
    with staged_dir(output_dir) as tmp:
        run = import_hf(transformer, tmp)
        kept = tmp / SENTENCE_TRANSFORMERS
        kept.mkdir()
        _copy_modules(st_dir, kept, modules)
        for f in [st_dir / n for n in ST_FILES]:
            if f.is_file():
                shutil.copyfile(f, kept / f.name)
        settings = sentence_settings(transformer)
        # written where every sentence-transformers reads it first (the export keeps it), whichever
        # name the source's had
        read = sentence_config_file(transformer)
        written = {**(json_file(read) if read else {}),
                   **({"max_seq_length": settings["max_seq_length"]} if "max_seq_length" in settings else {})}
        if read or written:
            (kept / ST_TRANSFORMER_FILES[0]).write_text(json.dumps(written, indent=2))
        run["imported_from"]["sentence_transformers"] = {"model": str(st_dir),
                                                         "modules": [m.get("type") for m in modules], **settings}
        (tmp / "run.json").write_text(json.dumps(run, indent=2))
    return run


def write_sentence_transformers(family: ModelFamily, output_dir: Path, cfg: ModelConfig, state: dict,
                                tokenizer: Path, model_type: str | None, modules: Path,
                                dtype: str | None = None) -> Path:
    """A sentence-transformers directory that `SentenceTransformer(output_dir)` loads: the family's
    body class (kind "body": BertModel, XLMRobertaModel, ...) with `state`'s weights and the
    run's `tokenizer`, its files at the top, and the source's other modules (`modules`, a run's
    SENTENCE_TRANSFORMERS) around it as they were."""
    write_hf(family, output_dir, cfg, state, "body", None, tokenizer, model_type, dtype=dtype)
    entries = json.loads((modules / "modules.json").read_text())
    entries[0]["path"] = ""
    _copy_modules(modules, output_dir, entries)
    for name in ST_FILES[1:] + ST_TRANSFORMER_FILES:
        if (modules / name).is_file():
            shutil.copyfile(modules / name, output_dir / name)
    (output_dir / "modules.json").write_text(json.dumps(entries, indent=2))
    return output_dir


def _copy_modules(src: Path, dst: Path, modules: list[dict]) -> None:
    """The modules after the transformer, each folder as it is (a fileless one, ST_FILELESS,
    may have none: it stays without)."""
    for m in modules[1:]:
        if (src / m["path"]).is_dir():
            shutil.copytree(src / m["path"], dst / m["path"])


def sentence_config_file(transformer: Path) -> Path | None:
    """The transformer module's settings file as sentence-transformers picks it: the first of
    ST_CONFIG_NAMES that is there and not empty (None: none is)."""
    for name in ST_CONFIG_NAMES:
        if (transformer / name).is_file() and json_file(transformer / name):
            return transformer / name
    return None


def sentence_settings(transformer: Path) -> dict:
    """What the transformer module says of how it reads a text, as sentence-transformers applies
    it: `max_seq_length` (pieces kept, the rest cut) and `do_lower_case` (lower-cased before the
    tokenizer) from its settings file (sentence_config_file); sentence-transformers 6 writes no
    max_seq_length there but keeps it as the tokenizer's model_max_length, capped at the model's
    positions (tokenizer_config.json, config.json)."""
    path = sentence_config_file(transformer)
    found = json_file(path) if path else {}
    if not isinstance(found, dict):
        raise ValueError(f"{path} holds a JSON {type(found).__name__}, not an object: sentence-transformers writes one")
    out = {k: found[k] for k in ("max_seq_length", "do_lower_case") if found.get(k) is not None}  # null: unset
    # refused at import, not at the first encode (a "128" raised a TypeError there; a "false" is
    # truthy and lower-cased every text)
    if "max_seq_length" in out and (type(out["max_seq_length"]) is not int or out["max_seq_length"] < 1):
        raise ValueError(f"{path}: max_seq_length is {out['max_seq_length']!r}, not a whole number of pieces: "
                         "write it as a positive integer (e.g. 128)")
    if "do_lower_case" in out and type(out["do_lower_case"]) is not bool:
        raise ValueError(f"{path}: do_lower_case is {out['do_lower_case']!r}, not true or false: write it as a JSON "
                         "boolean")
    tok = transformer / "tokenizer_config.json"
    if "max_seq_length" not in out and tok.is_file():
        settings = json_file(tok)
        length = settings.get("model_max_length") if isinstance(settings, dict) else None
        if isinstance(length, int) and 0 < length < 10**9:  # transformers' "no limit" is a huge number
            positions = config_json(transformer).get("max_position_embeddings")
            out["max_seq_length"] = min(length, positions) if isinstance(positions, int) and positions > 0 else length
    return out


def text_layout(tok, hf_ids: list[int]) -> dict[str, list[int]]:
    """What the source tokenizer puts around a text (transformers' `tok(text)` against the text's
    own pieces), in mmadapt's ids: Llama's and Mistral's `<s>` before it, nothing for Qwen2, BERT's
    [CLS] and [SEP] around it. A language model reads a text laid out so (predict, run_text_layout)."""
    bare = tok("a", add_special_tokens=False).input_ids
    full = tok("a").input_ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if at is None:  # a template that changes the text's own pieces: nothing recorded, mmadapt's layout kept
        return {}
    mine = inverse_permutation(hf_ids)
    return {"prefix": [int(mine[i]) for i in full[:at]], "suffix": [int(mine[i]) for i in full[at + len(bare):]]}


def hf_permutation(vocab_size: int, specials: list[int]) -> list[int]:
    """mmadapt id -> source id: the special roles first (tokens.py's ids), then every other row
    in the source's order."""
    taken = set(specials)
    return specials + [i for i in range(vocab_size) if i not in taken]


def _check_tokenizer_kind(family: ModelFamily, tok, where: Path) -> None:
    """A tokenizer whose kind (tokenizer.kind: its `tokenizers` model) the family takes."""
    kind = tokenizer_kind(tok.backend_tokenizer.to_str())
    if kind not in family.tokenizer_kinds:
        raise ValueError(f"{where}: its tokenizer is a {kind} tokenizer; the {family.name} family takes "
                         f"{', '.join(family.tokenizer_kinds)} tokenizers")


class ReadTracker(dict):
    """A state dict that records which of its tensors were read (by [] or get): what a mapping's
    from_hf consumed, so that a tensor it left out is refused rather than dropped."""

    def __init__(self, state: dict):
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, name: str):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default=None):
        if name in self:
            self.read.add(name)
        return super().get(name, default)


def imported_state(family: ModelFamily, cfg: ModelConfig, hf_state: dict, hf_ids: list[int], hf_cfg: dict,
                   where: Path) -> tuple[ModelConfig, dict, str | None]:
    """The checkpoint validator, around the family's mapping: the config of the model
    transformers builds from these files (`as_loaded`), every tensor it implies present with
    its shape (`implied`, naming the config field that disagrees), the mapping's weights, every
    tensor of the files consumed by it or one transformers ignores too (`ignored`), and the
    result in the family's names and shapes. -> (config, state, what the import says of it)."""
    mapping = family.hf
    tracked = ReadTracker(hf_state)
    cfg, loaded = mapping.as_loaded(cfg, tracked, hf_cfg)
    _check_implied(mapping.implied(cfg, hf_state, hf_cfg), hf_state, where)
    try:
        state = mapping.from_hf(cfg, tracked, hf_ids, hf_cfg)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except (RuntimeError, IndexError) as e:  # a shape the mapping did not expect (an undeclared `implied`)
        raise ValueError(f"{where}: its weights do not have the shapes config.json implies "
                         f"({(str(e).splitlines() or [''])[0][:200]})") from None
    unread = sorted(n for n in hf_state if n not in tracked.read and not any(re.search(p, n) for p in mapping.ignored))
    if unread:
        more = f" (and {len(unread) - 1} more tensor{'s' if len(unread) > 2 else ''})" if len(unread) > 1 else ""
        why = mapping.unused_note(unread[0], cfg, hf_cfg) or (
            "transformers would leave it out with a warning; import-hf imports a checkpoint whole or not at all")
        raise ValueError(f"{where}: its weights hold {unread[0]}{more}, which the model config.json describes has "
                         f"no place for: {why}")
    _check_shapes(family, cfg, state, where, mapping.is_headless(hf_cfg))
    return cfg, state, loaded


def _check_implied(implied: dict[str, Implied], hf_state: dict, where: Path) -> None:
    for name, (dims, by) in implied.items():
        want = tuple(n for n, _ in dims)
        if name not in hf_state:
            raise ValueError(f"{where}: the weights lack {name}, which config.json implies"
                             + (f" ({by})" if by else ""))
        got = tuple(hf_state[name].shape)
        if got != want:
            bad = ([(d, why) for d, ((n, why), g) in enumerate(zip(dims, got), 1) if n != g]
                if len(got) == len(want) else list(enumerate((why for _, why in dims), 1)))
            raise ValueError(f"{where}: {name} has shape {got}, but config.json implies {want} ("
                             + "; ".join(f"dimension {d}: {why}" for d, why in bad) + "): the config is not this "
                             "checkpoint's; fix it, or download the checkpoint again")


# The text the parity check (check_parity) runs through both models.
PARITY_TEXT = "In the beginning God created the heaven and the earth."


def check_parity(family: ModelFamily, cfg: ModelConfig, state: dict, tok, hf_ids: list[int], where: Path,
                 hf_cfg: dict) -> None:
    """The imported model's first layer, with its head, against the model transformers loads
    from the same files with one layer (`num_hidden_layers` 1: so "imported" means "the same
    model"), on PARITY_TEXT, in fp32 on the CPU: a few milliseconds of a tiny model, of a large
    one its embeddings and one layer. A body without a head (HFMapping.headless) is compared by
    its hidden states and pooler output. Refused in one line where they differ."""
    import transformers

    cls = getattr(transformers, hf_cfg["architectures"][0], None)
    if cls is None:  # a family's own architecture that transformers does not define
        return
    one = {"num_hidden_layers": 1}
    if isinstance(hf_cfg.get("layer_types"), list):
        one["layer_types"] = hf_cfg["layer_types"][:1]
    if hf_cfg.get("chunk_size_feed_forward"):
        # the feed-forward's positions in chunks, the same math; the reference refuses a text
        # whose length the chunk size does not divide (3: most texts)
        one["chunk_size_feed_forward"] = 0
    ids = tok(PARITY_TEXT).input_ids[:cfg.max_position_embeddings]
    headless = family.hf.is_headless(hf_cfg)
    with _quiet_transformers():
        try:
            ref_model = cls.from_pretrained(str(where), local_files_only=True, dtype=torch.float32, **one).eval()
            with torch.no_grad():
                out = ref_model(input_ids=torch.tensor([ids]))
        except Exception as e:  # transformers raises many kinds here; the user needs one line
            # its last line: a message that starts with a module's repr ("BertLayer(") ends with the cause
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
            raise ValueError(f"{where}: transformers cannot load it ({type(e).__name__}: "
                             f"{lines[-1][:200]})") from None
    inverse = inverse_permutation(hf_ids)
    one_layer = dataclasses.replace(family.one_head(cfg, 1), hidden_dropout=0.0, attention_dropout=0.0)
    with torch.no_grad():
        if headless:
            got, ref = (_body_outputs(family, one_layer, state, inverse[torch.tensor([ids])]),
                [out.last_hidden_state[0].float()] + ([out.pooler_output[0].float()] if cfg.add_pooling_layer else []))
        else:
            model = family.build_lm(one_layer)
            model.load_state_dict(family.keep_layers(state, 1))
            got = [model.eval().logits(inverse[torch.tensor([ids])])[0][0, :, :len(hf_ids)].float()]
            ref = [out.logits[0].float()[:, torch.tensor(hf_ids)]]
    diff = max((g - r).abs().max().item() for g, r in zip(got, ref))
    scale = max(r.abs().max().item() for r in ref)
    if not diff <= PARITY_TOL * max(1.0, scale):
        what = "hidden states" if headless else "logits"
        raise ValueError(f"{where}: the imported model is not the one transformers loads from these files (its first "
                         f"layer's {what} differ by up to {diff:.3g} on a short text, of {what} up to {scale:.3g}): "
                         "mmadapt cannot compute this checkpoint exactly")


def _body_outputs(family: ModelFamily, cfg: ModelConfig, state: dict, ids: torch.Tensor) -> list[torch.Tensor]:
    """A headless import's one-layer body on `ids` [1, s] (mmadapt's ids): its hidden states
    [s, h], and its pooler's output [h] where it has one. The LM is built for its body and
    pooler; its head keeps its fresh weights and is not read."""
    model = family.build_lm(cfg)
    model.load_state_dict({**model.state_dict(), **family.keep_layers(state, 1)})
    hidden = model.eval().encode(ids, (1,))[0]
    return [hidden[0].float()] + ([model.pooler(hidden)[0].float()] if cfg.add_pooling_layer else [])


# Relative tolerance of check_parity: fp32 on the CPU, the same weights, other kernels.
PARITY_TOL = 1e-4


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report (the later layers' tensors it leaves out) and progress bars off,
    then both as they were: transformers' own switch and huggingface_hub's, which transformers'
    enable_progress_bar also turns on (the hub's, off by mmadapt/quiet.py's environment variable,
    stays off)."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_off = hub_utils.are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()  # (turns the hub's on too)
        if hub_off:
            hub_utils.disable_progress_bars()
        else:
            hub_utils.enable_progress_bars()


def _check_shapes(family: ModelFamily, cfg: ModelConfig, state: dict, where: Path, headless: bool = False) -> None:
    """Every parameter of the family's LM in `state` with its shape (a headless body: all but the heads)."""
    for n, shape in family.param_names(cfg).items():
        if headless and n.startswith(family.heads_prefix):
            continue
        if n not in state or tuple(state[n].shape) != shape:
            got = tuple(state[n].shape) if n in state else "nothing"
            raise ValueError(f"{where}: mmadapt's {n} needs shape {shape}, the weights give {got}")


# --- export ------------------------------------------------------------------------------------------

def spm_to_hf(spm_path: Path, model_max_length: int, layout: dict):
    """An mmadapt SentencePiece model (unigram, special ids of tokens.py) as a transformers fast
    tokenizer with the same ids, laid out as `layout` says (a family mapping's tokenizer_layout:
    the encoder's is <s> text </s> for one text, <s> a </s></s> b </s> for a pair, as features.py
    encodes them)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    proto = sp_proto(spm_path)
    check_exportable(spm_path, proto)
    # byte fallback (PreprocessConfig.byte_fallback): a character outside the pieces is its UTF-8
    # bytes' pieces (<0xE4>), as SentencePiece encodes it, and decodes back to it
    fallback = proto.trainer_spec.byte_fallback
    tok = Tokenizer(Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=proto.trainer_spec.unk_id,
                            byte_fallback=fallback))
    if proto.normalizer_spec.precompiled_charsmap:
        tok.normalizer = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
        if "nfkc" in proto.normalizer_spec.name:  # nmt_nfkc (mmadapt's), nfkc, and their case-folding kinds
            # NFKC first: tokenizers' Precompiled composes a letter's first combining mark and drops the next
            # (decomposed Vietnamese 'ệ', e + U+0323 + U+0302, read as 'ẹ'), where SentencePiece composes them
            # all; on NFKC text the map gives what it gives SentencePiece
            tok.normalizer = normalizers.Sequence([normalizers.NFKC(), tok.normalizer])
    # SentencePiece drops extra spaces (remove_extra_whitespaces: after its normalizer has made a
    # tab or newline one) and marks each word's start with '▁'. Split on ' ' alone: WhitespaceSplit
    # also splits on what the normalizer keeps and SentencePiece reads as a character (U+0085).
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed"),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    if fallback:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), tok.decoder])
        text_pieces = [p.piece for p in proto.pieces if p.type in (1, 4)]  # normal and user-defined
        # A character no piece holds is its bytes' pieces, each spanning that character: tokenizers reads
        # a run of them as one unknown token and gives each byte piece the whole run's offsets (a QA
        # pipeline's answer cut from them widened to the run). Each alone, as SentencePiece's lattice
        # holds it (no piece crosses it): the same ids.
        known = "".join(sorted({c for p in text_pieces for c in p} | {"▁", " "}))
        cuts = [pre_tokenizers.Split(Regex("[^" + re.sub(r"([\\\]\[^&-])", r"\\\1", known) + "]"),
                                     behavior="isolated")]
        if (cut := _byte_name_cut(text_pieces)) is not None:
            cuts.append(pre_tokenizers.Split(Regex(cut), behavior="merged_with_previous"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([tok.pre_tokenizer, *cuts])
    # control pieces (<pad>, <s>, </s>, <mask>; <mask> user-defined in tokenizers trained before
    # 2026-12-04) are whole tokens, never split
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in proto.pieces
                            if p.type in (3, 4)])
    roles = {role: proto.pieces[i].piece for i, role in enumerate(SPECIAL_ROLES)}
    return _fast_tokenizer(tok, layout, roles, model_max_length)


def check_exportable(spm_path: Path, proto=None) -> None:
    """Refuse a SentencePiece model (`proto`: its parse, if read already) that spm_to_hf's
    pipeline would not read as SentencePiece does (tokenizer.unexportable)."""
    unread = unexportable(proto or sp_proto(spm_path))
    if unread:
        raise ValueError(f"{spm_path} was trained with {', '.join(unread)}, which the exported tokenizer would not "
                         "read as SentencePiece does (other ids than the model trained on): prepare the target data "
                         "with a tokenizer mmadapt trains (mmadapt preprocess without --tokenizer)")


# Where a byte piece's name in text ('<0x41>') is cut so that it reads as the text it is: each
# place in the name, the pieces that would cross it, and the Split pattern ending at it.
_BYTE_NAME_CUTS = ((r"<0", r"<(?=0x[0-9A-F]{2}>)"), (r"0x", r"<0(?=x[0-9A-F]{2}>)"),
                   (r"x[0-9A-F]", r"<0x(?=[0-9A-F]{2}>)"), (r"[0-9A-F]{2}", r"<0x[0-9A-F](?=[0-9A-F]>)"),
                   (r"[0-9A-F]>", r"<0x[0-9A-F]{2}(?=>)"))


def _byte_name_cut(pieces: list[str]) -> str | None:
    """The Split pattern that keeps a byte-fallback Unigram from matching a byte piece's name in
    text, given the vocabulary's text `pieces` (normal and user-defined): SentencePiece never
    matches a byte piece, tokenizers' Unigram matches every entry, and a byte piece's score (0)
    beats any path of pieces ('<0x41>' read as 'A'). The cut falls where no piece crosses it, so
    SentencePiece's best segmentation splits there too and both sides segment alike; None where
    some piece crosses every place."""
    for crossing, pattern in _BYTE_NAME_CUTS:
        if not any(re.search(crossing, p) for p in pieces):
            return pattern
    return None


def _fast_tokenizer(tok, layout: dict, roles: dict[str, str], model_max_length: int):
    """`tok` (a tokenizers.Tokenizer holding every token of `roles`: mmadapt role -> token) with
    `layout`'s template, as a transformers fast tokenizer whose bos/eos/unk/pad/... tokens are
    the layout's roles."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    def pieces(template: str) -> list[str]:  # a list, not one string: a token may hold a space
        # "{eos}:1": the role's token with type id 1 (BERT's second segment)
        return [roles[p[1:p.index("}")]] + p[p.index("}") + 1:] if p.startswith("{") else p for p in template.split()]
    used = {p[1:p.index("}")] for t in (layout["single"], layout["pair"]) for p in t.split() if p.startswith("{")}
    tok.post_processor = processors.TemplateProcessing(
        single=pieces(layout["single"]), pair=pieces(layout["pair"]),
        special_tokens=[(roles[r], tok.token_to_id(roles[r])) for r in sorted(used, key=SPECIAL_ROLES.index)])
    extra = {"model_input_names": layout["model_input_names"]} if "model_input_names" in layout else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   padding_side=layout.get("padding_side", "right"), **extra,
                                   **{attr: roles[role] for attr, role in layout["tokens"].items()})


def retemplated(hf_tok, hf_ids: list[int], layout: dict, model_max_length: int):
    """An imported tokenizer (`hf_tok`, with the run's `hf_ids`) laid out as `layout` over the
    source tokens of mmadapt's roles. A role whose row lies past the tokenizer (an embedding row
    the import borrowed for it) gets a special token `<|mmadapt_ROLE|>` there: the import took
    those rows in order from the tokenizer's size up, so adding the tokens in that order gives
    them exactly those ids. A role the import gave an ordinary token that text produces (a
    byte-level tokenizer's byte "À", models/llama/hf.py special_ids) is no special token of the
    result, but for pad, which padding needs: transformers matches special tokens in raw text,
    and every "À" would have read as the unk row."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    roles = {}
    for role, h in sorted(zip(SPECIAL_ROLES, hf_ids), key=lambda rh: rh[1]):
        token = tok.id_to_token(h)
        if token is None:
            token = f"<|mmadapt_{role}|>"
            tok.add_special_tokens([AddedToken(token, normalized=False, special=True)])
            if tok.token_to_id(token) != h:
                raise ValueError(f"the tokenizer cannot give the {role} row {h} a token: it would get id "
                                 f"{tok.token_to_id(token)}")
        roles[role] = token
    added = {t.content for t in tok.get_added_tokens_decoder().values()}  # the source's, and <|mmadapt_ROLE|>
    tokens = {attr: role for attr, role in layout["tokens"].items() if role == "pad" or roles[role] in added}
    return _fast_tokenizer(tok, {**layout, "tokens": tokens}, roles, model_max_length)


def export_hf(output_dir: str | os.PathLike, primary: str | os.PathLike | None = None,
              finetuned: str | os.PathLike | None = None, embeddings: str | os.PathLike | None = None,
              primary_tag: str | None = None, graft: bool = False) -> dict:
    """Write a transformers directory: the primary model of `primary` (a pretrain or imported
    run; the family's LM) or the Step-3 model of `finetuned` (its task's class), with the Step-2
    artifact `embeddings` swapped in when given (its vocabulary-indexed tensors and tokenizer).
    graft: `embeddings` were trained over a base model of which `primary` is a fine-tuned
    sibling (graft.py: checked, and the distance reported). Every check comes before anything is
    written. -> a summary {architecture, vocab_size, ...}."""
    if (primary is None) == (finetuned is None):
        raise ValueError("pass one of --primary (a pretrain run: its LM) and --finetuned (a fine-tuning run: "
                         "its task model)")
    if graft and embeddings is None:
        raise nothing_to_graft()
    if finetuned is not None and primary_tag is not None:
        raise ValueError("--primary_tag picks a checkpoint of --primary; a fine-tuned model is its final checkpoint: "
                         "drop --primary_tag")
    output_dir = Path(output_dir)
    _fresh_output(output_dir)
    labels, task_start, max_length = None, (BOS_ID,), None
    if finetuned is not None:
        ft = load_finetuned(finetuned)
        task_start = ft.framing.start  # the rows it was fine-tuned on start so
        # and hold at most seq_length pieces: a pipeline's truncation=True cuts there, not at the
        # positions (a roberta-base fine-tuned at 128 pieces read 512 of a long text)
        max_length = ft.run["finetune"]["seq_length"]
        family, cfg, state, kind, labels, tokenizer = ft.family, ft.cfg, ft.state, ft.task.kind, ft.labels, ft.tokenizer
        primary_run = Path(ft.run["primary"]["run_dir"])
    else:
        if primary_tag is None and embeddings is not None and not graft:
            # the checkpoint the embeddings were trained for (predict's and evaluate's rule), not the newest
            primary_tag = trained_for(Path(primary), [read_json(artifact_dir(embeddings) / "meta.json",
                                                                "Step-2 artifact file")])
        source = read_source(primary, primary_tag)
        primary_run, family = source.path, source.family
        if source.record.get("step") == "adapt":
            raise ValueError(f"{primary_run} is a Step-2 run: export its artifact with --embeddings and "
                             "the primary model with --primary")
        require_head(source, "export-hf --primary")
        weights = source.weights()
        cfg, state = family.primary_model(source.cfg, weights)
        kind, tokenizer = None, source.tokenizer
    if embeddings is not None:
        emb, tokenizer, meta = read_artifact(embeddings)
        if emb["word_embeddings"].shape[1] != cfg.hidden_size:
            raise ValueError(f"{embeddings} holds embeddings of hidden size {emb['word_embeddings'].shape[1]}, the "
                             f"model {cfg.hidden_size}: they were trained for another model")
        owner = artifact_primary(meta).resolve()
        # by path, or by content (a byte-identical copy of the run, as predict and evaluate match it)
        grafted = owner != primary_run.resolve() and not (
            same_primary(meta, recorded=ft.run["primary"].get("fingerprint")) if finetuned is not None
            else same_primary(meta, weights=weights))
        if grafted and not graft and Path(meta.get("source", owner)).resolve() == primary_run.resolve():
            # --primary the mini-model Step 2 trained over: the export is the primary model's
            raise ValueError(f"{embeddings} was trained over {primary_run}, a mini-model of the primary model "
                             f"{owner}: export the embeddings with the model they serve, --primary {owner}")
        if grafted and not graft:
            raise ValueError(f"{embeddings} holds embeddings for the primary model {owner}, not {primary_run}: if it is "
                             "a model fine-tuned from that one (the same architecture and vocabulary; an imported "
                             "classifier), pass --graft")
        if graft and not grafted:
            raise not_a_graft(embeddings, primary_run)
        if grafted:
            sibling = source if finetuned is None else read_source(primary_run)
            for line in check_siblings(read_base(owner, meta), sibling, meta, weights if finetuned is None else None,
                                       body_only=finetuned is not None).lines():
                print(line)
        elif finetuned is not None:  # the primary's weights as Step 3 recorded them
            check_primary_unchanged(Path(embeddings), meta, recorded=ft.run["primary"].get("fingerprint"))
        else:
            check_primary_unchanged(Path(embeddings), meta, weights=weights)
        # A task model has no output head: only the word embeddings are swapped into it.
        # (an expanded vocabulary's keep the model's own source rows: artifact.artifact_state)
        swap = artifact_state(family, emb if kind is None else {"word_embeddings": emb["word_embeddings"]}, meta, state)
        state = {**state, **{name: t.to(state[name].dtype) for name, t in swap.items()}}
        cfg = ModelConfig(**{**to_dict(cfg), "vocab_size": emb["word_embeddings"].shape[0]})

    if not is_hf(Path(tokenizer)):  # before anything is written (write_hf exports it)
        check_exportable(Path(tokenizer))
    imported = json.loads((primary_run / "run.json").read_text()).get("imported_from")
    model_type = imported["model_type"] if imported else None
    text_layout, dtype = (imported or {}).get("text_layout"), (imported or {}).get("dtype")
    # Staged whole: a sentence-transformers export is two directories and their module files,
    # and a copy cut short would load as a plain transformer (and refuse the rerun as not empty)
    with staged_dir(output_dir) as top:
        summary = {**write_hf(family, top, cfg, state, kind, labels, Path(tokenizer), model_type, text_layout,
                              primary_run / "tokenizer" / "hf", task_start, dtype, max_length),
                   "output_dir": str(output_dir), "embeddings": str(embeddings) if embeddings else None}
        if kind is None and (primary_run / SENTENCE_TRANSFORMERS).is_dir():  # a sentence-transformers source
            write_sentence_transformers(family, top / SENTENCE_TRANSFORMERS, cfg, state, Path(tokenizer), model_type,
                                        primary_run / SENTENCE_TRANSFORMERS, dtype)
            summary["sentence_transformers"] = str(output_dir / SENTENCE_TRANSFORMERS)
    return summary


def _document_tokenizer(doc: HFTokenizer, model_max_length: int, source_hf: Path | None = None):
    """A transformers fast tokenizer of an imported tokenizer's `tokenizers` pipeline alone (its
    post-processor, the source's prompt layout, included), its bos/eos/unk/pad tokens those of
    mmadapt's roles that are tokens of it (a role on a borrowed row past the tokenizer has none).
    With the source's own tokenizer files (`source_hf`, import_hf's copy), what they say of how
    it is used instead: its own special tokens (none for a role it has none for; a masked LM's
    fill-mask needs its mask token), its padding side (a decoder padded on the left for batched
    generation) and chat template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = doc.source_tokenizer()  # the document's pipeline, not the one mmadapt reads text with
    tokens = {f"{role}_token": doc.token(h) for role, h in zip(SPECIAL_ROLES, doc.hf_ids)
              if role != "mask"}
    kwargs = {k: v for k, v in tokens.items() if v is not None}
    if source_hf is not None and source_hf.is_dir():
        src = AutoTokenizer.from_pretrained(str(source_hf), local_files_only=True)
        # its model_input_names too: PreTrainedTokenizerFast's own leave token_type_ids out, and a
        # BERT given none reads a pair's second segment as type 0
        kwargs.update(padding_side=src.padding_side, truncation_side=src.truncation_side,
                      model_input_names=list(src.model_input_names))
        if getattr(src, "chat_template", None):
            kwargs["chat_template"] = src.chat_template
        # its own tokens for each role, none where it has none: a Qwen2 has no bos, where mmadapt's
        # <s> borrowed a row, and a graft into an instruct sibling ends a turn with its own eos
        for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token", "sep_token"):
            token = getattr(src, name, None)
            if token is not None and source.token_to_id(str(token)) is not None:
                kwargs[name] = str(token)
            elif token is None:
                kwargs.pop(name, None)
    return PreTrainedTokenizerFast(tokenizer_object=source, model_max_length=model_max_length, **kwargs)


def export_tokenizer(mapping: HFMapping, tokenizer: Path, kind: str | None, cfg: ModelConfig,
                     text_layout: dict | None = None, source_hf: Path | None = None,
                     task_start: tuple[int, ...] = (BOS_ID,)):
    """The transformers tokenizer that gives a run's `tokenizer` ids to the exported model, laid out
    as the family's mapping says for `kind` (and an imported source's `text_layout`), and hf_ids
    (mmadapt id -> its id; None: the same ids). An imported tokenizer keeps the source's ids (the
    rows go back to the source's order); an expanded one takes the source's settings from
    `source_hf` (_document_tokenizer). task_start: what a task model's rows start with
    (features.Framing.start, its Step-3 record's)."""
    import transformers

    layout = mapping.tokenizer_layout(kind, is_hf(tokenizer), cfg, text_layout, task_start)
    if not is_hf(tokenizer):
        return spm_to_hf(tokenizer, cfg.max_position_embeddings, layout), None
    hf_ids = HFTokenizer.read(tokenizer).hf_ids.tolist()
    if (tokenizer.parent / "hf").is_dir():  # the source's own files, saved by import_hf
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer.parent / "hf"), local_files_only=True)
    else:  # an expanded vocabulary's merged document (expand.py): its pipeline is the whole tokenizer
        hf_tok = _document_tokenizer(HFTokenizer.read(tokenizer), cfg.max_position_embeddings, source_hf)
    if layout is not None:
        hf_tok = retemplated(hf_tok, hf_ids, layout, cfg.max_position_embeddings)
    if kind == "tag":
        _words_after_a_space(hf_tok)
    return hf_tok, hf_ids


def _words_after_a_space(hf_tok) -> None:
    """A byte-level BPE tagger's tokenizer (RoBERTa's) reading every word as it stands after a
    space ('ĠIn'), a text's first word too, as Step 3 and Step 4 read a tagged sentence
    (features.word_pieces): transformers' add_prefix_space, which its token classification needs
    for pre-split words; without it the first word of every text read as 'In', another piece."""
    from tokenizers import pre_tokenizers, processors

    pre, post = hf_tok.backend_tokenizer.pre_tokenizer, hf_tok.backend_tokenizer.post_processor
    if isinstance(pre, pre_tokenizers.ByteLevel):  # (SentencePiece's Metaspace and WordPiece start words alike)
        pre.add_prefix_space = True
        if isinstance(post, (processors.RobertaProcessing, processors.ByteLevel)):  # its offsets' trim agrees:
            post.add_prefix_space = True  # tokenizer.json read alone gave the first word an empty span
        hf_tok.add_prefix_space = True
        hf_tok.init_kwargs["add_prefix_space"] = True  # saved: a class that builds its own pipeline reads it


def write_generation_config(output_dir: Path, source_hf: Path | None, ids: dict, same_ids: bool,
                            generates: bool = True) -> None:
    """The imported source's own generation settings (its generation_config.json, kept by
    import_hf beside its tokenizer) into an exported LM's `output_dir`, over the one transformers
    rebuilds from config.json (one eos, greedy): an instruct model's stop tokens (Qwen2-Instruct's
    eos list, Llama-3-Instruct's <|eot_id|>, which its tokenizer does not name) and sampling
    settings. Where the export reads another vocabulary (same_ids false: a replaced one), its
    special ids are the new tokenizer's `ids` (pad, bos, eos) and the settings that name other
    pieces by id are left out. Written as the source's file is, not through GenerationConfig:
    transformers refuses to save an edited config with flags it calls unused (a temperature
    without do_sample, as some chat models ship), which it loads with a warning. Nothing where the
    source had no settings of its own but config.json's ids, where the export's config.json names
    the same eos, or its file is no JSON object."""
    source = None if source_hf is None else Path(source_hf) / GENERATION_CONFIG
    if source is None or not source.is_file():
        return
    try:
        settings = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        settings = None
    if not isinstance(settings, dict):
        print(f"export-hf: {GENERATION_CONFIG} of the source is no JSON object: not kept", flush=True)
        return
    if settings.get("_from_model_config"):  # transformers' copy of config.json's ids (or import_hf's)
        if not (generates and same_ids) or settings.get("eos_token_id") in (None, ids["eos"]):
            return  # the export's config.json gives them (an encoder: generates nothing)
        # config.json's stop tokens the export's config.json (the tokenizer's one eos) does not name
        settings = {k: v for k, v in settings.items() if k != "_from_model_config"}
    if not same_ids:
        settings = {k: v for k, v in settings.items() if k not in PIECE_ID_SETTINGS}
        settings.update(pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"])
    (Path(output_dir) / GENERATION_CONFIG).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def write_hf(family: ModelFamily, output_dir: Path, cfg: ModelConfig, state: dict, kind: str | None,
             labels: list[str] | None, tokenizer: Path, model_type: str | None = None,
             text_layout: dict | None = None, source_hf: Path | None = None,
             task_start: tuple[int, ...] = (BOS_ID,), dtype: str | None = None,
             max_length: int | None = None) -> dict:
    """Write the family's LM (kind None) or task model full weights `state` with a run's
    `tokenizer` as a transformers directory of `model_type`'s class for `kind` (the source's
    model type, None for a model mmadapt pretrained: the family's mapping decides,
    export_model_type), in `dtype` (an imported source's half precision, HALF_DTYPES; None: fp32).
    max_length: the pieces a row holds, the tokenizer's model_max_length (a task model's Step-3
    seq_length, to which `truncation=True` then cuts as Step 3 and Step 4 do; None: the model's
    positions)."""
    import transformers

    if family.hf is None:
        raise ValueError(f"the {family.name} family has no Hugging Face mapping yet")
    mapping = family.hf
    model_type = mapping.export_model_type(model_type, cfg, own_tokenizer=is_hf(tokenizer))
    output_dir = Path(output_dir)
    _fresh_output(output_dir)
    hf_tok, hf_ids = export_tokenizer(mapping, Path(tokenizer), kind, cfg, text_layout, source_hf, task_start)
    if max_length is not None:
        hf_tok.model_max_length = max_length
    ids = {"pad": hf_tok.pad_token_id, "bos": hf_tok.bos_token_id, "eos": hf_tok.eos_token_id}
    hf_state = mapping.to_hf(cfg, state, kind, hf_ids, ids, model_type)
    hf_cfg = mapping.hf_config(cfg, kind, labels, ids, model_type)
    arch = hf_cfg.architectures[0]
    model = getattr(transformers, arch)(hf_cfg, **mapping.model_kwargs(cfg, kind))
    model.load_state_dict(hf_state, strict=True)
    if dtype is not None:  # as the source was: a bf16 model exported in fp32 doubles its size
        model.to(getattr(torch, dtype))
    with staged_dir(output_dir) as tmp:
        model.save_pretrained(str(tmp))
        if kind is None:
            write_generation_config(tmp, source_hf, ids, same_ids=is_hf(tokenizer),
                                    generates=not family.objective.masked)
        hf_tok.save_pretrained(str(tmp))
    return {"architecture": arch, "vocab_size": cfg.vocab_size, "labels": labels, "output_dir": str(output_dir)}
