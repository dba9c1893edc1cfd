"""Which vocabulary pays, on one scale: Step 2 over the demo's MINIJOINT mini-model for German and
Russian, with a replaced target vocabulary of each size and an expanded one (the source's 2,000
pieces plus the target's missing ones), scored in bits per byte of the same held-out verses
through the primary model (bpb.py), beside no adaptation (the English model as it is).

    source    the demo's shipped MINIJOINT encoder (roberta tiny preset, 12 layers, h 64, its
              2,000-piece English vocabulary; mmadapt/demo_models), or the llama-tiny decoder
              (--family llama)
    Step 2    the demo's schedule (--iters updates of 32 blocks of 32, checkpoints every --save),
              over the 4-layer mini-model; expand with the English Bible as --replay_data
              (replay_fraction 0: the text its bounded start is calibrated on and the source
              text it is scored on)
    compared  at equal Step-2 compute: each cell's bits per byte interpolated (linearly between
              checkpoints) at the smallest final compute of the language's cells; and at the
              last checkpoint

Finished runs are kept (--output_dir), so an interrupted sweep continues.

    python benchmarks/vocab_sweep.py --output_dir /tmp/vocab_sweep
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import bits_at, table, write_results  # (importing common puts mmadapt on the path)

from mmadapt import steps
from mmadapt.config import PreprocessConfig
from mmadapt.demo import Demo, DemoConfig, install_source_model, source_models, to_dict
from mmadapt.parallel import init_parallel
from mmadapt.plugin import plugin_records
from mmadapt.run import RunSpec, run_progress

LANGS = ("de", "ru")
REPLACE = (1000, 2000, 4000, 8000)
EXPAND = (2000, 8000)  # target vocabularies whose missing pieces are appended to the source's 2,000
SYSTEM = "minijoint"
HELD_OUT = 0.03  # the demo's heldout_fraction


def cells() -> list[tuple[str, str, int]]:
    return [(lang, mode, v) for lang in LANGS
            for mode, sizes in (("replace", REPLACE), ("expand", EXPAND)) for v in sizes]


def prepare(root: Path, source: Path, lang: str, mode: str, v: int) -> Path:
    out = root / "data" / f"{lang}-{mode}-{v}"
    steps.preprocess(f"bible:{lang}", output_dir=out, vocab_size=v, cfg=PreprocessConfig(workers=1,
                     valid_fraction=HELD_OUT), expand_from=source if mode == "expand" else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True)
    ap.add_argument("--family", choices=("roberta", "llama"), default="roberta")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--save", type=int, default=200)
    ap.add_argument("--rewrite", type=Path, help="only write the results' markdown again from this results JSON")
    args = ap.parse_args()
    if args.rewrite:
        import json

        write_results(f"vocab_sweep_{args.family}", {"rows": json.loads(args.rewrite.read_text())["rows"]},
                      markdown(json.loads(args.rewrite.read_text())["rows"], args))
        return
    init_parallel(1, 1)
    root = args.output_dir
    demo = Demo(DemoConfig(family=args.family, langs=LANGS), root)
    english = root / "data" / "en"
    steps.preprocess("bible:en", output_dir=english, vocab_size=None, tokenizer=source_models(args.family) / "spm.model",
                     cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
    source = root / "pretrain" / SYSTEM
    if not source.exists():
        model, train = demo.source_settings(SYSTEM)
        install_source_model(SYSTEM, source, english, to_dict(model), to_dict(train))
    rows, records, paths = [], {}, None  # paths: this run's one pair of results files
    for lang, mode, v in cells():
        data = prepare(root, source, lang, mode, v)
        run = root / "adapt" / f"{lang}-{mode}-{v}"
        state = run_progress(run, args.iters)
        if state != "done":
            train = demo._train(args.iters, args.save, train_micro_batch_size_per_gpu=demo.cfg.adapt_batch,
                                vocab_mode=mode, replay_data=str(english) if mode == "expand" else None)
            steps.adapt_embeddings(run=RunSpec(output_dir=run, data_path=data, resume=state == "resume"),
                                   step=steps.AdaptEmbeddings(system=SYSTEM, source=source, lang=lang, train=train))
        recs = plugin_records(source, [run], {lang: data}, seq_length=demo.cfg.seq_length, blocks=256)
        records[(lang, mode, v)] = recs
        last = recs[-1]
        rows.append({"lang": lang, "mode": mode, "target_vocab": v, "vocab_size": _rows(run), "updates": last["step"], "flops": last["flops"], "none_bpb": last["none_bpb"],
                     "start_bpb": last["start_bpb"], "last_bpb": last["bpb"], "plugin_gain": last["score"],
                     "source_none_bpb": last.get("source_none_bpb"), "source_bpb": last.get("source_bpb"),
                     "bpb_bytes": last["bpb_bytes"],
                     "curve": [(r["step"], r["flops"], r["bpb"]) for r in recs]})
        paths = write_results(f"vocab_sweep_{args.family}", {"rows": rows}, markdown(rows, args), paths)  # as it goes
    for lang in LANGS:
        mine = [r for r in rows if r["lang"] == lang]
        budget = min(r["flops"] for r in mine)
        for r in mine:
            r["budget_flops"] = budget
            r["bpb_at_budget"] = bits_at([(x["flops"], x["bpb"]) for x in records[(lang, r["mode"], r["target_vocab"])]],
                                         budget)
    write_results(f"vocab_sweep_{args.family}", {"rows": rows}, markdown(rows, args), paths)


def _rows(run: Path) -> int:
    import json

    return json.loads((run / "run.json").read_text())["model"]["vocab_size"]


def markdown(rows: list[dict], args) -> str:
    out = [f"# Vocabulary sweep in bits per byte: {args.family} demo model, Step 2 over MINIJOINT's mini-model", "",
           f"`python benchmarks/vocab_sweep.py --output_dir <dir> --family {args.family} --iters {args.iters} "
           f"--save {args.save}`; 2 CPU cores. Bits per byte of the same held-out verses of each language (the "
           "demo's 3% held-out documents, the first 8,192 bytes) through the primary model; lower is better. "
           "No adaptation: the English model with its own tokenizer and embeddings. Equal compute: each cell "
           "interpolated at the smallest final Step-2 compute among the language's cells.", ""]
    for lang in LANGS:
        mine = [dict(r) for r in rows if r["lang"] == lang]
        if not mine:
            continue
        for r in mine:
            r["gain"] = r["none_bpb"] - r["last_bpb"]
            r["cell"] = f"{r['mode']} {r['target_vocab']}"
            r["tflops"] = r["flops"] / 1e12
            if r.get("source_bpb") is not None:
                r["source"] = f"{r['source_none_bpb']:.4f} → {r['source_bpb']:.4f}"
        out += [f"## {lang} (no adaptation {mine[0]['none_bpb']:.3f} bits per byte, {mine[0]['bpb_bytes']:,} bytes)",
                "", table(mine, [("cell", "vocabulary"), ("vocab_size", "rows"), ("updates", "updates"),
                                 ("tflops", "Step-2 TFLOPs"), ("start_bpb", "update 0"), ("last_bpb", "last"),
                                 ("bpb_at_budget", "at equal compute"), ("gain", "no adaptation − last"),
                                 ("plugin_gain", "contextual gain (nats/piece)"),
                                 ("source", "English: own → expanded")]), ""]
        ranked = sorted((r for r in mine if r.get("bpb_at_budget") is not None), key=lambda r: r["bpb_at_budget"])
        if len(ranked) > 1:
            best, second = ranked[0], ranked[1]
            out += [f"At equal Step-2 compute ({ranked[0]['budget_flops'] / 1e12:.3g} TFLOPs) {best['cell']} wins in "
                    f"{lang}: {best['bpb_at_budget']:.3f} bits per byte, {second['bpb_at_budget'] - best['bpb_at_budget']:.3f} "
                    f"below the next ({second['cell']}, {second['bpb_at_budget']:.3f}) and "
                    f"{mine[0]['none_bpb'] - best['bpb_at_budget']:.3f} below no adaptation.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
