"""Step 4: swap a target language's embeddings into a fine-tuned model and evaluate zero-shot
(`evaluate_artifacts`), beside the same model with no adaptation (`no_adaptation_record`: its
own tokenizer and embeddings on the target text); parallel-sentence retrieval through the
primary model (`retrieval_records`).

A Step-3 run is rebuilt (`load_finetuned`, with its model family) and its model built once per
run (seed), on the device in Step 4's precision (devices.eval_dtype). Its word embeddings (the
family's `word` parameter) are replaced by a Step-2 artifact's in place (devices.swapped, which puts its own back
afterwards) and the tokenizer by the artifact's, and a target-language evaluation set is scored.
Nothing else changes: the source-language model is exactly Step 3's. An evaluation set is encoded
once per tokenizer, laid out by the family's framing, and run in token-sized batches of rows of
similar length (`EvalBatches`), each trimmed to its longest row: the padding a fixed-length batch
would carry is never computed. Needs no process group.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from mmadapt import checkpoint
from mmadapt.artifact import (NO_ADAPTATION, PrimaryRef, artifact_dirs, artifact_embeddings, artifact_primary,
                              artifact_primary_ref, artifact_state, given_once, read_artifact, record_base,
                              run_label, run_names, swap_key)
from mmadapt.config import EvaluateConfig, FinetuneConfig, ModelConfig
from mmadapt.data import file_sha256
from mmadapt.engine import PLACEHOLDER
from mmadapt.family import ModelFamily
from mmadapt.features import Encoded, Framing, encode_classify, special_mask, unknown_share
from mmadapt.finetune import check_positions, has_results, is_finished, primary_state
from mmadapt.graft import check_once, grafted, not_a_graft
from mmadapt.hf_classifier import BODY
from mmadapt.models.layers import Padding
from mmadapt.devices import device_of, host_to_device, on_eval_device, progress, swapped
from mmadapt.parallel import device
from mmadapt.run import RUN_FILE, load_checkpoint, read_source, require_kind, run_model, run_text_layout
from mmadapt.tasks import (Task, chance_levels, check_one_file_per_language, encode, get_task, headline, percent,
                           read_examples, scores)
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.tokens import PAD_ID


# --- the fine-tuned model, rebuilt -----------------------------------------------------------------------

@dataclass
class Finetuned:
    """A Step-3 model, rebuilt: its family, config, task, label names, full weights, tokenizer, run.json."""
    family: ModelFamily
    cfg: ModelConfig
    task: Task
    labels: list[str]
    state: dict
    tokenizer: Path
    run: dict
    # The evaluation model, built by the first `model()` call: once per run (seed), however many
    # artifacts are then swapped into it.
    _model: torch.nn.Module | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def framing(self) -> Framing:
        """How its rows are laid out: as it was fine-tuned (ModelFamily.recorded_framing)."""
        return self.family.recorded_framing(self.run)

    def model(self, on: torch.device | None = None) -> torch.nn.Module:
        """The evaluation model (dropout off, TP=1: plain torch layers, no process group) with
        these weights, on `on` (default `parallel.device()`) in `devices.eval_dtype`: built on the
        first call and kept (predict's device="cpu" on a GPU machine: fp32 from the weights, not
        from their bf16 copy).
        Step 4 swaps artifacts into it (`swapped`, which puts these weights back afterwards), so
        it is for evaluation only."""
        if self._model is None:
            # vocab_size: the embeddings' own (a swapped state may hold a vocabulary of another size)
            cfg = dataclasses.replace(self.cfg, hidden_dropout=0.0, attention_dropout=0.0,
                                      vocab_size=self.state[self.family.word].shape[0])
            model = self.family.build_task_model(cfg, self.task.kind, len(self.labels), self.run["finetune"]["seed"])
            model.load_state_dict(self.state, strict=True)
            self._model = on_eval_device(model, on or device())
        return self._model


def finetuned_record(run_dir: str | os.PathLike) -> dict:
    """A finished Step-3 run's run.json (its task, labels, settings and primary model), refused in
    one line for any other directory: what Step 4 checks its inputs against before any weights
    are read."""
    run_dir = Path(run_dir)
    run_file = run_dir / RUN_FILE
    if not run_file.is_file():
        raise ValueError(f"{run_dir} is not a fine-tuning run (no run.json): pass the --output_dir of "
                         "launch/finetune.py")
    run = checkpoint.read_json(run_file, "run file")
    require_kind(run_dir, run, "finetune")
    if not is_finished(run_dir):
        raise ValueError(f"{run_dir} has not finished its {run['updates']} updates: continue it with "
                         "finetune --resume")
    return run


def load_finetuned(run_dir: str | os.PathLike, run: dict | None = None) -> Finetuned:
    """Step 3's model: the final checkpoint's trained weights (fp32) + the primary run's word
    embeddings. run: its finetuned_record, where the caller read it already."""
    run_dir = Path(run_dir)
    run = finetuned_record(run_dir) if run is None else run
    source = read_source(run["primary"]["run_dir"], run["primary"]["tag"])
    word = source.family.word
    _, primary = primary_state(source)
    tag = checkpoint.tag_for(run["updates"])
    own = {k: v for k, v in load_checkpoint(run_dir, tag).items() if not k.startswith(PLACEHOLDER)}
    cfg = dataclasses.replace(run_model(run, run_dir), tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return Finetuned(source.family, cfg, get_task(run["task"]), run["labels"], {word: primary[word], **own},
                     source.tokenizer, run)


# --- Step 4: the model on the device, artifacts swapped in place, token-sized batches ---------------

def row_lengths(input_ids: torch.Tensor) -> torch.Tensor:
    """[n, s] -> [n]: each row's length, up to and including its last piece that is not padding."""
    positions = torch.arange(1, input_ids.shape[1] + 1)
    return (input_ids.ne(PAD_ID) * positions).amax(1) if len(input_ids) else torch.zeros(0, dtype=torch.long)


