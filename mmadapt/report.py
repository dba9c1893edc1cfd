"""Compute tables (the paper's Table 2 costs, A1/A3/A4) and time to near-maximal performance.

Evaluation results, as Step 4 writes them and `mmadapt report` reads them, are JSON lists of
records: {"system", "task", "lang", "step", "flops", "score"}: one per evaluated Step-2
checkpoint, `flops` being the Step-2 compute spent up to that checkpoint. Step 2's start (its
artifact of update 0, the new embeddings as initialised) is the point at 0 FLOPs of a curve;
the time to near-maximal performance counts trained checkpoints only. A record of system
`no_adaptation` (NO_ADAPTATION) is the fine-tuned model on the target text with its own
tokenizer and embeddings: no curve, but what the systems it names (its "of") are measured
against (`adaptation_markdown`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from collections import defaultdict
from pathlib import Path

from mmadapt.artifact import NO_ADAPTATION, SCORED_LABEL, run_label, run_names, runs_of, system_of_run
from mmadapt.bpb import fold_caveat
from mmadapt.checkpoint import atomic_write
from mmadapt.config import MiniModelConfig, ModelConfig, TrainConfig, apply_recipe
from mmadapt.data import UNKNOWN_REFUSE
from mmadapt.family import ModelFamily
from mmadapt.finetune import is_position_warning
from mmadapt.flops import DEVICE_TFLOPS, device_days, total_flops
from mmadapt.models import find_preset
from mmadapt.objectives import plugin_objective

# Paper section 3: 125k updates of 2048 sequences of 512 tokens, V = 50k, p = 0.15.
PAPER = {"updates": 125_000, "global_batch": 2048, "seq_length": 512, "mask_prob": 0.15}
NEAR_MAX = 0.95  # section 4.2: target = 95% of BL_BASE's final score for the language and task


def read_results(files: list[str]) -> list[dict]:
    """The records of Step 4's results `files` (JSON lists, as `mmadapt evaluate --output` writes
    them, or a sweep's sweep.json), each refused in one line unless it names a file once and
    holds whole records: a system, task and language, a finite score, finite FLOPs >= 0 and a
    step (where given) a whole number >= 0."""
    twice = next((f for i, f in enumerate(files) if any(Path(f).resolve() == Path(g).resolve() for g in files[:i])),
                 None)
    if twice is not None:
        raise ValueError(f"results file {twice} is given twice: its records would count twice; name it once")
    records = []
    for f in files:
        try:
            text = Path(f).read_text()
            data = json.loads(text)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read results file {f}: {str(e).splitlines()[0]}") from None
        except json.JSONDecodeError as e:
            what = ("it is empty" if not text.strip() else "it holds more than one JSON value (JSON Lines?)"
                    if e.msg == "Extra data" else str(e))
            raise ValueError(f"cannot read results file {f}: {what}; pass the JSON list `mmadapt evaluate --output` "
                             "writes") from None
        if isinstance(data, dict) and isinstance(data.get("records"), list) and "summary" in data:
            data = [_beside(r, Path(f)) for r in data["records"]]  # a sweep's sweep.json (steps.sweep): evaluate's
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"results file {f} is not a JSON list of records (as `mmadapt evaluate --output` "
                             "writes)")
        missing = [(k, i) for i, r in enumerate(data) for k in (*REQUIRED_TEXT, "flops", "score") if k not in r]
        if missing:
            raise ValueError(f"results file {f}: record {missing[0][1]} lacks {missing[0][0]!r}")
        bad = [(k, i, r[k]) for i, r in enumerate(data) for k in ("flops", "score")
               if not _finite_number(r[k]) or (k == "flops" and r[k] < 0)]
        if bad:
            raise ValueError(f"results file {f}: record {bad[0][1]} has {bad[0][0]} {bad[0][2]!r}; scores are finite "
                             "numbers and FLOPs finite and >= 0 (re-run mmadapt evaluate for it)")
        wrong = next(((i, k, r.get(k), what) for i, r in enumerate(data) for k, what in _field_problems(r)), None)
        if wrong is not None:
            i, k, value, what = wrong
            raise ValueError(f"results file {f}: record {i} has {k} {value!r}; {k} {what} (re-run mmadapt evaluate "
                             "for it)")
        step = next(((i, r["step"]) for i, r in enumerate(data) if r.get("step") is not None
                     and (isinstance(r["step"], bool) or not isinstance(r["step"], int) or r["step"] < 0)), None)
        if step is not None:
            raise ValueError(f"results file {f}: record {step[0]} has step {step[1]!r}; a step is a Step-2 update, a "
                             "whole number >= 0 (re-run mmadapt evaluate for it)")
        records += [{**r, "_file": f} for r in data]
    if not records:
        raise ValueError(f"{', '.join(map(str, files))} {'holds' if len(files) == 1 else 'hold'} no result records")
    if not adapted(records):
        raise ValueError(f"{', '.join(files)} hold only no-adaptation records: no Step-2 checkpoint to report "
                         "(mmadapt evaluate --embeddings <Step-2 runs> scores them)")
    _one_metric_per_task(records)
    _apart_across_files(records)
    _one_point_per_checkpoint(records)
    _one_no_adaptation_score(records)
    return [{k: v for k, v in r.items() if k != "_file"} for r in records]


def _beside(record, sweep_json: Path):
    """A sweep.json's record with its artifact where the file lies beside it: a sweep records
    <output_dir>/<depth>/embeddings/<tag> as --output_dir was spelt, relative to a working
    directory no file keeps, so two sweeps given as `sweep-de` from two directories read as one
    (two scores of one checkpoint) and a depth was matched to another sweep's ceiling. Left as
    recorded where the file was copied away from its runs."""
    artifact = record.get("artifact") if isinstance(record, dict) else None
    if not isinstance(artifact, str) or Path(artifact).is_absolute() or len(Path(artifact).parts) < 3:
        return record
    # by its run's directory (a checkpoint's removed since it was scored is still this sweep's)
    here = _as_given(sweep_json).parent
    run, *at = Path(artifact).parts[-3:]
    return {**record, "artifact": str(here.joinpath(run, *at))} if (here / run).is_dir() else record


def _as_given(path: Path) -> Path:
    """`path` made absolute from the working directory as the shell spells it (PWD: through a
    link as typed, as evaluate records a run given from there; os.getcwd resolves links), where
    that spelling names the file read (a '..' folded against a link's name may not): else its
    real path."""
    pwd = os.environ.get("PWD")
    if pwd and os.path.isabs(pwd):
        spelt = os.path.normpath(os.path.join(pwd, path))
        try:
            if os.path.samefile(spelt, path):
                return Path(spelt)
        except OSError:
            pass
    return Path(os.path.realpath(path))


def _one_point_per_checkpoint(records: list[dict]) -> None:
    """Refuse, in one line, a curve (system, task, language) whose points are not one run's
    checkpoints: two records of one checkpoint (the same step; where either records no step, the
    same FLOPs), or FLOPs that fall as the step rises (records of two runs, or edited by hand).
    Two runs of one system, told apart by their artifacts, are two names by now. A curve is
    sorted by (FLOPs, score): one checkpoint twice ended it on the better of the two, and falling
    FLOPs made an earlier step its last checkpoint (the target every system is measured by)."""
    by_curve = defaultdict(list)
    for r in adapted(records):
        by_curve[(r["system"], r["task"], r["lang"])].append(r)

    def where(a: dict, b: dict) -> str:
        return f"{a['_file']} holds" if a["_file"] == b["_file"] else f"{a['_file']} and {b['_file']} both hold"

    for (system, task, lang), rs in by_curve.items():
        for i, r in enumerate(rs):
            for o in rs[:i]:
                stepped = r.get("step") is not None and o.get("step") is not None
                if r["step"] == o["step"] if stepped else math.isclose(r["flops"], o["flops"], rel_tol=1e-9):
                    at = f"step {r['step']}" if stepped else f"{r['flops']:.4g} FLOPs (no step recorded)"
                    raise ValueError(f"{where(o, r)} {system}'s {task} score in {lang} at {at}: one checkpoint "
                                     "evaluated twice would be one curve's point twice; report one of them")
        stepped = sorted((r for r in rs if r.get("step") is not None), key=lambda r: r["step"])
        for a, b in zip(stepped, stepped[1:]):
            if b["flops"] < a["flops"]:
                raise ValueError(f"{where(a, b)} {system}'s {task} records in {lang} whose FLOPs fall as the step "
                                 f"rises (step {a['step']}: {a['flops']:.4g}, step {b['step']}: {b['flops']:.4g}): "
                                 "not one run's checkpoints; report each run's mmadapt evaluate output as written")


# A record's fields besides flops, score and step, as Step 4 writes them: what each must be where
# present (REQUIRED_TEXT in every record; a bits-per-byte record needs BPB_NEEDS beside it)
REQUIRED_TEXT = ("system", "task", "lang")
TEXT_FIELDS = (*REQUIRED_TEXT, "artifact", "metric", "heldout_tokenizer", "bpb_text")
NUMBER_FIELDS = ("chance", "bpb", "none_bpb", "start_bpb", "source_bpb", "source_none_bpb", "unknown_share")
BPB_NEEDS = ("none_bpb", "start_bpb")


def _field_problems(r: dict):
    """(field, what it must be) for each field of the record `r` that is not what the report
    reads (a null language sorted against a text one, a text chance level, a bits-per-byte
    record without its reference: each failed with a traceback)."""
    for k in TEXT_FIELDS:
        v = r.get(k)
        if k in r and not (isinstance(v, str) or v is None and k not in REQUIRED_TEXT):
            yield k, "must be a text"
    for k in NUMBER_FIELDS:
        if r.get(k) is not None and not _finite_number(r[k]):
            yield k, "must be a finite number"
    if r.get("bpb") is not None:
        for k in BPB_NEEDS:
            if r.get(k) is None:
                yield k, "must be given beside bpb (the bits per byte before adaptation and at the start)"
        v = r.get("bpb_bytes")  # the scale the bits per byte were scored at (the table's "bytes")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            yield "bpb_bytes", "must be given beside bpb: the held-out bytes it was scored on, a whole number"
    of = r.get("of")  # null: none named, every system's (as a record without it)
    if of is not None and not (isinstance(of, list) and of and all(isinstance(s, str) for s in of)):
        yield "of", "must be a list of system names"
    w = r.get("finetune_warnings")
    if w is not None and not (isinstance(w, list) and all(isinstance(x, str) for x in w)):
        yield "finetune_warnings", "must be a list of texts"


def _finite_number(v) -> bool:
    """A JSON number (not true/false, which Python counts as int) that is finite."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _one_metric_per_task(records: list[dict]) -> None:
    """Refuse records of one task scored by different metrics (a record's `metric`: Step 3's
    --metric, which can differ between fine-tuning runs): each curve, target, retention and speedup
    compares one task's scores with each other, and chunk F1 against accuracy compares nothing.
    Records from before `metric` was written are not checked."""
    metrics: dict[str, dict[str, str]] = defaultdict(dict)  # task -> metric -> the first file holding it
    for r in records:
        if r.get("metric") is not None:
            metrics[r["task"]].setdefault(r["metric"], r["_file"])
    task, by = next(((t, m) for t, m in metrics.items() if len(m) > 1), (None, None))
    if task is not None:
        raise ValueError(f"the {task} records are scored by different metrics ("
                         + ", ".join(f"{m} in {f}" for m, f in by.items())
                         + "): one curve compares one metric; report them apart")


def _apart_across_files(records: list[dict]) -> None:
    """Where records of one system, task and language come from two Step-2 runs (their
    `artifact`s' run directories) that evaluate calls of their own scored, each run's records name
    it after the system, as `evaluate.apart_runs` names them within one call: merged, one curve
    would take one run's start and the better of two last scores. In place. A no-adaptation
    record's `of` names the systems as its evaluate call did: each renamed system there becomes
    the names its file's records took (a file of its own: every run's), else no adapted row found
    its no-adaptation score."""
    runs = defaultdict(set)
    for r in adapted(records):
        if r.get("artifact"):
            runs[(r["system"], r["task"], r["lang"])].add(Path(r["artifact"]).parent.parent)
    spelt = {key: _run_spellings(dirs) for key, dirs in runs.items()}
    labels = {key: run_names(set(one.values())) for key, one in spelt.items() if len(set(one.values())) > 1}
    names = defaultdict(set)  # (task, lang, system) -> {(file, new name)}
    for r in adapted(records):
        key = (r["system"], r["task"], r["lang"])
        if r.get("artifact") and key in labels:
            name = run_label(r["system"], labels[key][spelt[key][Path(r["artifact"]).parent.parent]])
            names[(r["task"], r["lang"], r["system"])].add((r["_file"], name))
            r["system"] = name
    def renamed(none: dict, system: str) -> list[str]:  # what `system` in the no-adaptation record `none` became
        took = names.get((none["task"], none["lang"], system), set())
        return sorted(n for f, n in took if f == none["_file"]) or sorted(n for _, n in took) or [system]

    for r in records:
        if r["system"] == NO_ADAPTATION and r.get("of"):
            r["of"] = [n for system in r["of"] for n in renamed(r, system)]


def _run_spellings(dirs: set[Path]) -> dict[Path, Path]:
    """Each run directory -> the spelling it is known by: a relative one whose parts (after its
    leading '..') end another's (runs/adapt/x or ../adapt/x, as one evaluate call was given it;
    /work/runs/adapt/x in another) as that one, the most specific (absolute first, then the most
    parts): that run, not a run of its own, unless it ends two that are not one; an absolute one
    as spelt (a link resolved now may point elsewhere than when the run was scored)."""
    def specific(e: Path) -> tuple:
        return e.is_absolute(), len(_named(e)), len(e.parts), str(e)

    def known(d: Path) -> Path:
        if d.is_absolute():
            return Path(os.path.normpath(d))
        ends = [e for e in dirs if specific(e) > specific(d) and _ends(d, e)]
        if any(not _same_dir(e, f) for e in ends for f in ends):  # (../sweep/2 ends de-1/ and de-2/sweep/2)
            return d  # two runs it may be: a run of its own, as before it was ever matched
        return known(max(ends, key=specific)) if ends else d
    return {d: known(d) for d in dirs}


def is_plugin(task: str) -> bool:
    """A record of the plug-in metric (objectives.py: masked pieces for the encoder, next pieces
    for the decoder, both scored as contextual gain in nats), not of a task."""
    return plugin_objective(task) is not None


# --- compute --------------------------------------------------------------------------------

def flops_rows(family: ModelFamily, model: ModelConfig, train: TrainConfig, global_batch: int,
               mini: MiniModelConfig = MiniModelConfig(), device: str = "v100-paper") -> list[dict]:
    """Cost of every step of every system for a primary model `model` (its num_layers = l),
    trained train.train_iters updates of `global_batch` blocks of train.seq_length.

    Rows: system, step, num_layers, p (the fraction of each block's positions that reach an LM
    head: the encoder's mask_prob, the decoder's score_fraction), eflops_paper, eflops_exact,
    v100_days (paper count at the paper's 30 TFLOP/s, as its tables), device, days_exact (exact
    count at `device`'s rate).
    Several depths N (mini_layers 2 4 6): one MINIJOINT pretraining with a head after each, and
    the systems whose mini-model has depth N once per depth, named `<system>@N`.
    """
    s, p, l = train.seq_length, family.scored_fraction(train), model.num_layers
    depths, k = mini.mini_layers, mini.new_layers
    base = family.one_head(model, l)

    def cost(step: str, cfg: ModelConfig):
        return lambda paper: family.step_flops(step, cfg, s, p, paper, trainable_layers=k)

    steps = [("bl_base", "pretrain", l, cost("pretrain", apply_recipe(base, "bl_base"))),
             ("minijoint", "pretrain", l, cost("pretrain", apply_recipe(base, "minijoint", depths)))]
    for n in depths:
        at = f"@{n}" if len(depths) > 1 else ""
        steps += [(f"bl_small{at}", "pretrain", n, cost("pretrain", apply_recipe(base, "bl_small", n))),
                  (f"minipost{at}", "minipost", n + k, cost("minipost", family.one_head(base, n + k)))]
    steps.append(("bl_base", "adapt", l, cost("adapt", base)))
    for n in depths:
        at = f"@{n}" if len(depths) > 1 else ""
        steps += [(f"minipost{at}", "adapt", n + k, cost("adapt", family.one_head(base, n + k))),
                  (f"minijoint{at}", "adapt", n, cost("adapt", family.one_head(base, n))),
                  (f"bl_small{at}", "adapt", n, cost("adapt", family.one_head(base, n)))]
    rows = []
    for system, step, layers, f in steps:
        paper = total_flops(f(True), global_batch, train.train_iters)
        exact = total_flops(f(False), global_batch, train.train_iters)
        rows.append({"system": system, "step": step, "num_layers": layers, "p": p, "eflops_paper": paper / 1e18,
                     "eflops_exact": exact / 1e18, "v100_days": device_days(paper), "device": device,
                     "days_exact": device_days(exact, device)})
    return rows


def paper_rows() -> list[dict]:
    """`flops_rows` at the paper's settings (RoBERTa-base shape, V = 50,000)."""
    train = TrainConfig(train_iters=PAPER["updates"], seq_length=PAPER["seq_length"], mask_prob=PAPER["mask_prob"])
    family, model, _ = find_preset("roberta-base")
    return flops_rows(family, model, train, PAPER["global_batch"])


def format_flops_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    width = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(width[k]) for k in keys)]
    lines += ["  ".join(_fmt(r[k]).ljust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# --- time to near-maximal performance ----------------------------------------------------------

@dataclasses.dataclass
class Hit:
    """When a curve first reaches a target: `estimate` by linear interpolation between the last
    checkpoint below and the first at or above it; `lower`/`upper` are those two checkpoints'
    compute (lower = 0 when the first checkpoint already reaches it, paper A.4). None: never."""
    estimate: float
    lower: float
    upper: float


def time_to_target(points: list[tuple[float, float]], target: float) -> Hit | None:
    """points: (compute, score) per checkpoint, any order. Compute may be updates, FLOPs or
    device-days; the result is in the same unit."""
    pts = sorted(points)
    prev = None
    for x, y in pts:
        if y >= target:
            if prev is None:  # reached before the first checkpoint: its compute is the estimate
                return Hit(estimate=x, lower=0.0, upper=x)
            x0, y0 = prev
            return Hit(estimate=x0 + (target - y0) / (y - y0) * (x - x0), lower=x0, upper=x)
        prev = (x, y)
    return None


def near_max_target(baseline_final: float) -> float:
    return NEAR_MAX * baseline_final


def mean_speedup(baseline: dict[str, float | None], system: dict[str, float | None]) -> tuple[float | None, int]:
    """Mean over languages of baseline_time / system_time (paper footnote 6: the mean of ratios,
    not the ratio of means). Languages where either never reaches the target are left out;
    returns (mean or None, number of languages averaged). `speedup_over` also counts the
    languages a system never reaches: a mean over the others alone flatters it."""
    ratios = [baseline[k] / system[k] for k in baseline
              if baseline.get(k) is not None and system.get(k) is not None and system[k] > 0]
    return (sum(ratios) / len(ratios) if ratios else None), len(ratios)


@dataclasses.dataclass
class Speedup:
    """A system's speedup over the baseline for one task: `mean` (mean_speedup) over the
    `reached` languages where both reach the target, and the `never` languages where the
    baseline reaches it and the system never does (no speedup there: it failed)."""
    mean: float | None
    reached: int
    never: int

    def __str__(self) -> str:
        parts = [] if self.mean is None else [f"{self.mean:.2f}× ({self.reached} langs)"]
        parts += [f"never in {self.never} of {self.reached + self.never} langs"] if self.never else []
        return "; ".join(parts) or "-"


def speedup_over(baseline: dict[str, float | None], system: dict[str, float | None]) -> Speedup:
    """`mean_speedup`, with the languages where only the baseline reaches the target counted."""
    mean, n = mean_speedup(baseline, system)
    never = sum(1 for k in baseline if baseline[k] is not None and k in system and system[k] is None)
    return Speedup(mean, n, never)


def retention(system_avg: dict[str, float], baseline_avg: dict[str, float]) -> float:
    """Mean over tasks of system average / BL_BASE average (paper footnote 4)."""
    return sum(system_avg[t] / baseline_avg[t] for t in baseline_avg) / len(baseline_avg)


# --- evaluation results -> tables -------------------------------------------------------------------

def adapted(records: list[dict]) -> list[dict]:
    """The records of Step-2 artifacts: all but the no-adaptation ones."""
    return [r for r in records if r["system"] != NO_ADAPTATION]


def curves(records: list[dict]) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
    """(system, task, lang) -> [(flops, score)] sorted by compute, from the records of Step-2
    artifacts (the start, update 0, at 0 FLOPs)."""
    out = defaultdict(list)
    for r in adapted(records):
        out[(r["system"], r["task"], r["lang"])].append((float(r["flops"]), float(r["score"])))
    return {k: sorted(v) for k, v in out.items()}


def near_max_hits(cs: dict, baseline: str = "bl_base", device: str = "v100-paper") -> dict[tuple, Hit | None]:
    """(system, task, lang) -> when its curve first reaches 95% of `baseline`'s final score for
    that task and language, in device-days (None: never). Curves without a baseline, or without a
    trained checkpoint, are left out. The start (update 0, 0 FLOPs) is not a checkpoint here: the
    first checkpoint's compute bounds the time from above (paper A.4), and a start that already
    reaches the target is said apart (`_at_target_from_the_start`)."""
    out = {}
    for (system, task, lang), pts in cs.items():
        trained = [(device_days(x, device), y) for x, y in pts if x > 0]
        if has_target(cs, baseline, task, lang) and trained:
            out[(system, task, lang)] = time_to_target(trained, near_max_target(cs[(baseline, task, lang)][-1][1]))
    return out


def has_target(cs: dict, baseline: str, task: str, lang: str) -> bool:
    """Whether `baseline` has a curve for `task` in `lang` with a trained checkpoint (not its
    start alone: a run still training, or stopped, at update 0) whose final score is above 0: 95%
    of a score at or below 0 (a plug-in contextual gain can be negative) lies at or above it, and
    no system's time to it means anything."""
    pts = cs.get((baseline, task, lang))
    return pts is not None and pts[-1][0] > 0 and pts[-1][1] > 0


def _at_target_from_the_start(cs: dict, baseline: str, task: str, systems: list[str], langs: list[str],
                              f: str) -> list[str]:
    """'system in lang (score)' for each curve whose start (update 0) already reaches 95% of
    `baseline`'s final score: its time to the target is 0, whatever the table's checkpoints say."""
    out = []
    for s in systems:
        for lang in langs:
            pts = cs.get((s, task, lang))
            if (pts and pts[0][0] == 0 and has_target(cs, baseline, task, lang) and
                    pts[0][1] >= near_max_target(cs[(baseline, task, lang)][-1][1])):
                out.append(f"{s} in {lang} ({format(pts[0][1], f)})")
    return out


def _estimates(hits: dict, system: str, task: str, langs: list[str]) -> dict[str, float | None]:
    """lang -> `system`'s estimate (None: never reaches the target), for the languages it was
    measured in against a target: one it was never run in is no failure (speedup_over's never)."""
    return {lang: None if hits[(system, task, lang)] is None else hits[(system, task, lang)].estimate
            for lang in langs if (system, task, lang) in hits}


# How far above its chance level (records' "chance": majority class, 1/candidates, or 0 for the
# plug-in metric's contextual gain) BL_BASE must end for "95% of its final score" to mean anything.
PLUGIN_NOISE, TASK_NOISE = 0.05, 5.0  # nats, percent
# The fewest held-out pieces a plug-in gain is judged on (the head fit's verdict, the sweep's target):
# on a few pieces, a gain past PLUGIN_NOISE is as likely chance as learning.
VERDICT_PIECES = 200


def _noise(task: str) -> float:
    return PLUGIN_NOISE if is_plugin(task) else TASK_NOISE


def _score_format(task: str) -> str:
    return ".3f" if is_plugin(task) else ".1f"  # nats vs percent


def _chance(records: list[dict], task: str) -> float | None:
    vals = {r["chance"] for r in records if r["task"] == task and r.get("chance") is not None}
    return max(vals) if vals else None


def chance_by_lang(records: list[dict], task: str, langs: list[str]) -> dict[str, float] | None:
    """Each language's chance level of `task` (records' "chance": the majority class or tag of
    that language's evaluation data, 1/candidates, or 0 for the plug-in metric), or None when
    a language has none: gains over chance are then not shown."""
    out = {lang: _chance([r for r in records if r["lang"] == lang], task) for lang in langs}
    return None if any(v is None for v in out.values()) else out


def finetune_warnings(records: list[dict], task: str, positions: bool = False) -> dict[str, list[str]]:
    """system -> the warnings of the fine-tuned runs behind its `task` records (evaluate.py's
    "finetune_warnings"): that a run learned nothing (a source-language score within noise of
    chance, a loss that never dropped below the chance loss), or with `positions` that its model
    read positions its primary was never trained at (finetune.is_position_warning)."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r["task"] == task and r.get("finetune_warnings"):
            mine = out.setdefault(r["system"], [])
            mine += [w for w in r["finetune_warnings"] if w not in mine and is_position_warning(w) == positions]
    return {s: w for s, w in out.items() if w}


def ceiling_of(system: str) -> str:
    """The record name of `system`'s ceiling: Step 2 over the full model of its source
    (artifact.system_label), one per recipe, so `minijoint@4` and `minijoint` share `minijoint:full`;
    a decoder's scored at a fraction p (`minijoint p=0.25`) is measured against the ceiling scored
    at that p (`minijoint:full p=0.25`); each of several runs (`minijoint [run-a]`) against it too."""
    name, mark, p = system_of_run(system).partition(SCORED_LABEL)
    return f"{name.split('@')[0]}:full{mark}{p}"


def ceiling_among(system: str, systems, parents: dict[str, set] | None = None) -> str | None:
    """`system`'s ceiling among the record names `systems`: the one ceiling run from the directory
    that holds `system`'s run (two sweeps in one report: `minijoint:full [a/full]` and `[b/full]`;
    `parents`: each name's runs' parent directories, run_parents), else ceiling_of's (one ceiling
    run: every run of the recipe meets it). None where there is neither: with two sweeps reported
    and no directory to tell their runs by, every share reads '-'."""
    name, parents = ceiling_of(system), parents or {}
    # the directory first: a plain `minijoint:full` may be another language's sweep's, pooled with
    # this one's in the task table, where no language of `system` has a score of it; one spelt
    # alike before one whose relative spelling ends it (`sweep` ends /x/sweep and /y/sweep)
    ceilings = [c for c in (name, *runs_of(name, systems)) if c in systems]
    for alike in (lambda a, b: a == b or a.is_absolute() and b.is_absolute() and _same_dir(a, b), _same_dir):
        same = [c for c in ceilings if any(alike(a, b) for a in parents.get(system, ()) for b in parents.get(c, ()))]
        if len(same) == 1:
            return same[0]
    return name if name in systems else None


def _same_dir(a: Path, b: Path) -> bool:
    """Whether two spellings name one directory (what _run_spellings merges): equal (two absolute
    ones with '..' folded), or a relative one whose parts after its leading '..' end the other's
    (runs/a or ../runs/a, as one evaluate call was given it; /w/runs/a in another)."""
    if a.is_absolute() and b.is_absolute():
        return os.path.normpath(a) == os.path.normpath(b)
    return a == b or _ends(a, b) or _ends(b, a)


def _named(path: Path) -> tuple[str, ...]:
    """A relative path's parts after its leading '..' (directories not known here) and any '.'."""
    parts = tuple(p for p in path.parts if p != ".")
    while parts and parts[0] == "..":
        parts = parts[1:]
    return parts


