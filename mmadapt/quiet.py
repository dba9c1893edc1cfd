"""Quiet by default: the warnings and log lines of the libraries mmadapt sits on that say nothing
about the user's run, filtered in one place. `install` runs when the `mmadapt` package is
imported, before any module of it imports those libraries (most of them warn at import time, so
a filter set later would come too late). `MMADAPT_VERBOSE=1`, or `--verbose` on any command,
shows everything.

What is filtered, and why it is noise:
    megatron-core   "Transformer Engine and Apex are not installed" (four at import): mmadapt uses
                    neither; megatron's torch fallbacks are the layers mmadapt builds on
    DeepSpeed       its log line "Setting accelerator to CPU": a CPU machine's run is meant to run
                    there; where it may not be (a CUDA build that sees no GPU, or NVIDIA devices
                    under a CPU build), the run says so itself (parallel.cpu_fallback)
    torch           with a CUDA build on a machine without a GPU (a cluster's login node), the line
                    "No CUDA runtime is found, using CUDA_HOME=..." that torch.utils.cpp_extension
                    logs when DeepSpeed imports it: it concerns building CUDA extensions, which
                    mmadapt never does; where the run trains is what its own log says (above)
    torch           FutureWarnings that a torch.distributed function is deprecated: DeepSpeed calls
                    them, not the user's code; "nested tensors ... prototype" (attention_impl varlen
                    builds its jagged batches with them, as designed)
    matplotlib      "No artists with labels found to put in legend": a plot panel without a curve
    transformers    the progress bars of writing a model's weight shards (export-hf), through
                    huggingface_hub's switch HF_HUB_DISABLE_PROGRESS_BARS (a value you set stays)
    the C compiler  "/usr/bin/ld: cannot find -laio" and "collect2: error: ld returned 1 exit
                    status": DeepSpeed probes which C++ ops this machine could build (a compiler
                    run each) when a CPU run starts; libaio (ZeRO-Infinity's NVMe offload) is
                    one mmadapt never uses (probe_deepspeed_ops)
Only these exact messages go; every other warning and log line of these libraries still shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

VERBOSE_ENV = "MMADAPT_VERBOSE"
VERBOSE_FLAG = "--verbose"

# (category, regular expression matching the start of the message), as warnings.filterwarnings takes them.
WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (FutureWarning, r"`torch\.distributed\.\w+` (is|will be) deprecated"),
    (FutureWarning, r"`torch\.distributed\.\w+` is a private function"),
    (UserWarning, r"No artists with labels found to put in legend"),
    (UserWarning, r"The PyTorch API of nested tensors is in prototype stage"),
)
# Logger name -> the start of each message of it that is dropped.
LOG_LINES = {"DeepSpeed": ("Setting accelerator to CPU",), "torch.utils.cpp_extension": ("No CUDA runtime is found",)}
# Environment variables read when a library is imported: transformers' progress bars follow
# huggingface_hub's switch. A value the user set stays.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def verbose() -> bool:
    """Whether to show everything: MMADAPT_VERBOSE=1, or --verbose among this process's arguments
    (read here because the libraries warn as they are imported, before a command parses its flags)."""
    return os.environ.get(VERBOSE_ENV) == "1" or VERBOSE_FLAG in sys.argv[1:]


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> bool:
    """Filter the known noise (module docstring) unless verbose(). Returns whether it did."""
    if verbose():
        return False
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, starts in LOG_LINES.items():
        # The same logger objects the libraries log through when imported: a filter set now stays.
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(starts))
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # huggingface_hub and transformers read that switch when they are imported: ones imported
    # before mmadapt (a script or a notebook that imported transformers first) are switched
    # directly, unless the user set the variable otherwise.
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == QUIET_ENV["HF_HUB_DISABLE_PROGRESS_BARS"]:
        for name, switch in (("huggingface_hub.utils", "disable_progress_bars"),
                             ("transformers.utils.logging", "disable_progress_bar")):
            if name in sys.modules:
                getattr(sys.modules[name], switch)()
    return True


@contextlib.contextmanager
def deepspeed_prints():
    """Drop what DeepSpeed print()s (not logs) meanwhile, unless verbose(): its BF16_Optimizer
    prints the memory in use six times while it builds, whatever the log level."""
    if verbose():
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


def probe_deepspeed_ops() -> None:
    """DeepSpeed's probe of the C++ ops this machine could build (a compiler run each, once per
    process: on the CPU, deepspeed.init_distributed reads it for its shared-memory all-reduce),
    run here with file descriptors 1 and 2 on /dev/null unless verbose(). DeepSpeed silences the
    compiler by redirecting sys.stderr's descriptor, which under contextlib.redirect_stderr (a demo
    worker writing to its log) is the log's: the compiler's failures reached the terminal."""
    import deepspeed.ops

    if verbose():
        deepspeed.ops.__compatible_ops__
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1), os.dup2(null.fileno(), 2)
            deepspeed.ops.__compatible_ops__  # computed once, kept in the module (DeepSpeed reads it after)
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])
