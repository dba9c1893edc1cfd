"""Does a short `--preset tiny` pretraining give a model that fine-tunes? (issue 30, item 5)

    python benchmarks/tiny_preset.py                         # the grid below, ~14 min on 2 cores
    python benchmarks/tiny_preset.py --bias zeros --lr 2.5e-4 --seeds 1234 --no_finetune

For each setting: Step 1 (`recipe bl_base`, the tiny preset with the setting's output_bias_init,
init_method_std, lr, warm-up, clipping and batch, `--train_iters` updates on Genesis + Exodus
with a 1,000-piece tokenizer: the tests' corpus), then Step 3 on bible-testament (Old vs New
Testament, 1,000 English training verses per class, 2 epochs, lr 5e-4, 64 pieces), scored on
250 held-out verses per class (books no training verse comes from; chance 50%). Also recorded:
the last pretraining loss and how much the top layer's output varies across verses (std over 64
verses of the first position's hidden state, mean over features; the classifier reads that
position): ~1e-4 is the collapse that keeps a model at chance.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, table, write_results

from mmadapt import parallel, steps
from mmadapt.config import FinetuneConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.corpora import testament_examples, write_bible_corpus
from mmadapt.data import train_tokenizer
from mmadapt.features import encode_classify
from mmadapt.models import get_family
from mmadapt.run import RunSpec, load_weights
from mmadapt.tokenizer import load as load_tokenizer

VOCAB = 1000
# Default: the preset's schedule (lr 2e-3, 20 warm-up updates, batch 16) with each start of the
# weights, over three Step-1 seeds (1234: the preset's).
GRID = {"std": (0.02, 0.07), "lr": (2e-3,), "warmup": (20,), "clip": (0.0,), "batch": (16,),
        "bias": ("zeros", "unigram")}


def top_layer_spread(run_dir: Path, tokenizer: Path) -> float:
    """Std across 64 English verses of the top layer's output at the first position, mean over
    features: ~0 when the model maps every input to the same vector."""
    cfg, state = load_weights(run_dir)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    body = get_family(cfg).build_body(cfg)
    body.load_state_dict({k: state[k] for k in body.state_dict()})
    texts = [t for t, _ in testament_examples("en", "test", 32)]
    ids = encode_classify(load_tokenizer(tokenizer), [(t, 0) for t in texts], 64).input_ids
    with torch.no_grad():
        h = body.encode(ids, (cfg.num_layers,), None)[0]  # [b, s, h]
    return float(h[:, 0].std(0).mean())


def one(root: Path, corpus: Path, tokenizer: Path, setting: dict, seed: int, iters: int, finetune: bool) -> dict:
    model, train = PRESETS["tiny"]
    model = apply_recipe(dataclasses.replace(model, vocab_size=VOCAB, init_method_std=setting["std"],
                                             output_bias_init=setting["bias"]), "bl_base")
    train = dataclasses.replace(train, train_iters=iters, save_interval=iters, lr=setting["lr"],
                                lr_warmup_iters=setting["warmup"], gradient_clipping=setting["clip"], seed=seed,
                                train_micro_batch_size_per_gpu=setting["batch"], log_interval=iters)
    name = "_".join(f"{k}{v}" for k, v in setting.items()) + f"_seed{seed}"
    t0 = time.perf_counter()
    rows = steps.pretrain(run=RunSpec(output_dir=root / name / "pretrain", corpus=corpus, tokenizer=tokenizer),
                          step=steps.Pretrain(model=model, train=train, recipe="bl_base"))
    t1 = time.perf_counter()
    out = {"init_method_std": setting["std"], "output_bias_init": setting["bias"], "lr": setting["lr"],
           "lr_warmup_iters": setting["warmup"],
           "gradient_clipping": setting["clip"], "batch": setting["batch"], "seed": seed, "train_iters": iters,
           "pretrain_loss": [r["loss"] for r in rows if "loss" in r][-1],
           "top_layer_spread": top_layer_spread(root / name / "pretrain", tokenizer), "pretrain_s": t1 - t0}
    if not finetune:
        return out
    ft = FinetuneConfig(seq_length=64, epochs=2.0, lr=5e-4, seed=1, log_interval=50)
    record, _ = steps.finetune(run=RunSpec(output_dir=root / name / "finetune"),
                               step=steps.Finetune(task="bible-testament", primary=root / name / "pretrain", cfg=ft,
                                                   eval_file="bible"))
    return {**out, "finetune_final_loss": record["final_loss"], "heldout_accuracy": record["source_score"],
            "finetune_s": time.perf_counter() - t1}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--std", type=float, nargs="+", default=GRID["std"])
    ap.add_argument("--lr", type=float, nargs="+", default=GRID["lr"])
    ap.add_argument("--warmup", type=int, nargs="+", default=GRID["warmup"])
    ap.add_argument("--clip", type=float, nargs="+", default=GRID["clip"], help="gradient_clipping")
    ap.add_argument("--batch", type=int, nargs="+", default=GRID["batch"], help="train_micro_batch_size_per_gpu")
    ap.add_argument("--no_finetune", action="store_true", help="Step 1 and the top layer's spread only")
    ap.add_argument("--bias", nargs="+", default=GRID["bias"], help="output_bias_init")
    ap.add_argument("--seeds", type=int, nargs="+", default=(1234, 1, 2))
    ap.add_argument("--train_iters", type=int, default=60)
    ap.add_argument("--name", default="tiny_preset", help="results file name (benchmarks/results/<name>_...)")
    args = ap.parse_args(argv)
    parallel.init_parallel(1, 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = write_bible_corpus("en", root / "en.txt", books=range(1, 3))
        tokenizer = train_tokenizer(corpus, root / "spm", VOCAB)
        for bias, std, lr, warmup, clip, batch, seed in itertools.product(args.bias, args.std, args.lr, args.warmup,
                                                                          args.clip, args.batch, args.seeds):
            setting = {"bias": bias, "std": std, "lr": lr, "warmup": warmup, "clip": clip, "batch": batch}
            rows.append(one(root, corpus, tokenizer, setting, seed, args.train_iters, not args.no_finetune))
            print(json.dumps(rows[-1]), flush=True)
    cols = [("output_bias_init", "output bias"), ("init_method_std", "init std"), ("lr", "lr"),
            ("lr_warmup_iters", "warm-up"),
            ("gradient_clipping", "clip"), ("batch", "batch"), ("seed", "seed"),
            ("pretrain_loss", "pretrain loss"), ("top_layer_spread", "top-layer spread"),
            ("finetune_final_loss", "fine-tune loss"), ("heldout_accuracy", "held-out acc %")]
    md = f"# tiny preset, {args.train_iters} Step-1 updates, then bible-testament\n\n" + table(rows, cols)
    write_results(args.name, {"rows": rows, "repo": str(REPO)}, md)
    print(md)


if __name__ == "__main__":
    main()