def _ends(short: Path, long: Path) -> bool:
    """Whether the relative `short`'s named parts (_named) end `long`'s. '.' (a run given from
    inside its sweep's directory) names none: it ends no other directory; nor does one with '..'
    past its start."""
    parts = _named(short)
    return (bool(parts) and not short.is_absolute() and ".." not in parts and len(parts) <= len(long.parts)
            and long.parts[-len(parts):] == parts)


def run_parents(records: list[dict]) -> dict[str, set]:
    """Each record name -> the directories that hold its Step-2 runs (a sweep's output directory:
    an artifact's <dir>/<run>/embeddings/<tag>), what ceiling_among matches runs told apart by."""
    out = defaultdict(set)
    for r in records:
        if r.get("artifact"):
            out[r["system"]].add(Path(r["artifact"]).parent.parent.parent)
    return out


def plugin_markdown(records: list[dict]) -> str:
    """The plug-in metric (plugin.py: masked pieces for an encoder, next pieces for a decoder)
    with its references, per language: the unigram reference loss, and per system the
    overlap-initialised start and the last checkpoint's loss and contextual gain (unigram - loss,
    nats per scored piece), and its share of the ceiling's
    gain (`<recipe>:full`, the same source's full model) where one was run."""
    rows = [r for r in records if is_plugin(r["task"])]
    out = []
    for lang in sorted({r["lang"] for r in rows}):
        mine = [r for r in rows if r["lang"] == lang]
        last = {}
        for r in sorted(mine, key=lambda r: r["flops"]):
            last[r["system"]] = r
        objective, parents = plugin_objective(mine[0]["task"]), run_parents(mine)
        name, pieces = f"plug-in {objective.label}", objective.scored
        out += [f"## {name}, {lang}: held-out loss through the primary model (unigram reference "
                f"{mine[0]['unigram_loss']:.3f} nats on {mine[0]['masked_pieces']} {pieces})", "",
                "| system | Step-2 EFLOPs | start loss | final loss | contextual gain | share of ceiling |",
                "|---|---|---|---|---|---|"]
        for system in sorted(last, key=lambda s: (s != "bl_base", s)):
            r = last[system]
            ceiling = last.get(ceiling_among(system, last, parents))
            share = (f"{100 * r['score'] / ceiling['score']:.0f}% at {100 * r['flops'] / ceiling['flops']:.0f}% of its "
                    "compute" if ceiling and ceiling["score"] > 0 else "-")
            out.append(f"| {system} | {r['flops'] / 1e18:.3g} | {r['start_loss']:.3f} | {r['loss']:.3f} | "
                       f"{r['score']:+.3f} | {share} |")
        out.append("")
    return "\n".join(out)


