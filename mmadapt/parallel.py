"""Process groups, the model-parallel RNG tracker, and helpers that see across ranks.

Rank layout (megatron-core's default order, and DeepSpeed's PipeModelDataParallelTopology
with axes pipe, data, model): tensor-parallel rank varies fastest, then data, then pipeline:
    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)
Groups are created once, by `init_parallel`, in megatron-core's `parallel_state`; everything
else asks `parallel_state` (or the `DeepSpeedMPU` view of it) and never builds its own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from mmadapt import quiet
from mmadapt.config import dist_timeout_s
from mmadapt.faults import PeerFailed, clear_stale_extension_lock
from mmadapt.mcore import parallel_state

# How long a collective (and the rendezvous) may wait before the job fails. Set explicitly, not
# left to the backend's default: no mmadapt step waits on data preparation in a collective
# (rank0_prepares: the other ranks poll the job's store), so the default only
# has to cover a checkpoint write and the slowest update. Override it for slow shared file systems.
try:  # a bad value: refused in one line by every command's parser (config.Parser), and at init_distributed
    DIST_TIMEOUT_S = dist_timeout_s()
except ValueError:
    DIST_TIMEOUT_S = None


def from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Global rank 0's tensor `t` (on the host) on every rank of a launched job, on the host (as
    it is without one): a value every rank computes, made the same everywhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    out = t.to(device())
    dist.broadcast(out, src=0)
    return out.cpu()


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def has_nvidia_devices() -> bool:
    """Whether this machine shows an NVIDIA GPU (/dev/nvidia0, ...), whatever torch's build."""
    return any(n.startswith("nvidia") and n[6:].isdigit()
               for n in (os.listdir("/dev") if os.path.isdir("/dev") else ()))


