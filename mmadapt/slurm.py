"""From SLURM's environment to DeepSpeed's multi-node launch.

mmadapt does not launch processes itself. On a SLURM cluster `srun` starts one task per node
(see launch/slurm/*.sbatch), and on each node `mmadapt slurm-env -- <script> <args>` reads the
job's environment, writes a DeepSpeed hostfile and replaces itself with DeepSpeed's launcher
(`python -m deepspeed.launcher.runner`, the `deepspeed` command, in the Python that runs this)

    deepspeed --hostfile H --no_ssh --node_rank R --num_nodes N --num_gpus G \
              --master_addr A --master_port P <script> <args>

DeepSpeed's launcher then starts one rank per GPU on that node and torch.distributed
rendezvouses at A:P. `--no_ssh` is what lets DeepSpeed's own launcher run under srun: no
pdsh/ssh between nodes is needed (many clusters forbid it), and srun keeps its process
tracking, accounting and clean-up of every rank.

Variables read (SLURM sets them in every srun task):
    SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST (or SLURM_NODELIST)  compressed host list, e.g.
                                            gpu[01-03,07]: the step's nodes (an srun -N2 inside a
                                            4-node allocation runs on two of them)
    SLURM_STEP_NUM_NODES, else SLURM_NNODES (or SLURM_JOB_NUM_NODES)  number of nodes (checked
                                            against the list)
    SLURM_NODEID                            this node's index in the step's list
    SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ("8" or "a100:8"): ranks per node
    SLURM_GPUS                              where set without SLURM_GPUS_PER_NODE (--gpus=N): the job's
                                            GPUs in all, which must be this node's times the nodes
    SLURM_JOB_ID                            picks the rendezvous port
    MMADAPT_MASTER_ADDR, MMADAPT_MASTER_PORT  optional: another rendezvous host and port (tests run
                                            two "nodes" on one machine). The plain MASTER_ADDR and
                                            MASTER_PORT are not read: sbatch copies the submitting
                                            shell's environment into the job, and a MASTER_ADDR=localhost
                                            left there would send every node to its own loopback
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path

from mmadapt.config import Parser, check_output_file
from mmadapt.faults import EXIT_USER

# Rendezvous ports 20000-31999, one per job id: below Linux's ephemeral range (32768-60999), where
# an outgoing connection on the first node could hold the port and fail the store's bind at random.
PORT_BASE, PORT_SPAN = 20_000, 12_000


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {s!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in node list {s!r}")
    parts.append(cur)
    return [p for p in parts if p]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"cannot read range {item!r} in node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards in node list {nodelist!r}")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names, in SLURM's order.
    'gpu[01-03,07]' -> gpu01 gpu02 gpu03 gpu07; 'a1,b[2-3]' -> a1 b2 b3; 'r[1-2]-n[1-2]' -> r1-n1
    r1-n2 r2-n1 r2-n2."""
    hosts = []
    for part in _split_top(nodelist.strip()):
        m = re.search(r"\[([^\]]*)\]", part)
        if m is None:
            hosts.append(part)
            continue
        head, tail = part[:m.start()], part[m.end():]
        for value in _expand_ranges(m.group(1), nodelist):
            hosts += expand_nodelist(head + value + tail)
    return hosts


def _gpu_count(env: dict, key: str) -> int:
    """A GPU count as SLURM writes one: 8, a100:8, gpu:h100:2(IDX:0-1), 1g.10gb:7 (the first of a list)."""
    value = env[key]
    m = re.fullmatch(r"(?:[\w.-]+:)*(\d+)(?:\(.*\))?", value.split(",")[0])
    if not m:
        raise ValueError(f"cannot read {key}={value!r}: expected a count like 8 or a100:8")
    return int(m.group(1))


