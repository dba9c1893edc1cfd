"""Step-4 evaluation: time inside the model's forward passes and outside them, new path vs old.

    OMP_NUM_THREADS=1 python benchmarks/eval_overhead.py      # ~7 min on 2 shared CPU cores
    python benchmarks/eval_overhead.py --examples 5010 --shape roberta-base   # GPU (gpu_suite.sh)

What is evaluated: `finetune.evaluate_artifacts` (the new path) for 2 fine-tuned runs (seeds 1
and 2) x 2 Step-2 artifacts (steps 1000 and 2000 of one German adapt run: one tokenizer, as an
adapt run's checkpoints share) on 5,000 real examples: German Bible verses with their genre
(`corpora.genre_examples('de', 'train', 1000)`, 5 balanced classes, real verse lengths), read as
your own `--task classify` CSV at seq_length 128. The old path is Step 4 as it was before
(mmadapt 42b4233), replayed here: for every (artifact, seed) a model rebuilt from the swapped
state dict (fp32, on the CPU: --old_device cpu), the evaluation set encoded again, full-length
batches of 64 examples. On a GPU the replay runs on the GPU by default (--old_device cuda: the
old path moved to the device, still fp32), since roberta-base on the CPU would take most of an
hour; the new path runs in bf16 there, so the scores may differ in a few examples.

The models: --shape tiny (the CPU default), the shipped BL_BASE demo model (mmadapt/demo_models:
the tiny preset, 12 layers, h=64, V=2000) as the primary model; --shape roberta-base (the GPU
default) or cpu (benchmarks/common.py's shapes), seeded random weights of that shape, with a
German tokenizer of min(V, 8000) pieces. "Fine-tuned" runs have seeded, untrained
classification heads, artifacts random rows, all written as weights-only checkpoints. The work
of an evaluation does not depend on the weights' values, so the scores are near chance; in fp32
both paths must give the same ones (checked).

Time inside forward passes: RobertaForTask.forward wrapped in a timer (synchronised on a GPU);
outside = wall - inside, per (artifact, seed) = outside / 4. A few named steps (encoding,
loading runs, building models, scoring) are timed the same way to show where the rest goes.
This process's CPU time is reported beside the wall time: on shared cores it is the steadier
measure of the work done (other jobs' time slices count in wall time only).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, SHAPES, hardware, sync, table, write_results

from mmadapt import artifact as A
from mmadapt import evaluate as F
from mmadapt import tasks as T
from mmadapt.tokenizer import load as load_sp
from mmadapt.checkpoint import tag_for, write_weights_only
from mmadapt.devices import eval_dtype
from mmadapt.config import FinetuneConfig, ModelConfig, to_dict
from mmadapt.corpora import genre_examples, write_bible_corpus
from mmadapt.data import train_tokenizer
from mmadapt.models.roberta.model import RobertaForTask, RobertaMLM
from mmadapt.family import WORD
from mmadapt.models.roberta import ROBERTA

SHIPPED = REPO / "mmadapt" / "demo_models" / "roberta"
SEEDS, STEPS, LABELS = (1, 2), (1000, 2000), ["0", "1", "2", "3", "4"]
PAIRS = len(SEEDS) * len(STEPS)
OLD_BATCH = 64  # the old eval_batch_size default: examples per forward pass
TARGET_S = 0.5  # outside the forward passes, per (artifact, seed)
MODELS = {"tiny": "the tiny preset (the shipped BL_BASE demo model: 12 layers, h=64, V=2000)",
          "cpu": "benchmarks' cpu shape (12 layers, h=256, V=8000, seeded random weights)",
          "roberta-base": "roberta-base (12 layers, h=768, V=50,000, seeded random weights)"}


def hardware_cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def primary_model(shape: str) -> tuple[dict, dict]:
    """-> (run.json of a Step-1 run, its full weights): the shipped BL_BASE demo model for
    'tiny', else seeded random weights of SHAPES[shape] (12 layers, one head)."""
    if shape == "tiny":
        blob = torch.load(SHIPPED / "bl_base.pt", map_location="cpu", weights_only=False)
        return blob["run"], blob["state"]
    cfg = dataclasses.replace(SHAPES[shape], head_layers=(SHAPES[shape].num_layers,))
    # A Step-1 record names its block length (Step 4's position check reads it): Step 3's default.
    train = {"train_iters": 1, "seq_length": FinetuneConfig.seq_length}
    return ({"step": "pretrain", "recipe": "bl_base", "model": to_dict(cfg), "train": train},
            RobertaMLM(cfg).state_dict())


def build_runs(root: Path, examples: int, shape: str) -> tuple[list[Path], Path, str]:
    """The primary run, 2 fine-tuned runs, one adapt run with 2 artifacts and the evaluation CSV
    under `root` -> (fine-tuned runs, adapt run, evaluation file spec with {lang})."""
    run, state = primary_model(shape)
    primary = root / "primary"
    updates = run["train"]["train_iters"]
    write_weights_only(primary / "checkpoints", updates, state, run["model"])
    (primary / "tokenizer").mkdir()
    shutil.copyfile(SHIPPED / "spm.model", primary / "tokenizer" / "spm.model")  # unused by Step 4
    (primary / "run.json").write_text(json.dumps(run))
    del state

    model = dataclasses.replace(ModelConfig(**run["model"]), head_layers=(), head_weights=())
    finetuned = []
    for seed in SEEDS:
        run = root / f"ft-seed{seed}"
        head = ROBERTA.build_task_model(model, T.get_task("classify").kind, len(LABELS), seed).state_dict()
        write_weights_only(run / "checkpoints", 1, {k: v for k, v in head.items() if k != WORD}, to_dict(model))
        (run / "run.json").write_text(json.dumps({
            "step": "finetune", "task": "classify", "labels": LABELS, "metric": "accuracy", "updates": 1,
            "primary": {"run_dir": str(primary), "tag": tag_for(updates)}, "model": to_dict(model),
            # Timing only: the shapes need not have pretrained at Step 3's length.
            "finetune": to_dict(FinetuneConfig(seed=seed, allow_untrained_positions=True))}))
        finetuned.append(run)

    # The tiny model's 2000 pieces from 10 books (as measured first); larger: the whole Bible.
    corpus = write_bible_corpus("de", root / "de.txt", books=range(1, 11) if shape == "tiny" else None)
    tokenizer = train_tokenizer(corpus, root / "spm_de", min(model.vocab_size, 8000))
    adapt = root / "adapt-de"
    for step in STEPS:
        g = torch.Generator().manual_seed(step)
        meta = {"system": "bl_base", "lang": "de", "step": step, "flops": 1.0, "flops_paper": 1.0, "v100_days": 0.0,
                "tokens": 1, "source": str(primary)}
        emb = torch.randn(model.vocab_size, model.hidden_size, generator=g) * model.init_method_std
        A.write_artifact(adapt / "embeddings" / tag_for(step),
                         {"word_embeddings": emb, "output_bias": torch.zeros(model.vocab_size)}, tokenizer, meta)

    rows = genre_examples("de", "train", examples // len(LABELS))
    for name, part in (("genre", rows), ("warmup", rows[::50])):
        with open(root / f"{name}.de.csv", "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(part)
    return finetuned, adapt, str(root / "genre.{lang}.csv")


def old_path(finetuned: list[Path], artifacts: list[Path], eval_spec: str, device: str) -> list[list[dict]]:
    """Step 4 before this change: per (artifact, seed) a rebuilt fp32 model (on the CPU, as it
    was; or moved to `device`), a new encoding, full-length batches of OLD_BATCH examples.
    -> per artifact, each seed's scores."""
    runs = [F.load_finetuned(r) for r in finetuned]
    cfgs = [F.recorded_config(ft) for ft in runs]
    task, labels = runs[0].task, runs[0].labels
    out, examples = [], {}
    for path in F.artifact_dirs(artifacts):
        emb, tok, meta = A.read_artifact(path)
        lang = meta["lang"]
        if lang not in examples:
            examples[lang] = T.read_examples(task, eval_spec, lang, "test", cfgs[0], labels)
        seeds = []
        for ft, cfg in zip(runs, cfgs):
            state = {**ft.state, WORD: F.artifact_embeddings(emb, ft.state[WORD])}
            model = ft.family.build_task_model(dataclasses.replace(ft.cfg, hidden_dropout=0.0, attention_dropout=0.0,
                                                                   vocab_size=state[WORD].shape[0]),
                                               ft.task.kind, len(labels), ft.run["finetune"]["seed"])
            model.load_state_dict(state)
            model = model.to(device).eval()
            enc = T.encode(task, load_sp(tok), examples[lang], labels, cfg)
            with torch.no_grad():
                logits = torch.cat([model(enc.input_ids[i:i + OLD_BATCH].to(device))[1].cpu()
                                    for i in range(0, len(enc), OLD_BATCH)])
            seeds.append(T.scores(task, logits, enc, examples[lang], labels, cfg))
        out.append(seeds)
    return out


