"""Prepare a corpus once (tokenizer + parallel encoding into an indexed dataset); the training
commands then take --data_path. A CPU job: no GPU, no torch.distributed.

    python launch/preprocess.py --corpus cc100/en.txt --output_dir data/en --vocab_size 50000 --workers 32
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmadapt.faults import entry  # noqa: E402  (a Ctrl-C while mmadapt.cli imports: one line)

if __name__ == "__main__":
    sys.exit(entry("preprocess_main"))