def _gpus_per_node(env: dict, nodes: int) -> int:
    """This node's GPUs, the ranks every node runs (the hostfile gives each host as many): a job
    given its GPUs in all (--gpus=12 over 2 nodes: 8 and 4, say) that this node's count times the
    nodes does not make is refused, where each node would have laid out another world."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(key):
            gpus = _at_least_one(_gpu_count(env, key), key)
            if env.get("SLURM_GPUS") and not env.get("SLURM_GPUS_PER_NODE"):
                if (total := _gpu_count(env, "SLURM_GPUS")) != gpus * nodes:
                    raise ValueError(f"SLURM gave the job {total} GPUs over {nodes} nodes, {gpus} on this one: every "
                                     "node runs as many ranks; request them per node (#SBATCH --gpus-per-node=N), "
                                     "or pass --gpus_per_node")
            return gpus
    raise ValueError("SLURM_GPUS_ON_NODE is not set: request GPUs with #SBATCH --gpus-per-node=N, or pass --gpus_per_node")


def _at_least_one(gpus: int, where: str) -> int:
    # DeepSpeed's launcher starts --num_gpus ranks per node: with 0 it starts none and exits 0, a
    # job that "succeeds" having trained nothing
    if gpus < 1:
        raise ValueError(f"{where} is {gpus}: a node runs one rank per GPU, so at least 1 (request GPUs with "
                         "#SBATCH --gpus-per-node=N)")
    return gpus


def _whole(env: dict, key: str) -> int:
    """A SLURM (or MMADAPT_) variable that holds a whole number, read or refused in one line."""
    value = env[key]
    if not re.fullmatch(r"\d+", value.strip()):
        raise ValueError(f"cannot read {key}={value!r}: expected a whole number")
    return int(value)


@dataclasses.dataclass
class SlurmJob:
    hosts: list[str]
    node_rank: int
    gpus_per_node: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: dict | None = None, gpus_per_node: int | None = None) -> "SlurmJob":
        env = dict(os.environ if env is None else env)
        # the step's nodes where srun says (SLURM_NODEID counts within the step), else the job's
        step = bool(env.get("SLURM_STEP_NODELIST"))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError("SLURM_JOB_NODELIST is not set: run this inside a SLURM job step (srun)")
        hosts = expand_nodelist(nodelist)
        counts = ("SLURM_STEP_NUM_NODES",) if step else ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        count = next((k for k in counts if env.get(k)), None)
        if count is not None and _whole(env, count) != len(hosts):
            raise ValueError(f"{count}={env[count]} but the node list {nodelist!r} names {len(hosts)} hosts")
        if "SLURM_NODEID" not in env:
            raise ValueError("SLURM_NODEID is not set: start this with srun, one task per node")
        tasks = env.get("SLURM_STEP_NUM_TASKS", "").strip() if step else ""
        if tasks.isdigit() and int(tasks) != len(hosts):
            # each task would start its node's every rank: ranks twice over, one rendezvous
            raise ValueError(f"this step runs {tasks} tasks on {len(hosts)} node{'s' if len(hosts) > 1 else ''} "
                             "(SLURM_STEP_NUM_TASKS), and each would start every rank of its node: run it with "
                             "srun --ntasks-per-node=1 (as launch/slurm/*.sbatch do)")
        node_rank = _whole(env, "SLURM_NODEID")
        if not 0 <= node_rank < len(hosts):
            raise ValueError(f"SLURM_NODEID={node_rank} is outside 0..{len(hosts) - 1}")
        job_nodes = len(expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or nodelist))
        gpus = (_at_least_one(gpus_per_node, "--gpus_per_node") if gpus_per_node is not None
                else _gpus_per_node(env, job_nodes))
        # unset and empty alike (a template's `export MMADAPT_MASTER_PORT=$PORT` with no PORT), as
        # for MMADAPT_MASTER_ADDR
        if env.get("MMADAPT_MASTER_PORT", "").strip():
            port = _whole(env, "MMADAPT_MASTER_PORT")
            if not 1 <= port <= 65535:
                raise ValueError(f"MMADAPT_MASTER_PORT={port} is not a TCP port: choose one in 1..65535")
        elif "SLURM_JOB_ID" in env:
            port = PORT_BASE + _whole(env, "SLURM_JOB_ID") % PORT_SPAN
        else:
            raise ValueError("neither SLURM_JOB_ID nor MMADAPT_MASTER_PORT is set: cannot choose a rendezvous port")
        return cls(hosts, node_rank, gpus, env.get("MMADAPT_MASTER_ADDR") or hosts[0], port)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.gpus_per_node

    def hostfile(self) -> str:
        return "".join(f"{h} slots={self.gpus_per_node}\n" for h in self.hosts)

    def command(self, hostfile: str | os.PathLike, script_and_args: list[str],
                launcher_args: tuple[str, ...] = ()) -> list[str]:
        """DeepSpeed's launcher in this Python's environment (`python -m deepspeed.launcher.runner`,
        what the `deepspeed` script runs): it starts the ranks with its own interpreter, so a
        `deepspeed` found first on PATH would train in whichever environment that is."""
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(self.node_rank), "--num_nodes", str(len(self.hosts)),
                "--num_gpus", str(self.gpus_per_node), "--master_addr", self.master_addr,
                "--master_port", str(self.master_port), *launcher_args, *script_and_args]


def devices_warning(env: dict, gpus_per_node: int) -> str | None:
    """A warning where SLURM gave this node's task GPUs other than 0..G-1 (CUDA_VISIBLE_DEVICES
    of a cluster that does not confine a job to its devices): DeepSpeed's launcher, given a
    hostfile, sets CUDA_VISIBLE_DEVICES=0..G-1 for its ranks whatever SLURM said, so they would
    run on the node's first G GPUs, which may be another job's. None where they agree."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = None if visible is None else visible.split(",")
    # UUIDs or MIG names say nothing of which indices they are
    if ids is None or not all(i.strip().isdigit() for i in ids):
        return None
    if set(range(gpus_per_node)) <= {int(i) for i in ids}:  # (more given than used: the first G of them)
        return None
    return (f"warning: SLURM gave this task CUDA_VISIBLE_DEVICES={visible}, but DeepSpeed's launcher runs its "
            f"{gpus_per_node} ranks on devices 0-{gpus_per_node - 1} of the node: ask for whole nodes (--exclusive) "
            "or a cluster that confines jobs to their GPUs (cgroup ConstrainDevices)")


