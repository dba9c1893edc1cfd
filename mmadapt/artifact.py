"""The Step-2 artifact: what Step 4 swaps into the primary model, written at every Step-2
checkpoint, read by every later command, and how its records are labelled.

Layout of <adapt run>/embeddings/<tag>/:
    embeddings.pt   the vocabulary-indexed tensors under ModelFamily.artifact_keys' keys:
                    "word_embeddings" [V, h] and, where the family has one, "output_bias" [V]
                    (an expanded vocabulary's whole: the source rows, then the new rows)
    spm.model       the target (or merged) tokenizer
    meta.json       what, for how much Step-2 compute, for which primary model (its run and its
                    weights' fingerprints: Step 4 matches it by content, not by path, through the
                    full one; every load checks the primary's weights through the sampled one)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mmadapt import checkpoint
from mmadapt.data import file_sha256, load_checked_tokenizer
from mmadapt.family import ModelFamily
from mmadapt.run import RUN_FILE, sampled_fingerprint, weights_fingerprint

ARTIFACT_FILE = "embeddings.pt"
# meta.json's sampled fingerprint of the primary's weights (run.sampled_fingerprint), beside the
# full one (primary_fingerprint, which records compare): what a load checks the weights by.
SAMPLED_KEY = "primary_sampled_fingerprint"
# The system of the records of fine-tuned runs scored with no adaptation (evaluate.no_adaptation_record).
NO_ADAPTATION = "no_adaptation"
SCORED_LABEL = " p="  # system_label's mark of a Step 2 that scored a fraction of the positions


def write_artifact(out_dir: Path, tensors: dict[str, torch.Tensor], tokenizer: Path, meta: dict) -> Path:
    """embeddings.pt, the tokenizer and meta.json (module docstring), published whole
    (checkpoint.staged_dir): a reader never sees half an artifact."""
    with checkpoint.staged_dir(out_dir, replace=True) as tmp:
        torch.save({k: v.contiguous() for k, v in tensors.items()}, tmp / ARTIFACT_FILE)
        (tmp / "spm.model").write_bytes(Path(tokenizer).read_bytes())
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    return out_dir


def read_artifact(path: str | os.PathLike) -> tuple[dict, Path, dict]:
    """An artifact directory, or an adapt run directory: its last artifact (said on stderr), as
    `evaluate --embeddings` takes a run for all of them. -> ({"word_embeddings": [V, h], ...},
    tokenizer path, meta)."""
    path, given = artifact_dir(path), Path(path)
    if path != given:
        print(f"note: {given} is an adapt run: its last artifact, {path}, is used", file=sys.stderr)
    art = checkpoint.load_pt(path / ARTIFACT_FILE, "Step-2 artifact file", weights_only=True)
    if not isinstance(art, dict) or "word_embeddings" not in art:
        raise ValueError(f"{path / ARTIFACT_FILE} holds no word_embeddings: it is not a Step-2 artifact")
    # A piece id past the last row would index outside the embedding (rows past the last id are
    # harmless: a vocabulary padded for tensor parallelism has them).
    rows, pieces = art["word_embeddings"].shape[0], load_checked_tokenizer(path / "spm.model").get_piece_size()
    if rows < pieces:
        raise ValueError(f"{path}: its embeddings have {rows} rows but its tokenizer spm.model has {pieces} pieces: "
                         "they do not belong together; use the artifact directory as adapt wrote it")
    return art, path / "spm.model", checkpoint.read_json(path / "meta.json", "Step-2 artifact file")


def artifact_dir(path: str | os.PathLike) -> Path:
    """An artifact directory as given; an adapt run directory's last artifact (what read_artifact
    reads, and what every check before the read must read the meta.json of)."""
    path = Path(path)
    if (path / ARTIFACT_FILE).is_file():
        return path
    if (path / "embeddings").is_dir():
        return artifact_dirs([path])[-1]
    # refused here, before a caller reads its meta.json (which named only that file as missing)
    raise ValueError(f"{path} is not a Step-2 embedding artifact (no embeddings.pt): pass a "
                     "directory under <adapt run>/embeddings/")


def artifact_dirs(paths: list[Path]) -> list[Path]:
    """Artifact directories, an adapt run's expanded to all its artifacts in step order."""
    out, given = [], []  # given: each artifact's directory as given (an adapt run's: the run)
    for p in paths:
        if (p / ARTIFACT_FILE).is_file():
            out.append(p)
            given.append(p)
        elif (p / "embeddings").is_dir():
            # not a write cut short: staged_dir's `.<tag>.tmp<pid>` holds its tensors before its meta.json
            found = sorted(d for d in (p / "embeddings").iterdir()
                           if not d.name.startswith(".") and (d / ARTIFACT_FILE).is_file())
            if not found:
                raise ValueError(f"{p} holds no Step-2 embeddings yet: let its adapt run save a checkpoint")
            found = _on_schedule(p, found)
            out += found
            given += [p] * len(found)
        else:
            raise ValueError(f"{p} is neither a Step-2 artifact nor an adapt run directory")
    given_once(out, "artifact", given)
    return out


