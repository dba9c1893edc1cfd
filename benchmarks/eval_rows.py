"""Step 4's forward passes with the last layer at the rows a head reads, against the whole layer,
on a finished demo directory: zero-shot bible-genre (a classifier reads each row's <s>), the
plug-in metric and bits per byte (an MLM head reads the scored positions), and retrieval (a
middle layer's outputs: the layers above it not run at all).

    python benchmarks/eval_rows.py DEMO_DIR [--primaries bl_base bl_small] [--repeats 3]

Both ways run in one process, interleaved round by round (common.interleaved_times), at the
demo's Step-4 settings (two threads, 2,048-piece batches); each ratio is the median of the
rounds' ratios. "whole" is the code before: every position of the last layer, and every layer
for retrieval (RobertaForTask.head_rows and RobertaMLM.head_rows give None, run_layers runs them
all). The records of both ways are compared field by field: the rows path changes which rows
are computed, not any row's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, interleaved_times, table, write_results  # noqa: E402


def every_layer(layers, x, wanted, *args, rows=None):
    """run_layers as it was: every layer run, whatever is wanted."""
    out = []
    for layer in layers:
        x = layer(x, *args)
        if layer.layer_number in wanted:
            out.append(x)
    return out


@contextmanager
def whole_layers():
    from mmadapt.models.roberta import model as M

    saved = M.RobertaForTask.head_rows, M.RobertaMLM.head_rows, M.run_layers
    M.RobertaForTask.head_rows = M.RobertaMLM.head_rows = lambda self, _: None
    M.run_layers = every_layer
    try:
        yield
    finally:
        M.RobertaForTask.head_rows, M.RobertaMLM.head_rows, M.run_layers = saved


def differences(a: list[dict], b: list[dict]) -> dict:
    """Fields that differ between two lists of records: how many, and the largest relative gap of a number."""
    n, worst = 0, 0.0
    for x, y in zip(a, b, strict=True):
        for k in x.keys() | y.keys():
            if x.get(k) != y.get(k):
                n += 1
                if isinstance(x.get(k), float) and isinstance(y.get(k), float):
                    worst = max(worst, abs(x[k] - y[k]) / max(abs(y[k]), 1e-12))
    return {"fields_differing": n, "max_relative": worst}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("demo_dir", type=Path)
    ap.add_argument("--primaries", nargs="+", default=["bl_base", "bl_small"])
    ap.add_argument("--lang", default="de")
    ap.add_argument("--artifacts", type=int, default=3, help="zero-shot: the run's first checkpoints after update 0")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from mmadapt.corpora import parallel_verses
    from mmadapt.demo import Demo, DemoConfig, for_family
    from mmadapt.evaluate import evaluate_artifacts, retrieval_records
    from mmadapt.parallel import init_parallel
    from mmadapt.plugin import plugin_records

    init_parallel(1, 1)
    root = args.demo_dir
    demo = Demo(for_family(DemoConfig()), root)
    cfg = demo.cfg
    results = []
    for primary in args.primaries:
        run = root / "adapt" / f"{primary}-{args.lang}"
        finetuned = demo.finetune_dirs(primary)
        arts = sorted((run / "embeddings").iterdir())[1:1 + args.artifacts]
        pairs = {args.lang: parallel_verses("en", args.lang, cfg.retrieval_pairs)}
        parts = {
            "zero-shot": lambda: evaluate_artifacts(finetuned, artifacts=arts, eval_spec="bible", no_adaptation=False,
                                                    eval_batch_tokens=cfg.eval_batch_tokens),
            "plug-in": lambda: plugin_records(root / "pretrain" / primary, adapt_runs=[run],
                                              data_paths={args.lang: root / "data" / args.lang},
                                              seq_length=cfg.seq_length, blocks=cfg.plugin_blocks,
                                              bpb_bytes=cfg.bpb_bytes, bpb_batch_tokens=cfg.eval_batch_tokens),
            "retrieval": lambda: retrieval_records(root / "pretrain" / primary, adapt_runs=[run], pairs=pairs,
                                                   seq_length=cfg.seq_length),
        }
        for part, fn in parts.items():
            out = {}

            def rows_way(fn=fn):
                out["rows"] = fn()

            def whole_way(fn=fn):
                with whole_layers():
                    out["whole"] = fn()

            times = interleaved_times({"rows": rows_way, "whole": whole_way}, warmup=1, repeats=args.repeats)
            ratios = [r / w for r, w in zip(times["rows"], times["whole"])]
            results.append({"primary": primary, "part": part, "rows_s": statistics.median(times["rows"]),
                         "whole_s": statistics.median(times["whole"]), "ratio": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "records": len(out["rows"]), **differences(out["rows"], out["whole"]), "times": times})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "times"}), flush=True)
    md = [f"# Step 4 with the last layer at the rows a head reads ({hardware()})", "",
          f"`python benchmarks/eval_rows.py DEMO_DIR --repeats {args.repeats}` over a finished demo directory "
          f"({args.lang}; zero-shot: {args.artifacts} checkpoints x the 3 fine-tuning seeds; plug-in and retrieval: "
          "every checkpoint of the run). Seconds: median of the rounds; ratio: rows / whole, the median of the "
          "rounds' ratios (min-max beside it). Both ways interleaved in one process, 2 threads.", "",
          table(results, [("primary", "primary"), ("part", "part"), ("rows_s", "rows s"), ("whole_s", "whole s"),
                       ("ratio", "ratio"), ("ratio_min", "min"), ("ratio_max", "max"), ("records", "records"),
                       ("fields_differing", "fields differing"), ("max_relative", "max relative gap")])]
    write_results("eval_rows", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": results}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
