"""Graft German embeddings trained over a base decoder's mini-model into its fine-tuned sibling,
against the sibling with no adaptation and against Step 2 over the sibling itself at full depth
(the costly route the graft replaces), in bits per byte of the same held-out German verses.

    base      the demo's shipped llama-tiny BL_BASE (pretrained on the English Bible), exported
              to transformers and imported back: a Hugging Face model as a user holds one
    sibling   the base fine-tuned with transformers on a prompt/answer framing of English verses
              ("Q: Say verse N of Genesis.\\nA: <verse>"), its input embeddings and output
              projection frozen: an instruct model's stand-in
    graft     Step 1b (MINIPOST) over the base, Step 2 over its mini-model (--iters updates of
              32 x 32), the artifacts scored through the sibling (`evaluate --graft`)
    full      Step 2 over the sibling's full model (BL_BASE), the same updates
    modes     replace (a 2,000-piece German vocabulary) and expand (the base's vocabulary with the
              German pieces it lacks appended; English replay at the default 0.5): the sibling's
              own rows are kept, and its English bits per byte are scored with the graft and
              without it

Finished runs are kept (--output_dir).

    python benchmarks/graft.py --output_dir /tmp/graft
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import REPO, bits_at, demo_hf_base, table, write_results  # (importing common puts mmadapt on the path)

sys.path.insert(0, str(REPO / "tests"))
from hf_models import make_sibling  # noqa: E402  the tests' sibling maker: one fine-tune for both

from mmadapt import steps
from mmadapt.artifact import read_artifact
from mmadapt.bpb import BPB_BYTES, ByteScorer
from mmadapt.config import MiniModelConfig, PreprocessConfig
from mmadapt.graft import sibling_check
from mmadapt.heldout import Primary, Scorer
from mmadapt.hf import import_hf
from mmadapt.parallel import init_parallel
from mmadapt.plugin import plugin_records
from mmadapt.run import RunSpec, run_progress

HELD_OUT, VOCAB, LANG = 0.03, 2000, "de"
MODES = ("replace", "expand")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--save", type=int, default=250)
    ap.add_argument("--sibling_steps", type=int, default=100)
    ap.add_argument("--minipost_iters", type=int, default=150)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the vocabulary modes to run")
    args = ap.parse_args()
    init_parallel(1, 1)
    root = args.output_dir
    demo, hf_base = demo_hf_base(root, "llama", LANG)
    hf_sibling = root / "hf" / "sibling"
    if not (hf_sibling / "config.json").is_file():
        make_sibling(hf_base, hf_sibling, steps=args.sibling_steps, lr=1e-3)
    base, sibling = root / "base", root / "sibling"
    for hf, run in ((hf_base, base), (hf_sibling, sibling)):
        if not (run / "run.json").is_file():
            import_hf(hf, run)
    english = root / "data" / "en"  # in the imported base's ids, with held-out verses (English bits per byte)
    steps.preprocess("bible:en", output_dir=english, vocab_size=None, tokenizer=base / "tokenizer" / "spm.model",
                     cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
    minipost = root / "minipost"
    state = run_progress(minipost, args.minipost_iters)  # an interrupted run (or one stopped at its end) goes on
    if state != "done":
        steps.build_minipost(run=RunSpec(output_dir=minipost, data_path=english, resume=state == "resume"),
                             step=steps.BuildMinipost(primary=base, mini=MiniModelConfig(),
                                                      train=demo._train(args.minipost_iters, args.minipost_iters)))
    distance = sibling_check(base, sibling, {}).distance
    rows, paths = [], None  # paths: this run's one pair of results files, written as cells finish
    for mode in args.modes:
        runs, data = {}, {}
        for route, system, source in (("graft", "minipost", minipost), ("full", "bl_base", sibling)):
            # The same German text and split for both routes; expand's merged vocabulary is made from
            # the tokenizer of the run Step 2 trains over (the base's, or the sibling's same pieces).
            data[route] = root / "data" / (f"{LANG}-{mode}" + ("" if mode == "replace" else f"-{route}"))
            steps.preprocess(f"bible:{LANG}", output_dir=data[route], vocab_size=VOCAB,
                             cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT),
                             expand_from=(base if route == "graft" else sibling) if mode == "expand" else None)
            # expand's replay text, in the ids of the run Step 2 trains over (the same pieces, its own file)
            replay = english if route == "graft" else root / "data" / "en-sibling"
            if mode == "expand" and route == "full":
                steps.preprocess("bible:en", output_dir=replay, vocab_size=None,
                                 tokenizer=sibling / "tokenizer" / "spm.model",
                                 cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
            run = runs[route] = root / "adapt" / f"{route}-{mode}"
            state = run_progress(run, args.iters)
            if state != "done":
                train = demo._train(args.iters, args.save, train_micro_batch_size_per_gpu=demo.cfg.adapt_batch,
                                    vocab_mode=mode, replay_data=str(replay) if mode == "expand" else None)
                steps.adapt_embeddings(run=RunSpec(output_dir=run, data_path=data[route], resume=state == "resume"),
                                       step=steps.AdaptEmbeddings(system=system, source=source, lang=LANG, train=train))
        for route, primary, graft in (("graft", sibling, True), ("full", sibling, False),
                                      ("base (reference)", base, False)):
            trained = "full" if route == "full" else "graft"
            recs = plugin_records(primary, [runs[trained]], {LANG: data[trained]}, seq_length=demo.cfg.seq_length,
                                  blocks=256, graft=graft)
            last = recs[-1]
            rows.append({"mode": mode, "route": route, "through": primary.name, "flops": last["flops"],
                         "updates": last["step"], "none_bpb": last["none_bpb"], "start_bpb": last["start_bpb"],
                         "bpb": last["bpb"], "source_none_bpb": last.get("source_none_bpb"),
                         "source_bpb": last.get("source_bpb"),
                         "source_own_tokenizer_bpb": last.get("source_own_tokenizer_bpb"), "bpb_bytes": last["bpb_bytes"],
                         "source_suppressed_bpb": suppressed(primary, last, demo.cfg.seq_length),
                         "curve": [(r["step"], r["flops"], r["bpb"]) for r in recs]})
            paths = write_results("graft", {"rows": rows, "sibling_steps": args.sibling_steps,
                                            "sibling_distance": distance}, markdown(rows, args, distance), paths)


def suppressed(primary: Path, record: dict, seq_length: int) -> float | None:
    """An expanded record's English (its source text) read by `primary`'s own tokenizer through
    `primary` with the artifact swapped in and the new pieces suppressed (the softmax over the
    source rows alone, as generate(suppress_tokens=...) gives it); None for a replaced vocabulary."""
    if record.get("source_bpb_text") is None:
        return None
    emb, _, meta = read_artifact(Path(record["artifact"]))
    per_byte = ByteScorer(Scorer(Primary.read(primary)), seq_length, BPB_BYTES)  # plugin_records' text
    return per_byte.within(per_byte.text(record["source_bpb_text"]), per_byte.own_tokenizer,
                           meta["source_vocab_size"], emb, meta)


def markdown(rows: list[dict], args, distance: dict[str, float]) -> str:
    out = ["# Grafting German embeddings into a fine-tuned sibling: llama-tiny demo model", "",
           f"`python benchmarks/graft.py --output_dir <dir> --iters {args.iters} --sibling_steps {args.sibling_steps}"
           f"{'' if tuple(args.modes) == MODES else ' --modes ' + ' '.join(args.modes)}`; "
           "2 CPU cores. Bits per byte of the same held-out German verses (the first 8,192 bytes of the 3% held-out "
           "documents); lower is better. No adaptation: the model scored with its own (English) tokenizer and "
           "embeddings. graft: Step 2 over the base's MINIPOST mini-model, scored through the sibling; full: Step 2 "
           "over the sibling's whole model; base (reference): the graft's artifacts through the base itself. "
           "English (expand): held-out English verses through the model with its own vocabulary, then with the "
           "expanded one (the merged tokenizer), then with the expanded rows read by the model's own tokenizer: its "
           "source rows are kept bit for bit, so that last moves only by the new rows' share of the softmax, and the "
           "rest of the move is the merged tokenizer cutting English with new pieces; and read so with the new "
           "pieces suppressed (the softmax over the model's own rows), where it does not move.", "",
           "The sibling (export-hf --graft's check, ||sibling - base|| / ||base||): each layer moved "
           f"{min(v for k, v in distance.items() if 'layers.' in k):.3f}-"
           f"{max(v for k, v in distance.items() if 'layers.' in k):.3f}, the input embeddings "
           f"{distance.get('word_embeddings', 0.0):.3f}.", ""]
    shown = []
    for r in rows:
        s = dict(r)
        s["tflops"] = r["flops"] / 1e12
        s["gain"] = r["none_bpb"] - r["bpb"]
        if r.get("source_bpb") is not None:
            s["english"] = f"{r['source_none_bpb']:.4f} → {r['source_bpb']:.4f}"
            s["english_own"] = f"{r['source_own_tokenizer_bpb']:.4f}"
            s["english_suppressed"] = f"{r['source_suppressed_bpb']:.4f}"
        shown.append(s)
    out += [table(shown, [("mode", "mode"), ("route", "route"), ("through", "scored through"),
                          ("updates", "updates"), ("tflops", "Step-2 TFLOPs"), ("none_bpb", "no adaptation"),
                          ("start_bpb", "update 0"), ("bpb", "last"), ("gain", "no adaptation − last")]
                    + ([("english", "English: own → grafted"), ("english_own", "grafted, read by the own tokenizer"),
                        ("english_suppressed", "and the new pieces suppressed")]
                       if any("english" in s for s in shown) else [])), ""]
    for mode in MODES:
        g = next((r for r in rows if r["mode"] == mode and r["route"] == "graft"), None)
        f = next((r for r in rows if r["mode"] == mode and r["route"] == "full"), None)
        if g and f:
            same = bits_at([(x, y) for _, x, y in f["curve"]], g["flops"])
            out.append(f"- {mode}: the graft reads German at {g['bpb']:.3f} bits per byte through the sibling, "
                       f"{g['none_bpb'] - g['bpb']:.3f} below the sibling with no adaptation and "
                       f"{g['bpb'] - f['bpb']:+.3f} from Step 2 over the sibling itself, at "
                       f"{100 * g['flops'] / f['flops']:.0f}% of its Step-2 FLOPs; at the graft's compute "
                       f"({g['flops'] / 1e12:.3g} TFLOPs) Step 2 over the sibling was at {same:.3f} "
                       f"({g['bpb'] - same:+.3f}).")
    for r in rows:
        if r.get("source_bpb") is not None and r.get("source_own_tokenizer_bpb") is not None:
            share = r["source_own_tokenizer_bpb"] - r["source_none_bpb"]
            cut = r["source_bpb"] - r["source_own_tokenizer_bpb"]
            out.append(f"- English through {r['through']} ({r['route']}, expand): {r['source_none_bpb']:.4f} → "
                       f"{r['source_bpb']:.4f} bits per byte ({100 * (r['source_bpb'] / r['source_none_bpb'] - 1):+.2f}%):"
                       f" {share:+.4f} from the new rows' share of the softmax, {cut:+.4f} from the merged tokenizer's "
                       f"cuts. With the new pieces suppressed (generate(suppress_tokens=...)) and read by the model's "
                       f"own tokenizer: {r['source_suppressed_bpb']:.4f} "
                       f"({r['source_suppressed_bpb'] - r['source_none_bpb']:+.1e}), its own distribution.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