def _on_schedule(run: Path, found: list[Path]) -> list[Path]:
    """An adapt run's artifacts (step order) less those saved where it was stopped or paused by
    --exit_interval (meta.json's off_schedule) that a later one follows: a run stopped and
    continued holds a curve point at the update it stopped at that no other run of its schedule
    has (it would move a curve's time-to-target). A run's last artifact stays whatever it is: a
    run stopped and not continued ends there. Named by its directory, a stop's artifact is
    scored like any other."""
    off = [d for d in found[:-1] if (d / "meta.json").is_file()  # one without: refused where it is read
           and d.name != checkpoint.tag_for(0)  # the start: on every schedule (marked off it on 2026-12-06)
           and checkpoint.read_json(d / "meta.json", "Step-2 artifact file").get("off_schedule")]
    if off:
        print(f"note: {run}: {', '.join(d.name for d in off)} left out, saved where the run was stopped (or paused) "
              "and continued (off its --save_interval schedule): pass it by its directory to score it",
              file=sys.stderr)
    return [d for d in found if d not in off]


def run_names(runs) -> dict[Path, str]:
    """Each of several Step-2 run directories named by as few of its path's last parts as tell it
    from the others ('fvt'; 'p/run' and 'q/run' for /p/run and /q/run): the label that keeps two
    runs of one system and language two curves (evaluate.apart_runs, report). Their last part
    alone named two runs in directories of one name alike, and merged them again."""
    parts = {r: Path(r).parts[1 if Path(r).anchor else 0:] for r in map(Path, runs)}

    def name(run: Path) -> str:
        for k in range(1, len(parts[run]) + 1):
            if all(other[-k:] != parts[run][-k:] for o, other in parts.items() if o != run):
                return "/".join(parts[run][-k:])
        return str(run)
    return {run: name(run) for run in parts}


def run_label(system: str, name: str) -> str:
    """The system of the records of one of several Step-2 runs of one system and language, named
    by `name` (run_names): `bl_base [run]` (evaluate.apart_runs, report's across files)."""
    return f"{system} [{name}]"


def system_of_run(label: str) -> str:
    """run_label's inverse: the system a record's name counts for (`bl_base [run]` -> `bl_base`);
    a name that is no run label, unchanged."""
    return label.split(" [", 1)[0]


def runs_of(system: str, systems) -> list[str]:
    """`system`'s runs told apart (run_label) among `systems`, sorted."""
    return sorted(s for s in systems if s != system and system_of_run(s) == system)


