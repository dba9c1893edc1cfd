"""Checkpoints through DeepSpeed's engine, made crash-safe, plus an offline full-weight reader.

Layout of `<output_dir>/checkpoints/`:
    step00000100/          one tag per save: DeepSpeed's files, then
        rng_rank00000.pt   every rank's RNG states (DeepSpeed keeps client state for one rank only)
        fp32_tp00_pp00.pt  under bf16/fp16: the fp32 master weights of what the run trains, one file
                           per (tensor, pipeline) rank, in full parameter names (DeepSpeed's module
                           files hold the low-precision copies)
        COMPLETE           written by rank 0 after every rank finished writing: the tag is usable.
                           It lists every file of the tag with its size.
    latest                 DeepSpeed's pointer, replaced atomically after COMPLETE

A run killed at any moment, mid-save included, resumes from the newest tag that has COMPLETE;
`latest` is only a convenience for DeepSpeed's own tools. A complete tag whose files no longer
match COMPLETE's list (truncated, deleted), or that cannot be read, is reported and the one
before it is used (`resume`). keep_last > 0 deletes all but the newest keep_last complete tags.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import pickle
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from mmadapt.faults import LOCK_NAME, STOP_FILE, TAKEOVER_NAME, pid_alive
from mmadapt.parallel import dp_rank, is_rank0, pp_rank, rank0_decides, rng_state, set_rng_state, tp_rank

_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(ckpt_dir: str | os.PathLike) -> list[str]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(d.name for d in ckpt_dir.iterdir() if _TAG.match(d.name) and (d / "COMPLETE").is_file())


def has_checkpoints(ckpt_dir: str | os.PathLike) -> bool:
    ckpt_dir = Path(ckpt_dir)
    return ckpt_dir.is_dir() and any(_TAG.match(d.name) or d.name == "latest" for d in ckpt_dir.iterdir())


def check_output_dir(output_dir: Path) -> None:
    """An output directory must be a directory (or not exist yet) that this user can write in."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output_dir {output_dir} is a file, not a directory: choose a directory")
    existing = next(p for p in [output_dir, *output_dir.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--output_dir {output_dir} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir} is not writable ({existing} does not let this user write): "
                         "choose another directory")
    # A resumed run writes its next checkpoint here; torch would report a directory it cannot
    # write as "Parent directory ... does not exist", after the run had started.
    ckpt = output_dir / "checkpoints"
    if ckpt.exists() and not (ckpt.is_dir() and os.access(ckpt, os.W_OK | os.X_OK)):
        raise ValueError(f"{ckpt} is {'not a directory' if not ckpt.is_dir() else 'not writable by this user'}: the "
                         "run writes its checkpoints there; fix it, or choose a new --output_dir")


# What a training run writes in its directory before its run.json: a directory holding anything
# else and no run.json is somebody's other files, not a run that stopped early.
# The STOP file too: SLURM's warning may come while the run starts, before its run.json, and the
# requeued --resume must find a run (atomic_write's temporary files are matched in refuse_overwrite).
RUN_ENTRIES = ("checkpoints", "data", "tokenizer", "tensorboard", "metrics.jsonl", "embeddings", LOCK_NAME,
               TAKEOVER_NAME, STOP_FILE)


# The name of a temporary a write in a directory leaves where it is killed (atomic_write's
# .<name>.tmp<pid>@<host>; from before 2026-12-06 without the host): a writer's own entry.
WRITE_TEMPORARY = r"\..+\.tmp\d+(?:@[^/]+)?"


