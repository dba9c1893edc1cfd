"""Held-out logits at the scored positions: the whole [b, s, V] logits gathered (before dae9150)
against `model.logits(ids, padding, rows=...)` (heldout.scored_logits), one process, interleaved.

    python benchmarks/scored_logits.py                       # all-MiniLM-L6-v2's shape, ~1 min on 2 cores
    python benchmarks/scored_logits.py --layers 12 --hidden 768 --vocab 50265   # roberta-base's

What heldout.Scorer.logits feeds (Step 2's fitted output bias, an expanded vocabulary's source
bits per byte, expand's floor): the primary head's logits at a held-out batch's masked positions.
A BERT MLM with random weights at the given shape (the work does not depend on their values),
`--batches` batches of [b, s] with `--mask` of the positions scored. Reports each way's seconds per
batch (median of the rounds, min-max) and their ratio round by round, the largest difference
between the two logits, and the fp32 logits each way makes per batch (computed: rows x V x 4).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import interleaved_times, table, write_results

from mmadapt.config import ModelConfig
from mmadapt.heldout import scored_logits
from mmadapt.models import PRESETS
from mmadapt.models.bert.model import BertMLM
from mmadapt.models.layers import Padding


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--seq_length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mask", type=float, default=0.15, help="share of the positions scored")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    base = vars(PRESETS["bert-tiny"][0])
    cfg = ModelConfig(**{**base, "num_layers": args.layers, "hidden_size": args.hidden,
                         "num_attention_heads": args.heads, "ffn_hidden_size": 4 * args.hidden,
                         "vocab_size": args.vocab, "max_position_embeddings": args.seq_length + 2,
                         "head_layers": None})
    model = BertMLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    b, s = args.batch, args.seq_length
    batches = []
    for _ in range(args.batches):
        ids = torch.randint(5, args.vocab, (b, s), generator=g)
        index = torch.randperm(b * s, generator=g)[:round(args.mask * b * s)].sort().values  # [m], row-major
        batches.append((ids, Padding.of(ids), index, None))

    class WholeLogits(BertMLM):  # the path before: every position projected, m rows kept
        def logits(self, input_ids, padding=None):
            return super().logits(input_ids, padding)

    whole_model = WholeLogits(cfg).eval()
    whole_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = {"whole": scored_logits(whole_model, batches), "rows": scored_logits(model, batches)}
        diff = max(float((a - c).abs().max()) for a, c in zip(got["whole"], got["rows"]))
        times = interleaved_times({"whole": lambda: scored_logits(whole_model, batches),
                                   "rows": lambda: scored_logits(model, batches)}, warmup=1, repeats=args.repeats)
    m = len(batches[0][2])
    rows = []
    for name, n in (("whole", b * s), ("rows", m)):
        per = [t / args.batches for t in times[name]]
        rows.append({"path": name, "rows projected per batch": n, "s per batch (median)": statistics.median(per),
                     "min-max": f"{min(per):.3f}-{max(per):.3f}", "fp32 logits per batch, MB": n * args.vocab * 4 / 1e6})
    ratios = [r / w for r, w in zip(times["rows"], times["whole"])]
    md = [f"# Held-out logits at the scored positions: rows against the whole logits ({args.layers} layers, "
          f"h = {args.hidden}, V = {args.vocab}, [{b}, {s}], {args.mask:.0%} scored)", "",
          "`python benchmarks/scored_logits.py` (its docstring says what is timed). BERT MLM with random weights, "
          f"{args.batches} batches per round, {args.repeats} rounds after 1, both paths in turn each round, "
          f"{torch.get_num_threads()} torch threads, one process.", "",
          table(rows, [(k, k) for k in rows[0]]), "",
          f"rows / whole, round by round: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f}). Largest difference between the two paths' logits: {diff:.3g}. The logits' sizes "
          "are computed (rows x V x 4 bytes), not measured."]
    print("\n".join(md))
    write_results("scored_logits", {"args": vars(args), "times": times, "max_abs_diff": diff, "ratios": ratios},
                  "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
