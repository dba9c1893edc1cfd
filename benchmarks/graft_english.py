"""What it would cost German to keep English where it was: the expanded graft of
benchmarks/graft.py, its two parts of English's move taken away after training, one at a time.

An expanded vocabulary moves the source language by two things only (plugin.source_bits): the
new pieces' share of the softmax, and the merged tokenizer cutting source words with a new piece.
Neither can be 0 at no cost to the target:

    share   at a source position the loss rises by exactly -log(1 - s), s the new pieces' share
            there, and s = 0 only for new rows that score -infinity: pieces never predicted.
            After Step 2 the only free parameters of a tied decoder without an output bias are
            the new rows themselves (input and output side at once). Here they are moved by one
            shared vector, the nearest (least norm) that brings the mean rise on the English
            replay text's training split down to a fraction of what Step 2 left (expand.output_shift,
            the bounded start's own calibration, applied to the trained rows), and German and
            English are scored again.
    cuts    the merged tokenizer reads English as the source's does when none of its new pieces
            wins a segmentation of English (a unigram model keeps the source's ids where the best
            path uses no new piece: expand.py). The pieces that do win on the English corpus are
            counted, with their share of German's pieces, and dropped (scored under every piece,
            their rows kept) until no other wins in their place; both languages are then read by
            that tokenizer, first through the same trained rows (before German's rows could adapt
            to the coarser segmentation), then through the rows of a Step 2 run again as the
            graft's was (its recorded settings, the same German documents held out) on German
            prepared with that tokenizer: the cost of the cuts once German has trained without them.

Reads the finished runs of `python benchmarks/graft.py --output_dir DIR --modes expand` (run it
first); scores through the sibling, the last artifact of the graft route. The Step 2 without the
cutting pieces lands in DIR/adapt/graft-expand-uncut (kept, and resumed, as graft.py's runs are).

    python benchmarks/graft_english.py --output_dir DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch

from common import table, write_results  # (importing common puts mmadapt on the path)

from mmadapt import checkpoint, steps
from mmadapt.adapt import AdaptEmbeddings
from mmadapt.artifact import artifact_dirs, read_artifact
from mmadapt.bpb import BPB_BYTES, ByteScorer
from mmadapt.config import PreprocessConfig
from mmadapt.data import TEXT, read_manifest
from mmadapt.expand import SourceProbe, output_shift
from mmadapt.heldout import Primary, Scorer, Text
from mmadapt.parallel import init_parallel
from mmadapt.plugin import source_bits
from mmadapt.run import RunSpec, run_progress
from mmadapt.tokenizer import load

SEQ_LENGTH, LANG = 32, "de"  # graft.py's (the demo's llama-tiny)


def shifted(emb: dict, new: slice, delta: torch.Tensor) -> dict:
    """The artifact's tensors with every new row moved by `delta` [h] (tied: in and out)."""
    w = emb["word_embeddings"].clone()
    w[new] += delta.to(w.dtype)
    return {**emb, "word_embeddings": w}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True, help="graft.py's --output_dir, its expand runs finished")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.1],
                    help="the share's rise left, as a fraction of what Step 2 left on the English training text")
    args = ap.parse_args()
    init_parallel(1, 1)
    root = args.output_dir
    art = artifact_dirs([root / "adapt" / "graft-expand"])[-1]
    english_data, german = root / "data" / "en", root / "data" / f"{LANG}-expand-graft"
    emb, tok, meta = read_artifact(art)
    scorer = Scorer(Primary.read(root / "sibling"))
    per_byte = ByteScorer(scorer, SEQ_LENGTH, BPB_BYTES)
    raw_de = per_byte.text(german)
    n = meta["source_vocab_size"]
    new = slice(n, emb["word_embeddings"].shape[0])

    def scores(e: dict, reader: Path = tok) -> dict:
        """German and English in bits per byte with the tensors `e`, text read by `reader`."""
        english = source_bits(per_byte, english_data, reader, e, meta)
        return {"german_bpb": per_byte.score(raw_de, reader, e, meta)["bpb"], "english_bpb": english["source_bpb"],
                "english_own_tokenizer_bpb": english["source_own_tokenizer_bpb"]}

    # The share: the head's normed outputs at the English training text's scored positions.
    y, lse = (t.cpu().double() for t in SourceProbe(scorer, Text(english_data, SEQ_LENGTH, split=TEXT)).head_outputs())
    a = torch.logsumexp(y @ emb["word_embeddings"][new].double().T, 1)  # [m]: the new rows' logsumexp
    trained = float(torch.nn.functional.softplus(a - lse).mean())  # mean log(1 + share / (1 - share))
    english_none = per_byte.none(per_byte.text(english_data))  # the sibling with its own vocabulary
    # generate(suppress_tokens=<the new ids>) on English: the softmax over the sibling's own rows
    suppressed = per_byte.within(per_byte.text(english_data), per_byte.own_tokenizer, n, emb, meta)
    results = [{"rows": "as Step 2 left them", "fraction": 1.0, "rise_nats": trained, "shift_norm": 0.0, **scores(emb)}]
    row_norm = float(emb["word_embeddings"][new].float().norm(dim=1).mean())
    for f in args.fractions:
        # With the new rows' logsumexp a_i folded into the base, moving every row by delta is
        # output_shift's one row moved from 0: rise_i = log(1 + exp(a_i + y_i . delta - lse_i)).
        delta, rise = output_shift(y, lse - a, torch.zeros(y.shape[1]), 1, f * trained)
        results.append({"rows": f"moved to {f:g} of its rise", "fraction": f, "rise_nats": rise,
                     "shift_norm": float(delta.norm()), **scores(shifted(emb, new, delta))})
    for r in results:
        r["german_cost"] = r["german_bpb"] - results[0]["german_bpb"]
        r["english_move"] = r["english_bpb"] - english_none
        r["english_share_part"] = r["english_own_tokenizer_bpb"] - english_none

    # The cuts: the merged tokenizer's new pieces that win on the English corpus, dropped until none
    # does (without one, another may win), German's use of them, and both languages read by the
    # tokenizer without them, through the same rows and through a Step 2 run again without them.
    corpus = {lang: Path(read_manifest(d)["corpus"]).read_text(encoding="utf-8").splitlines()
              for lang, d in (("en", english_data), (LANG, german))}
    with tempfile.TemporaryDirectory() as work:  # the tokenizers without the cutting pieces
        reader, dropped, first, rounds = tok, set(), None, 0
        while True:
            cutting, lines_cut = collections.Counter(), 0
            merged = load(reader)
            for line in corpus["en"]:
                used = [i for i in merged.encode(line) if i >= n]
                lines_cut += bool(used)
                cutting.update(used)
            first = first or (cutting, lines_cut, merged)
            if not set(cutting) - dropped:  # what is left is read where nothing else can be (the source's <unk>)
                break
            dropped |= set(cutting)
            rounds += 1
            reader = never_producing(tok, dropped, Path(work) / f"without-{rounds}.json")
        left = cutting
        cutting, lines_cut, merged = first
        de_pieces = de_new = de_dropped = 0
        for line in corpus[LANG]:
            ids = merged.encode(line)
            de_pieces += len(ids)
            de_new += sum(i >= n for i in ids)
            de_dropped += sum(i in dropped for i in ids)
        cuts = {"new_pieces": new.stop - n, "cutting_pieces": len(cutting), "english_lines": len(corpus["en"]),
                "english_lines_cut": lines_cut, "english_uses": sum(cutting.values()),
                "most_used": [(merged.id_to_piece(i), c) for i, c in cutting.most_common(12)],
                "dropped_pieces": len(dropped), "rounds": rounds,
                "left": [(merged.id_to_piece(i), c) for i, c in left.most_common()],
                "german_pieces": de_pieces, "german_new_piece_uses": de_new, "german_uses_of_dropped": de_dropped,
                "without": scores(emb, reader)}
        retrained, with_cuts, without_cuts = retrain_without(root, german, reader)
        cuts["retrained"] = {"artifact": str(retrained), **scores(read_artifact(retrained)[0], reader),
                             "german_tokens": (with_cuts["tokens"], without_cuts["tokens"]),
                             "german_unknown": (with_cuts["unknown"], without_cuts["unknown"])}
    write_results("graft_english", {"artifact": str(art), "english_none_bpb": english_none, "row_norm": row_norm,
                                    "english_suppressed_bpb": suppressed, "shift": results, "cuts": cuts},
                  markdown(results, cuts, english_none, suppressed, row_norm, art))


