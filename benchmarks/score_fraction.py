"""Decoder Step 2 scoring a fraction p of the positions (TrainConfig.score_fraction), in the decoder
demo's setting: the plug-in contextual gain (unigram reference - held-out next-piece loss through
the primary model, nats per piece, every held-out position scored) against Step-2 compute, for
p = 1, 0.5, 0.25, 0.125, BL_BASE (over its 12-layer model) and MINIJOINT (over its 4-layer
mini-model), German and French, two Step-2 seeds; the FLOPs each run needs to reach 90% of the
final gain of the p = 1 run of its system, language and seed; and what the fractions make of
Step 2 at Qwen2-0.5B's shape (exact counts, models/llama/flops.py).

    python benchmarks/score_fraction.py [--output_dir runs/score_fraction] [--iters 1000] [--langs de fr]

Starts from the decoder demo's shipped Step-1 models (mmadapt/demo_models/llama) with the demo's
Step-2 settings (mmadapt.demo.DemoConfig: 32 blocks of 32 pieces per update, the llama-tiny
schedule), checkpoints every --save_interval updates. Every run is kept in --output_dir and skipped
when run again; so several processes may share the grid (one per language: --langs), and the one
that finds the whole grid done writes benchmarks/results/score_fraction_<hardware>_<date>.{json,md}.
FLOPs and gains do not depend on the machine; wall times do (the run's own, and the median time of
an update from its metrics, which leaves out start-up and checkpoints).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import hardware, table, write_results  # common puts mmadapt on the path

import torch

from mmadapt import steps
from mmadapt.config import to_dict
from mmadapt.demo import Demo, DemoConfig, install_source_model
from mmadapt.models import find_preset
from mmadapt.parallel import init_parallel
from mmadapt.plugin import plugin_records
from mmadapt.report import time_to_target
from mmadapt.run import RunSpec, run_progress

FRACTIONS = (1.0, 0.5, 0.25, 0.125)
SYSTEMS = ("bl_base", "minijoint")  # each from the shipped source of its own recipe
LANGS = ("de", "fr")
SEEDS = (1234, 1)
TARGET = 0.9  # of the p = 1 run's final gain


def run_name(system: str, lang: str, seed: int, p: float) -> str:
    return f"{system}-{lang}-s{seed}-p{p:g}"


def train_run(demo: Demo, run_dir: Path, system: str, source: Path, lang: str, data: Path, seed: int, p: float,
              iters: int, save_interval: int) -> None:
    """One Step-2 run (resumed if interrupted), its wall time kept beside it."""
    state = run_progress(run_dir, iters)
    if state == "done":
        return
    train = demo._train(iters, save_interval, train_micro_batch_size_per_gpu=demo.cfg.adapt_batch, seed=seed,
                        score_fraction=p, keep_last=1)
    t0 = time.perf_counter()
    steps.adapt_embeddings(run=RunSpec(output_dir=run_dir, data_path=data, resume=state == "resume"),
                           step=steps.AdaptEmbeddings(system=system, source=source, lang=lang, train=train))
    wall = run_dir / "wall_s.json"
    before = json.loads(wall.read_text()) if wall.is_file() else 0.0  # a resumed run adds its part
    wall.write_text(json.dumps(before + time.perf_counter() - t0))


def run_record(run_dir: Path, source: Path, lang: str, data: Path, cfg: DemoConfig) -> dict:
    """The plug-in curve of every checkpoint of a finished run (computed once, kept in plugin.json)."""
    cached = run_dir / "plugin.json"
    if not cached.is_file():
        recs = plugin_records(source, [run_dir], {lang: data}, cfg.seq_length, cfg.plugin_blocks)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        per_update = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        tokens = cfg.adapt_batch * cfg.seq_length
        cached.write_text(json.dumps({
            "start_gain": recs[0]["start_gain"], "unigram_loss": recs[0]["unigram_loss"],
            "curve": [[r["step"], r["flops"], r["score"]] for r in recs], "label": recs[0]["system"],
            "wall_s": json.loads((run_dir / "wall_s.json").read_text()),
            "update_ms": 1e3 * tokens / statistics.median(per_update)}))
    return json.loads(cached.read_text())


def reached(rec: dict, target: float) -> dict:
    """FLOPs (and updates) at which the curve (from its start at 0 FLOPs) first reaches `target`."""
    hit = time_to_target([(0.0, rec["start_gain"])] + [(f, g) for _, f, g in rec["curve"]], target)
    per_update = rec["curve"][-1][1] / rec["curve"][-1][0]
    return {"flops_to_target": None if hit is None else hit.estimate,
            "updates_to_target": None if hit is None else hit.estimate / per_update}


def gain_at(rec: dict, flops: float) -> float:
    """The curve's gain at `flops` (linear between checkpoints, from its start at 0 FLOPs)."""
    pts = [(0.0, rec["start_gain"])] + [(f, g) for _, f, g in rec["curve"]]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= flops <= x1:
            return y0 + (y1 - y0) * (flops - x0) / (x1 - x0)
    raise ValueError(f"{flops} FLOPs lie outside the curve")


