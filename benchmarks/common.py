"""Shared by the benchmarks: hardware name, timing, results files.

Results go to benchmarks/results/<name>_<hardware>_<yyyymmdd>.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# MMADAPT_BENCH_RESULTS: somewhere else (gpu_suite.sh's SMOKE run writes there, so that its
# meaningless numbers never replace measured ones).
RESULTS = Path(os.environ.get("MMADAPT_BENCH_RESULTS", REPO / "benchmarks" / "results"))

from mmadapt.config import ModelConfig, TrainConfig  # noqa: E402
from mmadapt.flops import DEVICE_TFLOPS  # noqa: E402
from mmadapt.models import PRESETS
from mmadapt.tokens import IGNORE_INDEX, NUM_SPECIAL  # noqa: E402

# Model shapes the benchmarks run at (dropout is turned off by `setup`).
SHAPES = {
    "cpu": ModelConfig(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=8000,
                       max_position_embeddings=128),
    "roberta-base": PRESETS["roberta-base"][0],
}


def paper_mini_layers(cfg: ModelConfig) -> int:
    """The mini-model's depth N the benchmarks use: the paper's bottom third of the layers (4 of
    12; 8 of Qwen2-0.5B's 24)."""
    return cfg.num_layers // 3


def add_run_args(ap: argparse.ArgumentParser, cpu_micro_batch: int, shapes: dict = SHAPES) -> None:
    """--shape (one of `shapes`), --seq_length, --micro_batch, --repeats, --warmup, --real,
    --dropout; GPU defaults: roberta-base, 512 tokens, 32 sequences."""
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", choices=shapes, default="roberta-base" if gpu else "cpu")
    ap.add_argument("--seq_length", type=int, default=512 if gpu else 128)
    ap.add_argument("--micro_batch", type=int, default=32 if gpu else cpu_micro_batch)
    ap.add_argument("--repeats", type=int, default=10, help="timed updates (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    ap.add_argument("--real", action="store_true", help="real packed blocks of the packaged English Bible, "
                    "padded at their ends as training pads them (default: random ids, no padding)")
    ap.add_argument("--dropout", action="store_true", help="keep the model's dropout (default: off)")


def setup(args, shapes: dict = SHAPES) -> tuple[ModelConfig, TrainConfig]:
    """The model shape (without dropout unless --dropout; eager unless --fusion names another:
    the config's default, 'auto', would compile on a GPU behind the benchmark's back) and a
    schedule at its peak lr, in a gloo/nccl world of one."""
    from mmadapt.parallel import init_parallel

    base = dataclasses.replace(shapes[args.shape], fusion=getattr(args, "fusion", "none"))
    if not getattr(args, "dropout", False):
        base = dataclasses.replace(base, hidden_dropout=0.0, attention_dropout=0.0)
    train = TrainConfig(seq_length=args.seq_length, train_micro_batch_size_per_gpu=args.micro_batch,
                        train_iters=10**6, lr=1e-4, lr_warmup_iters=1)
    init_parallel(1, 1)
    return base, train


def run_ds_config(path, train: TrainConfig, as_given: bool = False) -> dict:
    """The DeepSpeed config a run of one replica trains under (engine.for_replicas: no ZeRO
    partitioning of nothing, DeepSpeed's BF16_Optimizer under bf16), as `mmadapt` applies it;
    `as_given`: the JSON itself, ZeRO and all, as each rank of a data-parallel run applies it
    (and as every benchmark measured one GPU before 2026-11-29)."""
    from mmadapt.engine import for_replicas, load_ds_config

    ds = load_ds_config(path, train)
    return ds if as_given else for_replicas(ds, 1)


def add_zero_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--zero_as_given", action="store_true", help="train under the DeepSpeed JSON as given (its ZeRO "
                    "stage at one replica, as a data-parallel rank runs it) instead of what a one-replica run "
                    "applies (engine.for_replicas)")


def masked_batches(cfg: ModelConfig, micro: int, s: int, p: float, n: int, seed: int = 0):
    """n random micro-batches (ids, labels) of ordinary tokens with a fraction p selected."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, cfg.vocab_size, (micro, s), generator=g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        pick = torch.rand(micro, s, generator=g) < p
        labels[pick] = ids[pick]
        out.append((ids, labels))
    return out


def causal_batches(cfg: ModelConfig, micro: int, s: int, n: int, seed: int = 0):
    """n random micro-batches (ids [micro, s], next pieces [micro, s]) of ordinary tokens, every
    position scored: a decoder's training blocks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(NUM_SPECIAL, cfg.vocab_size, (micro, s + 1), generator=g)
        out.append((ids[:, :s], ids[:, 1:].clone()))
    return out


def real_batches(cfg: ModelConfig, micro: int, s: int, p: float, n: int, seed: int = 0):
    """n micro-batches of the blocks training reads: the packaged English Bible prepared once
    (cached in the temp directory) with a tokenizer of min(V, 8000) pieces, packed into
    FULL-SENTENCES blocks of s tokens, padded at the end, masked with probability p."""
    import tempfile

    from mmadapt.corpora import write_bible_corpus
    from mmadapt.data import MANIFEST, MLMBatches, prepare

    pieces = min(cfg.vocab_size, 8000)
    root = Path(tempfile.gettempdir()) / f"mmadapt-bench-bible-en-{pieces}"
    if not (root / "data" / MANIFEST).is_file():
        prepare(write_bible_corpus("en", root / "en.txt"), root / "data", pieces, quiet=True)
    held = TrainConfig(seq_length=s, seed=seed, mask_prob=p, train_micro_batch_size_per_gpu=micro)
    data = MLMBatches(root / "data", held, cfg.vocab_size)
    return [data.micro_batch(k, 0) for k in range(n)]


def padding_fraction(batches) -> float:
    from mmadapt.tokens import PAD_ID

    return sum(int(ids.eq(PAD_ID).sum()) for ids, _ in batches) / sum(ids.numel() for ids, _ in batches)


def mask_fraction(batches) -> float:
    return sum(int(lab.ge(0).sum()) for _, lab in batches) / sum(lab.numel() for _, lab in batches)


def engine_update(engine, batches, num_heads: int):
    """One training update through mmadapt's loop per call, cycling through `batches`."""
    from mmadapt.train import train_step

    from mmadapt.train import host_batch

    # Host batches as train_mlm's prefetcher hands them over (pinned on a GPU).
    cycle = itertools.cycle([host_batch(ids, labels, torch.cuda.is_available()) for ids, labels in batches])
    return lambda: train_step(engine, [next(cycle)], num_heads)


def hardware() -> str:
    """A short, file-name-safe description of the device the benchmark ran on."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    return f"cpu{len(os.sched_getaffinity(0))}"


def vendor() -> str:
    """The DEVICE_TFLOPS entry whose bf16 peak this GPU's utilisation is reported against (by its
    name, the PCIe and NVL cards apart from the SXM ones; an H100's where none matches)."""
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    chip = next((k for k in ("h200", "h100", "a100") if k in name), "h100")
    form = next((f for f in ("pcie", "nvl") if f in name), None)
    return f"{chip}-{form}" if f"{chip}-{form}" in DEVICE_TFLOPS else chip


def hardware_details() -> dict:
    d = {"hardware": hardware(), "torch": torch.__version__, "python": platform.python_version(),
         "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
    return d


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn, warmup: int = 3, repeats: int = 10) -> tuple[float, list[float]]:
    """Median seconds of `fn()` over `repeats` runs after `warmup` runs."""
    times = interleaved_times({"fn": fn}, warmup, repeats)["fn"]
    return statistics.median(times), times


def interleaved_times(fns: dict, warmup: int = 3, repeats: int = 10) -> dict[str, list[float]]:
    """Seconds of each `fns[name]()` over `repeats` rounds after `warmup` untimed rounds, every
    round calling each function once in turn: a machine whose speed drifts (a shared host, a
    clock that moves) slows every function of a round alike, so ratios taken round by round hold
    where timing one function's runs after another's would not."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def round_ratios(a: list[float], b: list[float]) -> tuple[float, list[float]]:
    """`a`'s times over `b`'s, round by round (interleaved_times: a drift of the machine's speed
    slows both of a round alike) -> (the median ratio, [its least, its most])."""
    each = sorted(x / y for x, y in zip(a, b))
    return statistics.median(each), [each[0], each[-1]]


def write_results(name: str, payload: dict, markdown: str, replace: tuple[Path, Path] | None = None
                  ) -> tuple[Path, Path]:
    """benchmarks/results/<name>_<hardware>_<date>.{json,md}; a file of that name already there (an
    earlier run the same day) is kept, and this run takes the next free suffix (b, c, ...).
    replace: what this run's earlier call returned (a script that writes what has finished as it
    goes): written over, one pair of files per run. A dot in `name` stays in it (a suffix is
    appended, never swapped for the name's tail)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    if replace is None:
        first = f"{name}_{hardware()}_{datetime.date.today():%Y%m%d}"
        stem = next((f"{first}{suffix}" for suffix in ("", *"bcdefghijklmnopqrstuvwxyz")
                     if not any((RESULTS / f"{first}{suffix}{ext}").exists() for ext in (".json", ".md"))), None)
        if stem is None:
            raise SystemExit(f"benchmarks/results holds {first} and 25 suffixes of it: pass another name")
        replace = (RESULTS / f"{stem}.json", RESULTS / f"{stem}.md")
    payload = {"benchmark": name, "date": f"{datetime.date.today():%Y-%m-%d}", **hardware_details(), **payload}
    replace[0].write_text(json.dumps(payload, indent=2) + "\n")
    replace[1].write_text(markdown.rstrip() + "\n")
    return replace


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown table; columns = [(key, header)]; floats get 4 significant digits."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def bits_at(points: list[tuple[float, float]], flops: float) -> float:
    """A curve's value (bits per byte, or a score) at Step-2 compute `flops`, linear between the
    checkpoints (flops, value) around it."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= flops <= x1:
            return y0 + (y1 - y0) * (flops - x0) / (x1 - x0) if x1 > x0 else y1
    raise ValueError(f"{flops} outside the curve")


def demo_hf_base(root: Path, family: str, lang: str):
    """The demo's shipped BL_BASE of `family` as a user holds a Hugging Face model: installed under
    `root`/pretrain/bl_base from the shipped weights, exported to `root`/hf/base (kept when there).
    -> (the Demo of `lang`, the exported directory)."""
    from mmadapt import steps
    from mmadapt.config import PreprocessConfig
    from mmadapt.demo import Demo, DemoConfig, install_source_model, source_models, to_dict
    from mmadapt.hf import export_hf

    demo = Demo(DemoConfig(family=family, langs=(lang,)), root)
    shipped = root / "data" / "en-shipped"
    steps.preprocess("bible:en", output_dir=shipped, vocab_size=None, tokenizer=source_models(family) / "spm.model",
                     cfg=PreprocessConfig(workers=1))
    native = root / "pretrain" / "bl_base"
    if not native.exists():
        model, train = demo.source_settings("bl_base")
        install_source_model("bl_base", native, shipped, to_dict(model), to_dict(train))
    hf_base = root / "hf" / "base"
    if not (hf_base / "config.json").is_file():
        export_hf(hf_base, primary=native)
    return demo, hf_base