def cpu_fallback() -> str | None:
    """Why a process that could have had a GPU trains on the CPU (device()), or None: its torch
    build has CUDA and sees no device (a job given no GPUs, CUDA_VISIBLE_DEVICES empty), or the
    machine has NVIDIA devices and its torch build has no CUDA (a CPU wheel on a GPU node).
    DeepSpeed's own notice of it is filtered (quiet.py), since a CPU machine's run is meant to
    run there: this is the line that says it where it may not be."""
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is not None:
        why = (f"this torch build has CUDA {torch.version.cuda} and sees no GPU"
               + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    elif has_nvidia_devices():
        why = "this machine has NVIDIA devices and this torch build has no CUDA: install torch's CUDA build"
    else:
        return None
    return f"note: training on the CPU: {why}"


def named_device(name: str | torch.device) -> torch.device:
    """A device the user named (--device), refused in one line if it is not one or this machine
    does not have it: torch would fail only when the model is moved there."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name!r} is not a device: use cpu or cuda[:i]") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: this machine has no CUDA device that torch can use: use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                             f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})")
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: mmadapt runs on cpu or cuda[:i]")
    return dev


def init_distributed() -> None:
    """Join the job that the launcher (deepspeed, torchrun; under srun, through mmadapt
    slurm-env) describes in the environment; a plain `python` run becomes a world of one, with
    no rendezvous (and no port) at all."""
    if dist.is_initialized():
        return
    if DIST_TIMEOUT_S is None:  # (a run from Python, no command's parser before it)
        dist_timeout_s()  # raises its one line
    world = launched_world_size()  # refuses srun's tasks without a launcher
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", str(world))
    # megatron-core's tensor-parallel layers warn about this on every layer when it is unset
    # (they exist only once the groups do); on a GPU it is the right value.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import deepspeed  # imported here so that model code never needs it

    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    else:  # DeepSpeed JIT-builds its CPU shared-memory all-reduce here, under torch's file lock
        clear_stale_extension_lock()
        quiet.probe_deepspeed_ops()
    from datetime import timedelta

    backend, timeout = "nccl" if torch.cuda.is_available() else "gloo", timedelta(seconds=DIST_TIMEOUT_S)
    if world == 1:
        # A world of one meets no one: an in-process store instead of a TCP rendezvous. A port
        # picked free and bound later by torch's store could be taken in between by another run
        # starting alike (two demo workers, two `python launch/...` runs): EADDRINUSE at start.
        # DeepSpeed adopts the group torch already has.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    with quiet.deepspeed_prints():  # on the CPU, "DeepSpeed ...shm_comm_op built successfully"
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    _unlink_shm_allreduce_buffer()
    global _CONTROL
    # Host-side agreements (a stop signal, checked every update) go over gloo on CPU tensors:
    # no device synchronisation, and no NCCL kernel queued behind the step's work.
    _CONTROL = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD


_CONTROL = None


def shutdown(agreed: bool = True) -> None:
    """Destroy the process groups before the interpreter exits (torchtitan does the same at the
    end of its trainer). Without it, gloo's worker threads can outlive Python's finalisation and
    abort a rank that finished its work: "terminate called without an active exception", exit
    -6 (it happened to a two-rank TP run in CI). `agreed` says every rank reached the same exit
    together (success, a stop, a divergence); after an error only this rank saw, NCCL's teardown
    may wait for peers that never come, so it is left to the process exit there, while gloo's is
    local and lets peers that wait on this rank fail at once."""
    global _CONTROL
    if not dist.is_initialized() or not (agreed or dist.get_backend() == "gloo"):
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    _CONTROL = None


def _joined_with_others() -> bool:
    """Whether this process is one rank of a job of several, joining the job the launcher
    describes if a step's checks come before start_run joined it (each rank would otherwise go
    on alone: a broadcast handing each its own value, a wait for a rank 0 it never meets)."""
    if not dist.is_initialized():
        if launched_world_size() == 1:
            return False
        init_distributed()
    return dist.get_world_size() > 1


def object_from_rank0(value):
    """Global rank 0's `value` (a picklable host object) on every rank (collective over the whole
    world, over gloo on the host; from_rank0 for a tensor): one decision for all, where each rank's
    own view could differ (a file system's cached listing on another node). Called before a step
    joined its job (a step's checks run before start_run), it joins it: each rank would otherwise
    keep its own value (on the others, the None they pass)."""
    if not _joined_with_others():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def rank0_decides(decide):
    """decide() run on global rank 0 alone, its value taken by every rank (object_from_rank0);
    whatever it raises is raised on every rank (as rank0_prepares sends it: _pickled), none left
    waiting for rank 0 in the collective. Before, only a ValueError or OSError was sent: with any
    other (torch.load's UnpicklingError on a damaged file) rank 0 left and the others waited until
    the collective timeout, to fail naming nothing."""
    if not _joined_with_others():
        return decide()
    outcome, raised = None, None
    if is_rank0():
        try:
            outcome = _pickled(("value", decide()))
        except BaseException as e:  # SystemExit and Ctrl-C too, as rank0_prepares
            outcome, raised = _pickled(("raised", e)), e
    kind, value = pickle.loads(object_from_rank0(outcome))
    if kind == "raised":
        raise raised if raised is not None else value  # rank 0: its own, with its traceback
    return value


_PREPARED = collections.Counter()  # rank0_prepares: what -> the calls so far in this process


def rank0_prepares(prepare, what: str, poll_s: float = 0.25):
    """prepare() run on global rank 0 alone -> its value on every rank, the others waiting with no
    collective: a preparation (a corpus encoded, a block index built) may outlast the collective
    timeout (MMADAPT_DIST_TIMEOUT_S). A short poll keeps a rank from reaching the next collective,
    which comes under that timeout, a whole poll after rank 0. `what` names the work in the
    waiting ranks' line; every rank makes the same calls in the same order.

    The ranks meet in the job's rendezvous store (the job is joined here, as object_from_rank0
    does), where rank 0 leaves its value or what it raised, which the others then raise too.
    Before, they polled the file system for rank 0's file alone: when rank 0 refused the input
    while preparing (a corpus too small for its --vocab_size), ranks on nodes that no launcher
    stops when rank 0 exits waited for that file forever. A store lives as long as its launch, so
    nothing an earlier launch left is read as this one's, as a marker file beside the data could
    be (torchrun's agent keeps its store across the restarts of --max_restarts: the keys name the
    attempt); where rank 0's process holds it (DeepSpeed's launcher, srun), a rank 0 that dies
    outright takes it along and the others fail at once. Rank 0 goes on once every rank has read
    its outcome: all may refuse the prepared data next (too few tokens), and a rank 0 gone before
    a slower rank's next poll left that rank only "rank 0 stopped". A file prepare() wrote may
    still take a moment to show on another node of a shared file system: callers wait for it
    (data.wait_for)."""
    if not _joined_with_others():
        return prepare()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's; no other launcher restarts
    key = f"mmadapt/rank0_prepares/{attempt}/{_PREPARED[what]}/{what}"
    _PREPARED[what] += 1
    # The store torch.distributed rendezvoused through: not public API, but the one store every
    # rank of this launch (and of no other) reaches; a new one would need a port of its own.
    store = dist.distributed_c10d._get_default_store()
    if is_rank0():
        try:
            value = prepare()
            outcome = _pickled(("value", value))
        except BaseException as e:  # SystemExit and Ctrl-C too: no rank may be left waiting
            store.set(key, _pickled(("raised", e)))
            # Ctrl-C reaches every rank of a bare launch: none will read, so no long wait for them
            _await_readers(store, key, 2.0 if isinstance(e, KeyboardInterrupt) else DIST_TIMEOUT_S)
            raise
        store.set(key, outcome)
        _await_readers(store, key, DIST_TIMEOUT_S)
        return value
    announced = False
    while True:
        try:
            if store.check([key]):
                break
        except RuntimeError as e:  # torch's DistError: the store's host went away
            raise RuntimeError(f"rank {dist.get_rank()}: rank 0 stopped while it prepared {what} "
                               f"(the job's store answers: {e}): its log says why") from None
        if not announced:
            print(f"rank {dist.get_rank()}: waiting for rank 0 to prepare {what}", file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll_s)
    kind, value = pickle.loads(store.get(key))
    store.set(f"{key}/read/{dist.get_rank()}", b"")  # (rank 0 names the ranks that never read)
    store.add(key + "/read", 1)
    if kind == "raised":
        raise value
    return value


def _await_readers(store, key: str, timeout_s: float) -> None:
    """Until every other rank has read rank 0's outcome under `key`, at most timeout_s (the
    collective timeout: a rank that late is broken). The store lives in rank 0's process under
    DeepSpeed's launcher: rank 0 leaving at once with its error took the store along before the
    others read it, and they failed with the store's "connection closed" instead of the error."""
    deadline = time.monotonic() + timeout_s
    try:
        while store.add(key + "/read", 0) < dist.get_world_size() - 1:
            if time.monotonic() >= deadline:
                # a rank that stopped before it got here (a launcher that does not stop the others):
                # named, or rank 0's next collective fails a timeout later naming no one
                late = [r for r in range(1, dist.get_world_size()) if not store.check([f"{key}/read/{r}"])]
                print(f"rank 0: rank(s) {', '.join(map(str, late))} never took {key.split('/', 4)[-1]} in "
                      f"{timeout_s:g} s: they stopped (their logs say why) or hang", file=sys.stderr, flush=True)
                return
            time.sleep(0.05)
    except RuntimeError:  # a store held elsewhere (torchrun's agent) that went away: nothing to wait for
        pass