# --- one scale for every tokenizer: bits per byte of the raw held-out text (bpb.py) ------------------

def bpb_rows(records: list[dict]) -> list[dict]:
    """Per language and system of the plug-in records that carry bits per byte: {lang, system,
    none (no adaptation), start (update 0), last, flops (the last checkpoint's Step-2 compute),
    first_below (the compute of the first checkpoint below no adaptation; None: none is),
    source_none, source_last (an expanded vocabulary's source text; None elsewhere), source_seen (that text may
    be text the primary trained on: heldout.pretrained_on), bytes, folds and none_folds (what the
    artifact's tokenizer and the primary's own read as one: bpb.folds)}."""
    rows = []
    mine = [r for r in records if is_plugin(r["task"]) and r.get("bpb") is not None]
    for lang in sorted({r["lang"] for r in mine}):
        for system in sorted({r["system"] for r in mine if r["lang"] == lang}, key=lambda s: (s != "bl_base", s)):
            pts = sorted((r for r in mine if (r["lang"], r["system"]) == (lang, system)),
                         key=lambda r: (r["flops"], r.get("step") or 0))
            last = pts[-1]
            below = [r["flops"] for r in pts if r["bpb"] < r["none_bpb"]]
            rows.append({"lang": lang, "system": system, "none": last["none_bpb"], "start": last["start_bpb"],
                         "last": last["bpb"], "flops": float(last["flops"]), "first_below": below[0] if below else None,
                         "source_none": last.get("source_none_bpb"), "source_last": last.get("source_bpb"),
                         "source_seen": last.get("source_bpb_pretrained_on"), "bytes": last["bpb_bytes"],
                         "folds": last.get("bpb_folds") or [], "none_folds": last.get("none_bpb_folds") or [],
                         "unknown": last.get("bpb_unknown_share"), "none_unknown": last.get("none_bpb_unknown_share")})
    return rows