def refuse_overwrite(output_dir: Path, resume: bool) -> None:
    """A run directory with another run's checkpoints is continued (--resume) or left alone; a
    directory of other files is not written into (as import-hf and export-hf refuse it)."""
    check_output_dir(output_dir)
    output_dir = Path(output_dir)
    checkpoints = has_checkpoints(output_dir / "checkpoints")
    if checkpoints and not resume:
        raise ValueError(f"{output_dir} already holds a run's checkpoints: pass --resume to continue it (run again as "
                         "it was, it trains nothing more), or choose a new --output_dir")
    # A Step-2 artifact past update 0 is written after its checkpoint: with none left (deleted to
    # save disk), a run here would start at update 0 and overwrite them one by one, the old run's
    # later ones left beside the new run's for Step 4 to take as one run
    from mmadapt.artifact import ARTIFACT_FILE  # (artifact.py imports this module)

    later = sorted(p.parent.name for p in (output_dir / "embeddings").glob(f"step*/{ARTIFACT_FILE}")
                   if p.parent.name != tag_for(0))
    if later and not checkpoints:
        raise ValueError(f"{output_dir} holds the Step-2 artifacts of a run (embeddings/{later[-1]}) and no checkpoint "
                         "to continue it from: choose a new --output_dir (nothing is overwritten)")
    refuse_other_than_a_run(output_dir)


def refuse_other_than_a_run(output_dir: Path) -> None:
    """A run's directory, or one to make one in: a directory holding no run.json and files a
    training run does not write before it is somebody's other files (refused in one line)."""
    check_output_dir(output_dir)
    if not (Path(output_dir) / "run.json").exists():
        refuse_other_files(Path(output_dir), lambda name: name in RUN_ENTRIES or re.fullmatch(WRITE_TEMPORARY, name),
                           "mmadapt run")


def refuse_other_files(output_dir: Path, own: Callable[[str], bool], what: str) -> None:
    """Refuse to write `what` (a run, a prepared dataset) into a directory that holds files whose
    names are not `own` (what such a writer puts there, finished or stopped): somebody's other files."""
    other = sorted(p.name for p in output_dir.iterdir() if not own(p.name)) if output_dir.is_dir() else []
    if other:
        raise ValueError(f"--output_dir {output_dir} holds other files ({', '.join(other[:3])}"
                         f"{', ...' if len(other) > 3 else ''}) and no {what}: choose a new or empty directory "
                         "(nothing is overwritten)")


def latest_tag(ckpt_dir: str | os.PathLike) -> str | None:
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def optimizer_name(engine) -> str:
    """The class name of the engine's optimizer ("" for an engine without one)."""
    optimizer = getattr(engine, "optimizer", None)
    return type(optimizer).__name__ if optimizer is not None else ""


def written_by(ckpt_dir: str | os.PathLike) -> str | None:
    """The class of the optimizer whose state the checkpoint `resume` would load holds (the newest
    complete one that is intact; None: none; "" for one written before mmadapt recorded it,
    always under the JSON's ZeRO stage)."""
    tag = next((t for t in reversed(complete_tags(ckpt_dir)) if damaged(Path(ckpt_dir) / t) is None), None)
    if tag is None:
        return None
    return json.loads((Path(ckpt_dir) / tag / "COMPLETE").read_text()).get("ds_optimizer", "")


