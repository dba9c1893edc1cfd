"""Counted FLOPs of real training steps against the encoder family's analytic functions
(mmadapt/models/roberta/flops.py; the decoder's are checked by tests/test_llama_flops.py).

    python benchmarks/flops_validation.py          # ~1 min on 2 CPU cores

For every system and step (Step 1: BL_BASE, BL_SMALL, MINIJOINT; Step 1b: MINIPOST; Step 2:
every system's model), one update is run through the DeepSpeed engine exactly as training runs
it, under torch's FlopCounterMode, with attention_impl='math' (the counter sees CPU SDPA as zero
FLOPs). The exact functions must agree to 0.1%; the paper's formulas' gap is reported.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import (
    REPO,
    SHAPES,
    engine_update,
    mask_fraction,
    masked_batches,
    paper_mini_layers,
    table,
    write_results,
)

from mmadapt.config import TrainConfig, apply_recipe
from mmadapt.flops import counted_flops
from mmadapt.models.roberta.flops import step_flops
from mmadapt.parallel import init_parallel
from mmadapt.engine import load_ds_config
from mmadapt.models import get_family
from mmadapt.train import LMJob, lm_engine

TOLERANCE = 1e-3


def cases(base, mini_layers=None, new_layers=2):
    """(system, step, model config, trainable names) of every system's Step 1, 1b and 2 update in
    `base`'s family; mini_layers N: the paper's third of the depth (4 of 12) unless given."""
    family = get_family(base)
    n = mini_layers or paper_mini_layers(base)
    depth = n + new_layers
    return [
        ("bl_base", "pretrain", apply_recipe(base, "bl_base"), None),
        ("bl_small", "pretrain", apply_recipe(base, "bl_small", n), None),
        ("minijoint", "pretrain", apply_recipe(base, "minijoint", n), None),
        ("minipost", "minipost", family.one_head(base, depth), family.minipost_trainable(n, new_layers)),
        ("bl_base", "adapt", family.one_head(base, base.num_layers), family.vocab_params(base)),
        ("minipost", "adapt", family.one_head(base, depth), family.vocab_params(base)),
        ("minijoint", "adapt", family.one_head(base, n), family.vocab_params(base)),
        ("bl_small", "adapt", family.one_head(base, n), family.vocab_params(base)),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="cpu")
    ap.add_argument("--seq_length", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=4)
    args = ap.parse_args(argv)
    base = dataclasses.replace(SHAPES[args.shape], attention_impl="math", hidden_dropout=0.0, attention_dropout=0.0)
    s, b = args.seq_length, args.micro_batch
    train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=b, train_iters=10, lr_warmup_iters=1)
    init_parallel(1, 1)
    ds = load_ds_config(REPO / "ds_configs" / "zero1.json", train)
    batch = masked_batches(base, b, s, train.mask_prob, 1)[0]
    p = mask_fraction([batch])
    rows = []
    for system, step, cfg, trainable in cases(base):
        job = LMJob(step=step, trainable=trainable, trainable_layers=2)
        engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, job)
        counted = counted_flops(engine_update(engine, [batch], len(cfg.heads_after)))
        exact = b * step_flops(step, cfg, s, p, trainable_layers=2)
        paper = b * step_flops(step, cfg, s, p, paper=True, trainable_layers=2)
        rows.append({"system": system, "step": step, "layers": cfg.num_layers, "counted_gflop": counted / 1e9,
                     "exact_gflop": exact / 1e9, "exact_rel_error": abs(counted - exact) / counted,
                     "paper_gflop": paper / 1e9, "paper_gap": (paper - counted) / counted,
                     "within_tolerance": abs(counted - exact) / counted <= TOLERANCE})
        del engine
    ok = all(r["within_tolerance"] for r in rows)
    md = [f"# Counted vs analytic FLOPs of one update (h={base.hidden_size}, V={base.vocab_size}, s={s}, "
          f"batch {b}, p={p:.4f})", "",
          table(rows, [("system", "system"), ("step", "step"), ("layers", "layers"),
                       ("counted_gflop", "counted GFLOP"), ("exact_gflop", "exact GFLOP"),
                       ("exact_rel_error", "exact rel. error"), ("paper_gflop", "paper GFLOP"),
                       ("paper_gap", "paper gap")]),
          "", f"Exact functions within {TOLERANCE:.1%} of the counted FLOPs: {'yes' if ok else 'NO'}."]
    paths = write_results("flops_validation", {"shape": {"hidden_size": base.hidden_size, "vocab_size": base.vocab_size,
                                                         "seq_length": s, "micro_batch": b, "mask_fraction": p},
                                               "tolerance": TOLERANCE, "all_within_tolerance": ok, "rows": rows},
                          "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
