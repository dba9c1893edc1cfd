"""Step 3: fine-tune a pretrain run's primary model on a source-language task, embeddings frozen.

    deepspeed --num_gpus 8 launch/finetune.py --task xnli --primary runs/minijoint \
        --train_micro_batch_size_per_gpu 4 --ds_config ds_configs/zero1_bf16.json \
        --train_file data/multinli/train.tsv --output_dir runs/finetune/minijoint-xnli-seed1 --seed 1
    python launch/finetune.py --task bible-genre --primary runs/minijoint --output_dir runs/ft   # one process

The learning rate defaults to the paper's for the task (1e-5 XNLI/PAWS-X, 3e-5 MLQA/XQuAD), with
6% warm-up, linear decay and 3 epochs; run several --seed values and pass them all to
launch/evaluate.py, which averages them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("finetune_main"))
