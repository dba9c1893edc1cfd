"""Step 2's calibration to the primary model (TrainConfig.primary_calibration, adapt.PrimaryCalibration)
on finished replace runs: each run's last artifact through its primary model, as trained over the
mini-model, with its bias refitted through the primary ("bias") and with the rows' scale fitted
too ("scale"), as a run with that setting writes it at that checkpoint (the same blocks of target
training text, the same fit), on the held-out text the plug-in metric scores, against its unigram
reference.

    python benchmarks/bias_refit.py --primary <head-fitted run> --runs <adapt run> ... [--name NAME]

The runs must hold their artifacts as trained (`--primary_calibration none`, or trained before it
existed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import table, write_results  # (importing common puts mmadapt on the path)

from mmadapt.adapt import AdaptEmbeddings, PrimaryCalibration, StartRule, bias_fit_text
from mmadapt.artifact import artifact_dirs, read_artifact
from mmadapt.data import TOKENIZER
from mmadapt.heldout import Primary, Scorer, Text, piece_counts
from mmadapt.parallel import init_parallel
from mmadapt.run import read_source
from mmadapt.tokenizer import load as load_tokenizer


def measure(scorer: Scorer, run: Path) -> dict:
    record = json.loads((run / "run.json").read_text())
    data, train = Path(record["data_path"]), AdaptEmbeddings.recorded(record).train
    vocab = load_tokenizer(data / TOKENIZER).get_piece_size()
    art, _, meta = read_artifact(artifact_dirs([run])[-1])
    held = scorer.heldout(Text(data, train.seq_length, train.plugin_eval_blocks or 256), vocab)
    family = read_source(Path(record["frozen_from"]["run_dir"])).family
    assert "primary_calibration" not in meta, f"{run}'s artifacts are calibrated already"
    # what the run's start rule fits a bias to (StartRule.target: its record's bias_target)
    text, logp = bias_fit_text(data, train, family), StartRule.recorded(record).target(
        data, piece_counts(data, vocab), scorer.primary)
    row = {"run": run.name, "system": meta["system"], "lang": meta["lang"], "update": meta["step"],
           "unigram": held.unigram, "trained": scorer.loss(held, art, meta)}
    for how in ("bias", "scale"):
        out, info = PrimaryCalibration(lambda: scorer, text, logp, scale=how == "scale")(art)
        row[how] = scorer.loss(held, out, meta)
        row.update(positions=info["primary_calibration"]["positions"],
                   **({"factor": info["primary_calibration"]["scale"]} if how == "scale" else {}))
    for k in ("trained", "bias", "scale"):
        row[f"below_{k}"] = held.unigram - row[k]
    return row


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
          "(nats per masked piece; `below` = unigram reference - loss, issue 50's bar 0.3): as trained over the "
          "mini-model (`--primary_calibration none`), with the output bias refitted through the primary (`bias`, "
          "the default) and with the rows' scale fitted there too (`scale`: the factor found), as "
          "adapt.PrimaryCalibration writes them. Written by `python benchmarks/bias_refit.py`. " + args.note, "",
          table(rows, [("system", "system"), ("lang", "lang"), ("update", "update"), ("unigram", "unigram"),
                       ("trained", "none"), ("below_trained", "below"), ("bias", "bias"), ("below_bias", "below"),
                       ("scale", "scale"), ("below_scale", "below"), ("factor", "factor"),
                       ("positions", "fit positions")])]
    write_results(args.name, {"rows": rows, "primary": str(args.primary)}, "\n".join(md))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
