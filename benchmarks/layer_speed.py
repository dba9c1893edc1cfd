"""One transformer layer, forward + backward: eager against torch.compile, on padded and unpadded
blocks, with dropout on (as training runs it).

    python benchmarks/layer_speed.py              # CPU: h=256, s=128, micro 16; ~1 min on 2 cores
    python benchmarks/layer_speed.py              # GPU: roberta-base layer, s=512, micro 32, bf16

Eager is `mmadapt.models.roberta.model.TransformerLayer` as the model runs it; compiled is the same module after
`torch.compile` (what `--fusion compile` applies to each layer): inductor fuses the bias adds,
GELU, dropout, residual adds and LayerNorms that eager launches one by one. "padded" blocks carry
the attention mask of blocks that end in padding (SDPA then cannot use its flash kernel on a
GPU), or the jagged layout of attention_impl "varlen"; "unpadded" ones carry none. Median of --repeats after --warmup (compilation happens in
the warm-up and is reported separately).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from common import SHAPES, add_run_args, median_time, table, write_results

from mmadapt.models.roberta.model import Padding, TransformerLayer, attention_mask
from mmadapt.parallel import device, seed_everything
from mmadapt.tokens import NUM_SPECIAL, PAD_ID


def layer_step(layer, x, mask):
    def run():
        layer(x, mask).float().pow(2).mean().backward()
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, cpu_micro_batch=16)
    args = ap.parse_args(argv)
    dev, gpu = device(), torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = SHAPES[args.shape]
    if not args.dropout:
        cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    b, s = args.micro_batch, args.seq_length
    seed_everything(0)
    x = torch.randn(b, s, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    ids = torch.full((b, s), NUM_SPECIAL, device=dev)
    ids[:, s - s // 16:] = PAD_ID  # the last 1/16 of each block is padding
    padding = Padding.of(ids.cpu())
    masks = {"padded, mask": attention_mask(ids, padding, "sdpa"),
             "padded, varlen": attention_mask(ids, padding, "varlen"), "unpadded": None}
    rows = []
    for fused in (False, True):
        layer = TransformerLayer(cfg, 1).to(dev, dtype).train()
        if fused:
            layer.compile()
        for name, m in masks.items():
            t0 = time.perf_counter()
            layer_step(layer, x, m)()  # the first call compiles
            first = time.perf_counter() - t0
            t, times = median_time(layer_step(layer, x, m), args.warmup, args.repeats)
            rows.append({"path": "compiled" if fused else "eager", "blocks": name, "ms": 1e3 * t,
                         "first_call_s": first, "times_s": times})
    eager = {r["blocks"]: r["ms"] for r in rows if r["path"] == "eager"}
    for r in rows:
        r["speedup_vs_eager"] = eager[r["blocks"]] / r["ms"]
        r["vs_eager_padded_mask"] = eager["padded, mask"] / r["ms"]
    md = [f"# One layer forward + backward ({dev}, {str(dtype).split('.')[-1]}, h={cfg.hidden_size}, "
          f"ffn={cfg.ffn_hidden_size}, s={s}, batch {b}, dropout {'on' if args.dropout else 'off'})", "",
          table(rows, [("path", "path"), ("blocks", "blocks"), ("ms", "ms fwd+bwd"),
                       ("speedup_vs_eager", "vs eager, same blocks"), ("vs_eager_padded_mask", "vs eager padded+mask"),
                       ("first_call_s", "first call s (compile)")])]
    paths = write_results("layer_speed", {"shape": dataclasses.asdict(cfg), "seq_length": s, "micro_batch": b,
                                          "dtype": str(dtype), "dropout": args.dropout, "rows": rows}, "\n".join(md))
    print("\n".join(md))
    print(f"\nwritten: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
