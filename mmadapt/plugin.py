"""Step 4 without a task: do the new embeddings plug into the primary model?

The plug-in metric is the loss of held-out target-language text, scored by the model family's
objective (objectives.py: masked pieces for the encoder, next pieces for the decoder), through the
**primary** model's primary head (its last layer) with a Step-2 artifact swapped in: word
embeddings (tied to the output projection) and output bias (heldout.py scores). For MINIJOINT and
MINIPOST the embeddings were trained over the mini-model and are scored through a full model they
never saw; that they work there is the paper's claim.

A loss alone does not say whether the model uses context: the output bias alone can learn the
target pieces' frequencies. So every artifact is scored beside references on the same scored
positions:
    unigram     the loss of the unigram distribution of the target pieces (counted on the Step-2
                training text, add-one smoothed): what the output bias alone can reach
    start       the embeddings Step 2 started from (its artifact of update 0, as initialised by
                TrainConfig.embedding_init), which is also scored as a point of its own
and the headline is the **contextual gain**, unigram - loss (nats per scored piece). The
ceiling is an artifact trained over the full primary model of the same source run (for
MINIJOINT: `adapt --system bl_base --source <minijoint run>`), recorded as system
`<recipe>:full` (artifact.system_label).

Masking is deterministic (the dataset's validation split, selected with a fixed seed), so the
curves of one language are comparable across systems. The model is built once, on the
device in Step 4's precision (devices.eval_dtype), and each artifact is swapped into it in
place; the held-out batches go to the device once per language. Needs no process group.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmadapt import checkpoint
from mmadapt.adapt import AdaptEmbeddings, StartRule, Step2Start, body_config
from mmadapt.artifact import (ARTIFACT_FILE, PrimaryRef, artifact_dirs, artifact_primary, artifact_primary_ref,
                              check_primary_unchanged, read_artifact, record_base, swap_key, trained_for)
from mmadapt.bpb import BATCH_TOKENS, BPB_BYTES, ByteScorer
from mmadapt.checkpoint import tag_for
from mmadapt.data import TOKENIZER, file_sha256, read_manifest
from mmadapt.devices import progress
from mmadapt.evaluate import apart_runs
from mmadapt.graft import check_once, grafted, not_a_graft
from mmadapt.heldout import Primary, Scorer, Text, pretrained_on
from mmadapt.run import read_source

METRIC = "contextual_gain"


def start_embeddings(adapt_run: Path, tokenizer: Path) -> dict:
    """The embeddings and bias the adapt run started from: its artifact of update 0 where Step 2
    saved one (adapt.ArtifactWriter.save_start); for a run recorded before that, recomputed
    (adapt.Step2Start.build, as the run's record describes its step and start rule, over its
    data: AdaptEmbeddings.recorded, StartRule.recorded; calibrated to the primary as the run's
    artifacts are, Step2Start.artifact) for its vocabulary `tokenizer`."""
    start = adapt_run / "embeddings" / tag_for(0)
    if (start / ARTIFACT_FILE).is_file():
        return read_artifact(start)[0]
    run = json.loads((adapt_run / "run.json").read_text())
    step = AdaptEmbeddings.recorded(run)
    source = read_source(step.source, step.source_tag)
    body = body_config(source.family, step.system, source.cfg, step.mini_layers)
    data = Path(run["data_path"]) if run.get("data_path") else None
    start = Step2Start.build(source, body, step, tokenizer, data, StartRule.recorded(run))
    return start.tensors() if data is None else start.artifact(step, data)


def source_text_data(adapt_run: Path, primary: Primary) -> Path | None:
    """The source-language text an expanded vocabulary's bits per byte are measured on: the adapt
    run's replay data, else the primary run's own data (expand.source_text's choice); None for
    neither (an imported primary and no --replay_data)."""
    run = json.loads((adapt_run / "run.json").read_text())
    data = (run.get("train") or {}).get("replay_data") or primary.record.get("data_path")
    return Path(data) if data else None


def plugin_records(primary_run: Path, adapt_runs: list[Path], data_paths: dict[str, Path], seq_length: int,
                   blocks: int = 256, batch_size: int = 32, seed: int = 0, bpb_bytes: int = BPB_BYTES,
                   graft: bool = False, bpb_batch_tokens: int = BATCH_TOKENS) -> list[dict]:
    """Plug-in records of every artifact of `adapt_runs` (whose embeddings belong to the primary
    model of `primary_run`), scored on the validation split of `data_paths[lang]` (a prepared
    dataset whose tokenizer is the artifacts'), and in bits per byte on the first `bpb_bytes`
    of its raw held-out text (module docstring), in batches of at most `bpb_batch_tokens`
    positions. graft: the artifacts were trained over a base model of which `primary_run` is a
    fine-tuned sibling (graft.check_once). An artifact that swaps in what an
    earlier one did (artifact.swap_key: each run's start is its update-0 artifact) is scored once."""
    paths = artifact_dirs(adapt_runs)
    metas = [checkpoint.read_json(path / "meta.json", "Step-2 artifact file") for path in paths]
    prepared: dict[str, str] = {}  # the languages whose dataset was checked to be one -> its tokenizer's sha256
    for path, meta in zip(paths, metas):  # each artifact's held-out data, before the primary's weights are read
        lang = meta["lang"]
        if lang not in data_paths:
            raise ValueError(f"no held-out {lang} text: pass a prepared {lang} dataset with a validation split")
        if lang not in prepared:  # a prepared dataset, or refused naming what it is
            read_manifest(data_paths[lang])
            prepared[lang] = file_sha256(Path(data_paths[lang]) / TOKENIZER)
        if prepared[lang] != file_sha256(path / "spm.model"):
            raise ValueError(f"{path} uses another tokenizer than {data_paths[lang]}: score it on the dataset Step 2 "
                             "trained on")
    # the primary's checkpoint the artifacts were trained for, not its newest (adapt --source_tag, a
    # source trained on since): a graft's primary is a sibling, whose checkpoints are its own
    primary = Primary.read(primary_run, None if graft else trained_for(Path(primary_run), metas))
    siblings: dict = {}  # graft.check_once's checks of the artifacts, by key
    # Artifacts name their primary model by its weights' fingerprint (older ones by path).
    ref = PrimaryRef(Path(primary_run), primary.fingerprint)
    scorer = Scorer(primary)  # once: every artifact (and start) is swapped into its model
    per_byte = ByteScorer(scorer, seq_length, bpb_bytes, bpb_batch_tokens)
    held = {}  # per language: the held-out set
    starts: dict[Path, tuple[float, float]] = {}
    for lang in prepared:  # its raw held-out text (kept): a changed corpus is refused now
        per_byte.text(data_paths[lang])
    for path, meta in zip(paths, metas):  # every refusal before any scoring (and before the progress bar)
        if graft and artifact_primary_ref(meta).same(ref):
            raise not_a_graft(path, primary_run)
        if not artifact_primary_ref(meta).same(ref):
            base = artifact_primary(meta).resolve()
            if base == Path(primary_run).resolve():  # that run, with other weights than Step 2 read
                check_primary_unchanged(path, meta, recorded=primary.fingerprint)
            if not graft or base == Path(primary_run).resolve():
                raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)}, not "
                                 f"{primary_run}" + (" (their weights differ)" if meta.get("primary_fingerprint") else
                                                     "") + ("" if graft else ": if it is a model fine-tuned from that "
                                                            "one, score the graft with --graft"))
            check_once(siblings, base, Path(primary_run), meta)
        if meta.get("vocab_mode") == "expand":  # the source text its bits per byte read, likewise
            source = source_text_data(path.parent.parent, primary)
            if source is not None and read_manifest(source).get("valid"):
                per_byte.text(source)
    records, scored = [], {}  # scored: (loss, bits per byte) by swap_key and language
    for path in progress(paths, "plug-in metric"):
        emb, tok, meta = read_artifact(path)
        lang = meta["lang"]
        data = Path(data_paths[lang])
        if lang not in held:
            held[lang] = scorer.heldout(Text(data, seq_length, blocks, min(batch_size, blocks), seed),
                                        emb["word_embeddings"].shape[0])
        text, raw = held[lang], per_byte.text(data)

        def score(art: dict) -> tuple[float, float]:  # once per content: a run's start is its update 0
            key = (swap_key(art, art.keys(), meta, tok), lang)
            if key not in scored:
                scored[key] = scorer.loss(text, art, meta), per_byte.score(raw, tok, art, meta)["bpb"]
            return scored[key]

        run = path.parent.parent
        if run not in starts:
            starts[run] = score(start_embeddings(run, tok))
        loss, bpb = score(emb)
        record = {**record_base(meta, scorer.family.objective.plugin_task), "metric": METRIC,
                  "score": text.unigram - loss, "chance": 0.0, "loss": loss, "unigram_loss": text.unigram,
                  "start_loss": starts[run][0], "start_gain": text.unigram - starts[run][0],
                  "masked_pieces": text.scored, "artifact": str(path),
                  "bpb": bpb, "start_bpb": starts[run][1],
                  "none_bpb": per_byte.none(raw), "bpb_bytes": raw.bytes, "bpb_seq_length": per_byte.seq_length,
                  "bpb_text": raw.digest, "heldout_tokenizer": prepared[lang][:16],
                  "bpb_unknown_share": per_byte.unknown_share(raw, tok),
                  "none_bpb_unknown_share": per_byte.unknown_share(raw, per_byte.own_tokenizer),
                  "bpb_folds": per_byte.folds(tok, raw), "none_bpb_folds": per_byte.folds(per_byte.own_tokenizer, raw),
                  **_source_bits(per_byte, run, primary, tok, emb, meta)}
        records.append(record if artifact_primary_ref(meta).same(ref) else grafted(record, primary_run))
    apart_runs(records)  # two runs of one system and language: two curves, as the task records keep them
    return records