def missing_dirs(path: Path) -> list[Path]:
    """`path` and its parents that do not exist yet, deepest first: what making it will create."""
    return [d for d in (path, *path.parents) if not d.exists()]


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Each of `dirs` (missing_dirs' list, deepest first) removed where it is an empty directory:
    a refused command leaves none it made, and none that something else wrote into meanwhile."""
    for d in dirs:
        with contextlib.suppress(OSError):  # not empty, or gone
            d.rmdir()


def _remove_stale(dest: Path) -> None:
    """The staging directories of `dest` left by a process of this host that is gone (killed: an
    import of a 7B model left 14 GB beside its run): removed. Another host's (a shared file system)
    are left, its processes unknown here."""
    host = socket.gethostname()
    for p in dest.parent.glob(f".{glob.escape(dest.name)}.*@{glob.escape(host)}"):
        m = re.fullmatch(rf"\.{re.escape(dest.name)}\.(?:tmp|old)(\d+)@{re.escape(host)}", p.name)
        if m and p.is_dir() and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(dest: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """A fresh temporary directory beside `dest` that becomes `dest` once the body has filled it,
    so a reader never sees half of it (and a failure leaves nothing). replace: an existing `dest`
    is deleted first; otherwise it must not exist or be empty (the caller has checked). A failure
    also removes the parent directories made for it (an --output_dir new/sub/run refused inside the
    body left new/sub/ behind)."""
    dest = Path(dest)
    if dest.is_symlink():  # a link to the directory: filled where it points (the link stays a link)
        dest = Path(os.path.realpath(dest))
    me = f"{os.getpid()}@{socket.gethostname()}"
    if dest.name.startswith(".") and dest.name.endswith(f".tmp{me}") and dest.is_dir():
        # this process's own stage (export_hf stages the directory write_hf fills): filled in place,
        # made whole by the outer stage's move; a stage of it would sit beside it, named after no
        # directory a rerun stages, and a kill left it (a whole model's weights) for good
        yield dest
        return
    tmp = dest.with_name(f".{dest.name}.tmp{me}")
    made = missing_dirs(tmp.parent)
    _remove_stale(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_dir() and replace:  # moved aside whole, then deleted: never a half-deleted `dest`
            old = dest.with_name(f".{dest.name}.old{me}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(old, dest)  # what was there stays
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
        if dest.is_dir():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:  # the body's failure, or the move's: nothing of it left beside `dest`
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_dirs(made)
        raise


def atomic_write(path: Path, data: str | bytes) -> None:
    """`path` holds `data` (text or bytes) whole, or what it held before: never half. What an
    earlier writer of `path` killed before its rename left goes (remove_dead_writes)."""
    tmp = write_temporary(path)
    binary = isinstance(data, bytes)
    with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_temporary(path: Path, suffix: str = "") -> Path:
    """Where a write of `path` builds it before renaming it into place (os.replace), after the
    temporaries of earlier writers of it killed before their rename are removed
    (remove_dead_writes): `.<name>.tmp<pid>@<host><suffix>`. suffix: the extension the writer
    needs (np.save appends .npy to a name without it); `path` is then the name without it."""
    remove_dead_writes(path, suffix)
    return path.with_name(f".{path.name}.tmp{os.getpid()}@{socket.gethostname()}{suffix}")


def remove_dead_writes(path: Path, suffix: str = "") -> None:
    """The temporaries that atomic_write(`path`), publish_new(`path`) and write_temporary(`path`,
    `suffix`) left in processes of this host that are gone (killed before the rename or the
    link): removed; a live writer's stay, and another host's (a shared file system), its
    processes unknown here. (A run's record and a step's --output: each killed rerun's write left
    one more; a dataset's block index and laid-out stream, one per killed run that built it.)
    Names without a host are from before 2026-12-06."""
    name, host, ext = re.escape(path.name), f"(?:@{re.escape(socket.gethostname())})?", re.escape(suffix)
    own = re.compile(rf"\.{name}\.(?:tmp|new)(\d+){host}{ext}"
                     rf"|\.\.{name}\.new\d+{host}\.tmp(\d+){host}")  # publish_new's, staged by atomic_write
    for tmp in path.parent.glob(f".*{glob.escape(path.name)}.*"):
        m = own.fullmatch(tmp.name)
        if m and not pid_alive(int(m.group(1) or m.group(2))):
            tmp.unlink(missing_ok=True)


def publish_new(path: Path, data: str | bytes, flag: str = "--output") -> None:
    """`path`, which must not exist, created holding `data` whole: refused in one line where it
    exists by now (another job with the same output finished first: os.replace, atomic_write's
    publish, would replace its result without a word). A file system without hard links gets the
    check and the replace, not atomic."""
    path = Path(path)
    remove_dead_writes(path)
    tmp = path.with_name(f".{path.name}.new{os.getpid()}@{socket.gethostname()}")
    atomic_write(tmp, data)
    try:
        os.link(tmp, path)  # fails where path exists, however it came to
    except FileExistsError:
        tmp.unlink()
        raise ValueError(f"{path} appeared while this command ran (another job writing the same {flag}?): kept "
                         f"as it is; choose a new {flag}") from None
    except OSError:  # no hard links here
        if os.path.lexists(path):
            tmp.unlink()
            raise ValueError(f"{path} appeared while this command ran: kept as it is; choose a new {flag}") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _save_fp32_master(engine, path: Path, names: dict[str, str | None]) -> None:
    """Collective over the data-parallel group: DeepSpeed assembles each trained parameter's
    fp32 master copy from the ZeRO partitions (safe_get_full_fp32_param); data-parallel rank 0
    writes this (tensor, pipeline) rank's shards."""
    from deepspeed.utils import safe_get_full_fp32_param

    master = {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is not None and names.get(n) is not None:
            master[names[n]] = full.detach().to("cpu", torch.float32)
    if dp_rank() == 0:
        torch.save(master, path)


def load_pt(path: str | os.PathLike, what: str = "file", weights_only: bool = False):
    """torch.load on the CPU, with a file that is missing, truncated or not a PyTorch file
    reported as a user's mistake (one line naming it) rather than a torch traceback."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} " + ("is a directory, not a file" if path.is_dir() else "does not exist"))
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # pickle, zip and torch errors all mean: not a readable checkpoint file
        if weights_only and isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e):
            # a whole file holding objects beside its tensors (code a load would run): not read, not "truncated"
            raise ValueError(f"{what} {path} holds objects other than tensors, which mmadapt does not load (a "
                             "pickle runs code): save its weights as safetensors (save_pretrained's default) and "
                             "read that") from None
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ValueError(f"{what} {path} cannot be read ({reason}): it is truncated or not a PyTorch file; "
                         "restore or recreate it") from None


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """A JSON object from `path`, with a missing file, broken JSON or another shape reported in
    one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} " + ("is a directory, not a file" if path.is_dir() else "does not exist"))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ValueError(f"{what} {path} is not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} holds a JSON {type(data).__name__}, not an object")
    return data


def kept_result(path: Path, key: dict, what: str) -> dict | None:
    """The JSON object kept at `path` (read_json's refusals) when its "key" entry equals `key`
    (what it was computed from), else None: a result computed once and given again by a repeated
    command (extend's summary, the sweep's records), computed anew when its inputs changed."""
    if not path.is_file():
        return None
    kept = read_json(path, what)
    return kept if kept.get("key") == key else None


def _complete_temporary(name: str) -> bool:
    """A temporary of COMPLETE's atomic write that a kill left in a tag: no file of the tag (the
    next write of COMPLETE removes it; listed among the tag's files, it made the tag 'damaged')."""
    return name.startswith(".COMPLETE.tmp")


def _files(tag_dir: Path) -> dict[str, int]:
    """The files of a tag COMPLETE lists: not COMPLETE, nor its write's temporary."""
    return {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir())
            if p.is_file() and p.name != "COMPLETE" and not _complete_temporary(p.name)}