UNKNOWN_NOTE = 0.25  # a share of <unk> pieces over which a bits-per-byte verdict says a tokenizer misses the text


def bpb_verdict(lang: str, rows: list[dict]) -> str:
    """One line: in `lang`, which systems' adapted models read the held-out text better than no
    adaptation, by how many bits per byte, and from what Step-2 compute on."""
    out = []
    for r in rows:
        d = r["none"] - r["last"]
        if d > 0:
            first = (f", first below it at {r['first_below'] / 1e18:.3g} EFLOPs" if r["first_below"] is not None and
                     r["first_below"] < r["flops"] else "")
            out.append(f"{r['system']} beats no adaptation by {d:.3f} bits per byte ({r['last']:.3f} against "
                       f"{r['none']:.3f}) at {r['flops'] / 1e18:.3g} EFLOPs of Step 2{first}")
        else:
            out.append(f"{r['system']} does not beat no adaptation ({r['last']:.3f} bits per byte against "
                       f"{r['none']:.3f}) after {r['flops'] / 1e18:.3g} EFLOPs of Step 2")
    # A tokenizer that reads much of the text as <unk> pays 8 bits a byte there (docs/bits-per-byte.md):
    # its score says first that it does not cover the text
    shares = [("no adaptation", max(r.get("none_unknown") or 0.0 for r in rows))]
    shares += [(r["system"], r.get("unknown") or 0.0) for r in rows]
    poor = [f"{who}'s tokenizer reads {share:.0%} of its pieces as <unk>" for who, share in shares
            if share > UNKNOWN_NOTE]
    note = f" ({'; '.join(poor)}: it does not cover the text)" if poor else ""
    return f"{lang}: " + "; ".join(out) + "." + note


def mixed_scales(records: list[dict]) -> str | None:
    """How bits-per-byte records of one language differ in what they were scored on (None: they
    do not): the held-out bytes, the text itself (`bpb_text`, recorded since 2026-12-04: as many
    bytes of another split), or the window (`--seq_length`, recorded since 2026-12-02); a record
    from before a field matches any."""
    sizes = sorted({r["bpb_bytes"] for r in records})
    texts = {r["bpb_text"] for r in records if r.get("bpb_text") is not None}
    windows = sorted({r["bpb_seq_length"] for r in records if r.get("bpb_seq_length") is not None})
    parts = ([f"on {' and '.join(f'{b:,}' for b in sizes)} held-out bytes"] if len(sizes) > 1 else
             [f"on {len(texts)} different held-out texts of as many bytes"] if len(texts) > 1 else [])
    parts += [f"at windows of {' and '.join(map(str, windows))} positions"] if len(windows) > 1 else []
    return " and ".join(parts) or None


