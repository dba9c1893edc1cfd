"""Run by tests/test_llama_parallel.py as a launch script: `mmadapt pretrain` on ranks whose
device memory is faked to leave room (a peak of 2 MiB above 1 MiB resident per micro-batch, 16
GiB available), so that micro_batch_fill re-splits on this CPU as it would on a GPU.

    torchrun --nproc_per_node 2 tests/microbatch_worker.py PRETRAIN-ARGS...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import microbatch, train  # noqa: E402
from mmadapt.cli import pretrain_main  # noqa: E402

ROOM = microbatch.Memory(allocated=lambda: 1 << 20, peak=lambda: 3 << 20, reset_peak=lambda: None,
                         available=lambda: 16 << 30)
train.device_memory = lambda device: ROOM

if __name__ == "__main__":
    sys.exit(pretrain_main(sys.argv[1:]))