def damaged(tag_dir: Path) -> str | None:
    """Why a complete tag cannot be trusted (a file missing or of another size than when it
    was saved), or None. Tags saved before COMPLETE listed their files are trusted."""
    try:
        listed = json.loads((tag_dir / "COMPLETE").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return f"{tag_dir / 'COMPLETE'} is unreadable"
    for name, size in (listed or {}).items():
        if _complete_temporary(name):  # listed by saves before 2026-12-06
            continue
        f = tag_dir / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} when it was saved"
    return None


def prune(ckpt_dir: Path, keep_last: int, saved: str) -> None:
    """Delete all but the newest `keep_last` intact complete tags up to `saved` (the tag just
    written), and incomplete or damaged tags older than them (rank 0). COMPLETE goes first, so a
    tag being deleted is never taken for a usable one. A tag after `saved` is neither counted nor
    deleted: one that `resume` passed over as damaged, which would otherwise count as the newest
    and take every intact tag with it (a save at its update writes it anew; without one it
    stays, damaged, for you to delete). Within keep_last, the incomplete tags older than the
    oldest complete one go: a prune killed after a tag's COMPLETE left its files whole, which no
    resume reads."""
    if keep_last <= 0:
        return
    # intact ones: a damaged tag (one resume fell back from) took the place of an intact one
    tags = [t for t in complete_tags(ckpt_dir) if t <= saved and not damaged(ckpt_dir / t)]
    if not tags:
        return
    oldest_kept = tags[-min(keep_last, len(tags))]
    for d in sorted(ckpt_dir.iterdir()):
        if _TAG.match(d.name) and d.name < oldest_kept:
            (d / "COMPLETE").unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)