def bpb_markdown(records: list[dict]) -> str:
    """The plug-in records in bits per byte of the same held-out text, per language: no
    adaptation (the primary model with its own tokenizer and embeddings), each system's update 0
    and last checkpoint, what it bought, an expanded vocabulary's cost on source text; then the
    verdict line of each language. Empty when no record carries bits per byte."""
    rows = bpb_rows(records)
    if not rows:
        return ""
    source = any(r["source_last"] is not None for r in rows)
    out = ["## bits per byte of held-out text: adapted against no adaptation", "",
           "One scale for every tokenizer (lower is better; docs/bits-per-byte.md): the same raw held-out text "
           "through the primary model. No adaptation: its own tokenizer and embeddings. Update 0: the new "
           "embeddings as Step 2 initialised them." + (" Source text: held-out source-language text with the "
           "expanded vocabulary, against the model's own (what the new language cost the source)." if source else ""),
           "", "| lang | system | Step-2 EFLOPs | no adaptation | update 0 | last checkpoint | last − no adaptation |"
           + (" source text: own → expanded |" if source else ""), "|---" * (8 if source else 7) + "|"]
    for r in rows:
        cells = [r["lang"], r["system"], f"{r['flops'] / 1e18:.3g}", f"{r['none']:.3f}", f"{r['start']:.3f}",
                 f"{r['last']:.3f}", f"{r['last'] - r['none']:+.3f}"]
        if source:
            cells.append("-" if r["source_last"] is None else f"{r['source_none']:.4f} → {r['source_last']:.4f}"
                         + (" †" if r["source_seen"] else ""))
        out.append("| " + " | ".join(cells) + " |")
    for side, fold in (("the primary model's own tokenizer (no adaptation)", "none_folds"),
                       ("the adapted tokenizer", "folds")):
        other = "folds" if fold == "none_folds" else "none_folds"
        lost = sorted({f for r in rows for f in set(r[fold]) - set(r[other])})
        if lost:
            out += ["", fold_caveat(side, lost, [])]
    if any(r["source_seen"] and r["source_last"] is not None for r in rows):
        out += ["", "†: source text the primary model may have trained on (the validation split of another "
                "preparation of its pretraining corpus), not held-out text."]
    langs = dict.fromkeys(r["lang"] for r in rows)
    for lang in langs:
        scales = mixed_scales([r for r in records if r["lang"] == lang and is_plugin(r["task"])
                               and r.get("bpb") is not None])
        if scales:
            out += ["", f"Not one scale in {lang}: its records were scored {scales}, and bits per byte move with "
                    "both; score every system's checkpoints in one `mmadapt evaluate` call."]
        tokenizers = {r["heldout_tokenizer"] for r in records if r["lang"] == lang and is_plugin(r["task"])
                      and r.get("heldout_tokenizer") is not None}
        if len(tokenizers) > 1:  # (separate evaluate calls: one scores a language through one dataset's)
            out += ["", f"Per piece, not one scale in {lang}: its plug-in records were read through {len(tokenizers)} "
                    "tokenizers, so their losses and contextual gains (nats per piece, and the retention and "
                    "speedups taken from them) set pieces of other lengths side by side; compare them here, in bits "
                    "per byte."]
    out += [""] + [f"- {bpb_verdict(lang, [r for r in rows if r['lang'] == lang])} "
                   f"({_bytes_scored([r for r in rows if r['lang'] == lang])})" for lang in langs] + [""]
    return "\n".join(out)


def _bytes_scored(rows: list[dict]) -> str:
    """The held-out bytes behind a language's verdict: one count, or each system's where they
    were scored on different text (the note above says they are not on one scale)."""
    sizes = {r["bytes"] for r in rows}
    if len(sizes) == 1:
        return f"{sizes.pop():,} bytes"
    return "; ".join(f"{r['system']} on {r['bytes']:,}" for r in rows) + " bytes: not one scale"


# --- what adaptation bought: no adaptation, the start (update 0), the last checkpoint ----------------

def no_adaptation_score(records: list[dict], system: str, task: str, lang: str) -> float | None:
    """The no-adaptation score that `system`'s `task` scores in `lang` are measured against: that
    of the fine-tuned runs they were evaluated with (a no-adaptation record names their systems in
    "of"; one without it stands for every system). None: the records hold none."""
    named, every = _no_adaptation_records(records, system, task, lang)
    return float((named or every)[0]["score"]) if named or every else None


def _no_adaptation_records(records: list[dict], system: str, task: str, lang: str) -> tuple[list[dict], list[dict]]:
    """The no-adaptation records of `task` in `lang` that name `system` in their "of", and those
    that name none (every system's): a record naming it is its own runs' score, and comes first."""
    nones = [r for r in records if r["system"] == NO_ADAPTATION and r["task"] == task and r["lang"] == lang]
    return ([r for r in nones if r.get("of") is not None and system in r["of"]],
            [r for r in nones if r.get("of") is None])


def _one_no_adaptation_score(records: list[dict]) -> None:
    """Refuse two no-adaptation scores for one system, task and language (from two files, or two
    fine-tuning runs): which one its rows were measured against followed the files' order."""
    for system, task, lang in sorted({(r["system"], r["task"], r["lang"]) for r in adapted(records)}):
        named, every = _no_adaptation_records(records, system, task, lang)
        for group in (named, every):
            scores = {float(r["score"]): r["_file"] for r in group}
            if len(scores) > 1:
                (a, fa), (b, fb) = list(scores.items())[:2]
                raise ValueError(f"{system}'s {task} in {lang} has two no-adaptation scores, {a:g} ({fa}) and {b:g} "
                                 f"({fb}): one would be taken by the files' order; report the records of one "
                                 "evaluation (its fine-tuned runs) together")


def paid(last: float, none: float | None) -> bool | None:
    """Whether adaptation paid: the last checkpoint above no adaptation (None: no such score)."""
    return None if none is None else last > none


def adaptation_rows(records: list[dict], task: str) -> list[dict]:
    """Per language and system of `task`: {lang, system, none (no adaptation), start (update 0),
    last (the last checkpoint's score), paid, unknown (the largest share of the text's pieces its
    tokenizers read as <unk>)}; none and start None where the records lack them."""
    rows = []
    for (system, t, lang), pts in sorted(curves(records).items(), key=lambda kv: (kv[0][2], kv[0][0])):
        if t == task:
            none = no_adaptation_score(records, system, task, lang)
            unknown = max(float(r.get("unknown_share") or 0.0) for r in adapted(records)
                          if (r["system"], r["task"], r["lang"]) == (system, t, lang))
            rows.append({"lang": lang, "system": system, "none": none, "start": pts[0][1] if pts[0][0] == 0 else None,
                         "last": pts[-1][1], "paid": paid(pts[-1][1], none), "unknown": unknown})
    return rows


def verdict(lang: str, rows: list[dict], f: str) -> str | None:
    """One line: did adaptation pay in `lang` (rows: adaptation_rows of one language), system by
    system, and which systems' tokenizers cannot read the text (data.UNKNOWN_REFUSE: their scores
    say nothing of the adaptation); None without a no-adaptation score."""
    known = [r for r in rows if r["paid"] is not None]
    if not known:
        return None
    unread = [r for r in known if r.get("unknown", 0.0) > UNKNOWN_REFUSE]
    note = "".join(f" {r['system']}'s tokenizer reads {r['unknown']:.0%} of the {lang} text's pieces as <unk>: the "
                   "file is not text it covers, and the score says nothing of the adaptation." for r in unread)
    return _paid_line(lang, known, f) + note


def _paid_line(lang: str, known: list[dict], f: str) -> str:
    gains = {r["system"]: format(r["last"] - r["none"], "+" + f) for r in known}
    yes, no = [r for r in known if r["paid"]], [r for r in known if not r["paid"]]
    if not no:
        return (f"{lang}: adaptation paid for every system (" + ", ".join(f"{s} {g}" for s, g in gains.items()) +
            " over no adaptation).")
    line = f"{lang}: adaptation did not pay for " + ", ".join(
        f"{r['system']} ({format(r['last'], f)} at its last checkpoint, {format(r['none'], f)} with no adaptation)"
        for r in no)
    return (line + ("; it paid for " + ", ".join(f"{r['system']} ({gains[r['system']]})" for r in yes) if yes else "")
        + ".")


def _mark(records: list[dict], system: str, task: str, lang: str, last: float) -> str:
    """' ↓' where `system`'s last score in `lang` is not above its no-adaptation score."""
    return " ↓" if paid(last, no_adaptation_score(records, system, task, lang)) is False else ""


