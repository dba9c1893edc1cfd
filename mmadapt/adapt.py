"""Step 2: a new language's embeddings over a frozen model, as one straight path.

    adapt_embeddings(run, AdaptEmbeddings)
      Step2Plan.of      every check a user can get wrong, before any side effect: the source run
                        and the body its system trains over (body_config), the target text and
                        vocabulary (replace: the target's; expand: the source's with the target's
                        new pieces, expand.py), the replay text, the run's data plan
      run.start_run     the run lock, the data prepared, the process groups
      Step2Start.build  the start, built once per run and rank: the source's weights read once,
                        the body's state with the new vocabulary's rows (new_vocabulary), the
                        primary model the embeddings plug into (one head, its fingerprint), an
                        expanded vocabulary's output start and its calibration (expand.py)
      ArtifactWriter    the artifact of update 0 and of every checkpoint (artifact.py), each
                        scored through the primary model where asked (heldout.PluginProbe); over
                        a mini-model, fitted to the primary (PrimaryCalibration)
      train.train_lm    the updates
      expand_report     what an expanded vocabulary did to the source language (expand.py)

The model each system trains its new embeddings over (paper section 2):
    bl_base    the full primary model (its last head)
    bl_small   the N-layer model of Step 1 with recipe bl_small
    minijoint  the bottom N layers of a MINIJOINT primary model + its secondary head (after layer N);
               a MINIJOINT run with several secondary heads holds a mini-model per head: Step 2
               names its depth N (`mini_layers`), and its records are shown as `minijoint@N`
    minipost   the (N + K)-layer mini-model built in Step 1b: bottom N layers, K new layers, primary head

Step-2 runs train the parameters indexed by vocabulary piece (ModelFamily.vocab_params): the
word embedding [V, h] (tied with the output projection where the family ties them) and what
else the family indexes by piece: the encoder's output bias [V], a decoder's untied output
projection [V, h]. The encoder's bias is trained because the source model's belongs to the
source vocabulary and means nothing for most target pieces; it adds V elements to the h*V of the
embedding and no matmul FLOPs. TrainConfig.train_output_bias=False is the paper's setting: the
embeddings alone, the bias frozen at its start (StartRule: fitted to the target text).

Everything here works on full ("single-device") state dicts in the family's parameter names
(family.py); train.py shards them onto whatever tensor/pipeline layout a run uses.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, ClassVar

import sentencepiece as spm
import torch

from mmadapt import checkpoint, faults, parallel
from mmadapt.parallel import from_rank0
from mmadapt.artifact import ARTIFACT_FILE, SAMPLED_KEY, read_artifact, write_artifact
from mmadapt.config import (EMBEDDING_INITS, MIN_VOCAB_SIZE, PRIMARY_CALIBRATIONS, SOURCE_RECIPES, SYSTEMS,
                            MiniModelConfig, ModelConfig, StepSpec, TrainConfig, _f, check_lang)
from mmadapt.corpora import check_bible_lang
from mmadapt.data import (TEXT, TOKENIZER, check_prepared, file_sha256, follows_byte_fallback, read_tokenizer,
                          replay_blocks)
from mmadapt.expand import (Replay, calibrate, check_expansion, expand_report, merged_vocabulary,
                            output_start, replay_text, source_text)
from mmadapt.family import ModelFamily
from mmadapt.flops import device_days, flops_by_rows
from mmadapt.heldout import PluginProbe, Primary, Scorer, Text, piece_counts, target_logprobs, unigram_logprobs
from mmadapt.models.layers import derive_seed, new_rows_name
from mmadapt.run import (RUN_TOKENIZER, RunSpec, Source, agreed_source, check_run, check_same_source,
                         check_trained_positions, load_checkpoint, read_source, require_head, resumed_tag,
                         run_text_layout, sampled_fingerprint, start_run)
from mmadapt.tokenizer import (WORD_BOUNDARY, bare_proto, byte_piece_text, byte_surfaces, has_byte_fallback,
                               sp_proto)
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.tokenizer import pieces as tokenizer_pieces
from mmadapt.tokenizer import source_form
from mmadapt.tokens import UNK_ID
from mmadapt.train import ExpandedText, LMJob, TextData, WithReplay, train_lm


@dataclasses.dataclass
class AdaptEmbeddings(StepSpec):
    """Step 2: new `lang` embeddings over the frozen model of `system`, from the source run
    `source` (its checkpoint `source_tag`, default: the newest complete one).

    Data: RunSpec.data_path, the target language's prepared dataset (mmadapt preprocess; its
    tokenizer is the target vocabulary); else RunSpec.corpus (default: the packaged Bible,
    bible:<lang>) with RunSpec.tokenizer, an existing target SentencePiece model (default: one
    trained on the corpus). vocab_size: the target vocabulary (default: the dataset's or
    tokenizer's size, else the source model's). mini_layers (minijoint): the depth N of the
    source's mini-model to train over, one of its secondary heads (default: its only one; a run
    with several needs it, ModelFamily.minijoint_depth)."""
    name: ClassVar[str] = "adapt"
    system: str
    source: Path
    lang: str
    train: TrainConfig
    vocab_size: int | None = _f(None, "the target vocabulary's pieces", flag=False, ge=MIN_VOCAB_SIZE)
    source_tag: str | None = None
    mini_layers: int | None = _f(None, "MINIJOINT with several depths: the one to adapt", flag=False, ge=1)

    def __post_init__(self):
        super().__post_init__()
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        check_lang(self.lang)  # recorded with the embeddings, and a path in evaluate's {lang}

    @classmethod
    def recorded(cls, run: dict) -> "AdaptEmbeddings":
        """The step an adapt run's record (run.json) describes, as its start was computed then: a
        field the record lacks takes the value runs had before it existed (expand_output_start:
        the output side as the input side; a bounded start recorded with no calibration is the
        worst case), and the replay text is the record's resolved path."""
        train, names = run["train"], {f.name for f in dataclasses.fields(TrainConfig)}
        how = train.get("expand_output_start", "embedding_init")
        if how == "bounded" and not ("output_shift" in run or "bias_shift" in run):
            how = "worst_case"
        recorded = {**{k: v for k, v in train.items() if k in names}, "expand_output_start": how,
                    "replay_data": run.get("replay_data")}
        src = run["frozen_from"]
        return cls(system=run["system"], source=Path(src["run_dir"]), lang=run["lang"], train=TrainConfig(**recorded),
                   source_tag=src["tag"], mini_layers=run.get("mini_layers"))


def final_artifact_written(run_dir: Path, iters: int) -> bool:
    """Whether the Step-2 run in `run_dir` holds the artifact of its update `iters`: a stop
    between that checkpoint's COMPLETE and its artifact leaves it to the next --resume
    (ArtifactWriter.save_start), which a caller that keeps a finished run must still start."""
    return (Path(run_dir) / "embeddings" / checkpoint.tag_for(iters) / ARTIFACT_FILE).is_file()


