"""Why an expanded vocabulary's Step 2 starts far above the target unigram model on a real
encoder: the German (Russian) loss through the primary model split by what each held-out
position's target is, a source piece (its output row and bias frozen: the source language's
guarantee) or a new piece, at update 0 and after Step 2.

At a position whose target is a source piece the loss is at least the cross-entropy over the
source logits alone (the new pieces can only take mass away): the frozen English output side,
reading the German context, sets it, whatever the new pieces' output rows and bias are (their
input rows change the context it reads). A start that predicts a new piece by its frequency
among the new pieces (-log q(piece | new), what a start derived from the text's statistics
knows) and routes every position's mass to the right kind leaves

    floor = (1 - s) * CE_source + s * U_new,      s the share of new-piece targets,

and one that cannot tell the kinds apart pays -log(1 - s) and -log s on top. Only a start that
predicted the new pieces from their context, better than their frequencies, would go below it.
The target's unigram model pays no such cost at source-piece targets: it fits the source pieces'
German frequencies, which expand freezes at English's. Reads the finished runs of
benchmarks/real_weights.py (its --output_dir).

    python benchmarks/expand_floor.py --output_dir /tmp/real_weights
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from common import table, write_results  # (importing common puts mmadapt on the path)
from real_weights import ADAPT_ITERS, LANGS, SEQ, SOURCE_VOCAB, schedule

from mmadapt.adapt import AdaptEmbeddings, Step2Start, body_config
from mmadapt.artifact import artifact_dirs, read_artifact
from mmadapt.data import TOKENIZER
from mmadapt.heldout import Text, unigram_logprobs
from mmadapt.parallel import init_parallel
from mmadapt.run import read_source


def split(scorer, held, art: dict, meta: dict, logq: torch.Tensor) -> dict:
    """The plug-in loss of the artifact `art` on `held`, split by target kind, and the floors."""
    logits = torch.cat(scorer.logits(held.on_device, art, meta)).double()
    targets = torch.cat([t for *_, t in held.on_device]).to(logits.device)
    new = targets >= SOURCE_VOCAB
    s = float(new.double().mean())
    loss = F.cross_entropy(logits, targets, reduction="none")
    ce_source = float(F.cross_entropy(logits[~new, :SOURCE_VOCAB], targets[~new]).mean())
    logq_new = torch.log_softmax(logq[SOURCE_VOCAB:].double(), 0)
    u_new = float(-logq_new[targets[new] - SOURCE_VOCAB].mean())
    share = (torch.logsumexp(logits[:, SOURCE_VOCAB:], 1) - torch.logsumexp(logits, 1)).exp()
    return {"loss": float(loss.mean()), "loss_source_targets": float(loss[~new].mean()),
            "loss_new_targets": float(loss[new].mean()), "new_target_share": s,
            "new_mass": float(share.mean()), "ce_over_source_logits": ce_source,
            "unigram_source_targets": float(-logq.double()[targets[~new]].mean()),
            "unigram_new_targets": float(-logq.double()[targets[new]].mean()), "u_new_among_new": u_new,
            "floor_routed": (1 - s) * ce_source + s * u_new,
            "floor_unrouted": (1 - s) * (ce_source - math.log(1 - s)) + s * (u_new - math.log(s))}


def cell(root: Path, system: str, lang: str) -> list[dict]:
    source_dir = {"bl_base": root / "head", "minipost": root / "minipost"}[system]
    run_dir = root / "adapt" / f"{system}-expand-{lang}-subword_mean"
    target = root / "data" / f"{lang}-expanded"
    source = read_source(source_dir)
    train = schedule(ADAPT_ITERS, 100, embedding_init="subword_mean", vocab_mode="expand", plugin_eval_blocks=256)
    step = AdaptEmbeddings(system=system, source=source_dir, lang=lang, train=train)
    start = Step2Start.build(source, body_config(source.family, system, source.cfg), step, target / TOKENIZER, target)
    scorer, art = start.scorer(), start.tensors()
    vocab = art["word_embeddings"].shape[0]
    meta = {"vocab_mode": "expand", "source_vocab_size": SOURCE_VOCAB}
    held = scorer.heldout(Text(target, SEQ), vocab)
    logq = unigram_logprobs(target, vocab)
    final_art, _, final_meta = read_artifact(artifact_dirs([run_dir])[-1])
    rows = []
    for when, tensors, m in (("start", art, meta), (f"after {ADAPT_ITERS}", final_art, final_meta)):
        rows.append({"system": system, "lang": lang, "when": when, "unigram": held.unigram,
                     **split(scorer, held, tensors, m, logq)})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["# Where an expanded vocabulary's plug-in loss sits on all-MiniLM-L6-v2 (cpu, 2 cores)", "",
           "The Step-2 runs of benchmarks/real_weights.py with `--vocab_mode expand` (FVT rows, the new pieces' "
           "output bias calibrated so that English rises by 0.005 nats), scored on held-out target verses through "
           "the head-fitted primary model, split by each position's target: a source piece (its row and output "
           "bias frozen at English's) or a new piece. `CE over source logits`: the loss at source-piece targets "
           "if the new pieces took no mass there, which no choice of the new output rows lowers at update 0. "
           "`floor, routed`: (1 - s) CE_source + s U_new, the loss of a start that knew each position's "
           "target kind and predicted the new pieces by their frequencies among themselves; `floor, unrouted`: "
           "the same start unable to tell the kinds apart. "
           "Written by `python benchmarks/expand_floor.py`.", ""]
    out.append(table(rows, [("system", "system"), ("lang", "lang"), ("when", "when"), ("loss", "loss"),
                            ("unigram", "target unigram"), ("new_target_share", "new-piece targets"),
                            ("new_mass", "new pieces' mass"), ("loss_source_targets", "loss, source targets"),
                            ("ce_over_source_logits", "CE over source logits"),
                            ("unigram_source_targets", "unigram, source targets"),
                            ("loss_new_targets", "loss, new targets"), ("unigram_new_targets", "unigram, new targets"),
                            ("floor_routed", "floor, routed"), ("floor_unrouted", "floor, unrouted")]))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True, help="benchmarks/real_weights.py's, its runs finished")
    args = ap.parse_args()
    init_parallel(1, 1)
    rows = [row for system in ("bl_base", "minipost") for lang in LANGS for row in cell(args.output_dir, system, lang)]
    write_results("expand_floor", {"rows": rows}, markdown(rows))


if __name__ == "__main__":
    main()
