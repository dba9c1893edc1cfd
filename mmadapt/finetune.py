"""Step 3: fine-tune the primary model of a Step-1 run on a source-language task, word
embeddings frozen (steps.finetune runs it).

It starts from the primary model of the run (its last layer; heads dropped) with a new task
head, trains everything but the word embeddings through the shared engine (engine.py: data
parallel, ZeRO, megatron tensor parallel; no pipeline: fine-tuning fits one device per model
replica) with train.task_step, and saves DeepSpeed checkpoints without the frozen word
embeddings: they are the primary run's, which run.json points to. This module holds its data
(`TaskData`: the task's examples, read and encoded before anything is written) and the
primary model's weights (`primary_state`); the tasks themselves are tasks.py's, the rebuilt
model (Step 4) evaluate.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from mmadapt import checkpoint, parallel
from mmadapt.config import FinetuneConfig, ModelConfig
from mmadapt.family import ModelFamily
from mmadapt.features import Encoded, Framing
from mmadapt.run import (RUN_FILE, UNTRAINED_POSITIONS, RunSpec, Source, pretrained_blocks, require_kind,
                         run_text_layout, untrained_positions, weights_fingerprint)
from mmadapt.tasks import Task, check_chunk_tags, check_task_fields, encode, headline, label_names, read_examples
from mmadapt.tokens import IGNORE_INDEX
from mmadapt.tokenizer import load as load_tokenizer


def check_primary(source: Source) -> None:
    """Step 3 fine-tunes the primary model of a pretrain (or imported, or head-fitted: run.KIND_OF_STEP)
    run, nothing else."""
    require_kind(source.path, source.record, "pretrain")


def primary_state(source: Source, weights: dict | None = None) -> tuple[ModelConfig, dict]:
    """The primary model of a Step-1 run as its task model starts from it (ModelFamily.task_state:
    its full depth, without heads). weights: the run's full weights, if loaded already."""
    check_primary(source)
    task_state = source.family.task_state(source.cfg, source.weights() if weights is None else weights)
    return dataclasses.replace(source.cfg, head_layers=(), head_weights=()), task_state


def is_finished(run_dir: str | os.PathLike) -> bool:
    """A fine-tuning run whose last update is in a complete checkpoint."""
    run_file = Path(run_dir) / RUN_FILE
    if not run_file.is_file():
        return False
    run = json.loads(run_file.read_text())
    return (run.get("step") == "finetune" and
            checkpoint.latest_tag(Path(run_dir) / "checkpoints") == checkpoint.tag_for(run["updates"]))


def has_results(run_dir: str | os.PathLike) -> bool:
    """A finished fine-tuning run whose results (final loss, source-language score, warnings) are
    in its record: they are written after the last checkpoint, so a run stopped in between is
    finished without them (`steps.finetune` with resume writes them, training nothing)."""
    return is_finished(run_dir) and "warnings" in json.loads((Path(run_dir) / RUN_FILE).read_text())


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """What Step 3 trains on and records, worked out before anything is written (TaskData.check):
    the task's label names and headline metric, the training examples encoded as the family lays
    them out, the optional evaluation examples, the warning about untrained positions (None: none),
    and the number of updates."""
    labels: list[str]
    metric: str
    enc: Encoded
    eval_examples: list | None
    positions: str | None
    updates: int
    global_batch: int