# what torch's zip writer raises where a write fails (a full disk, a lost file system): a RuntimeError
_WRITE_FAILED = ("PytorchStreamWriter failed", "inline_container", "file write failed")


@contextlib.contextmanager
def _write_failures(tag_dir: Path):
    """A checkpoint write that torch's zip writer could not finish (a full disk raises its
    RuntimeError, not an OSError) as an OSError naming the tag and the space left: one line, the
    tag left without COMPLETE (no resume reads it), the complete ones before it kept."""
    try:
        yield
    except RuntimeError as e:
        if not any(m in str(e) for m in _WRITE_FAILED):
            raise
        try:
            free = f"{shutil.disk_usage(tag_dir.parent).free / 2**20:,.0f} MiB free there"
        except OSError:
            free = "its file system unreadable"
        reason = str(e).strip().splitlines()[0][:160]
        raise OSError(errno.EIO, f"could not write checkpoint {tag_dir.name} ({free}; torch: {reason}): the "
                                 "complete checkpoints before it are kept; free space, then run the same command "
                                 "again (with --resume where the command takes it)", str(tag_dir)) from None


def save(engine, ckpt_dir: str | os.PathLike, step: int, client_state: dict, names: dict[str, str | None],
         exclude_frozen: bool = False, keep_last: int = 0) -> str:
    """Collective: every rank calls it. Returns the tag written. names: module parameter name ->
    full name (None: a tied duplicate). exclude_frozen: leave parameters with requires_grad=False
    out of the module state (Steps 1b, 2 and 3 keep only what they train). keep_last: see prune."""
    ckpt_dir, tag = Path(ckpt_dir), tag_for(step)
    if is_rank0():  # rewriting a tag (one a damaged newer tag's fallback left behind): not usable meanwhile
        (ckpt_dir / tag / "COMPLETE").unlink(missing_ok=True)
    dist.barrier()
    with _write_failures(ckpt_dir / tag), _recording_saves(engine) as written:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={**client_state, "step": step},
                               save_latest=False, exclude_frozen_parameters=exclude_frozen)
        (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
        if engine.bfloat16_enabled() or engine.fp16_enabled():
            master = ckpt_dir / tag / f"fp32_tp{tp_rank():02d}_pp{pp_rank():02d}.pt"
            _save_fp32_master(engine, master, names)
            if dp_rank() == 0:  # its writer
                written.append(master)
        written.append(ckpt_dir / tag / f"rng_rank{dist.get_rank():05d}.pt")
        torch.save(rng_state(), written[-1])
    # Each rank's own files on disk before COMPLETE says the tag is whole: a node lost after it
    # (a client's write-back cache on a parallel file system) must not leave a COMPLETE tag whose
    # data were lost, the older tags pruned. On NFS and Lustre only the writing client can flush.
    _fsync_files(written)
    dist.barrier()
    if is_rank0():
        # ds_optimizer: which optimizer's state the tag holds (engine.for_replicas resumes under it)
        atomic_write(ckpt_dir / tag / "COMPLETE", json.dumps({"step": step, "files": _files(ckpt_dir / tag),
                                                               "ds_optimizer": optimizer_name(engine)}))
        _fsync_dir(ckpt_dir / tag)  # its files' entries and COMPLETE's, before older tags go
        atomic_write(ckpt_dir / "latest", tag)
        _fsync_dir(ckpt_dir)
        prune(ckpt_dir, keep_last, tag)
    dist.barrier()
    return tag


@contextlib.contextmanager
def _recording_saves(engine) -> Iterator[list]:
    """The files DeepSpeed's checkpoint engine writes on this rank inside the block (its `save`:
    torch.save for the default engine), listed in the list it yields."""
    written: list = []
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None:
        yield written
        return
    save, own = ce.save, vars(ce).get("save")

    def recording(state_dict, path, *args, **kwargs):
        save(state_dict, path, *args, **kwargs)
        written.append(Path(path))
    ce.save = recording
    try:
        yield written
    finally:
        if own is None:
            del ce.save  # the class's method again
        else:
            ce.save = own


def _fsync_files(paths: list) -> None:
    for path in paths:
        if Path(path).is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """The directory's entries (new files, renames) on disk (POSIX; a no-op where it cannot open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DamagedRun(ValueError):
    """A run to continue whose every complete checkpoint is damaged: `detail` says which; the
    line a --resume gets says how it goes on. A command that continues its runs by itself (the
    sweep, extend, the demo: the same command again) words its own line around `detail`."""

    def __init__(self, detail: str):
        super().__init__(f"--resume: {detail}: restore its files and resume, or start a new --output_dir")
        self.detail = detail

    def __reduce__(self):  # pickled by its fields: a demo worker's run sends it to the demo's process
        return type(self), (self.detail,)


def intact_tag(ckpt_dir: str | os.PathLike) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint that is intact (None: there is no complete one) and the
    newer complete ones passed over, (tag, why damaged), newest first. Refused in one line where
    every complete one is damaged: what a --resume checks before it writes anything (run.start_run:
    the record's FINISHED is cleared as a resume starts) and again where it loads."""
    ckpt_dir = Path(ckpt_dir)
    tags, passed = complete_tags(ckpt_dir), []
    for tag in reversed(tags):
        why = damaged(ckpt_dir / tag)
        if why is None:
            return tag, passed
        passed.append((tag, why))
    if tags:
        raise DamagedRun(f"every complete checkpoint in {ckpt_dir} is damaged (the newest, {tags[-1]}: "
                         f"{passed[0][1]})")
    return None, []


def resume(engine, ckpt_dir: str | os.PathLike, strict: bool = True) -> dict | None:
    """Collective. Load the newest complete checkpoint that is intact, saying which newer ones
    were skipped and why; None (with a message) when there is no complete one: the run starts at
    update 0. Where every complete one is damaged, refused in one line: starting again would
    overwrite the run's log and, update by update, its checkpoints (a requeued job resumes with
    no one watching), for what may be a file system's passing fault. A file that passes the size
    check but cannot be read stops with a one-line error naming it."""
    ckpt_dir = Path(ckpt_dir)

    def newest_intact() -> str | None:
        tag, passed = intact_tag(ckpt_dir)
        for old, old_why in passed:
            print(f"checkpoint {old} is damaged ({old_why}): resuming from the one before it", file=sys.stderr)
        if tag is None:
            print(f"--resume: no complete checkpoint in {ckpt_dir}: starting at update 0", file=sys.stderr)
        return tag
    # one choice for every rank: each rank's view of a shared file system may lag
    chosen = rank0_decides(newest_intact)
    if chosen is None:
        return None
    try:
        return load(engine, ckpt_dir, chosen, strict=strict)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(unreadable(ckpt_dir / chosen, e)) from None


def unreadable(tag_dir: Path, e: BaseException) -> str:
    """The line for a complete, intact-sized checkpoint that failed to load with `e`: moving it
    aside (to resume from the one before it) is the fix for damaged content only, not for a
    shortage of memory or a file system that failed to read it, where the checkpoint is good."""
    reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return (f"checkpoint {tag_dir} cannot be read: out of memory ({reason}): free memory (fewer processes per "
                "node, a larger node) and resume again; the checkpoint is kept")
    if isinstance(e, OSError):
        return (f"checkpoint {tag_dir} cannot be read ({reason}): the file system failed to read it, its files "
                "have the sizes they were saved with: resume again once it reads; move it aside only if it is "
                "damaged (then the one before it is resumed)")
    return f"checkpoint {tag_dir} cannot be read ({reason}): move it aside to resume from the one before it"


def load(engine, ckpt_dir: str | os.PathLike, tag: str, strict: bool = True) -> dict:
    """Collective. Restores module, optimizer, scheduler and this rank's RNG; returns client state.
    strict=False: the checkpoint may lack frozen parameters (they come from the starting weights)."""
    ckpt_dir = Path(ckpt_dir)
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=strict)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    rng_file = ckpt_dir / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        raise ValueError(f"{rng_file} is missing: resume with the same number of ranks that wrote {tag}")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