def _pickled(outcome: tuple[str, object]) -> bytes:
    """rank0_prepares' (kind, value) as bytes; an exception pickle cannot carry, as its text in
    the nearest built-in class it derives from (a ValueError stays one: every rank exits alike)."""
    try:
        b = pickle.dumps(outcome)
        pickle.loads(b)  # an exception whose __init__ wants other arguments pickles, then fails to load
        return b
    except Exception:
        if outcome[0] != "raised":
            raise
        e = outcome[1]
        message = f"rank 0: {type(e).__name__}: {e}"
        for c in type(e).__mro__:  # UnicodeDecodeError, ExceptionGroup: no class of one message
            if c.__module__ == "builtins":
                try:
                    sent = pickle.dumps(("raised", c(message)))
                    pickle.loads(sent)
                    return sent
                except Exception:
                    continue
        return pickle.dumps(("raised", RuntimeError(message)))


def together(work, failure: str):
    """work() on every rank -> its value, once every rank's has returned (collective over the
    whole world, over gloo on the host; joins the job as object_from_rank0 does). Where it raised
    on any rank, every rank leaves: that rank with its own error, the others with PeerFailed,
    "rank(s) <those ranks> <failure> (their output says why)". Each rank reads a source's checkpoint for itself, and one can fail where
    rank 0 did not (the checkpoint rank 0 chose, pruned by the source's --keep_last before a slower
    node read it; a file another node's view of a shared file system does not show yet): the
    ranks that read went on into the next collective (DeepSpeed's initialize) and waited there
    until the collective timeout, wherever no launcher stops a job one of whose ranks failed (srun
    without --kill-on-bad-exit), to end in a timeout that named nothing. The same holds for work
    one rank does alone (rank 0's after a checkpoint: work() returns None on the others).
    Whatever work() raises, an interrupt too, is agreed on before it is raised here."""
    failed = value = None
    try:
        value = work()
    except BaseException as e:  # re-raised below, once every rank knows (not left in a collective)
        failed = e
    if _joined_with_others():
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        flags[dist.get_rank()] = int(failed is not None)
        dist.all_reduce(flags, group=_CONTROL)
        ranks = flags.nonzero().flatten().tolist()
        if ranks and failed is None:
            raise PeerFailed(f"rank(s) {', '.join(map(str, ranks))} {failure} (their output says why)")
    if failed is not None:
        raise failed
    return value


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (collective over the whole world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL)
    return bool(t.item())


