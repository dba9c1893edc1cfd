"""Beyond the paper: Step 2 over each mini-model of a multi-depth MINIJOINT run, scored by the
plug-in MLM metric against Step-2 compute (the cheapest depth that transfers).

    deepspeed --num_gpus 2 launch/sweep.py --source runs/minijoint-246 --lang de \
        --data_path data/de --output_dir runs/sweep-de
    python launch/sweep.py ...               # one process, same flags

Writes <output_dir>/<N>/ (one Step-2 run per depth), sweep.md, sweep.json and sweep.png.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("sweep_main"))
