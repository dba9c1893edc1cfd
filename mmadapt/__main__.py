"""The `mmadapt` command's entry (and `python -m mmadapt`): mmadapt.cli imports torch, DeepSpeed
and megatron-core, seconds in which a Ctrl-C would print their import traceback; it says
"interrupted" in one line there too, as cli.user_errors does after."""

import sys

from mmadapt import faults


def main() -> int:
    try:
        from mmadapt.cli import run_process
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return faults.EXIT_INTERRUPTED
    return run_process()


if __name__ == "__main__":
    sys.exit(main())