def retrain_without(root: Path, german: Path, reader: Path) -> tuple[Path, dict, dict]:
    """The graft's Step 2 run again (its recorded step: system, source, settings, replay text) on
    the German corpus read by `reader`, the merged tokenizer without the cutting pieces
    (`never_producing`: the same ids, so every row the graft trained is there, the dropped ones
    read only where nothing else can be), held out as the graft's German (the prepared dataset
    `german`) was. -> its last artifact, and the manifests of `german` and of its German."""
    graft_run = root / "adapt" / "graft-expand"
    step = AdaptEmbeddings.recorded(checkpoint.read_json(graft_run / "run.json", "run file"))
    data = german.with_name(f"{german.name}-uncut")
    graft = read_manifest(german)
    steps.preprocess(f"bible:{LANG}", output_dir=data, vocab_size=None, tokenizer=reader,
                     cfg=PreprocessConfig(workers=1, valid_fraction=graft["valid_fraction"],
                                          tokenizer_seed=graft["valid_seed"]))
    # German is scored on the graft's held-out text: the run must not have trained on it. The split
    # is by document, drawn from the corpus and seed alone: the same documents, the same counts.
    mine = read_manifest(data)
    same = ("corpus_fingerprint", "valid_fraction", "valid_seed", "documents", "sentences")
    if any(mine[k] != graft[k] for k in same) or mine["valid"]["documents"] != graft["valid"]["documents"]:
        raise SystemExit(f"{data} holds out other documents than {german}: its scores would not compare")
    run = root / "adapt" / "graft-expand-uncut"
    state = run_progress(run, step.train.train_iters)
    if state != "done":
        steps.adapt_embeddings(run=RunSpec(output_dir=run, data_path=data, resume=state == "resume"), step=step)
    return artifact_dirs([run])[-1], graft, mine