def replicas_sum(count: int) -> int:
    """The sum of `count` over the data-parallel replicas, on every rank (collective over the whole
    world, over gloo on the host): every rank of a replica (its tensor- and pipeline-parallel
    ranks) holds the same count, a count of the replica's batches, so the world's sum is that
    many times the replicas'."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(t, group=_CONTROL)
    return int(t.item()) // (dist.get_world_size() // dp_world())


def shm_allreduce_buffer() -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce keeps this rank's buffer (about 66 MB; it
    makes one per rank when all ranks run on one machine, i.e. LOCAL_SIZE == WORLD_SIZE)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")


def _unlink_shm_allreduce_buffer() -> None:
    """DeepSpeed never removes its CPU all-reduce buffers, and /dev/shm is RAM: every run leaves
    ranks x 66 MB behind (a day of tests filled 22 GB here, then the OOM killer came). When
    deepspeed.init_distributed returns, each rank has mapped every peer's buffer, so after a
    barrier the names can go: the mappings stay valid, and the memory is freed when the
    processes exit, however they exit."""
    if torch.cuda.is_available():
        return
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_allreduce_buffer())


def launched_world_size() -> int:
    """The job's size as the launcher describes it, before any process group exists (1 for a
    plain `python` run). srun's tasks started without a launcher between (no WORLD_SIZE) are
    refused: torch.distributed reads no SLURM variable, so each would train alone, a world of
    one, into the same directories."""
    if "WORLD_SIZE" not in os.environ:
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")  # set by srun for its tasks alone (not sbatch's script)
        if tasks.isdigit() and int(tasks) > 1:
            raise ValueError(f"srun started {tasks} tasks of this command and no launcher told them of each other "
                             "(WORLD_SIZE is unset), so each would train alone: launch one task per node through "
                             "`mmadapt slurm-env` (launch/slurm/*.sbatch, docs/cluster.md), or run it with srun -n 1 "
                             "(independent runs, one per task into its own --output_dir: set WORLD_SIZE=1)")
    return int(os.environ.get("WORLD_SIZE", 1))


def check_one_process(command: str, fix: str) -> None:
    """Refuse a command that runs in one process (and starts its own workers, or claims its
    directories once) where a launcher started several: every one would run it whole."""
    world = launched_world_size()
    if world > 1:
        raise ValueError(f"{command} runs in one process (the launcher started {world}): {fix}")


def check_world_size(world: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
    mp = tensor_model_parallel_size * pipeline_model_parallel_size
    if world % mp:
        raise ValueError(f"{world} ranks cannot hold tensor_model_parallel_size x pipeline_model_parallel_size "
                         f"= {mp}: launch a multiple of {mp} ranks")


def init_parallel(tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
    """Create the tensor/pipeline/data-parallel groups: once per process, by the entry point
    (a command, a test, the demo). Groups are never torn down and rebuilt; asking for another
    layout in the same process is an error. Evaluation needs no groups at all (TP=1 models are
    plain torch modules)."""
    init_distributed()
    check_world_size(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        have = (tp_world(), parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tensor_model_parallel_size, pipeline_model_parallel_size):
            raise ValueError(f"this process already runs tensor x pipeline parallel {have[0]} x {have[1]}; a step "
                             f"with {tensor_model_parallel_size} x {pipeline_model_parallel_size} needs its own "
                             "process (launch it separately)")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size)


def _initialized() -> bool:
    return parallel_state.model_parallel_is_initialized()


# Without process groups (evaluation, export) this process is rank 0 of a world of one.
def tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank() if _initialized() else 0


def tp_world() -> int:
    return parallel_state.get_tensor_model_parallel_world_size() if _initialized() else 1


def dp_rank() -> int:
    return parallel_state.get_data_parallel_rank() if _initialized() else 0


def dp_world() -> int:
    return parallel_state.get_data_parallel_world_size() if _initialized() else 1


def pp_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_rank() if _initialized() else 0


def is_rank0() -> bool:
    """Global rank 0: the rank that writes run records, logs and shared files. Before the process
    groups exist (the run lock) the launcher's RANK says it; a plain `python` run is rank 0."""
    return (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0


class DeepSpeedMPU:
    """The model-parallel-unit interface DeepSpeed's engine asks for, read from parallel_state.

    Used without pipeline parallelism, where "model parallel" means tensor parallel. (The
    pipeline engine builds its own grid from the same topology.)
    """

    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_world_size = staticmethod(
        parallel_state.get_pipeline_model_parallel_world_size)

    @staticmethod
    def get_data_parallel_group_ranks():
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


# --- RNG ------------------------------------------------------------------------------------

class ModelParallelRNG:
    """A second RNG stream for randomness inside tensor-parallel regions.

    Dropout on a replicated tensor must draw the same mask on every tensor-parallel rank (the
    default stream, seeded identically); dropout on a partitioned tensor (attention
    probabilities, whose heads are split across ranks) must draw a different one per rank.
    megatron-core's tracker does this for CUDA only; this one swaps the state of whichever
    default generator the tensors live on, so it works on CPU and GPU alike.
    """

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}

    def seed(self, seed: int) -> None:
        for dev in ("cpu", "cuda"):
            if dev == "cuda" and not torch.cuda.is_available():
                continue
            with self._swap(dev):
                # the CPU generator alone: torch.manual_seed would also seed every CUDA default
                # generator, outside the swap, to this rank's model-parallel seed
                torch.default_generator.manual_seed(seed) if dev == "cpu" else torch.cuda.manual_seed(seed)

    @staticmethod
    def _get(dev):
        return torch.get_rng_state() if dev == "cpu" else torch.cuda.get_rng_state()

    @staticmethod
    def _set(dev, state):
        torch.set_rng_state(state) if dev == "cpu" else torch.cuda.set_rng_state(state)

    @contextlib.contextmanager
    def _swap(self, dev):
        outer = self._get(dev)
        if dev in self.states:
            self._set(dev, self.states[dev])
        try:
            yield
        finally:
            self.states[dev] = self._get(dev)
            self._set(dev, outer)

    @contextlib.contextmanager
    def fork(self, dev: torch.device | str = "cpu"):
        dev = torch.device(dev).type
        if dev not in self.states:  # not seeded: behave like the default stream
            yield
            return
        with self._swap(dev):
            yield

    def state_dict(self) -> dict:
        return dict(self.states)

    def load_state_dict(self, states: dict) -> None:
        self.states = dict(states)


MODEL_PARALLEL_RNG = ModelParallelRNG()


def seed_everything(seed: int) -> None:
    """Default streams: same on all tensor-parallel ranks of a stage; the model-parallel stream:
    different per tensor-parallel rank (megatron's offset of 2718)."""
    stage_seed = seed + 100 * pp_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    MODEL_PARALLEL_RNG.seed(stage_seed + 2718 + tp_rank())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "model_parallel": MODEL_PARALLEL_RNG.state_dict()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    MODEL_PARALLEL_RNG.load_state_dict(state["model_parallel"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def seeded(seed: int):
    """Run the body with the default generators seeded to `seed`, then restore them.

    Each submodule is initialised inside `seeded(base + k)` so that its weights depend only on
    (seed, k) - not on which other modules this rank builds. A pipeline stage that builds only
    its own layers therefore gets exactly the weights of the single-process model.

    The CPU generator alone (weights are drawn on the CPU: use_cpu_initialization), as fork_rng
    restores it alone: torch.manual_seed would seed every CUDA generator too and leave it so, and a
    model built after seed_everything (Step 2's scoring model, on rank 0 alone, at its first
    checkpoint) would move that rank's dropout masks off its tensor-parallel peers'.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield
