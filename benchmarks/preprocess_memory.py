"""Peak memory of `mmadapt preprocess` as the corpus grows: does encoding stream?

    python benchmarks/preprocess_memory.py                      # ~5 minutes on 2 cores; run it alone
    python benchmarks/preprocess_memory.py --against /tmp/old   # and a checkout of another commit

Corpus: documents drawn (seeded) from the English Bible's chapters, each a run of its verses
headed by its own number, a blank line between documents, to --sizes MB. One tokenizer (2,000
pieces, trained once on the English Bible) encodes every corpus (`--tokenizer`: no tokenizer
training, whose memory --tokenizer_sample_lines bounds), with --workers 1 and 3% held out.
Each run is `launch/preprocess.py` of a checkout in its own process under GNU time: its peak
RSS is the largest of the command's processes (the encoding worker, or the main process's merge
of the shards). With --against, the other checkout runs each size right after this one, and
their datasets must be byte-identical.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, table, write_results

from mmadapt.corpora import resolve_corpus
from mmadapt.data import train_tokenizer


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """Documents of the English Bible's verses to `megabytes` MB; -> the sentences written."""
    docs = [d.strip("\n").split("\n") for d in resolve_corpus("bible:en").read_text(encoding="utf-8").split("\n\n")
            if d.strip()]
    rng, size, sentences, n = random.Random(seed), 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes << 20:
            lines = rng.choice(docs)
            start = rng.randrange(len(lines))
            chosen = lines[start:start + rng.randint(1, len(lines))]
            text = f"Doc {n} " + "\n".join(chosen) + "\n\n"
            f.write(text)
            size, sentences, n = size + len(text.encode()), sentences + len(chosen), n + 1
    return sentences


def peak(checkout: Path, corpus: Path, tokenizer: Path, out: Path) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of one preprocess of `corpus` by `checkout`."""
    cmd = ["/usr/bin/time", "-f", "%M %e", sys.executable, str(checkout / "launch" / "preprocess.py"),
           "--corpus", str(corpus), "--output_dir", str(out), "--tokenizer", str(tokenizer), "--workers", "1",
           "--valid_fraction", "0.03"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    kb, seconds = proc.stderr.strip().splitlines()[-1].split()
    return int(kb) / 1024, float(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 300, 600], help="corpus sizes in MB")
    ap.add_argument("--against", type=Path, help="a checkout of another commit, measured beside this one")
    args = ap.parse_args()
    checkouts = {"this": REPO, **({"against": args.against.resolve()} if args.against else {})}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = train_tokenizer(resolve_corpus("bible:en"), tmp / "tok", 2000, threads=1)
        for mb in args.sizes:
            corpus = tmp / f"c{mb}.txt"
            sentences = write_corpus(corpus, mb)
            outs = {}
            for name, checkout in checkouts.items():
                outs[name] = tmp / f"{name}{mb}"
                rss, seconds = peak(checkout, corpus, tokenizer, outs[name])
                rows.append({"checkout": name, "MB": mb, "sentences": sentences, "peak_rss_mb": round(rss),
                             "seconds": seconds})
                print(rows[-1], flush=True)
            if len(outs) == 2:
                for f in ("text.bin", "text.idx", "valid.bin", "valid.idx"):
                    if not filecmp.cmp(outs["this"] / f, outs["against"] / f, shallow=False):
                        raise SystemExit(f"{f} differs between the checkouts at {mb} MB")
            for d in outs.values():
                subprocess.run(["rm", "-rf", str(d)], check=True)
            corpus.unlink()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    against = None
    if args.against:
        against = subprocess.run(["git", "-C", str(args.against), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
    md = (f"# Peak memory of preprocess as the corpus grows ({commit}"
          + (f" against {against}" if against else "") + ")\n\n"
          + "`python benchmarks/preprocess_memory.py" + (" --against <checkout>" if against else "") + "` "
          "(its docstring says what is run). One run each, alone on the machine; the datasets of the two "
          "checkouts byte-identical at every size.\n\n"
          + table(rows, [("checkout", "checkout"), ("MB", "corpus MB"), ("sentences", "sentences"),
                         ("peak_rss_mb", "peak RSS MB"), ("seconds", "seconds")]) + "\n")
    print(md)
    write_results("preprocess_memory", {"commit": commit, "against": against, "rows": rows}, md)


if __name__ == "__main__":
    main()