def given_once(paths: list[Path], what: str, given: list[Path] | None = None) -> None:
    """Refuse a list that names one directory twice (as given, or an adapt run and one of its
    artifacts): it would be scored, recorded and averaged twice. given: each path as the user
    named it (an adapt run for each of its artifacts), which the refusal names."""
    given = list(paths) if given is None else given
    seen: dict[Path, int] = {}

    def how(i: int) -> str:
        return str(paths[i]) if Path(given[i]) == Path(paths[i]) else f"{paths[i]} in the adapt run {given[i]}"

    for i, p in enumerate(paths):
        if Path(p).resolve() in seen:
            raise ValueError(f"the {what} {how(i)} is given twice (also as {how(seen[Path(p).resolve()])}): each "
                             "counts once, drop one")
        seen[Path(p).resolve()] = i


# --- an artifact in a model ----------------------------------------------------------------------------

def meta_digests(dirs: list[Path]) -> list[str]:
    """The sha256 of each artifact's meta.json as it is now: part of what a kept result was
    computed from (an artifact written anew under the same path has another)."""
    return [hashlib.sha256((Path(d) / "meta.json").read_bytes()).hexdigest() for d in dirs]


def swap_key(art: dict, keys, meta: dict | None, tokenizer: str | os.PathLike) -> str:
    """One sha256 of what a Step-4 score of an artifact depends on besides the model and the
    text: the tensors `keys` of `art` that the score swaps in (dtype, shape and every byte), how
    they go in (meta's vocab_mode and source_vocab_size: artifact_state) and the tokenizer file
    that reads the text. Two artifacts with one key score the same, so Step 4 scores the second
    from the first's result: an adapt run's start beside its update-0 artifact, and runs that
    start alike (MINIPOST's word embeddings at update 0 are BL_BASE's, MINIJOINT's are its
    ceiling's; their output biases differ, fitted through different bodies)."""
    h = hashlib.sha256(file_sha256(tokenizer).encode())
    h.update(json.dumps([(meta or {}).get("vocab_mode", "replace"), (meta or {}).get("source_vocab_size")]).encode())
    for key in sorted(keys):
        t = art[key].detach().cpu().contiguous()
        h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def artifact_state(family: ModelFamily, art: dict, meta: dict | None = None,
                   own: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """An artifact's tensors under the family's parameter names (those it holds). An expanded
    vocabulary's artifact (meta["vocab_mode"] "expand") put into a model whose own tensors are
    `own` (the primary model's, of the source vocabulary) keeps the model's own source rows and
    appends the artifact's new rows: the word embedding's source rows are the same either way
    (frozen in Step 2, and the primary's in every system), while a MINIJOINT encoder's output
    bias would otherwise bring its secondary head's source rows into the primary head."""
    out = {name: art[key] for key, name in family.artifact_keys().items() if key in art}
    if meta is None or meta.get("vocab_mode", "replace") != "expand":
        return out
    size = meta["source_vocab_size"]
    for name, t in out.items():
        if own[name].shape[0] != size:
            raise ValueError(f"the artifact expands a {size}-piece vocabulary, the model's {name} has "
                             f"{own[name].shape[0]} rows: it was trained for another model")
        out[name] = torch.cat([own[name].to(t.device, t.dtype), t[size:]])
    return out


def artifact_embeddings(artifact: dict, like: torch.Tensor) -> torch.Tensor:
    """An artifact's word embeddings [V_trg, h] for a model whose own are `like` [V, h]: checked
    for the model's width (V_trg may differ from V), in `like`'s dtype, on its device."""
    new = artifact["word_embeddings"]
    if new.shape[1] != like.shape[1]:
        raise ValueError(f"the embeddings have hidden size {new.shape[1]}, the model {like.shape[1]}: "
                         "they were trained for another model")
    return new.to(like.device, like.dtype)


def swap_tensors(family: ModelFamily, model: torch.nn.Module, art: dict, meta: dict | None) -> dict:
    """What Step 4's swap puts into `model` (devices.swapped takes it): the artifact's embeddings,
    checked for the model's width, and the head's other vocabulary-indexed parameters (the
    encoder's output bias), in the model's dtype, on its device. An expanded vocabulary's keep
    the model's own source rows (artifact_state)."""
    out = {family.word: artifact_embeddings(art, model.get_parameter(family.word))}
    params = dict(model.named_parameters())
    own = {name: params[name] for name in family.artifact_keys().values() if name in params}
    for name, t in artifact_state(family, art, meta, own).items():
        out[name] = t.to(own[name].device, own[name].dtype)
    return out


# --- the primary model an artifact belongs to ------------------------------------------------------------

def artifact_primary(meta: dict) -> Path:
    """The primary model that an artifact's embeddings belong to: the Step-2 source run, or for
    MINIPOST the run its mini-model was built from."""
    src = Path(meta["source"])
    if not (src / RUN_FILE).is_file():
        raise ValueError(f"the Step-2 artifact names its source run {src}, which holds no {RUN_FILE} now (moved or "
                         "deleted?): put that run back where it was, or train Step 2 again over it where it is")
    run = json.loads((src / RUN_FILE).read_text())
    return Path(run["frozen_from"]["run_dir"]) if run.get("step") == "minipost" else src


def artifact_primary_tag(meta: dict) -> str | None:
    """The checkpoint of artifact_primary(meta) that the embeddings were trained for: the Step-2
    source's (meta `source_tag`), or for MINIPOST the one its mini-model was built from. A later
    step that reads the primary model reads that one, not the run's newest (a source run trains on
    after its Step 2 read it, and `adapt --source_tag` picks an older one). None: an artifact from
    before tags were recorded."""
    src = Path(meta["source"])
    run = json.loads((src / RUN_FILE).read_text()) if (src / RUN_FILE).is_file() else {}
    if run.get("step") == "minipost":
        return run["frozen_from"].get("tag")
    return meta.get("source_tag")


def trained_for(run_dir: Path, metas) -> str | None:
    """The checkpoint of the run `run_dir` that the artifacts of meta.json `metas` were trained
    over (their Step-2 source's, meta `source_tag`) or for (their primary model's,
    artifact_primary_tag), where the run still holds it complete; refused where they name
    several. None: none names one that is there (the newest is read, and its weights checked
    against theirs)."""
    run_dir = Path(run_dir).resolve()

    def tag(meta: dict) -> str | None:
        if Path(meta["source"]).resolve() == run_dir:
            return meta.get("source_tag")
        return artifact_primary_tag(meta) if artifact_primary(meta).resolve() == run_dir else None
    tags = {tag(m) for m in metas} - {None}
    if len(tags) > 1:
        raise ValueError(f"the embeddings were trained for checkpoints {', '.join(sorted(tags))} of {run_dir}: score "
                         "those of each checkpoint apart")
    tag = next(iter(tags), None)
    return tag if tag in checkpoint.complete_tags(run_dir / "checkpoints") else None


def primary_changed(meta: dict, weights: dict[str, torch.Tensor]) -> bool:
    """Whether the primary model's `weights`, read now, differ from those Step 2 recorded in an
    artifact's `meta`: by their sampled fingerprint where it recorded one (run.sampled_fingerprint:
    the same cost at any size, which makes this check cheap enough for every load of the largest
    checkpoints), else (an artifact written before it) the full one; False where it recorded none."""
    if meta.get(SAMPLED_KEY):
        return sampled_fingerprint(weights) != meta[SAMPLED_KEY]
    return bool(meta.get("primary_fingerprint")) and weights_fingerprint(weights) != meta["primary_fingerprint"]


def same_primary(meta: dict, *, weights: dict[str, torch.Tensor] | None = None, recorded: str | None = None) -> bool:
    """Whether a model is, by content, the primary model an artifact (its meta.json `meta`) was
    trained for, at whatever path: its `weights` read now against the fingerprint Step 2 recorded
    (primary_changed), or a fine-tuning run's `recorded` fingerprint of them. A byte-identical copy
    of the run (another import of the same checkpoint) is the same model, as PrimaryRef.same has
    it for evaluate; False where neither side holds a fingerprint."""
    if recorded:
        return meta.get("primary_fingerprint") == recorded
    fingerprinted = bool(meta.get(SAMPLED_KEY) or meta.get("primary_fingerprint"))
    return weights is not None and fingerprinted and not primary_changed(meta, weights)


def check_primary_unchanged(path: Path, meta: dict, *, recorded: str | None = None,
                            weights: dict[str, torch.Tensor] | None = None) -> None:
    """Refuse an artifact (at `path`, its meta.json `meta`) swapped into its primary model whose
    weights changed since Step 2 recorded them: against another record of them (`recorded`: a
    fine-tuning run's of the full fingerprint; None, or an artifact without one: not checked), or
    against the `weights` read now (primary_changed)."""
    if weights is not None:
        changed = primary_changed(meta, weights)
    else:
        changed = bool(recorded and meta.get("primary_fingerprint") and recorded != meta["primary_fingerprint"])
    if changed:
        tag = artifact_primary_tag(meta)
        raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)} as its weights were "
                         f"when Step 2 ran{f' (its checkpoint {tag})' if tag else ''}, and they have changed since "
                         "(other weights under the same path): restore that checkpoint, or train Step 2 again over "
                         "the model as it is")


