"""Step 2's output-bias refit (TrainConfig.refit_output_bias, adapt.BiasRefit) on finished replace
runs: each run's last artifact through its primary model, with the bias as trained over the
mini-model and refitted through the primary (what a run with the refit writes at that
checkpoint: the same blocks of target training text, the same fit), on the held-out text the
plug-in metric scores, against its unigram reference.

    python benchmarks/bias_refit.py --primary <head-fitted run> --runs <adapt run> ... [--name NAME]

An adapt run trained before the refit existed holds the trained bias in its artifacts; one trained
with it holds the refitted bias, which this reports as both (the refit of a refitted bias is itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from common import table, write_results  # (importing common puts mmadapt on the path)

from mmadapt.adapt import BiasRefit, bias_fit_text
from mmadapt.artifact import artifact_dirs, read_artifact
from mmadapt.config import TrainConfig
from mmadapt.data import TOKENIZER
from mmadapt.heldout import Primary, Scorer, Text, unigram_logprobs
from mmadapt.parallel import init_parallel
from mmadapt.run import read_source
from mmadapt.tokenizer import load as load_tokenizer


def measure(scorer: Scorer, run: Path) -> dict:
    record = json.loads((run / "run.json").read_text())
    data, train = Path(record["data_path"]), TrainConfig(**{k: v for k, v in record["train"].items()
                                                            if k in {f.name for f in dataclasses.fields(TrainConfig)}})
    vocab = load_tokenizer(data / TOKENIZER).get_piece_size()
    art, _, meta = read_artifact(artifact_dirs([run])[-1])
    held = scorer.heldout(Text(data, train.seq_length, train.plugin_eval_blocks or 256), vocab)
    family = read_source(Path(record["frozen_from"]["run_dir"])).family
    refit, info = BiasRefit(lambda: scorer, bias_fit_text(data, train, family), unigram_logprobs(data, vocab))(art)
    own, fitted = scorer.loss(held, art, meta), scorer.loss(held, {**art, "output_bias": refit}, meta)
    return {"run": run.name, "system": meta["system"], "lang": meta["lang"], "update": meta["step"],
            "unigram": held.unigram, "trained": own, "below_trained": held.unigram - own, "refit": fitted,
            "below_refit": held.unigram - fitted, "positions": info["bias_refit"]["positions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--primary", type=Path, required=True, help="the head-fitted primary run the artifacts plug into")
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="finished replace-mode adapt runs")
    ap.add_argument("--name", default="bias_refit")
    ap.add_argument("--note", default="", help="a sentence on where the runs came from, for the results file")
    args = ap.parse_args()
    init_parallel(1, 1)
    scorer = Scorer(Primary.read(args.primary))
    rows = [measure(scorer, run) for run in args.runs]
    md = ["# Step 2's output bias refitted through the primary model (cpu, 2 cores)", "",
          "Each run's last artifact through the primary model, on the held-out verses the plug-in metric scores "
          "(nats per masked piece; `below` = unigram reference - loss, issue 50's bar 0.3): the output bias as "
          "trained over the mini-model, and refitted through the primary (adapt.BiasRefit, what "
          "`--refit_output_bias true` writes). Written by `python benchmarks/bias_refit.py`. " + args.note, "",
          table(rows, [("system", "system"), ("lang", "lang"), ("update", "update"), ("unigram", "unigram"),
                       ("trained", "trained bias"), ("below_trained", "below"), ("refit", "refitted bias"),
                       ("below_refit", "below, refitted"), ("positions", "fit positions")])]
    write_results(args.name, {"rows": rows, "primary": str(args.primary)}, "\n".join(md))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