def adaptation_markdown(records: list[dict], task: str) -> str:
    """`task`'s scores beside what they are measured against, per language and system: the
    fine-tuned model with no adaptation, the new embeddings at their start (update 0) and at the
    last checkpoint; a last score not above no adaptation marked ↓; then one line per language
    saying whether adaptation paid. Empty when the records hold neither reference."""
    rows = adaptation_rows(records, task)
    if all(r["none"] is None and r["start"] is None for r in rows):
        return ""
    f = _score_format(task)

    def cell(v: float | None, sign: str = "") -> str:
        return "-" if v is None else format(v, sign + f)

    with_none = any(r["none"] is not None for r in rows)  # a task's records, not the plug-in metric's or retrieval's
    out = [f"## {task}: what adaptation bought", "",
           ("No adaptation: the fine-tuned model with its own (source) tokenizer and embeddings on the target text, "
            "no Step 2; ↓: the last checkpoint is not above it. " if with_none else "")
           + "Update 0: the new embeddings as Step 2 initialised them, before any update.", "",
           "| lang | system | " + ("no adaptation | " if with_none else "") + "update 0 | last checkpoint |"
           + (" last − no adaptation |" if with_none else ""), "|---" * (6 if with_none else 4) + "|"]
    for r in rows:
        cells = ([r["lang"], r["system"]] + ([cell(r["none"])] if with_none else []) +
            [cell(r["start"]), cell(r["last"]) + (" ↓" if r["paid"] is False else "")])
        cells += [cell(None if r["none"] is None else r["last"] - r["none"], "+")] if with_none else []
        out.append("| " + " | ".join(cells) + " |")
    langs = dict.fromkeys(r["lang"] for r in rows)
    lines = [verdict(lang, [r for r in rows if r["lang"] == lang], f) for lang in langs]
    out += [""] + [f"- {line}" for line in lines if line] + [""]
    return "\n".join(out)


def choose_baseline(records: list[dict]) -> tuple[str, str | None]:
    """The system a report measures against when none is named: BL_BASE (the paper's), else the
    one whose last checkpoints spent the most Step-2 compute (mean over its curves): Step 2 over
    a full model, as BL_BASE's, or a ceiling `<recipe>:full`. -> (system, why; None for BL_BASE)."""
    cs = curves(records)
    if any(k[0] == "bl_base" for k in cs):
        return "bl_base", None
    cost = defaultdict(list)
    for (system, _, _), pts in cs.items():
        cost[system].append(pts[-1][0])
    runs = runs_of("bl_base", cost)
    best = max(runs or sorted(cost), key=lambda s: sum(cost[s]) / len(cost[s]))
    if runs:  # "no bl_base in the records" said of records that hold several of its runs
        return best, (f"bl_base has {len(runs)} runs in the records, told apart by their directories "
                      f"({', '.join(runs)}): the one with the most Step-2 compute")
    return best, ("the only system in the records" if len(cost) == 1 else
                  "no bl_base in the records: the system with the most Step-2 compute")


def _split_baseline(t: "TaskScores", baseline: str) -> str | None:
    """One sentence where `baseline` has no score in some of the task's languages because its runs
    there were told apart (two seeds or starts: evaluate.apart_runs names them `bl_base [run]`):
    those languages have no target, and every average against the baseline leaves them out."""
    def has(system: str, i: int) -> bool:
        return system in t.final and t.final[system][i] is not None

    split = {lang: [s for s in runs_of(baseline, t.final) if has(s, i)]
             for i, lang in enumerate(t.langs) if not has(baseline, i)}
    split = {lang: runs for lang, runs in split.items() if runs}
    if not split:
        return None
    return ("No " + baseline + " target in " + ", ".join(split) + ": " + "; ".join(
        f"{len(runs)} runs of {baseline} in {lang} ({', '.join(runs)})" for lang, runs in split.items())
        + ", told apart by their directories; pass --baseline with one of them, or report each run's records "
        "apart")


def report_markdown(records: list[dict], baseline: str = "bl_base", device: str = "v100-paper") -> str:
    """Table-2-style final scores, and Table-3-style device-days to near-maximal performance
    (estimate and lower-upper bounds) with the mean per-language speedup, per task. A task's
    retention column is a system's average over languages / BL_BASE's; with several tasks, the
    paper's retention (footnote 4: the mean of those ratios over tasks) follows. Where the
    records hold no-adaptation scores or starts (update 0), each task's scores are shown beside
    them (`adaptation_markdown`), and a last score not above no adaptation is marked ↓."""
    everything, records = records, adapted(records)
    cs = curves(records)
    systems = sorted({k[0] for k in cs}, key=lambda s: (s != baseline, s))
    tasks = sorted({k[1] for k in cs})
    if baseline not in systems:
        raise ValueError(f"the results hold no {baseline} runs: the near-maximal target is 95% of its final score; "
                         f"pass --baseline with one of their systems ({', '.join(systems)})")
    hits = near_max_hits(cs, baseline, device)
    out, per_task = [], {}
    for task in tasks:
        t = TaskScores.of(records, cs, task, systems)
        per_task[task] = t
        out += _final_table(t, everything, baseline, device)
        bought = adaptation_markdown(everything, task)
        out += ["", bought.rstrip("\n")] if bought else []
        per_byte = bpb_markdown([r for r in everything if r["task"] == task])
        out += ["", per_byte.rstrip("\n")] if per_byte else []
        out += _near_max_section(t, cs, hits, baseline, device)
    if len(tasks) > 1:  # the paper's single retention number (footnote 4): the mean of the per-task ones
        out += [f"## retention against {baseline}, mean over tasks ({', '.join(tasks)})", "",
                "| system | retention |", "|---|---|"]
        for s in [s for s in systems if all(s in per_task[t].final for t in tasks)]:
            # each over the languages both have; "-" where one task has none, or no baseline above 0
            ret = sum(per_task[t].retention(s, baseline) for t in tasks) / len(tasks)
            out.append(f"| {s} | {_percent(ret)} |")
        out.append("")
    return "\n".join(out)


@dataclasses.dataclass
class TaskScores:
    """One task's numbers behind `report_markdown`'s tables: its languages and systems, each
    system's last score per language (None: not run there), their average, its Step-2 cost (the
    compute at the last checkpoint, mean over languages, as in Table 2), the chance level per
    language (None: the records hold none) and each system's average gain over it."""
    task: str
    langs: list[str]
    systems: list[str]
    final: dict[str, list[float | None]]
    avg: dict[str, float]
    cost: dict[str, float]
    floors: dict[str, float] | None
    gain: dict[str, float]
    warned: dict[str, list[str]]  # system -> its fine-tuned runs' warnings that they learned nothing
    positions: dict[str, list[str]]  # system -> that they read untrained positions (no "(!)": a caveat)

    @classmethod
    def of(cls, records: list[dict], cs: dict, task: str, systems: list[str]) -> "TaskScores":
        langs = sorted({k[2] for k in cs if k[1] == task})
        task_systems = [s for s in systems if any((s, task, lang) in cs for lang in langs)]
        final = {s: [cs[(s, task, lang)][-1][1] if (s, task, lang) in cs else None for lang in langs]
                 for s in task_systems}
        got = {s: [v for v in vals if v is not None] for s, vals in final.items()}
        avg = {s: sum(v) / len(v) if v else math.nan for s, v in got.items()}
        cost = {s: [cs[(s, task, lang)][-1][0] for lang in langs if (s, task, lang) in cs] for s in task_systems}
        # Where the records know the chance level, what a system learned is its gain over it: the
        # share of BL_BASE's gain (and of its ceiling's, `<recipe>:full`, where one was run) says
        # more than the ratio of scores that chance inflates. Each language's own level (a
        # majority tag differs between languages), averaged over the languages a system has.
        floors = chance_by_lang(records, task, langs)
        gain = ({} if floors is None else
                {s: sum(v - floors[lang] for v, lang in zip(final[s], langs) if v is not None) / len(got[s])
                 if got[s] else math.nan for s in task_systems})
        return cls(task, langs, task_systems, final, avg, {s: sum(v) / len(v) for s, v in cost.items()}, floors,
                   gain, finetune_warnings(records, task), finetune_warnings(records, task, positions=True))

    def shared(self, s: str, of: str) -> list[int]:
        """The languages (indices into langs) where both `s` and `of` have a score."""
        if of not in self.final:  # `of` was not run on this task
            return []
        return [i for i, (a, b) in enumerate(zip(self.final[s], self.final[of])) if a is not None and b is not None]

    def shared_avgs(self, s: str, of: str) -> tuple[float, float]:
        """`s`'s and `of`'s averages over the languages both have (nan where they share none): a
        system without a hard language must not look better than one with it."""
        both = self.shared(s, of) if of in self.final else []
        if not both:
            return math.nan, math.nan
        return tuple(sum(self.final[x][i] for i in both) / len(both) for x in (s, of))

    def retention(self, s: str, of: str) -> float:
        """retention() of `s` against `of` on this task, over the languages both have."""
        mine, theirs = self.shared_avgs(s, of)  # (nan where `of` has no score: not run on this task)
        return retention({self.task: mine}, {self.task: theirs}) if theirs > 0 else math.nan

    def gain_share(self, s: str, of: str) -> float:
        """`s`'s gain over chance as a share of `of`'s, over the languages both have (nan where
        `of` gained nothing there, or they share none)."""
        both = self.shared(s, of) if of in self.final else []
        lang = [self.langs[i] for i in both]
        theirs = sum(self.final[of][i] - self.floors[l] for i, l in zip(both, lang)) if self.floors else 0.0
        return sum(self.final[s][i] - self.floors[l] for i, l in zip(both, lang)) / theirs if theirs > 0 else math.nan


