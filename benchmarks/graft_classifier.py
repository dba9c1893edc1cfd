"""Graft German embeddings trained over a base encoder into a classifier fine-tuned from it outside
mmadapt (every weight trained, as transformers users fine-tune one), scored zero-shot on German
bible-genre, beside the classifier with no adaptation and beside the paper's Step 3 (mmadapt's
fine-tune of the base, its embeddings frozen) with the same embeddings.

    base        the demo's shipped RoBERTa BL_BASE (pretrained on the English Bible), exported to
                transformers and imported back: a Hugging Face model as a user holds one
    sibling     RobertaForSequenceClassification of the base fine-tuned with transformers on the
                5,000 English bible-genre training verses (--sibling_epochs, AdamW, every weight),
                imported with `import-hf --task bible-genre`
    graft       Step 1b (MINIPOST) over the base, Step 2 over its mini-model (the demo's 1,000
                updates of 32 x 32); `evaluate --finetuned <sibling> --graft`
    full        Step 2 over the base's whole model (BL_BASE), the same updates, grafted alike
    paper       the same two artifact series through mmadapt's Step 3 of the base (the demo's
                fine-tune, word embeddings frozen): Step 4 as the paper runs it

Finished runs are kept (--output_dir).

    python benchmarks/graft_classifier.py --output_dir /tmp/graft_classifier
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from common import demo_hf_base, table, write_results  # (importing common puts mmadapt on the path)

from mmadapt import steps
from mmadapt.config import FinetuneConfig, MiniModelConfig, PreprocessConfig
from mmadapt.evaluate import evaluate_artifacts
from mmadapt.finetune import is_finished
from mmadapt.graft import check_siblings
from mmadapt.hf import import_any, import_hf
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, read_source, run_progress
from mmadapt.tasks import get_task, read_examples

LANG, VOCAB, HELD_OUT = "de", 2000, 0.03
TASK = "bible-genre"


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
    german = root / "data" / LANG
    steps.preprocess(f"bible:{LANG}", output_dir=german, vocab_size=VOCAB,
                     cfg=PreprocessConfig(workers=1, valid_fraction=HELD_OUT))
    minipost = root / "minipost"
    if run_progress(minipost, cfg.minipost_iters) != "done":
        steps.build_minipost(run=RunSpec(output_dir=minipost, data_path=english),
                             step=steps.BuildMinipost(primary=base, mini=MiniModelConfig(),
                                                      train=demo._train(cfg.minipost_iters, cfg.minipost_iters)))
    runs = {}
    for route, system, source in (("graft", "minipost", minipost), ("full", "bl_base", base)):
        run = runs[route] = root / "adapt" / route
        state = run_progress(run, cfg.adapt_iters)
        if state != "done":
            train = demo._train(cfg.adapt_iters, cfg.adapt_save_interval, train_micro_batch_size_per_gpu=cfg.adapt_batch)
            steps.adapt_embeddings(run=RunSpec(output_dir=run, data_path=german, resume=state == "resume"),
                                   step=steps.AdaptEmbeddings(system=system, source=source, lang=LANG, train=train))
    paper = root / "finetune"
    if not is_finished(paper):
        ft = dataclasses.replace(FinetuneConfig(), seq_length=cfg.seq_length, epochs=cfg.finetune_epochs,
                                 lr=cfg.finetune_lr, seed=1)
        steps.finetune(run=RunSpec(output_dir=paper, resume=(paper / "checkpoints").is_dir()),
                       step=steps.Finetune(task=TASK, primary=base, cfg=ft, eval_file="bible"))
    distance = check_siblings(read_source(base), read_source(sibling / "body"), {}, body_only=True).distance
    rows, records = [], {}
    for through, graft in (("classifier (transformers, every weight)", True), ("Step 3 (mmadapt, embeddings frozen)",
                                                                              False)):
        run = sibling if graft else paper
        records[through] = evaluate_artifacts([run], [runs["graft"], runs["full"]], "bible", graft=graft)
        none = next(r for r in records[through] if r["system"] == "no_adaptation")
        for route in ("graft", "full"):
            mine = [r for r in records[through] if r.get("artifact", "").startswith(str(runs[route]))]
            last = max(mine, key=lambda r: r["step"])
            rows.append({"through": through, "route": route, "flops": last["flops"], "updates": last["step"],
                         "none": none["score"], "start": min(mine, key=lambda r: r["step"])["score"],
                         "last": last["score"], "chance": last.get("chance"),
                         "curve": [(r["step"], r["flops"], r["score"]) for r in sorted(mine, key=lambda r: r["step"])]})
    write_results("graft_classifier", {"rows": rows, "records": records, "sibling_distance": distance,
                                       "sibling_epochs": args.sibling_epochs, "sibling_lr": args.sibling_lr},
                  markdown(rows, distance, args))


def markdown(rows: list[dict], distance: dict[str, float], args) -> str:
    layers = [v for k, v in distance.items() if "layers." in k]
    out = ["# Grafting German embeddings into a classifier fine-tuned outside mmadapt: the demo's RoBERTa", "",
           f"`python benchmarks/graft_classifier.py --output_dir <dir>` (sibling: {args.sibling_epochs:g} epochs at lr "
           f"{args.sibling_lr:g}, every weight); 2 CPU cores. German bible-genre accuracy (%) zero-shot on the "
           "held-out books' verses. graft: Step 2 over the base's MINIPOST mini-model; full: Step 2 over the "
           "base's whole model (BL_BASE). Through the classifier fine-tuned with transformers (`import-hf --task`, "
           "`evaluate --graft`), and through mmadapt's Step 3 of the same base (word embeddings frozen: the "
           "paper's Step 4). No adaptation: each with its own English tokenizer and embeddings.", "",
           f"The classifier's encoder against the base (the sibling check, ||sibling - base|| / ||base||): layers "
           f"{min(layers):.3f}-{max(layers):.3f}, word embeddings {distance.get('word_embeddings', 0.0):.3f}.", ""]
    for r in rows:
        r["tflops"] = r["flops"] / 1e12
        r["gain"] = r["last"] - r["none"]
    out.append(table(rows, [("through", "scored through"), ("route", "route"), ("updates", "updates"),
                            ("tflops", "Step-2 TFLOPs"), ("none", "no adaptation"), ("start", "update 0"),
                            ("last", "last"), ("gain", "last − no adaptation"), ("chance", "chance")]))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
