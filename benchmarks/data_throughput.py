"""Data preparation at scale: encoding throughput with 1 and 2 workers, tokenizer-training
memory, block packing rate, and training start-up on a 45-million-block index.

    python benchmarks/data_throughput.py          # about 3 minutes on 2 cores; run it alone

Corpus: the packaged Bibles of --langs concatenated (real text, about 4 MB per language). The
tokenizer is trained once (its peak RSS measured in a child process), then `mmadapt.data.prepare`
encodes the corpus with 1 and with 2 workers (best of --repeats each; the datasets must be
byte-identical). Start-up: a child process opens `MLMBatches` on a synthetic prepared dataset
whose block index holds --blocks blocks and draws one micro-batch; its time and RSS growth are
what every rank pays when a job starts.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, table, write_results

from mmadapt.corpora import BIBLE_VERSIONS, bible_verses
from mmadapt.data import pack_blocks, prepare

RSS_PROBE = """
import resource, sys
from mmadapt.data import train_tokenizer
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
train_tokenizer(sys.argv[1], sys.argv[2], int(sys.argv[3]), max_sentences=int(sys.argv[4]))
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

STARTUP_PROBE = """
import os, sys, time
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
from mmadapt.config import PreprocessConfig, TrainConfig
from mmadapt.data import MLMBatches  # imports (torch, numpy) are not start-up cost of a dataset
before = rss_kb()
t = time.perf_counter()
batches = MLMBatches(sys.argv[1], TrainConfig(seq_length=512, train_micro_batch_size_per_gpu=8), 50000, dp_rank=3, dp_world=64)
ids, labels = batches.micro_batch(123_456, 0)
print(time.perf_counter() - t, (rss_kb() - before) / 1024, len(batches))
"""