# Per-position logits past a row's batch, once padded back to [n, s, C]: span logits at padding
# are -inf, as the encoder's span head gives them (never predicted); a tag at padding has no label and
# is never scored.
PAD_LOGIT = {"span": float("-inf"), "tag": 0.0}


@dataclass
class EvalBatches:
    """The rows of input_ids [n, s] grouped for evaluation: sorted by length, longest first, each
    batch trimmed to its longest row and holding at most `batch_tokens` ids (rows x that length;
    at least one row). The batches are views of one block copied to the device once, so an
    evaluation set pays one host-to-device copy for all the seeds and artifacts that score it.

    Trimming changes no result: padding is never attended to (a masked key, or causal attention
    on right-padded rows), so a row's
    outputs at its own positions do not depend on the padding after it. Each batch's Padding is
    counted here, on the host, so that no forward pass waits for the device to count it. Rows
    with token types (a family whose framing has them, features.Encoded) keep them beside their
    ids, trimmed and copied the same way."""
    ids: list[torch.Tensor]  # per batch [b_i, s_i], on the device
    rows: list[torch.Tensor]  # per batch [b_i]: each row's index in input_ids, on the device
    padding: list  # per batch, its model.Padding
    n: int
    seq_length: int
    token_types: list[torch.Tensor] | None = None  # per batch [b_i, s_i], on the device; None: none

    @classmethod
    def plan(cls, input_ids: torch.Tensor, batch_tokens: int, device: torch.device,
             token_types: torch.Tensor | None = None) -> "EvalBatches":
        lengths = row_lengths(input_ids)
        order = torch.sort(lengths, descending=True, stable=True).indices  # [n]
        groups, trimmed, types, start = [], [], [], 0  # groups: (rows, length) per batch
        while start < len(order):
            longest = max(int(lengths[order[start]]), 1)
            rows = order[start:start + max(1, batch_tokens // longest)]
            groups.append((len(rows), longest))
            trimmed.append(input_ids[rows, :longest].reshape(-1))
            if token_types is not None:
                types.append(token_types[rows, :longest].reshape(-1))
            start += len(rows)
        # One copy: the ids, then the order, then the token types.
        block = host_to_device(torch.cat([*trimmed, order, *types]), device)
        sizes = [b * s for b, s in groups]
        parts = block.split(sizes + [len(order)] + (sizes if types else []))
        ids = [p.view(b, s) for p, (b, s) in zip(parts, groups)]
        typed = [p.view(b, s) for p, (b, s) in zip(parts[len(groups) + 1:], groups)] if types else None
        padding = [Padding.of(t.view(b, s)) for t, (b, s) in zip(trimmed, groups)]  # host tensors: no wait
        return cls(ids, list(parts[len(groups)].split([b for b, _ in groups])), padding, len(input_ids),
                   input_ids.shape[1], typed)

    @torch.no_grad()
    def run(self, fn, per_position: bool, fill: float = 0.0) -> torch.Tensor:
        """fn(ids [b, s_i], its Padding[, token_types=[b, s_i]]) -> [b, ...], or per position
        [b, s_i, ...], over every batch -> fp32 on the CPU in input_ids' row order: [n, ...], or
        [n, s, ...] with `fill` past each row's batch. token_types only where the rows have them."""
        out = None
        types = self.token_types or [None] * len(self.ids)
        for ids, rows, padding, t in zip(self.ids, self.rows, self.padding, types):
            y = (fn(ids, padding) if t is None else fn(ids, padding, token_types=t)).float()
            if out is None:
                shape = (self.n, self.seq_length, *y.shape[2:]) if per_position else (self.n, *y.shape[1:])
                out = torch.full(shape, fill, dtype=torch.float32, device=y.device)
            if per_position:
                out[rows, :ids.shape[1]] = y
            else:
                out[rows] = y
        assert out is not None, "no rows to evaluate"
        return out.cpu()

    def logits(self, model: torch.nn.Module) -> torch.Tensor:
        """A task model's logits, as for the full rows: [n, C] (classify) or [n, s, C]."""
        return self.run(lambda ids, padding, **types: model(ids, padding=padding, **types)[1],
                        model.kind != "classify", PAD_LOGIT.get(model.kind, 0.0))


@dataclass
class EvalSet:
    """Evaluation examples encoded with one tokenizer and planned into token-sized batches on the
    device: made once per (tokenizer, language), scored by every seed and artifact that share them."""
    examples: list
    enc: Encoded
    batches: EvalBatches


def eval_set(task: Task, sp, examples: list, labels: list[str], cfg: FinetuneConfig, device: torch.device,
             framing: Framing = Framing()) -> EvalSet:
    """`examples` encoded with the tokenizer `sp` as the model family lays them out (`framing`)."""
    enc = encode(task, sp, examples, labels, cfg, framing)
    return EvalSet(examples, enc, EvalBatches.plan(enc.input_ids, cfg.eval_batch_tokens, device, enc.token_types))


def set_logits(ft: Finetuned, data: EvalSet, artifact: dict | None = None) -> torch.Tensor:
    """The logits of `data`'s rows (`EvalBatches.logits`) with Step 3's model, or with
    `artifact`'s word embeddings swapped into it (Step 4); the model is left as it was."""
    model, word = ft.model(), ft.family.word
    swap = {} if artifact is None else {word: artifact_embeddings(artifact, model.get_parameter(word))}
    with swapped(model, swap):
        return data.batches.logits(model)


def score_set(ft: Finetuned, data: EvalSet, cfg: FinetuneConfig, artifact: dict | None = None) -> dict[str, float]:
    """Every metric of `data` (`scores`) from `set_logits`."""
    return scores(ft.task, set_logits(ft, data, artifact), data.enc, data.examples, ft.labels, cfg)


# --- parallel-sentence retrieval (no fine-tuning) --------------------------------------------------

def sentence_vectors(model, sp, texts: list[str], seq_length: int, layer: int, framing: Framing = Framing(),
                     batch_tokens: int = FinetuneConfig.eval_batch_tokens) -> torch.Tensor:
    """Mean of layer `layer`'s outputs over each text's ordinary pieces -> [n, h], unit length
    (fp32, on the CPU), in token-sized batches on the model's device; each row laid out by
    `framing` (its start: as the model read text, ModelFamily.task_framing)."""
    enc = encode_classify(sp, [(t, 0) for t in texts], seq_length, framing)

    def pool(ids: torch.Tensor, padding) -> torch.Tensor:  # [b, s_i] -> [b, h]
        h = model.encode(ids, (layer,), padding)[0].float()  # [b, s_i, h], summed in fp32
        keep = special_mask(ids)[..., None].float()
        return (h * keep).sum(1) / keep.sum(1).clamp(min=1)

    vectors = EvalBatches.plan(enc.input_ids, batch_tokens, device_of(model)).run(pool, per_position=False)
    return torch.nn.functional.normalize(vectors, dim=-1)


def retrieval_accuracy(src_vectors: torch.Tensor, trg_vectors: torch.Tensor,
                       pairs: list[tuple[str, str]] | None = None) -> float:
    """Percent of target sentences whose nearest source sentence (cosine, after centring each
    side, which removes each language's common direction) is their translation. pairs: the
    (source, target) texts of the rows: a hit is then a source of the same text as the
    translation, or one whose own translation has the query's text (retrieval_records gives each
    text as the pieces its tokenizer reads: two spellings read alike are one text to the model,
    e.g. a decomposed accent under NFKC). A text that is in the sample twice (a verse the Bible
    repeats: es's "Y fué á mí palabra de Jehová, diciendo:") gives two equal vectors, which the
    arg-max settles for one of them alone: a perfect model scored 99.6 on ru's 500 pairs."""
    s = torch.nn.functional.normalize(src_vectors - src_vectors.mean(0), dim=-1)
    t = torch.nn.functional.normalize(trg_vectors - trg_vectors.mean(0), dim=-1)
    found = (t @ s.T).argmax(1)
    if pairs is None:
        return percent(found == torch.arange(len(t)))
    return percent(torch.tensor([pairs[j][0] == pairs[i][0] or pairs[j][1] == pairs[i][1]
                                 for i, j in enumerate(found.tolist())], dtype=torch.bool))


# --- Step 4 over series of Step-2 artifacts ------------------------------------------------------------

def finetuned_primary_ref(run: dict) -> PrimaryRef:
    """The primary model a fine-tuning run's record (its run.json) names."""
    return PrimaryRef(Path(run["primary"]["run_dir"]), run["primary"].get("fingerprint"))


def position_warning(run_dir: Path, run: dict, cfg: FinetuneConfig) -> str | None:
    """Step 3's check_positions for the fine-tuned run `run_dir` (its record `run`) at its
    seq_length `cfg.seq_length`: refused past the primary model's pretraining blocks unless
    `cfg` (the run's record or Step 4's flag) allows it, then the warning."""
    primary = Path(run["primary"]["run_dir"])
    return check_positions(primary, json.loads((primary / RUN_FILE).read_text()), cfg.seq_length,
                           cfg.allow_untrained_positions, run=run_dir)


def recorded_config(ft: Finetuned | dict, **changes) -> FinetuneConfig:
    """The FinetuneConfig of a run's run.json (a Finetuned's, or the record itself), with
    `changes`. A field that no longer exists is dropped (eval_batch_size: eval_batch_tokens
    replaced it); a field the record lacks (it predates the field) takes its default."""
    run = ft if isinstance(ft, dict) else ft.run
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    return FinetuneConfig(**{**{k: v for k, v in run["finetune"].items() if k in names}, **changes})


@dataclass
class Scoring:
    """What every record of one `evaluate_artifacts` call shares: the fine-tuned runs (seeds) and
    their configs, each language's evaluation examples (read and checked before any weights) and
    each evaluation set (encoded and put on the device once per tokenizer, language and encoding
    settings)."""
    runs: list[Finetuned]
    cfgs: list[FinetuneConfig]
    examples: dict[str, list]
    sets: dict = dataclasses.field(default_factory=dict)
    scored: dict = dataclasses.field(default_factory=dict)  # `fields` by swap_key and language

    def fields(self, lang: str, tokenizer: Path, artifact: dict | None, meta: dict | None = None) -> dict:
        """The scores of a record: every metric of `lang`'s examples encoded with `tokenizer`,
        averaged over the seeds, with `artifact`'s word embeddings swapped into each run's model
        (None: its own), the language's chance level as the first run encodes its rows, and the
        share of the text's pieces that `tokenizer` reads as <unk> (report.verdict names it).
        An artifact whose word embeddings, tokenizer and vocabulary mode are an earlier one's
        (artifact.swap_key) takes that one's scores: the seeds' forward passes would repeat them."""
        if artifact is None:
            return self._fields(lang, tokenizer, None, meta)
        key = (swap_key(artifact, ["word_embeddings"], meta, tokenizer), lang)
        if key not in self.scored:
            self.scored[key] = self._fields(lang, tokenizer, artifact, meta)
        return copy.deepcopy(self.scored[key])

    def _fields(self, lang: str, tokenizer: Path, artifact: dict | None, meta: dict | None) -> dict:
        task, labels, cfg0 = self.runs[0].task, self.runs[0].labels, self.cfgs[0]
        examples = self.examples[lang]
        # Every artifact of an adapt run carries a copy of one tokenizer: known by its content.
        known, seeds, first = file_sha256(tokenizer), [], None
        for ft, cfg in zip(self.runs, self.cfgs):
            model = ft.model()
            key = (known, lang, tuple(ft.labels), cfg.seq_length, cfg.doc_stride, cfg.max_query_length,
                   cfg.eval_batch_tokens, ft.framing)  # what the encoding and the batches depend on
            if key not in self.sets:
                self.sets[key] = eval_set(task, load_tokenizer(tokenizer), examples, ft.labels, cfg,
                                          device_of(model), ft.framing)
            if artifact is not None:  # on the device in the model's dtype after the first seed: one copy for all
                own = model.get_parameter(ft.family.word)
                # An expanded vocabulary keeps the model's own source rows (artifact_state): the
                # primary's in a Step-3 run of mmadapt, a grafted classifier's own fine-tuned ones.
                rows = artifact_state(ft.family, {"word_embeddings": artifact_embeddings(artifact, own)}, meta,
                                      {ft.family.word: own.detach()})
                artifact = {"word_embeddings": rows[ft.family.word]}
            seeds.append(score_set(ft, self.sets[key], cfg, artifact))
            first = first or self.sets[key]
        metric = headline(task, labels, cfg0)
        chance = chance_levels(task, first.enc, examples, labels, cfg0) or {"chance": None}
        return {"metric": metric, "score": sum(s[metric] for s in seeds) / len(seeds),
                "scores": {k: sum(s[k] for s in seeds) / len(seeds) for k in seeds[0]},
                "seed_scores": [s[metric] for s in seeds], "unknown_share": unknown_share(first.enc.input_ids),
                **chance}


def no_adaptation_record(scoring: Scoring, lang: str, systems: list[str]) -> dict:
    """The fine-tuned runs on `lang`'s evaluation file with no adaptation: their own (source)
    tokenizer and word embeddings, exactly Step 3's model (`evaluate_scores` with no artifact).
    What the adapted scores of `systems` (evaluated with these runs) are measured against; no
    Step-2 compute. One evaluation pass per seed."""
    ft = scoring.runs[0]
    return {"system": NO_ADAPTATION, "task": ft.task.name, "lang": lang, "flops": 0.0, "flops_paper": 0.0,
            "v100_days": 0.0, "tokens": 0, **scoring.fields(lang, ft.tokenizer, None), "of": systems,
            "tokenizer": str(ft.tokenizer), "primary": ft.run["primary"]["run_dir"]}


def evaluate_artifacts(finetuned: list[Path], artifacts: list[Path], eval_spec: str,
                       eval_batch_tokens: int | None = None, cfg_override: dict | None = None,
                       no_adaptation: bool = EvaluateConfig.no_adaptation_baseline, graft: bool = False,
                       lang: str | None = None) -> list[dict]:
    """Zero-shot scores of every artifact, averaged over the fine-tuned runs (seeds). All runs must
    fine-tune the primary model the embeddings were trained for (PrimaryRef.same: by its
    weights' fingerprint, or for older records its path). eval_batch_tokens None: each run's
    own (run.json). cfg_override: FinetuneConfig fields over each run's recorded ones
    (allow_untrained_positions: accept a run whose seq_length is past its primary's pretraining
    blocks). no_adaptation: after the artifacts' records, one per language of the runs with
    their own tokenizer and embeddings (`no_adaptation_record`).

    Each record carries its language's chance level (tasks.chance_levels) and the warnings of
    the runs behind it (`finetune_warnings`: a fine-tune at chance, untrained positions). Each
    run's model is built once (`Finetuned.model`) and every artifact swapped into it; each
    evaluation set is encoded and put on the device once per (tokenizer, language).

    graft: the artifacts were trained over a base encoder and the runs fine-tune a sibling of it
    (an imported classifier, whose own word embeddings moved): checked (graft.check_siblings over
    the bodies) and printed before anything is scored; its records are named as grafts into the
    runs' primary model (graft.grafted; an imported classifier: its run).

    lang: every artifact scored on this language's evaluation file, read by the artifact's
    tokenizer, instead of on its own language's (meta["lang"]): an expanded vocabulary on the
    source language, beside the no-adaptation record of that language, is what the expansion (or
    a graft of it) costs the source language's task."""
    paths = artifact_dirs(artifacts)  # the cheap checks first: every input's before any weights are read
    recorded, cfgs, primary, warnings = _finetuned_records(finetuned, eval_batch_tokens, cfg_override)
    metas = {path: checkpoint.read_json(path / "meta.json", "Step-2 artifact file") for path in paths}
    if not graft:  # every artifact's primary model before any is scored (its meta.json alone)
        for path, meta in metas.items():
            _check_artifact_primary(path, meta, primary)
    task, labels = get_task(recorded[0]["task"]), recorded[0]["labels"]
    if lang is None:  # every artifact on its own language's examples: the file must hold them
        check_one_file_per_language(eval_spec, sorted({meta["lang"] for meta in metas.values()}), "--eval_file",
                                    task.by_lang)
    # The first run's settings read the evaluation files (your own task's columns) and name the
    # headline; every metric is recorded, averaged over the seeds. Every language's file is
    # refused (missing, empty, unknown labels) before any weights are read or any is scored.
    examples = {scored: read_examples(task, eval_spec, scored, "test", cfgs[0], labels)
                for scored in sorted({lang or meta["lang"] for meta in metas.values()})}
    if graft:  # reads the base's and the sibling's bodies
        graft_check(paths, primary)
    runs = [load_finetuned(r, run) for r, run in zip(finetuned, recorded)]
    warned = {"finetune_warnings": warnings} if warnings else {}
    scoring, records = Scoring(runs, cfgs, examples), []
    # The sibling a graft goes into: the runs' primary model; an imported classifier's is its own
    # encoder, inside the classifier's run (hf_classifier.BODY), which names it instead.
    sibling = Path(primary.run_dir)
    if sibling.name == BODY and sibling.resolve().parent == Path(finetuned[0]).resolve():
        sibling = Path(finetuned[0])
    for path in progress(paths, f"zero-shot {runs[0].task.name}"):
        emb, tok, meta = read_artifact(path)  # its primary model checked above
        scored = lang or meta["lang"]
        record = {**record_base(meta, runs[0].task.name), "lang": scored, **scoring.fields(scored, tok, emb, meta),
                  "artifact": str(path), **warned}
        records.append(grafted(record, sibling) if graft else record)
    apart_runs(records)
    if no_adaptation:
        langs = list(dict.fromkeys(r["lang"] for r in records))
        records += [{**no_adaptation_record(scoring, lang, sorted({r["system"] for r in records if r["lang"] == lang})),
                     **warned} for lang in langs]
    return records


def apart_runs(records: list[dict]) -> None:
    """Where two adapt runs give records of one system and language (two starts, two seeds), each
    run's records name it after the system, `bl_base [run-dir-name]`, so that every table and plot
    keeps one curve per run: one curve would mix one run's update 0 with the other's last
    checkpoint. In place; the `artifact` field says whose a record is."""
    runs = defaultdict(set)
    for r in records:
        runs[(r["system"], r["lang"])].add(Path(r["artifact"]).parent.parent)
    names = {key: run_names(dirs) for key, dirs in runs.items() if len(dirs) > 1}
    for r in records:
        if (r["system"], r["lang"]) in names:
            r["system"] = run_label(r["system"], names[(r["system"], r["lang"])][Path(r["artifact"]).parent.parent])


def _finetuned_records(finetuned: list[Path], eval_batch_tokens: int | None, cfg_override: dict | None
                       ) -> tuple[list[dict], list[FinetuneConfig], PrimaryRef, list[str]]:
    """`evaluate_artifacts`' fine-tuned runs (seeds) as their records say, no weights read: their
    run.json, their configs with Step 4's changes, the primary model they share (one primary
    model and task, else refused), and their warnings (each run's own and its position warning,
    once), printed."""
    given_once(finetuned, "fine-tuned run")  # a seed given twice would be averaged as two
    for r in finetuned:  # Step 3's warnings (a run at chance) go into every record made from its run
        if is_finished(r) and not has_results(r):
            raise ValueError(f"{r} finished its updates but stopped before writing its results (final loss, "
                             "source-language score, warnings): run finetune --resume on it (it trains nothing)")
    recorded = [finetuned_record(r) for r in finetuned]
    primary = finetuned_primary_ref(recorded[0])
    if not all(finetuned_primary_ref(r).same(primary) for r in recorded) or len({r["task"] for r in recorded}) > 1:
        raise ValueError("--finetuned runs must share one primary model and task (one per seed)")
    changes = {**({} if eval_batch_tokens is None else {"eval_batch_tokens": eval_batch_tokens}),
               **(cfg_override or {})}
    cfgs = [recorded_config(run, **changes) for run in recorded]
    warnings = []
    for r, run, cfg in zip(finetuned, recorded, cfgs):
        positions = position_warning(r, run, cfg)
        # A warning Step 3 recorded about positions is the same one: keep it once.
        mine = [w for w in run.get("warnings", []) if w != positions] + ([positions] if positions else [])
        warnings += [f"{r}: {w}" for w in mine]
    for w in warnings:
        print(f"warning: {w}", flush=True)
    return recorded, cfgs, primary, warnings


def graft_check(paths: list[Path], primary: PrimaryRef) -> None:
    """evaluate --graft: every artifact trained over a base of which `primary` (the fine-tuned
    runs' encoder) is a sibling (graft.check_once, the bodies alone)."""
    checked = {}
    for path in paths:
        meta = checkpoint.read_json(path / "meta.json", "Step-2 artifact file")
        if artifact_primary_ref(meta).same(primary):
            raise not_a_graft(path, primary.run_dir)
        check_once(checked, artifact_primary(meta).resolve(), Path(primary.run_dir), meta, body_only=True)


def _check_artifact_primary(path: Path, meta: dict, primary: PrimaryRef) -> None:
    """Refuse, by name, the artifact at `path` (its meta.json `meta`) when its embeddings were
    trained for another primary model than `primary`."""
    if not artifact_primary_ref(meta).same(primary):
        raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)}, but the "
                         f"fine-tuned runs start from {primary.run_dir}"
                         + (" (their weights differ)" if primary.fingerprint and meta.get("primary_fingerprint")
                            else "") + ": evaluate them with that model's runs (or, if these runs fine-tune a model "
                         "fine-tuned from it, an imported classifier, pass --graft)")


