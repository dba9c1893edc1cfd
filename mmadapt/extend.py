"""`mmadapt extend`: one command from a Hugging Face directory to the extended model in its own
format: import, fit-head where the source is headless, the mini-model, Step 2 on the user's
target corpus, export. Every stage is the library function of the command a user would run
(mmadapt.steps, hf.py), each run in its own directory under the output directory:

    <output_dir>/extend.json   what this extension is (its arguments): a later call must match it
                 summary.json  the summary printed at the end (a repeated call prints it again)
                 import/       import-hf's run
                 head/         fit-head's run (a headless encoder: a sentence-transformers body)
                 minipost/     Step 1b (--system minipost, the default: an imported model has no
                               MINIJOINT head)
                 data/         the target corpus prepared (its vocabulary, 3% held out), before
                               anything trains
                 adapt/        Step 2 over the mini-model (or the full model: --system bl_base)
                 export/       the extended model: a transformers directory (and, for a
                               sentence encoder, export/sentence_transformers/)
                 exports.json  what export/ and export-into/ were made from
                 sources.json  --model's and --into's files as their imports read them
                               (hf.model_dir_files: each one's SHA-256): --model saved again is
                               refused, --into saved again is imported again
                 graft.json    the graft's scores (kept like the summary)
                 sibling/      with --into: import-hf's run of a model fine-tuned from --model
                               (another --into on a later call replaces it once it passes the check)
                 export-into/  the embeddings grafted into it (export-hf --graft, graft.py)

A stage that finished is kept; one that was interrupted resumes from its checkpoint; a repeated
call trains nothing and prints the same result. The source-language text of the head fit and of
Step 1b is --source_corpus (default: the packaged English Bible).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

from mmadapt import checkpoint, faults, parallel, steps
from mmadapt.adapt import check_output_start, final_artifact_written
from mmadapt.artifact import artifact_dirs, meta_digests, read_artifact
from mmadapt.bpb import BPB_BYTES, MIN_BPB_BYTES, SCORING, ByteScorer, fold_caveat
from mmadapt.config import (MIN_VOCAB_SIZE, TINY_CAPS, TINY_ENV, TINY_FLAGS, MiniModelConfig, PreprocessConfig,
                            TrainConfig, _f, check_declared, check_lang, given, output_inside_an_input)
from mmadapt.corpora import check_bible_lang, resolve_corpus
from mmadapt.data import (MANIFEST, UNKNOWN_REFUSE, DataError, NothingHeldOut, check_corpus, corpus_fingerprint,
                          follows_byte_fallback, read_manifest, sample_unknown_share)
from mmadapt.graft import SiblingCheck, check_siblings
from mmadapt.hf_classifier import is_classifier
from mmadapt.heldout import Primary, Scorer
from mmadapt.hf import (TRANSFORMERS, OtherVocabulary, export_hf, files_differ, files_digest, import_any,
                        config_json, import_kind, model_dir_files, read_hf_config, sentence_transformers_body)
from mmadapt.run import RUN_TOKENIZER, RunSpec, read_source, run_progress, run_text_layout
from mmadapt.train import lm_batches

RECORD = "extend.json"
SUMMARY = "summary.json"  # the summary a finished extension printed (_summary)
# where the summary's text names the export, on a line of its own (named anew on each call; a text
# kept before 2026-12-05 ended its last sentence with it)
EXPORTED, EXPORTED_BEFORE = "\nExtended model: ", " Extended model: "
EXPORTS = "exports.json"  # what each export was made from (_export_once): one made from anything else is made again
SOURCES = "sources.json"  # the content of --model and of --into as each import read them (_imported)
GRAFT = "graft.json"  # the graft's scores and what they were computed from (_graft)
REPORT_ONLY = ("bpb_bytes", "into")  # Extend fields that size the summary, not the extension: a later call may change them
# Not compared with the record either: the record lives in output_dir, however its path is spelled
NOT_IDENTITY = (*REPORT_ONLY, "output_dir")
HELD_OUT = 0.03  # of the target corpus's documents: Step 2's held-out scores and the summary's
SYSTEMS = ("minipost", "bl_base")  # what an imported model offers: no MINIJOINT head, no BL_SMALL run


@dataclasses.dataclass
class Extend:
    """The extension of `model` (a Hugging Face or sentence-transformers directory) to `lang` on
    `corpus` (a text file or bible:<lang>), into `output_dir`. The schedules are the steps' own
    (TrainConfig fields), sized for a CPU by default."""
    model: Path
    lang: str
    corpus: str | Path  # a text file or bible:<lang>
    output_dir: Path
    vocab_mode: str = "replace"
    # FVT's start (the mean of each new piece's split under the source tokenizer): over
    # all-MiniLM-L6-v2, German, 600 updates, 0.41 nats under the target unigram reference against
    # overlap's 0.21 (benchmarks/results/real_weights_cpu2_20261127.md)
    embedding_init: str = "subword_mean"
    # --vocab_mode expand: how the new pieces start on the output side (adapt --expand_output_start)
    expand_output_start: str = TrainConfig.expand_output_start
    vocab_size: int = _f(16_000, "the target vocabulary's pieces", flag=False, ge=MIN_VOCAB_SIZE)
    # lines sampled to train the target vocabulary (preprocess --tokenizer_sample_lines): no flag of
    # extend's; MMADAPT_TINY=1 caps it as it caps preprocess's (the command line's `override`)
    tokenizer_sample_lines: int = _f(PreprocessConfig.tokenizer_sample_lines, "lines sampled to train the target "
                                     "vocabulary", flag=False, ge=1)
    system: str = "minipost"
    source_corpus: str | Path = "bible:en"
    seq_length: int = _f(64, "pieces per block in every stage", flag=False, ge=8)
    batch: int = _f(32, "blocks per update in every stage", flag=False, ge=1)
    lr: float = 1e-3
    head_iters: int = _f(200, "fit-head's updates", flag=False, ge=1)
    minipost_iters: int = _f(500, "Step 1b's updates", flag=False, ge=1)
    adapt_iters: int = _f(600, "Step 2's updates", flag=False, ge=1)
    # held-out target blocks each Step-2 checkpoint is scored on through the primary model (adapt
    # --plugin_eval_blocks): the progress line and the summary's plug-in loss
    plugin_eval_blocks: int = _f(256, "held-out target blocks per Step-2 checkpoint", flag=False, ge=1)
    bpb_bytes: int = BPB_BYTES  # held-out target bytes the summary scores in bits per byte: not the extension's identity
    into: Optional[Path] = None  # a fine-tuned sibling of `model` (a Hugging Face directory) to graft the embeddings into

    def __post_init__(self):
        """Every argument checked here, before anything is written: a mistake found by a stage
        would come after the stages before it had trained and left their runs."""
        # the declared types and ranges (the command line's), first: Path(None) was a TypeError, and a
        # plugin_eval_blocks 0 failed at the summary
        check_declared(self)
        self.model, self.output_dir = Path(self.model).resolve(), Path(self.output_dir)
        self.into = None if self.into is None else Path(self.into).resolve()
        # recorded as absolute paths: the same extension continued from another directory, or
        # with another spelling of its corpus, is the same extension
        self.corpus, self.source_corpus = _corpus_spec(self.corpus), _corpus_spec(self.source_corpus)
        if self.system not in SYSTEMS:
            raise ValueError(f"--system {self.system}: extend adapts an imported model over {' or '.join(SYSTEMS)}")
        check_lang(self.lang)
        check_bible_lang(self.corpus, self.lang)
        if self.bpb_bytes < MIN_BPB_BYTES:
            raise ValueError(f"bpb_bytes {self.bpb_bytes}: the summary scores at least {MIN_BPB_BYTES} held-out bytes")
        for iters in (self.head_iters, self.minipost_iters):
            self.schedule(iters)  # each stage's TrainConfig checks its fields as it is made
        self.step2_schedule()
        for corpus in (self.corpus, self.source_corpus):
            check_corpus(resolve_corpus(corpus))
        inside = output_inside_an_input(self.output_dir, {"model": self.model, "into": self.into})
        if inside:  # the command line refuses it as it parses; the Python API here
            raise ValueError(inside)
        if self.into == self.model:
            raise ValueError(f"--into {self.into} is --model itself: its extension is <output_dir>/export; drop --into "
                             "(it takes a model fine-tuned from --model)")
        for flag, d in (("--model", self.model), ("--into", self.into)):
            if d is not None and not ((d / "config.json").is_file() or (d / "modules.json").is_file()):
                raise ValueError(f"{flag} {d} is not a Hugging Face or sentence-transformers model directory (no "
                                 "config.json or modules.json): pass the directory save_pretrained wrote")
            if d is not None and is_classifier(d):
                # the extension's final artifact: this one's (--into) or the extension of the base (--model)
                adapt = self.run_dir("adapt") if flag == "--into" else Path("<the extension of its base>/adapt")
                final = adapt / "embeddings" / checkpoint.tag_for(self.adapt_iters)
                raise ValueError(f"{flag} {d} is a sequence classifier: extend takes language models; graft the "
                                 "extension's embeddings into a classifier with `mmadapt import-hf --model "
                                 f"{d} --task <task> --output_dir <run>` and `mmadapt export-hf --finetuned <run> "
                                 f"--graft --embeddings {final} --output_dir <dir>` (docs/huggingface.md)")
        headless = _headless_encoder(self.into) if self.into is not None else None
        if headless:  # (found only by the graft's check, after both imports, as "another architecture")
            raise ValueError(f"--into {self.into} is a headless encoder ({headless}): extend grafts the embeddings "
                             "into a language model fine-tuned from --model; a headless model is extended as --model "
                             "itself: drop --into")

    def run_dir(self, stage: str) -> Path:
        return self.output_dir / stage

    def schedule(self, iters: int, **changes) -> TrainConfig:
        return TrainConfig(seq_length=self.seq_length, train_iters=iters, save_interval=iters, lr=self.lr,
                           train_micro_batch_size_per_gpu=self.batch, lr_warmup_iters=iters // 10,
                           log_interval=max(1, iters // 10), **changes)

    def step2_schedule(self) -> TrainConfig:
        return self.schedule(self.adapt_iters, vocab_mode=self.vocab_mode, embedding_init=self.embedding_init,
                             expand_output_start=self.expand_output_start, plugin_eval_blocks=self.plugin_eval_blocks)


def _headless_encoder(model_dir: Path) -> str | None:
    """What makes `model_dir` a headless encoder (a sentence-transformers directory, a body class
    such as BertModel), or None (a config the import refuses is left to it; so is one without
    architectures, whose class the import reads off the weights: no weights are read here, where
    every call, a continued one too, makes this check). A sentence-transformers directory whose
    modules.json or transformer the import refuses is refused here in its words, before anything
    is written (its transformer a decoder's LM, its modules.json empty)."""
    if (model_dir / "modules.json").is_file():
        sentence_transformers_body(model_dir)
        return "a sentence-transformers directory"
    try:
        if not config_json(model_dir).get("architectures"):
            return None
        hf_cfg, family = read_hf_config(model_dir)
    except (OSError, ValueError):
        return None
    return f"a {hf_cfg['architectures'][0]}" if family.hf.is_headless(hf_cfg) else None


def _corpus_spec(spec: str) -> str:
    """A corpus argument as recorded: bible:<lang> as given, a file as its absolute path."""
    spec = str(spec)
    return spec if spec.startswith("bible:") else str(Path(spec).resolve())


def claim(ext: Extend, tiny: bool = False) -> bool:
    """The output directory is this extension's: new or empty (its record is written: -> True), or
    holding the record of the same extension (continued: -> False). Anything else is refused in
    one line, nothing written. tiny: whether MMADAPT_TINY=1 capped `ext`'s sizes (the command
    line's; a Python call's are as given, whatever the environment), recorded too: a call without
    it (or with it, on one made without) was refused naming a capped size the user never gave
    (head_iters 8, not 200)."""
    def as_recorded(fields: dict) -> dict:  # as extend.json holds them (paths as text)
        return json.loads(json.dumps(fields, default=str))

    out, mine = ext.output_dir, {**as_recorded(dataclasses.asdict(ext)), "tiny": tiny}
    checkpoint.check_output_dir(out)  # a file on its way: refused here, not by the first write
    record = out / RECORD
    if record.is_file():
        theirs = checkpoint.read_json(record, "extend record")
        # a field the record predates was its default then, compared as recorded
        defaults = as_recorded({f.name: f.default for f in dataclasses.fields(ext)
                                if f.default is not dataclasses.MISSING})
        recorded = {k: theirs.get(k, defaults.get(k)) for k in mine if k != "tiny"}
        # but tokenizer_sample_lines, in a record from before it was one, is not compared: under
        # MMADAPT_TINY=1 that call sampled 2,000,000 lines, where the same command now caps them
        if "tokenizer_sample_lines" not in theirs:
            recorded["tokenizer_sample_lines"] = mine["tokenizer_sample_lines"]
        for k in ("corpus", "source_corpus"):  # a record from before they were resolved holds them as typed
            if isinstance(recorded[k], str):
                recorded[k] = _corpus_spec(recorded[k])
        changed = sorted(k for k in recorded if k not in NOT_IDENTITY and recorded[k] != mine[k])
        if changed:
            made, name = theirs.get("tiny"), changed[0]
            # Where MMADAPT_TINY was set otherwise: its setting is the news if only sizes it caps
            # differ; else the first field it does not cap (the one the user changed)
            if made is not None and made != tiny:
                own = [k for k in changed if k not in TINY_FLAGS and k not in TINY_CAPS]
                if not own:
                    way = "with" if made else "without"
                    raise ValueError(f"{out} holds an extension made {way} {TINY_ENV}=1 ({name} {recorded[name]!r} "
                                     f"there, {mine[name]!r} here): continue it {way} {TINY_ENV}=1 and the same "
                                     "arguments, or choose a new --output_dir")
                name = own[0]
            raise ValueError(f"{out} holds the extension of {theirs.get('model')} with {name} "
                             f"{recorded[name]!r}, not {mine[name]!r}: continue it with the same "
                             "arguments, or choose a new --output_dir")
        for kept in (SOURCES, EXPORTS, GRAFT, SUMMARY):  # a write a kill cut short left its temporary, never read
            checkpoint.remove_dead_writes(out / kept)
        return False
    if out.is_dir():  # a claim killed while it wrote its record left atomic_write's temporary alone
        checkpoint.remove_dead_writes(record)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an extend directory (no {RECORD}): choose a new "
                         "--output_dir (nothing is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write(record, json.dumps(mine, indent=2))
    return True


@faults.resumes_itself
def extend(ext: Extend, tiny: bool = False) -> dict:
    """The extension (module docstring). -> its summary: the plug-in loss of the new embeddings at
    the start and at the end beside the target unigram reference, and the export's directories.
    tiny: `ext`'s sizes are MMADAPT_TINY=1's caps (the command line's, `claim`)."""
    if not isinstance(ext, Extend):  # its fields are checked when it is made
        raise ValueError(f"ext takes an Extend, got {type(ext).__name__}")
    # every rank would claim, import, prepare and export into the same directories
    parallel.check_one_process("mmadapt extend", "run it as `mmadapt extend`, not under deepspeed, torchrun or "
                               "srun; for several GPUs launch its steps (docs/huggingface.md, from xlm-roberta-base "
                               "to XNLI)")
    if ext.system != "minipost" and _given(ext, "minipost_iters", tiny):  # known before the import, unlike fit-head's
        raise ValueError(f"--minipost_iters {ext.minipost_iters} is for Step 1b, which --system {ext.system} "
                         "does not run: drop it")
    made = checkpoint.missing_dirs(ext.output_dir)
    fresh = claim(ext, tiny)
    say = _stage_printer()
    try:
        imported, sibling, files = _imported(ext, say)
        _check_stages_take(ext, imported, tiny)
        _check_source_corpus(ext, imported)
        # The target corpus before any training: a corpus too small for the vocabulary, or for
        # a held-out part, is refused while the call has trained nothing (and a fresh one left nothing)
        data = _prepared(ext, imported, say)
        _check_blocks(ext, imported, data)
    except BaseException:
        if fresh:  # refused or stopped before anything trained: the extension it began is none, so nothing is left
            for stage in ("import", "sibling", "data"):
                shutil.rmtree(ext.run_dir(stage), ignore_errors=True)
            (ext.output_dir / SOURCES).unlink(missing_ok=True)
            (ext.output_dir / RECORD).unlink()
            checkpoint.remove_empty_dirs(made)
        raise
    source = imported
    if read_source(imported).headless:
        source = ext.run_dir("head")
        say("fit an MLM head over the imported body on the source-language text")
        _train(source, ext.head_iters, lambda run: steps.fit_head(run=run, step=steps.FitHead(
            primary=imported, train=ext.schedule(ext.head_iters))), corpus=ext.source_corpus)
    over = source
    if ext.system == "minipost":
        over = ext.run_dir("minipost")
        say("Step 1b: the mini-model (the bottom layers + 2 new ones, trained on the source-language text)")
        layers = read_source(source).cfg.num_layers
        mini = MiniModelConfig(max(1, layers // 3), 2)
        _train(over, ext.minipost_iters, lambda run: steps.build_minipost(run=run, step=steps.BuildMinipost(
            primary=source, train=ext.schedule(ext.minipost_iters), mini=mini)), corpus=ext.source_corpus)
    adapt = ext.run_dir("adapt")
    say(f"Step 2: the {ext.lang} embeddings over {'the mini-model' if over != source else 'the full model'}")
    train = ext.step2_schedule()
    _train(adapt, ext.adapt_iters, lambda run: steps.adapt_embeddings(run=run, step=steps.AdaptEmbeddings(
        system=ext.system, source=over, lang=ext.lang, train=train)), data_path=data,
        complete=lambda: final_artifact_written(adapt, ext.adapt_iters))
    final = artifact_dirs([adapt])[-1]
    export = ext.run_dir("export")
    # a SIGTERM from here on (an export, the summary's scoring: minutes on a real model): Stopped
    # (75) as in a training loop, not 143 and no word; the same command again does what is left
    with faults.stopped_after_checkpoint(ext.adapt_iters, final.name):
        _export_once(ext, export, primary=source, embeddings=final, files=files["model"], say=say)
        summary = _summary(ext, source, adapt, data, export)
        if sibling is not None:
            summary.update(_graft(ext, sibling, final, data, files["into"]))
    return summary


def _imported(ext: Extend, say) -> tuple[Path, Path | None, dict]:
    """The imports (the model, and the sibling of --into, checked to be one: graft.check_siblings)
    and every stage's schedule checked against the imported model (its positions), before
    anything trains. The model directories' files are recorded (SOURCES, hf.model_dir_files):
    --model changed since the extension read it is refused (the extension trained over it as it
    was); an --into changed since, or with no record, is imported again like another --into. ->
    (the import's run, the sibling's run or None, the directories' digests: {"model": ...,
    "into": ... or None})."""
    imported = ext.run_dir("import")
    recorded = checkpoint.read_json(ext.output_dir / SOURCES, "extend sources") if (
        ext.output_dir / SOURCES).is_file() else {}
    known = _entry(recorded, "model")
    files = model_dir_files(ext.model, known.get("files"))
    sources = {**recorded, "model": {"files": files}}
    digests = {"model": files_digest(files), "into": None}
    if known and files_digest(known["files"]) != digests["model"]:  # (an extension from before SOURCES: taken)
        what = files_differ(known["files"], files)
        raise ValueError(f"--model {ext.model} changed since this extension read it ({what}): its runs trained over "
                         "the model as it was; restore it, or choose a new --output_dir to extend it as it is now")
    # recorded before the import: an import/ with no record is an extension's from before SOURCES
    recorded = _record_sources(ext, recorded, sources)
    if not (imported / "run.json").is_file():
        say(f"import {ext.model}")
        import_any(ext.model, imported)  # writes nothing unless the import succeeds
    model = read_source(imported)
    for train in (ext.schedule(ext.head_iters), ext.schedule(ext.minipost_iters), ext.step2_schedule()):
        train.validate(model.cfg)
    # Step 2's start refused for this model (a tied decoder's subword_mean under expand) before the
    # stages ahead of it train: refused there, the extension could not be continued with other flags
    check_output_start(model.family, ext.step2_schedule(), model.cfg)
    if ext.system == "minipost" and model.cfg.num_layers < 2:  # Step 1b keeps max(1, layers // 3) of them
        raise ValueError(f"{ext.model} has one layer: too few for a mini-model below it (Step 1b keeps its bottom "
                         "layers); pass --system bl_base")
    if ext.into is None:
        return imported, None, digests
    if model.headless:
        raise ValueError(f"--into grafts the embeddings into a language model; {ext.model} is a headless encoder, "
                         "whose extension gets an MLM head its sibling lacks: drop --into")
    sibling = ext.run_dir("sibling")
    known = _entry(recorded, "into")
    known = known if known.get("model") == str(ext.into) else {}  # (another directory's times tell nothing)
    files = model_dir_files(ext.into, known.get("files"))
    sources["into"], digests["into"] = {"model": str(ext.into), "files": files}, files_digest(files)
    same_path = _imported_from(sibling) == str(ext.into)
    if same_path and known and files_digest(known["files"]) == digests["into"]:
        check = _a_sibling_not_a_copy(ext, check_siblings(model, read_source(sibling), {"vocab_mode": ext.vocab_mode}))
    else:  # first asked for, another --into than the last call's, or its files changed (or unrecorded): imported
        # and checked aside
        why = "its files changed since it was imported" if known else "no record of the files it was imported from"
        say(f"import the sibling {ext.into}" + (f" again ({why})" if same_path else ""))
        staged = ext.run_dir("sibling.new")
        shutil.rmtree(staged, ignore_errors=True)
        try:
            # with the base's special roles (an instruct sibling's eos is another token than its
            # base's: graft.other_roles), imported once; a model of another vocabulary on its own,
            # for check_siblings to name what differs
            try:
                import_any(ext.into, staged, roles_from=imported if import_kind(ext.into) == TRANSFORMERS else None)
            except OtherVocabulary:
                import_any(ext.into, staged)
            check = _a_sibling_not_a_copy(ext, check_siblings(model, read_source(staged),
                                                              {"vocab_mode": ext.vocab_mode}))
        except BaseException as e:  # the sibling grafted before, if any, stays as it was
            shutil.rmtree(staged, ignore_errors=True)
            if isinstance(e, ValueError):  # named as the user named them, not as the runs made of them here
                said = str(e)
                for run, flag in ((staged, f"--into {ext.into}"), (imported, f"--model {ext.model}")):
                    said = said.replace(str(run.resolve()), flag).replace(str(run), flag)  # as read_source names it
                raise ValueError(said) from None
            raise
        if sibling.exists():  # the graft into the last --into gives way to this one's
            said = "the one as it is now" if same_path else f"one into {ext.into}"
            say(f"replace the graft into {_imported_from(sibling)} (export-into/) with {said}")
            shutil.rmtree(sibling)
        staged.rename(sibling)
    _record_sources(ext, recorded, sources)
    if parallel.is_rank0():  # the distances, and a sibling that moved too far, said before anything trains
        print("\n".join(check.lines()), flush=True)
    return imported, sibling, digests


def _a_sibling_not_a_copy(ext: Extend, check: SiblingCheck) -> SiblingCheck:
    """`check`, where the sibling's weights are not the base's; refused where they are (--into a
    copy of --model: the same model in another directory, a cache's snapshot), as --into naming
    --model itself is. They are judged as the graft at the end judges them (export_hf: by the
    sampled fingerprint), which refused them after Step 2 had trained, in words about a --graft
    the user never gave."""
    if check.same_weights:
        raise ValueError(f"--into {ext.into} holds the same weights as --model {ext.model} (a copy of it): its "
                         "extension is <output_dir>/export; drop --into (it takes a model fine-tuned from --model)")
    return check


def _entry(recorded: dict, name: str) -> dict:
    """SOURCES' record of one model directory, {} where there is none it can read."""
    entry = recorded.get(name)
    return entry if isinstance(entry, dict) and isinstance(entry.get("files"), dict) else {}


def _record_sources(ext: Extend, recorded: dict, sources: dict) -> dict:
    """SOURCES written as `sources` where it was `recorded` otherwise. -> what it holds now."""
    if sources != recorded and parallel.is_rank0():
        checkpoint.atomic_write(ext.output_dir / SOURCES, json.dumps(sources, indent=2))
    return dict(sources)


def _imported_from(run: Path) -> str | None:
    """The model directory an import-hf run was read from (its run.json), None where there is none."""
    if not (run / "run.json").is_file():
        return None
    imported = checkpoint.read_json(run / "run.json", "imported run").get("imported_from") or {}
    st = imported.get("sentence_transformers")
    return (st or {}).get("model") or imported.get("model")


def _given(ext: Extend, name: str, tiny: bool) -> bool:
    """Whether field `name` was given: it is not its default (nor, where `tiny`, the command
    line's MMADAPT_TINY=1 cap of it, 8 updates; a Python call's sizes are as given, whatever the
    environment: claim)."""
    default = Extend.__dataclass_fields__[name].default
    return given(name, getattr(ext, name), default, tiny)


def _check_stages_take(ext: Extend, imported: Path, tiny: bool) -> None:
    """A flag of a stage this extension does not run (fit-head over a model with its own head;
    Step 1b's under --system bl_base: extend refuses it before the import) is refused: it trained
    nothing, yet, recorded, it made the same extension without it another one (claim)."""
    headless, minipost = read_source(imported).headless, ext.system == "minipost"
    why = {"head_iters": None if headless else f"fit-head, which {ext.model} needs not (it has its own MLM head)",
           "source_corpus": None if minipost or headless else
           f"fit-head and Step 1b, neither of which runs here (--system {ext.system}; {ext.model} has its MLM head)"}
    for name, reason in why.items():
        if reason is not None and _given(ext, name, tiny):
            raise ValueError(f"--{name} {getattr(ext, name)} is for {reason}: drop it")


def _check_source_corpus(ext: Extend, imported: Path) -> None:
    """--source_corpus, where a stage trains on it (fit-head over a headless body, Step 1b), read by
    the imported model's tokenizer before anything trains: a text of a script it does not cover
    (mostly <unk>) was refused only when that stage prepared it, after this extension's record
    named it, and a corrected call was then refused as another extension's. A sample of its first
    lines (the stage's preparation still checks the whole)."""
    if not (ext.system == "minipost" or read_source(imported).headless):
        return
    corpus, tokenizer = resolve_corpus(ext.source_corpus), imported / RUN_TOKENIZER
    share = sample_unknown_share(corpus, tokenizer)
    if share > UNKNOWN_REFUSE:
        raise DataError(f"--source_corpus {ext.source_corpus}: {share:.0%} of the pieces of its first lines are "
                        f"unknown to {ext.model}'s tokenizer (<unk>); fit-head and Step 1b train on it in the model's "
                        "own language: pass --source_corpus text in that language")


def _prepared(ext: Extend, imported: Path, say) -> Path:
    """The target corpus prepared (its vocabulary, HELD_OUT of its documents held out) -> its
    dataset. An expanded vocabulary extends the import's (every later stage keeps its tokenizer)."""
    data = ext.run_dir("data")
    if (data / MANIFEST).is_file():  # prepared by an earlier call: from this corpus as it is now, or refused
        if read_manifest(data)["corpus_fingerprint"] != corpus_fingerprint(resolve_corpus(ext.corpus)):
            raise DataError(f"corpus {ext.corpus} changed since this extension prepared it (in {data}): its runs "
                            "trained on the text as it was; choose a new --output_dir to extend on the new text")
    else:
        say(f"prepare the {ext.lang} corpus ({ext.vocab_mode} vocabulary)")
        prep = PreprocessConfig(workers=1, valid_fraction=HELD_OUT, tokenizer_sample_lines=ext.tokenizer_sample_lines,
                                byte_fallback=follows_byte_fallback(data, imported / RUN_TOKENIZER, ext.vocab_mode))
        try:
            steps.preprocess(ext.corpus, output_dir=data, vocab_size=ext.vocab_size, cfg=prep,
                             expand_from=imported if ext.vocab_mode == "expand" else None)
        except NothingHeldOut as e:
            raise DataError(f"corpus {ext.corpus}: extend holds out {HELD_OUT:.0%} of its documents for the held-out "
                            f"scores, and none of its {e.documents:,} fell there (a document ends at a blank line): "
                            "give it more documents, a blank line after every few hundred sentences") from None
    return data


def _check_blocks(ext: Extend, imported: Path, data: Path) -> None:
    """Step 2's training blocks of --seq_length, cut as Step 2 cuts them, before anything trains:
    a decoder's are whole windows of the target text (an encoder packs at least one from any text),
    and a text too short for one was refused only when Step 2 started, after the stages ahead of it
    trained, when a lower --seq_length or more text had become another extension's. (Lays out the
    imported tokenizer's stream Step 2 then reads, as it would.)"""
    source = read_source(imported)
    if not source.family.objective.masked:
        lm_batches(source.family, data, source.cfg, ext.step2_schedule(), layout=run_text_layout(source.record))


def _graft(ext: Extend, sibling: Path, final: Path, data: Path, files: str) -> dict:
    """The embeddings grafted into the sibling (export-hf --graft) and scored through it in bits
    per byte beside the sibling with no adaptation: computed once for the artifact, the sibling's
    files (`files`) and --bpb_bytes, and kept in GRAFT (as the summary is)."""
    out = ext.run_dir("export-into")
    _export_once(ext, out, primary=sibling, embeddings=final, files=files, graft=True)
    key = {"artifact": meta_digests([final]), "files": files, "bpb_bytes": ext.bpb_bytes, "scoring": SCORING}
    kept = checkpoint.kept_result(ext.output_dir / GRAFT, key, "extend graft scores")
    if kept is not None:
        scores = {k: v for k, v in kept.items() if k != "key"}
    else:  # (a score kept by other rules, SCORING: scored again)
        per_byte = ByteScorer(Scorer(Primary.read(sibling)), ext.seq_length, ext.bpb_bytes)
        raw = per_byte.text(data)
        emb, tok, meta = read_artifact(final)
        scores = {"graft_bpb": per_byte.score(raw, tok, emb, meta)["bpb"],
                  "graft_no_adaptation_bpb": per_byte.none(raw), "graft_bpb_folds": per_byte.folds(tok, raw),
                  "graft_no_adaptation_bpb_folds": per_byte.folds(per_byte.own_tokenizer, raw)}
        if parallel.is_rank0():
            checkpoint.atomic_write(ext.output_dir / GRAFT, json.dumps({"key": key, **scores}, indent=2))
    print(f"Grafted into {ext.into}: {ext.lang} at {scores['graft_bpb']:.3f} bits per byte through it, "
          f"{scores['graft_no_adaptation_bpb']:.3f} with no adaptation (its own tokenizer and embeddings)."
          + _caveats("its own tokenizer", scores["graft_no_adaptation_bpb_folds"], scores["graft_bpb_folds"])
          + f" Grafted model: {out}", flush=True)
    return {"graft": str(out), **scores}


def _export_once(ext: Extend, out: Path, primary: Path, embeddings: Path, files: str, say=None, **kw) -> None:
    """export_hf into `out` unless it holds this very export: made from the artifact `embeddings`
    as it is now over the run `primary` as it was imported from a model directory with `files`
    (hf.files_digest) (kept in EXPORTS). An export cut short, or one from a Step 2 run
    again or another sibling (or the same one saved again), is written again whole."""
    record = ext.output_dir / EXPORTS
    made = checkpoint.read_json(record, "extend exports") if record.is_file() else {}
    key = {"embeddings": meta_digests([embeddings]), "primary": str(primary.relative_to(ext.output_dir)),
           "imported_from": _imported_from(primary), "files": files, **{k: str(v) for k, v in kw.items()}}
    if (out / "config.json").is_file() and made.get(out.name) == key:
        return
    if say is not None:
        say("export the extended model")
    # Written beside the last export, which it replaces only once whole: an export refused (a
    # moved extension whose artifact names its primary where it was) leaves the last one as it was
    staged = out.with_name(out.name + ".new")
    if staged.exists():
        shutil.rmtree(staged)
    export_hf(staged, primary=primary, embeddings=embeddings, **kw)
    if out.exists():
        shutil.rmtree(out)
    staged.rename(out)
    if parallel.is_rank0():
        checkpoint.atomic_write(record, json.dumps({**made, out.name: key}, indent=2))


def _train(run_dir: Path, iters: int, step, corpus: str | None = None, data_path: Path | None = None,
           complete=lambda: True) -> None:
    """A training stage into run_dir: kept if done (and `complete()`: what its last checkpoint
    leads to is written too), resumed if interrupted or not complete, else run."""
    state = run_progress(run_dir, iters)
    if state == "done" and complete():
        if parallel.is_rank0():
            print(f"  done already: {run_dir} (kept)", flush=True)
        return
    step(RunSpec(output_dir=run_dir, corpus=corpus, data_path=data_path, resume=state != "new"))


def _stage_printer():
    counter = iter(range(1, 100))

    def say(what: str) -> None:
        if parallel.is_rank0():
            print(f"\n[extend {next(counter)}] {what}", flush=True)
    return say


def _summary(ext: Extend, source: Path, adapt: Path, data: Path, export: Path) -> dict:
    """The plug-in loss (held-out target text, through the primary model) of the new embeddings at
    update 0 and at the end against the target unigram reference, and the same text in bits per
    byte (bpb.py: one scale for every tokenizer) at update 0, at the end and with no adaptation
    (the source model with its own tokenizer and embeddings). Computed once and kept in
    <output_dir>/summary.json with what it was computed from: a repeated call prints it again
    (scoring every held-out piece three times costs more than the rest of a small extension);
    another --bpb_bytes computes it anew."""
    arts = artifact_dirs([adapt])
    # what the summary is computed from: the artifacts as they are now (a Step 2 deleted and run
    # again writes them anew), the bytes scored and the rules scoring them
    key = {"artifacts": meta_digests([arts[0], arts[-1]]), "artifact": str(arts[-1].relative_to(ext.output_dir)),
           "bpb_bytes": ext.bpb_bytes, "scoring": SCORING}  # the artifact as named inside the output directory
    kept = ext.output_dir / SUMMARY
    if (old := checkpoint.kept_result(kept, key, "extend summary")) is not None:
        # the scores as kept; the export named as this call's (a copied or moved directory's own)
        print(old["text"].split(EXPORTED)[0].split(EXPORTED_BEFORE)[0] + f"{EXPORTED}{export}", flush=True)
        return _exports_named(old["summary"], export)
    (start_emb, start_tok, first), (emb, tok, last) = read_artifact(arts[0]), read_artifact(arts[-1])
    per_byte = ByteScorer(Scorer(Primary.read(source)), ext.seq_length, ext.bpb_bytes)
    raw = per_byte.text(data)
    summary = {"lang": ext.lang, "start_loss": first["plugin_loss"], "final_loss": last["plugin_loss"],
               "unigram_loss": last["unigram_loss"], "step": last["step"], "flops": last["flops"],
               "start_bpb": per_byte.score(raw, start_tok, start_emb, first)["bpb"],
               "final_bpb": per_byte.score(raw, tok, emb, last)["bpb"], "no_adaptation_bpb": per_byte.none(raw),
               "bpb_bytes": raw.bytes, "bpb_folds": per_byte.folds(tok, raw),
               "no_adaptation_bpb_folds": per_byte.folds(per_byte.own_tokenizer, raw)}
    summary = _exports_named(summary, export)
    gain = summary["no_adaptation_bpb"] - summary["final_bpb"]
    text = (f"{ext.lang} through the primary model (plug-in loss, held-out text): {summary['start_loss']:.3f} at the "
          f"start, {summary['final_loss']:.3f} after {last['step']} updates, unigram reference "
          f"{summary['unigram_loss']:.3f} ({summary['unigram_loss'] - summary['final_loss']:+.3f} past it).\n"
          f"In bits per byte of the same {raw.bytes:,} held-out bytes (every tokenizer on one scale): "
          f"{summary['start_bpb']:.3f} at the start, {summary['final_bpb']:.3f} at the end, "
          f"{summary['no_adaptation_bpb']:.3f} with no adaptation (the source's own tokenizer and embeddings): "
          + (f"the extended model reads {ext.lang} better by {gain:.3f} bits per byte." if gain > 0 else
             f"the extended model does not read {ext.lang} better than the source model yet ({-gain:.3f} bits per byte "
             "behind): train Step 2 longer (a larger --adapt_iters, into a new --output_dir).")
          + _caveats("the source's own tokenizer", summary["no_adaptation_bpb_folds"], summary["bpb_folds"])
          + f"{EXPORTED}{export}")
    print(text, flush=True)
    if parallel.is_rank0():
        checkpoint.atomic_write(kept, json.dumps({"key": key, "summary": summary, "text": text}, indent=2))
    return summary


def _caveats(none_side: str, none_folds: list[str], folds: list[str]) -> str:
    """bpb.fold_caveat both ways, each on a line of its own: what the no-adaptation tokenizer
    (`none_side`) and the extension's fold that the other keeps (an uncased source, all-MiniLM-
    L6-v2's, reads lower than a cased target tokenizer would: docs/bits-per-byte.md)."""
    lines = [fold_caveat(none_side, none_folds, folds), fold_caveat("the extension's tokenizer", folds, none_folds)]
    return "".join(f"\n{line}" for line in lines if line)


def _exports_named(summary: dict, export: Path) -> dict:
    """`summary` naming the export directory `export` (and its sentence-transformers one, if made)."""
    named = {k: v for k, v in summary.items() if k != "sentence_transformers"}
    named["export"] = str(export)
    if (export / "sentence_transformers").is_dir():
        named["sentence_transformers"] = str(export / "sentence_transformers")
    return named


__all__ = ["Extend", "extend"]
