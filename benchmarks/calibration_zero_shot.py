"""Step 4 of one replace-mode artifact under each primary_calibration (adapt.PrimaryCalibration):
as trained (none), with its bias refitted (bias, the default) and with its rows' scale fitted too
(scale), zero-shot on the target Bible's bible-genre verses through a Step-3 run of the primary
(real_weights.zero_shot's: English bible-genre, 1 epoch at lr 5e-5), beside no adaptation.

    python benchmarks/calibration_zero_shot.py --primary <head-fitted run> --run <adapt run> --output_dir <dir>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import table, write_results  # (importing common puts mmadapt on the path)
import real_weights as rw

from mmadapt.adapt import AdaptEmbeddings, PrimaryCalibration, StartRule, bias_fit_text
from mmadapt.artifact import artifact_dirs, read_artifact, write_artifact
from mmadapt.heldout import Primary, Scorer, piece_counts
from mmadapt.parallel import init_parallel
from mmadapt.run import read_source

CALIBRATIONS = ("none", "bias", "scale")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--primary", type=Path, required=True, help="the head-fitted primary run the artifact plugs into")
    ap.add_argument("--run", type=Path, required=True, help="a finished replace-mode adapt run, artifacts as trained")
    ap.add_argument("--output_dir", type=Path, required=True, help="the calibrated artifacts and the Step-3 run")
    ap.add_argument("--note", default="", help="a sentence on where the run came from, for the results file")
    args = ap.parse_args()
    init_parallel(1, 1)
    record = json.loads((args.run / "run.json").read_text())
    data, train = Path(record["data_path"]), AdaptEmbeddings.recorded(record).train
    src = artifact_dirs([args.run])[-1]
    art, tok, meta = read_artifact(src)
    assert "primary_calibration" not in meta, f"{args.run}'s artifacts are calibrated already"
    scorer = Scorer(Primary.read(args.primary))
    text = bias_fit_text(data, train, read_source(args.primary).family)
    # what the run's start rule fits a bias to (StartRule.target: its record's bias_target)
    logp = StartRule.recorded(record).target(data, piece_counts(data, len(art["output_bias"])), scorer.primary)
    dirs = []
    for how in CALIBRATIONS:
        tensors, extra = art, {}
        if how != "none":
            tensors, extra = PrimaryCalibration(lambda: scorer, text, logp, scale=how == "scale")(art)
        dirs.append(write_artifact(args.output_dir / f"art-{how}" / "embeddings" / src.name, tensors, tok,
                                   {**meta, **extra}))
    scores = rw.zero_shot(args.output_dir, args.primary, [{"artifact": str(d)} for d in dirs])
    rows = [{"calibration": how, "system": r["system"], "lang": r["lang"], "accuracy": r["score"],
             "chance": r.get("chance", "")} for how, r in zip([*CALIBRATIONS, ""], scores["records"])]
    md = ["# Step 4 under each primary_calibration (cpu, 2 cores)", "",
          f"{__doc__.split(chr(10) + chr(10))[0]} Step 3's English accuracy: {scores['source_score']:.2f}. One seed. "
          + args.note, "",
          table(rows, [("calibration", "primary_calibration"), ("system", "system"), ("lang", "lang"),
                       ("accuracy", "accuracy"), ("chance", "chance")])]
    write_results("calibration_zero_shot", {"rows": rows, "source_score": scores["source_score"],
                                            "primary": str(args.primary), "run": str(args.run)}, "\n".join(md))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
