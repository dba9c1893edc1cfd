"""One run of the demo's Step 2 or Step 3, as a demo worker trains it (one torch thread), or
Step 4 over one primary model (a demo worker on 2 cores scores it at --threads 1; the demo's own
process, with --workers 1, at its threads), timed: for comparing two commits on the demo's own
work, run by run.

    python benchmarks/demo_run.py DEMO_DIR adapt bl_base de OUT      # Step 2, --adapt_iters updates
    python benchmarks/demo_run.py DEMO_DIR finetune bl_base 1 OUT    # Step 3, seed 1
    python benchmarks/demo_run.py DEMO_DIR evaluate bl_base - OUT.json   # Step 4, as a demo worker scores it

DEMO_DIR: a finished `mmadapt demo --output_dir DEMO_DIR` (its prepared data, Step-1 models and,
for evaluate, its Steps 2 and 3). OUT is emptied first; evaluate writes the records there as
JSON, to compare two commits' scores. Prints "seconds N" (the run alone, after imports and
set-up). To compare two commits, run this file from each commit's clone over the same DEMO_DIR,
paired A B A B.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("demo_dir", type=Path)
    ap.add_argument("step", choices=("adapt", "finetune", "evaluate"))
    ap.add_argument("system", help="adapt: a system (bl_base, minipost, ...); finetune, evaluate: a primary "
                    "(bl_base, bl_small, minijoint)")
    ap.add_argument("which", help="adapt: the target language; finetune: the seed; evaluate: ignored (-)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--adapt_iters", type=int, default=200, help="Step-2 updates (the demo's: 1000)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a demo worker's on 2 cores: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from mmadapt.demo import Demo, DemoConfig, for_family
    from mmadapt.parallel import init_parallel

    init_parallel(1, 1)
    root = args.demo_dir
    shutil.rmtree(args.out, ignore_errors=True)
    demo = Demo(for_family(DemoConfig(adapt_iters=args.adapt_iters, adapt_save_interval=args.adapt_iters)), root)
    t = time.perf_counter()
    if args.step == "adapt":
        source = root / "minipost" if args.system == "minipost" else root / "pretrain" / args.system
        demo.adapt(args.system, source, args.which, args.out, root / "data" / args.which)
    elif args.step == "finetune":
        demo.finetune(root / "pretrain" / args.system, int(args.which), args.out)
    else:
        data = {lang: root / "data" / lang for lang in demo.cfg.langs}
        records = demo.evaluate_primary(root / "pretrain" / args.system, demo.finetune_dirs(args.system),
                                        demo.step4_runs(args.system), data)
        args.out.write_text(json.dumps(records, indent=1, sort_keys=True))
    print(f"seconds {time.perf_counter() - t:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
