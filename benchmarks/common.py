"""Shared by the benchmarks: hardware name, timing, results files.

Results go to benchmarks/results/<name>_<hardware>_<yyyymmdd>.{json,md}.
"""

from __future__ import annotations

import datetime
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
RESULTS = REPO / "benchmarks" / "results"


def hardware() -> str:
    """A short, file-name-safe description of the device the benchmark ran on."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    return f"cpu{len(os.sched_getaffinity(0))}"


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
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{name}_{hardware()}_{datetime.date.today():%Y%m%d}"
    payload = {"benchmark": name, "date": f"{datetime.date.today():%Y-%m-%d}", **hardware_details(), **payload}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown.rstrip() + "\n")
    return stem.with_suffix(".json"), stem.with_suffix(".md")


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown table; columns = [(key, header)]; floats get 4 significant digits."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])
