"""Held-out scoring that Steps 1 (fit-head), 2 and 4 share: a primary model with its primary
head alone on the evaluation device, the held-out blocks of a prepared dataset scored by the
family's objective, the unigram reference, and artifacts swapped into that model.

For the encoder every scored position's input is <mask> (`heldout_batches`: the positions
pretraining's masking selects, none left visible, Objective.heldout), so the loss is what the
model predicts from the context alone; for the decoder every next piece is scored. The unigram
reference is the loss of the frequencies of the pieces the rows can score (counted on the
dataset's training text, add-one smoothed; `reference_logprobs`): what an output bias alone can
reach. Masking is seeded, so every artifact of
one tokenizer is scored on the same positions. Needs no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mmadapt.artifact import swap_tensors
from mmadapt.checkpoint import read_json
from mmadapt.config import ModelConfig, PreprocessConfig, TrainConfig
from mmadapt.data import TEXT, TOKENIZER, VALID, SentenceRows, read_manifest
from mmadapt.devices import device_of, host_to_device, on_eval_device, swapped
from mmadapt.family import ModelFamily
from mmadapt.models.layers import Padding, gathered, masked_positions, takes_rows
from mmadapt.objectives import MLM, Objective
from mmadapt.parallel import device
from mmadapt.run import (RUN_FILE, RUN_TOKENIZER, Source, read_source, require_head, sampled_fingerprint, text_prefix,
                         weights_fingerprint)
from mmadapt.tokens import EOS_ID, NUM_SPECIAL

UNIGRAM_MAX_TOKENS = 50_000_000  # counted from the start of the training text: plenty for frequencies


# --- the primary model, its primary head alone -----------------------------------------------------------

def primary_head(family: ModelFamily, cfg: ModelConfig, state: dict[str, torch.Tensor]
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A run's full weights -> the model with only its primary head (after its last layer), as a
    one-head config (dropout off) and state dict (that head renamed head 0)."""
    cfg, state = family.primary_model(cfg, state)
    return dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0), state


def primary_head_state(primary_run: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`primary_head` of the run `primary_run` (its newest checkpoint)."""
    source = read_source(primary_run)
    require_head(source, "the plug-in metric")
    return primary_head(source.family, source.cfg, source.weights())


@dataclasses.dataclass
class Primary:
    """The primary model an artifact plugs into, read once: its run (`ref`: run_dir and tag; its
    record), its family, its one-head config and state (`primary_head`), and its full weights'
    fingerprints (run.weights_fingerprint, what records compare, and run.sampled_fingerprint, what
    a load checks the weights by; None where they were not asked for)."""
    ref: dict
    record: dict
    family: ModelFamily
    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    fingerprint: str | None = None
    sampled: str | None = None

    @classmethod
    def of(cls, source: Source, weights: dict[str, torch.Tensor], fingerprint: bool = True) -> "Primary":
        """The primary model of the run `source` from its full `weights` (already read)."""
        cfg, state = primary_head(source.family, source.cfg, weights)
        return cls({"run_dir": str(source.path), "tag": source.tag}, source.record, source.family, cfg, state,
                   *((weights_fingerprint(weights), sampled_fingerprint(weights)) if fingerprint else (None, None)))

    @classmethod
    def read(cls, run_dir: Path, tag: str | None = None, what: str = "the plug-in metric") -> "Primary":
        """The run `run_dir`'s primary model at `tag` (default: its newest checkpoint); `what`
        names the step in the refusal of a headless run."""
        source = read_source(run_dir, tag)
        require_head(source, what)
        return cls.of(source, source.weights())

    def text_prefix(self, data: Path) -> list[int] | None:
        """The ids this model's tokenizer puts before a text of the prepared dataset `data` (run.
        text_prefix: how its held-out rows are laid out; None for mmadapt's own packed stream)."""
        return text_prefix(self.record, Path(self.ref["run_dir"]) / RUN_TOKENIZER, Path(data) / TOKENIZER)


def scoring_model(family: ModelFamily, cfg: ModelConfig, state: dict, on: torch.device | None = None
                  ) -> torch.nn.Module:
    """The family's one-head LM with `state` (vocab from its rows), on `on` (default: the device
    for evaluation) in its evaluation precision: built there at once, so fp32 on the CPU is
    `state` itself, not a copy of it rounded to a GPU's bf16 on the way."""
    cfg = dataclasses.replace(cfg, vocab_size=state[family.word].shape[0])
    model = family.build_lm(cfg)
    model.load_state_dict(state)
    return on_eval_device(model, on or device())


# --- held-out text ----------------------------------------------------------------------------------------

def piece_counts(data_path: Path, vocab_size: int) -> np.ndarray:
    """How often each piece [V] occurs in the dataset's training text (its first
    UNIGRAM_MAX_TOKENS tokens)."""
    manifest = read_manifest(data_path)
    tokens = np.memmap(Path(data_path) / f"{TEXT}.bin", dtype=manifest["dtype"], mode="r")[:UNIGRAM_MAX_TOKENS]
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]


