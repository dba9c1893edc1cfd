"""What each --vocab_mode expand start takes from the source language at update 0, in the demo's
setting: the primary model's English loss on held-out English verses (3% of the English Bible's
documents, the replay text's validation split) with the German pieces in its softmax, minus its
own, for the new rows' output side as the input side (`embedding_init`), at the source rows'
mean (a decoder's start before 2026-11-26, Hewitt's), and the bounded start (the encoder's bias
bound; a decoder's mean row moved off the source text, plugin.off_source_start, on the replay
text's training split). Both families' shipped MINIJOINT and BL_BASE. No training: starts only.

    python benchmarks/expand_start.py [--output_dir runs/expand_replay] [--families roberta llama]

Shares expand_replay.py's data (its --output_dir). Writes
benchmarks/results/expand_start_<hardware>_<date>.{json,md}. Losses, not times.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import table, write_results  # (importing common puts mmadapt on the path)
from expand_replay import LANG, setup

from mmadapt.adapt import step2_start
from mmadapt.data import TOKENIZER
from mmadapt.models.layers import derive_seed, new_rows_name
from mmadapt.parallel import init_parallel
from mmadapt.plugin import SourceProbe, off_source_start, source_text
from mmadapt.run import read_source


def starts(s: dict, system: str, probe: SourceProbe) -> list[dict]:
    """One row per start of `system`'s source model."""
    src = read_source(s["sources"][system])
    primary = src.family.primary_model(src.cfg, src.weights())[1]
    seed = derive_seed(s["demo"]._train(1, 1).seed, f"embeddings.{LANG}")
    merged, seq = s["expanded"] / TOKENIZER, s["cfg"].seq_length
    rows = []
    for start in ("embedding_init", "mean", "bounded"):
        body, init, counts = step2_start(system, src.path, src.tag, merged, seed, None, "overlap", "expand",
                                         "bounded" if start == "mean" else start)
        moved = src.family.output_path(body).bias is None and start == "bounded"
        if start == "mean" and src.family.output_path(body).bias is not None:
            continue  # the encoder's bounded start is its bias bound: no mean-row variant
        if moved:
            init, shift = off_source_start(src, s["replay"], seq, body, init, primary)
            counts.update(shift)
        tensors = {key: torch.cat([init[name], init[new_rows_name(name)]])
                   for key, name in src.family.artifact_keys().items() if name in init}
        scored = probe.score(tensors, {"vocab_mode": "expand", "source_vocab_size": src.cfg.vocab_size})
        rows.append({"system": system, "start": start, "en_rise": scored["source_loss"] - probe.before,
                     "kl": scored["source_kl"], "bound": counts["new_mass_bound"],
                     "calibrated": counts.get("new_mass_calibrated", ""), "moved": counts.get("output_shift", ""),
                     "new_pieces": init[new_rows_name(src.family.word)].shape[0]})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output_dir", default="runs/expand_replay")
    ap.add_argument("--families", nargs="+", default=["roberta", "llama"])
    ap.add_argument("--systems", nargs="+", default=["minijoint", "bl_base"])
    ap.add_argument("--blocks", type=int, default=256, help="held-out English blocks scored")
    args = ap.parse_args()
    init_parallel(1, 1)
    results, md = {}, ["# Expand starts at update 0: what the German pieces take from English\n",
                       __doc__.split("\n\n")[0].replace("\n", " ") + "\n",
                       "`en_rise`: nats per scored English piece (the KL from the source model's distribution, "
                       "`kl`, is the same to rounding); `bound`: the start's worst case over every context "
                       "(adapt.py); `calibrated`: a moved row's rise on the text it was moved on (the replay "
                       "text's training split); `moved`: how far it moved (norm).\n"]
    cols = [("system", "system"), ("start", "start"), ("en_rise", "en rise @0"), ("kl", "KL @0"),
            ("bound", "bound"), ("calibrated", "calibrated"), ("moved", "moved"), ("new_pieces", "new pieces")]
    for family in args.families:
        s = setup(family, Path(args.output_dir) / family)
        results[family] = []
        for system in args.systems:
            probe = SourceProbe(s["sources"][system], source_text(s["sources"][system], s["replay"]),
                                s["cfg"].seq_length, args.blocks)
            results[family] += [{**r, "before": probe.before} for r in starts(s, system, probe)]
        md.append(f"## {family}\n\n" + table(results[family], cols) + "\n")
    print(*write_results("expand_start", {"settings": {"lang": LANG, "blocks": args.blocks}, "results": results},
                         "\n".join(md)))


if __name__ == "__main__":
    main()