class Timers:
    """Seconds and calls per name; 'forward' also counts the ids it computed."""

    def __init__(self):
        self.seconds, self.calls, self.tokens, self.forward_cpu = {}, {}, 0, 0.0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            sync()
            t, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1
                if name == "forward":
                    self.forward_cpu += time.process_time() - cpu
        return timed


@contextlib.contextmanager
def timed(timers: Timers):
    """Time the forward passes and the named steps of both paths (module attributes, patched
    for the duration: both paths look them up at call time)."""
    forward = RobertaForTask.forward

    def counted_forward(self, input_ids, *args, **kwargs):
        timers.tokens += input_ids.numel()
        return forward(self, input_ids, *args, **kwargs)

    patches = [(RobertaForTask, "forward", timers.wrap("forward", counted_forward))]
    for name in ("encode", "load_finetuned", "scores", "read_examples"):
        patches.append((F, name, timers.wrap(name, getattr(F, name))))
    # The task model is the family's to build (ModelFamily.build_task_model): timed on its instance.
    patches.append((ROBERTA, "build_task_model", timers.wrap("build_task_model", ROBERTA.build_task_model)))
    patches.append((F, "read_artifact", timers.wrap("read_artifact", F.read_artifact)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def measure(fn) -> tuple[dict, object]:
    timers = Timers()
    with timed(timers):
        sync()
        t, cpu = time.perf_counter(), time.process_time()
        result = fn()
        sync()
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    inside = timers.seconds.get("forward", 0.0)
    return {"wall_s": wall, "forward_s": inside, "outside_s": wall - inside,
            "outside_per_pair_s": (wall - inside) / PAIRS, "cpu_s": cpu, "forward_cpu_s": timers.forward_cpu,
            "outside_cpu_s": cpu - timers.forward_cpu, "forward_calls": timers.calls.get("forward", 0),
            "ids_computed": timers.tokens,
            "steps_s": {k: v for k, v in timers.seconds.items() if k != "forward"},
            "steps_calls": {k: v for k, v in timers.calls.items() if k != "forward"}}, result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--examples", type=int, default=5000, help="German verses, 1 in 5 of each genre")
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="roberta-base" if gpu else "tiny")
    ap.add_argument("--old_device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu",
                    help="where the replayed old path runs (it ran on the CPU)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of each path, interleaved (the median is reported)")
    ap.add_argument("--shared", action="store_true", help="say in the results that other jobs shared the machine")
    args = ap.parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory() as tmp:
        finetuned, adapt, spec = build_runs(Path(tmp), args.examples, args.shape)
        cfg = FinetuneConfig()
        # The artifacts alone, as the old path scores them (no no-adaptation pass).
        new = lambda: F.evaluate_artifacts(finetuned, [adapt], spec, no_adaptation=False)  # noqa: E731
        old = lambda: old_path(finetuned, [adapt], spec, args.old_device)  # noqa: E731
        # Warm-up on 1 example in 50: first imports, allocator, tokenizer and kernel set-up.
        measure(lambda: F.evaluate_artifacts(finetuned, [adapt], spec.replace("genre.", "warmup."),
                                             no_adaptation=False))
        runs = {"old": [], "new": []}
        for _ in range(args.repeats):  # interleaved, so both see the same load on the shared cores
            runs["old"].append(measure(old))
            runs["new"].append(measure(new))
        records, old_scores = runs["new"][0][1], runs["old"][0][1]
        same = all(r["seed_scores"] == [s["accuracy"] for s in seeds] for r, seeds in zip(records, old_scores))
        n_rows = len(T.read_examples(T.get_task("classify"), spec, "de", "test"))

    result = {}
    for path, measured in runs.items():
        m = [x for x, _ in measured]
        median = {k: statistics.median(x[k] for x in m) for k in ("wall_s", "forward_s", "outside_s",
                                                                   "outside_per_pair_s", "cpu_s", "forward_cpu_s",
                                                                   "outside_cpu_s")}
        steps = {k: statistics.median(x["steps_s"].get(k, 0.0) for x in m) for k in m[0]["steps_s"]}
        result[path] = {**median, "forward_calls": m[0]["forward_calls"], "ids_computed": m[0]["ids_computed"],
                        "steps_s": steps, "steps_calls": m[0]["steps_calls"], "runs": m}
    new_r, old_r = result["new"], result["old"]
    met = new_r["outside_per_pair_s"] < TARGET_S
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = str(eval_dtype(torch.device(device))).replace("torch.", "")
    payload = {"examples": n_rows, "seeds": len(SEEDS), "artifacts": len(STEPS), "seq_length": cfg.seq_length,
               "eval_batch_tokens": cfg.eval_batch_tokens, "old_batch_examples": OLD_BATCH, "shape": args.shape,
               "device": device, "eval_dtype": dtype, "old_device": args.old_device, "shared": args.shared,
               "same_scores": same, "target_outside_per_pair_s": TARGET_S, "target_met": met,
               "speedup_wall": old_r["wall_s"] / new_r["wall_s"], "speedup_cpu": old_r["cpu_s"] / new_r["cpu_s"],
               **result}
    rows = [{"path": p, "wall": r["wall_s"], "forward": r["forward_s"], "outside": r["outside_s"],
             "outside_pair": r["outside_per_pair_s"], "cpu": r["cpu_s"], "forward_cpu": r["forward_cpu_s"],
             "outside_cpu": r["outside_cpu_s"], "calls": r["forward_calls"], "ids": r["ids_computed"],
             "us_per_id": 1e6 * r["forward_cpu_s"] / r["ids_computed"]}
            for p, r in ((f"old (rebuilt fp32 model on {args.old_device}, re-encoded, {OLD_BATCH} x {cfg.seq_length} "
                          "batches)", old_r),
                         (f"new ({device}, {dtype}, one model per seed, in-place swap, {cfg.eval_batch_tokens}-id "
                          "batches)", new_r))]
    steps = [{"step": k, "old": old_r["steps_s"].get(k, 0.0), "old_calls": old_r["steps_calls"].get(k, 0),
              "new": new_r["steps_s"].get(k, 0.0), "new_calls": new_r["steps_calls"].get(k, 0)}
             for k in sorted(set(old_r["steps_s"]) | set(new_r["steps_s"]))]
    shared = (f"\n**The machine's {hardware_cores()} CPU cores were shared with other jobs**, so the absolute "
              "times are noisy." if args.shared else "")
    timed_runs = ("One timed run of each path (old, then new)" if args.repeats == 1 else
                  f"Median of {args.repeats} timed runs of each path (old and new interleaved)") + \
        ", after a warm-up run of the new path on 1 example in 50."
    md = f"""# Step-4 evaluation overhead

`python benchmarks/eval_overhead.py {' '.join(argv_used)}` (OMP_NUM_THREADS={torch.get_num_threads()}),
{datetime.date.today()}, {hardware()}.
{n_rows} German Bible verses (genre classification, `--task classify` CSV, seq_length {cfg.seq_length}),
{len(SEEDS)} seeds x {len(STEPS)} artifacts of one adapt run (one tokenizer).
Model: {MODELS[args.shape]}.
Untrained heads and random artifact rows: timing only, the scores are near chance.
Both paths give the same scores: {same}.
{timed_runs}{shared}

{table(rows, [("path", "path"), ("wall", "wall s"), ("forward", "in forward s"), ("outside", "outside s"),
              ("outside_pair", "outside per (artifact, seed) s"), ("calls", "forward calls"),
              ("ids", "ids computed")])}

The same runs in this process's CPU time:

{table(rows, [("path", "path"), ("cpu", "CPU s"), ("forward_cpu", "in forward CPU s"),
              ("outside_cpu", "outside CPU s"), ("us_per_id", "forward CPU µs per id")])}

Wall time old / new: {payload['speedup_wall']:.2f}x (CPU time: {payload['speedup_cpu']:.2f}x). Target (< {TARGET_S} s
outside the forward passes per (artifact, seed)): **{'met' if met else 'not met'}**
({new_r['outside_per_pair_s']:.3f} s).

Where the time outside the forward passes goes (seconds in all, calls; a step's time includes the forward
passes it runs, none of these does):

{table(steps, [("step", "step"), ("old", "old s"), ("old_calls", "old calls"), ("new", "new s"),
               ("new_calls", "new calls")])}
"""
    paths = write_results("eval_overhead", payload, md)
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