@dataclasses.dataclass
class TaskData:
    """Step 3's data (run.DataPlan): the task's training examples in the source language,
    encoded with the primary run's tokenizer as its family lays them out, and the optional
    evaluation examples (their source-language score goes into run.json). `check` works out the
    `TaskPlan`, which `prepare` hands the step (started.data)."""
    task: Task
    primary: Source
    train_file: str
    eval_file: str | None = None
    source_lang: str = "en"
    plan: TaskPlan | None = dataclasses.field(default=None, init=False)

    def check(self, run: RunSpec, model: ModelConfig, cfg: FinetuneConfig, family: ModelFamily) -> dict:
        check_task_fields(self.task, cfg)
        examples = read_examples(self.task, self.train_file, self.source_lang, "train", cfg)
        labels = label_names(self.task, examples)
        check_chunk_tags(self.task, labels, self.train_file)
        if self.task.kind == "classify" and len(labels) < 2:
            raise ValueError(f"{self.train_file} has one label ({labels[0] if labels else 'none'}) in every example: a "
                             "task model learns from at least two classes")
        if self.task.kind == "tag" and len(labels) < 2:  # (it trained a one-output head at loss 0)
            raise ValueError(f"{self.train_file} has one tag ({labels[0] if labels else 'none'}) on every token: a "
                             "tagger learns from at least two tags (check --label_column)")
        metric = headline(self.task, labels, cfg)
        framing = self.framing(run, family)
        enc = encode(self.task, load_tokenizer(self.primary.tokenizer), examples, labels, cfg, framing)
        eval_examples = (read_examples(self.task, self.eval_file, self.source_lang, "test", cfg, labels)
                         if self.eval_file else None)
        # After the data's own checks: a file's mistake is named before the length is.
        positions = check_positions(self.primary.path, self.primary.record, cfg.seq_length,
                                    cfg.allow_untrained_positions)
        global_batch = cfg.global_batch(parallel.launched_world_size() // model.tensor_model_parallel_size)
        updates = max(1, math.ceil(cfg.epochs * len(enc) / global_batch))
        self.plan = TaskPlan(labels, metric, enc, eval_examples, positions, updates, global_batch)
        return {"task": self.task.name, "labels": labels, "metric": self.plan.metric, "source_lang": self.source_lang,
                "train_file": self.recorded_file(), "train_examples": len(examples), "train_rows": len(enc),
                "task_digest": weights_fingerprint(enc.trained()), "updates": updates, "global_batch": global_batch,
                "task_start": list(framing.start)}

    def recorded_file(self) -> str:
        """train_file as run.json records it: the file's absolute path, which a --resume from
        another directory (a requeued job) names alike; a Bible task's 'bible' as it is."""
        return self.train_file if self.task.name.startswith("bible-") else os.path.abspath(self.train_file)

    def framing(self, run: RunSpec, family: ModelFamily) -> Framing:
        """How this run's rows are laid out: as the primary model read text in training
        (ModelFamily.task_framing: a decoder's rows start with </s>, or its imported tokenizer's
        prefix), or, resumed, as the run's record says it trained (one recorded before: <s>)."""
        recorded = run.output_dir / RUN_FILE
        if run.resume and recorded.is_file():
            return family.recorded_framing(checkpoint.read_json(recorded, "run file"))
        return family.task_framing(run_text_layout(self.primary.record).get("prefix"))

    def check_resume(self, run: RunSpec) -> None:
        """Everything a --resume must match is in the record."""

    def prepare(self, run: RunSpec, model: ModelConfig, cfg: FinetuneConfig, family: ModelFamily) -> TaskPlan:
        return self.plan


# --- what Step 3 refuses or warns about ----------------------------------------------------------------

def is_position_warning(warning: str) -> bool:
    """Whether a fine-tuned run's warning is check_positions' (its model read untrained positions),
    not that it learned nothing (steps.at_chance): a record may carry both, prefixed by its run."""
    return warning.endswith(UNTRAINED_POSITIONS) and "seq_length " in warning


def check_positions(primary: Path, src: dict, seq_length: int, allow: bool, run: Path | None = None) -> str | None:
    """A `seq_length` within the blocks the primary model of the Step-1 record `src` was
    pretrained on: None. Longer: a ValueError naming both numbers, or with `allow` the warning
    to log (the positions past its blocks were never trained: a RoBERTa's position embeddings
    there are their random init). Past the model's positions (an imported model, whose blocks are
    unknown, or `allow`): a ValueError, whatever `allow` says (an encoder's forward failed on it
    with a traceback after the model had loaded).

    `run`: the fine-tuned run Step 4 scores at its recorded seq_length (which Step 4 takes no flag
    to change): refused as that run's, a run recorded without the allowance (fine-tuned before
    Step 3 checked) scored only with --allow_untrained_positions, else fine-tuned again."""
    most = src.get("model", {}).get("max_position_embeddings")
    if most is not None and seq_length > most:
        raise ValueError(f"--seq_length {seq_length} exceeds max_position_embeddings {most} of the model of {primary}: "
                         f"pass --seq_length {most} or less")
    what = untrained_positions(primary, src, seq_length)
    if what is None:
        return None
    blocks = pretrained_blocks(src)
    if not allow and run is not None:
        raise ValueError(f"{run}: {what}, and its run.json does not allow that (it was fine-tuned before "
                         "Step 3 checked): pass --allow_untrained_positions true to score it anyway, with a warning, "
                         f"or fine-tune it again at --seq_length {blocks} or less")
    if not allow:
        raise ValueError(f"--{what}; pass --seq_length {blocks} or less (or --allow_untrained_positions true to "
                         "use them anyway, with a warning)")
    return what


# z of a two-sided 95% interval: a score inside the chance predictor's interval is noise.
CHANCE_Z = 1.96


def label_counts(task: Task, enc: Encoded, labels: list[str]) -> list[int]:
    """How often each of `labels` is a training target in `enc` (classify: rows; tag: scored
    tokens; QA: none)."""
    if task.kind == "span":
        return []
    gold = enc.labels if task.kind == "classify" else enc.labels[enc.labels.ne(IGNORE_INDEX)]
    return torch.bincount(gold, minlength=len(labels))[:len(labels)].tolist()


def at_chance(kind: str, counts: list[int], losses: list[float], accuracy: float | None,
              chance: dict | None) -> list[str]:
    """Why a fine-tune looks like it learned nothing (classify and tag; [] when it did, or for QA):
    its lowest logged training loss is not below the chance loss, the entropy of its training
    labels `counts` (ln C for C balanced classes: the loss of predicting the label frequencies,
    which the head's bias learns without reading the input), or its source-language `accuracy`
    (percent) is not above the binomial 95% interval of the majority predictor's accuracy p on
    its n scored items (`tasks.chance_levels`: p + 1.96 sqrt(p (1 - p) / n))."""
    if kind == "span":
        return []
    out = []
    total = sum(counts)
    chance_loss = max(0.0, -sum(c / total * math.log(c / total) for c in counts if c)) if total else 0.0  # not -0.0
    if losses and min(losses) >= chance_loss:
        out.append(f"the training loss never dropped below the chance loss {chance_loss:.3f} (the entropy of the "
                   f"training labels; ln {len(counts)} = {math.log(len(counts)):.3f} for balanced classes; lowest "
                   f"logged {min(losses):.3f})")
    if accuracy is not None and chance is not None:
        p, n = chance["majority_accuracy"] / 100, chance["scored_items"]
        bound = 100 * (p + CHANCE_Z * math.sqrt(p * (1 - p) / n))
        if accuracy <= bound:
            out.append(f"the source-language accuracy {accuracy:.1f} is not above chance beyond noise (the "
                       f"majority label's {100 * p:.1f}, whose 95% interval on {n} items reaches {bound:.1f})")
    return out
