"""Step 4 of one replace-mode artifact under each primary_calibration (adapt.PrimaryCalibration):
as trained (none), with its bias refitted (bias, the default) and with its rows' scale fitted too
(scale), zero-shot on the target Bible's bible-genre verses through a Step-3 run of the primary
(English bible-genre, 1 epoch at lr 5e-5: real_weights.py's), beside no adaptation.

    python benchmarks/calibration_zero_shot.py --primary <head-fitted run> --run <adapt run> --output_dir <dir>
"""
import argparse
import dataclasses
import json
from pathlib import Path

from common import table, write_results  # (importing common puts mmadapt on the path)
import real_weights as rw
from mmadapt import steps
from mmadapt.adapt import PrimaryCalibration, bias_fit_text
from mmadapt.artifact import artifact_dirs, read_artifact, write_artifact
from mmadapt.config import FinetuneConfig, TrainConfig
from mmadapt.evaluate import evaluate_artifacts
from mmadapt.finetune import is_finished
from mmadapt.heldout import Primary, Scorer, unigram_logprobs
from mmadapt.models.roberta import ROBERTA
from mmadapt.run import RunSpec, read_source
from mmadapt.parallel import init_parallel
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--primary", type=Path, required=True)
ap.add_argument("--run", type=Path, required=True, help="a finished replace-mode adapt run, artifacts as trained")
ap.add_argument("--output_dir", type=Path, required=True)
ap.add_argument("--note", default="")
args = ap.parse_args()
init_parallel(1, 1)
root, head, run = args.output_dir, args.primary, args.run
data = Path(json.loads((run / "run.json").read_text())["data_path"])
src = artifact_dirs([run])[-1]
art, tok, meta = read_artifact(src)
scorer = Scorer(Primary.read(head))
text, logp = bias_fit_text(data, TrainConfig(seq_length=64), read_source(head).family), unigram_logprobs(data, len(art["output_bias"]))
dirs = []
for how in ("none", "bias", "scale"):
    t, m = art, meta
    if how != "none":
        t, rec = PrimaryCalibration(lambda: scorer, text, logp, scale=how == "scale")(art)
        m = {**meta, **rec}
    d = root / f"art-{how}" / "embeddings" / "step00000600"
    write_artifact(d, t, tok, m); dirs.append(d)
ft = root / "finetune"
if not is_finished(ft):
    cfg = dataclasses.replace(FinetuneConfig(), seq_length=rw.SEQ, epochs=1.0, lr=5e-5)
    steps.finetune(run=RunSpec(output_dir=ft, resume=(ft / "checkpoints").is_dir()),
                   step=steps.Finetune(task="bible-genre", primary=head, cfg=cfg, eval_file="bible"))
source = json.loads((ft / "run.json").read_text()).get("source_score")
records = evaluate_artifacts([ft], dirs, "bible", None, None, True)
rows = [{"calibration": how, "system": r["system"], "lang": r["lang"], "accuracy": r["score"],
         "chance": r.get("chance", "")} for how, r in zip(["none", "bias", "scale", ""], records)]
md = ["# Step 4 under each primary_calibration (cpu, 2 cores)", "",
      f"{__doc__.split(chr(10) + chr(10))[0]} Step 3's English accuracy: {source:.2f}. One seed. " + args.note, "",
      table(rows, [("calibration", "primary_calibration"), ("system", "system"), ("lang", "lang"),
                   ("accuracy", "accuracy"), ("chance", "chance")])]
write_results("calibration_zero_shot", {"rows": rows, "source_score": source, "primary": str(head), "run": str(run)},
              "\n".join(md))
print(json.dumps(rows))
