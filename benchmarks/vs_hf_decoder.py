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
inside; mmadapt's blocks carry them shifted, the last position unscored). Dropout off; every
engine and transformers' model built first, then --repeats rounds of one update of each after
--warmup untimed rounds (ratios: medians of the rounds' ratios, with their range); time ratios
beside the exact FLOP ratios (models/llama/flops.py) and beside a causal count (attention halved).

--score_fraction p (default: TrainConfig's, the default of `mmadapt adapt`): mmadapt's systems
score round(p (s - 1)) of each row's s - 1 next pieces, drawn as data.CausalBatches draws them,
so its output layer runs on those rows only; transformers scores all of them. Its line on equal
quality reads benchmarks/results/score_fraction_cpu2_20261125.json: the Step-2 updates MINIJOINT
needs at p to reach 90% of its p = 1 gain, over those it needs at p = 1 (measured on llama-tiny in
the demo's setting, applied here to the time per update).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics

import numpy as np
import torch
from common import (REPO, RESULTS, add_zero_arg, engine_update, interleaved_times, paper_mini_layers, round_ratios,
                    run_ds_config, table, write_results)

from mmadapt.config import ModelConfig, TrainConfig, scored_positions
from mmadapt.data import score_subset
from mmadapt.models import find_preset
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.flops import adapt_flops, layer_attn_flops
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
    mini = paper_mini_layers(cfg)
    return {"bl_base": cfg.num_layers, "minipost": mini + 2, "minijoint": mini}


def blocks(shape: ModelConfig, micro: int, s: int, n: int, seed: int = 0,
           p: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n random rows of s + 1 ordinary pieces -> (input_ids [micro, s], next pieces [micro, s]),
    the last position unscored: the s - 1 targets transformers' shift scores; p < 1: a seeded
    round(p (s - 1)) of them."""
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, shape.vocab_size, (micro, s + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, -1] = IGNORE_INDEX
        if p < 1:
            m = scored_positions(s - 1, p)
            labels[:, :-1] = torch.from_numpy(np.stack([score_subset(r, rng, m) for r in labels[:, :-1].numpy()]))
        out.append((ids[:, :s], labels))
    return out


def equal_quality_updates(system: str, p: float) -> float | None:
    """`system`'s Step-2 updates to 90% of its p = 1 gain at p, over those at p = 1 (means over the
    languages and seeds of the score_fraction results file; None where it has no such row)."""
    path = RESULTS / "score_fraction_cpu2_20261125.json"
    if p == 1:
        return 1.0
    if not path.is_file():
        return None
    rows = {r["p"]: r for r in json.loads(path.read_text())["summary"] if r["system"] == system}
    if p not in rows or rows[p]["updates_to_90"] is None or rows[1.0]["updates_to_90"] is None:
        return None
    return rows[p]["updates_to_90"] / rows[1.0]["updates_to_90"]


def scored_flops(cfg: ModelConfig, s: int, scored: int) -> int:
    """Exact Step-2 FLOPs of one row of s positions of which `scored` reach the (tied) head: the
    head's three products scale with the scored rows."""
    return adapt_flops(cfg, s) - 3 * 2 * cfg.hidden_size * cfg.vocab_size * (s - scored)


HF = "transformers"


def causal_saving(cfg: ModelConfig, s: int) -> int:
    """The FLOPs of one row's Step 2 a causal attention kernel skips: half of the s x s score and
    value products the exact count (models/llama/flops.py, as FlopCounterMode counts the explicit
    product) holds, forward and the two products of their backward in every layer."""
    return 3 * cfg.num_layers * layer_attn_flops(cfg, s) // 2


def resident_gib() -> float:
    """Device memory held now, GiB (0 on a CPU)."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


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


def markdown(rows: list[dict], hf_row: dict, args, dev: str, peer: str, speedup: float, speedup_range: list[float],
             ratio: float | None, shape: ModelConfig, bf16: bool, peak: float | None) -> list[str]:
    """The results file's lines: the table, the two targets (each a median of the rounds' ratios,
    with their range) and, at p < 1, the equal-quality line."""
    s, b, p = args.seq_length, args.micro_batch, args.score_fraction
    base, minijoint = rows[0], next(r for r in rows if r["system"] == "minijoint")
    md = [f"# Step 2 of a {shape.num_layers}-layer decoder ({args.shape}): mmadapt vs transformers {peer} "
          f"({dev}, h={shape.hidden_size}, {shape.num_attention_heads} heads / {shape.query_groups} groups, "
          f"V={shape.vocab_size}, s={s}, batch {b}, {'bf16' if bf16 else 'fp32'}, body frozen, mmadapt fusion "
          f"{args.fusion}, mmadapt score_fraction {p:g})", "",
          table([*rows, hf_row], [("system", "system"), ("p", "p"), ("layers", "layers"),
                                  ("ms_per_update", "ms/update"),
                                  ("tokens_per_s", "tokens/s"), ("gflop", "GFLOP/update (exact)"),
                                  ("achieved_tflops", "achieved TFLOP/s"),
                                  ("achieved_tflops_causal", "achieved TFLOP/s, causal count"),
                                  ("resident_gib", "resident GiB"),
                                  ("time_ratio_vs_bl_base", "time ratio vs BL_BASE"),
                                  ("flop_ratio_vs_bl_base", "FLOP ratio vs BL_BASE"),
                                  ("time_over_flop_ratio", "time ratio / FLOP ratio"),
                                  ("time_over_flop_ratio_causal", "the same, causal count")]), "",
          f"Timed in {args.repeats} rounds of one update of every row in turn, after {args.warmup} untimed; "
          "ratios are medians of the rounds' ratios. Exact count: attention's s x s products whole, as "
          "FlopCounterMode counts them; causal count: half of them, what a causal flash kernel computes. "
          "Resident: what building the row's engine (model) added to device memory"
          + ("" if peak is None else f"; the run's peak: {peak:.2f} GiB") + ".", "",
          f"- BL_BASE / MINIJOINT time ratio {minijoint['time_ratio_vs_bl_base']:.2f}x "
          f"({minijoint['time_ratio_range'][0]:.2f}-{minijoint['time_ratio_range'][1]:.2f} over the rounds) against "
          f"an exact FLOP ratio of {minijoint['flop_ratio_vs_bl_base']:.2f}x: {minijoint['time_over_flop_ratio']:.2f} "
          f"of it (target >= 0.9: {'met' if minijoint['time_over_flop_ratio'] >= 0.9 else 'NOT met'}); against the "
          f"causal count's {minijoint['flop_ratio_causal']:.2f}x: {minijoint['time_over_flop_ratio_causal']:.2f}",
          f"- mmadapt BL_BASE does {speedup:.2f}x the tokens/s of transformers ({speedup_range[0]:.2f}-"
          f"{speedup_range[1]:.2f} over the rounds) on the same frozen-body job"
          + (f" scoring {p:g} of the positions where transformers scores all" if p != 1 else "")
          + f" (target >= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'})"]
    # transformers' job is BL_BASE's at p = 1: at equal quality, mmadapt's BL_BASE at p needs `ratio`
    # times the updates (score_fraction results) at its own time per update
    if p != 1:
        md.append("- no equal-quality figure for this p in the score_fraction results" if ratio is None else
                  f"- at equal plug-in quality (90% of BL_BASE's p = 1 gain, which BL_BASE at p = {p:g} reaches in "
                  f"{ratio:.2f}x the updates: score_fraction_cpu2_20261125) mmadapt's BL_BASE takes "
                  f"{ratio * base['ms_per_update'] / hf_row['ms_per_update']:.2f}x transformers' full-scoring time")
    return md


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b" if gpu else "cpu")
    ap.add_argument("--seq_length", type=int, default=2048 if gpu else 128)
    ap.add_argument("--micro_batch", type=int, default=4 if gpu else 16)
    ap.add_argument("--ds_config", default="ds_configs/" + ("zero1_bf16.json" if gpu else "zero1.json"),
                    help="mmadapt's DeepSpeed config; bf16 in it runs transformers under bf16 autocast too")
    add_zero_arg(ap)
    ap.add_argument("--repeats", type=int, default=10, help="timed updates (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    ap.add_argument("--fusion", default="none", choices=("none", "compile", "cudagraphs"),
                    help="mmadapt's ModelConfig.fusion")
    ap.add_argument("--score_fraction", type=float, default=TrainConfig.score_fraction,
                    help="mmadapt's TrainConfig.score_fraction p (default: its default); transformers scores every "
                    "position")
    args = ap.parse_args(argv)
    import transformers

    init_parallel(1, 1)
    s, b, p = args.seq_length, args.micro_batch, args.score_fraction
    train = TrainConfig(seq_length=s, train_micro_batch_size_per_gpu=b, train_iters=10**6, lr=1e-4, lr_warmup_iters=1)
    ds = run_ds_config(REPO / args.ds_config, train, args.zero_as_given)
    bf16 = bool(ds.get("bf16", {}).get("enabled"))
    shape = SHAPES[args.shape]
    batches, dev = blocks(shape, b, s, 4), device()
    mine = batches if p == 1 else blocks(shape, b, s, 4, p=p)
    # Every system's engine and transformers' model are built first and timed in rounds, each
    # round one update of each (common.interleaved_times): a ratio is the median of the rounds'
    # ratios, so a machine whose speed drifts between cases moves no ratio (one case timed after
    # another's moved the same code by 7% on an H200). Each row's resident memory (its weights,
    # gradients and optimizer state) is what its build added; the peak is the whole run's.
    fns, built, rows = {}, {}, []
    for system, layers in systems(shape).items():
        cfg = LLAMA.one_head(dataclasses.replace(shape, fusion=args.fusion), layers)
        before = resident_gib()
        job = LMJob(step="adapt", trainable=LLAMA.vocab_params(cfg))
        engine, _, _ = lm_engine(get_family(cfg), cfg, train, ds, job)
        fns[system], built[system] = engine_update(engine, mine, 1), (cfg, layers, resident_gib() - before)
    before = resident_gib()
    model, opt = hf_model(shape, train.lr)
    hf_resident = resident_gib() - before
    cycle = itertools.cycle(batches)

    def peer():
        ids, _ = next(cycle)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss  # shifted inside: s - 1 targets
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fns[HF] = peer
    times = interleaved_times(fns, args.warmup, args.repeats)
    for system, (cfg, layers, resident) in built.items():
        t = statistics.median(times[system])
        flops = b * scored_flops(cfg, s, int(mine[0][1][0].ge(0).sum()))
        causal = flops - b * causal_saving(cfg, s)
        rows.append({"system": system, "p": p, "layers": layers, "ms_per_update": 1e3 * t, "tokens_per_s": b * s / t,
                     "gflop": flops / 1e9, "achieved_tflops": flops / t / 1e12,
                     "gflop_causal": causal / 1e9, "achieved_tflops_causal": causal / t / 1e12,
                     "resident_gib": resident, "ms_each": [1e3 * x for x in times[system]]})
    base = rows[0]
    for r in rows:
        r["time_ratio_vs_bl_base"], r["time_ratio_range"] = round_ratios(times["bl_base"], times[r["system"]])
        r["flop_ratio_vs_bl_base"] = base["gflop"] / r["gflop"]
        r["time_over_flop_ratio"] = r["time_ratio_vs_bl_base"] / r["flop_ratio_vs_bl_base"]
        r["flop_ratio_causal"] = base["gflop_causal"] / r["gflop_causal"]
        r["time_over_flop_ratio_causal"] = r["time_ratio_vs_bl_base"] / r["flop_ratio_causal"]
    t_hf = statistics.median(times[HF])
    full = LLAMA.one_head(shape, shape.num_layers)
    hf_flops = b * scored_flops(full, s, s - 1)
    hf_row = {"system": "transformers (full model)", "p": 1.0, "layers": shape.num_layers,
              "ms_per_update": 1e3 * t_hf, "tokens_per_s": b * s / t_hf, "gflop": hf_flops / 1e9,
              "achieved_tflops": hf_flops / t_hf / 1e12, "gflop_causal": (hf_flops - b * causal_saving(full, s)) / 1e9,
              "achieved_tflops_causal": (hf_flops - b * causal_saving(full, s)) / t_hf / 1e12,
              "resident_gib": hf_resident, "ms_each": [1e3 * x for x in times[HF]]}
    speedup, speedup_range = round_ratios(times[HF], times["bl_base"])  # transformers' time over BL_BASE's
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    ratio = equal_quality_updates("bl_base", p)
    md = markdown(rows, hf_row, args, f"{dev}", f"{transformers.__version__} {type(model).__name__}", speedup,
                  speedup_range, ratio, shape, bf16, peak)
    # p's dot would end the file's stem (write_results' with_suffix): 0.5 -> _p0_5
    name = "vs_hf_decoder" + ("" if args.shape == "cpu" else "_" + args.shape.replace(".", "_")) + \
        ("" if args.fusion == "none" else f"_{args.fusion}") + \
        ("" if p == 1 else "_p" + f"{p:g}".replace(".", "_")) + ("_zero_as_given" if args.zero_as_given else "")
    paths = write_results(name, {"fusion": args.fusion, "score_fraction": p, "shape": dataclasses.asdict(shape),
                                 "seq_length": s, "micro_batch": b, "ds_config": args.ds_config, "bf16": bf16,
                                 "transformers": transformers.__version__,
                                 "rows": [*rows, hf_row], "speedup_bl_base_vs_transformers": speedup,
                                 "speedup_range": speedup_range, "peak_memory_gib": peak, "warmup": args.warmup,
                                 "repeats": args.repeats, "timing": "interleaved rounds",
                                 "equal_quality_update_ratio": ratio}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