def _percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


def _final_table(t: TaskScores, everything: list[dict], baseline: str, device: str) -> list[str]:
    """Table 2 for one task: each system's last score per language (↓ where not above no
    adaptation, from `everything`, the records with the no-adaptation ones), average,
    retention and, with a chance level, the gain over it and its share of the baseline's (and
    the ceiling's); then the notes under it."""
    f, floors, gain = _score_format(t.task), t.floors, t.gain
    parents = run_parents([r for r in everything if r["task"] == t.task])
    ceilings = {s: ceiling_among(s, t.avg, parents) for s in t.systems}
    with_ceiling = floors is not None and any(c is not None for c in ceilings.values())
    extra = [] if floors is None else ["gain over chance", f"share of {baseline}'s gain"]
    extra += ["share of the ceiling's gain"] if with_ceiling else []
    out = [f"## {t.task}: score at the last checkpoint", ""]
    if floors is None:
        out += ["No chance level in these records: retention is a ratio of raw scores, which a high chance "
                "level inflates.", ""]
    else:
        levels = sorted(set(floors.values()))
        out += ["Chance level (the evaluation data's majority class or tag; 0 for the plug-in metric): "
                + ", ".join(f"{lang} {format(floors[lang], f)}" for lang in t.langs) + "."
                if len(levels) > 1 else f"Chance level: {format(levels[0], f)}.", ""]
    out += [f"| system | Step-2 EFLOPs | {device} days | " + " | ".join(t.langs + ["avg", "retention"] + extra)
            + " |", "|---" * (len(t.langs) + 5 + len(extra)) + "|"]

    def share(s: str, of: str | None) -> str:
        part = float("nan") if of is None else t.gain_share(s, of)
        return "-" if math.isnan(part) else f"{100 * part:.0f}%"

    marks = {s: [_mark(everything, s, t.task, lang, v) if v is not None else "" for v, lang in zip(t.final[s], t.langs)]
             for s in t.systems}

    def count(s: str) -> int:  # the languages `s` has a score in
        return sum(v is not None for v in t.final.get(s, []))

    # a system whose retention and shares are over fewer languages than its own average or the baseline's
    fewer = [s for s in t.systems
             if baseline in t.final and len(t.shared(s, baseline)) < max(count(s), count(baseline))]
    for s in t.systems:
        ret = t.retention(s, baseline)
        cells = [] if floors is None else [format(gain[s], "+" + f), share(s, baseline)]
        cells += [share(s, ceilings[s])] if with_ceiling else []
        out.append(f"| {s}{' (!)' if s in t.warned else ''} | {t.cost[s] / 1e18:.3g} | "
                   f"{device_days(t.cost[s], device):.3g} | " +
                   " | ".join(["-" if v is None else format(v, f) + m for v, m in zip(t.final[s], marks[s])]
                              + [format(t.avg[s], f), _percent(ret) + ('*' if s in fewer else '')]
                              + cells)
                   + " |")
    if baseline not in t.final:
        out += ["", f"No {baseline} records for {t.task}: no retention or share of its gain."]
    split = _split_baseline(t, baseline)
    out += ["", split + "."] if split else []
    if fewer:
        out += ["", f"*: retention and shares over the languages it shares with {baseline} (its average over its "
                "own): " + "; ".join(
                    f"{s} has {', '.join(t.langs[i] for i in t.shared(s, baseline)) or 'none of them'}"
                    for s in fewer) + "."]
    if any(any(m) for m in marks.values()):
        out += ["", "↓: not above the same fine-tuned model with no adaptation in that language (what adaptation "
                "bought, below)."]
    for s, warnings in t.warned.items():
        out += ["", f"(!) {s}: from fine-tuned runs that learned nothing measurable in the source language, so "
                f"its zero-shot scores say nothing about its embeddings: " + "; ".join(warnings)]
    for s, warnings in t.positions.items():
        out += ["", f"{s}: from fine-tuned runs that read positions their primary model never trained at: "
                + "; ".join(warnings)]
    return out


def _near_max_section(t: TaskScores, cs: dict, hits: dict, baseline: str, device: str) -> list[str]:
    """Table 3 for one task: each system's device-days to near-maximal performance per language,
    its mean speedup over `baseline` and the languages it never reaches; or one line saying why
    that is not meaningful (the baseline's gain within noise of the chance level)."""
    f, task, langs = _score_format(t.task), t.task, t.langs
    if baseline not in t.final:
        return ["", f"## {task}: {device} days to near-maximal performance: no {baseline} records for {task}, so no "
                f"target (95% of its final score)", ""]
    if t.floors is not None and t.gain[baseline] <= _noise(task):
        return ["", f"## {task}: {device} days to near-maximal performance: not meaningful here ({baseline}'s "
                f"final average {format(t.avg[baseline], f)} is within noise of the chance level: "
                f"{format(t.gain[baseline], '+' + f)} over it)", ""]
    # "never": the system's curve does not reach the target in that language. The speedup is
    # the mean over the languages it does reach, and beside it how many it never reaches.
    out = ["", f"## {task}: {device} days to near-maximal performance (95% of {baseline}'s final score)", "",
           "| system | " + " | ".join(langs) + " | speedup | never reaches |", "|---" * (len(langs) + 3) + "|"]
    base_times = _estimates(hits, baseline, task, langs)
    for s in t.systems:
        cells = [_hit_cell(hits, (s, task, lang)) for lang in langs]
        mine = _estimates(hits, s, task, langs)
        speed = speedup_over(base_times, mine)
        missed = [lang for lang in langs if (s, task, lang) in hits and mine[lang] is None]
        cells += ["-" if speed.mean is None else f"{speed.mean:.2f}× ({speed.reached} langs)",
                  f"{len(missed)} ({', '.join(missed)})" if missed else "0"]
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    none = [lang for lang in langs if (baseline, task, lang) in cs and not has_target(cs, baseline, task, lang)]
    untrained = [lang for lang in none if cs[(baseline, task, lang)][-1][0] == 0]
    below = [lang for lang in none if lang not in untrained]
    out += ["", f"No target in {', '.join(below)}: {baseline}'s final score there is not above 0."] if below else []
    out += ["", f"No target in {', '.join(untrained)}: {baseline} has no trained checkpoint there (its start, "
            "update 0, alone)."] if untrained else []
    split = _split_baseline(t, baseline)
    out += ["", split + "."] if split else []
    early = _at_target_from_the_start(cs, baseline, task, t.systems, langs, f)
    out += ["", "Already at the target before any Step-2 update (the start, update 0, which the table does not "
            "count as a checkpoint): " + "; ".join(early) + "."] if early else []
    return out + [""]


def _hit_cell(hits: dict, key: tuple) -> str:
    """A cell of the near-maximal table: '-' (no such curve, or no baseline for it), 'never', or
    the estimate in device-days with its bounds."""
    if key not in hits:
        return "-"
    hit = hits[key]
    return "never" if hit is None else f"{hit.estimate:.3g} ({hit.lower:.3g}–{hit.upper:.3g})"


# --- plots (matplotlib, an optional dependency: pip install -e ".[plot]") ------------------------------

COLORS = {"bl_base": "C0", "minijoint": "C1", "minipost": "C2", "bl_small": "C3", "minijoint:full": "C4"}  # one colour per system


