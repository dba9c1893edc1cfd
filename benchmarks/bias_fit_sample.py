"""How much Step 2's output-bias fit (adapt.fit_bias, on adapt.FIT_POSITIONS = 2,048 scored
positions, the start's and PrimaryCalibration's) costs a model through sampling alone, where the
vocabulary has more pieces than those positions can show.

    python benchmarks/bias_fit_sample.py        # ~1 min on 2 CPU cores

A synthetic language with known conditionals: V pieces with Zipf unigram frequencies q; each
position's context names one piece (drawn from q) that comes next with probability 1/2, else a
piece drawn from q. Its exact model is calibrated (the mean of its predictions over contexts is
q), so a fit to q has nothing to correct and any change of held-out loss is the sample's. Also a
model miscalibrated piece by piece (a N(0, 1) offset on every piece's logit, as new rows start
uncalibrated): what the fit recovers of it. Fits: per piece (fit_bias, as Step 2 does), and per
piece where a piece is expected at least 5 times among the positions, one shared shift for the
rarer ones ("banded"). Held-out loss on 20,000 fresh positions, mean of 3 seeds.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import table, write_results

from mmadapt.adapt import FIT_POSITIONS, fit_bias


def fit_banded(c: torch.Tensor, logp: torch.Tensor, n_min: float = 5.0, iters: int = 200, tol: float = 1e-5):
    """fit_bias's iteration, with the pieces expected fewer than n_min times among c's positions
    moved by one shared shift (their total mass matched to theirs in logp)."""
    rare = logp.exp() * c.shape[0] < n_min
    b = torch.zeros(c.shape[1])
    for _ in range(iters):
        mean = torch.softmax(c + b, -1).mean(0)
        gap = logp - mean.log()
        if rare.any():
            gap[rare] = torch.logsumexp(logp[rare], 0) - torch.log(mean[rare].sum())
        b = b + gap
        if float(gap.abs().max()) < tol:
            break
    return b


def language(vocab: int, sharp: float = 0.5):
    q = 1 / torch.arange(1, vocab + 1, dtype=torch.float64)
    q = q / q.sum()

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:  # the exact model's log-probs [n, V], next pieces [n]
        ctx = torch.multinomial(q, n, replacement=True)
        logp = torch.log(sharp * F.one_hot(ctx, vocab) + (1 - sharp) * q).float()
        y = torch.where(torch.rand(n) < sharp, ctx, torch.multinomial(q, n, replacement=True))
        return logp, y
    return q.log().float(), draw


def measure(vocab: int, positions: int, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    target, draw = language(vocab)
    fit, _ = draw(positions)
    held, y = draw(20_000)
    off = torch.randn(vocab)
    loss = lambda logits: F.cross_entropy(logits, y).item()  # noqa: E731
    return {"calibrated": loss(held),
            "calibrated, fitted per piece": loss(held + fit_bias([fit], torch.zeros(vocab), target, tol=1e-5)),
            "calibrated, fitted banded": loss(held + fit_banded(fit, target)),
            "offset": loss(held + off),
            "offset, fitted per piece": loss(held + off + fit_bias([fit + off], torch.zeros(vocab), target, tol=1e-5)),
            "offset, fitted banded": loss(held + off + fit_banded(fit + off, target))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for vocab, positions in ((2000, FIT_POSITIONS), (2000, 8 * FIT_POSITIONS), (8000, FIT_POSITIONS),
                             (8000, 8 * FIT_POSITIONS)):
        runs = [measure(vocab, positions, seed) for seed in range(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        rows.append({"vocab": vocab, "positions": positions, **{k: round(v, 4) for k, v in mean.items()},
                     "sampling cost, per piece": round(mean["calibrated, fitted per piece"] - mean["calibrated"], 4),
                     "sampling cost, banded": round(mean["calibrated, fitted banded"] - mean["calibrated"], 4)})
        print(rows[-1], flush=True)
    md = ("# Step 2's output-bias fit: what its 2,048 positions cost through sampling\n\n"
          f"`python benchmarks/bias_fit_sample.py` (its docstring says what is measured). Held-out loss in nats per "
          f"piece, mean of {args.seeds} seeds.\n\n" + table(rows, [(k, k) for k in rows[0]]))
    print("\nwrote", *write_results("bias_fit_sample", {"seeds": args.seeds, "rows": rows}, md))


if __name__ == "__main__":
    main()