def synthetic_dataset(root: Path, blocks: int, tokenizer: Path) -> Path:
    """A prepared dataset whose block index has `blocks` entries over a small token file."""
    import numpy as np

    from mmadapt.data import FORMAT, MANIFEST, TEXT, TOKENIZER

    d = root / "synthetic"
    d.mkdir()
    tokens = 1 << 20
    np.full(tokens, 100, dtype=np.uint16).tofile(d / (TEXT + ".bin"))
    (d / (TEXT + ".idx")).write_bytes(b"")  # not read by training: blocks come from blocks_s512.npy
    shutil.copyfile(tokenizer, d / TOKENIZER)
    index = np.lib.format.open_memmap(d / "blocks_s512.npy", mode="w+", dtype=np.int64, shape=(blocks, 2))
    chunk = 1 << 22
    for i in range(0, blocks, chunk):
        n = min(chunk, blocks - i)
        index[i:i + n, 0] = (np.arange(i, i + n) * 509) % (tokens - 512)
        index[i:i + n, 1] = 511
    index.flush()
    del index
    (d / MANIFEST).write_text(json.dumps({"format": FORMAT, "corpus": "synthetic", "vocab_size": 50000,
                                          "dtype": "uint16"}))
    return d


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--langs", nargs="+", default=sorted(BIBLE_VERSIONS))
    ap.add_argument("--vocab_size", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=45_000_000)
    args = ap.parse_args(argv)
    import mmadapt.mcore  # noqa: F401  (import time is not encoding time; megatron-core as mmadapt imports it)
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix="mmadapt_data_bench_"))
    try:
        corpus = tmp / "bibles.txt"
        with open(corpus, "w", encoding="utf-8") as f:
            for lang in args.langs:
                last = None
                for b, c, _v, text in bible_verses(lang):
                    if last is not None and (b, c) != last:
                        f.write("\n")
                    f.write(text + "\n")
                    last = (b, c)
                f.write("\n")
        mb = corpus.stat().st_size / 1e6

        # Tokenizer training: the default sample bound, peak RSS of a fresh process.
        from mmadapt.config import PreprocessConfig

        sample = PreprocessConfig().tokenizer_sample_lines
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(corpus), str(tmp / "spm"), str(args.vocab_size),
                              str(sample)], capture_output=True, text=True, check=True, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        tok_seconds = time.perf_counter() - t
        rss_before, rss_peak = (int(x) / 1024 for x in out.stdout.split()[-2:])
        tok = tmp / "spm.model"

        # Encoding with 1 and 2 workers: best of --repeats, byte-identical results.
        rows, best = [], {}
        for workers in (1, 2):
            times = []
            for r in range(args.repeats):
                d = tmp / f"w{workers}_{r}"
                t = time.perf_counter()
                prepare(corpus, d, args.vocab_size, tokenizer=tok, quiet=True, cfg=PreprocessConfig(workers=workers))
                times.append(time.perf_counter() - t)
            best[workers] = min(times)
            median = statistics.median(times)
            rows.append({"workers": workers, "seconds": best[workers], "mb_per_s": mb / best[workers],
                         "median_seconds": median, "median_mb_per_s": mb / median, "times_s": times})
        identical = all(filecmp.cmp(tmp / "w1_0" / f, tmp / "w2_0" / f, shallow=False) for f in ("text.bin", "text.idx"))
        speedup = best[1] / best[2]
        median_speedup = rows[0]["median_seconds"] / rows[1]["median_seconds"]
        manifest = json.loads((tmp / "w1_0" / "manifest.json").read_text())

        # Block packing (once per dataset and seq_length, then cached): sentences per second.
        lengths = np.random.default_rng(0).integers(5, 60, 2_000_000)
        t = time.perf_counter()
        packed = pack_blocks(lengths, 512)
        pack_seconds = time.perf_counter() - t

        # Start-up on a synthetic 45M-block index, in a fresh process.
        synth = synthetic_dataset(tmp, args.blocks, tok)
        out = subprocess.run([sys.executable, "-c", STARTUP_PROBE, str(synth)], capture_output=True, text=True,
                             check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        startup_s, startup_mb, n_blocks = out.stdout.split()[-3:]
        startup_s, startup_mb = float(startup_s), float(startup_mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    payload = {"corpus_mb": mb, "langs": args.langs, "sentences": manifest["sentences"], "tokens": manifest["tokens"],
               "vocab_size": args.vocab_size, "encoding": rows, "speedup_2_workers": speedup,
               "median_speedup_2_workers": median_speedup,
               "byte_identical": identical, "tokenizer_sample_lines": sample, "tokenizer_seconds": tok_seconds,
               "tokenizer_peak_rss_mb": rss_peak, "tokenizer_rss_before_mb": rss_before,
               "pack_sentences": len(lengths), "pack_blocks": len(packed), "pack_seconds": pack_seconds,
               "pack_sentences_per_s": len(lengths) / pack_seconds, "startup_blocks": int(n_blocks),
               "startup_seconds": startup_s, "startup_rss_growth_mb": startup_mb}
    md = [f"# Data preparation throughput ({mb:.1f} MB of Bible text: {', '.join(args.langs)})", "",
          table(rows, [("workers", "workers"), ("seconds", "seconds (best)"), ("mb_per_s", "MB/s (best)"),
                       ("median_seconds", "seconds (median)"), ("median_mb_per_s", "MB/s (median)")]), "",
          f"- 2 workers / 1 worker: **{median_speedup:.2f}x** (medians of {args.repeats} runs; best runs "
          f"{speedup:.2f}x); datasets byte-identical: {identical}",
          f"- tokenizer ({args.vocab_size} pieces, sample bound {sample:,} lines): {tok_seconds:.1f} s, peak RSS "
          f"{rss_peak:.0f} MB (process before training: {rss_before:.0f} MB)",
          f"- block packing: {len(lengths):,} sentences -> {len(packed):,} blocks of 512 in {pack_seconds:.2f} s "
          f"({len(lengths) / pack_seconds / 1e6:.2f} M sentences/s), once per dataset and seq_length",
          f"- training start-up on a {int(n_blocks):,}-block index: {startup_s:.3f} s, RSS growth "
          f"{startup_mb:.1f} MB per rank"]
    for p in write_results("data_throughput", payload, "\n".join(md)):
        print(p)
    print("\n".join(md))


if __name__ == "__main__":
    main()