def system_colors(records: list[dict]) -> dict[str, object]:
    """A colour for every system of `records`, the same in every plot: the paper's systems their
    own (COLORS), the others (`minijoint@2`, `bl_base [run-a]`, `minijoint p=0.25`) the next
    colours no system has (matplotlib's cycle restarted at C0 for them: minijoint@2 in bl_base's)."""
    import matplotlib

    systems = sorted({r["system"] for r in records} | {s for r in records for s in r.get("of") or []})
    palette = [f"C{i}" for i in range(10)] + [matplotlib.colormaps["tab20b"](i) for i in range(20)]
    free = [c for c in palette if c not in COLORS.values()]
    out = {s: COLORS[s] for s in systems if s in COLORS}
    for i, s in enumerate(s for s in systems if s not in COLORS):
        out[s] = free[i % len(free)]
    return out


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, **kw) -> None:
    """`fig` as a PNG at `path`, whole or not at all (checkpoint.atomic_write): savefig straight to
    the file left half a PNG where it failed, and the rerun refused the directory as holding it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kw)
    atomic_write(Path(path), buf.getvalue())


# The compute axis of plot_curves: device-days where a run reaches a hundredth of one (the paper's
# figures), else FLOPs with the largest prefix that keeps them >= 1 (a CPU demo's Step 2 is
# ~1e-6 V100-days: a matplotlib offset of "1e-6" on days reads as nonsense).
FLOP_UNITS = (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6))


def compute_axis(max_flops: float, device: str = "v100-paper") -> tuple[float, str]:
    """(FLOPs per unit, axis label) for Step-2 compute up to `max_flops`."""
    if device_days(max_flops, device) >= 0.01:
        return max_flops / device_days(max_flops, device), f"Step-2 compute ({device} days)"
    name, size = next(((n, v) for n, v in FLOP_UNITS if max_flops >= v), FLOP_UNITS[-1])
    return size, f"Step-2 compute ({name})"


def _bpb_panel(ax, records: list[dict], systems: list[str], unit: float, colors: dict) -> None:
    """One language's plug-in records in bits per byte against Step-2 compute: a line per system
    from its start (update 0) at 0 FLOPs, no adaptation dash-dotted."""
    for system in systems:
        mine = sorted((r for r in records if r["system"] == system and r.get("bpb") is not None),
                      key=lambda r: (r["flops"], r.get("step") or 0))
        if not mine:
            continue
        pts = [(float(r["flops"]), r["bpb"]) for r in mine]
        if pts[0][0] > 0:
            pts = [(0.0, mine[0]["start_bpb"]), *pts]
        ax.plot([x / unit for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=system,
                color=colors[system])
    # one line per primary model (the demo scores three): its own tokenizer and embeddings, beside
    # the systems whose embeddings went into it
    nones = defaultdict(list)
    for r in records:
        if r.get("bpb") is not None and r["system"] not in nones[r["none_bpb"]]:
            nones[r["none_bpb"]].append(r["system"])
    for value, of in nones.items():
        ax.axhline(value, color="black" if len(nones) == 1 else colors.get(of[0], "gray"), ls="-.", lw=1.0,
                   label="no adaptation (own tokenizer and embeddings)" if len(nones) == 1 else
                   f"no adaptation ({', '.join(sorted(of))}'s primary model)")


def plot_curves(records: list[dict], path, device: str = "v100-paper", baseline: str = "bl_base") -> bool:
    """Figure-3 style: score against Step-2 compute, one panel per task and language, one line per
    system from its start (update 0) at 0 FLOPs, the `baseline`'s near-maximal target dashed (the
    tables' target: report --baseline), the chance
    level (or unigram reference) dotted and each fine-tuned model with no adaptation dash-dotted,
    one legend for the figure. Writes nothing and returns False when there are no
    records."""
    if not records:
        return False
    plt = pyplot()
    cs = curves(records)
    panels = [(task, lang, "score") for task, lang in sorted({(k[1], k[2]) for k in cs})]
    panels += [(task, lang, "bpb") for task, lang in sorted({(r["task"], r["lang"]) for r in records
                                                             if is_plugin(r["task"]) and r.get("bpb") is not None})]
    systems, colors = sorted({k[0] for k in cs}), system_colors(records)
    unit, xlabel = compute_axis(max(x for pts in cs.values() for x, _ in pts), device)
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, (task, lang, kind) in zip(axes.flat, panels):
        if kind == "bpb":
            _bpb_panel(ax, [r for r in records if r["task"] == task and r["lang"] == lang], systems, unit, colors)
            ax.set_title(f"{task} · {lang} · bits per byte", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("bits per byte (lower is better)", fontsize=8)
            ax.tick_params(labelsize=7)
            continue
        for system in systems:
            pts = cs.get((system, task, lang))
            start = [r["start_gain"] for r in records if r["task"] == task and r["lang"] == lang
                     and r["system"] == system and "start_gain" in r]
            if pts and start and pts[0][0] > 0:  # a run recorded without its update-0 artifact: its start
                pts = [(0.0, start[0]), *pts]
            if pts:
                ax.plot([x / unit for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=system,
                        color=colors[system])
        for r in records:  # each fine-tuned model with no adaptation, in the colour of its first system
            if r["system"] == NO_ADAPTATION and r["task"] == task and r["lang"] == lang:
                of = r.get("of") or []
                ax.axhline(r["score"], color=colors.get(of[0], "gray") if of else "gray", ls="-.", lw=1.0,
                           label=f"no adaptation ({', '.join(of)}'s fine-tuned model)" if of else "no adaptation")
        if has_target(cs, baseline, task, lang):
            ax.axhline(near_max_target(cs[(baseline, task, lang)][-1][1]), color="gray", ls="--", lw=0.8,
                       label=f"near-max target (95% of {baseline}'s final)")
        floor = _chance([r for r in records if r["lang"] == lang], task)
        if floor is not None:
            ax.axhline(floor, color="black", ls=":", lw=0.8,
                       label="unigram reference" if is_plugin(task) else "chance")
        ax.set_title(f"{task} · {lang}", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("contextual gain (nats)" if is_plugin(task) else "score", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = {}  # one entry per label, from every panel: systems, target, chance / unigram reference
    for ax in axes.flat:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    labels = [l for l in handles if not l.startswith("_")]
    ncol = min(len(labels), max(1, round(1.8 * cols)))  # about 2 inches an entry: the figure's width
    legend_rows = math.ceil(len(labels) / ncol)
    fig.legend([handles[l] for l in labels], labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.16 * legend_rows / (2.8 * rows), 1, 1))
    save_figure(fig, path, dpi=120, bbox_inches="tight")  # the legend's longest row can be wider than the panels
    plt.close(fig)
    return True


def speedup_table(records: list[dict], baseline: str = "bl_base", device: str = "v100-paper"
                  ) -> dict[tuple[str, str], Speedup]:
    """(system, task) -> its Speedup over `baseline` to near-maximal performance: the mean over
    the languages it reaches, and how many it never reaches."""
    hits = near_max_hits(curves(records), baseline, device)
    out = {}
    for system, task in sorted({(k[0], k[1]) for k in hits if k[0] != baseline}):
        langs = sorted({k[2] for k in hits if k[1] == task})
        out[(system, task)] = speedup_over(_estimates(hits, baseline, task, langs),
                                           _estimates(hits, system, task, langs))
    return out


def speedups(records: list[dict], baseline: str = "bl_base", device: str = "v100-paper") -> dict[tuple[str, str], float]:
    """(system, task) -> mean per-language speedup over `baseline` to near-maximal performance,
    over the languages where the system reaches it (speedup_table also counts the others)."""
    return {k: v.mean for k, v in speedup_table(records, baseline, device).items() if v.mean is not None}


def plot_speedup(records: list[dict], path, baseline: str = "bl_base", device: str = "v100-paper") -> bool:
    """Figure-1 style: mean per-language speedup over BL_BASE, grouped by task; a system that
    never reaches the target in some languages is marked above its bar ("never k/n"). Writes
    nothing and returns False when no system has a speedup (none but the baseline, or none
    reaches the target)."""
    sp = speedup_table(records, baseline, device)
    if not any(v.mean is not None for v in sp.values()):
        return False
    plt = pyplot()
    tasks = sorted({t for _, t in sp})
    systems, colors = sorted({s for s, _ in sp}), system_colors(records)
    fig, ax = plt.subplots(figsize=(1.2 + 1.4 * max(1, len(tasks)), 3.0))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(tasks))]
        got = [sp.get((system, t)) for t in tasks]
        ax.bar(xs, [0.0 if g is None or g.mean is None else g.mean for g in got], width, label=system,
               color=colors[system])
        for x, g in zip(xs, got):
            if g is not None and g.never:  # the bar is the mean over the other languages only
                ax.annotate(f"never {g.never}/{g.reached + g.never}", (x, 0.0 if g.mean is None else g.mean),
                            xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=6,
                            rotation=90, color="darkred")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
    ax.set_ylabel(f"speedup over {baseline}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


__all__ = ["DEVICE_TFLOPS", "NO_ADAPTATION", "PAPER", "Hit", "Speedup", "adapted", "adaptation_markdown", "flops_rows",
           "paper_rows", "time_to_target", "mean_speedup", "speedup_over", "retention", "choose_baseline",
           "report_markdown", "speedups", "speedup_table", "compute_axis", "plot_curves", "plot_speedup"]
