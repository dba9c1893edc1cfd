"""Step 1b (MINIPOST): build an (N + K)-layer mini-model aligned with a pretrained primary model.

    deepspeed --num_gpus 2 launch/build_minipost.py --primary runs/bl_base --preset roberta-base \
        --output_dir runs/minipost --ds_config ds_configs/zero2_bf16.json
    python launch/build_minipost.py ...      # one process, same flags

Copies the bottom N layers (--mini_layers, 4), the embeddings and the MLM head of the primary
model, inserts K (--new_layers, 2) new layers under the head and trains only those with the
primary's own source corpus and tokenizer. TrainConfig flags set the schedule, over --preset's
(default: the family's small one, whatever the primary's size).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("minipost_main"))
