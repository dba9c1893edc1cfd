"""Step 2 --vocab_mode expand: the source vocabulary with the target's missing pieces appended, the
new rows' start on the output side and its calibration on source text, the source language
measured through the primary model, and the source-language text replayed in Step 2.

Everything an expanded vocabulary needs beyond replace mode lives here, in the order a run uses
it: the merged tokenizer (`expand`, `check_expansion`), the new pieces' output start
(`output_start`: bounded, worst_case or as the input side) and its calibration (`calibrate`), the
replay text (`replay_text`), and what every expand run reports (`SourceProbe`, `expand_report`).
What stays elsewhere: the HF tokenizers' own merge (tokenizer.expand_hf), the frozen source block of
each vocabulary-indexed weight (models/layers.py), the data plan of a raw corpus encoded with the
merged tokenizer (train.ExpandedText).

The merged vocabulary. The paper replaces the vocabulary; much of the field extends it instead,
so that the source language keeps working: the source's pieces keep their ids and rows (frozen),
and only the rows of the appended pieces train (models/layers.py holds them apart: the trainable
parameter is the block of new rows, not a masked full matrix).

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
        after every source merge, and only the characters and the pieces that a merge of two
        known pieces forms (`_formable_by_bpe`: BPE cannot reach the others). A new piece then wins only where it
        replaces several source pieces, so source-language text keeps its segmentation far more
        often than with the target's own scores (English Genesis-Exodus, 1000-piece English and
        German models: 7% of sentences change, against 36%; German text takes 13% more pieces
        than with those).
For a unigram model (mmadapt's), a text that the merged tokenizer encodes with no new piece gets
exactly the source's ids: Viterbi runs over a superset of the pieces with the source's scores
unchanged, so where the best segmentation uses no new piece it is the source's.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import torch
from sentencepiece import sentencepiece_model_pb2 as sp_model

from mmadapt.config import EXPAND_OUTPUT_STARTS, ModelConfig, TrainConfig
from mmadapt.corpora import resolve_corpus
from mmadapt.data import (TEXT, TOKENIZER, VALID, check_prepared, file_sha256, read_manifest, read_tokenizer,
                          replay_blocks, train_tokenizer)
from mmadapt.family import WORD, ModelFamily, OutputPath
from mmadapt.heldout import Primary, Scorer, Text, pretrained_on
from mmadapt.models.layers import new_rows_name
from mmadapt.parallel import from_rank0, is_rank0, launched_world_size, rank0_prepares
from mmadapt.run import RunSpec, Source
from mmadapt.tokenizer import (WORD_BOUNDARY, bare_proto, cut_to_multiple, expand_hf, is_hf, pieces, source_form,
                               sp_proto)


# --- the merged vocabulary ---------------------------------------------------------------------------

EXPAND_MULTIPLE = 8

_NORMAL, _BPE = sp_model.ModelProto.SentencePiece.NORMAL, sp_model.TrainerSpec.BPE


@dataclasses.dataclass(frozen=True)
class Expansion:
    """A merged tokenizer (its file's bytes) and what it adds: source_size pieces kept, then
    `new` (the appended pieces' surface forms, in id order from source_size)."""
    model: bytes
    source_size: int
    new: tuple[str, ...]
    # the target model's --vocab_size where it was trained here on the run's corpus (run.json
    # records it: a --resume reads the kept merged tokenizer, and another size went unnoticed)
    vocab_size: int | None = None

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


def _normal_forms(source: sp_model.ModelProto, candidates: list[str]) -> list[str]:
    """The `candidates` (in their order) that the SentencePiece model `source`'s normaliser leaves
    as they are: the merged model keeps that normaliser, so a piece it rewrites (a target trained
    without NFKC: full-width letters, ligatures, 'ｏ' for 'o'; '▁▁' where it collapses spaces)
    would be a row no text reaches."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=bare_proto(source).SerializeToString())
    # (and where it collapses runs of whitespace, a piece holding two '▁' together: a target
    # trained on double spaces with remove_extra_whitespaces false)
    run = 2 * WORD_BOUNDARY if source.normalizer_spec.remove_extra_whitespaces else None
    return [c for c in candidates if sp.normalize(c.replace(WORD_BOUNDARY, " ")) == c and not (run and run in c)]


def _formable_by_bpe(source: sp_model.ModelProto, candidates: list[str]) -> list[str]:
    """The `candidates` (in their order) that the SentencePiece BPE model `source` can form once they
    are appended, each merge ranked after every source merge and in the candidates' order (as
    `expand` appends them). BPE forms a piece only by merging two adjacent pieces that exist: one
    that the model, with the candidates kept so far, reads as exactly two known pieces is formed by
    its own merge, the last one possible there; any other would be a row no text reaches (a review
    found 72% of a German unigram model's new pieces so). A character is formed by no merge: BPE
    looks every character up before it merges, so a new one (a script, or German's ä over an
    English model) is kept, and the pieces built on it become formable. Shortest first: a piece of
    one length never enters the segmentation of another of that length, so each length is checked
    at once."""
    import sentencepiece as spm

    check = bare_proto(source)  # a piece as it is: '▁' where it has one, not added
    lowest = min((p.score for p in source.pieces if p.type == _NORMAL), default=0.0)
    rank = {c: i for i, c in enumerate(candidates)}
    kept: set[str] = set()
    for length in sorted({len(c) for c in candidates}):
        sp = spm.SentencePieceProcessor(model_proto=check.SerializeToString())
        for c in (c for c in candidates if len(c) == length):
            ids = sp.encode(c.replace(WORD_BOUNDARY, " "))
            if length == 1 or (len(ids) == 2 and sp.unk_id() not in ids):
                kept.add(c)
        for c in sorted((c for c in kept if len(c) == length), key=rank.get):
            check.pieces.add(piece=c, score=lowest - 1 - rank[c], type=_NORMAL)
    return [c for c in candidates if c in kept]


def expand(source: Path, target: Path) -> Expansion:
    """The merged tokenizer of the source tokenizer `source` and the target SentencePiece model
    `target` (module docstring). ValueError when the target adds no piece: nothing would train."""
    if is_hf(target):
        raise ValueError(f"the target tokenizer {target} is an imported Hugging Face tokenizer; expand appends the "
                         "pieces of a SentencePiece model (mmadapt preprocess trains one)")
    trg = sp_proto(target)
    src_pieces = pieces(source)
    form = source_form(source)  # an uncased WordPiece source's lower case: what its normaliser can produce
    candidates = missing_pieces(src_pieces, [form(p.piece) for p in trg.pieces], [p.type == _NORMAL for p in trg.pieces])
    merged = None if is_hf(source) else sp_proto(source)
    bpe = merged is not None and merged.trainer_spec.model_type == _BPE
    if merged is None:
        model, new = expand_hf(source, candidates, EXPAND_MULTIPLE, {form(p.piece): p.score for p in trg.pieces})
    else:
        new = cut_to_multiple(len(src_pieces), _normal_forms(merged, candidates), EXPAND_MULTIPLE)
        if bpe:  # only pieces a merge forms; again after each cut (a dropped piece may be another's part)
            while (formable := _formable_by_bpe(merged, new)) != new:
                new = cut_to_multiple(len(src_pieces), formable, EXPAND_MULTIPLE)
    if not new:
        raise ValueError(f"the target tokenizer {target} adds no piece to the source's {len(src_pieces)} (every "
                         f"ordinary piece is there already, or fewer than {EXPAND_MULTIPLE} are new): nothing to "
                         "train with --vocab_mode expand; use a larger target vocabulary, or --vocab_mode replace")
    if merged is None:
        return Expansion(model, len(src_pieces), tuple(new))
    score = {p.piece: p.score for p in trg.pieces}
    lowest = min((p.score for p in merged.pieces if p.type == _NORMAL), default=0.0)
    shift = lowest - 1 - max(score[p] for p in new)
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



MERGED_TOKENIZER = Path("tokenizer") / "merged.model"  # a run's merged tokenizer, built from a raw corpus


def merged_vocabulary(run: RunSpec, source: Source, vocab_size: int | None, seed: int, manifest: dict | None
                      ) -> tuple[int, int, Expansion | None]:
    """Step 2's merged vocabulary: (its size, the source's, and the merged tokenizer to build when
    the run prepares a raw corpus itself; None: the prepared dataset's, whose `manifest` is
    given, is it). A raw corpus with RunSpec.tokenizer: that target model merged into the
    source's; without it, a `vocab_size`-piece target model (default: the source model's) trained
    on the corpus as replace mode trains one (data.train_tokenizer, seeded, in a temporary
    directory), by global rank 0 alone for every rank: each rank training its own took every core
    of the host once per rank, and nothing would say if two came out apart (a host of another core
    count; the model's size follows from it). The others wait for it outside any collective
    (parallel.rank0_prepares: what rank 0 raises, they raise). A --resume reads the merged
    tokenizer the run kept."""
    if vocab_size is not None and (run.data_path is not None or run.tokenizer is not None):
        raise ValueError("--vocab_mode expand: the vocabulary is the source's with the target's new pieces "
                         "appended, its size follows from the tokenizers: drop --vocab_size")
    if run.data_path is not None:
        return manifest["vocab_size"], check_expansion(source.tokenizer, run.data_path / TOKENIZER), None
    if run.tokenizer is not None:
        read_tokenizer(run.tokenizer)
        expansion = expand(source.tokenizer, run.tokenizer)
        return expansion.size, expansion.source_size, expansion
    kept = run.output_dir / MERGED_TOKENIZER

    want = vocab_size or source.cfg.vocab_size

    def merged() -> Expansion:
        if run.resume and kept.is_file():  # rank 0's view decides: every rank makes the one call below
            size = check_expansion(source.tokenizer, kept)
            return Expansion(kept.read_bytes(), size, tuple(pieces(kept)[size:]), want)
        with tempfile.TemporaryDirectory() as tmp:
            target = train_tokenizer(resolve_corpus(run.corpus), Path(tmp) / "target", want, seed=seed,
                                     max_sentences=run.prep.tokenizer_sample_lines,
                                     threads=run.prep.tokenizer_threads)
            return dataclasses.replace(expand(source.tokenizer, target), vocab_size=want)
    expansion = rank0_prepares(merged, f"the merged vocabulary of {run.corpus}")
    return expansion.size, expansion.source_size, expansion

# --- an expanded vocabulary's output side (TrainConfig.expand_output_start) ---------------------------
# The new pieces join the softmax of a model that stays the source's: at any position they can only
# take probability mass from the source pieces, and the source-language loss there rises by
# exactly -log(1 - their share), which is also the KL from the source model's distribution to the
# expanded one. Hewitt ("Initializing new word embeddings for pretrained language models"): a new
# output row at the mean mu of the n source rows scores exp(mu . y + mean(b)) <= Z / n (Jensen;
# Z the source pieces' sum of exp(logit)). A row mu + d scores at most exp(excess(d)) times that,
# excess(d) = max over the head's normed output y of d . y (`logit_excess`), and a bias b_new
# scales it by exp(b_new - mean(b)). So k new pieces together add at most
#     Z / n * sum_i exp(excess(d_i) + b_new_i - mean(b))
# to the softmax's sum (`mass_bound`), whatever the text. The bounded start
# (`bounded_start`) chooses what it can of each row:
#   encoder (tied word embedding and an output bias): the row is also the input embedding, so it
#       stays --embedding_init's; each new bias entry is mean(b) - excess(d_i) + log(n eps / ((1 -
#       eps) k)), which caps the new pieces' share at eps = 1 - exp(-nats): the loss and the KL
#       rise by at most nats (TrainConfig.expand_source_nats) at any position, at update 0;
#   decoder with an output projection of its own (no bias): its new rows at mu (d = 0), the input
#       rows --embedding_init's: a rise of at most log(1 + k / n);
#   decoder with a tied projection (no bias): nothing but the row itself holds the mass back, so
#       the new rows start at mu on both sides (--embedding_init gives way): log(1 + k / n) again.
# The decoders' bound is Hewitt's, loose where k is near n (0.055 nats measured at k / n = 0.9, the
# demo's decoder, 2026-11-25). With no bias, no row bounds the share at every position (a row
# that scores low for every y would have to be -infinity), but it can be low where the source text
# puts y. The mean rise over source positions is convex in the row: `output_shift` walks down it
# from mu until it is nats / 2, half the encoder's bound, on source text (the source run's or
# the replay data's training split; held-out text measures it after, run.json's expand_report);
# `calibrate` applies it (run.json records how far the row moved, the rise it leaves
# on that text, and the worst-case bound, now loose). The encoder's worst case is far from what
# the source text sees (its new bias entries ~12 nats under the source mean on the demo's encoder,
# 5e-6 nats of rise on source text: the target pays for the slack), so it is calibrated the same
# way: `bias_shift` raises every new entry by one c until the mean rise on source text is nats / 2
# (run.json's `bias_shift`; the worst case rises by c with it).


def logit_excess(d: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None = None) -> torch.Tensor:
    """d [k, h] -> [k]: max over y = w * x_hat + beta, ||x_hat|| <= sqrt(h) (the head's LayerNorm or
    RMSNorm output, whatever its input) of d . y, by Cauchy-Schwarz sqrt(h) ||d * w|| + d . beta:
    how far above the mean row's logit a row mean + d can score anywhere."""
    d, w = d.float(), norm_weight.float()
    excess = d.shape[1] ** 0.5 * (d * w).norm(dim=1)
    return excess if norm_bias is None else excess + d @ norm_bias.float()


def mass_bound(excess: torch.Tensor, n: int) -> float:
    """The most, in nats, that k new pieces whose logits exceed the mean source row's by at most
    `excess` [k] (bias included) can raise the loss of a source piece, at any position: log(1 +
    sum_i exp(excess_i) / n) (the comment above)."""
    return float(torch.logsumexp(torch.cat([excess.double(), excess.new_zeros(1).double() + math.log(n)]), 0)
                 - math.log(n))


def _excess(path: OutputPath, head: dict, rows: dict) -> torch.Tensor:
    """[k]: the bound on each new piece's logit above the mean source row's, bias included, in
    the one-head model `head` (full state, source vocabulary) with the new rows `rows`."""
    d = rows[path.matrix].float() - head[path.matrix].float().mean(0)
    excess = logit_excess(d, head[path.norm_weight], head[path.norm_bias] if path.norm_bias else None)
    if path.bias is not None and path.bias in rows:
        excess = excess + rows[path.bias].float() - head[path.bias].float().mean()
    return excess


def bounded_start(path: OutputPath, heads: list[dict], new: dict[str, torch.Tensor], nats: float, word: str = WORD,
                  prior: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """The new rows `new` (name -> [k, ...], an --embedding_init start) with their output side
    started so that the new pieces take a bounded share of the mass (the comment above), in each
    one-head model of `heads` (full states of the source vocabulary that will score them: Step
    2's body and the primary model, whose heads differ for MINIJOINT; `word`: the family's input
    embedding, the output matrix too where it is tied; `nats`: the encoder's bound,
    TrainConfig.expand_source_nats) -> (rows, the bound in nats, the largest over `heads`).
    prior: log q [k] (sum of q 1), how the bias entries share the bound among the new pieces
    (the target text's frequencies: a frequent piece gets more of it, the bound is the same);
    None: equally (q = 1 / k)."""
    out, n = dict(new), heads[0][path.matrix].shape[0]
    k = out[path.matrix].shape[0]
    if path.matrix != word or path.bias is None:
        out[path.matrix] = heads[0][path.matrix].float().mean(0).expand(k, -1).clone()
    if path.bias is not None and path.bias in out:
        eps = -math.expm1(-nats)
        rows = {**out, path.bias: torch.zeros(k)}  # -_excess: mean(b) - excess(d_i) of each head
        under = torch.stack([-_excess(path, h, rows) for h in heads]).min(0).values
        out[path.bias] = (under + math.log(n * eps / ((1 - eps) * k)) if prior is None
                          else under + math.log(n * eps / (1 - eps)) + prior.float())
    return out, max(mass_bound(_excess(path, h, out), n) for h in heads)


def output_shift(y: torch.Tensor, lse: torch.Tensor, row: torch.Tensor, k: int, target: float
                 ) -> tuple[torch.Tensor, float]:
    """A decoder's bounded start, moved off the source text (the comment above): y [m, h] the
    head's normed outputs at m source positions, lse [m] the source logits' logsumexp there, row
    [h] the k new rows' start (the source rows' mean) -> (the new row [h], the mean rise in nats
    it leaves there). The nearest row to `row` whose mean rise, mean_i log(1 + k exp(y_i . r -
    lse_i)) (convex in r), is at most `target`: the minimiser of rise(r) + lam/2 ||r - row||^2
    (L-BFGS), lam found by bisection (log scale) as the largest that gets there; a row that moves
    no further than it must stays close to where the source puts the text (a far row scores
    unseen contexts high). Where no lam gets there, the lowest rise found."""
    y, base, mu = y.double(), lse.double() - math.log(k), row.detach().double()

    def rise(r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(y @ r - base).mean()

    def nearest(lam: float, start: torch.Tensor) -> tuple[torch.Tensor, float]:
        r = start.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([r], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                                line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = rise(r) + lam / 2 * (r - mu).square().sum()
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            return r.detach(), float(rise(r))

    with torch.no_grad():
        if float(rise(mu)) <= target:
            return mu.float(), float(rise(mu))
    lo, hi = -12.0, 6.0  # log10 lam: the far end reaches (nearly) the unconstrained minimum
    best = nearest(10 ** lo, mu)
    if best[1] > target:
        return best[0].float(), best[1]
    while hi - lo > 0.05:  # log10 lam to 5%: ~9 solves
        mid = (lo + hi) / 2
        r, got = nearest(10 ** mid, best[0])
        if got <= target:
            lo, best = mid, (r, got)
        else:
            hi = mid
    return best[0].float(), best[1]


def bias_shift(y: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor,
               target: float) -> tuple[float, float]:
    """An encoder's bounded start, raised toward the source text (the comment above): y [m, h] the
    head's normed outputs at m source positions, lse [m] the source logits' logsumexp there, rows
    [k, h] and bias [k] the new pieces' output rows and (bounded_start's) bias entries -> (c >= 0,
    the mean rise in nats it leaves there): the largest c to add to every new entry with mean_i
    log(1 + sum_j exp(y_i . rows_j + bias_j + c - lse_i)) <= target. The rise grows with c, so
    bisection finds it (to 1e-6 nats of c); where c = 0 is already over, c = 0."""
    excess = torch.logsumexp(y.double() @ rows.double().T + bias.double(), 1) - lse.double()  # [m]

    def rise(c: float) -> float:
        return float(torch.nn.functional.softplus(excess + c).mean())

    if rise(0.0) > target:
        return 0.0, rise(0.0)
    lo, hi = 0.0, 1.0
    while rise(hi) <= target:  # the rise grows without bound in c: this ends
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rise(mid) <= target else (lo, mid)
    return lo, rise(lo)


def bounded_over(path: OutputPath, heads: list[dict], state: dict) -> float:
    """The worst-case bound (mass_bound) on what the new rows of `state` (under new_rows_name)
    add to a source piece's loss, the largest over the one-head models `heads` (full states)."""
    new = {name: state[new_rows_name(name)] for name in (path.matrix, path.bias)
           if name is not None and new_rows_name(name) in state}
    return max(mass_bound(_excess(path, h, new), h[path.matrix].shape[0]) for h in heads)


def output_start(family: ModelFamily, body: ModelConfig, state: dict, primary: dict,
                 how: str = "embedding_init", nats: float = TrainConfig.expand_source_nats,
                 prior: torch.Tensor | None = None) -> tuple[dict, float]:
    """An expanded vocabulary's start (new_vocabulary's `state`, the new rows under
    `new_rows_name`s as --embedding_init starts them) with their output side started by
    `how` (TrainConfig.expand_output_start: "bounded" and "worst_case", bounded_start,
    which Step 2 then calibrates for "bounded" (`calibrate`); "embedding_init": as the
    input side), scored through the body's head and the primary model's (`primary`: its
    one-head full state, family.primary_model's) -> (the state, `new_mass_bound`: the bound in
    nats on what the new pieces can add to a source piece's loss at update 0). prior:
    bounded_start's (how the bound is shared among the new pieces)."""
    if how not in EXPAND_OUTPUT_STARTS:
        raise ValueError(f"unknown expand_output_start {how!r}; choose one of {', '.join(EXPAND_OUTPUT_STARTS)}")
    path, heads = family.output_path(body), [state, primary]
    new = {name: state[new_rows_name(name)] for name in family.vocab_params(body) if new_rows_name(name) in state}
    if how in ("bounded", "worst_case"):
        new, bound = bounded_start(path, heads, new, nats, family.word, prior)
    else:
        bound = max(mass_bound(_excess(path, h, new), state[path.matrix].shape[0]) for h in heads)
    return {**state, **{new_rows_name(name): rows for name, rows in new.items()}}, bound


# --- the source language through the primary model --------------------------------------------------------

class SourceProbe:
    """What an expanded vocabulary does to the source language, on source text (`text`) through
    the primary model (`scorer`'s), by its own objective (as the plug-in metric scores the
    target): its loss per scored piece with its own vocabulary (`before`), and, with an
    artifact's tensors swapped in (its source rows kept, the new rows appended: the softmax now
    spans the new pieces, so the loss moves with every source row frozen), the loss and the KL
    from the primary model's own distribution to the expanded one, averaged over the scored
    positions. The input is source ids only and the source rows are the model's own, so the
    expanded logits' first V_source columns are the source model's logits: its distribution is
    their softmax. The KL at a position is then -log(1 - the new pieces' share), which is also by
    how much the loss rises there: the two agree to rounding."""

    def __init__(self, scorer: Scorer, text: Text):
        self.scorer, self.family, self.cfg = scorer, scorer.family, scorer.primary.cfg
        self.source_size, self.data = self.cfg.vocab_size, f"{text.data} ({text.split})"
        self.held = scorer.heldout(text, self.source_size, unigram=False)
        self.scored, self.batches = self.held.scored, self.held.on_device

    @property
    def before(self) -> float:
        """The primary model's own loss on the text (its own vocabulary)."""
        return self.scorer.loss(self.held)

    @torch.no_grad()
    def head_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The primary head's normed output y [m, h] at the scored positions (what its vocabulary
        projection reads: a forward hook on the norm the family's OutputPath names) and the source
        logits' logsumexp [m] there."""
        model = self.scorer.model
        norm = model.get_submodule(self.family.output_path(self.cfg).norm_weight.rsplit(".", 1)[0])
        seen: list[torch.Tensor] = []
        hook = norm.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            logits = self.scorer.logits(self.batches)
        finally:
            hook.remove()
        # The norm saw the m scored rows (heldout.scored_logits through a model's rows), or all
        # b * s (a family whose logits takes no rows), whose scored rows are kept. m = b * s means
        # every position, in order: both agree.
        ys = [y if len(y) == len(masked_index) else y.reshape(-1, y.shape[-1]).index_select(0, masked_index)
              for y, (_, _, masked_index, _) in zip(seen, self.batches, strict=True)]
        self.projected = sum(y.reshape(-1, y.shape[-1]).shape[0] for y in seen)  # the rows the head projected
        return torch.cat(ys).float(), torch.cat([torch.logsumexp(l.float(), -1) for l in logits])

    def score(self, tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, float]:
        """tensors: an expanded artifact's ({"word_embeddings": [V', h], ...}), meta: its meta.json
        -> {"source_loss", "source_kl"} (nats per scored piece)."""
        loss = kl = 0.0
        for logits, (*_, targets) in zip(self.scorer.logits(self.batches, tensors, meta), self.batches):
            lq = torch.log_softmax(logits.float(), -1)[:, :self.source_size]  # [m, V_source]
            lp = torch.log_softmax(logits[:, :self.source_size].float(), -1)
            loss += float(-lq.gather(1, targets[:, None]).sum())
            kl += float((lp.exp() * (lp - lq)).sum())
        return {"source_loss": loss / self.scored, "source_kl": kl / self.scored}


def source_text(primary: Primary, data: Path | None, seq_length: int) -> Text | None:
    """The source-language text an expanded vocabulary is scored on: `data` (a prepared dataset in
    the primary model's ids, e.g. Step 2's replay data) or else the primary run's own data, each
    its validation split when it has one, else its training text; None for a run with no data (an
    import) and no `data`."""
    data = data or primary.record.get("data_path")
    if not data:
        return None
    return Text(Path(data), seq_length, split=VALID if read_manifest(data).get("valid") else TEXT)


def calibrate(body: ModelConfig, init: dict, scorer: Scorer, text: Text | None, nats: float, every_rank: bool = False
              ) -> tuple[dict, dict]:
    """A bounded start (`init`: Step 2's over `body`, its output side from `output_start`)
    calibrated on the source text `text` (the training split of Step 2's --replay_data, or else
    the source run's data), measured through the primary model (`scorer`'s, the one-head model
    the start was bounded through): a decoder's new row moved off it (output_shift), an encoder's
    new output-bias entries raised toward it (bias_shift), until the new pieces take nats / 2 of
    it (TrainConfig.expand_source_nats) -> (the start, what run.json records: `output_shift` how
    far the row moved (its norm) or `bias_shift` by how much the entries rose,
    `new_mass_calibrated` the rise left on that text, `new_mass_bound` the worst case again,
    `calibration_flops` what the probe's forward pass cost, a cost of the start apart from the
    artifacts' training `flops`, as Step 2's primary calibration's).
    Without text (an import and no --replay_data) the start stays the worst-case one (the
    encoder's bound, the decoder's mean row), said in one line.

    Where every rank of a launched job calls this (`every_rank`: Step 2's start), every rank runs
    the probe (its layers are the tensor-parallel ones: a tensor-parallel group runs them
    together) and global rank 0's result is every rank's, so that every rank starts from the same
    rows; the fit itself runs on the CPU in float64."""
    path = scorer.family.output_path(body)
    if text is None:
        if is_rank0():
            kept = "the worst-case bound" if path.bias is not None else "the source rows' mean"
            print(f"the new pieces' output start stays at {kept}: the source run holds no text to calibrate it on "
                  "(pass --replay_data, source text in its ids)")
        return init, {}
    probe = SourceProbe(scorer, text)
    y, lse = (t.cpu() for t in probe.head_outputs())
    blocks = sum(len(ids) for ids, *_ in probe.batches)
    cost = scorer.family.scoring_flops(scorer.primary.cfg, text.seq_length, blocks, probe.projected)
    matrix = new_rows_name(path.matrix)
    if path.bias is None:
        mean = init[matrix][0].float().cpu()
        row, rise = output_shift(y, lse, mean, init[matrix].shape[0], nats / 2)
        if every_rank:
            *row, rise = from_rank0(torch.tensor([*row.tolist(), rise], dtype=torch.float64)).tolist()
            row = torch.tensor(row)
        init = {**init, matrix: row.to(init[matrix].device, init[matrix].dtype).expand_as(init[matrix]).clone()}
        shift = {"output_shift": float((row - mean).norm())}
    else:
        bias = new_rows_name(path.bias)
        c, rise = bias_shift(y, lse, init[matrix].float().cpu(), init[bias].float().cpu(), nats / 2)
        if every_rank:
            c, rise = from_rank0(torch.tensor([c, rise], dtype=torch.float64)).tolist()
        init = {**init, bias: init[bias] + c}
        shift = {"bias_shift": c}
    bound = bounded_over(path, [init, scorer.primary.state], init)
    return init, {**shift, "new_mass_calibrated": rise, "new_mass_bound": bound, "calibration_flops": cost}


def expand_report(scorer: Scorer, final: tuple[dict, dict], start: dict, lang: str, target: Text | None,
                  source: Text | None) -> dict:
    """What every expanded-vocabulary run reports (printed, and in run.json): on held-out source
    text `source` through the primary model (`scorer`'s: SourceProbe), its loss with its own
    vocabulary, and the loss and the KL from its own distribution with the new pieces in its
    softmax, at update 0 (the start `start`, artifact tensors) and at the end (`final`: the last
    artifact's tensors and meta.json); beside them the plug-in target metric at both on the
    target data's validation split `target` (None: the data hold none, said so)."""
    tensors, meta = final
    report = {}
    if source is not None:
        probe = SourceProbe(scorer, source)
        before, first, last = probe.before, probe.score(start, meta), probe.score(tensors, meta)
        seen = pretrained_on(source, scorer.primary.record)  # training text: no held-out score
        report = {"source_loss_before": before, "source_loss_start": first["source_loss"],
                  "source_kl_start": first["source_kl"], "source_loss_after": last["source_loss"],
                  "source_kl_after": last["source_kl"], "source_text": probe.data, "scored_pieces": probe.scored,
                  "source_text_split": source.split, "source_text_pretrained_on": seen}
        if seen:
            print(f"note: the source text below ({source.data}, its {source.split} split) may be text the primary "
                  "model trained on, not held-out text: for a held-out score pass as --replay_data source text it did "
                  "not train on (its pretraining data's own validation split, or another corpus)")
        print(f"source language through the primary model ({probe.scored} pieces of {probe.data}): loss "
              f"{before:.4f} with its own vocabulary; with the new pieces {first['source_loss']:.4f} at update 0 "
              f"(KL {first['source_kl']:.4f}), {last['source_loss']:.4f} at the end (KL {last['source_kl']:.4f})")
    if target is not None:
        held = scorer.heldout(target, tensors["word_embeddings"].shape[0])
        loss, loss_start = scorer.loss(held, tensors, meta), scorer.loss(held, start, meta)
        report.update(plugin_gain=held.unigram - loss, plugin_loss=loss, unigram_loss=held.unigram,
                      plugin_gain_start=held.unigram - loss_start)
        print(f"{lang} through the primary model (plug-in): contextual gain {held.unigram - loss_start:.3f} nats at "
              f"update 0, {held.unigram - loss:.3f} at the end (loss {loss:.3f}, unigram reference "
              f"{held.unigram:.3f})")
    else:
        print(f"note: no plug-in {lang} score: the target data hold no validation split (mmadapt preprocess "
              "--valid_fraction 0.03 --expand_from <source run>, then --data_path)")
    return report


# --- source-language replay in Step 2 ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Replay:
    """Step 2's source-language replay: `fraction` of every update's blocks from the prepared
    dataset `data` (source text in the run's vocabulary, checked by `replay_text`); `valid`: the
    dataset holds a validation split (the expand report scores the source language on it)."""
    data: Path
    fraction: float
    valid: bool = False


def replay_text(train: TrainConfig, tokenizer: Path | None, layout: ModelConfig) -> Replay | None:
    """Step 2's replay (train.replay_fraction > 0), its text checked before any work, else None.
    The replay text must be in the run's vocabulary, so encoded with `tokenizer`: expand, the
    source run's (its ids are the merged vocabulary's first ones: the source's own segmentation,
    what the source model was trained on and its loss is measured on); replace, the target
    tokenizer (the new embeddings learn the source text's pieces too; None: the run would only
    train it, from a raw corpus). Refused in one line: text that is not a prepared dataset, not
    encoded with `tokenizer`, or a --replay_fraction that rounds to no block or every block of
    the global batch (`layout`: the run's model config, its parallel sizes)."""
    if not train.replay_fraction or train.replay_data is None:  # half of the pair: TrainConfig.validate says so
        return None
    if tokenizer is None:
        raise ValueError("--replay_data with --vocab_mode replace is source text in the target vocabulary, which this "
                         "run would only train: prepare the target data first (mmadapt preprocess) and pass "
                         "--data_path, or pass --tokenizer")
    data = Path(train.replay_data)
    # a prepared dataset whole, as the target data must be (a text.bin cut short gave every replay
    # block nothing to score, and the run said it replayed), or one line saying it is not
    manifest = check_prepared(data)
    if file_sha256(data / TOKENIZER) != file_sha256(tokenizer):
        raise ValueError(f"--replay_data {data} was not encoded with {tokenizer}, the tokenizer whose ids the "
                         "replay text needs here: prepare it with mmadapt preprocess --tokenizer "
                         f"{tokenizer} into a new --output_dir")
    dp = launched_world_size() // (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size)
    blocks, batch = replay_blocks(train.replay_fraction, train.global_batch(dp)), train.global_batch(dp)
    if not 1 <= blocks < batch:
        raise ValueError(f"--replay_fraction {train.replay_fraction} of a global batch of {batch} blocks rounds to "
                         f"{'no block' if blocks < 1 else 'every block, leaving no target text'}: "
                         f"{'raise' if blocks < 1 else 'lower'} it, or raise the batch")
    return Replay(data, train.replay_fraction, bool(manifest.get("valid")))