def _source_bits(per_byte: ByteScorer, run: Path, primary: Primary, tok: Path, emb: dict, meta: dict) -> dict:
    """An expanded vocabulary's bits per byte on held-out source text beside the primary model's
    own ({} for a replaced one, and where no source text with a validation split is at hand)."""
    if meta.get("vocab_mode") != "expand":
        return {}
    data = source_text_data(run, primary)
    if data is None or not (read_manifest(data).get("valid")):
        return {}
    return source_bits(per_byte, data, tok, emb, meta, primary.record)


def source_bits(per_byte: ByteScorer, data: Path, tok: Path, emb: dict, meta: dict, primary: dict | None = None
                ) -> dict:
    """The source-language text of the prepared dataset `data` (its validation split) in bits
    per byte through the primary model: with its own tokenizer and embeddings
    (`source_none_bpb`), with the expanded artifact (`emb`, its merged tokenizer `tok`:
    `source_bpb`), and with the artifact read by the source's own tokenizer
    (`source_own_tokenizer_bpb`). The last parts the source language's cost in two: its source
    rows are the model's own (expand keeps them bit for bit), so it moves from `source_none_bpb`
    only by the probability the new pieces' output rows take in the softmax; the rest, to
    `source_bpb`, is where the merged tokenizer cuts source text with a new piece.
    `source_bpb_pretrained_on`: whether that text may be text the primary model (its run's record
    `primary`) trained on (heldout.pretrained_on; None: unknown), when it is no held-out text."""
    raw = per_byte.text(data)
    seen = None if primary is None else pretrained_on(Text(Path(data), 0), primary)
    return {"source_bpb": per_byte.score(raw, tok, emb, meta)["bpb"],
            "source_own_tokenizer_bpb": per_byte.score(raw, per_byte.own_tokenizer, emb, meta)["bpb"],
            "source_none_bpb": per_byte.none(raw), "source_bpb_text": str(data), "source_bpb_pretrained_on": seen}