def adapt_embeddings(run: RunSpec, step: AdaptEmbeddings) -> list[dict]:
    """Step 2 (module docstring). Writes an artifact (embeddings.pt, spm.model, meta.json) under
    <output_dir>/embeddings/<tag> at update 0 and at every checkpoint: what Step 4 swaps in.
    Returns the metrics rows of this invocation (global rank 0; empty elsewhere)."""
    check_run(run, step, AdaptEmbeddings)
    plan = Step2Plan.of(run, step)
    step = plan.step  # (resumed_calibration's)
    with start_run(plan.run, plan.model, step.train, plan.identity, plan.data) as started:
        tokenizer = started.data / TOKENIZER
        # A resumed run starts as it started: its frozen start values (a frozen bias, an expanded
        # vocabulary's source side) and its update-0 artifact by the rule its record names, not
        # today's default (a run recorded before rules were, with a checkpoint: the rule of then,
        # StartRule.recorded; with none, it starts anew). A --resume into a directory with no
        # record yet (launch/slurm/adapt.sbatch's first launch, or a requeue before train_lm wrote
        # it) starts anew as well. Rank 0 reads it for every rank: a node's cached view of a shared
        # file system could start its ranks by another rule.
        def recorded_rule() -> StartRule:
            if plan.run.resume and started.record.exists():
                record = started.record.read()
                if "start_rule" in record or checkpoint.latest_tag(plan.run.output_dir / "checkpoints") is not None:
                    return StartRule.recorded(record)
            return StartRule()
        rule = parallel.rank0_decides(recorded_rule)
        # the source's tokenizer too, before the start is built over it (its shared pieces' rows, the bias fit:
        # built again on a resume)
        source_tokenizer = file_sha256(plan.source.tokenizer)
        check_same_source(plan.run, {"source_tokenizer_sha256": lambda: source_tokenizer}, plan.source.path)
        start = parallel.together(lambda: Step2Start.build(plan.source, plan.body, step, tokenizer, started.data, rule),
                                  f"could not read {plan.source.path}'s checkpoint {plan.source.tag}")
        check_same_source(plan.run, {"source_fingerprint": lambda: start.source_fingerprint}, plan.source.path)
        if parallel.is_rank0():
            say_start(step.lang, step.train.embedding_init, plan.model, start.rows)
        writer = ArtifactWriter.of(plan, start, tokenizer, started.data)
        if plan.replay is not None and parallel.is_rank0():
            say_replay(plan.replay, writer.meta["global_batch"])
        writer.save_start(plan.run.resume and started.record.exists(), step.train)
        job = LMJob(step="adapt", trainable=writer.trainable, replay=plan.replay,
                    text_layout=run_text_layout(plan.source.record))
        metrics = train_lm(started, plan.run, plan.model, step.train, job, start.init, after_save=writer,
                           record={**start.rows, **plan.expanded, "target_vocab_size": plan.model.vocab_size,
                                   "source_fingerprint": start.source_fingerprint,
                                   "source_tokenizer_sha256": source_tokenizer})
        final = plan.run.output_dir / "embeddings" / checkpoint.tag_for(step.train.train_iters)
        if plan.expanded and parallel.is_rank0() and final.is_dir():
            # a SIGTERM while the source language is scored (after the last checkpoint): Stopped,
            # exit 75 as in the loop (the SLURM templates requeue it), not 143 and no word;
            # --resume scores it again without training
            with faults.stopped_after_checkpoint(step.train.train_iters, final.name):
                started.record.finish(expand_report=start.report(plan, final, started.data))
        return metrics


# --- before any side effect ------------------------------------------------------------------------------

@dataclasses.dataclass
class Step2Plan:
    """Step 2 as checked before any side effect (`of`): the run (its default target text and its
    raw corpus resolved), the step, its source run, the body its system trains over (on one
    device), the model the run trains (the body as the run lays it out, with the new vocabulary's
    size; expand: and its frozen source rows), the data plan (start_run's), the replay text, the
    prepared target dataset's manifest (read once; None for a raw corpus), and what the record
    adds (`identity`, and an expanded vocabulary's fields)."""
    run: RunSpec
    step: AdaptEmbeddings
    source: Source
    body: ModelConfig
    model: ModelConfig
    data: object
    replay: Replay | None
    manifest: dict | None
    expanded: dict
    depth: dict

    @classmethod
    def of(cls, run: RunSpec, step: AdaptEmbeddings) -> "Step2Plan":
        source, body = _source(run, step)
        if run.data_path is None and run.corpus is None:
            run = dataclasses.replace(run, corpus=f"bible:{step.lang}")
        check_bible_lang(run.corpus, step.lang)
        expand = step.train.vocab_mode == "expand"
        if run.data_path is None and run.tokenizer is None:  # a target vocabulary trained here
            fallback = follows_byte_fallback(run.output_dir / "data", source.tokenizer, step.train.vocab_mode)
            run = dataclasses.replace(run, prep=dataclasses.replace(run.prep, byte_fallback=fallback))
        manifest = check_prepared(run.data_path) if run.data_path is not None else None
        if (manifest and manifest.get("unknown") and not manifest.get("byte_fallback") and not expand
                and has_byte_fallback(source.tokenizer) and parallel.is_rank0()):
            print(f"note: {source.path}'s tokenizer reads every character (byte fallback) and {run.data_path}'s "
                  f"does not: {manifest['unknown']:,} of its pieces are <unk>; prepare the text with mmadapt "
                  "preprocess --byte_fallback true (into a new --output_dir) to keep them", flush=True)
        if step.train.plugin_eval_blocks and not (manifest or {}).get("valid"):
            raise ValueError("--plugin_eval_blocks scores held-out target text: pass --data_path, a dataset prepared "
                             "with mmadapt preprocess --valid_fraction 0.03 (a raw --corpus has no validation split)")
        recorded = recorded_calibration(run)
        step = resumed_calibration(step, expand, source.family, recorded)
        check_calibration(step, expand, source.family, recorded)
        target = run.data_path / TOKENIZER if run.data_path is not None else run.tokenizer
        replay = replay_text(step.train, source.tokenizer if expand else target, run.layout.apply(body))
        model, data, expanded = _vocabulary(run, step, source, body, manifest)
        # Which mini-model (MINIJOINT): its depth, and every depth the source offers (artifact labels).
        depth = ({"mini_layers": body.num_layers, "mini_depths": list(source.cfg.heads_after[:-1])}
                 if step.system == "minijoint" else {})
        return cls(run.with_corpus_resolved(), step, source, body, model,
                   data if replay is None else WithReplay(data, replay), replay, manifest, expanded, depth)

    @property
    def identity(self) -> dict:
        """What run.json records of the run's identity (compared on --resume)."""
        step = self.step
        return {"step": "adapt", "recipe": step.system, "system": step.system, "lang": step.lang,
                "frozen_from": {"run_dir": str(self.source.path), "tag": self.source.tag, "system": step.system},
                **self.depth}


def _source(run: RunSpec, step: AdaptEmbeddings) -> tuple[Source, ModelConfig]:
    """The source run of `step` (the checkpoint a --resume of `run` recorded, run.resumed_tag) and
    the config of the model its system trains over (checked once: the system, the source's
    recipe, the mini-model's depth)."""
    if step.system not in SYSTEMS:
        raise ValueError(f"unknown system {step.system!r}; choose one of {', '.join(SYSTEMS)}")
    source = agreed_source(step.source, lambda: resumed_tag(run.output_dir, run.resume, step.source, step.source_tag))
    require_head(source, "Step 2")
    pieces = read_tokenizer(source.tokenizer).get_piece_size()
    if pieces > source.cfg.vocab_size:  # (an IndexError where its shared pieces' rows were copied)
        raise ValueError(f"{source.path}'s tokenizer ({RUN_TOKENIZER}) has {pieces} pieces, more than its "
                         f"model's {source.cfg.vocab_size} rows: it is not the tokenizer the run trained with; put "
                         "that one back")
    check_trained_positions(source, step.train.seq_length, "Step 2")
    recipe = source.record.get("recipe")
    if recipe not in SOURCE_RECIPES[step.system]:
        raise ValueError(f"--system {step.system} adapts a run with recipe {' or '.join(SOURCE_RECIPES[step.system])}, "
                         f"but {source.path} has recipe {recipe}")
    return source, body_config(source.family, step.system, source.cfg, step.mini_layers)