def grid_rows(runs: dict) -> list[dict]:
    """One row per run: its final gain, compute, time and when it reaches 90% of its p = 1 twin's
    final gain (FLOPs, as a share of that twin's whole run and of the twin's own time to it); and
    its final gain less the twin's after the same FLOPs (the twin then mid-schedule)."""
    rows = []
    for (system, lang, seed, p), rec in runs.items():
        twin = runs[(system, lang, seed, 1.0)]
        target = TARGET * twin["curve"][-1][2]
        mine, theirs = reached(rec, target), reached(twin, target)
        total, twin_total = rec["curve"][-1][1], twin["curve"][-1][1]
        f = mine["flops_to_target"]
        rows.append({"system": system, "lang": lang, "seed": seed, "p": p, "label": rec["label"],
                     "final_gain": rec["curve"][-1][2], "start_gain": rec["start_gain"],
                     "share_of_p1_gain": rec["curve"][-1][2] / twin["curve"][-1][2],
                     "step2_eflops": total / 1e18, "target": target, **mine,
                     "to_target_share_of_p1_run": None if f is None else f / twin_total,
                     "to_target_vs_p1": None if f is None else f / theirs["flops_to_target"],
                     "gain_vs_p1_at_same_flops": rec["curve"][-1][2] - gain_at(twin, total),
                     "wall_s": rec["wall_s"], "update_ms": rec["update_ms"], "curve": rec["curve"]})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per system and p: means over languages and seeds (FLOP shares: None when a run never got there)."""
    out = []
    for system in SYSTEMS:
        for p in FRACTIONS:
            mine = [r for r in rows if r["system"] == system and r["p"] == p]
            never = sum(r["flops_to_target"] is None for r in mine)

            def mean(key):  # None where a run never reached the target and the key needs it
                vals = [r[key] for r in mine]
                return None if None in vals else sum(vals) / len(vals)
            gains = [r["final_gain"] for r in mine]
            out.append({"system": system, "p": p, "runs": len(mine), "final_gain": mean("final_gain"),
                        "gain_range": f"{min(gains):+.3f}..{max(gains):+.3f}",
                        "share_of_p1_gain": mean("share_of_p1_gain"), "step2_eflops": mean("step2_eflops"),
                        "eflops_to_90": None if mean("flops_to_target") is None else mean("flops_to_target") / 1e18,
                        "updates_to_90": mean("updates_to_target"),
                        "to_90_share_of_p1_run": mean("to_target_share_of_p1_run"),
                        "to_90_vs_p1": mean("to_target_vs_p1"), "never": never,
                        "vs_p1_at_same_flops": mean("gain_vs_p1_at_same_flops"),
                        "vs_p1_at_same_flops_max": max(r["gain_vs_p1_at_same_flops"] for r in mine),
                        "wall_s": mean("wall_s"),
                        "update_ms": mean("update_ms")})
    return out


def qwen_rows(summ: list[dict]) -> list[dict]:
    """Step 2 per update at Qwen2-0.5B's shape (24 layers, V 151,936, s 2048; MINIJOINT over 4
    layers): exact FLOPs at each p, BL_BASE's full-scoring run over each, and MINIJOINT's FLOPs to
    90% of its p = 1 gain over those at p = 1 if it needed the updates measured here (an
    extrapolation: blocks of 2048 pieces, not 32)."""
    family, model, train = find_preset("qwen2-0.5b")
    s = train.seq_length
    base = family.step_flops("adapt", family.one_head(model, model.num_layers), s, 1.0)
    updates = {r["p"]: r["updates_to_90"] for r in summ if r["system"] == "minijoint"}
    mini_p1 = family.step_flops("adapt", family.one_head(model, 4), s, 1.0)
    out = []
    for p in FRACTIONS:
        mini = family.step_flops("adapt", family.one_head(model, 4), s, p)
        full = family.step_flops("adapt", family.one_head(model, model.num_layers), s, p)
        out.append({"p": p, "minijoint_gflops_per_seq": mini / 1e9, "bl_base_gflops_per_seq": full / 1e9,
                    "bl_base_p1_over_minijoint": base / mini,
                    "minijoint_to_90_vs_p1": None if updates[p] is None else
                    updates[p] * mini / (updates[1.0] * mini_p1)})
    return out


def markdown(settings: dict, rows: list[dict], summ: list[dict], qwen: list[dict]) -> str:
    md = [f"# Decoder Step 2 scoring a fraction p of the positions, demo setting ({hardware()})", "",
          f"`python benchmarks/score_fraction.py` ({settings['iters']} Step-2 updates of {settings['batch']} x "
          f"{settings['seq_length']} pieces from the decoder demo's shipped llama-tiny Step-1 models; checkpoints "
          f"every {settings['save_interval']} updates; languages {', '.join(settings['langs'])}; Step-2 seeds "
          f"{', '.join(map(str, settings['seeds']))}). Contextual gain: the plug-in next-token metric over every "
          f"position of {settings['plugin_blocks']} held-out blocks (nats per piece). FLOPs: the exact Step-2 count "
          "(the head's terms over the scored rows only). Target: 90% of the final gain of the p = 1 run of the same "
          "system, language and seed; FLOPs to it interpolated between checkpoints (report.time_to_target). "
          "Gain - p=1's at same FLOPs: the run's final gain less its p = 1 twin's gain after the same Step-2 FLOPs "
          "(interpolated; the twin then earlier in its schedule, its learning rate not yet decayed). Wall s: the "
          "whole run (start-up and checkpoints included); ms / update: the median over its logging intervals.", "",
          "## Per system and p (mean over languages and seeds)", "",
          table(summ, [("system", "system"), ("p", "p"), ("runs", "runs"), ("final_gain", "final gain"),
                       ("gain_range", "range"), ("share_of_p1_gain", "share of p=1 gain"),
                       ("step2_eflops", "Step-2 EFLOPs"), ("eflops_to_90", "EFLOPs to 90%"),
                       ("updates_to_90", "updates to 90%"), ("to_90_share_of_p1_run", "to 90% / p=1 run's FLOPs"),
                       ("to_90_vs_p1", "to 90% / p=1's own"), ("never", "never"),
                       ("vs_p1_at_same_flops", "gain - p=1's at same FLOPs"),
                       ("vs_p1_at_same_flops_max", "(its max)"), ("wall_s", "wall s"),
                       ("update_ms", "ms / update")]), "",
          "## At Qwen2-0.5B's shape (exact per-sequence FLOPs per Step-2 update, s = 2048)", "",
          table(qwen, [("p", "p"), ("minijoint_gflops_per_seq", "MINIJOINT GFLOPs"),
                       ("bl_base_gflops_per_seq", "BL_BASE GFLOPs at p"),
                       ("bl_base_p1_over_minijoint", "BL_BASE p=1 / MINIJOINT at p"),
                       ("minijoint_to_90_vs_p1", "MINIJOINT FLOPs to 90% / p=1's (updates as measured)")]), "",
          "## Every run", "",
          table(rows, [("system", "system"), ("lang", "lang"), ("seed", "seed"), ("p", "p"),
                       ("start_gain", "start gain"), ("final_gain", "final gain"),
                       ("share_of_p1_gain", "share of p=1"), ("step2_eflops", "Step-2 EFLOPs"),
                       ("updates_to_target", "updates to 90%"), ("to_target_share_of_p1_run", "to 90% / p=1 run"),
                       ("to_target_vs_p1", "to 90% / p=1's own"),
                       ("gain_vs_p1_at_same_flops", "gain - p=1's at same FLOPs"), ("wall_s", "wall s"),
                       ("update_ms", "ms / update")])]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output_dir", default="runs/score_fraction")
    ap.add_argument("--iters", type=int, default=DemoConfig.adapt_iters, help="Step-2 updates (the demo's)")
    ap.add_argument("--save_interval", type=int, default=50, help="updates between checkpoints (curve points)")
    ap.add_argument("--langs", nargs="+", default=list(LANGS), help="the languages this process trains")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the faster on a busy machine, "
                    "benchmarks/results/demo_threads_cpu2_20261124.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.output_dir)
    cfg = DemoConfig(family="llama", langs=LANGS, adapt_iters=args.iters)
    demo = Demo(cfg, root)
    init_parallel(1, 1)
    data = demo.prepare()
    sources = {system: root / "pretrain" / system for system in SYSTEMS}
    for system, run_dir in sources.items():
        if not run_dir.exists():
            install_source_model(system, run_dir, data["en"], *map(to_dict, demo.source_settings(system)))
    grid = [(system, lang, seed, p) for seed in SEEDS for lang in LANGS for system in SYSTEMS for p in FRACTIONS]
    for system, lang, seed, p in grid:
        if lang in args.langs:
            run_dir = root / "adapt" / run_name(system, lang, seed, p)
            train_run(demo, run_dir, system, sources[system], lang, data[lang], seed, p, args.iters,
                      args.save_interval)
            run_record(run_dir, sources[system], lang, data[lang], cfg)
            print(f"done: {run_dir.name}", flush=True)
    if any(run_progress(root / "adapt" / run_name(*key), args.iters) != "done" for key in grid):
        print("other runs of the grid are not done yet: the process that finishes last writes the results")
        return
    runs = {key: run_record(root / "adapt" / run_name(*key), sources[key[0]], key[1], data[key[1]], cfg)
            for key in grid}
    rows = grid_rows(runs)
    summ = summary(rows)
    qwen = qwen_rows(summ)
    settings = {"iters": args.iters, "save_interval": args.save_interval, "batch": cfg.adapt_batch,
                "seq_length": cfg.seq_length, "langs": list(LANGS), "seeds": list(SEEDS),
                "plugin_blocks": cfg.plugin_blocks, "threads": args.threads, "fractions": list(FRACTIONS)}
    md = markdown(settings, rows, summ, qwen)
    paths = write_results("score_fraction", {"settings": settings, "summary": summ, "qwen2_0_5b": qwen,
                                             "runs": rows}, md)
    print(md, "\n", *paths)


if __name__ == "__main__":
    main()