def retrieval_records(primary_run: Path, adapt_runs: list[Path], pairs: dict[str, list[tuple[str, str]]],
                      seq_length: int = 64, layer: int | None = None) -> list[dict]:
    """Parallel-sentence retrieval through the primary model (Step 1 weights, no fine-tuning):
    source sentences with the source embeddings against target sentences with each artifact's
    embeddings. `layer`: whose outputs are pooled (default: the middle layer, ceil(L / 2),
    whose representations are the least tied to the MLM objective). The artifacts are taken to be
    `primary_run`'s, unchecked: its callers (the demo, benchmarks/eval_rows.py) score the same
    ones through plugin_records first, which refuses another model's."""
    source = read_source(primary_run)
    family, word = source.family, source.family.word
    cfg, state = primary_state(source)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    layer = layer or math.ceil(cfg.num_layers / 2)
    model = family.build_body(cfg)
    model.load_state_dict({k: state[k] for k in model.state_dict()})  # the body of the task model's start
    model = on_eval_device(model, device())  # built once; each artifact is swapped into it
    # rows start as the model read text (a decoder: </s> or its tokenizer's prefix; never <s>,
    # whose row no decoder trained), as Step 3's task rows do
    framing = family.task_framing(run_text_layout(source.record).get("prefix"))
    empty = next(((lang, i) for lang, given in pairs.items() for i, pair in enumerate(given)
                  if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                          and all(isinstance(t, str) and t.strip() for t in pair))), None)
    if empty is not None:  # (every empty text pools to one vector: a tie the arg-max settles for one;
        # a string of two letters was scored as a pair of them, three texts failed to unpack)
        raise ValueError(f"pairs[{empty[0]!r}][{empty[1]}] is {pairs[empty[0]][empty[1]]!r}: each pair is two "
                         "non-empty texts (source, target)")
    src_sp, src_vectors, src_read, records = load_tokenizer(source.tokenizer), {}, {}, []
    scored = {}  # accuracy by swap_key and language: an artifact like an earlier one scores the same
    for path in progress(artifact_dirs(adapt_runs), "retrieval"):
        emb, tok, meta = read_artifact(path)
        lang = meta["lang"]
        if not pairs.get(lang):
            raise ValueError(f"{path} is a {lang} artifact and pairs holds no {lang} sentences "
                             f"({', '.join(pairs) or 'no language'}): give pairs[{lang!r}], a list of (source, "
                             "target) texts")
        if lang not in src_vectors:
            src_vectors[lang] = sentence_vectors(model, src_sp, [a for a, _ in pairs[lang]], seq_length, layer,
                                                 framing)
            src_read[lang] = [tuple(src_sp.encode(a)) for a, _ in pairs[lang]]  # (hits by the pieces read)
        key = (swap_key(emb, ["word_embeddings"], meta, tok), lang)
        if key not in scored:
            tgt_sp = load_tokenizer(tok)
            with swapped(model, {word: artifact_embeddings(emb, model.get_parameter(word))}):
                trg = sentence_vectors(model, tgt_sp, [b for _, b in pairs[lang]], seq_length, layer, framing)
            # hits by the pieces each side reads (NFD and NFC spellings of a verse are one to the model)
            read = [(a, tuple(tgt_sp.encode(b))) for a, (_, b) in zip(src_read[lang], pairs[lang])]
            scored[key] = retrieval_accuracy(src_vectors[lang], trg, read)
        records.append({**record_base(meta, "retrieval"), "metric": "accuracy", "chance": 100 / len(pairs[lang]),
                        "score": scored[key], "artifact": str(path)})
    return records
