"""Vocabulary expansion (Step 2 --vocab_mode expand): the source tokenizer with the target
tokenizer's missing pieces appended after the source's ids, so every source id keeps its meaning.

The paper replaces the vocabulary; much of the field extends it instead, so that the source
language keeps working: the source's pieces keep their ids and rows (frozen), and only the rows
of the appended pieces train (models/layers.py holds them apart: the trainable parameter is the
block of new rows, not a masked full matrix).

Which pieces are new: the target's ordinary pieces whose surface form (tokenizer.pieces) the
source lacks, in the target's order (a SentencePiece unigram model lists them by score, so the
most useful come first). As many are kept as make the expanded size a multiple of
`EXPAND_MULTIPLE`: a tensor-parallel vocabulary is split evenly over its ranks, and a GPU's
matmuls prefer such sizes; at most EXPAND_MULTIPLE - 1 of the rarest pieces are dropped.

The merged tokenizer is of the source's kind:
    An imported BPE tokenizer (byte-level, or SentencePiece-style with byte fallback): the pieces
        as tokens after the model's rows, each with a merge after the source's (tokenizer.expand_hf).
    An imported WordPiece (BERT): the pieces as tokens after the model's rows (`▁foo` as `foo`,
        `oo` as `##oo`; an uncased source's in lower case); WordPiece has no merges, so a new
        piece is used wherever it is the longest match, in source text too.
    SentencePiece (mmadapt's, unigram or BPE)  the source model with the pieces appended, each
        scored below every source piece: unigram, its target log-probability shifted so that the
        best new piece sits just under the worst source piece (their order kept); BPE, ranked
        after every source merge. A new piece then wins only where it replaces several source
        pieces, so source-language text keeps its segmentation far more often than with the
        target's own scores (English Genesis-Exodus, 1000-piece English and German models: 7%
        of sentences change, against 36%; German text takes 13% more pieces than with those).
For a unigram model (mmadapt's), a text that the merged tokenizer encodes with no new piece gets
exactly the source's ids: Viterbi runs over a superset of the pieces with the source's scores
unchanged, so where the best segmentation uses no new piece it is the source's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2 as sp_model

from mmadapt.tokenizer import expand_hf, is_hf, pieces, source_form

EXPAND_MULTIPLE = 8

_NORMAL, _BPE = sp_model.ModelProto.SentencePiece.NORMAL, sp_model.TrainerSpec.BPE


@dataclasses.dataclass(frozen=True)
class Expansion:
    """A merged tokenizer (its file's bytes) and what it adds: source_size pieces kept, then
    `new` (the appended pieces' surface forms, in id order from source_size)."""
    model: bytes
    source_size: int
    new: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.source_size + len(self.new)

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.model)
        return path


def missing_pieces(source: list[str], target_pieces: list[str], ordinary: list[bool]) -> list[str]:
    """The ordinary target pieces (in target order) whose surface form the source lacks."""
    have, new = set(source), []
    for piece, ok in zip(target_pieces, ordinary):
        if ok and piece not in have:
            have.add(piece)
            new.append(piece)
    return new


def _cut(source_size: int, new: list[str]) -> list[str]:
    """`new`, cut to the count that makes the vocabulary a multiple of EXPAND_MULTIPLE."""
    return new[:max((source_size + len(new)) // EXPAND_MULTIPLE * EXPAND_MULTIPLE - source_size, 0)]


def _proto(path: Path) -> sp_model.ModelProto:
    proto = sp_model.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def expand(source: Path, target: Path) -> Expansion:
    """The merged tokenizer of the source tokenizer `source` and the target SentencePiece model
    `target` (module docstring). ValueError when the target adds no piece: nothing would train."""
    if is_hf(target):
        raise ValueError(f"the target tokenizer {target} is an imported Hugging Face tokenizer; expand appends the "
                         "pieces of a SentencePiece model (mmadapt preprocess trains one)")
    trg = _proto(target)
    src_pieces = pieces(source)
    form = source_form(source)  # an uncased WordPiece source's lower case: what its normaliser can produce
    candidates = missing_pieces(src_pieces, [form(p.piece) for p in trg.pieces], [p.type == _NORMAL for p in trg.pieces])
    if is_hf(source):
        model, new = expand_hf(source, candidates, EXPAND_MULTIPLE)
    else:
        new = _cut(len(src_pieces), candidates)
    if not new:
        raise ValueError(f"the target tokenizer {target} adds no piece to the source's {len(src_pieces)} (every "
                         f"ordinary piece is there already, or fewer than {EXPAND_MULTIPLE} are new): nothing to "
                         "train with --vocab_mode expand; use a larger target vocabulary, or --vocab_mode replace")
    if is_hf(source):
        return Expansion(model, len(src_pieces), tuple(new))
    merged = _proto(source)
    score = {p.piece: p.score for p in trg.pieces}
    lowest = min((p.score for p in merged.pieces if p.type == _NORMAL), default=0.0)
    shift = lowest - 1 - max(score[p] for p in new)
    bpe = merged.trainer_spec.model_type == _BPE
    for i, piece in enumerate(new):
        merged.pieces.add(piece=piece, score=lowest - 1 - i if bpe else score[piece] + shift, type=_NORMAL)
    merged.trainer_spec.vocab_size = len(merged.pieces)
    return Expansion(merged.SerializeToString(), len(src_pieces), tuple(new))


def check_expansion(source: Path, merged: Path) -> int:
    """The number of source pieces, after checking that the tokenizer `merged` is an expansion of
    `source` (its first pieces are the source's, id for id) that adds at least one piece."""
    src, got = pieces(source), pieces(merged)
    if got[:len(src)] != src or len(got) <= len(src):
        raise ValueError(f"the tokenizer {merged} is not an expansion of the source's {source} (its first "
                         f"{len(src)} pieces must be the source's, with new pieces after them): prepare the target "
                         "data with mmadapt preprocess --expand_from <source run>")
    return len(src)
