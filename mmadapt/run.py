"""A run directory: how a step describes it (`RunSpec`), how every training step starts one
(`start_run`), what it records (`RunRecord`, run.json), and how later steps read a finished one
(`read_source`, `read_run`, `checkpoint_tag`, `load_weights`).

This is where a run's model family is looked up (models.get_family), once per run a process
starts or reads: `Started.family`, `Source.family`; everything after takes it from there.

Layout of a run directory:
    run.json        the record: what the run is (compared on --resume) and what it produced
    run.lock        held by global rank 0 while the run writes (faults.RunLock)
    tokenizer/      spm.model, the vocabulary later steps read (LM steps)
    data/           a raw --corpus, prepared by the run itself
    checkpoints/    checkpoint.py's layout
    metrics.jsonl, tensorboard/, embeddings/ (Step 2's artifacts)

`start_run` is the one start-up of Steps 1, 1b, 2 and 3, in this order: every check a user can
get wrong, before any side effect; the run lock (global rank 0 creates the directory); the data
(prepared by global rank 0 outside any collective: see `DataPlan`); the process groups. The step
then builds its engine and writes its record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from mmadapt import checkpoint, fusion, parallel
from mmadapt.config import (CHANGEABLE_ON_RESUME, DEFAULT_DS_CONFIG, SAME_ON_RESUME, FinetuneConfig, Layout, LoopConfig,
                            MiniModelConfig, ModelConfig, PreprocessConfig, TrainConfig, check_declared,
                            output_inside_an_input, to_dict)
from mmadapt.corpora import resolve_corpus
from mmadapt.engine import for_replicas, load_ds_config, zero_stage
from mmadapt.family import ModelFamily
from mmadapt.faults import RunLock
from mmadapt.models import get_family
from mmadapt.tasks import TASKS

RUN_FILE = "run.json"
# run.json: the checkpoint tag at which the run's step returned, what follows its last update
# written (an artifact, a report); None from its start until then. A stop at the last update
# leaves it None: a caller that keeps finished runs (sweep, extend, the demo) resumes that one.
FINISHED = "finished_at"
RUN_TOKENIZER = Path("tokenizer") / "spm.model"  # a run's vocabulary, relative to its directory


@dataclasses.dataclass
class RunSpec:
    """Where a step runs and on what: the same for every step.

    output_dir: the run directory. ds_config: DeepSpeed JSON (ZeRO stage, precision). data_path:
    a dataset prepared by `mmadapt preprocess`; else corpus: raw text (or bible:<lang>), prepared
    into <output_dir>/data by the run, with tokenizer (an existing SentencePiece model; None: one
    trained on the corpus). resume: continue from the newest complete checkpoint. layout: how a
    later step lays out its source's model; Step 1 applies it over its ModelConfig. prep: how a
    raw corpus's tokenizer is trained (its sample of lines, its threads; the seed is the step's),
    as preprocess trains one (MMADAPT_TINY=1 caps the sample the command line reads, as it caps
    every flag it caps; a RunSpec made in Python is taken as given)."""
    output_dir: Path
    ds_config: Path = DEFAULT_DS_CONFIG
    data_path: Path | None = None
    corpus: str | Path | None = None
    tokenizer: Path | None = None
    resume: bool = False
    layout: Layout = Layout()
    prep: PreprocessConfig = dataclasses.field(default_factory=PreprocessConfig)

    def __post_init__(self):
        check_declared(self)
        if self.data_path is not None and self.corpus is not None:  # a step would train on one, record one
            raise ValueError("RunSpec takes one text: data_path (a prepared dataset) or corpus (raw text), not both")
        self.output_dir, self.ds_config = Path(self.output_dir), Path(self.ds_config)
        self.data_path = None if self.data_path is None else Path(self.data_path)
        self.tokenizer = None if self.tokenizer is None else Path(self.tokenizer)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"

    def with_corpus_resolved(self) -> "RunSpec":
        """The run with its raw corpus resolved (bible:<lang> -> the packaged Bible, written once)."""
        return self if self.corpus is None else dataclasses.replace(self, corpus=resolve_corpus(self.corpus))


class DataPlan(Protocol):
    """A training step's data, in start_run's order. `check` (before any side effect) refuses
    what cannot work and returns the run record's data fields, the ones a --resume must match;
    `check_resume` compares what the record cannot (a changed corpus, another tokenizer);
    `prepare` (global rank 0 holds the run lock) returns what the step trains on: global rank 0
    prepares while the others wait outside any collective (parallel.rank0_prepares), whose
    timeout would kill a job that prepares for longer. `family`: the run's
    model family (its objective's blocks, its text framing, the tokenizers it takes)."""

    def check(self, run: RunSpec, model: ModelConfig, loop: LoopConfig, family: ModelFamily) -> dict: ...

    def check_resume(self, run: RunSpec) -> None: ...

    def prepare(self, run: RunSpec, model: ModelConfig, loop: LoopConfig, family: ModelFamily) -> Any: ...


# --- the record ---------------------------------------------------------------------------------------

def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recorded_defaults() -> dict:
    """Each config field's default as run.json records it, flattened ("model.head_weights",
    "train.decay_all", "finetune.lr", ...): what a run recorded before that field existed ran with."""
    configs = {"model": to_dict(ModelConfig()), "train": to_dict(TrainConfig()), "finetune": to_dict(FinetuneConfig())}
    return _flat(json.loads(json.dumps(configs)))


# record keys (not config fields) run.json gained later: a run recorded before one is not checked
# for it (2026-12-03: the rows a Step-3 run trains on, features.Encoded.trained; 2026-12-01: a
# Step-3 run's rows then started with <s>, ModelFamily.recorded_framing; 2026-11-27: the
# fingerprint of the weights Step 1b and fit-head build on, which every load checks where it is
# recorded, run._built_on)
UNRECORDED_BEFORE = ("data_parallel_size", "task_start", "data_digest", "replay_digest", "data_split", "replay_split",
                     "frozen_from.fingerprint", "task_digest",
                     "vocab_size",  # expand's target model trained on the corpus, recorded from 2026-12-06
                     "step")  # a record from before steps were named: a pretrain run's (check_same_kind)


# config fields whose default is not what a run recorded before the field ran with, and the value
# that run trained with: it resumes with that value (2026-12-02: an update's loss a mean of its
# micro-batches' means; Step 3's field, 2026-12-04, likewise), unless it trained alike under both.
RECORDED_BEFORE = {"train.calculate_per_token_loss": False, "finetune.calculate_per_token_loss": False}


def _same_math_before(key: str, saved: dict) -> bool:
    """Whether a run recorded before `key` (RECORDED_BEFORE) trained alike under either value: one
    micro-batch on one rank per update, or a Step-3 task that scores one per row (not a tag task).
    A record without data_parallel_size (before 2026-12-01) may have run on several ranks: not so."""
    config = key.split(".", 1)[0]
    one = saved.get(f"{config}.gradient_accumulation_steps") == 1 and saved.get("data_parallel_size") == 1
    task = TASKS.get(saved.get("task")) if config == "finetune" else None
    return one or (task is not None and task.kind != "tag")


class ChangedRun(ValueError):
    """A run to continue that is not the one its record describes: `detail` says where they
    differ, `fix` how a --resume continues it instead. A command that continues its runs by
    itself (the sweep: the same command again) words its own line around `detail`."""

    def __init__(self, detail: str, fix: str):
        super().__init__(f"--resume of a changed run: {detail}; {fix}, or start a new --output_dir")
        self.detail, self.fix = detail, fix

    def __reduce__(self):  # pickled by its fields: a demo worker's run sends it to the demo's process, where
        # one that did not unpickle broke the pool (read as a killed worker, exit 1)
        return type(self), (self.detail, self.fix)


# the record keys a --resume compares first: what the run is (its step, system, language, task)
IDENTITY_FIRST = ("step", "system", "recipe", "lang", "task")

# record keys that hold a file's or a dataset's path: the same one however it is spelt (records
# from before 2026-12-05 hold it as given, perhaps relative to where the run started; a replay
# dataset's content is compared by its replay_digest)
PATH_KEYS = ("train_file", "train.replay_data")


def check_same_run(run_file: Path, expected: dict) -> None:
    """--resume continues the run recorded in `run_file`: every entry of `expected` (nested dicts
    compared leaf by leaf) must equal the recorded one, except config.CHANGEABLE_ON_RESUME. A
    config field the record lacks (it predates the field) matches the field's default."""
    saved = _flat(checkpoint.read_json(run_file, "run file"))
    mine = _flat(json.loads(json.dumps(expected)))  # tuples as lists, as run.json holds them
    defaults = None
    # what the run is (where its record says) before how it is shaped: --system bl_base over a
    # minijoint run's record was refused as 'model.num_layers is 12 here but 4'
    for key, value in sorted(mine.items(), key=lambda kv: kv[0] not in IDENTITY_FIRST or kv[0] not in saved):
        leaf = key.rsplit(".", 1)[-1]
        if leaf in CHANGEABLE_ON_RESUME or saved.get(key) == value:
            continue
        if key in PATH_KEYS and isinstance(saved.get(key), str) and isinstance(value, str) and (
                os.path.realpath(saved[key]) == os.path.realpath(value)):
            continue  # the same file spelt another way (./t.csv, a link to it, /scratch for /lustre; or
            # recorded relative and resumed from there): its contents are compared by their digest
        if key in saved and value in SAME_ON_RESUME.get(leaf, ()) and saved[key] in SAME_ON_RESUME[leaf]:
            continue
        if key not in saved:
            if key in UNRECORDED_BEFORE:  # a run recorded before the key: not checked
                continue
            if key in RECORDED_BEFORE:
                if value == RECORDED_BEFORE[key] or _same_math_before(key, saved):
                    continue
                raise ValueError(f"--resume of a run recorded before {key} existed: it trained with "
                                 f"{str(RECORDED_BEFORE[key]).lower()}; resume with --{key.rsplit('.', 1)[-1]} "
                                 f"{str(RECORDED_BEFORE[key]).lower()}, or start a new --output_dir")
            defaults = defaults or recorded_defaults()
            if key in defaults and defaults[key] == value:
                continue
        if key in ("data_digest", "replay_digest", "data_split", "replay_split"):
            which = expected.get("data_path" if key.startswith("data") else "replay_data")
            what = "other text or another tokenizer" if key.endswith("digest") else "another validation split"
            raise ChangedRun(f"the dataset {which} holds {what} than when {run_file} recorded it (prepared again "
                             "at the same path?)", "resume with that dataset")
        if key == "task_digest":
            raise ChangedRun(f"the rows of {expected.get('train_file')} (its examples, as the primary's tokenizer "
                             f"encodes them) are not those {run_file} recorded (the file edited, or the tokenizer "
                             "replaced?)", "resume with that data")
        raise ChangedRun(f"{key} is {value} here but {saved.get(key)} in {run_file}", "resume with the run's settings")
    # A DeepSpeed setting the run had and this --ds_config lacks (bf16 on, then a JSON without it:
    # DeepSpeed would load its bf16 files into an fp32 engine with a warning): config fields are
    # the other way round (one the code no longer has is not a change), the JSON's keys are not.
    for key in sorted(saved.keys() - mine.keys()):
        if (key.startswith("ds_config.") and key.rsplit(".", 1)[-1] not in CHANGEABLE_ON_RESUME
                and "ds_config" in expected and saved[key] not in (None, False)):
            raise ChangedRun(f"{key} is {saved[key]} in {run_file} and unset in this --ds_config",
                             "resume with the run's --ds_config")


# The key under which run.json holds each loop config.
CONFIG_KEYS = {TrainConfig: "train", FinetuneConfig: "finetune"}


class RunRecord:
    """run.json: `identity` (what the run is: step, model, its config, data, DeepSpeed config,
    where its weights come from; what a --resume must match) and what the run adds once it has
    built its model (`write`) or finished (`finish`). Global rank 0 writes it, atomically."""

    def __init__(self, run_dir: Path, identity: dict):
        self.path, self.identity = Path(run_dir) / RUN_FILE, identity

    def exists(self) -> bool:
        return self.path.is_file()

    def check_resume(self) -> None:
        check_same_run(self.path, self.identity)

    def write(self, resume: bool, **extra) -> None:
        """The record as the run starts (collective: every rank waits for it); a resumed run's
        record stays as it is, but for FINISHED: not finished until its step returns again (a
        record from before FINISHED gains it)."""
        if parallel.is_rank0():
            if not (resume and self.exists()):
                checkpoint.atomic_write(self.path, json.dumps({**self.identity, **extra, FINISHED: None}, indent=2))
            elif self.read().get(FINISHED, "") is not None:
                self.finish(**{FINISHED: None})
        if dist.is_initialized():
            dist.barrier()

    def read(self) -> dict:
        """The record as it stands in run.json."""
        return checkpoint.read_json(self.path, "run file")

    def finish(self, **results) -> dict:
        """Global rank 0: add what the run produced (also mid-run: the micro-batch fit's record).
        Returns the whole record."""
        record = {**self.read(), **results}
        checkpoint.atomic_write(self.path, json.dumps(record, indent=2))
        return record


# --- start-up -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Started:
    """What start_run hands the step: DeepSpeed's config, the prepared data, the record, and the
    run's model family."""
    ds_config: dict
    data: Any
    record: RunRecord
    family: ModelFamily


@contextlib.contextmanager
def start_run(run: RunSpec, model: ModelConfig, loop: LoopConfig, identity: dict, data: DataPlan
              ) -> Iterator[Started]:
    """The start of every training step (module docstring). `model` is the model as this run
    lays it out; identity: the record's step-specific fields (step, recipe, where the weights
    come from). Global rank 0 holds the run lock until the step returns."""
    family = get_family(model)
    ds, record = _checked_record(run, model, loop, identity, data, family)
    if run.resume and record.exists():
        _same_run(run, record, data)
        # refused before anything is written (RunRecord.write clears the record's FINISHED); not in
        # _same_run: a caller's check of runs it will not train (a finished sweep depth) reads none
        checkpoint.intact_tag(run.checkpoints)
    with run_lock(run.output_dir):
        prepared = data.prepare(run, model, loop, family)
        parallel.init_parallel(model.tensor_model_parallel_size, model.pipeline_model_parallel_size)
        if parallel.is_rank0() and (why := parallel.cpu_fallback()):
            print(why, flush=True)
        yield Started(for_replicas(ds, parallel.dp_world(), run.output_dir / "checkpoints" if run.resume else None),
                      prepared, record, family)
        if parallel.is_rank0() and record.exists():  # the step returned (a stop or a pause raises)
            record.finish(**{FINISHED: checkpoint.latest_tag(run.checkpoints)})


def check_resumable(run: RunSpec, model: ModelConfig, loop: LoopConfig, identity: dict, data: DataPlan) -> None:
    """What start_run checks before anything is written, where `run` holds a run to continue: it
    is the same run (a caller about to train several runs checks each before training any)."""
    _same_run(run, _checked_record(run, model, loop, identity, data, get_family(model))[1], data)


def _same_run(run: RunSpec, record: RunRecord, data: DataPlan) -> None:
    """A run recorded in run.output_dir (if any) is the one `record` and `data` describe."""
    if record.exists():
        record.check_resume()
        data.check_resume(run)


def _checked_record(run: RunSpec, model: ModelConfig, loop: LoopConfig, identity: dict, data: DataPlan,
                    family: ModelFamily) -> tuple[dict, RunRecord]:
    """start_run's checks of everything it is given -> (DeepSpeed's config, the run's record)."""
    ds = check_layout(model, loop, run.ds_config, family)
    fields = data.check(run, model, loop, family)
    check_same_kind(run.output_dir, identity["step"])
    checkpoint.refuse_overwrite(run.output_dir, run.resume)
    # The data-parallel ranks set the global batch and each rank's share of the data: a --resume
    # on another number would go on with another batch under the same schedule
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    dp = parallel.launched_world_size() // (tp * pp)
    record = RunRecord(run.output_dir, {"model": to_dict(model), CONFIG_KEYS[type(loop)]: to_dict(loop), **fields,
                                        "ds_config": ds, "data_parallel_size": dp, **identity})
    return ds, record


def check_layout(model: ModelConfig, loop: LoopConfig, ds_config: Path, family: ModelFamily | None = None) -> dict:
    """What start_run checks of the model as the run lays it out, its loop and the DeepSpeed
    config, before it reads any data -> DeepSpeed's config. A step that prepares data before
    start_run (sweep: its target corpus) calls it first, so that these refusals write nothing."""
    family = family or get_family(model)
    family.validate(model)
    fusion.check_device(model, family)
    loop.validate(model)
    family.check_loop(loop)
    ds = load_ds_config(ds_config, loop)
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    stage = zero_stage(ds)
    if pp > 1 and stage > 1:
        raise ValueError(f"ZeRO stage {stage} does not combine with DeepSpeed pipeline parallelism: "
                         "use ds_configs/zero1.json with --pipeline_model_parallel_size > 1")
    # Before any process group exists: the launcher's WORLD_SIZE (1 for a plain `python` run).
    parallel.check_world_size(parallel.launched_world_size(), tp, pp)
    if pp > 1 and tp > 1 and len(model.heads_after) > 1:
        # With tensor parallelism DeepSpeed splits the first tensor sent between stages across the
        # TP ranks and asserts that no other tensor of the tuple needs a gradient; the carried
        # output of an intermediate head's layer does (pipeline.py), so send whole tensors.
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    return ds


@contextlib.contextmanager
def run_lock(output_dir: Path):
    """Global rank 0 creates `output_dir` and holds its lock (faults.RunLock) meanwhile."""
    output_dir = Path(output_dir)
    created = not output_dir.exists()
    # an empty directory made beforehand (mkdir, or a job script's) holds only what this call writes
    fresh = created or (output_dir.is_dir() and next(output_dir.iterdir(), None) is None)
    lock = RunLock(output_dir)
    if parallel.is_rank0():
        output_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        yield
    except ValueError:
        # A user's mistake found late (a corpus too short for one block, an unreadable source
        # checkpoint): what this call wrote goes, where no checkpoint was saved: the directory it
        # created, or the entries of one that was empty (a prepared data/ left there refused the
        # corrected command as another corpus's dataset)
        if lock.held and fresh and not checkpoint.has_checkpoints(output_dir / "checkpoints"):
            lock.release()
            if created:
                shutil.rmtree(output_dir, ignore_errors=True)
            else:
                for entry in output_dir.iterdir():
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        raise
    finally:
        lock.release()


# --- finished runs ------------------------------------------------------------------------------------

# The kinds of run (RUN_KINDS) a step reads its model from: Step 1's or a mini-model of Step 1b's
# (Step 2, the sweep, the plug-in metric); Step 1's alone (build_minipost, fit-head, finetune:
# pretrain, import-hf and fit-head runs)
SOURCE_KINDS, STEP_ONE = ("pretrain", "minipost"), ("pretrain",)


def read_run(run_dir: str | os.PathLike, kinds: tuple[str, ...] = SOURCE_KINDS) -> dict:
    """run.json of a run with a complete checkpoint and a tokenizer (one without, of a kind that
    keeps none, is refused naming the `kinds` the caller takes)."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_FILE).is_file():
        raise ValueError(f"{run_dir} is not an mmadapt run directory (no run.json): pass the --output_dir of "
                         "the run meant (the kinds a flag takes: the command's --help)")
    if checkpoint.latest_tag(run_dir / "checkpoints") is None:
        raise ValueError(f"{run_dir} has no complete checkpoint yet: let its run save one first")
    record = checkpoint.read_json(run_dir / RUN_FILE, "run file")
    if not (run_dir / RUN_TOKENIZER).is_file():
        kind = KIND_OF_STEP.get(record.get("step", "pretrain"), record.get("step", "pretrain"))
        if kind in RUN_KINDS and kind not in ("pretrain", "minipost"):  # complete, and of a kind with no tokenizer
            raise ValueError(f"{run_dir} is {RUN_KINDS[kind]}, which reads the tokenizer of the run it was trained "
                             "from: pass " + " or ".join(RUN_KINDS[k] for k in kinds))
        raise ValueError(f"{run_dir} has no tokenizer/spm.model: it is not a complete mmadapt run")
    return record


def run_progress(run_dir: Path, iters: int) -> str:
    """'done' (its newest complete checkpoint is update `iters` and its step returned there:
    FINISHED; a run recorded before FINISHED, the checkpoint alone), 'resume' (an interrupted
    run: checkpoints, but not that one, or a stop at that one before what follows it was
    written) or 'new'."""
    ckpt, tag = Path(run_dir) / "checkpoints", checkpoint.tag_for(iters)
    if checkpoint.latest_tag(ckpt) == tag:
        path = Path(run_dir) / RUN_FILE
        if (checkpoint.read_json(path, "run file") if path.is_file() else {}).get(FINISHED, tag) == tag:
            return "done"
    return "resume" if checkpoint.has_checkpoints(ckpt) else "new"


def run_model(run: dict, run_dir: Path | None = None) -> ModelConfig:
    """A record's model config (a run from before model families is a RoBERTa run), refused in
    one line naming `run_dir` where run.json holds none that this mmadapt reads."""
    model = run.get("model")
    fields = dataclasses.fields(ModelConfig)
    if not isinstance(model, dict):
        why = "no model config"
    elif unknown := sorted(set(model) - {f.name for f in fields}):
        why = f"unknown model fields ({', '.join(unknown)})"
    elif missing := [f.name for f in fields if f.name not in model and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING]:
        why = f"an incomplete model config (no {', '.join(missing)})"
    else:
        return ModelConfig(**model)
    raise ValueError(f"{run_dir or 'the run'}/{RUN_FILE} holds {why}: it was not written by this mmadapt, or was "
                     "edited; run that step again into a new --output_dir")


# Each kind of run (run.json "step"), as a refusal names what it got and what it needs.
RUN_KINDS = {"pretrain": "a pretrain or import-hf run (Step 1)", "minipost": "a build_minipost run (Step 1b)",
             "adapt": "an adapt run (Step 2: its products are the artifacts under its embeddings/)",
             "finetune": "a finetune run (Step 3: a task model)"}


# A head fit (steps.fit_head) writes a Step-1 run that every later step takes as a pretrain run's.
KIND_OF_STEP = {"fit_head": "pretrain"}
# What each step's run is, said where a run directory is told from another (check_same_kind):
# a head fit is its own run there, though later steps take it as a pretrain run's.
STEP_RUNS = {**RUN_KINDS, "fit_head": "a fit-head run (Step 1: a new MLM head over a headless encoder)"}


def check_same_kind(output_dir: Path, step: str) -> None:
    """Refuse, in one line, an --output_dir that holds a run of another step than `step` (its
    record's "step"; none: a pretrain run's, from before steps were named): neither a --resume
    nor a new run may go on in it, and the refusals further on (another run's checkpoints: pass
    --resume; a changed run: the fields of another kind's config) would send the user round."""
    record = Path(output_dir) / RUN_FILE
    if not record.is_file():
        return
    saved = checkpoint.read_json(record, "run file").get("step", "pretrain")
    if saved != step:
        raise ValueError(f"--output_dir {output_dir} holds {STEP_RUNS.get(saved, f'a {saved} run')}, and this "
                         f"command writes {STEP_RUNS[step]}: choose a new --output_dir (nothing was changed)")


def require_kind(path: Path, run: dict, *kinds: str) -> None:
    """Refuse, in one line naming what it got and what it needs, a run (its record `run`) of
    another kind than `kinds` (RUN_KINDS; a record without "step" is a pretrain run's, from
    before steps were named; KIND_OF_STEP: steps whose runs are of another step's kind)."""
    kind = run.get("step", "pretrain")
    kind = KIND_OF_STEP.get(kind, kind)
    if kind not in kinds:
        raise ValueError(f"{path} is {RUN_KINDS.get(kind, f'a {kind} run')}; this needs "
                         + " or ".join(RUN_KINDS[k] for k in kinds))


def run_family(run: dict, run_dir: Path | None = None) -> ModelFamily:
    """The model family of a record (run.json of `run_dir`), known by name (models.get_family)."""
    return get_family(run_model(run, run_dir))


@dataclasses.dataclass(frozen=True)
class Source:
    """A finished Step-1 (or 1b, or imported) run that a later step reads: its directory, record,
    checkpoint tag, model config on one device, and model family. `weights()` loads its full
    weights (load_weights)."""
    path: Path
    record: dict
    tag: str
    cfg: ModelConfig
    family: ModelFamily

    def weights(self, read: dict | None = None) -> dict[str, torch.Tensor]:
        """Its full weights (load_weights; `read`: the checkpoints read already, load_weights')."""
        return load_weights(self.path, self.tag, read)[1]

    def agreed_weights(self) -> dict[str, torch.Tensor]:
        """Its full weights, read by each rank of a step's job, every rank stopping where one could
        not read them (parallel.together)."""
        return parallel.together(self.weights, f"could not read {self.path}'s checkpoint {self.tag}")

    @property
    def tokenizer(self) -> Path:
        return self.path / RUN_TOKENIZER

    @property
    def headless(self) -> bool:
        """An imported body without an LM head (run.json `imported_from.headless`: a BertModel,
        RobertaModel or XLMRobertaModel, as sentence-transformers ships them)."""
        return bool((self.record.get("imported_from") or {}).get("headless"))


def require_head(source: Source, what: str) -> None:
    """Refuse, in one line naming the command that fixes it, a headless run given to a step that
    needs its LM head (`what`: the step)."""
    if source.headless:
        arch = source.record["imported_from"].get("architecture", "body")
        raise ValueError(f"{source.path} is a headless encoder (a {arch} imported without an MLM head), and {what} "
                         f"needs one: fit it first with `mmadapt fit-head --primary {source.path} --corpus "
                         "<source-language text> --output_dir <new run>` and pass that run")


def resumed_tag(output_dir: Path, resume: bool, source: str | os.PathLike, tag: str | None,
                key: str = "frozen_from") -> str | None:
    """The checkpoint of the run `source` that the step writing `output_dir` reads: `tag` where
    given; on a --resume (`resume`) of a run whose record names a checkpoint of this same source
    (under `key`: "frozen_from", or Step 3's "primary"), that one; else None (read_source: the
    newest). A requeued job goes on over the checkpoint it started from, though the source saved
    newer ones since (its pretraining still running): the newest would be refused as a changed
    run."""
    record = Path(output_dir) / RUN_FILE
    if tag is not None or not resume or not record.is_file():
        return tag
    recorded = checkpoint.read_json(record, "run file").get(key) or {}
    if not isinstance(recorded, dict):  # (a hand-edited record: a traceback before any check had read it)
        raise ValueError(f"{record} is damaged: its {key} is {recorded!r}, not the record of the run it was built "
                         "over; restore it, or start a new --output_dir")
    if recorded.get("run_dir") != str(Path(source).resolve()) or recorded.get("tag") is None:
        return None
    if recorded["tag"] not in checkpoint.complete_tags(Path(source) / "checkpoints"):
        raise ValueError(f"--resume of {output_dir}: it trained over {source}'s checkpoint {recorded['tag']}, which "
                         f"{source} no longer holds (pruned by its --keep_last?): restore that checkpoint, or start "
                         "a new --output_dir")
    return recorded["tag"]


def read_source(run_dir: str | os.PathLike, tag: str | None = None,
                kinds: tuple[str, ...] = SOURCE_KINDS) -> Source:
    """The run `run_dir` at checkpoint `tag` (default: its newest complete one), checked to be a
    complete run (read_run, checkpoint_tag) of one of `kinds` (require_kind: a step that takes
    a Step-1 run alone names it so); its weights are not loaded yet."""
    path = Path(run_dir).resolve()
    record = read_run(path, kinds)
    require_kind(Path(run_dir), record, *kinds)
    cfg = dataclasses.replace(run_model(record, path), tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return Source(path, record, checkpoint_tag(path, tag), cfg, get_family(cfg))


def agreed_source(run_dir: str | os.PathLike, choose: Callable[[], str | None] = lambda: None,
                  kinds: tuple[str, ...] = SOURCE_KINDS) -> Source:
    """read_source(run_dir, choose()) for a step of a launched job: the checkpoint chosen on global
    rank 0 and read by every rank (parallel.rank0_decides; a refusal there raised on each). The
    source may still be saving (its pretraining running) as the step starts, and ranks listing its
    checkpoints a moment apart, or through another node's cached view of a shared file system,
    would take different ones: replicas over different frozen weights, none the wiser. `choose`:
    the tag asked for (resumed_tag; None: the newest complete). Where a rank cannot read the
    chosen checkpoint (pruned since), every rank stops (parallel.together)."""
    tag = parallel.rank0_decides(lambda: read_source(run_dir, choose(), kinds).tag)
    return parallel.together(lambda: read_source(run_dir, tag, kinds), f"could not read {run_dir}'s checkpoint {tag}")


def text_prefix(run: dict, own_tokenizer: Path, tokenizer: Path | None = None) -> list[int] | None:
    """What the model of the run `run` (its record; `own_tokenizer` its tokenizer file) reads
    before a text read by `tokenizer` (None: its own): the recorded prefix (run_text_layout; None
    for a model mmadapt trained: its objective's start). An imported decoder that puts nothing
    before a text (Qwen2) read in a new vocabulary (Step 2 replace: a SentencePiece model where
    its own is not) reads `</s>` first: Step 2's stream ended every document with it
    (data.LayoutBatches), and the exported tokenizer lays a text out so (the llama family's
    tokenizer_layout); in its own vocabulary, or an expansion of it, it reads bare text as its
    tokenizer lays it out."""
    from mmadapt.tokenizer import is_hf
    from mmadapt.tokens import EOS_ID

    prefix = run_text_layout(run).get("prefix")
    if prefix == [] and tokenizer is not None and not is_hf(tokenizer) and is_hf(own_tokenizer):
        return [EOS_ID]
    return prefix


def run_text_layout(run: dict) -> dict[str, list[int]]:
    """How the model of a run (its record) reads a text: an imported model's tokenizer's layout
    (hf.text_layout: the ids before and after a text), through the runs it was made from (a head
    fit, MINIPOST's frozen_from); {} for a model mmadapt trained (its objective's own layout)."""
    imported = run.get("imported_from")
    if imported is not None:
        return imported.get("text_layout") or {}
    ref = run.get("frozen_from")
    if ref is not None and (Path(ref["run_dir"]) / RUN_FILE).is_file():
        return run_text_layout(checkpoint.read_json(Path(ref["run_dir"]) / RUN_FILE, "run file"))
    return {}


def pretrained_blocks(run: dict) -> int | None:
    """The block length (pieces) a Step-1 record's model was pretrained on; None for a model whose
    body was imported, a head fit over one included (its source trained its positions, up to its
    max_position_embeddings: all that is known; the head fit's own blocks trained no position)."""
    if run.get("imported_from") is not None or "train" not in run:
        return None
    return run["train"]["seq_length"]


UNTRAINED_POSITIONS = "were never trained"  # how untrained_positions ends: report.py tells Step 3's warning by it


def untrained_positions(path: Path, record: dict, seq_length: int) -> str | None:
    """'seq_length S is longer than the B-piece blocks <path> was pretrained on: positions B+1-S
    were never trained' for the Step-1 record `record` of the run at `path`; None where S is
    within its blocks, or they are unknown (pretrained_blocks)."""
    blocks = pretrained_blocks(record)
    if blocks is None or seq_length <= blocks:
        return None
    return (f"seq_length {seq_length} is longer than the {blocks}-piece blocks {path} was pretrained on: "
            f"positions {blocks + 1}-{seq_length} {UNTRAINED_POSITIONS}")


def check_trained_positions(source: Source, seq_length: int, step: str) -> None:
    """Refuse a `seq_length` past the blocks `source` was pretrained on, for a step that trains
    no position (Step 1b, Step 2: positions stay as the source has them): past its blocks they
    are never trained (an encoder's position embeddings their random init), and stay so. Step 3
    allows them, with a warning (finetune.check_positions)."""
    what = untrained_positions(source.path, source.record, seq_length)
    if what is not None:
        raise ValueError(f"--{what}, and {step} trains none; pass --seq_length {pretrained_blocks(source.record)} "
                         "or less")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes as held in memory (any dtype, on the host): what the digests of its
    content hash."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: a model's
    identity by its content, the same for a byte-identical copy of its run wherever it lives
    (Step 4 matches primary models by it, not by their paths)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


SAMPLED_ELEMENTS = 1024  # of each tensor, evenly spaced, in sampled_fingerprint


def sampled_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A model's identity by a sample of its content, cheap at any size: sha256 over every
    tensor's name, dtype and shape and SAMPLED_ELEMENTS evenly spaced elements of it (a smaller
    tensor whole). Another checkpoint of the same shape differs in it (training moves every
    element of a tensor it trains); a run built on another records it (frozen_from.fingerprint)
    and load_weights compares it at every load."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(state[name].shape)}|".encode())
        if t.numel() > SAMPLED_ELEMENTS:
            t = t[torch.linspace(0, t.numel() - 1, SAMPLED_ELEMENTS).long()]
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


def check_run(run: RunSpec, step, kind: type) -> None:
    """What the command line refuses before a step starts, for a step called from Python: a
    `run` that is no RunSpec and a `step` that is no `kind` (the step function's own), a
    RunSpec text field the step does not read (`step.run_text`; its command has no such flag),
    and an output directory strictly inside a directory the step reads
    (config.output_inside_an_input, which Parser.parse_args runs): the step's fields, its
    configs' (replay_data), and the run's data_path."""
    # named here, not as an AttributeError deep in the step ('str' object has no attribute 'data_path')
    if not isinstance(run, RunSpec):
        raise ValueError(f"run takes a RunSpec, got {type(run).__name__} {run!r}")
    if not isinstance(step, kind):
        raise ValueError(f"step takes a {kind.__name__}, got {type(step).__name__}")
    unread = [f for f in ("data_path", "corpus", "tokenizer") if getattr(run, f) is not None and f not in step.run_text]
    if unread:
        raise ValueError(f"{step.name} reads no RunSpec {unread[0]} ({step.text_from}): drop it")
    inputs: dict[str, list] = {"data_path": [run.data_path]}
    for f in dataclasses.fields(step):
        value = getattr(step, f.name)
        nested = ([(g.name, getattr(value, g.name)) for g in dataclasses.fields(value)]
                  if dataclasses.is_dataclass(value) else [(f.name, value)])
        for name, v in nested:
            inputs.setdefault(name, []).extend(v if isinstance(v, (list, tuple)) else [v])
    inside = output_inside_an_input(run.output_dir, inputs)
    if inside:
        raise ValueError(inside)


def check_same_source(run: "RunSpec", checks: dict[str, Callable[[], str]], source: Path) -> None:
    """A --resume over a source whose weights (or tokenizer) changed since the run started is
    refused before anything trains: the rest of the run would train over other weights (or another
    vocabulary) than its first checkpoints, and its artifacts name two models. `checks`: a key of
    the run's record (a fingerprint, or the tokenizer's sha256; dotted for a nested one) -> how to
    compute it from what is read now, in order of preference: the first key the record holds is
    compared (a run recorded before a cheaper fingerprint existed holds only the older one). Every
    rank computes it from what it read, so every rank refuses alike."""
    path = Path(run.output_dir) / RUN_FILE
    if not (run.resume and path.is_file()):
        return
    record = checkpoint.read_json(path, "run file")
    for key, now in checks.items():
        recorded = record
        for part in key.split("."):
            recorded = recorded.get(part) if isinstance(recorded, dict) else None
        if recorded is None:
            continue
        if recorded != now():
            what, other = (("its tokenizer differs from the one", "another vocabulary") if "tokenizer" in key else
                           ("its weights differ from those", "other weights"))
            raise ValueError(f"{source} changed since {run.output_dir} started over it ({what} the run recorded): "
                             f"resuming would train the rest over {other}; restore it, or start a new run in a new "
                             "--output_dir")
        return


def run_fingerprint(run_dir: str | os.PathLike, tag: str | None = None) -> str:
    """`weights_fingerprint` of a Step-1 or Step-1b run's full weights at `tag` (load_weights)."""
    return weights_fingerprint(load_weights(run_dir, tag)[1])


def checkpoint_tag(run_dir: Path, tag: str | None) -> str:
    """`tag` if `run_dir` has it complete, else (tag None) its newest complete checkpoint; refused
    where a file of it is missing or of another size than saved (checkpoint.damaged, what
    --resume skips): a missing fp32 master file was read as the bf16 weights, a missing shard as
    half a tensor, by every later step."""
    tags = checkpoint.complete_tags(Path(run_dir) / "checkpoints")
    if tag is not None and tag not in tags:
        # (a sweep's depths all read the tag the first one chose, which the source may prune meanwhile)
        older = bool(tags) and tag < tags[0] and _prunes(Path(run_dir))
        raise ValueError(f"{run_dir} has no complete checkpoint {tag}"
                         + (" (pruned by its --keep_last?)" if older else "") + f"; it has {', '.join(tags) or 'none'}")
    if not tags:
        raise ValueError(f"{run_dir} has no complete checkpoint yet: let its run save one first")
    chosen = tag or tags[-1]
    why = checkpoint.damaged(Path(run_dir) / "checkpoints" / chosen)
    if why is not None:
        others = [t for t in tags if t != chosen]
        raise ValueError(f"{run_dir}'s checkpoint {chosen} is damaged ({why}): restore it"
                         + (f", or name another of its checkpoints ({', '.join(others)})" if others else ""))
    return chosen


def _prunes(run_dir: Path) -> bool:
    """Whether the run records a --keep_last (it deletes its older checkpoints as it trains)."""
    try:
        return int((checkpoint.read_json(run_dir / RUN_FILE).get("train") or {}).get("keep_last") or 0) > 0
    except (ValueError, TypeError, AttributeError):  # (read_json's refusals are ValueErrors)
        return False


def load_checkpoint(run_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """A run's checkpoint as full weights in its family's names (checkpoint.load_full_state_dict)."""
    def prefixes(model_config: dict) -> list:
        cfg = ModelConfig(**model_config)
        return get_family(cfg).pipeline_layer_prefixes(cfg)

    return checkpoint.load_full_state_dict(Path(run_dir) / "checkpoints", tag, layer_prefixes=prefixes)


def load_weights(run_dir: str | os.PathLike, tag: str | None = None, read: dict | None = None
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Full weights of a Step-1 or Step-1b run (newest complete checkpoint unless `tag`), with
    its config on one device.

    A Step-1b checkpoint holds only the layers it trained; its frozen part is rebuilt from the
    run it references (run.json `frozen_from`), exactly as Step 1b started from it. A head fit's
    (`frozen_from.head_fit`) holds its head; the body is the headless run's.

    read: {(run directory, tag): (config, weights)} of the runs read already, filled as they are
    read (the referenced runs too): a caller that needs a run and the run it references reads
    each checkpoint once. The weights are shared, not copied: do not change them in place.
    """
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    require_kind(run_dir, run, "pretrain", "minipost")
    tag = tag or checkpoint.latest_tag(run_dir / "checkpoints")
    key = (str(run_dir.resolve()), tag)
    if read is not None and key in read:
        return read[key]
    cfg = dataclasses.replace(run_model(run, run_dir), tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    own = load_checkpoint(run_dir, tag)
    ref = run.get("frozen_from")
    if ref is None:
        loaded = cfg, own
    elif ref.get("head_fit"):  # mmadapt fit-head: a new head over the frozen body of the run it references
        loaded = cfg, {**_built_on(run_dir, ref, read)[1], **own}
    else:
        loaded = cfg, _minipost_weights(run_dir, cfg, ref, own, read)
    if read is not None:
        read[key] = loaded
    return loaded


def _built_on(run_dir: Path, ref: dict, read: dict | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The full weights of the run `run_dir` was built on (`ref`: its frozen_from), checked to be the
    ones it was built on where it recorded their fingerprint (sampled_fingerprint): a run that
    keeps only what it trained is refused over another body in one line, and over none."""
    if not (Path(ref["run_dir"]) / RUN_FILE).is_file():
        raise ValueError(f"{run_dir} was built on {ref['run_dir']} (checkpoint {ref['tag']}), which is gone: it keeps "
                         "only what it trained; restore that run where it was, or build this one again")
    cfg, state = load_weights(ref["run_dir"], ref["tag"], read)
    if ref.get("fingerprint") and sampled_fingerprint(state) != ref["fingerprint"]:
        raise ValueError(f"{run_dir} was built on {ref['run_dir']} (checkpoint {ref['tag']}), whose weights have changed "
                         "since: it keeps only what it trained and would run over another model; restore the run it "
                         "was built on, or build this one again")
    return cfg, state


def _minipost_weights(run_dir: Path, cfg: ModelConfig, ref: dict, own: dict, read: dict | None) -> dict:
    """A Step-1b run's full weights: its checkpoint `own` (the layers it trained) over the frozen
    part rebuilt from the run it references (`ref`: run.json's frozen_from)."""
    family = get_family(cfg)
    src_cfg, src_state = _built_on(run_dir, ref, read)
    mini = MiniModelConfig(ref["mini_layers"], ref["new_layers"])
    _, frozen = family.minipost_start(src_cfg, src_state, mini.one_depth("build_minipost"), mini.new_layers)
    state = {**frozen, **own}
    missing = sorted(set(family.param_names(cfg)) - set(state))
    if missing:
        raise ValueError(f"{run_dir}: the checkpoint lacks {missing[0]}; it was not written by build_minipost")
    return state
