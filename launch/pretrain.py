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

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("pretrain_main"))
