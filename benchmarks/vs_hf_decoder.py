"""The same new-language embedding job for a 12-layer decoder, timed side by side: transformers'
LlamaForCausalLM with every body weight frozen, mmadapt over the full model (BL_BASE) and over
the mini-models (MINIJOINT: its bottom 4 layers; MINIPOST: 4 + 2).

    pip install transformers                  # optional: only this benchmark needs it
    python benchmarks/vs_hf_decoder.py        # CPU: h=256, 12 layers, ~3 min on 2 cores

The job: next-token prediction over a frozen body with only the word embedding trainable (tied
to the output projection). transformers' model has the same shape and the same frozen parameters,
AdamW over the embedding and a plain PyTorch loop, as a user of `transformers` would write it;
mmadapt runs its DeepSpeed engine (ZeRO-1) as `launch/adapt.py` does. Every system gets the same
random blocks and scores the same s - 1 next pieces per row (transformers shifts its labels
inside; mmadapt's blocks carry them shifted, the last position unscored). fp32, dropout off,
median of --repeats updates after warm-up; time ratios beside the exact FLOP ratios
(models/llama/flops.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from common import REPO, engine_update, median_time, table, write_results

from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.engine import load_ds_config
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.flops import adapt_flops
from mmadapt.parallel import device, init_parallel
from mmadapt.tokens import IGNORE_INDEX, NUM_SPECIAL
from mmadapt.models import get_family
from mmadapt.train import LMJob, lm_engine

# 12 layers at h = 256 (4 heads, 2 key/value groups, SwiGLU at Llama's 8h/3 rounded to 64), V = 8000.
SHAPE = ModelConfig(family="llama", num_layers=12, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=704, vocab_size=8000, max_position_embeddings=256, hidden_dropout=0.0,
                    attention_dropout=0.0)
SYSTEMS = {"bl_base": 12, "minipost": 6, "minijoint": 4}  # the model Step 2 trains over


def blocks(micro: int, s: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n random rows of s + 1 ordinary pieces -> (input_ids [micro, s], next pieces [micro, s]),
    the last position unscored: the s - 1 targets transformers' shift scores."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, SHAPE.vocab_size, (micro, s + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, -1] = IGNORE_INDEX
        out.append((ids[:, :s], labels))
    return out


def hf_model(cfg: ModelConfig, lr: float):
    """LlamaForCausalLM shaped like `cfg`, everything frozen but the (tied) embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
                         intermediate_size=cfg.ffn_hidden_size, max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base, tie_word_embeddings=True,
                         attention_dropout=0.0, use_cache=False)
    model = LlamaForCausalLM(hf_cfg).to(device()).train()
    for n, p in model.named_parameters():
        p.requires_grad_(n == "model.embed_tokens.weight")
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq_length", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10, help="timed updates (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    ap.add_argument("--fusion", default="none", help="mmadapt's ModelConfig.fusion: none (eager) or compile")
    args = ap.parse_args(argv)
    import transformers

    init_parallel(1, 1)
    s, b = args.seq_length, args.micro_batch
    train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=b, train_iters=10**6, lr=1e-4, lr_warmup_iters=1)
    ds = load_ds_config(REPO / "ds_configs" / "zero1.json", train)
    batches, dev = blocks(b, s, 4), device()
    rows = []
    for system, layers in SYSTEMS.items():
        cfg = LLAMA.one_head(dataclasses.replace(SHAPE, fusion=args.fusion), layers)
        engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, LMJob(step="adapt", trainable=LLAMA.vocab_params(cfg)))
        t, _ = median_time(engine_update(engine, batches, 1), args.warmup, args.repeats)
        del engine
        # exact FLOPs of the s - 1 scored positions: the head's share scales with them
        flops = b * (adapt_flops(cfg, s) - 3 * 2 * cfg.hidden_size * cfg.vocab_size)
        rows.append({"system": system, "layers": layers, "ms_per_update": 1e3 * t, "tokens_per_s": b * s / t,
                     "gflop": flops / 1e9})
    model, opt = hf_model(SHAPE, train.lr)
    cycle = itertools.cycle(batches)

    def peer():
        ids, _ = next(cycle)
        loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss  # shifted inside: s - 1 targets
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_hf, _ = median_time(peer, args.warmup, args.repeats)
    base = rows[0]
    for r in rows:
        r["time_ratio_vs_bl_base"] = base["ms_per_update"] / r["ms_per_update"]
        r["flop_ratio_vs_bl_base"] = base["gflop"] / r["gflop"]
        r["time_over_flop_ratio"] = r["time_ratio_vs_bl_base"] / r["flop_ratio_vs_bl_base"]
    hf_row = {"system": "transformers (full model)", "layers": SHAPE.num_layers, "ms_per_update": 1e3 * t_hf,
              "tokens_per_s": b * s / t_hf, "gflop": base["gflop"]}
    speedup = base["tokens_per_s"] / hf_row["tokens_per_s"]
    minijoint = next(r for r in rows if r["system"] == "minijoint")
    md = [f"# Step 2 of a 12-layer decoder: mmadapt vs transformers {transformers.__version__} LlamaForCausalLM "
          f"({dev}, h={SHAPE.hidden_size}, {SHAPE.num_attention_heads} heads / {SHAPE.query_groups} groups, "
          f"V={SHAPE.vocab_size}, s={s}, batch {b}, fp32, body frozen, mmadapt fusion {args.fusion})", "",
          table([*rows, hf_row], [("system", "system"), ("layers", "layers"), ("ms_per_update", "ms/update"),
                                  ("tokens_per_s", "tokens/s"), ("gflop", "GFLOP/update (exact)"),
                                  ("time_ratio_vs_bl_base", "time ratio vs BL_BASE"),
                                  ("flop_ratio_vs_bl_base", "FLOP ratio vs BL_BASE"),
                                  ("time_over_flop_ratio", "time ratio / FLOP ratio")]), "",
          f"- BL_BASE / MINIJOINT time ratio {minijoint['time_ratio_vs_bl_base']:.2f}x against an exact FLOP ratio of "
          f"{minijoint['flop_ratio_vs_bl_base']:.2f}x: {minijoint['time_over_flop_ratio']:.2f} of it (target >= 0.9: "
          f"{'met' if minijoint['time_over_flop_ratio'] >= 0.9 else 'NOT met'})",
          f"- mmadapt BL_BASE does {speedup:.2f}x the tokens/s of transformers on the same frozen-body job (target "
          f">= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'})"]
    paths = write_results("vs_hf_decoder" + ("" if args.fusion == "none" else f"_{args.fusion}"), {"fusion": args.fusion, "shape": dataclasses.asdict(SHAPE), "seq_length": s, "micro_batch": b,
                                            "transformers": transformers.__version__, "rows": [*rows, hf_row],
                                            "speedup_bl_base_vs_transformers": speedup}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