def _vocabulary(run: RunSpec, step: AdaptEmbeddings, source: Source, body: ModelConfig, manifest: dict | None
                ) -> tuple[ModelConfig, object, dict]:
    """The model Step 2 runs (the body, laid out as the run says, with the new vocabulary's
    size), its data plan, and the record's expansion fields ({} in replace mode)."""
    layout, train = run.layout.apply(body), step.train
    if train.vocab_mode != "expand":
        if step.vocab_size is not None:
            size = step.vocab_size
        elif manifest is not None:
            size = manifest["vocab_size"]
        elif run.tokenizer is not None:
            size = read_tokenizer(run.tokenizer).get_piece_size()
        else:
            size = body.vocab_size
        return dataclasses.replace(layout, vocab_size=size), TextData(manifest), {}
    check_output_start(source.family, train, body)
    size, source_size, expansion = merged_vocabulary(run, source, step.vocab_size, train.seed, manifest)
    model = dataclasses.replace(layout, vocab_size=size, frozen_vocab_size=source_size)
    data = TextData(manifest) if expansion is None else ExpandedText(expansion)
    return model, data, {"vocab_mode": "expand", "source_vocab_size": source_size,
                         "expand_output_start": train.expand_output_start}


def check_output_start(family: ModelFamily, train: TrainConfig, body: ModelConfig) -> None:
    """Refuse what --vocab_mode expand cannot start, before anything is written: a family that
    does not say how its model scores the vocabulary (ModelFamily.output_path), and --embedding_init
    subword_mean where the bounded start would overwrite it (a tied decoder's new rows are its
    output rows)."""
    if train.vocab_mode != "expand":
        return
    path = family.output_path(body)
    if train.expand_output_start == "embedding_init" or train.embedding_init != "subword_mean":
        return
    if path.bias is None and path.matrix == family.word:
        raise ValueError("--embedding_init subword_mean with a tied decoder: its new rows are its output rows too, "
                         f"which --expand_output_start {train.expand_output_start} starts at the source rows' mean; pass "
                         "--expand_output_start embedding_init to start them at their splits' means instead")


# --- the body and the new vocabulary's rows ----------------------------------------------------------------