# --- offline: full weights of a checkpoint, in the model family's parameter names -----------------------

def write_weights_only(ckpt_dir: Path, step: int, state: dict[str, torch.Tensor], model_config: dict) -> str:
    """A complete tag holding full weights only (no optimizer state), in the layout
    load_full_state_dict reads: for runs made outside this run's DeepSpeed engine (Hugging Face
    imports, the demo's shipped source models). Later steps start from it; it cannot be resumed."""
    ckpt_dir, tag = Path(ckpt_dir), tag_for(step)
    (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
    torch.save({"module": state, "tp_partition_dims": {}, "model_config": model_config, "step": step},
               ckpt_dir / tag / "mp_rank_00_model_states.pt")
    atomic_write(ckpt_dir / tag / "COMPLETE", json.dumps({"step": step, "files": _files(ckpt_dir / tag)}))
    atomic_write(ckpt_dir / "latest", tag)
    return tag


# A checkpoint's client state: the positions its updates' heads projected (their scored
# positions), summed over the updates run and the data-parallel replicas (engine.train_loop)
SCORED_ROWS = "scored_rows"


def work_run(tag_dir: Path) -> tuple[int, int | None]:
    """What was run to reach the checkpoint `tag_dir`: (the updates, its client state's position:
    applied updates and fp16 steps skipped on an overflow, a checkpoint without one its step;
    the rows its heads projected over them, SCORED_ROWS: None where the checkpoint does not
    know, one written before the count or by a job that counts none)."""
    files = sorted(Path(tag_dir).glob("mp_rank_*_model_states.pt"))  # each holds the client state
    meta = load_pt(files[0] if files else Path(tag_dir) / "mp_rank_00_model_states.pt", "checkpoint file")
    return int(meta.get("position", meta["step"])), meta.get(SCORED_ROWS)


def load_full_state_dict(ckpt_dir: str | os.PathLike, tag: str | None = None,
                         layer_prefixes: Callable[[dict], list] | None = None) -> dict[str, torch.Tensor]:
    """Merge a checkpoint's tensor-parallel shards and pipeline layers into one state dict, with
    the fp32 master weights wherever the run trained in bf16/fp16: what every later step starts
    from.

    Needs no process group. The partition dims of tensor-parallel parameters are recorded in
    the client state at save time (key `tp_partition_dims`; a padded vocabulary's real rows:
    `tp_vocab_padded_from`, whose padding is cut), and so is each pipeline layer's
    name prefix (key `pipeline_layers`, ModelFamily.pipeline_layer_prefixes). A pipeline
    checkpoint written before that key existed needs `layer_prefixes`(its model config dict)
    (mmadapt.run.load_weights passes its family's).
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"no complete checkpoint in {ckpt_dir}")
    d = ckpt_dir / tag
    # A tag chosen complete may be pruned (prune: COMPLETE first) by its run's --keep_last before or
    # while it is read, when a later step starts from a run still training: what fails then (a
    # file gone, a shard short, the fp32 masters missing and the bf16 copies taken) is that, said so
    sealed = (d / "COMPLETE").is_file()
    if not d.is_dir():  # pruned where the run kept newer tags (a run still training); else gone otherwise
        if any(t > tag for t in complete_tags(ckpt_dir)):
            raise _pruned(d, "does not exist")
        raise ValueError(f"checkpoint {d} does not exist: restore it")
    try:
        state = _merged_state(d, layer_prefixes)
    except Exception:
        if sealed and not (d / "COMPLETE").is_file():
            raise _pruned(d, "was deleted while it was read") from None
        raise
    if sealed and not (d / "COMPLETE").is_file():
        raise _pruned(d, "was deleted while it was read")
    return state


def _pruned(d: Path, what: str) -> ValueError:
    return ValueError(f"checkpoint {d} {what} (a run's --keep_last deletes its older checkpoints as it trains): "
                      "name a checkpoint the run keeps, or let it finish or raise its --keep_last")


def _merged_state(d: Path, layer_prefixes: Callable[[dict], list] | None) -> dict[str, torch.Tensor]:
    """load_full_state_dict's merge of the tag directory `d`."""
    model_files = sorted(d.glob("mp_rank_*_model_states.pt"))
    if not model_files:
        raise ValueError(f"checkpoint {d} has no model files (mp_rank_*_model_states.pt): it is not an mmadapt "
                         "checkpoint, or it was damaged")
    meta = load_pt(model_files[0], "checkpoint file")
    dims: dict[str, int] = meta["tp_partition_dims"]
    layer_files = sorted(d.glob("layer_*-model_*-model_states.pt"))
    shards: dict[str, list[torch.Tensor]] = {}
    if layer_files:  # pipeline: one file per (layer, tp rank)
        prefixes = meta.get("pipeline_layers")
        if prefixes is None:
            if layer_prefixes is None:
                raise ValueError(f"pipeline checkpoint {d} predates recorded layer names: read it through its run "
                                 "(mmadapt.run.load_weights)")
            prefixes = layer_prefixes(meta["model_config"])
        for f in layer_files:
            prefix = prefixes[int(re.match(r"layer_(\d+)-model_(\d+)", f.name).group(1))]
            if prefix is None:
                continue  # the last stage's copy of a tied weight
            for k, v in load_pt(f, "checkpoint file").items():
                shards.setdefault(prefix + k, []).append(v)
    else:
        for f in model_files:
            for k, v in load_pt(f, "checkpoint file")["module"].items():
                shards.setdefault(k, []).append(v)
    # megatron's layers (TP > 1) also save an `_extra_state` entry each: not a weight, and absent
    # from the plain layers of TP = 1, so a state dict means the same in every layout without it.
    state = {k: torch.cat(v, dim=dims[k]) if k in dims and len(v) > 1 else v[0] for k, v in shards.items()
             if not k.endswith("_extra_state")}
    master: dict[str, dict[int, torch.Tensor]] = {}
    for f in sorted(d.glob("fp32_tp*_pp*.pt")):  # sorted: pipeline stage 0's copy of a tied weight wins
        tp = int(re.match(r"fp32_tp(\d+)_pp(\d+)", f.name).group(1))
        for k, v in load_pt(f, "checkpoint file", weights_only=True).items():
            master.setdefault(k, {}).setdefault(tp, v)
    for k, by_tp in master.items():
        # a tensor-parallel shard per rank, or (LayerNorms, biases of row-parallel layers, position
        # embeddings) the same replicated parameter on every rank
        parts = [by_tp[i] for i in sorted(by_tp)]
        state[k] = torch.cat(parts, dim=dims[k]) if k in dims and len(parts) > 1 else parts[0]
    # A vocabulary padded for tensor parallelism (ModelConfig.padded_vocab_size): its real rows alone.
    for k, rows in meta.get("tp_vocab_padded_from", {}).items():
        if k in state:
            state[k] = state[k][:rows].clone()  # not a view: torch.save would write the padding too
    return state
