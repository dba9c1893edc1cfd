"""The same new-language embedding job for a decoder, timed side by side: transformers'
LlamaForCausalLM (Qwen2ForCausalLM for a shape with QKV biases) with every body weight frozen,
mmadapt over the full model (BL_BASE) and over the mini-models (MINIJOINT: its bottom third of
the layers, 4 of 12; MINIPOST: those + 2).

    pip install transformers                  # optional: only this benchmark needs it
    python benchmarks/vs_hf_decoder.py        # CPU: h=256, 12 layers, fp32, ~3 min on 2 cores
    python benchmarks/vs_hf_decoder.py --shape qwen2-0.5b --seq_length 2048 --micro_batch 4 \
        --ds_config ds_configs/zero1_bf16.json  # GPU: Qwen2-0.5B's shape in bf16 (the GPU default)

The job: next-token prediction over a frozen body with only the word embedding trainable (tied
to the output projection). transformers' model has the same shape and the same frozen parameters,
AdamW over the embedding and a plain PyTorch loop, as a user of `transformers` would write it
(in bf16: fp32 weights under torch.autocast, as Trainer's bf16=True runs); mmadapt runs its
DeepSpeed engine (ZeRO-1; bf16 with fp32 master weights under zero1_bf16.json) as
`launch/adapt.py` does. Every system gets the same
random blocks and scores the same s - 1 next pieces per row (transformers shifts its labels
inside; mmadapt's blocks carry them shifted, the last position unscored). Dropout off,
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
from mmadapt.models import find_preset
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
SHAPES = {"cpu": SHAPE, "qwen2-0.5b": find_preset("qwen2-0.5b")[1]}


def systems(cfg: ModelConfig) -> dict[str, int]:
    """The depth each system's Step 2 trains over: the full model, the paper's mini-model (the
    bottom third of the layers: 4 of 12) and MINIPOST's (those + 2 new layers)."""
    mini = cfg.num_layers // 3
    return {"bl_base": cfg.num_layers, "minipost": mini + 2, "minijoint": mini}