def body_config(family: ModelFamily, system: str, cfg: ModelConfig, mini_layers: int | None = None) -> ModelConfig:
    """The config of the model Step 2 trains embeddings over, from the source's config alone.
    mini_layers: minijoint only, which of the source's mini-models (ModelFamily.minijoint_depth)."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    if system == "minijoint":
        return family.minijoint_config(cfg, mini_layers)
    if mini_layers is not None:
        raise ValueError(f"--mini_layers picks one of a MINIJOINT run's mini-models; {system}'s model comes whole "
                         "from its source run")
    return family.primary_config(cfg)


def body_weights(family: ModelFamily, system: str, cfg: ModelConfig, state: dict, body: ModelConfig) -> dict:
    """The weights of the model Step 2 trains embeddings over (`body`, body_config's) from
    `state`, the full weights of the system's source run (whose config is `cfg`)."""
    if system == "minijoint":
        return family.extract_minijoint(cfg, state, body.num_layers)[1]
    return family.primary_model(cfg, state)[1]


# --- the new vocabulary's starting rows ---------------------------------------------------------------

def overlap_init(src_pieces: list[str], src: dict[str, torch.Tensor], trg_pieces: list[str],
                 std: float | dict[str, float], seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """Target rows of each vocabulary-indexed tensor of `src` (name -> [V_src, ...], the word
    embedding first), after the paper's footnote 1 (Pfeiffer et al. 2021): a piece that is also in
    the source vocabulary (special tokens included) gets the source row; every other row is
    N(0, std) in a matrix (std: one for all, or each matrix's by name) and 0 in a vector (a bias;
    Step2Start fits it to the target text). Returns (name -> [V_trg, ...], number of shared
    pieces). The random rows depend only on `seed`, drawn matrix by matrix in `src`'s order.
    Two source pieces of one surface form (a byte-level token of the literal U+2581 reads as '▁',
    as the space token does; a text token '<s>' as the BOS role's name): the first, the special
    roles' row or, in a BPE vocabulary ordered by merge, the more frequent piece."""
    src_index: dict[str, int] = {}
    for i, p in enumerate(src_pieces):
        src_index.setdefault(p, i)
    gen = torch.Generator().manual_seed(seed)
    trg_rows = [i for i, p in enumerate(trg_pieces) if p in src_index]
    src_rows = [src_index[trg_pieces[i]] for i in trg_rows]
    out = {}
    for name, t in src.items():
        if t.ndim == 2:
            new = torch.randn(len(trg_pieces), t.shape[1], generator=gen, dtype=torch.float32) * (
                std[name] if isinstance(std, dict) else std)
        else:
            new = torch.zeros(len(trg_pieces), dtype=torch.float32)
        new[trg_rows] = t[src_rows].float()
        out[name] = new
    return out, len(trg_rows)


def source_split(src_tokenizer: Path):
    """piece -> the source tokenizer's ids for that piece's surface form, as FVT splits a new
    piece (Gee et al. 2022): '▁' read as the space it stands for, and nothing added to the text, so
    a word-initial piece '▁foo' splits as ' foo' does inside a text and a word-internal 'oo' as
    'oo' does (a SentencePiece source gets a copy of its model without the dummy prefix and with
    spaces kept; a byte-level BPE source's pre-tokenizer adds no prefix space already; a
    WordPiece source splits a word-internal piece into `##` continuations,
    HFTokenizer.split_surface). The unknown piece is dropped from a split: its row says nothing
    about the piece."""
    tok = load_tokenizer(src_tokenizer)
    if not isinstance(tok, spm.SentencePieceProcessor):
        return tok.split_surface  # an imported tokenizer (HFTokenizer)
    tok = spm.SentencePieceProcessor(model_proto=bare_proto(sp_proto(src_tokenizer)).SerializeToString())

    def split(piece: str) -> list[int]:
        return [i for i in tok.encode(piece.replace(WORD_BOUNDARY, " ")) if i != UNK_ID]
    return split


def subword_mean_init(split, src_pieces: list[str], src: dict[str, torch.Tensor], trg_pieces: list[str],
                      std: float | dict[str, float], seed: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """overlap_init, then every target piece that is not shared and that the source tokenizer
    splits (`split`, source_split) gets the mean of the source rows of its split, in every
    vocabulary-indexed tensor (the bias likewise); a piece with an empty split keeps its N(0, std)
    row. -> (name -> [V_trg, ...], shared pieces, pieces given a mean)."""
    out, shared = overlap_init(src_pieces, src, trg_pieces, std, seed)
    src_index = {p: i for i, p in enumerate(src_pieces)}
    composed = 0
    for i, piece in enumerate(trg_pieces):
        if piece in src_index:
            continue
        # a byte piece (a byte-fallback vocabulary's <0xE4>) is no text to split: its character's
        # split for an ASCII byte, none for a byte of a longer character (its literal "<0xE4>"
        # split into '<', '0', 'x', ... rows meant nothing)
        text = byte_piece_text(piece)
        ids = split(piece) if text is None else split(text) if text else []
        if not ids:
            continue
        composed += 1
        for name, t in src.items():
            out[name][i] = t[ids].float().mean(0)
    return out, shared, composed


def init_rows(how: str, src_tokenizer: Path, src: dict[str, torch.Tensor], trg_pieces: list[str],
              std: float | dict[str, float], seed: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The rows of the pieces `trg_pieces` (surface forms, tokenizer.pieces) in the
    vocabulary-indexed tensors `src` by TrainConfig.embedding_init: overlap (the paper: shared
    pieces copied, the rest N(0, std)), subword_mean (FVT: subword_mean_init) or normal (every
    row drawn, nothing copied: the baseline that shows what the copies are worth). -> (name ->
    [len(trg_pieces), ...], how many rows started which way: shared_pieces, subword_mean_pieces,
    random_pieces)."""
    # byte pieces as one surface on both sides (byte_surfaces: a byte-fallback target's <0x0A> is
    # Llama-2's '\n'), in the source's normal form (an uncased WordPiece's lower case): a piece
    # shares the row its text reaches
    src_pieces = byte_surfaces(tokenizer_pieces(src_tokenizer))
    trg_pieces = list(map(source_form(src_tokenizer), byte_surfaces(trg_pieces)))
    composed = 0
    if how == "normal":
        out, shared = overlap_init([], src, trg_pieces, std, seed)
    elif how == "subword_mean":
        out, shared, composed = subword_mean_init(source_split(src_tokenizer), src_pieces, src, trg_pieces, std, seed)
    elif how == "overlap":
        out, shared = overlap_init(src_pieces, src, trg_pieces, std, seed)
    else:
        raise ValueError(f"unknown embedding_init {how!r}; choose one of {', '.join(EMBEDDING_INITS)}")
    return out, {"shared_pieces": shared, "subword_mean_pieces": composed,
                 "random_pieces": len(trg_pieces) - shared - composed}


def new_vocabulary(family: ModelFamily, body: ModelConfig, state: dict, src_tokenizer: Path, target_tokenizer: Path,
                   seed: int, train: TrainConfig = TrainConfig(), row_std: str = "source"
                   ) -> tuple[dict, dict[str, int]]:
    """Step 2's starting weights: the body's weights `state` (body_weights) with the new
    vocabulary's rows of every vocabulary-indexed parameter (init_rows), started as `train`'s
    embedding_init and vocab_mode say. vocab_mode "replace": the
    rows of every piece of `target_tokenizer`; "expand" (`target_tokenizer` is then the merged
    one, expand.py): the source's rows kept under their names and the rows of the appended pieces
    under `new_rows_name`s. Random rows are drawn from `seed`, N(0, row_std): "source", each
    matrix's own standard deviation in the source (StartRule: the scale its rows were trained
    to); "config", the model's init_method_std (runs before 2026-11-27). -> (full state dict,
    how many rows started which way)."""
    embedding_init, vocab_mode = train.embedding_init, train.vocab_mode
    vocab = {name: state[name] for name in family.vocab_params(body)}
    std = ({name: float(t.float().std()) for name, t in vocab.items() if t.ndim == 2} if row_std == "source"
           else body.init_method_std)
    trg_pieces = tokenizer_pieces(target_tokenizer)
    scale = {"row_std": std[family.word] if isinstance(std, dict) else std}  # the word rows' (say_start prints it)
    if vocab_mode == "replace":
        new, counts = init_rows(embedding_init, src_tokenizer, vocab, trg_pieces, std, seed)
        return {**state, **new}, {**counts, **scale}
    source_size = check_expansion(src_tokenizer, target_tokenizer)
    new, counts = init_rows(embedding_init, src_tokenizer, vocab, trg_pieces[source_size:], std, seed)
    return {**state, **{new_rows_name(name): rows for name, rows in new.items()}}, {**counts, **scale}


def step2_trainable(family: ModelFamily, cfg: ModelConfig, train_output_bias: bool = True) -> tuple[str, ...]:
    """The parameters Step 2 trains: the vocabulary-indexed ones (ModelFamily.vocab_params), or,
    for an expanded vocabulary (cfg.frozen_vocab_size), only their new rows."""
    names = family.vocab_params(cfg, train_output_bias)
    return tuple(map(new_rows_name, names)) if cfg.frozen_vocab_size else names


# --- the start, built once ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StartRule:
    """How Step 2 starts the new vocabulary's rows, derived from the source and the target text
    (run.json records it as `start_rule`; docs/mini-models.md says why):
        row_std  "source": a drawn row at its matrix's own standard deviation in the source (the
                 scale the body reads its input at; an imported checkpoint's word embeddings have
                 std 0.056 where its config's initializer_range says 0.02); "config": the
                 model's init_method_std (runs recorded before 2026-11-27)
        bias     "fitted": replace mode, the output bias fitted on the target text so that the
                 start's mean prediction there is the target text's unigram distribution (its
                 loss starts at the unigram reference, whatever the source's bias: an imported
                 head's sits at English log-frequencies, 13 nats under the 0 a new piece got);
                 expand mode, the bound on the new pieces' share divided among them by the target
                 text's frequencies; "copied": shared pieces' entries copied, the rest 0 (before).
        bias_target  what "fitted" fits the mean prediction to (and the artifacts' calibration to
                 the primary): "scored", the frequencies of the pieces a scored position can be
                 (heldout.target_logprobs: for an encoder no special piece, as its masked
                 positions and the plug-in metric's reference); "every", every piece's, each
                 sentence's </s> included, which cost an encoder's start about 0.035 nats against
                 the reference (runs recorded before 2026-12-02)."""
    row_std: str = "source"
    bias: str = "fitted"
    bias_target: str = "scored"

    def __post_init__(self):
        if self.bias_target not in ("scored", "every"):
            raise ValueError(f"start_rule bias_target {self.bias_target!r}: 'scored' or 'every'")

    @classmethod
    def recorded(cls, run: dict) -> "StartRule":
        """The rule an adapt run's record says it started by (a record without one: the old rule;
        one without bias_target: "every", the fit of then)."""
        if "start_rule" not in run:
            return cls(row_std="config", bias="copied", bias_target="every")
        return cls(**{"bias_target": "every", **run["start_rule"]})

    def target(self, data: Path, counts, primary: Primary) -> torch.Tensor | None:
        """The log-frequencies [V] the fitted bias is fitted to, from the prepared target data's
        piece `counts` [V] (heldout.piece_counts), as `primary` scores that text; None where the
        bias is not fitted."""
        if self.bias != "fitted":
            return None
        if self.bias_target == "every":
            return unigram_logprobs(data, len(counts), counts)
        return target_logprobs(data, len(counts), primary.family.objective, primary.text_prefix(data), counts)


def recorded_calibration(run: RunSpec) -> str | None:
    """The --primary_calibration the run.json of the run `run` resumes records (None: not a
    resume, or no record yet)."""
    record = run.output_dir / "run.json"
    if not (run.resume and record.is_file()):
        return None
    train = checkpoint.read_json(record, "run file").get("train")  # (a damaged one: start_run's checks name it)
    recorded = train.get("primary_calibration") if isinstance(train, dict) else None
    return recorded if recorded in PRIMARY_CALIBRATIONS else None


def resumed_calibration(step: AdaptEmbeddings, expanded: bool, family: ModelFamily,
                        recorded: str | None) -> AdaptEmbeddings:
    """`step` as a --resume continues it: where --primary_calibration does not apply
    (calibrates_at_all false), with a value other than the default that its run.json records
    (`recorded`), which changed nothing. A decoder's run begun before check_calibration refused
    one there (2026-12-07) recorded the value it was given and calibrated nothing: it resumes
    with the flag or without."""
    if (recorded in (None, TrainConfig.primary_calibration, step.train.primary_calibration)
            or calibrates_at_all(step, expanded, family)):
        return step  # (a run that recorded the default: another value is refused, as in a new run)
    return dataclasses.replace(step, train=dataclasses.replace(step.train, primary_calibration=recorded))


def check_calibration(step: AdaptEmbeddings, expanded: bool, family: ModelFamily,
                      recorded: str | None = None) -> None:
    """Refuse, in one line, a --primary_calibration other than its default where it does not apply
    (calibrates_at_all false): run.json would record a calibration no artifact had; `recorded`:
    the value the record of a resumed run holds (resumed_calibration), taken."""
    train = step.train
    value, default = train.primary_calibration, TrainConfig.primary_calibration
    if value in (default, recorded) or calibrates_at_all(step, expanded, family):  # (none: as trained)
        return
    why = ("it trains over the full model" if step.system not in MINI_SYSTEMS else
           "it expands the vocabulary" if expanded else
           f"the {family.name} family's model has no output bias" if not has_output_bias(family) else
           "its output bias is frozen (--train_output_bias false)")
    raise ValueError(f"--primary_calibration {value} fits a mini-model's artifacts to the primary model (minijoint or "
                     f"minipost, replace mode, the output bias trained), and this run has none to fit: {why}; drop "
                     "the flag")


FIT_POSITIONS = 2048  # scored positions of target text the output bias is fitted on (its V-vector's estimate)
MINI_SYSTEMS = ("minijoint", "minipost")  # Step 2 over a mini-model, for a deeper primary model


def has_output_bias(family: ModelFamily) -> bool:
    """Whether `family`'s models have an output bias an artifact holds (a decoder's have none)."""
    return "output_bias" in family.artifact_keys()


def calibrates_at_all(step: AdaptEmbeddings, expanded: bool, family: ModelFamily) -> bool:
    """Whether --primary_calibration applies to `step` over a model of `family`: Step 2 over a
    mini-model, replace mode (`expanded` false), an output bias and trained (what is fitted)."""
    return (step.train.train_output_bias and has_output_bias(family) and step.system in MINI_SYSTEMS
            and not expanded)


def calibrated(step: AdaptEmbeddings, expanded: bool, family: ModelFamily) -> bool:
    """Whether `step`'s artifacts are fitted to the primary model (PrimaryCalibration): where
    --primary_calibration applies (calibrates_at_all) and is not none."""
    return step.train.primary_calibration != "none" and calibrates_at_all(step, expanded, family)


def bias_fit_text(data: Path, train: TrainConfig, family: ModelFamily) -> Text:
    """The blocks of the target data's training text (not the held-out part the plug-in metric
    scores) whose FIT_POSITIONS scored positions an output bias is fitted on."""
    scored = train.seq_length * (TrainConfig.mask_prob if family.objective.masked else 1.0)
    blocks = max(1, math.ceil(FIT_POSITIONS / scored))
    batch = min(32, blocks)
    # whole batches (the blocks the fit has read since it was written: heldout_batches then dropped
    # a last partial batch, and every recorded start was fitted so)
    return Text(data, train.seq_length, blocks // batch * batch, batch, split=TEXT)


def fit_bias(logits: list[torch.Tensor], bias: torch.Tensor, logp: torch.Tensor, iters: int = 100,
             tol: float = 1e-3) -> torch.Tensor:
    """The output bias b [V] with which the mean over positions i of softmax(c_i + b) is exp(logp),
    the target unigram distribution (c: `logits` [m_b, V] at the scored positions, computed with
    `bias`, less it): iterative proportional fitting, b += logp - log mean_i softmax(c_i + b),
    until every piece's gap is under `tol` nats (or `iters`), on the logits' device in fp32. The
    mean is taken in log space (logsumexp of the log-softmax): a piece ~104 nats below the best at
    every position has a softmax of 0 in fp32, whose log, -inf, made the bias inf and then NaN."""
    c = torch.cat(logits).float()
    b = bias.to(c.device, torch.float32)
    c, target = c - b, logp.to(c.device, torch.float32)
    for _ in range(iters):
        gap = target - (torch.logsumexp(torch.log_softmax(c + b, -1), 0) - math.log(c.shape[0]))
        b = b + gap
        if float(gap.abs().max()) < tol:
            break
    return b.cpu()


@dataclasses.dataclass
class Step2Start:
    """Step 2's start, built once per run and rank (`build`) and handed to training, the probes,
    the artifacts and the expand report: the body's config and full state with the new
    vocabulary's rows (`init`), how they started (`rows`: run.json's counts; expand: the bound on
    what the new pieces take of the source language, and the calibration's record), and the
    primary model the embeddings plug into (`primary`: one head; its fingerprint on global rank
    0, which alone writes artifacts). The model that scores through the primary (`scorer`) is
    built where first needed and kept while something will use it again."""
    body: ModelConfig
    init: dict[str, torch.Tensor]
    rows: dict
    primary: Primary
    expanded: bool
    family: ModelFamily
    source_fingerprint: str = ""  # run.sampled_fingerprint of the source's weights
    logp: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # [V] the fitted bias's target
    _scorer: Scorer | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(cls, source: Source, body: ModelConfig, step: AdaptEmbeddings, tokenizer: Path,
              data: Path | None, rule: StartRule = StartRule()) -> "Step2Start":
        """The start of `step` over `body` (its system's, from the source run `source`) for the new
        vocabulary `tokenizer` (replace: the target's; expand: the merged one), by `rule`, which
        reads the training text of the prepared target data `data` (None: a rule that reads none,
        a run's recompute from before the rule): the source's checkpoint read once (MINIPOST: and
        the one its mini-model came from, the primary)."""
        train, family = step.train, source.family
        read: dict = {}  # every checkpoint this start reads, read once
        weights = source.weights(read)
        fingerprint = sampled_fingerprint(weights)  # what a --resume checks the source against
        ref = source.record["frozen_from"] if step.system == "minipost" else None
        primary_run = source if ref is None else read_source(ref["run_dir"], ref["tag"])
        primary = Primary.of(primary_run, primary_run.weights(read), fingerprint=parallel.is_rank0())
        state = body_weights(family, step.system, source.cfg, weights, body)
        del weights, read
        init, rows = new_vocabulary(family, body, state, source.tokenizer, tokenizer,
                                    derive_seed(train.seed, f"embeddings.{step.lang}"), train, rule.row_std)
        start = cls(body, init, {**rows, "start_rule": dataclasses.asdict(rule)}, primary,
                    train.vocab_mode == "expand", family, fingerprint)
        counts = (piece_counts(data, load_tokenizer(tokenizer).get_piece_size())
                  if rule.bias == "fitted" or start.expanded else None)
        logp = rule.target(data, counts, primary)
        if start.expanded:
            start.count_unused_new_pieces(counts)
            start.bound_new_outputs(train, source.record.get("data_path"), logp)
        elif logp is not None and family.artifact_keys().get("output_bias") in start.init:
            # Where every artifact is calibrated to the primary, the start's bias serves training
            # alone: fitted through the model Step 2 trains (the mini-model), not the primary.
            start.fit_output_bias(data, train, logp, over_trained=calibrated(step, start.expanded, family))
        if not (parallel.is_rank0() and (train.plugin_eval_blocks or start.calibrates(step))):
            # only global rank 0's checkpoint probe and calibration score again before the end
            start._scorer = None
        return start

    def calibrates(self, step: AdaptEmbeddings) -> bool:
        """Whether `step`'s artifacts are fitted to the primary model (PrimaryCalibration, every
        artifact's): `calibrated`, with the output bias fitted at the start."""
        return calibrated(step, self.expanded, self.family) and self.logp is not None

    def calibration(self, step: AdaptEmbeddings, data: Path) -> "PrimaryCalibration | None":
        """What fits `step`'s artifacts to the primary model, on the prepared target data `data`'s
        text that fitted the start; None where they are written as trained."""
        train = step.train
        return (PrimaryCalibration(self.scorer, bias_fit_text(data, train, self.family), self.logp,
                                   scale=train.primary_calibration == "scale") if self.calibrates(step) else None)

    def artifact(self, step: AdaptEmbeddings, data: Path) -> dict[str, torch.Tensor]:
        """The start as Step 2 writes it, its artifact of update 0 (calibrated where `step`'s are)."""
        tensors, calibration = self.tensors(), self.calibration(step, data)
        return tensors if calibration is None else calibration(tensors)[0]

    def fit_output_bias(self, data: Path, train: TrainConfig, logp: torch.Tensor, over_trained: bool = False) -> None:
        """Replace mode (StartRule.bias "fitted"): the output bias fitted (fit_bias) through the
        primary model (over_trained: through the model Step 2 trains, the body as it starts) on
        FIT_POSITIONS scored positions of the target data's training text to its unigram
        log-frequencies `logp`, then shifted to the source bias's mean (the softmax is blind to
        the shift; weight decay is not). Every rank runs the probe, global rank 0's fit is every
        rank's."""
        name = self.family.artifact_keys()["output_bias"]
        scorer = self.trained_scorer() if over_trained else self.scorer()
        held = scorer.heldout(bias_fit_text(data, train, self.family), len(logp), unigram=False)
        art = self.tensors()
        fitted = fit_bias(scorer.logits(held.on_device, art), art["output_bias"], logp)
        source_mean = float(self.primary.state[name].float().mean())
        self.init = {**self.init, name: from_rank0(fitted - fitted.mean() + source_mean)}
        self.rows.update(bias_fitted_positions=held.scored, bias_fitted_through="trained" if over_trained else "primary")
        self.logp = logp

    def trained_scorer(self) -> Scorer:
        """The model Step 2 trains (`body`, as it starts: `init`), dropout off, as a heldout.Scorer
        of the primary's text layout; built for the call, not kept."""
        cfg = dataclasses.replace(self.body, hidden_dropout=0.0, attention_dropout=0.0)
        return Scorer(dataclasses.replace(self.primary, cfg=cfg, state=self.init, fingerprint=None, sampled=None))

    def count_unused_new_pieces(self, counts) -> None:
        """run.json's `new_pieces_unused`: the new pieces that the target text, as the merged
        tokenizer reads it, never holds (their scores sit below every source piece's, so that the
        source language keeps its segmentation: one loses wherever source pieces outscore it).
        Their rows take softmax mass and train on nothing; said once, on rank 0. counts [V]:
        heldout.piece_counts of the target text."""
        new = self.init[new_rows_name(self.family.word)].shape[0]
        unused = int((counts[len(counts) - new:] == 0).sum())
        self.rows["new_pieces_unused"] = unused
        if unused and parallel.is_rank0():
            print(f"note: {unused} of the {new} new pieces never occur in the target text as the merged tokenizer "
                  "reads it (each scores below every source piece, and loses where source pieces outscore it): "
                  "their rows take softmax mass and train on nothing", flush=True)

    def bound_new_outputs(self, train: TrainConfig, source_data: str | None, logp: torch.Tensor | None) -> None:
        """An expanded vocabulary's output side (expand.output_start; the bound shared among the new
        pieces by the target text's frequencies `logp` where given), calibrated on source text
        where the start is `bounded` (expand.calibrate: the replay text's training split, else the
        source run's data `source_data`, through the primary model)."""
        nats, new = train.expand_source_nats, self.init[new_rows_name(self.family.word)].shape[0]
        prior = None if logp is None else torch.log_softmax(logp[len(logp) - new:], 0)  # the new pieces' ids: the last
        self.init, self.rows["new_mass_bound"] = output_start(self.family, self.body, self.init, self.primary.state,
                                                              train.expand_output_start, nats, prior)
        path = self.family.output_path(self.body)
        if train.expand_output_start != "embedding_init" and path.matrix == self.family.word and path.bias is None:
            # a tied decoder: the output start is the input rows' start too (bounded_start: every new
            # row at the source rows' mean), whatever --embedding_init drew for them
            self.rows.update(subword_mean_pieces=0, random_pieces=0, mean_row_pieces=new)
        if train.expand_output_start != "bounded":
            return
        data = train.replay_data or source_data
        if data is None:
            if parallel.is_rank0():
                bias = self.family.output_path(self.body).bias
                kept = "the worst-case bound" if bias is not None else "the source rows' mean"
                print(f"the new pieces' output start stays at {kept}: the source run holds no text to calibrate it "
                      "on (pass --replay_data, source text in its ids)")
            return
        text = Text(Path(data), train.seq_length, split=TEXT)
        self.init, shift = calibrate(self.body, self.init, self.scorer(), text, nats, every_rank=True)
        self.rows.update(shift)

    def scorer(self) -> Scorer:
        """The primary model on the evaluation device (heldout.Scorer), built on the first call."""
        if self._scorer is None:
            self._scorer = Scorer(self.primary)
        return self._scorer

    def tensors(self) -> dict[str, torch.Tensor]:
        """The start as an artifact's tensors (artifact.py: an expanded vocabulary's whole, the
        source rows then the new rows)."""
        keys = self.family.artifact_keys().items()
        if self.expanded:
            return {key: torch.cat([self.init[name], self.init[new_rows_name(name)]])
                    for key, name in keys if name in self.init}
        return {key: self.init[name] for key, name in keys if name in self.init}

    def report(self, plan: Step2Plan, final: Path, data: Path) -> dict:
        """Global rank 0, after an expanded vocabulary's last update: expand.expand_report on the
        artifacts of update 0 (kept by a --resume) and of the end `final`, the source text the
        replay data's validation split where it has one (else the primary run's data), the target
        text the validation split of the run's prepared data `data` where it has one."""
        seq_length, replay = plan.step.train.seq_length, plan.replay
        art, _, meta = read_artifact(final)
        start = read_artifact(final.parent / checkpoint.tag_for(0))[0]
        source = source_text(self.primary, replay.data if replay is not None and replay.valid else None, seq_length)
        target = Text(data, seq_length) if (plan.manifest or {}).get("valid") else None
        return expand_report(self.scorer(), (art, meta), start, plan.step.lang, target, source)


def say_start(lang: str, how: str, model: ModelConfig, rows: dict[str, float]) -> None:
    """What Step 2 prints of its start (`model`: the run's, with the new vocabulary's size):
    where the rows came from, and an expanded vocabulary's output side."""
    mean = f", {rows['subword_mean_pieces']} the mean of their source split" if how == "subword_mean" else ""
    std = rows.get("row_std", model.init_method_std)
    if model.frozen_vocab_size:
        new = model.vocab_size - model.frozen_vocab_size
        start = ("all at the source rows' mean (tied to their output side, which starts there)"
                 if rows.get("mean_row_pieces") else f"{how}{mean}, {rows['random_pieces']} drawn from N(0, {std:.3g})")
        print(f"{lang}: {new} new pieces after the source's {model.frozen_vocab_size} (frozen; only the new rows "
              f"train), {start}")
        if "new_mass_calibrated" in rows:
            print(f"  their output side, calibrated on source text: they take {rows['new_mass_calibrated']:.4f} nats of "
                  f"its loss (the worst case at any position: {rows['new_mass_bound']:.3g})")
        else:
            print(f"  their output side: they take at most {rows['new_mass_bound']:.3g} nats of the source language's "
                  "loss at any position")
        return
    fitted = (f"; output bias fitted to the target text's unigram distribution ({rows['bias_fitted_positions']} "
              "positions)" if "bias_fitted_positions" in rows else "")
    print(f"new {lang} embeddings ({how}): {rows['shared_pieces']} of {model.vocab_size} pieces copied from the "
          f"source vocabulary{mean}, {rows['random_pieces']} drawn from N(0, {std:.3g}){fitted}")


# --- the artifacts -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class PrimaryCalibration:
    """An artifact fitted to the primary model it plugs into (TrainConfig.primary_calibration), on
    the blocks of target training text that fitted the start (bias_fit_text), forward passes only:
    its output bias refitted (fit_bias) to the target unigram distribution `logp` and shifted to
    the trained bias's mean; with `scale`, first its word rows (input and tied output) times the
    one factor whose refitted loss there is least (a golden-section search over SCALES). Step 2
    over a mini-model trains the bias against the mini-model's logits, and the rows at the scale
    the mini-model's new layers read best; the primary's differ (on all-MiniLM-L6-v2, MINIPOST's
    German through the primary: 0.045 nats below the unigram reference as trained, 0.28 with the
    bias refitted, 0.35 with the scale too: benchmarks/results/minipost_bias_refit_*). Every
    artifact of such a run, update 0's too (its start's bias was fitted through the mini-model).
    Global rank 0, which alone writes artifacts."""
    scorer: Callable[[], Scorer]
    text: Text
    logp: torch.Tensor  # [V]
    scale: bool = False
    _held: object = dataclasses.field(default=None, repr=False)

    SCALES: ClassVar[tuple[float, float]] = (0.5, 3.0)  # the factors searched
    STEPS: ClassVar[int] = 12  # golden-section steps: the factor to within 1% of the searched range's ratio

    def _fit(self, scorer: Scorer, tensors: dict[str, torch.Tensor], targets: torch.Tensor
             ) -> tuple[torch.Tensor, float]:
        """(the refitted bias [V], the loss per piece of the fit text with it) for `tensors`."""
        trained = tensors["output_bias"].float()
        logits = torch.cat(scorer.logits(self._held.on_device, tensors)).float()  # [m, V], with `trained`
        # tol: to fp32's rounding (about 5 iterations), so that two layouts' nearly equal
        # trained tensors give nearly equal biases rather than stopping an iteration apart
        fitted = fit_bias([logits], trained, self.logp, tol=1e-5)
        loss = float(torch.nn.functional.cross_entropy(logits - trained.to(logits.device) + fitted.to(logits.device),
                                                       targets))
        return fitted - fitted.mean() + trained.mean(), loss

    def __call__(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """tensors: an artifact's -> (the same calibrated, what meta.json records of it)."""
        scorer = self.scorer()
        if self._held is None:
            self._held = scorer.heldout(self.text, len(self.logp), unigram=False)
        targets = torch.cat([t for *_, t in self._held.on_device])
        blocks, s = sum(len(ids) for ids, *_ in self._held.on_device), self.text.seq_length
        record = {"through": "primary", "positions": self._held.scored, "tokens": blocks * s}
        passes = 0  # forward passes of the primary over the fit text

        def fit(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
            nonlocal passes
            passes += 1
            return self._fit(scorer, t, targets)

        def scaled(a: float) -> dict[str, torch.Tensor]:
            return {**tensors, "word_embeddings": tensors["word_embeddings"] * a}

        factor = 1.0
        if self.scale:  # golden-section search of log(factor): the loss is smooth and one-dimensional
            lo, hi = (math.log(x) for x in self.SCALES)
            g = (math.sqrt(5) - 1) / 2
            x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
            f1, f2 = (fit(scaled(math.exp(x)))[1] for x in (x1, x2))
            for _ in range(self.STEPS):
                if f1 <= f2:
                    hi, x2, f2 = x2, x1, f1
                    x1 = hi - g * (hi - lo)
                    f1 = fit(scaled(math.exp(x1)))[1]
                else:
                    lo, x1, f1 = x1, x2, f2
                    x2 = lo + g * (hi - lo)
                    f2 = fit(scaled(math.exp(x2)))[1]
            factor = math.exp((lo + hi) / 2)
            record["scale"] = factor
        out = scaled(factor)
        out["output_bias"], record["fit_loss"] = fit(out)
        # What the fit cost, apart from the artifact's training `flops` (the curves' compute, as
        # the paper counts it): each pass the primary's forward over the blocks, its head
        # projecting the scored positions onto the artifact's vocabulary
        cfg = dataclasses.replace(scorer.primary.cfg, vocab_size=len(self.logp))
        record.update(passes=passes, flops=passes * scorer.family.scoring_flops(cfg, s, blocks, self._held.scored))
        return out, {"primary_calibration": record}


@dataclasses.dataclass
class ArtifactWriter:
    """Step 2's `after_save`: at each checkpoint, the artifact Step 4 swaps in (artifact.write_artifact)
    under <output_dir>/embeddings/<tag>, with its meta.json (what, for how much compute, for which
    primary model) and, with TrainConfig.plugin_eval_blocks, its plug-in score (global rank 0,
    which alone saves artifacts)."""
    run_dir: Path
    family: ModelFamily
    model: ModelConfig
    init: dict  # the start: the frozen parameters an artifact takes from it (the bias with train_output_bias false)
    trainable: tuple[str, ...]
    tokenizer: Path
    meta: dict  # every artifact's meta.json fields
    seq_flops: dict[bool, float]  # per sequence, exact (False) and the paper's (True)
    row_flops: tuple[float, float] | None  # exact, per sequence with no row projected and per row (family.row_flops)
    probe: PluginProbe | None
    fingerprint: dict  # the primary model's: {"primary_fingerprint": full, SAMPLED_KEY: sampled} (heldout.Primary)
    calibration: PrimaryCalibration | None = None

    @classmethod
    def of(cls, plan: Step2Plan, start: Step2Start, tokenizer: Path, data: Path) -> "ArtifactWriter":
        """The writer of `plan`'s artifacts from `start`, for the new vocabulary `tokenizer` and
        the prepared target data `data` (a raw corpus's, prepared by start_run)."""
        step, source, model = plan.step, plan.source, plan.model
        train, family = step.train, source.family
        meta = {"system": step.system, "lang": step.lang, "source": str(source.path), "source_tag": source.tag,
                "body_layers": model.num_layers, **plan.depth, **plan.expanded, **start.rows,
                "hidden_size": model.hidden_size, "vocab_size": model.vocab_size,
                "train_output_bias": train.train_output_bias, "embedding_init": train.embedding_init,
                "global_batch": train.global_batch(parallel.dp_world()), "seq_length": train.seq_length}
        if train.score_fraction != 1:  # scored a sample of the positions: its records say so (artifact.system_label)
            meta["score_fraction"] = train.score_fraction
        if train.replay_fraction:  # ordinary blocks of seq_length: counted in `tokens` and the FLOPs like the rest
            meta.update(replay_fraction=train.replay_fraction,
                        replay_blocks=replay_blocks(train.replay_fraction, meta["global_batch"]))
        if step.system == "minipost":  # the mini-model's N and K (its source's Step 1b)
            mini = MiniModelConfig(source.record["frozen_from"]["mini_layers"],
                                   source.record["frozen_from"]["new_layers"])
            meta.update(mini_layers=mini.one_depth("build_minipost"), new_layers=mini.new_layers)
        # The progress signal: each artifact through the primary model it is for, against the
        # unigram reference of the held-out text.
        probe = (PluginProbe(start.scorer, Text(plan.run.data_path, train.seq_length, train.plugin_eval_blocks))
                 if train.plugin_eval_blocks else None)
        seq_flops = {p: family.step_flops("adapt", model, train.seq_length, family.scored_fraction(train), paper=p)
                     for p in (False, True)}
        row_flops = family.row_flops("adapt", model, train.seq_length)
        # The primary model these embeddings plug into (MINIPOST's: the run its mini-model was
        # built from), known by its weights' fingerprint: Step 4 matches it by content, not by path;
        # every later load checks the weights by the sampled one (artifact.primary_changed).
        fingerprint = {"primary_fingerprint": start.primary.fingerprint, SAMPLED_KEY: start.primary.sampled}
        trainable = step2_trainable(family, model, train.train_output_bias)
        return cls(plan.run.output_dir, family, model, start.init, trainable, tokenizer, meta, seq_flops, row_flops,
                   probe, fingerprint, start.calibration(step, data))

    def __call__(self, update: int, ckpt_tag: str, run: int | None = None, rows: int | None = None,
                 sd: dict | None = None, scheduled: bool = True) -> None:
        """The artifact of the checkpoint `ckpt_tag` of update `update`. run: the updates run to
        reach it (LoopJob.after_save; None: `update`): fp16 steps skipped on an overflow computed
        their forward and backward, so the FLOPs and tokens count them. rows: the positions the
        head projected in them (LoopJob.after_save): the exact count's head terms count them, not
        the p of every position the paper's formula and a prediction assume (an encoder masks
        among ordinary pieces only: on the Bible 0.122 of the positions at s = 128, not 0.15);
        None (a run resumed from a checkpoint written before the count): p of every position."""
        sd = load_checkpoint(self.run_dir, ckpt_tag) if sd is None else sd  # fp32 master weights
        run = update if run is None else run
        batch = self.meta["global_batch"]
        flops = flops_by_rows(self.seq_flops[False], self.row_flops, batch * run, rows)
        meta = {**self.meta, "step": update, "tokens": batch * self.meta["seq_length"] * run, "flops": flops,
                **({"scored_rows": rows} if rows is not None and self.row_flops is not None else {}),
                **({"replay_tokens": self.meta["replay_blocks"] * self.meta["seq_length"] * run}
                   if "replay_blocks" in self.meta else {}),
                **({"skipped_updates": run - update} if run != update else {}),
                # a stop's checkpoint: a curve point the schedule's runs lack (a sweep scores none)
                **({"off_schedule": True} if not scheduled else {}),
                "flops_paper": self.seq_flops[True] * batch * run, "v100_days": device_days(flops),
                **self.fingerprint}
        tensors = self.tensors(sd)
        if self.calibration is not None:  # update 0's too: the start's bias was fitted through the mini-model
            tensors, record = self.calibration(tensors)
            meta.update(record)
        if self.probe is not None:
            scored = self.probe.score(tensors, meta)
            meta.update(scored)
            print(progress_line(update, scored), flush=True)
        write_artifact(self.run_dir / "embeddings" / ckpt_tag, tensors, self.tokenizer, meta)

    def save_start(self, resume: bool, train: TrainConfig) -> None:
        """Step 2's start as the artifact of update 0 (the new rows as initialised, before any
        update: the start `init` as its state), what Step 4 and the plug-in metric score as "init
        only" beside the trained embeddings. Global rank 0 (which alone saves artifacts).
        `resume`: a --resume of a recorded run (run.json, which the resume was checked against).
        It keeps the one it finds, and writes the artifact of every intact checkpoint that has
        none (a stop between a checkpoint's COMPLETE and its artifact: the resumed run would never
        write it, the final one included). Otherwise it is written even over one an earlier attempt
        left: a run that diverged before its first checkpoint starts again without --resume, and
        one that stopped before its record was written (the SLURM template's first launch passes
        --resume) resumes unchecked, both perhaps with another source, data or settings."""
        if not parallel.is_rank0():
            return
        embeddings, ckpt = self.run_dir / "embeddings", self.run_dir / "checkpoints"
        tag = checkpoint.tag_for(0)
        if not resume or not (embeddings / tag / ARTIFACT_FILE).is_file():
            self(0, tag, 0, 0, sd=self.init)
        if resume:
            for done in checkpoint.complete_tags(ckpt):
                if not (embeddings / done / ARTIFACT_FILE).is_file() and checkpoint.damaged(ckpt / done) is None:
                    update = int(done.removeprefix("step"))  # a stop's or pause's, off `train`'s schedule, marked so
                    self(update, done, *checkpoint.work_run(ckpt / done),
                         scheduled=train.on_schedule(update, train.train_iters))

    def tensors(self, sd: dict) -> dict:
        """An artifact's tensors (artifact.write_artifact) from the checkpoint `sd` (the trained
        parameters' fp32 master weights) and the start (a frozen parameter, such as the bias
        with train_output_bias false, is not in the checkpoint: it is still its start). An
        expanded vocabulary's are whole: the source rows (frozen, as they started) then the new
        rows."""
        def value(name: str) -> torch.Tensor:
            return (sd[name] if name in self.trainable else self.init[name]).float()

        out = {}
        for key, name in self.family.artifact_keys().items():
            if name not in self.init:
                continue
            out[key] = (torch.cat([self.init[name].float(), value(new_rows_name(name))])
                        if self.model.frozen_vocab_size else value(name))
        return out


def say_replay(replay: Replay, global_batch: int) -> None:
    """The replay as a run takes it: its blocks of each update, a whole number (data.replay_blocks),
    so the fraction trained can differ from --replay_fraction's."""
    blocks = replay_blocks(replay.fraction, global_batch)
    exact = math.isclose(blocks, replay.fraction * global_batch, abs_tol=1e-9)  # 0.57 x 100 is 56.99999999999999
    rounded = "" if exact else f" (--replay_fraction {replay.fraction} rounded)"
    print(f"replay: {blocks} of every update's {global_batch} blocks are source-language text from {replay.data}, "
          f"a fraction of {blocks / global_batch:.4g}{rounded}", flush=True)


def progress_line(update: int, scored: dict[str, float]) -> str:
    """What Step 2's log says of a checkpoint's plug-in score: whether the embeddings have passed
    the unigram reference, the first sign that they use the model's context."""
    gain = scored["plugin_gain"]
    verdict = ("past the unigram reference: the embeddings use the model's context" if gain > 0 else
               "not past the unigram reference yet: piece frequencies alone still predict better")
    return (f"plug-in metric at update {update}: contextual gain {gain:+.3f} nats (loss {scored['plugin_loss']:.3f}, "
            f"unigram reference {scored['unigram_loss']:.3f}); {verdict}")
