"""Step 2: learn a target language's embeddings over a frozen model.

    deepspeed --num_gpus 2 launch/adapt.py --system minijoint --source runs/minijoint --preset roberta-base \
        --lang de --output_dir runs/adapt/minijoint-de --ds_config ds_configs/zero2_bf16.json
    python launch/adapt.py ...               # one process, same flags

The embeddings (and output bias) are saved under <output_dir>/embeddings/<tag>/ at every
checkpoint (--save_interval, --extra_save_steps), and as initialised before the first update
(step00000000), for Step 4 to swap into the primary model.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("adapt_main"))
