"""Step 1: pretrain a source-language MLM.

    deepspeed --num_gpus 2 launch/pretrain.py --recipe minijoint --preset tiny \
        --corpus en.txt --output_dir runs/minijoint
    python launch/pretrain.py ...            # one process, same flags

Every ModelConfig / TrainConfig field is a flag of the same name (see --help); unset flags keep
the preset's value.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.cli import pretrain_main, run_process  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_process(pretrain_main))
