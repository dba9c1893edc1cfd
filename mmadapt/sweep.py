"""The depth sweep: which mini-model of a multi-depth MINIJOINT run is the cheapest that transfers.

Beyond the paper (its section 7 and Appendix A.3, where each depth N was a separate pretraining):
one MINIJOINT pretraining with a secondary head after each of several layers (`--mini_layers 2 4 6`)
holds a mini-model of each depth. `steps.sweep` runs Step 2 over each of them on one target
language, scores every checkpoint with the plug-in metric (plugin.py: contextual gain =
unigram reference - loss through the primary model, on masked pieces for an encoder and next
pieces for a decoder), and this module turns those records into
the answer: per depth, the gain against Step-2 compute, and the cheapest depth that reaches
near-maximal performance.

Near-maximal follows the paper's section 4.2: `near_max` (0.95) of a reference gain, reached at
the compute interpolated linearly between the checkpoints just below and at or above it (the
curve starts at the overlap-initialised embeddings, compute 0). The reference is the final gain
of the full-model ceiling when the sweep trained one (Step 2 over the whole primary model, the
paper's BL_BASE role), otherwise the best final gain over the depths. Shallower mini-models
cost less per update but plateau lower (paper, Table A3), so the cheapest depth to the target
is not always the shallowest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmadapt.bpb import BPB_BYTES
from mmadapt.config import Checked, _f
from mmadapt.objectives import MLM, plugin_objective
from mmadapt.report import NEAR_MAX, PLUGIN_NOISE, VERDICT_PIECES, pyplot, save_figure, time_to_target

CEILING = "full"  # the key of the full-model row


@dataclass
class SweepConfig(Checked):
    """`mmadapt sweep`: what is trained besides the mini-models, and how they are scored."""
    ceiling: bool = _f(False, "also train embeddings over the full primary model (Step 2 as bl_base over the same "
                       "run, the most expensive): the reference for near-maximal performance instead of the best depth")
    near_max: float = _f(NEAR_MAX, "near-maximal performance: this fraction of the reference's final gain (paper "
                         "section 4.2: 95%)", gt=0, le=1)
    plugin_blocks: int = _f(256, "held-out blocks of the target validation split scored at every checkpoint", ge=1)
    bpb_bytes: int = _f(BPB_BYTES, "held-out target bytes scored in bits per byte at every checkpoint (the records' "
                        "bpb: the scale every tokenizer shares, docs/bits-per-byte.md; the summary reads the gains)",
                        ge=256)


def _curve(key, rows: list[dict]) -> dict:
    # The start is the curve's point at compute 0: from the records' start_gain, whether or not
    # the run saved its update-0 artifact (whose own record, step 0, would repeat it).
    rows = sorted((r for r in rows if r["step"] > 0), key=lambda r: r["flops"])
    if not rows:
        raise ValueError(f"the records of depth {key} hold no trained checkpoint (only update 0): train it")
    last = rows[-1]
    return {"system": last["system"], "updates": last["step"], "flops_per_update": last["flops"] / last["step"],
            "final_flops": last["flops"], "start_gain": last["start_gain"], "final_gain": last["score"],
            "points": [(0.0, last["start_gain"]), *((r["flops"], r["score"]) for r in rows)]}


def summarize(records: list[dict], near_max: float = NEAR_MAX) -> dict:
    """Plug-in records of a sweep (each with `mini_layers`: the depth N, or "full" for the
    ceiling), all of one objective's plug-in metric -> {lang, label ("MLM" or "LM"), scored (what
    its loss is per), reference, reference_from, target, meaningful, rows, cheapest}. Each row:
    mini_layers, system, updates, flops_per_update, final_flops, start_gain, final_gain,
    share (of the reference), points [(flops, gain)], and to_target / lower / upper (Step-2
    FLOPs to the target; None: never reached)."""
    langs = {r["lang"] for r in records}
    if len(langs) != 1:
        raise ValueError(f"a sweep scores one target language, these records hold {', '.join(sorted(langs))}")
    objective = {plugin_objective(r.get("task", "")) or MLM for r in records}
    if len(objective) != 1:
        raise ValueError("a sweep scores one objective's plug-in metric; these records hold "
                         + " and ".join(sorted(o.plugin_task for o in objective)))
    objective = objective.pop()
    keys = sorted({r["mini_layers"] for r in records}, key=lambda k: (k == CEILING, k if k != CEILING else 0))
    rows = [{"mini_layers": k, **_curve(k, [r for r in records if r["mini_layers"] == k])} for k in keys]
    depths = [row for row in rows if row["mini_layers"] != CEILING]
    if not depths:
        raise ValueError("the records hold no mini-model depth (only the full-model ceiling)")
    ceiling = next((row for row in rows if row["mini_layers"] == CEILING), None)
    best = max(depths, key=lambda row: row["final_gain"])
    reference, source = ((ceiling["final_gain"], "the full model") if ceiling else
        (best["final_gain"], f"the best depth (N = {best['mini_layers']})"))
    target = near_max * reference
    # Near the unigram reference (gain 0), or below it, a fraction of the reference is noise, not a
    # level; on a few held-out pieces, so is the reference
    pieces = min((r["masked_pieces"] for r in records if r.get("masked_pieces") is not None), default=None)
    meaningful = reference > PLUGIN_NOISE and (pieces is None or pieces >= VERDICT_PIECES)
    for row in rows:
        row["share"] = row["final_gain"] / reference if reference > 0 else None  # None: JSON has no NaN
        hit = time_to_target(row["points"], target) if meaningful else None
        row.update(to_target=None if hit is None else hit.estimate, lower=None if hit is None else hit.lower,
                   upper=None if hit is None else hit.upper)
    reached = [row for row in depths if row["to_target"] is not None]
    cheapest = min(reached, key=lambda row: (row["to_target"], row["mini_layers"])) if reached else None
    return {"lang": langs.pop(), "label": objective.label, "scored": objective.scored, "near_max": near_max,
            "reference": reference, "reference_from": source,
            "target": target, "meaningful": meaningful, "pieces": pieces, "rows": rows,
            "cheapest": None if cheapest is None else cheapest["mini_layers"]}


def _no_target_why(summary: dict) -> str:
    """Why a summary has no near-maximal target (summary["meaningful"] false): "pieces" (too few
    held-out pieces), "below" (a reference gain below the unigram reference) or "noise" (within
    noise of it)."""
    if (summary.get("pieces") or VERDICT_PIECES) < VERDICT_PIECES:
        return "pieces"
    return "below" if summary["reference"] <= -PLUGIN_NOISE else "noise"


def no_target(summary: dict) -> str:
    """_no_target_why in a sentence, with its figures and what to do."""
    pieces, reference = summary.get("pieces"), summary["reference"]
    return {"pieces": f"the gains are scored on {pieces} held-out pieces, too few to judge (at least "
                      f"{VERDICT_PIECES}): prepare the text with a larger validation split (--valid_fraction), "
                      "or raise --plugin_blocks",
            "below": f"the reference gain {reference:.3f} is below the unigram reference: the embeddings read the text "
                     "worse than piece frequencies alone; train longer, or check the data",
            "noise": f"the reference gain {reference:.3f} is within noise ({PLUGIN_NOISE} nats) of the unigram "
                     f"reference, so {round(100 * summary['near_max'])}% of it means nothing; train longer",
            }[_no_target_why(summary)]


def _label(summary: dict) -> str:
    """'masked-LM' or 'LM': the loss the gains are of (a summary written before it was recorded: MLM)."""
    return "masked-LM" if summary.get("label", MLM.label) == MLM.label else summary["label"]


def _scored(summary: dict) -> str:
    return summary.get("scored", MLM.scored)


def _e(flops: float | None) -> str:
    return "-" if flops is None else f"{flops / 1e18:.3g}"


def sweep_markdown(summary: dict, source: str = "") -> str:
    """The sweep's table: per depth its Step-2 cost, gains, share of the reference and the
    compute to near-maximal performance, then the cheapest depth."""
    pct = round(100 * summary["near_max"])
    out = [f"## Depth sweep, {summary['lang']}: plug-in contextual gain against Step-2 compute"
           + (f" ({source})" if source else ""), "",
           f"Gain = unigram reference - held-out {_label(summary)} loss through the primary model (nats per "
           f"{_scored(summary)[:-1]}"
           + (f", on {summary['pieces']:,} held-out {_scored(summary)}" if summary.get("pieces") else "") + "). "
           f"Reference: {summary['reference_from']}, final gain {summary['reference']:.3f}; near-maximal target "
           f"{pct}% of it = {summary['target']:.3f}.", "",
           "| depth N | Step-2 EFLOPs per update | updates | final EFLOPs | start gain | final gain | share of reference "
           f"| EFLOPs to {pct}% (bounds) |", "|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        name = "full model" if row["mini_layers"] == CEILING else str(row["mini_layers"])
        hit = "never" if row["to_target"] is None else f"{_e(row['to_target'])} ({_e(row['lower'])}–{_e(row['upper'])})"
        if not summary["meaningful"]:
            hit = "-"
        share = "-" if row["share"] is None or math.isnan(row["share"]) else f"{100 * row['share']:.0f}%"
        out.append(f"| {name} | {_e(row['flops_per_update'])} | {row['updates']} | {_e(row['final_flops'])} | "
                   f"{row['start_gain']:+.3f} | {row['final_gain']:+.3f} | {share} | {hit} |")
    out.append("")
    if not summary["meaningful"]:
        out.append(f"No cheapest depth: {no_target(summary)}.")
    elif summary["cheapest"] is None:
        out.append(f"No depth reached {pct}% of the reference within its Step-2 budget.")
    else:
        row = next(r for r in summary["rows"] if r["mini_layers"] == summary["cheapest"])
        line = (f"**Cheapest depth reaching {pct}% of the reference: N = {summary['cheapest']}**, at "
                f"{_e(row['to_target'])} EFLOPs of Step 2")
        ceiling = next((r for r in summary["rows"] if r["mini_layers"] == CEILING), None)
        if row["to_target"] == 0:  # its start already at the target (time_to_target's first point)
            line += " (its start is at the target already)"
        elif ceiling is not None and ceiling["to_target"]:  # (0: the ceiling's start is at it too)
            line += f", {ceiling['to_target'] / row['to_target']:.2f}× less than the full model needs"
        out.append(line + ".")
    out.append("")
    return "\n".join(out)


def plot_sweep(summary: dict, path) -> None:
    """Two panels: gain against Step-2 FLOPs, one line per depth (the ceiling dashed, the
    target dotted, the cheapest depth's hit starred); and per depth the FLOPs to the target."""
    plt = pyplot()
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for i, row in enumerate(summary["rows"]):
        full = row["mini_layers"] == CEILING
        xs, ys = zip(*row["points"])
        curves.plot(xs, ys, marker="o", ms=3, ls="--" if full else "-", color="gray" if full else f"C{i}",
                    label="full model" if full else f"N = {row['mini_layers']}")
        if row["mini_layers"] == summary["cheapest"]:
            curves.plot([row["to_target"]], [summary["target"]], marker="*", ms=12, color=f"C{i}")
    if summary["meaningful"]:
        curves.axhline(summary["target"], color="black", ls=":", lw=0.8,
                       label=f"{round(100 * summary['near_max'])}% of {summary['reference_from']}")
    curves.axhline(0.0, color="gray", lw=0.5)
    curves.set_xlabel("Step-2 FLOPs (exact count)", fontsize=8)
    curves.set_ylabel("contextual gain (nats)", fontsize=8)
    curves.set_title(f"plug-in {summary.get('label', MLM.label)} · {summary['lang']}", fontsize=9)
    curves.legend(fontsize=7)
    depths = [row for row in summary["rows"] if row["mini_layers"] != CEILING]
    names = [str(row["mini_layers"]) for row in depths]
    heights = [row["to_target"] or 0.0 for row in depths]
    bars.bar(names, heights, color=[f"C{i}" for i in range(len(depths))])
    for j, row in enumerate(depths):
        if row["to_target"] is None and summary["meaningful"]:
            bars.text(j, 0, "never", ha="center", va="bottom", fontsize=7)
    if not summary["meaningful"]:
        why = {"pieces": "too few held-out pieces", "below": "the reference gain\nis below the unigram reference",
               "noise": "the reference gain\nis within noise of the unigram reference"}[_no_target_why(summary)]
        bars.text(0.5, 0.5, f"no near-maximal target: {why}",
                  transform=bars.transAxes, ha="center", va="center", fontsize=8)
    bars.set_xlabel("mini-model depth N", fontsize=8)
    bars.set_ylabel(f"Step-2 FLOPs to {round(100 * summary['near_max'])}%", fontsize=8)
    bars.set_title("compute to near-maximal gain (lower is better)", fontsize=9)
    for ax in (curves, bars):
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