def write_hostfile(job: SlurmJob, path: Path) -> Path:
    """The hostfile at `path`, written whole (a temporary beside it, renamed). A path that cannot
    hold it (a directory; a file on its way) is refused naming --hostfile, nothing left behind:
    it failed in the rename, as '.<name>.tmp<pid>: Is a directory' (a traceback under `python -m
    mmadapt.slurm`, the templates' entry), the temporary left."""
    check_output_file(path, "--hostfile")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(job.hostfile())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def main(argv=None) -> int:
    """`mmadapt slurm-env`; a ValueError is a user's mistake (cli.user_errors reports it)."""
    p = Parser(prog="mmadapt slurm-env", description="Turn SLURM's environment into "
                                "DeepSpeed's multi-node launch for this node, and run it.")
    p.add_argument("--dry-run", action="store_true", help="print the hostfile and the command, run nothing")
    p.add_argument("--hostfile", help="where to write the hostfile (default: $TMPDIR or /tmp, per job and node)")
    p.add_argument("--gpus_per_node", type=int, help="ranks per node (default: from SLURM_GPUS_ON_NODE)")
    p.add_argument("--launcher_args", default="", help="more flags for DeepSpeed's launcher, in one string given "
                   "with '=' (argparse takes a lone flag for one of its own otherwise): "
                   "--launcher_args=\"--enable_each_rank_log /scratch/logs\"")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- then the training script and its arguments")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("no script given: mmadapt slurm-env [--dry-run] -- launch/pretrain.py ARGS")
    job = SlurmJob.from_env(gpus_per_node=args.gpus_per_node)
    hostfile = Path(args.hostfile or Path(os.environ.get("TMPDIR", "/tmp")) /
                    f"mmadapt-hostfile-{os.environ.get('SLURM_JOB_ID', 'job')}-{job.node_rank}")
    try:
        launcher_args = tuple(shlex.split(args.launcher_args))
    except ValueError as e:  # an unclosed quote: shlex's own words named no flag
        raise ValueError(f"--launcher_args {args.launcher_args!r}: {e}: quote its values as a shell would") from None
    check_output_file(hostfile, "--hostfile")  # --dry-run refuses what the launch would
    cmd = job.command(hostfile, script, launcher_args)
    warning = devices_warning(dict(os.environ), job.gpus_per_node)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.dry_run:
        print(f"# hostfile {hostfile}\n{job.hostfile()}# node {job.node_rank} of {len(job.hosts)}, "
              f"world size {job.world_size}\n{shlex.join(cmd)}")
        return 0
    write_hostfile(job, hostfile)
    print(f"[mmadapt slurm-env] node {job.node_rank}/{len(job.hosts)}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    # The SLURM templates run this on every node before DeepSpeed's launcher: `python -m
    # mmadapt.slurm` imports only the standard library and config, where `-m mmadapt.cli` would
    # import torch, DeepSpeed and megatron-core first (seconds per node, for a few string
    # operations). Its failures look like the CLI's (cli.user_errors): one `error:` line, exit 2.
    try:
        sys.exit(main())
    except ValueError as e:
        if os.environ.get("MMADAPT_DEBUG") == "1":  # as cli.user_errors: the traceback of every failure
            import traceback

            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER)