def unigram_logprobs(data_path: Path, vocab_size: int, counts: np.ndarray | None = None) -> torch.Tensor:
    """log p(piece) [V] of every piece of the dataset's training text, add-one smoothed (from
    `counts`, piece_counts', where read already): what Step 1's output biases start at
    (output_bias_init unigram), and Step 2's fitted start in runs recorded before 2026-12-02
    (StartRule.bias_target "every"). The plug-in metric's reference counts only the pieces it
    scores (reference_logprobs), and so do the output-bias fits now (target_logprobs)."""
    counts = (piece_counts(data_path, vocab_size) if counts is None else counts) + 1.0
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def _scorable(counts: np.ndarray, objective: Objective, prefix: list[int] | None) -> np.ndarray:
    """`counts` [V] (float64) with the pieces no scored position can be set to 0: for a masked
    objective every special piece (data.mask_tokens selects none), for an imported decoder's
    sentence rows (`prefix` given) </s> (data.SentenceRows leaves it out); mmadapt's packed causal
    blocks score every piece."""
    counts = counts.astype(np.float64)
    if objective.masked:
        counts[:NUM_SPECIAL] = 0.0
    elif prefix is not None:
        counts[EOS_ID] = 0.0
    return counts


def target_logprobs(data_path: Path, vocab_size: int, objective: Objective = MLM, prefix: list[int] | None = None,
                    counts: np.ndarray | None = None) -> torch.Tensor:
    """log p(piece) [V] that an output bias is fitted to (Step 2's fitted start and its
    calibration to the primary, fit-head's start): the frequencies of the pieces a scored
    position can be (reference_logprobs' counts), add-one smoothed over every piece, so finite
    everywhere (a piece no position is keeps the one count alone). Fitted to every piece's
    frequencies instead (unigram_logprobs), an encoder's start gave each sentence's </s> its
    share, about 3.5% of the mass on the Bible, and read about 0.035 nats above the reference."""
    counts = piece_counts(data_path, vocab_size) if counts is None else counts
    counts = _scorable(counts, objective, prefix) + 1.0
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def reference_logprobs(data_path: Path, vocab_size: int, objective: Objective = MLM, prefix: list[int] | None = None
                       ) -> torch.Tensor:
    """The plug-in metric's unigram reference, log p(piece) [V]: the frequencies in the dataset's
    training text of the pieces the held-out rows can score (`heldout_batches`' layout), add-one
    smoothed over those alone; -inf for the others. Masked: no special piece is ever selected
    (data.mask_tokens); an imported decoder's sentence rows leave each sentence's </s> out (data.
    SentenceRows); mmadapt's packed causal blocks score every piece of the stream, </s> included.
    Counted over every piece (unigram_logprobs), each sentence's </s> took about 3.5% of the mass
    from the pieces scored, and every contextual gain read 0.035 nats (de, ru) above what the
    best output bias alone reaches."""
    counts = _scorable(piece_counts(data_path, vocab_size) + 1.0, objective, prefix)
    with np.errstate(divide="ignore"):
        return torch.from_numpy(np.log(counts / counts.sum())).float()


