"""What source-language replay costs per target-language token in Step 2, timed: the demo's
German expand run (its shipped Step-1 models, its Step-2 batch), --replay_fraction 0, 0.1, 0.25
and 0.5 of every batch from the English Bible, each run alone in this process.

A replay block is an ordinary block of the same length (docs/mini-models.md), so an update costs
the same whatever the fraction and the target text gets 1 - f of it: the cost per target token
should be 1 / (1 - f) of no replay's, 2x at the default 0.5. This measures it (update time from
the runs' own throughput log, the replay pipeline's reading of a second dataset included) and
sets it beside what replay buys (benchmarks/results/expand_replay_cpu2_20261126: the English
loss change and the German gain after 1000 updates at each fraction).

    python benchmarks/replay_cost.py [--output_dir runs/replay_cost] [--iters 200] [--families roberta llama]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
from pathlib import Path

from common import REPO, table, write_results  # (importing common puts mmadapt on the path)

sys.path.insert(0, str(REPO / "benchmarks"))
from expand_replay import LANG, setup  # noqa: E402  the same data and source models

from mmadapt import steps  # noqa: E402
from mmadapt.artifact import artifact_dirs, read_artifact  # noqa: E402
from mmadapt.parallel import init_parallel  # noqa: E402
from mmadapt.run import RunSpec  # noqa: E402

FRACTIONS = (0.0, 0.1, 0.25, 0.5)
SYSTEM = "bl_base"  # the full-depth Step 2: where an update costs most
LOG = 10  # updates per throughput line


def timed_run(s: dict, fraction: float, run_dir: Path, iters: int) -> dict:
    """One fresh Step-2 run of `iters` updates; its median update time over the throughput lines
    after the first (warm-up), its tokens and target tokens per update."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = s["cfg"]
    train = dataclasses.replace(s["demo"]._train(iters, iters, train_micro_batch_size_per_gpu=cfg.adapt_batch),
                                log_interval=LOG, vocab_mode="expand", replay_fraction=fraction,
                                replay_data=str(s["replay"]) if fraction else None, plugin_eval_blocks=0)
    rows = steps.adapt_embeddings(run=RunSpec(output_dir=run_dir, data_path=s["expanded"]),
                                  step=steps.AdaptEmbeddings(system=SYSTEM, source=s["sources"][SYSTEM], lang=LANG,
                                                             train=train))
    rows = [r for r in rows if "tokens_per_s" in r][1:]
    meta = read_artifact(artifact_dirs([run_dir])[-1])[2]
    tokens = meta["global_batch"] * meta["seq_length"]
    replay = meta.get("replay_blocks", 0) * meta["seq_length"]
    times = [tokens / r["tokens_per_s"] for r in rows]
    return {"replay_fraction": fraction, "blocks_per_update": meta["global_batch"],
            "replay_blocks": meta.get("replay_blocks", 0), "tokens_per_update": tokens,
            "target_tokens_per_update": tokens - replay, "ms_per_update": 1e3 * statistics.median(times),
            "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times), "lines": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output_dir", type=Path, default=Path("runs/replay_cost"))
    ap.add_argument("--iters", type=int, default=200, help="Step-2 updates per run (the first log line is warm-up)")
    ap.add_argument("--families", nargs="+", default=["roberta", "llama"])
    args = ap.parse_args()
    init_parallel(1, 1)
    rows = []
    for family in args.families:
        s = setup(family, args.output_dir / family)
        base = None
        for fraction in FRACTIONS:
            row = {"family": family, "system": SYSTEM,
                   **timed_run(s, fraction, args.output_dir / family / "adapt" / f"r{fraction}", args.iters)}
            row["us_per_target_token"] = 1e3 * row["ms_per_update"] / row["target_tokens_per_update"]
            base = base or row
            row["update_vs_none"] = row["ms_per_update"] / base["ms_per_update"]
            row["per_target_token_vs_none"] = row["us_per_target_token"] / base["us_per_target_token"]
            row["arithmetic"] = base["target_tokens_per_update"] / row["target_tokens_per_update"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    md = ["# What source-language replay costs per target token in Step 2", "",
          f"The demo's German expand Step 2 ({SYSTEM}, its shipped Step-1 models and Step-2 batch), "
          f"{args.iters} updates per run, each alone; update time: the median (min-max) of the runs' own throughput "
          f"lines of {LOG} updates, the first dropped. `arithmetic`: 1 / (1 - f) as the blocks round, what replay "
          "costs if an update's time does not depend on it. What it buys at each fraction (English loss change, "
          "German gain after 1000 updates): [expand_replay_cpu2_20261126](expand_replay_cpu2_20261126.md). "
          "Written by `python benchmarks/replay_cost.py`.", "",
          table(rows, [("family", "family"), ("replay_fraction", "replay"), ("replay_blocks", "replay blocks"),
                       ("blocks_per_update", "of blocks"), ("ms_per_update", "ms / update"), ("ms_min", "min"),
                       ("ms_max", "max"), ("update_vs_none", "update vs none"),
                       ("us_per_target_token", "us / target token"),
                       ("per_target_token_vs_none", "per target token vs none"), ("arithmetic", "arithmetic")])]
    print(*write_results("replay_cost", {"iters": args.iters, "rows": rows}, "\n".join(md)))


if __name__ == "__main__":
    main()
