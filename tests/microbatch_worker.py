"""Run by tests/test_llama_parallel.py as a launch script: `mmadapt pretrain` on ranks whose
device memory is faked (1 MiB resident, a peak 2 MiB above it for a micro-batch of 2 blocks: 1
MiB a block; 12 MiB available on rank 0, 8 on the others), so that micro_batch_fill re-splits on
this CPU as it would on a GPU: under the default fill 0.8, rank 0 has room for 8 blocks, the
others for 4 (1 + 4 <= 6.4 < 1 + 8), and the ranks take the smaller.

    torchrun --nproc_per_node 2 tests/microbatch_worker.py PRETRAIN-ARGS...
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import microbatch, train  # noqa: E402
from mmadapt.cli import pretrain_main  # noqa: E402

AVAILABLE = (12 if int(os.environ.get("RANK", "0")) == 0 else 8) << 20
ROOM = microbatch.Memory(allocated=lambda: 1 << 20, peak=lambda: 3 << 20, reset_peak=lambda: None,
                         available=lambda: AVAILABLE)
train.device_memory = lambda device: ROOM

if __name__ == "__main__":
    sys.exit(pretrain_main(sys.argv[1:]))
