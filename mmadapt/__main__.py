"""The `mmadapt` command's entry (and `python -m mmadapt`): faults.entry, whose Ctrl-C while
mmadapt.cli imports torch, DeepSpeed and megatron-core is one line, not their import traceback."""

import sys

from mmadapt import faults


def main() -> int:
    return faults.entry()


if __name__ == "__main__":
    sys.exit(main())
