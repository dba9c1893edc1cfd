"""Step-2 time per update over each system's model, next to the analytic FLOP ratios.

    python benchmarks/step2_speed.py                 # CPU default shape (h=256), ~1 min on 2 cores
    python benchmarks/step2_speed.py --shape roberta-base --ds_config ds_configs/zero1_bf16.json  # GPU

Each system's Step-2 model (BL_BASE: 12 layers; MINIPOST: 4 + 2; MINIJOINT and BL_SMALL: 4) is
built with a frozen body and trainable embeddings + output bias, wrapped in a DeepSpeed engine in
one process, and trained on the same masked batches; the median of --repeats updates after
warm-up is reported. Weights are random: the work of an update does not depend on their values.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import REPO, median_time, table, write_results

from mmadapt import adapt as A
from mmadapt.config import PRESETS, ModelConfig, TrainConfig
from mmadapt.flops import adapt_flops, mini_config
from mmadapt.parallel import device, init_parallel
from mmadapt.tokens import IGNORE_INDEX, NUM_SPECIAL
from mmadapt.train import Job, build_engine, load_ds_config, train_step

SHAPES = {
    "cpu": ModelConfig(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=8000,
                       max_position_embeddings=128),
    "roberta-base": PRESETS["roberta-base"][0],
}
SYSTEMS = {"bl_base": 12, "minipost": 6, "minijoint": 4}  # Step-2 depth (BL_SMALL = MINIJOINT's 4)


def masked_batches(cfg: ModelConfig, micro: int, s: int, p: float, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, cfg.vocab_size, (micro, s), generator=g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        pick = torch.rand(micro, s, generator=g) < p
        labels[pick] = ids[pick]
        out.append((ids, labels))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="roberta-base" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq_length", type=int, default=None, help="default: 128 on CPU, 512 on GPU")
    ap.add_argument("--micro_batch", type=int, default=None, help="default: 8 on CPU, 32 on GPU")
    ap.add_argument("--ds_config", default=str(REPO / "ds_configs" / "zero1.json"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    s = args.seq_length or (512 if gpu else 128)
    micro = args.micro_batch or (32 if gpu else 8)
    base = dataclasses.replace(SHAPES[args.shape], hidden_dropout=0.0, attention_dropout=0.0)
    train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=micro, train_iters=10**6, lr=1e-4,
                        lr_warmup_iters=1)
    init_parallel(1, 1)
    ds = load_ds_config(REPO / args.ds_config, train)  # an absolute path replaces REPO
    batches = masked_batches(base, micro, s, train.mask_prob, 4)
    rows = []
    for system, layers in SYSTEMS.items():
        cfg = mini_config(base, layers)
        engine, _, _ = build_engine(cfg, train, ds, Job(step="adapt", trainable=A.ADAPT_TRAINABLE))
        counter = iter(range(10**9))

        def step(engine=engine, counter=counter):
            train_step(engine, False, [batches[next(counter) % len(batches)]], 1)

        t, times = median_time(step, args.warmup, args.repeats)
        m = sum(int(lab.ge(0).sum()) for _, lab in batches) / len(batches)  # masked rows per micro-batch
        p = m / (micro * s)
        exact, paper = micro * adapt_flops(cfg, s, p), micro * adapt_flops(cfg, s, p, paper=True)
        rows.append({"system": system, "layers": layers, "ms_per_update": 1e3 * t, "tokens_per_s": micro * s / t,
                     "gflop_exact": exact / 1e9, "gflop_paper": paper / 1e9, "achieved_tflops": exact / t / 1e12,
                     "times_s": times})
        del engine, step
        if gpu:
            torch.cuda.empty_cache()
    by = {r["system"]: r for r in rows}
    ratios = []
    for small in ("minijoint", "minipost"):
        b, m = by["bl_base"], by[small]
        measured = b["ms_per_update"] / m["ms_per_update"]
        exact = b["gflop_exact"] / m["gflop_exact"]
        ratios.append({"pair": f"bl_base / {small}", "measured_time_ratio": measured, "exact_flop_ratio": exact,
                       "paper_flop_ratio": b["gflop_paper"] / m["gflop_paper"],
                       "measured_over_exact": measured / exact})
    shape = {"hidden_size": base.hidden_size, "ffn_hidden_size": base.ffn_hidden_size,
             "num_attention_heads": base.num_attention_heads, "vocab_size": base.vocab_size, "seq_length": s,
             "micro_batch": micro, "ds_config": str(args.ds_config), "device": str(device())}
    md = [f"# Step-2 time per update ({shape['device']}, h={base.hidden_size}, V={base.vocab_size}, s={s}, "
          f"batch {micro}, {args.ds_config.split('/')[-1]})", "",
          table(rows, [("system", "system"), ("layers", "layers"), ("ms_per_update", "ms/update"),
                       ("tokens_per_s", "tokens/s"), ("gflop_exact", "GFLOP/update (exact)"),
                       ("gflop_paper", "GFLOP/update (A3)"), ("achieved_tflops", "achieved TFLOP/s")]),
          "", table(ratios, [("pair", "pair"), ("measured_time_ratio", "measured time ratio"),
                             ("exact_flop_ratio", "exact FLOP ratio"), ("paper_flop_ratio", "A3 FLOP ratio"),
                             ("measured_over_exact", "measured / exact")])]
    paths = write_results("step2_speed", {"shape": shape, "rows": rows, "ratios": ratios}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