def never_producing(tokenizer: Path, ids: set[int], out: Path) -> Path:
    """A copy of the merged tokenizer `tokenizer` (an imported Unigram's document, as graft.py's
    base has) that never produces the pieces `ids` (mmadapt ids) where any other segmentation
    exists: their scores put under every piece's, as the expansion's filler rows are
    (tokenizer._expand_unigram). Every id keeps its row."""
    doc = json.loads(Path(tokenizer).read_text(encoding="utf-8"))
    model = doc["tokenizer"]["model"]
    if model.get("type") != "Unigram":
        raise ValueError(f"{tokenizer} is not an imported Unigram tokenizer: graft.py's base has one")
    floor = min(score for _, score in model["vocab"]) - 1e3
    for i in ids:
        model["vocab"][doc["hf_ids"][i]][1] = floor
    out.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return out


def markdown(results: list[dict], cuts: dict, english_none: float, suppressed: float, row_norm: float,
             art: Path) -> str:
    base = results[0]
    shown = [{**r, **{k: f"{r[k]:.4f}" for k in ("german_bpb", "english_bpb", "english_own_tokenizer_bpb")},
              **{k: f"{r[k]:+.4f}" for k in ("german_cost", "english_move")}} for r in results]
    out = ["# What keeping English where it was would cost German: the expanded graft, llama-tiny", "",
           "`python benchmarks/graft_english.py --output_dir <graft.py's>`, after `python benchmarks/graft.py "
           "--modes expand` (its runs as in graft_cpu2_20261129); 2 CPU cores. Through the sibling, the graft "
           f"route's last artifact ({art.name}). Bits per byte of the same held-out text as graft.py: German "
           f"(lower is better), English (the sibling with its own vocabulary: {english_none:.4f}).", "",
           "## The new pieces' share of English's softmax", "",
           "The new rows (tied: input and output side) moved by one shared vector, the least that brings the mean "
           "rise of English's loss on the replay text's training split to a fraction of what Step 2 left "
           f"(expand.output_shift; the rows' mean norm is {row_norm:.3f}). `English, own tokenizer`: the share's "
           "part alone.", "",
           table(shown, [("rows", "new rows"), ("rise_nats", "rise on English training text (nats/piece)"),
                        ("shift_norm", "shift norm"), ("german_bpb", "German bpb"), ("german_cost", "German cost"),
                        ("english_bpb", "English bpb"), ("english_move", "English move from the sibling's"),
                        ("english_own_tokenizer_bpb", "English, own tokenizer")]), ""]
    half = next((r for r in results[1:] if r["fraction"] == 0.5), None)
    if half:
        out.append(f"- Halving the share's rise takes English from {base['english_bpb']:.4f} to "
                   f"{half['english_bpb']:.4f} bits per byte ({half['english_bpb'] - base['english_bpb']:+.4f}) "
                   f"and German from {base['german_bpb']:.4f} to {half['german_bpb']:.4f} "
                   f"({half['german_cost']:+.4f}): {abs(half['german_cost'] / (half['english_bpb'] - base['english_bpb'])):.0f} "
                   "bits of German per bit of English.")
    out += [f"- With the new pieces suppressed (their logits -inf, as `generate(suppress_tokens=...)` sets them), "
            f"English read by the sibling's own tokenizer through the graft is {suppressed:.4f} bits per byte, the "
            f"sibling's own {english_none:.4f} ({suppressed - english_none:+.1e}): the graft's logits over the "
            "sibling's rows are the sibling's (tests/test_graft.py)."]
    w, r = cuts["without"], cuts["retrained"]
    out += ["", "## The merged tokenizer's cuts", "",
            f"Of the {cuts['new_pieces']} new pieces, {cuts['cutting_pieces']} win a segmentation somewhere in the "
            f"English corpus ({cuts['english_lines_cut']:,} of {cuts['english_lines']:,} lines, "
            f"{cuts['english_uses']:,} uses; most: "
            + ", ".join(f"`{p}` {c}" for p, c in cuts["most_used"]) + "). "
            f"Dropped until no other wins (others can win in their place: {cuts['rounds']} "
            f"round{'s' if cuts['rounds'] != 1 else ''}), "
            f"{cuts['dropped_pieces']} pieces go; "
            + (", ".join(f"`{p}`" for p, _ in cuts["left"]) + " are still read in English, only where the source reads an "
               "<unk> (charged 8 bits a byte). " if cuts["left"] else "")
            + f"In German those {cuts['dropped_pieces']} are {cuts['german_uses_of_dropped']:,} of the "
            f"{cuts['german_new_piece_uses']:,} uses of new pieces "
            f"({100 * cuts['german_uses_of_dropped'] / cuts['german_new_piece_uses']:.0f}%) and "
            f"{100 * cuts['german_uses_of_dropped'] / cuts['german_pieces']:.1f}% of the German corpus's "
            f"{cuts['german_pieces']:,} pieces.", "",
            "Both languages read by the merged tokenizer without them (their scores put under every piece's, their "
            "rows kept): first through the same trained rows, before German's rows could adapt to the coarser "
            "segmentation; then through the rows of a Step 2 run again as the graft's was (its recorded settings "
            "and replay text, the same German documents held out) on German prepared with that tokenizer "
            f"({Path(r['artifact']).parent.parent.name}, {Path(r['artifact']).name}).", "",
            "| tokenizer | German bpb | English bpb | English, own tokenizer |", "|---|---|---|---|",
            f"| merged | {base['german_bpb']:.4f} | {base['english_bpb']:.4f} | {base['english_own_tokenizer_bpb']:.4f} |",
            f"| merged without the {cuts['dropped_pieces']} | {w['german_bpb']:.4f} ({w['german_bpb'] - base['german_bpb']:+.4f}) "
            f"| {w['english_bpb']:.4f} | {w['english_own_tokenizer_bpb']:.4f} |",
            f"| merged without the {cuts['dropped_pieces']}, Step 2 again with it | {r['german_bpb']:.4f} "
            f"({r['german_bpb'] - base['german_bpb']:+.4f}) | {r['english_bpb']:.4f} | "
            f"{r['english_own_tokenizer_bpb']:.4f} |", "",
            f"- Trained without the cutting pieces, German costs {r['german_bpb'] - base['german_bpb']:+.4f} bits per "
            f"byte over the graft's {base['german_bpb']:.4f}, and English moves {r['english_bpb'] - english_none:+.4f} "
            f"from the sibling's {english_none:.4f} (with them: {base['english_bpb'] - english_none:+.4f}). "
            f"Without them German's training text is {r['german_tokens'][1]:,} pieces against "
            f"{r['german_tokens'][0]:,} ({r['german_tokens'][1] / r['german_tokens'][0] - 1:+.1%}), with "
            f"{r['german_unknown'][1]:,} <unk> against {r['german_unknown'][0]:,}: no byte goes unread, but the "
            "words those pieces read whole (`▁und` among them) take more pieces, each one more prediction."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
