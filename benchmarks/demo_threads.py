"""The demo's Step 2 at a given number of torch intra-op threads: what `mmadapt demo --threads`
chooses between.

    python benchmarks/demo_threads.py prepare --root /tmp/threads      # once: German data, shipped BL_BASE
    python benchmarks/demo_threads.py run --root /tmp/threads --threads 1 --updates 200

`run` is `mmadapt demo`'s own Step 2 (Demo.adapt: the tiny preset's schedule, 32 blocks of 32
tokens per update) for BL_BASE, the costliest system (12 layers), from the shipped source model,
into a fresh output directory, with torch.set_num_threads(--threads); it prints one line with the
seconds per update of the step itself (start-up excluded). Time whole processes from outside
(`/usr/bin/time -v`, or pairs of runs alternated A B A B ... so that a machine's drift cancels in
their ratio) with and without a second process beside them: the results file
(benchmarks/results/demo_threads_cpu2_<date>.md) says how each figure was taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmadapt import parallel  # noqa: E402
from mmadapt.config import to_dict  # noqa: E402
from mmadapt.demo import Demo, DemoConfig, install_source_model  # noqa: E402

SYSTEM, LANG = "bl_base", "de"


def _demo(root: Path, updates: int) -> Demo:
    return Demo(dataclasses.replace(DemoConfig(), langs=(LANG,), adapt_iters=updates, adapt_save_interval=updates),
                root)


def prepare(root: Path) -> None:
    demo = _demo(root, 1)
    data = demo.prepare()
    source = root / "pretrain" / SYSTEM
    if not source.exists():
        install_source_model(SYSTEM, source, data["en"], *map(to_dict, demo.source_settings(SYSTEM)))


def run(root: Path, threads: int, updates: int) -> float:
    """Seconds per update of the demo's Step 2 at `threads` intra-op threads (the step itself:
    engine start-up, the updates and the one checkpoint at the end)."""
    torch.set_num_threads(threads)
    parallel.init_parallel(1, 1)
    out = root / "adapt" / f"t{threads}-{time.time_ns()}"
    t0 = time.perf_counter()
    _demo(root, updates).adapt(SYSTEM, root / "pretrain" / SYSTEM, LANG, out, root / "data" / LANG)
    seconds = (time.perf_counter() - t0) / updates
    shutil.rmtree(out, ignore_errors=True)
    print(f"step2 threads={threads} updates={updates} s_per_update={seconds:.4f}", flush=True)
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("prepare", "run"))
    ap.add_argument("--root", required=True, help="where the prepared data and the source model live")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--updates", type=int, default=200, help="Step-2 updates to time")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.what == "prepare":
        prepare(root)
    else:
        run(root, args.threads, args.updates)


if __name__ == "__main__":
    main()
