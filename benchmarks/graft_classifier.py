"""Graft German embeddings trained over a base encoder into a classifier fine-tuned from it outside
mmadapt (every weight trained, as transformers users fine-tune one), scored zero-shot on German
bible-genre, beside the classifier with no adaptation, beside Step 2 over the classifier's own
encoder at full depth (the costly route the graft replaces), and beside the paper's Step 3
(mmadapt's fine-tune of the base, its embeddings frozen) with the same embeddings.

    base        the demo's shipped RoBERTa BL_BASE (pretrained on the English Bible), exported to
                transformers and imported back: a Hugging Face model as a user holds one
    sibling     RobertaForSequenceClassification of the base fine-tuned with transformers on the
                5,000 English bible-genre training verses (--sibling_epochs, AdamW, every weight),
                imported with `import-hf --task bible-genre`
    graft       Step 1b (MINIPOST) over the base, Step 2 over its mini-model (the demo's 1,000
                updates of 32 x 32); `evaluate --finetuned <sibling> --graft`
    sibling     (route) an MLM head fitted over the classifier's encoder (`mmadapt fit-head`,
                --head_iters), Step 2 over that whole encoder (BL_BASE), the same updates
    base        (route) Step 2 over the base's whole model (BL_BASE), the same updates
    modes       replace (a 2,000-piece German vocabulary: every route) and expand (the base's
                vocabulary with the German pieces it lacks appended, English replay at the default
                0.5: graft and sibling; the graft again at each --expand_nats), with the
                classifier's English bible-genre score with the new embeddings and without them
    paper       the artifacts trained over the base through mmadapt's Step 3 of the base (the
                demo's fine-tune, word embeddings frozen): Step 4 as the paper runs it

Finished runs are kept (--output_dir).

    python benchmarks/graft_classifier.py --output_dir /tmp/graft_classifier
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from common import bits_at, demo_hf_base, table, write_results  # (importing common puts mmadapt on the path)

from mmadapt import steps
from mmadapt.config import FinetuneConfig, MiniModelConfig, PreprocessConfig
from mmadapt.checkpoint import read_json
from mmadapt.data import TEXT, TOKENIZER, read_manifest
from mmadapt.evaluate import evaluate_artifacts
from mmadapt.extend import Extend
from mmadapt.finetune import is_finished
from mmadapt.graft import check_siblings
from mmadapt.hf import import_any, import_hf
from mmadapt.hf_classifier import BODY
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, read_source, run_progress
from mmadapt.tasks import get_task, read_examples
from mmadapt.tokenizer import kind
from mmadapt.tokenizer import load as load_tokenizer

LANG, VOCAB, HELD_OUT = "de", 2000, 0.03
TASK = "bible-genre"
MODES = ("replace", "expand")
ROUTES = {"replace": ("graft", "sibling", "base"), "expand": ("graft", "sibling")}  # Step 2's runs per mode
CLASSIFIER, PAPER = "classifier (transformers, every weight)", "Step 3 (mmadapt, embeddings frozen)"


def fine_tune_classifier(base: Path, out: Path, epochs: float, lr: float, batch: int, seed: int) -> Path:
    """RobertaForSequenceClassification of `base`, every weight trained on the English training
    verses with transformers (AdamW, linear decay), saved with the base's tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task = get_task(TASK)
    labels = list(task.labels)
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(seed)
    hf = AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)})
    examples = read_examples(task, "bible", "en", "train")
    steps_total = int(epochs * len(examples) / batch)
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / max(steps_total, 1))
    g = torch.Generator().manual_seed(seed)
    hf.train()
    for _ in range(steps_total):
        pick = torch.randint(0, len(examples), (batch,), generator=g).tolist()
        enc = tok([examples[i][0] for i in pick], truncation=True, max_length=64, padding=True, return_tensors="pt")
        loss = hf(**enc, labels=torch.tensor([examples[i][1] for i in pick])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    hf.eval()
    hf.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", type=Path, required=True)
    ap.add_argument("--sibling_epochs", type=float, default=3.0)
    ap.add_argument("--sibling_lr", type=float, default=1e-4)
    ap.add_argument("--head_iters", type=int, default=Extend.head_iters,
                    help="fit-head's updates over the classifier's encoder (the full route over the sibling)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the vocabulary modes to run")
    ap.add_argument("--expand_target_scores", action=argparse.BooleanOptionalAction, default=True,
                    help="the graft's expand Step 2 again with its new pieces at the target tokenizer's own scores")
    ap.add_argument("--expand_nats", nargs="*", type=float, default=[0.1, 1.0],
                    help="the graft's expand Step 2 again at each of these --expand_source_nats (its default first)")
    args = ap.parse_args()
    init_parallel(1, 1)
    root = args.output_dir
    demo, hf_base = demo_hf_base(root, "roberta", LANG)
    cfg, hf_sibling = demo.cfg, root / "hf" / "classifier"
    if not (hf_sibling / "config.json").is_file():
        fine_tune_classifier(hf_base, hf_sibling, args.sibling_epochs, args.sibling_lr, 32, 1)
    base, sibling = root / "base", root / "classifier"
    if not (base / "run.json").is_file():
        import_hf(hf_base, base)
    if not (sibling / "run.json").is_file():
        import_any(hf_sibling, sibling, task=TASK)
    english = root / "data" / "en"  # in the imported base's ids
    steps.preprocess("bible:en", output_dir=english, vocab_size=None, tokenizer=base / "tokenizer" / "spm.model",
                     cfg=PreprocessConfig(workers=1))
    minipost = root / "minipost"
    state = run_progress(minipost, cfg.minipost_iters)  # an interrupted run (or one stopped at its end) goes on
    if state != "done":
        steps.build_minipost(run=RunSpec(output_dir=minipost, data_path=english, resume=state == "resume"),
                             step=steps.BuildMinipost(primary=base, mini=MiniModelConfig(),
                                                      train=demo._train(cfg.minipost_iters, cfg.minipost_iters)))
    # The full route over the sibling: a classifier's encoder has no MLM head, so one is fitted over
    # it (mmadapt fit-head, on English in its own tokenizer's ids) and Step 2 runs over the whole
    # encoder with that head, as extend does for a headless model.
    english_sibling, head = root / "data" / "en-classifier", root / "classifier-head"
    steps.preprocess("bible:en", output_dir=english_sibling, vocab_size=None,
                     tokenizer=sibling / BODY / "tokenizer" / "spm.model", cfg=PreprocessConfig(workers=1))
    state = run_progress(head, args.head_iters)
    if state != "done":
        steps.fit_head(run=RunSpec(output_dir=head, data_path=english_sibling, resume=state == "resume"),
                       step=steps.FitHead(primary=sibling / BODY, train=demo._train(args.head_iters, args.head_iters)))
    routes = {"graft": ("minipost", minipost, english), "sibling": ("bl_base", head, english_sibling),
              "base": ("bl_base", base, english)}
    runs, shares = {}, {}  # (mode, row label) -> (route, run); expand's German data -> (first row label, source_share)
    for mode in args.modes:
        # replace: one German vocabulary for every route; expand: the German pieces appended to the
        # vocabulary of the run Step 2 trains over (the base's, or the classifier's same pieces)
        for route in ROUTES[mode]:
            system, source, replay = routes[route]
            data = root / "data" / (LANG if mode == "replace" else f"{LANG}-expand-{route}")
            steps.preprocess(f"bible:{LANG}", output_dir=data, vocab_size=VOCAB,
                             cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT),
                             expand_from=source if mode == "expand" else None)
            # (name suffix, row label, TrainConfig changes, data): expand's graft again where the new
            # pieces may take more of English at update 0, and where its tokenizer reads German in
            # the new pieces at the target's own scores (each ablates one suspect of its shortfall)
            variants, source_rows = [("", route, {}, data)], read_source(source).cfg.vocab_size
            if (mode, route) == ("expand", "graft"):
                variants += [(f"-nats{n:g}", f"{route} (nats {n:g})", {"expand_source_nats": n}, data)
                             for n in args.expand_nats]
                if args.expand_target_scores:
                    variants.append(("-target-scores", f"{route} (target scores)", {},
                                     target_scored(root, data, source_rows)))
            for suffix, label, changes, text in variants:
                run = root / "adapt" / (route if mode == "replace" else f"{route}-{mode}{suffix}")
                runs[mode, label] = route, run
                if mode == "expand" and text not in shares:
                    shares[text] = label, source_share(text, source_rows)
                state = run_progress(run, cfg.adapt_iters)
                if state != "done":
                    train = demo._train(cfg.adapt_iters, cfg.adapt_save_interval,
                                        train_micro_batch_size_per_gpu=cfg.adapt_batch, vocab_mode=mode,
                                        replay_data=str(replay) if mode == "expand" else None, **changes)
                    steps.adapt_embeddings(run=RunSpec(output_dir=run, data_path=text, resume=state == "resume"),
                                           step=steps.AdaptEmbeddings(system=system, source=source, lang=LANG,
                                                                      train=train))
    paper = root / "finetune"
    if not is_finished(paper):
        ft = dataclasses.replace(FinetuneConfig(), seq_length=cfg.seq_length, epochs=cfg.finetune_epochs,
                                 lr=cfg.finetune_lr, seed=1)
        steps.finetune(run=RunSpec(output_dir=paper, resume=(paper / "checkpoints").is_dir()),
                       step=steps.Finetune(task=TASK, primary=base, cfg=ft, eval_file="bible"))
    distance = check_siblings(read_source(base), read_source(sibling / BODY), {}, body_only=True).distance
    one_off = {"graft": minipost_flops(minipost, demo._train(cfg.minipost_iters, cfg.minipost_iters)),
               "sibling": float(read_json(head / "run.json", "run file")["flops"]), "base": 0.0}
    segmentation = dict(shares.values())
    rows, records, expanded = [], {}, {}
    for through, run in ((CLASSIFIER, sibling), (PAPER, paper)):
        # the paper's Step 3 fine-tunes the base: only the artifacts trained over the base (not the
        # ablations) go into it
        mine = {key: path for key, (route, path) in runs.items()
                if run == sibling or (key[1] == route and route != "sibling")}
        records[through] = evaluate_artifacts([run], list(mine.values()), "bible", graft=run == sibling)
        none = next(r for r in records[through] if r["system"] == "no_adaptation")
        for (mode, label), path in mine.items():
            curve = sorted((r for r in records[through] if r.get("artifact", "").startswith(f"{path}/")),
                           key=lambda r: r["step"])
            rows.append({"through": through, "mode": mode, "route": label, "flops": curve[-1]["flops"],
                         "one_off": one_off[runs[mode, label][0]], "updates": curve[-1]["step"], "none": none["score"],
                         "start": curve[0]["score"], "last": curve[-1]["score"], "chance": curve[-1].get("chance"),
                         "curve": [(r["step"], r["flops"], r["score"]) for r in curve]})
            if mode == "expand" and run == sibling:
                expanded[label] = path, Path(curve[-1]["artifact"])
    # the classifier's English task with each expanded vocabulary's last embeddings and without
    # them: one scoring pass (the model built once, each tokenizer's English encoded once)
    english = evaluate_artifacts([sibling], [art for _, art in expanded.values()], "bible", graft=True, lang="en")
    own = next(r for r in english if r["system"] == "no_adaptation")
    english_rows = [{"route": label, "own": own["score"], "grafted": record["score"], "artifact": str(art),
                     "expand_report": read_json(path / "run.json", "run file").get("expand_report")}
                    for (label, (path, art)), record in zip(expanded.items(), english)]
    write_results("graft_classifier", {"rows": rows, "english": english_rows, "records": records,
                                       "sibling_distance": distance, "sibling_epochs": args.sibling_epochs,
                                       "sibling_lr": args.sibling_lr, "head_iters": args.head_iters,
                                       "expand_nats": args.expand_nats, "segmentation": segmentation},
                  markdown(rows, english_rows, distance, segmentation, args))