def blocks(shape: ModelConfig, micro: int, s: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n random rows of s + 1 ordinary pieces -> (input_ids [micro, s], next pieces [micro, s]),
    the last position unscored: the s - 1 targets transformers' shift scores."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, shape.vocab_size, (micro, s + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, -1] = IGNORE_INDEX
        out.append((ids[:, :s], labels))
    return out


def hf_model(cfg: ModelConfig, lr: float):
    """LlamaForCausalLM shaped like `cfg` (Qwen2ForCausalLM where `cfg` has QKV biases, as Qwen2
    has), everything frozen but the (tied) embedding."""
    import transformers

    name = "Qwen2" if cfg.add_qkv_bias else "Llama"
    hf_cfg = getattr(transformers, f"{name}Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
        intermediate_size=cfg.ffn_hidden_size, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base, tie_word_embeddings=True,
        attention_dropout=0.0, use_cache=False)
    model = getattr(transformers, f"{name}ForCausalLM")(hf_cfg).to(device()).train()
    for n, p in model.named_parameters():
        p.requires_grad_(n == "model.embed_tokens.weight")
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b" if gpu else "cpu")
    ap.add_argument("--seq_length", type=int, default=2048 if gpu else 128)
    ap.add_argument("--micro_batch", type=int, default=4 if gpu else 16)
    ap.add_argument("--ds_config", default="ds_configs/" + ("zero1_bf16.json" if gpu else "zero1.json"),
                    help="mmadapt's DeepSpeed config; bf16 in it runs transformers under bf16 autocast too")
    ap.add_argument("--repeats", type=int, default=10, help="timed updates (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    ap.add_argument("--fusion", default="none", help="mmadapt's ModelConfig.fusion: none (eager) or compile")
    args = ap.parse_args(argv)
    import transformers

    init_parallel(1, 1)
    s, b = args.seq_length, args.micro_batch
    train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=b, train_iters=10**6, lr=1e-4, lr_warmup_iters=1)
    ds = load_ds_config(REPO / args.ds_config, train)
    bf16 = bool(ds.get("bf16", {}).get("enabled"))
    shape = SHAPES[args.shape]
    batches, dev = blocks(shape, b, s, 4), device()
    rows = []
    for system, layers in systems(shape).items():
        cfg = LLAMA.one_head(dataclasses.replace(shape, fusion=args.fusion), layers)
        engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, LMJob(step="adapt", trainable=LLAMA.vocab_params(cfg)))
        t, _ = median_time(engine_update(engine, batches, 1), args.warmup, args.repeats)
        del engine
        # exact FLOPs of the s - 1 scored positions: the head's share scales with them
        flops = b * (adapt_flops(cfg, s) - 3 * 2 * cfg.hidden_size * cfg.vocab_size)
        rows.append({"system": system, "layers": layers, "ms_per_update": 1e3 * t, "tokens_per_s": b * s / t,
                     "gflop": flops / 1e9, "achieved_tflops": flops / t / 1e12})
        if torch.cuda.is_available():
            rows[-1]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
    model, opt = hf_model(shape, train.lr)
    cycle = itertools.cycle(batches)

    def peer():
        ids, _ = next(cycle)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
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
    hf_row = {"system": "transformers (full model)", "layers": shape.num_layers, "ms_per_update": 1e3 * t_hf,
              "tokens_per_s": b * s / t_hf, "gflop": base["gflop"], "achieved_tflops": base["gflop"] / t_hf / 1e3}
    if torch.cuda.is_available():
        hf_row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    speedup = base["tokens_per_s"] / hf_row["tokens_per_s"]
    minijoint = next(r for r in rows if r["system"] == "minijoint")
    md = [f"# Step 2 of a {shape.num_layers}-layer decoder ({args.shape}): mmadapt vs transformers "
          f"{transformers.__version__} {type(model).__name__} ({dev}, h={shape.hidden_size}, "
          f"{shape.num_attention_heads} heads / {shape.query_groups} groups, V={shape.vocab_size}, s={s}, batch {b}, "
          f"{'bf16' if bf16 else 'fp32'}, body frozen, mmadapt fusion {args.fusion})", "",
          table([*rows, hf_row], [("system", "system"), ("layers", "layers"), ("ms_per_update", "ms/update"),
                                  ("tokens_per_s", "tokens/s"), ("gflop", "GFLOP/update (exact)"),
                                  ("achieved_tflops", "achieved TFLOP/s"), ("peak_memory_gib", "peak GiB"),
                                  ("time_ratio_vs_bl_base", "time ratio vs BL_BASE"),
                                  ("flop_ratio_vs_bl_base", "FLOP ratio vs BL_BASE"),
                                  ("time_over_flop_ratio", "time ratio / FLOP ratio")]), "",
          f"- BL_BASE / MINIJOINT time ratio {minijoint['time_ratio_vs_bl_base']:.2f}x against an exact FLOP ratio of "
          f"{minijoint['flop_ratio_vs_bl_base']:.2f}x: {minijoint['time_over_flop_ratio']:.2f} of it (target >= 0.9: "
          f"{'met' if minijoint['time_over_flop_ratio'] >= 0.9 else 'NOT met'})",
          f"- mmadapt BL_BASE does {speedup:.2f}x the tokens/s of transformers on the same frozen-body job (target "
          f">= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'})"]
    name = "vs_hf_decoder" + ("" if args.shape == "cpu" else "_" + args.shape.replace(".", "_")) + \
        ("" if args.fusion == "none" else f"_{args.fusion}")
    paths = write_results(name, {"fusion": args.fusion, "shape": dataclasses.asdict(shape), "seq_length": s,
                                 "micro_batch": b, "ds_config": args.ds_config, "bf16": bf16,
                                            "transformers": transformers.__version__, "rows": [*rows, hf_row],
                                            "speedup_bl_base_vs_transformers": speedup}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
