"""A Hugging Face sequence classifier (BertForSequenceClassification, RobertaForSequenceClassification,
XLMRobertaForSequenceClassification, CamembertForSequenceClassification) fine-tuned outside mmadapt, as a Step-3 run.

People serve task models fine-tuned from a base encoder with transformers, every weight trained.
`mmadapt import-hf --model <classifier> --task <task>` writes one as the fine-tuning run Step 4
reads (evaluate --finetuned, export-hf --finetuned, predict):

    <output_dir>/run.json        step "finetune": the task, its labels in the classifier's
                                 output order (config.json id2label), the model, `imported_from`
    <output_dir>/checkpoints/    the task model's weights but the word embeddings (as Step 3 keeps
                                 them: its embeddings are its primary model's)
    <output_dir>/body/           the classifier's encoder (its base model) imported as a headless
                                 Step-1 run (import_hf): the run's primary model, with its own,
                                 fine-tuned word embeddings and tokenizer

Its word embeddings moved in fine-tuning, so Step-2 embeddings trained over the base encoder it
came from are grafted into it (`--graft`, graft.check_siblings: the body is the sibling) rather
than swapped in as Step 4 swaps them into a run of mmadapt's Step 3. The import is checked before
anything is written: mmadapt's task model gives the classifier's logits on text read by its own
tokenizer (IMPORT_TOL).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch

from mmadapt.checkpoint import staged_dir, write_weights_only
from mmadapt.config import FinetuneConfig, to_dict
from mmadapt.models import FAMILIES
from mmadapt.run import read_source, sampled_fingerprint, weights_fingerprint
from mmadapt.tasks import TASKS, get_task
from mmadapt.tokenizer import HFTokenizer

CLASSIFIER_SUFFIX = "ForSequenceClassification"
BODY = "body"  # the classifier's encoder, imported as the run's primary model
IMPORT_TOL = 1e-4  # fp32 logits of mmadapt's task model against the classifier's, on the check's texts
CHECK_TEXTS = ("In the beginning God created the heaven and the earth.", "Jesus wept.")


def is_classifier(model_dir: Path) -> bool:
    """Whether config.json names a sequence classifier."""
    from mmadapt.hf import config_json

    try:
        archs = config_json(model_dir).get("architectures") or []
    except (OSError, ValueError):  # no config, or none that is a JSON object: hf.read_hf_config refuses it
        return False
    return isinstance(archs, list) and bool(archs) and str(archs[0]).endswith(CLASSIFIER_SUFFIX)


def _num_labels(hf_cfg: dict) -> int:
    """The classifier's outputs: its id2label's size (config.json holds that, not num_labels)."""
    return len(hf_cfg.get("id2label") or {}) or int(hf_cfg.get("num_labels", 2))


def classifier_labels(hf_cfg: dict, model_dir: Path, task_name: str) -> list[str]:
    """The classifier's labels in its output order (id2label), checked against `task_name`'s."""
    task = get_task(task_name)
    if task.kind != "classify":
        names = ", ".join(n for n, t in TASKS.items() if t.kind == "classify")
        raise ValueError(f"{model_dir} is a sequence classifier: --task must be a classification task ({names}), "
                         f"not {task_name} ({task.kind})")
    id2label = hf_cfg.get("id2label") or {}
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(_num_labels(hf_cfg))]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{model_dir}: config.json's id2label names one label twice ({labels}): name each output "
                         "once")
    if task.labels is not None and sorted(labels) != sorted(task.labels):
        raise ValueError(f"{model_dir}: its labels ({', '.join(labels)}) are not {task.name}'s "
                         f"({', '.join(task.labels)}): pass the task they belong to (--task classify or pair for "
                         "your own data; config.json's id2label names them)")
    return labels


def import_classifier(model_dir: str | os.PathLike, output_dir: str | os.PathLike, task_name: str | None) -> dict:
    """Write a Step-3 run directory (module docstring) from the sequence classifier in
    `model_dir`, for the task `task_name`. -> its run.json."""
    from transformers import AutoModelForSequenceClassification

    from mmadapt.finetune import primary_state
    from mmadapt.hf import _fresh_output, config_json, half_dtype, import_hf, read_hf_tokenizer, weight_names

    model_dir, output_dir = Path(model_dir).resolve(), Path(output_dir)
    hf_cfg = config_json(model_dir)
    arch = hf_cfg["architectures"][0]
    family = next((f for f in FAMILIES.values() if f.hf is not None and f.hf.task_head_names("classify")
                   and hf_cfg.get("model_type") in f.hf.architectures.values()), None)
    if family is None:
        raise ValueError(f"{model_dir} holds a {arch} (model_type {hf_cfg.get('model_type')}); import-hf --task takes "
                         "BertForSequenceClassification, RobertaForSequenceClassification, "
                         "XLMRobertaForSequenceClassification and CamembertForSequenceClassification")
    if _num_labels(hf_cfg) < 2 or hf_cfg.get("problem_type") not in (None, "single_label_classification"):
        raise ValueError(f"{model_dir} is a {hf_cfg.get('problem_type') or 'one-output'} model, not a classifier of "
                         "one label per text (problem_type single_label_classification, 2 labels or more): mmadapt's "
                         "tasks score one label per text")
    if task_name is None:
        raise ValueError(f"{model_dir} holds a {arch}: pass --task, the task whose labels it predicts (bible-genre, "
                         "xnli, pawsx, or classify / pair for your own data)")
    labels = classifier_labels(hf_cfg, model_dir, task_name)
    _fresh_output(output_dir)
    weight_names(model_dir)  # a missing or damaged weight file: one line, before transformers reads it
    # transformers builds a tokenizer of the 5 special tokens alone for a directory without
    # tokenizer files, and the logit check below would pass on it (both models read all [UNK])
    tok = read_hf_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as t:
        body_dir = Path(t) / BODY
        # fp32, as import_hf's parity check loads a model: a bf16 checkpoint compares in fp32
        try:
            hf, loading = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), dtype=torch.float32, local_files_only=True, output_loading_info=True)
        except Exception as e:  # transformers raises many kinds here; the user needs one line
            raise ValueError(f"{model_dir}: transformers cannot load it as a {arch} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        # A weight the files lack, transformers starts at random and says so only in its log: a
        # masked LM's checkpoint relabelled as a classifier would import with a random head
        lacking = sorted(loading["missing_keys"]) + sorted(k[0] if isinstance(k, tuple) else k
                                                           for k in loading["mismatched_keys"])
        if lacking:
            more = ", ..." if len(lacking) > 3 else ""
            raise ValueError(f"{model_dir}: its weights lack {', '.join(lacking[:3])}{more} (or hold another shape), "
                             f"which a {arch} holds: transformers would start them at random; import the "
                             "classifier's own fine-tuned checkpoint")
        hf = hf.eval()
        hf.base_model.save_pretrained(str(body_dir))  # the encoder alone: a class import_hf takes
        tok.save_pretrained(str(body_dir))
        with staged_dir(output_dir) as tmp:
            try:
                body_run = import_hf(body_dir, tmp / BODY)
            except ValueError as e:  # named the temporary directory the encoder was saved to, gone by then
                raise ValueError(str(e).replace(str(body_dir), f"{model_dir} (the encoder of its {arch})")) from None
            note = "; ".join(n for n in (f"the encoder of the {arch} in {model_dir}",
                                         body_run["imported_from"].get("note")) if n)
            body_run["imported_from"].update(model=str(model_dir), note=note)
            if (dtype := half_dtype(hf_cfg)) is not None:
                body_run["imported_from"]["dtype"] = dtype  # (the body was saved in fp32): its export's dtype
            (tmp / BODY / "run.json").write_text(json.dumps(body_run, indent=2))
            source = read_source(tmp / BODY)
            weights = source.weights()
            cfg, body_state = primary_state(source, weights)
            names = family.hf.task_head_names("classify")
            hf_state = hf.state_dict()
            # every tensor of the task model from the encoder or the head (strict: none left at its init)
            state = {**body_state, **{mine: hf_state[theirs].float() for mine, theirs in names.items()}}
            model = family.build_task_model(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0),
                                            "classify", len(labels)).eval()
            model.load_state_dict(state, strict=True)
            _check_logits(hf, model, tok, HFTokenizer.read(source.tokenizer).to_mmadapt, model_dir, arch)
            write_weights_only(tmp / "checkpoints", 0, {k: v for k, v in state.items() if k != family.word},
                               to_dict(cfg))
            # it reads what transformers reads (truncation=True): up to its tokenizer's limit, within
            # its positions; Step 3's default (128) cut longer texts that the classifier had read whole
            limit = tok.model_max_length if 0 < tok.model_max_length < 10**9 else cfg.max_position_embeddings
            ft = dataclasses.replace(FinetuneConfig(), seq_length=min(limit, cfg.max_position_embeddings))
            run = {"step": "finetune", "model": to_dict(cfg), "finetune": to_dict(ft), "task": task_name,
                   "labels": labels, "metric": get_task(task_name).metric, "updates": 0, "global_batch": 0,
                   "primary": {"run_dir": str(output_dir.resolve() / BODY), "tag": source.tag,
                               "fingerprint": weights_fingerprint(weights),
                               "sampled_fingerprint": sampled_fingerprint(weights)},
                   "imported_from": {"model": str(model_dir), "architecture": arch,
                                     "model_type": hf_cfg.get("model_type")},
                   "warnings": []}
            (tmp / "run.json").write_text(json.dumps(run, indent=2))
    return run


def _check_logits(hf, model, tok, to_mmadapt, model_dir: Path, arch: str) -> None:
    """mmadapt's task model `model` against the classifier `hf` on CHECK_TEXTS, as its own
    tokenizer `tok` frames them (their ids mapped to mmadapt's: `to_mmadapt`), within
    IMPORT_TOL; else refused before anything stays."""
    to_mmadapt = torch.as_tensor(to_mmadapt)
    for text in CHECK_TEXTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = hf(input_ids=ids).logits.float()
            mine = model(to_mmadapt[ids])[1].float()
        diff = (mine - theirs).abs().max().item()
        if diff > IMPORT_TOL:
            raise ValueError(f"{model_dir}: mmadapt's model of this {arch} gives other logits "
                             f"than transformers' (up to {diff:.2g} apart on {text!r}): it is not imported")
