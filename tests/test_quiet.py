"""First contact with the commands: `mmadapt --help` lists every command with its purpose and
where to start, an unknown command says which it may have meant, and the libraries' known
warnings stay out of a command's output unless asked for (--verbose, MMADAPT_VERBOSE=1)."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, VOCAB, child_env
from mmadapt.cli import COMMAND_GROUPS, COMMANDS, main, top_help


def _mmadapt(*args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmadapt.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=child_env(PYTHONPATH=str(REPO), **env))


def _warn_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "warn" in line.lower()]


def test_top_level_help_lists_every_command_with_its_purpose(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out == top_help() + "\n"
    listed = {}
    for line in out.splitlines():
        m = re.match(r"  (\S+)\s{2,}(\S.*)", line)
        if m:
            listed[m.group(1)] = m.group(2)
    assert set(listed) == set(COMMANDS)  # every command the dispatcher knows, and nothing else
    for _, group in COMMAND_GROUPS:
        for name, _, purpose in group:
            assert purpose.startswith(listed[name]) and len(purpose) > 30
    assert "mmadapt demo --quick" in out.split("Start here:")[0]  # where to start comes first
    assert [t for t, _ in COMMAND_GROUPS][:3] == ["Start here", "Data (once per corpus)", "Step 1: the source model"]
    # Each command's own help: usage on stdout, exit 0.
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert capsys.readouterr().out.startswith("usage:"), name
    assert main([]) == 2 and capsys.readouterr().err == top_help() + "\n"
    assert main(["pretrian"]) == 2
    assert capsys.readouterr().err == "error: unknown command 'pretrian': did you mean pretrain? mmadapt --help lists " \
                                      "the commands\n"


def test_a_command_is_named_as_it_was_started(capsys, monkeypatch):
    """The parsers launch/*.py shares with `mmadapt <command>` name the command as typed in their
    usage and error lines: `mmadapt pretrain` from the mmadapt command, `launch/pretrain.py` from
    the script, not `pretrain` for both."""
    from mmadapt.cli import pretrain_main, run_process

    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--output_dir", "x", "--bogus"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: mmadapt pretrain: unrecognized arguments: --bogus")
    monkeypatch.setattr(sys, "argv", ["launch/pretrain.py", "--output_dir", "x", "--bogus"])
    with pytest.raises(SystemExit) as e:
        run_process(pretrain_main)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: launch/pretrain.py: unrecognized arguments: --bogus")
    with pytest.raises(SystemExit):  # and in-process callers keep the parser's own name
        pretrain_main(["--output_dir", "x", "--bogus"])
    assert capsys.readouterr().err.startswith("error: pretrain: ")


@pytest.mark.slow  # a fresh process per command
def test_help_prints_help_and_nothing_else():
    quiet = _mmadapt("pretrain", "--help")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("usage: mmadapt pretrain ")
    assert _warn_lines(quiet) == []
    # The filter is what keeps them out: --verbose and MMADAPT_VERBOSE=1 show megatron's four.
    for proc in (_mmadapt("pretrain", "--help", "--verbose"), _mmadapt("pretrain", "--help", MMADAPT_VERBOSE="1")):
        assert proc.returncode == 0
        assert sum("Transformer Engine and Apex are not installed" in l for l in _warn_lines(proc)) == 4, proc.stderr


def test_a_cuda_build_without_a_gpu_keeps_its_cuda_home_line_out_and_other_lines_in():
    """A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found" when
    DeepSpeed imports torch.utils.cpp_extension (every command's first line there, seen with torch
    2.11.0+cu130 on this CPU machine); the filter drops that line alone."""
    import logging

    class Keep(logging.Handler):  # torch's loggers do not propagate to the root (caplog)
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    logger, keep = logging.getLogger("torch.utils.cpp_extension"), Keep()
    logger.addHandler(keep)
    try:
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        logger.warning("Error checking compiler version for %s", "c++")
    finally:
        logger.removeHandler(keep)
    assert keep.lines == ["Error checking compiler version for c++"]


def test_a_run_that_could_have_had_a_gpu_says_it_trains_on_the_cpu(monkeypatch):
    """DeepSpeed's "Setting accelerator to CPU" is filtered; a CUDA build that sees no GPU (a job
    given none) or NVIDIA devices under a CPU build then said nothing anywhere of where the run
    trained. start_run prints parallel.cpu_fallback's line; a CPU machine's CPU build, nothing."""
    import torch

    from mmadapt import parallel
    from mmadapt.parallel import cpu_fallback

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cpu_fallback() == "note: training on the CPU: this torch build has CUDA 12.4 and sees no GPU " \
                             "(CUDA_VISIBLE_DEVICES='')"
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(parallel.os, "listdir", lambda d: ["null", "nvidiactl", "nvidia0"] if d == "/dev" else [])
    assert cpu_fallback() == ("note: training on the CPU: this machine has NVIDIA devices and this "
                              "torch build has no CUDA: install torch's CUDA build")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_fallback() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(parallel.os, "listdir", lambda d: ["null", "nvidiactl", "nvidia-uvm"])  # a driver, no GPU
    assert cpu_fallback() is None


def test_verbose_shows_what_the_models_and_config_checks_filtered(monkeypatch):
    """MMADAPT_VERBOSE=1 shows every warning: layers.py filtered torch's nested-tensor notice at
    import, and transformers_config silenced transformers' config warnings, whatever the switch."""
    code = ("import logging, torch, transformers\n"
            "import mmadapt.models.layers\n"
            "from mmadapt.family import transformers_config\n"
            "torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])\n"
            "print('ok')\n"
            "seen = []\n"
            "class Keep(logging.Handler):\n"
            "    def emit(self, record): seen.append(record.getMessage())\n"
            "logging.getLogger('transformers').addHandler(Keep())\n"
            "transformers_config({'model_type': 'llama', 'rope_scaling': {'rope_type': 'linear', 'factor': 2.0,"
            " 'bogus_key': 1}}, 'm')\n"
            "print('bogus_key' in ' '.join(seen))\n")
    for verbose, shown in (("1", True), ("0", False)):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env=child_env(PYTHONPATH=str(REPO), MMADAPT_VERBOSE=verbose))
        assert out.returncode == 0, out.stderr[-2000:]
        assert ("nested tensors is in prototype stage" in out.stderr) is shown, out.stderr[-2000:]
        assert out.stdout.split() == ["ok", str(shown)], out.stdout


@pytest.mark.slow
def test_a_short_pretraining_prints_no_warning(corpus, tokenizer, tmp_path):
    args = ["pretrain", "--preset", "tiny", "--corpus", str(corpus), "--tokenizer", str(tokenizer), "--vocab_size",
            str(VOCAB), "--train_iters", "2", "--log_interval", "1"]
    quiet = _mmadapt(*args, "--output_dir", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert _warn_lines(quiet) == [], _warn_lines(quiet)
    assert "done: step 2" in quiet.stdout
    loud = _mmadapt(*args, "--output_dir", str(tmp_path / "loud"), "--verbose")
    assert loud.returncode == 0, loud.stderr[-3000:]
    lines = _warn_lines(loud)
    assert any("Setting accelerator to CPU" in l for l in lines) and any("Transformer Engine" in l for l in lines)


@pytest.mark.slow  # a fresh process: what was imported before mmadapt
def test_progress_bars_stay_off_when_transformers_was_imported_first():
    """quiet.py switches transformers' and huggingface_hub's progress bars off through an
    environment variable they read when imported; a process that imported transformers before
    mmadapt (a notebook) gets them switched off directly, and an import-hf's quiet block puts
    back what it found, not bars on."""
    code = ("import transformers.utils.logging as tl, huggingface_hub.utils as hu\n"
            "import mmadapt.hf as h\n"
            "print(tl.is_progress_bar_enabled(), hu.are_progress_bars_disabled())\n"
            "with h._quiet_transformers():\n    pass\n"
            "print(tl.is_progress_bar_enabled(), hu.are_progress_bars_disabled())\n")
    env = child_env(PYTHONPATH=str(REPO))
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # as a fresh shell has it (this process set it)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "False", "True"]


def test_a_process_command_runs_with_its_imports_out_of_the_collectors_sight(corpus, tokenizer, tmp_path):
    """run_process freezes what the imports made (gc.freeze), so DeepSpeed's forced collections at
    start-up scan only the command's own objects; a preprocess inside the command keeps it so."""
    import gc

    from mmadapt.cli import run_process
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import prepare

    seen = []

    def command() -> int:
        seen.append(gc.get_freeze_count())
        prepare(corpus, tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
        seen.append(gc.get_freeze_count())
        return 0

    session_frozen = gc.get_freeze_count() > 0  # conftest's pytest_collection_finish
    gc.unfreeze()
    try:
        assert run_process(command) == 0
    finally:
        gc.unfreeze()
        if session_frozen:
            gc.freeze()
    assert seen[0] > 100_000 and seen[1] > 100_000, seen  # torch's, DeepSpeed's, megatron-core's objects; 0: unfrozen


def test_a_run_started_under_a_redirected_stderr_keeps_deepspeeds_op_probe_off_the_terminal(tmp_path):
    """A demo worker starts its runs with sys.stderr on its log (contextlib.redirect_stderr):
    DeepSpeed's probe of the ops it could build silences the compiler through sys.stderr's
    descriptor (the log's), so "/usr/bin/ld: cannot find -laio" and "collect2: error" reached the
    terminal; and its shared-memory op's "built successfully" print is DeepSpeed's own. Neither
    shows now; --verbose still shows the print."""
    script = ("import contextlib, sys\n"
              "from mmadapt import parallel\n"
              f"with open({str(tmp_path / 'log')!r}, 'w') as log, contextlib.redirect_stderr(log):\n"
              "    parallel.init_parallel(1, 1)\n"
              "print('started')\n")
    for verbose in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=child_env(PYTHONPATH=str(REPO), MMADAPT_VERBOSE=verbose))
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "started", proc.stderr[-2000:]
        if verbose == "0":
            assert proc.stdout + proc.stderr == "started\n", proc.stdout + proc.stderr
    assert "built successfully" in proc.stdout
