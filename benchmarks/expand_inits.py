"""Vocabulary mode and the start of the new rows, in the demo's setting: the plug-in contextual gain
(unigram reference - plug-in loss through the primary model, nats per scored piece) after 0, 50,
200 and the last Step-2 update, for each --embedding_init (overlap, subword_mean, normal) and each
--vocab_mode (replace: the target vocabulary; expand: the source's plus the target's missing
pieces, only those trained), for MINIJOINT (over its mini-model) and BL_BASE (over the full model),
German. Expand runs also give the primary model's English loss before and after their new pieces
join its softmax.

    python benchmarks/expand_inits.py [--output_dir runs/expand_inits] [--iters 1000]

Starts from the demo's shipped Step-1 models (mmadapt/demo_models) and the demo's Step-2 settings
(mmadapt.demo.DemoConfig); every run is kept in --output_dir and resumed or skipped when run again.
Writes benchmarks/results/expand_inits_<hardware>_<date>.{json,md}. Losses, not times: it may run
beside other work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from common import REPO, hardware, table, write_results  # noqa: F401  (REPO: puts mmadapt on the path)

from mmadapt import steps
from mmadapt.config import EMBEDDING_INITS, VOCAB_MODES, PreprocessConfig, to_dict
from mmadapt.demo import VOCAB, Demo, DemoConfig, install_source_model
from mmadapt.parallel import init_parallel
from mmadapt.plugin import plugin_records
from mmadapt.run import RunSpec, run_progress

SYSTEMS = {"minijoint": "minijoint", "bl_base": "bl_base"}  # system -> the shipped source recipe
LANG = "de"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output_dir", default="runs/expand_inits")
    ap.add_argument("--iters", type=int, default=DemoConfig.adapt_iters, help="Step-2 updates (the demo's)")
    args = ap.parse_args()
    root = Path(args.output_dir)
    cfg = DemoConfig(langs=(LANG,), adapt_iters=args.iters)
    demo = Demo(cfg, root)
    init_parallel(1, 1)
    data = demo.prepare()  # en through the shipped tokenizer; de with its own 2000-piece vocabulary
    sources = {}
    for system, recipe in SYSTEMS.items():
        sources[system] = root / "pretrain" / recipe
        if not sources[system].exists():
            install_source_model(recipe, sources[system], data["en"], *map(to_dict, demo.source_settings(recipe)))
    # One expanded dataset serves both systems: their sources share the shipped English tokenizer.
    expanded = root / "data" / f"{LANG}-expanded"
    steps.preprocess(f"bible:{LANG}", output_dir=expanded, vocab_size=VOCAB, tokenizer=data[LANG] / "tokenizer.model",
                     cfg=PreprocessConfig(workers=1, valid_fraction=cfg.heldout_fraction),
                     expand_from=sources["minijoint"])
    points = sorted({p for p in (50, 200) if p < args.iters} | {args.iters})
    rows, records = [], []
    for system in SYSTEMS:
        for mode in VOCAB_MODES:
            for init in EMBEDDING_INITS:
                run_dir = root / "adapt" / f"{system}-{mode}-{init}"
                state = run_progress(run_dir, args.iters)
                train = dataclasses.replace(demo._train(args.iters, 200, train_micro_batch_size_per_gpu=cfg.adapt_batch),
                                            extra_save_steps=tuple(points), embedding_init=init, vocab_mode=mode)
                if state != "done":
                    data_path = expanded if mode == "expand" else data[LANG]
                    steps.adapt_embeddings(run=RunSpec(output_dir=run_dir, data_path=data_path,
                                                       resume=state == "resume"),
                                           step=steps.AdaptEmbeddings(system=system, source=sources[system],
                                                                      lang=LANG, train=train))
                arts = [run_dir / "embeddings" / f"step{p:08d}" for p in points]
                recs = plugin_records(sources[system], arts, {LANG: expanded if mode == "expand" else data[LANG]},
                                      cfg.seq_length, cfg.plugin_blocks)
                row = {"system": system, "vocab_mode": mode, "embedding_init": init, "gain_0": recs[0]["start_gain"],
                       **{f"gain_{r['step']}": r["score"] for r in recs}}
                run = json.loads((run_dir / "run.json").read_text())
                if mode == "expand":
                    report = run["expand_report"]
                    row.update(vocabulary=run["model"]["vocab_size"],
                               en_loss_before=report["source_loss_before"], en_loss_after=report["source_loss_after"])
                else:
                    row.update(vocabulary=run["model"]["vocab_size"])
                rows.append(row)
                records += recs
                print(json.dumps(row), flush=True)
    columns = [("system", "system"), ("vocab_mode", "vocab"), ("embedding_init", "init"), ("vocabulary", "V"),
               *((f"gain_{p}", f"gain @{p}") for p in [0, *points]), ("en_loss_before", "en loss before"),
               ("en_loss_after", "en loss after")]
    md = (f"# Vocabulary mode and new-row start, demo setting ({hardware()})\n\n"
          f"Plug-in contextual gain (nats per scored piece: unigram reference - loss through the primary model) of "
          f"German embeddings after 0, {', '.join(map(str, points))} Step-2 updates of {cfg.adapt_batch} x "
          f"{cfg.seq_length} tokens, from the demo's shipped Step-1 models; expand runs: the English loss of the "
          f"primary model (masked pieces of its own training text) before and after the new pieces join its softmax. "
          f"Each vocabulary scores its own German held-out blocks (the same verses, its own pieces and unigram "
          f"reference).\n\n" + table(rows, columns) + "\n")
    paths = write_results("expand_inits", {"settings": {"iters": args.iters, "points": points,
                                                        "batch": cfg.adapt_batch, "seq_length": cfg.seq_length},
                                           "rows": rows, "records": records}, md)
    print(md, "\n", *paths)


if __name__ == "__main__":
    main()