@dataclass(frozen=True)
class PrimaryRef:
    """A primary model as a record names it: its run directory and, in records written since
    fingerprints exist, its weights' fingerprint (run.weights_fingerprint)."""
    run_dir: Path
    fingerprint: str | None = None

    def same(self, other: "PrimaryRef") -> bool:
        """The same model: by content where both records hold a fingerprint (a byte-identical copy
        of a run is the same model), else (an older record) by the resolved path."""
        if self.fingerprint and other.fingerprint:
            return self.fingerprint == other.fingerprint
        return self.run_dir.resolve() == other.run_dir.resolve()


def artifact_primary_ref(meta: dict) -> PrimaryRef:
    return PrimaryRef(artifact_primary(meta), meta.get("primary_fingerprint"))


# --- how records name an artifact -----------------------------------------------------------------------

def system_label(meta: dict) -> str:
    """How an artifact's records name its system, in every Step-4 table and plot:
    `<recipe>:full` for a ceiling, full-model Step 2 over a source pretrained as another system
    (bl_base over a MINIJOINT run: `minijoint:full`, the embeddings the mini-model's are
    measured against); `minijoint@N` when its MINIJOINT source has several mini-models (meta
    `mini_depths`), so that curves of different depths stay apart; otherwise the system itself.
    A decoder's Step 2 that scored a fraction p < 1 of the positions (meta `score_fraction`) adds
    ` p=<p>` (SCORED_LABEL), so that its curves stay apart from full scoring's."""
    return _system_name(meta) + (f"{SCORED_LABEL}{meta['score_fraction']:g}" if "score_fraction" in meta else "")


def _system_name(meta: dict) -> str:
    if meta["system"] == "bl_base" and "source" in meta:
        recipe = json.loads((Path(meta["source"]) / RUN_FILE).read_text()).get("recipe")
        if recipe not in (None, "bl_base"):  # None: an imported Hugging Face model
            return f"{recipe}:full"
    if meta["system"] == "minijoint" and len(meta.get("mini_depths") or ()) > 1:
        return f"minijoint@{meta['mini_layers']}"
    return meta["system"]


def record_base(meta: dict, task: str) -> dict:
    """The fields every Step-4 record of an artifact starts with: which system and language, at
    which Step-2 update, for how much Step-2 compute."""
    return {"system": system_label(meta), "task": task, "lang": meta["lang"], "step": meta["step"],
            "flops": meta["flops"], "flops_paper": meta["flops_paper"], "v100_days": meta["v100_days"],
            "tokens": meta["tokens"]}