def heldout_batches(text: "Text", vocab_size: int, objective: Objective = MLM, prefix: list[int] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `text.blocks` blocks of the dataset's `text.split` in a seeded order, scored by
    the family's objective: the same positions for every artifact of this tokenizer.

    MLM: the positions pretraining's masking selects (a fixed seed), every one of them replaced by
    <mask> (Objective.heldout says why: tests/test_plugin.py shows a model that predicts its
    input piece beating the unigram reference under BERT's 80/10/10, and unable to here).
    Causal: packed blocks of mmadapt's stream; an imported decoder's (`prefix`: the ids its own
    tokenizer puts before a text, run.run_text_layout) one sentence per row laid out as that
    tokenizer lays it out (data.SentenceRows), so that the metric's inputs are the ones the model
    was trained to read."""
    # Causal: every position (score_fraction 1), whatever Step 2 scored: the metric measures the artifact.
    held_out = TrainConfig(seq_length=text.seq_length, seed=text.seed, train_micro_batch_size_per_gpu=text.batch_size,
                           score_fraction=1.0)
    if prefix is not None and not objective.masked:
        data = SentenceRows(text.data, held_out, vocab_size, prefix, split=text.split)
    else:
        data = objective.batches(text.data, held_out, vocab_size, split=text.split)
    blocks = min(text.blocks, len(data))
    if blocks == 0:
        raise ValueError(f"{text.data}'s {'validation split' if text.split == VALID else 'text'} holds no block "
                         f"of {text.seq_length}: prepare it with a "
                         "larger --valid_fraction")
    n, rest = divmod(blocks, text.batch_size)
    out = [objective.heldout(*data.micro_batch(k, 0)) for k in range(n)]
    if rest:  # the blocks after the last whole batch: a smaller one (every block asked for is scored)
        out.append(objective.heldout(*(t[:rest] for t in data.micro_batch(n, 0))))
    return out


def on_device(batches: list, device: torch.device) -> list:
    """Held-out (ids [b, s], labels [b, s]) batches as (ids, Padding, masked_index [m],
    targets [m]) on `device`: the padding and masked positions counted on the host, where that
    costs no wait for the device."""
    return [(host_to_device(ids, device), Padding.of(ids),
             *(host_to_device(t, device) for t in masked_positions(labels))) for ids, labels in batches]


@torch.no_grad()
def summed_nats(model: torch.nn.Module, batches: list) -> float:
    """The summed loss (nats) of a one-head LM over `on_device` batches (the model's own forward:
    its loss is the batch's mean over its m scored pieces, times m). Summed on the device and read
    once at the end: no host-device synchronisation per batch."""
    total = 0.0
    for ids, padding, masked_index, targets in batches:
        if not len(targets):  # a short block with no position selected: its mean loss is NaN (0 / 0)
            continue
        loss, _ = model(ids, masked_index=masked_index, targets=targets, padding=padding)
        total = total + loss * len(targets)
    return float(total)


def masked_loss(model: torch.nn.Module, batches: list) -> float:
    """Mean loss per masked piece of a one-head LM over `on_device` batches (summed_nats / their
    scored pieces)."""
    return summed_nats(model, batches) / sum(len(targets) for *_, targets in batches)


def unigram_loss(logp: torch.Tensor, batches: list) -> float:
    labels = torch.cat([l[l.ge(0)] for _, l in batches])
    return float(-logp[labels].mean())


def scored_logits(model: torch.nn.Module, batches: list) -> list[torch.Tensor]:
    """The primary head's logits [m_b, V] at the scored positions of each of the `on_device`
    batches. A family whose `logits` takes `rows` (family.py) computes the last layer and the head
    there alone; any other's whole logits [b, s, V] are made and their m rows kept."""
    if takes_rows(type(model), "logits"):
        return [model.logits(ids, padding, rows=masked_index)[0] for ids, padding, masked_index, _ in batches]
    return [gathered(model.logits(ids, padding)[0], masked_index) for ids, padding, masked_index, _ in batches]


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Held-out blocks of one dataset in one vocabulary, as every artifact of it is scored: the
    batches (on the host and on the scoring model's device), the unigram reference's loss on
    them, and how many pieces they score."""
    batches: list
    on_device: list
    unigram: float | None
    scored: int


@dataclasses.dataclass(frozen=True)
class Text:
    """Which held-out text to score: a prepared dataset, its split, and how it is cut into blocks."""
    data: Path
    seq_length: int
    blocks: int = 256
    batch_size: int = 32
    seed: int = 0
    split: str = VALID


def pretrained_on(text: Text, record: dict) -> bool | None:
    """Whether the split `text` scores may hold text the model of the run `record` (a primary's)
    trained on: True where it is training text, or the validation split of another preparation
    of a corpus that model (or the run it was made from: a head fit's body, frozen_from) trained
    on (another split, or that corpus prepared with none: the demo prepares English whole);
    False where it is those preparations' own held-out split, or another corpus; None where the
    records cannot tell (an imported model, or no data named). A source-language score on such
    text is no held-out score."""
    if text.split != VALID:
        return True
    own = _held_out_of(text, record.get("data_path"))
    if own is False:
        return True
    if record.get("imported_from") is not None:
        return None
    ref = record.get("frozen_from")
    if ref is not None and (Path(ref["run_dir"]) / RUN_FILE).is_file():  # as run_text_layout follows it
        return pretrained_on(text, read_json(Path(ref["run_dir"]) / RUN_FILE, "run file"))
    return None if own is None else False


def _held_out_of(text: Text, data_path: str | None) -> bool | None:
    """Whether `text`'s validation split is held out of the prepared dataset `data_path` a run
    trained on (another corpus, or that preparation's own split); None where there is none."""
    if not data_path or not (Path(data_path) / "manifest.json").is_file():
        return None
    mine, theirs = read_manifest(text.data), read_manifest(data_path)
    if mine["corpus_fingerprint"] != theirs["corpus_fingerprint"]:
        return True
    split = {"valid_fraction": 0.0, "valid_seed": PreprocessConfig.tokenizer_seed}  # what an older manifest ran with
    return bool(theirs.get("valid")) and all(mine.get(k, d) == theirs.get(k, d) for k, d in split.items())


class Scorer:
    """The plug-in metric through one primary model (`Primary`), built once on the evaluation
    device: held-out text (`heldout`) and artifacts swapped into the model in place (`loss`)."""

    def __init__(self, primary: Primary):
        self.primary, self.family = primary, primary.family
        self.model = scoring_model(primary.family, primary.cfg, primary.state)

    def heldout(self, text: Text, vocab_size: int, unigram: bool = True) -> HeldOut:
        """`text`'s held-out blocks in a `vocab_size`-piece vocabulary (the artifacts' that score
        it), on the model's device, with the unigram reference's loss (unigram: where asked)."""
        prefix = self.primary.text_prefix(text.data)
        batches = heldout_batches(text, vocab_size, self.family.objective, prefix)
        reference = reference_logprobs(text.data, vocab_size, self.family.objective, prefix) if unigram else None
        return HeldOut(batches, on_device(batches, device_of(self.model)),
                       None if reference is None else unigram_loss(reference, batches),
                       int(sum(int(l.ge(0).sum()) for _, l in batches)))

    def _swapped(self, art: dict | None, meta: dict | None):
        """The artifact's tensors `art` swapped into the model for a `with` block (its meta.json
        `meta` says whether they expand the vocabulary); None: the model's own."""
        if art is None:
            return contextlib.nullcontext()
        return swapped(self.model, swap_tensors(self.family, self.model, art, meta))

    @torch.no_grad()
    def logits(self, on_device: list, art: dict | None = None, meta: dict | None = None) -> list[torch.Tensor]:
        """The primary head's logits [m_b, V] at the scored positions of each of the `on_device`
        batches (a HeldOut's, a bpb reading's), with the artifact's tensors `art` swapped in (None:
        the model's own)."""
        with self._swapped(art, meta):
            return scored_logits(self.model, on_device)

    def summed(self, on_device: list, art: dict | None = None, meta: dict | None = None) -> float:
        """The summed loss (nats) of `on_device` batches (summed_nats) with the artifact's tensors
        `art` swapped in (None: the model's own)."""
        with self._swapped(art, meta):
            return summed_nats(self.model, on_device)

    def loss(self, held: HeldOut, art: dict | None = None, meta: dict | None = None) -> float:
        """The loss per scored piece of `held` with the artifact's tensors `art` swapped in (its
        meta.json `meta` says whether they expand the vocabulary); None: the model's own."""
        with self._swapped(art, meta):
            return masked_loss(self.model, held.on_device)


class PluginProbe:
    """The plug-in metric of one artifact at a time, for Step 2's checkpoints
    (TrainConfig.plugin_eval_blocks): the scoring model (`scorer()`, called once) and the
    held-out set are made on the first call and kept; each call swaps the artifact's tensors in
    and scores them, as Step 4's plugin records do (the same blocks, masked positions and unigram
    reference)."""

    def __init__(self, scorer: Callable[[], Scorer], text: Text):
        self.make, self.text = scorer, dataclasses.replace(text, batch_size=min(text.batch_size, text.blocks))
        self.scorer = self.held = None

    def score(self, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> dict[str, float]:
        """tensors: an artifact's ({"word_embeddings": [V, h], ...}), meta: its meta.json (an
        expanded vocabulary's says so) -> {"plugin_loss", "unigram_loss", "plugin_gain"} (nats per
        scored piece; the gain is the metric) and "plugin_eval_blocks", the blocks scored: a --resume
        may change them (TrainConfig's changeable fields), and each artifact then says which it had."""
        if self.scorer is None:
            self.scorer = self.make()
            self.held = self.scorer.heldout(self.text, tensors["word_embeddings"].shape[0])
        loss = self.scorer.loss(self.held, tensors, meta)
        return {"plugin_loss": loss, "unigram_loss": self.held.unigram, "plugin_gain": self.held.unigram - loss,
                "plugin_eval_blocks": self.text.blocks}
