"""Step-2 time per update over each system's model, next to the analytic FLOP ratios.

    python benchmarks/step2_speed.py                 # CPU default shape (h=256), ~1 min on 2 cores
    python benchmarks/step2_speed.py --shape roberta-base --ds_config ds_configs/zero1_bf16.json  # GPU

Each system's Step-2 model (BL_BASE: 12 layers; MINIPOST: 4 + 2; MINIJOINT and BL_SMALL: 4) is
built with a frozen body and trainable embeddings + output bias, wrapped in a DeepSpeed engine in
one process, and trained on the same masked batches (random ids, or --real Bible blocks). The
engines are built first and then take one update each in turn, --repeats rounds after --warmup
(common.interleaved_times): each system's median, and each time ratio taken round by round (its
median and range), so that the machine's drift during the run slows both sides of a ratio alike.
Weights are random: the work of an update does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import (
    REPO,
    add_run_args,
    engine_update,
    interleaved_times,
    mask_fraction,
    masked_batches,
    real_batches,
    setup,
    table,
    write_results,
)

from mmadapt.models.roberta.flops import adapt_flops
from mmadapt.models.roberta import ROBERTA
from mmadapt.parallel import device
from mmadapt.engine import for_replicas, load_ds_config
from mmadapt.models import get_family
from mmadapt.train import LMJob, lm_engine
from mmadapt.family import WORD
from mmadapt.models.roberta.model import BIAS

SYSTEMS = {"bl_base": 12, "minipost": 6, "minijoint": 4}  # Step-2 depth (BL_SMALL = MINIJOINT's 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=8)
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / "zero1.json"))
    args = ap.parse_args(argv)
    base, train = setup(args)
    s, micro = args.seq_length, args.micro_batch
    # an absolute path replaces REPO; applied to one replica as a run applies it (engine.for_replicas)
    ds = for_replicas(load_ds_config(REPO / args.ds_config, train), 1)
    batches = (real_batches if args.real else masked_batches)(base, micro, s, train.mask_prob, 4)
    p = mask_fraction(batches)
    steps, cfgs = {}, {}
    for system, layers in SYSTEMS.items():
        cfgs[system] = cfg = ROBERTA.one_head(base, layers)
        engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, LMJob(step="adapt", trainable=(WORD, BIAS)))
        steps[system] = engine_update(engine, batches, 1)
    times = interleaved_times(steps, args.warmup, args.repeats)
    rows = []
    for system, layers in SYSTEMS.items():
        t = statistics.median(times[system])
        exact, paper = micro * adapt_flops(cfgs[system], s, p), micro * adapt_flops(cfgs[system], s, p, paper=True)
        rows.append({"system": system, "layers": layers, "ms_per_update": 1e3 * t, "tokens_per_s": micro * s / t,
                     "gflop_exact": exact / 1e9, "gflop_paper": paper / 1e9, "achieved_tflops": exact / t / 1e12,
                     "times_s": times[system]})
    by = {r["system"]: r for r in rows}
    ratios = []
    for small in ("minijoint", "minipost"):
        b, m = by["bl_base"], by[small]
        rounds = sorted(x / y for x, y in zip(times["bl_base"], times[small]))  # round by round
        measured = statistics.median(rounds)
        exact = b["gflop_exact"] / m["gflop_exact"]
        ratios.append({"pair": f"bl_base / {small}", "measured_time_ratio": measured,
                       "ratio_range": f"{rounds[0]:.3f}-{rounds[-1]:.3f}", "exact_flop_ratio": exact,
                       "paper_flop_ratio": b["gflop_paper"] / m["gflop_paper"],
                       "measured_over_exact": measured / exact, "rounds": rounds})
    shape = {"hidden_size": base.hidden_size, "ffn_hidden_size": base.ffn_hidden_size,
             "num_attention_heads": base.num_attention_heads, "vocab_size": base.vocab_size, "seq_length": s,
             "micro_batch": micro, "ds_config": str(args.ds_config), "device": str(device()), "real": args.real,
             "dropout": args.dropout}
    md = [f"# Step-2 time per update ({shape['device']}, h={base.hidden_size}, V={base.vocab_size}, s={s}, "
          f"batch {micro}, {args.ds_config.split('/')[-1]}, {'real Bible blocks' if args.real else 'random ids'}, "
          f"dropout {'on' if args.dropout else 'off'})", "",
          table(rows, [("system", "system"), ("layers", "layers"), ("ms_per_update", "ms/update"),
                       ("tokens_per_s", "tokens/s"), ("gflop_exact", "GFLOP/update (exact)"),
                       ("gflop_paper", "GFLOP/update (A3)"), ("achieved_tflops", "achieved TFLOP/s")]),
          "", f"{args.repeats} rounds after {args.warmup} of warm-up, each system one update per round; a time "
          "ratio is the median of its rounds' ratios (their range beside it).",
          "", table(ratios, [("pair", "pair"), ("measured_time_ratio", "measured time ratio"),
                             ("ratio_range", "range over rounds"),
                             ("exact_flop_ratio", "exact FLOP ratio"), ("paper_flop_ratio", "A3 FLOP ratio"),
                             ("measured_over_exact", "measured / exact")])]
    paths = write_results("step2_speed", {"shape": shape, "rows": rows, "ratios": ratios}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
