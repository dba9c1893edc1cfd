"""Step 4: swap target-language embeddings into fine-tuned models and evaluate zero-shot.

    python launch/evaluate.py --finetuned runs/finetune/minijoint-xnli-seed{1,2,3,4,5} \
        --embeddings runs/adapt/minijoint-de runs/adapt/minijoint-fr \
        --eval_file data/xnli/xnli.test.tsv --output results/minijoint-xnli.json
    mmadapt report results/*.json --plots results/

Every Step-2 checkpoint of the given adapt runs is scored (a score-versus-compute curve per
language); one process, the model is rebuilt from the checkpoints whatever their parallel layout.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("evaluate_main"))