def minipost_flops(run: Path, train) -> float:
    """Step 1b's training FLOPs (its run.json does not record them, as fit-head's does): its
    updates' cost (flops.STEPS "minipost": the new layers trained over the frozen bottom)."""
    source = read_source(run)
    per_sequence = source.family.step_flops("minipost", source.cfg, train.seq_length,
                                            source.family.scored_fraction(train),
                                            trainable_layers=MiniModelConfig().new_layers)
    return per_sequence * train.global_batch(1) * train.train_iters


def target_scored(root: Path, merged: Path, rows: int) -> Path:
    """German prepared with `merged`'s tokenizer (an expansion of an imported Unigram tokenizer,
    its first `rows` pieces the source's) changed only in the new pieces' scores: the target
    tokenizer's own log-probabilities (that of the replace data, root/data/LANG, trained on the
    same text) instead of those shifted under every source piece (tokenizer.expand_hf), so that
    Viterbi takes a new piece wherever the target's model would. -> the prepared data."""
    if kind(merged / TOKENIZER) != "unigram":
        raise ValueError(f"{merged / TOKENIZER} is not a Unigram tokenizer: its new pieces hold no score to change")
    doc = json.loads((merged / TOKENIZER).read_text(encoding="utf-8"))
    target = root / "data" / LANG  # prepared here already where replace ran (a no-op then)
    steps.preprocess(f"bible:{LANG}", output_dir=target, vocab_size=VOCAB,
                     cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
    sp = load_tokenizer(target / TOKENIZER)
    score = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    for entry in doc["tokenizer"]["model"]["vocab"][rows:]:
        entry[1] = score[entry[0]]
    out = root / "tokenizers" / "de-expand-target-scores.model"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    data = root / "data" / f"{LANG}-expand-target-scores"
    steps.preprocess(f"bible:{LANG}", output_dir=data, vocab_size=None, tokenizer=out,
                     cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
    return data


def source_share(data: Path, source_rows: int) -> dict:
    """How an expanded vocabulary's tokenizer reads the target text (`data`, prepared with it):
    its pieces, and the share of them that are the source's own rows (id < source_rows, frozen in
    Step 2) rather than new ones."""
    ids = np.fromfile(data / f"{TEXT}.bin", dtype=np.dtype(read_manifest(data)["dtype"]))
    return {"pieces": int(ids.size), "source_share": float((ids < source_rows).mean())}


def markdown(rows: list[dict], english: list[dict], distance: dict[str, float], segmentation: dict, args) -> str:
    layers = [v for k, v in distance.items() if "layers." in k]
    out = ["# Grafting German embeddings into a classifier fine-tuned outside mmadapt: the demo's RoBERTa", "",
           f"`python benchmarks/graft_classifier.py --output_dir <dir>` (sibling: {args.sibling_epochs:g} epochs at lr "
           f"{args.sibling_lr:g}, every weight; fit-head: {args.head_iters} updates); 2 CPU cores. German bible-genre "
           "accuracy (%) zero-shot on the held-out books' verses. Routes: graft, Step 2 over the base's MINIPOST "
           "mini-model; sibling, Step 2 over the classifier's whole encoder with an MLM head fitted over it "
           "(`mmadapt fit-head`: the costly route the graft replaces); base, Step 2 over the base's whole model "
           "(BL_BASE). replace: a 2,000-piece German vocabulary; expand: the German pieces the vocabulary lacks "
           "appended (English replay at the default 0.5), the classifier's own source rows kept; graft (nats x): "
           "the same with --expand_source_nats x (default 0.01: how much of English the new pieces may take at "
           "update 0); graft (target scores): the same with the merged tokenizer's new pieces at the target "
           "tokenizer's own scores, not shifted under every source piece. Scored through the "
           "classifier fine-tuned with transformers (`import-hf --task`, `evaluate --graft`), and through mmadapt's "
           "Step 3 of the same base (word embeddings frozen: the paper's Step 4) for the artifacts trained over the "
           "base. No adaptation: each with its own English tokenizer and embeddings. One-off: the route's Step-1 "
           "cost before Step 2 (Step 1b's two layers; fit-head's head).", "",
           f"The classifier's encoder against the base (the sibling check, ||sibling - base|| / ||base||): layers "
           f"{min(layers):.3f}-{max(layers):.3f}, word embeddings {distance.get('word_embeddings', 0.0):.3f}.", ""]
    for r in rows:
        r["tflops"], r["one_off_tflops"] = r["flops"] / 1e12, r["one_off"] / 1e12
        r["gain"] = r["last"] - r["none"]
    out.append(table(rows, [("through", "scored through"), ("mode", "mode"), ("route", "route"),
                            ("updates", "updates"), ("tflops", "Step-2 TFLOPs"), ("one_off_tflops", "one-off TFLOPs"),
                            ("none", "no adaptation"), ("start", "update 0"), ("last", "last"),
                            ("gain", "last − no adaptation"), ("chance", "chance")]))
    out.append("")
    for mode in MODES:
        g = next((r for r in rows if (r["through"], r["mode"], r["route"]) == (CLASSIFIER, mode, "graft")), None)
        f = next((r for r in rows if (r["through"], r["mode"], r["route"]) == (CLASSIFIER, mode, "sibling")), None)
        if g and f:
            same = bits_at([(x, y) for _, x, y in f["curve"]], g["flops"])
            out.append(f"- {mode}: the graft reads German bible-genre at {g['last']:.2f}% through the classifier, "
                       f"{g['last'] - g['none']:+.2f} points from the classifier with no adaptation and "
                       f"{g['last'] - f['last']:+.2f} from Step 2 over the classifier's own encoder, at "
                       f"{100 * g['flops'] / f['flops']:.0f}% of its Step-2 FLOPs (with each route's one-off "
                       f"cost: {100 * (g['flops'] + g['one_off']) / (f['flops'] + f['one_off']):.0f}%); at the "
                       f"graft's Step-2 compute the route over the classifier was at {same:.2f}%.")
    for seg in [dict(t) for t in dict.fromkeys(tuple(v.items()) for v in segmentation.values())]:
        routes = ", ".join(route for route, v in segmentation.items() if v == seg)
        how = ("with its new pieces at the target's own scores" if "target scores" in routes else
               "(a new piece is taken only where it replaces several source pieces, tokenizer.expand_hf)")
        out.append(f"- expand ({routes}): the merged tokenizer {how} reads the German training text in "
                   f"{seg['pieces']:,} pieces, {100 * seg['source_share']:.0f}% of them the source's own (frozen) rows.")
    for e in english:
        start = (e.get("expand_report") or {}).get("plugin_gain_start")
        out.append(f"- English bible-genre through the classifier (expand, {e['route']}): {e['own']:.2f}% with its own "
                   f"tokenizer and embeddings, {e['grafted']:.2f}% with the expanded embeddings read by the merged "
                   f"tokenizer ({e['grafted'] - e['own']:+.2f} points). Read by the classifier's own tokenizer they "
                   "change nothing: those pieces' rows are the classifier's own, bit for bit, and a classifier has "
                   "no softmax over the vocabulary."
                   + (f" Step 2's German plug-in gain over a unigram model at update 0: {start:+.2f} nats."
                      if start is not None else ""))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
