"""Bits per byte of raw held-out text: one scale for every tokenizer.

A loss per piece cannot be set beside a loss per piece of another tokenizer: each cuts the same
text into a different number of pieces. Measured per UTF-8 byte of the same raw text, the source
model with its own vocabulary (no adaptation), a replaced vocabulary of any size and an expanded
one are on one scale (docs/bits-per-byte.md):

    decoder   the next-piece loss of the text's pieces, summed, / its bytes / ln 2 (lm-eval's
              bits_per_byte): each text read after the model's own start (run.run_text_layout's
              prefix; `</s>` for a model mmadapt trained, whose stream puts one before every
              sentence), every piece of it scored, nothing after it.
    encoder   PLL-word-l2r (Kauf & Ivanova, 2023), summed, / bytes / ln 2: piece j of a word is
              scored with itself and every later piece of its word masked, every other word
              visible, so that the pieces of one word are scored as a left-to-right chain over
              the word and the sum is a log-probability of the word's text given its number of
              pieces (the masks show it; docs/bits-per-byte.md bounds what that leaves out).
              Masking one piece at a time (Salazar et al.'s PLL, `whole_word=False`) lets the
              word's other pieces give it away, and flatters a finer tokenizer; tests/test_bpb.py
              checks both on a language whose exact conditionals are known.

A piece the tokenizer cannot read (<unk>) stands for bytes the model gives no probability to:
each byte under it is charged 8 bits (a uniform code over byte values) on top of the <unk>
piece's own loss, so that a tokenizer cannot score well by reading a text as <unk> (English
pieces on Russian text are nearly all <unk>, which a model predicts easily). So are the bytes
of a character its normalizer drops (one the tokenizer encodes, alone, as no piece at all:
SentencePiece's and BERT's drop control characters such as U+0007, and SentencePiece reads
zero-width spaces and direction marks as a word boundary): no piece stands for them, and a
byte-level tokenizer would pay for them.

A word is a run of non-whitespace characters of the raw text (not a tokenizer's notion of one),
so that every tokenizer groups the same pieces together; a piece belongs to the word its first
non-space character falls in (a lone '▁' to the word after it).

The text: the first `BPB_BYTES` bytes of sentences of a prepared dataset's validation documents,
read back from its corpus (the manifest's split rule) and checked against the validation split's
pieces. Each line is scored on its own. A line longer than the model's positions is read in
disjoint windows of its pieces, cut before a word where one fits (as lm-eval reads a long
document in windows of the model's length): a tokenizer that needs fewer pieces for the text
gives each piece more context, an advantage that is its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import unicodedata
from pathlib import Path

import numpy as np
import torch

from mmadapt.data import MANIFEST, TOKENIZER, VALID, DataError, corpus_fingerprint, read_manifest
from mmadapt.features import piece_offsets
from mmadapt.run import run_text_layout
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID

BPB_BYTES = 8192  # held-out bytes scored per language: the same text for every row of one language
MIN_BPB_BYTES = 256  # the least a caller may ask for: a few sentences, where a figure still means something
BATCH_TOKENS = 16_384  # positions per scoring batch (padding included), a GPU's: on a CPU, batches this large
# fault in fresh pages on every pass (the demo passes its eval_batch_tokens, 2048)
IGNORE = -100


# --- the raw text ---------------------------------------------------------------------------------------

def heldout_lines(data_path: str | Path, max_bytes: int = BPB_BYTES) -> list[list[str]]:
    """The sentences of the first validation documents of the prepared dataset `data_path`, as
    read from its corpus (data.prepare's split: is_validation_document with the manifest's
    fraction and seed), until they hold `max_bytes` bytes -> one list of lines per document.
    Refused where the dataset has no validation split or its corpus is gone or changed, and where
    the lines do not give the validation split's first pieces (a split made another way)."""
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import is_validation_document
    from mmadapt.tokenizer import load

    data_path = Path(data_path)
    manifest = read_manifest(data_path)
    fraction = manifest.get("valid_fraction") or 0.0
    if not fraction or not manifest.get("valid"):
        raise DataError(f"{data_path} has no validation split: bits per byte score held-out text; prepare it with "
                        "--valid_fraction (e.g. 0.01)")
    corpus = Path(manifest["corpus"])
    if not corpus.is_file():
        raise DataError(f"{data_path}'s corpus {corpus} is gone: bits per byte read its held-out sentences from it; "
                        "put it back or prepare the text again")
    if corpus_fingerprint(corpus) != manifest["corpus_fingerprint"]:
        raise DataError(f"corpus {corpus} changed since {data_path} was prepared from it: prepare it again")
    seed = manifest.get("valid_seed", PreprocessConfig.tokenizer_seed)
    docs, doc, total, held = [], None, 0, None
    # lines as prepare splits them: at \n alone, a byte-order mark no text
    with open(corpus, encoding="utf-8-sig", newline="\n") as f:
        for raw in f:
            line = raw.strip()
            if not line:
                if doc:
                    docs.append(doc)
                doc, held = None, None
                if total >= max_bytes:
                    break
                continue
            if held is None:
                held = is_validation_document(line, fraction, seed)
                doc = [] if held else None
            if held and total < max_bytes:
                doc.append(line)
                total += len(line.encode("utf-8"))
    if doc:
        docs.append(doc)
    _check_against_split(data_path, manifest, docs, load(data_path / TOKENIZER))
    return docs


def _check_against_split(data_path: Path, manifest: dict, docs: list[list[str]], sp) -> None:
    """The pieces of `docs` laid out as prepare lays them out (each line's pieces and </s>, a lone
    </s> after each document but the last read, whose end may lie beyond) are the validation
    split's first pieces."""
    lines = [line for doc in docs for line in doc]
    ids = iter(sp.encode(lines))
    # as prepare stores them: a line that encodes to nothing is left out, and a document of such lines
    pieces = [[p for p in (next(ids) for _ in doc) if p] for doc in docs]
    pieces = [doc for doc in pieces if doc]
    stream = []
    for n, doc in enumerate(pieces):
        for line in doc:
            stream += list(line) + [EOS_ID]
        if n < len(pieces) - 1:
            stream.append(EOS_ID)
    split = np.memmap(data_path / f"{VALID}.bin", dtype=manifest["dtype"], mode="r")[:len(stream)]
    if len(stream) == 0 or not np.array_equal(np.asarray(split, dtype=np.int64), np.asarray(stream, dtype=np.int64)):
        raise DataError(f"the held-out sentences read from {manifest['corpus']} are not those of {data_path}'s "
                        f"validation split (its {MANIFEST} lacks the seed it was split with): prepare the text again")


@dataclasses.dataclass(frozen=True)
class RawText:
    """Held-out raw text of one language, as every row of it is scored: its lines and their
    bytes (the denominator)."""
    lines: tuple[str, ...]
    source: str  # the prepared dataset it was read from

    @property
    def bytes(self) -> int:
        return sum(len(s.encode("utf-8")) for s in self.lines)

    @property
    def digest(self) -> str:
        """Which text it is (the lines' sha256, 16 hex digits): two records scored it both, or not."""
        return hashlib.sha256("\n".join(self.lines).encode("utf-8")).hexdigest()[:16]

    @classmethod
    def read(cls, data_path: str | Path, max_bytes: int = BPB_BYTES) -> "RawText":
        """The validation text of `data_path` (heldout_lines), its first `max_bytes` bytes of lines."""
        return cls(tuple(line for doc in heldout_lines(data_path, max_bytes) for line in doc), str(data_path))


# --- how a model reads a text ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """The ids a model reads around a text (prefix, suffix)."""
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def of(cls, record: dict, masked: bool) -> "Layout":
        """An imported model's tokenizer's layout (run.run_text_layout); a model mmadapt trained
        reads a text as its objective's lm_row frames one, as its training stream put it: a
        decoder, the `</s>` of the sentence before (which also gives an imported decoder with no
        prefix, Qwen2's, something to predict the first piece from, as lm-eval's end-of-text
        token does); an encoder, `<s> text </s>` (every block it trained on starts with <s>: its
        position 0 never held anything else)."""
        layout = run_text_layout(record)
        prefix, suffix = tuple(layout.get("prefix") or ()), tuple(layout.get("suffix") or ())
        if masked:
            return cls(prefix, suffix) if layout else cls((BOS_ID,), (EOS_ID,))
        return cls(prefix or (EOS_ID,), ())

    @property
    def extra(self) -> int:
        return len(self.prefix) + len(self.suffix)


def word_index(text: str, spans: list[tuple[int, int]]) -> list[int]:
    """The word (a run of non-whitespace characters of `text`, counted from 0) of each piece,
    by its character span [begin, end) (leading whitespace excluded: features.piece_offsets); a
    piece with no character of its own goes to the word at or after its position."""
    word_of_char, w, inside = np.zeros(len(text) + 1, dtype=np.int64), -1, False
    for i, ch in enumerate(text):
        if not ch.isspace() and not inside:
            w += 1
        inside = not ch.isspace()
        word_of_char[i] = w + (0 if inside else 1)  # a space: the next word
    word_of_char[len(text)] = w + 1
    return [int(word_of_char[min(b, len(text))]) for b, _ in spans]


@dataclasses.dataclass(frozen=True)
class Rows:
    """One tokenizer's reading of a RawText: the model's input rows and their scored positions
    (labels, IGNORE elsewhere), how many pieces the text has and how many are <unk>."""
    rows: list[tuple[list[int], list[int]]]
    pieces: int
    unknown: int
    unknown_bytes: int  # the UTF-8 bytes the <unk> pieces stand for, and those of characters no piece does


_WHITESPACE_RUN = re.compile(r"\s{2,}")
# Two letters a tokenizer reads as pieces, between which a character it drops leaves their pieces
# as they were (_rows): the first whose pieces hold no <unk>
_PROBES = ("ab", "аб", "αβ", "अब", "אב", "اب", "一二", "12")


def windows(words: list[int], room: int) -> list[tuple[int, int]]:
    """A line's pieces (`words`: each one's word, word_index) in disjoint windows [start, end) of at
    most `room` pieces, each cut before a word where the window holds its start (inside a word
    longer than a window, at the window's end)."""
    if room < 1:
        raise ValueError("the model's positions leave no room for a text: score with a longer --seq_length")
    out, start, n = [], 0, len(words)
    while start < n:
        end = min(start + room, n)
        if end < n:  # cut before the last word that starts inside the window, if any
            cut = end
            while cut > start and words[cut] == words[cut - 1]:
                cut -= 1
            end = cut if cut > start else end
        out.append((start, end))
        start = end
    return out


def _rows(sp, text: RawText, layout: Layout, positions: int, window_rows) -> Rows:
    """Rows of every window of every line of `text` (`window_rows(ids, words, a, b)`: those of the
    window [a, b) of a line's pieces `ids`, each piece's word `words`), and the counts of Rows."""
    rows, pieces, unknown, unk_bytes, dropped, collapses = [], 0, 0, 0, {}, None
    # a tokenizer that strips accents drops a nonspacing mark (category Mn, as BERT's strip_accents
    # does after NFD) as it drops the accent of a composed character: a fold, free either way
    # (charged, "cafe\u0301" cost 16 bits that "café" does not)
    strips = "accents" in folds(sp)

    def folded(ch: str) -> bool:  # a mark it strips: free, and no character of the text as read
        return strips and unicodedata.category(ch) == "Mn"

    # two characters it reads as pieces of their own, between which a character it drops leaves them
    # as they were (a BPE whose byte fallback has no byte pieces drops what it cannot encode, and a
    # character alone it encodes as the word start '▁' its pre-tokenizer put before it)
    # (two letters of another script where it has no Latin: a Russian vocabulary reads "ab" as <unk>),
    # which a space between them changes: a WordPiece reads "一 二" as "一二", and took every space
    # for a dropped character
    probe = next((p for p in _PROBES if UNK_ID not in sp.encode(p) and sp.encode(f"{p[0]} {p[1]}") != sp.encode(p)),
                 None)
    plain = list(sp.encode(probe)) if probe is not None else []
    for line in text.lines:
        ids, spans = piece_offsets(sp, line)
        words = word_index(line, spans)
        for a, b in windows(words, positions - layout.extra):
            rows += window_rows(ids, words, a, b)
        pieces += len(ids)
        unknown += sum(i == UNK_ID for i in ids)
        unk = [(b, e) for i, (b, e) in zip(ids, spans) if i == UNK_ID]
        unk_bytes += sum(len(line[b:e].encode("utf-8")) for b, e in unk)
        in_unk = {k for b, e in unk for k in range(b, e)}  # charged already, as <unk>'s bytes
        # a character the tokenizer drops: its span is a neighbour's, so only encoding it alone (no
        # piece at all), or between the probe's two (their pieces alone), tells. Whitespace alone is
        # no piece either (a space): the probe alone tells a space (a boundary) from a control
        # character Python calls whitespace that the normalizer deletes (U+000B, U+001F: "cre\x0bated"
        # read as "created", charged nothing until 2026-12-07)
        for k, ch in enumerate(line):
            if ch not in dropped:
                between = probe is not None and list(sp.encode(probe[0] + ch + probe[1])) == plain
                dropped[ch] = between if ch.isspace() else not folded(ch) and (not sp.encode(ch) or between)
            unk_bytes += len(ch.encode("utf-8")) if dropped[ch] and k not in in_unk else 0
        # a run of whitespace a tokenizer reads as one boundary (SentencePiece's remove_extra_whitespaces,
        # a WordPiece's split at whitespace): its characters after the first stand for nothing. Runs
        # of the text as it is read, without the characters it drops (charged above) or folds away
        # (an accent-stripper's marks): "a \x07 b" is "a  b", whose second space was free
        if collapses is None:
            collapses = list(sp.encode("a  b")) == list(sp.encode("a b"))
        if collapses:
            read = "".join(ch for ch in line if not (dropped[ch] or folded(ch)))
            unk_bytes += sum(len(m.group()[1:].encode("utf-8")) for m in _WHITESPACE_RUN.finditer(read))
    return Rows(rows, pieces, unknown, unk_bytes)


def causal_rows(sp, text: RawText, layout: Layout, positions: int) -> Rows:
    """One row per window: layout.prefix, its pieces; every piece scored (from the position before it)."""
    def window(ids, words, a, b):
        row = list(layout.prefix) + ids[a:b]
        labels = [IGNORE] * len(row)
        labels[len(layout.prefix) - 1:len(row) - 1] = ids[a:b]
        return [(row, labels)]
    return _rows(sp, text, layout, positions, window)


def masked_rows(sp, text: RawText, layout: Layout, positions: int, whole_word: bool = True) -> Rows:
    """One row per piece: its window laid out, the piece masked with (whole_word) every later
    piece of its word in the window (PLL-word-l2r) or alone (PLL), the piece scored at its
    position."""
    def window(ids, words, a, b):
        row, at, out = list(layout.prefix) + ids[a:b] + list(layout.suffix), len(layout.prefix) - a, []
        for j in range(a, b):
            end = j + 1
            while whole_word and end < b and words[end] == words[j]:
                end += 1
            masked, labels = list(row), [IGNORE] * len(row)
            masked[at + j:at + end] = [MASK_ID] * (end - j)
            labels[at + j] = ids[j]
            out.append((masked, labels))
        return out
    return _rows(sp, text, layout, positions, window)


def batches(rows: Rows, batch_tokens: int = BATCH_TOKENS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rows padded into (ids [b, s], labels [b, s]) batches of at most `batch_tokens`
    positions, rows of one length together."""
    order = sorted(range(len(rows.rows)), key=lambda i: len(rows.rows[i][0]))
    out, cur = [], []

    def flush():
        s = max(len(rows.rows[i][0]) for i in cur)
        ids = torch.full((len(cur), s), PAD_ID, dtype=torch.long)
        labels = torch.full((len(cur), s), IGNORE, dtype=torch.long)
        for r, i in enumerate(cur):
            row, lab = rows.rows[i]
            ids[r, :len(row)] = torch.tensor(row)
            labels[r, :len(lab)] = torch.tensor(lab)
        out.append((ids, labels))

    for i in order:
        if cur and (len(cur) + 1) * len(rows.rows[i][0]) > batch_tokens:
            flush()
            cur = []
        cur.append(i)
    if cur:
        flush()
    return out


@dataclasses.dataclass(frozen=True)
class Scored:
    """One tokenizer's rows of a RawText, ready to score: batches on the model's device."""
    on_device: list
    pieces: int
    unknown: int
    unknown_bytes: int
    bytes: int

    def bpb(self, nats: float) -> float:
        """The summed loss `nats` of the pieces, and 8 bits for each byte under an <unk>, per byte."""
        return (nats / math.log(2) + 8 * self.unknown_bytes) / self.bytes


def prepare(sp, text: RawText, layout: Layout, masked: bool, positions: int, device: torch.device,
            batch_tokens: int = BATCH_TOKENS) -> Scored:
    """`text` read by the tokenizer `sp` as a model of `layout` with `positions` positions reads
    it, on `device`, in batches of at most `batch_tokens` positions."""
    from mmadapt.heldout import on_device

    rows = (masked_rows if masked else causal_rows)(sp, text, layout, positions)
    return Scored(on_device(batches(rows, batch_tokens), device), rows.pieces, rows.unknown, rows.unknown_bytes,
                  text.bytes)


# What a kept score was computed by (extend's summary and graft scores): changed with the folds
# and charges, so that a repeated call scores again rather than print a score of other rules
SCORING = "2026-12-05"


def _strip_accents(text: str) -> str:
    """As BERT's strip_accents: NFD, then every nonspacing mark (category Mn) dropped."""
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


# Each fold as what it makes of a text, asked of texts in several scripts: a tokenizer of one
# script reads another's text as <unk>s, the same pieces on both sides, which says nothing of what
# it folds (a Russian SentencePiece read the Latin probes so, and was said to fold case and accents)
FOLDS = {"case": str.lower, "accents": _strip_accents,
         # a WordPiece splits at punctuation and whitespace alike: "God, said" and "God ,said" are one
         "punctuation spacing": lambda t: re.sub(r"([,:;]) (?=\w)", r" \1", t)}
# Unicode normalisation (SentencePiece's nmt_nfkc and XLM-R's NFKC; a byte-level BPE's NFC) reads
# a form as another of more bytes, free: a score is flattered by it only on a text that holds such
# forms (the Bibles here are NFC, but the Chinese one's punctuation is full-width, NFKC's ASCII).
# Each is asked where the scored text holds such forms, of its own lines that do (a Chinese
# tokenizer reads every probe of FOLD_TEXTS with <unk>), else, where the tokenizer reads none of
# them without <unk> (an English one, of Chinese), of the probes made so: what -> (a line as
# given, as the normalisation makes it, a probe text made of such forms)
NORMALIZATION_FOLDS = {
    "compatibility forms": (lambda line: unicodedata.normalize("NFC", line),  # full-width forms, ligatures
                            lambda line: unicodedata.normalize("NFKC", line),
                            lambda t: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in t)),
    "composition": (lambda line: line, lambda line: unicodedata.normalize("NFC", line),  # a decomposed accent
                    lambda t: unicodedata.normalize("NFD", t))}
FOLD_LINES = 16  # of the scored text's, per normalisation: a few lines answer as well as all
# Short texts, each asked alone: one <unk> (a rare letter) leaves the others' answer standing
FOLD_TEXTS = ("The Lord God said unto Moses", "Noël über café à Sião", "Ärger über Öl",
              "And God said, Let there be light: and",
              "И сказал Господь Бог Моисею", "Йосиф и Ёлка", "И сказал Бог: да будет свет, и",
              "Και είπεν ο Κύριος ο Θεός", "Γενηθήτω φως, και εγένετο",
              "परमेश्वर ने मूसा से कहा", "उजियाला हो, और")


def folds(sp, lines=()) -> list[str]:
    """What tokenizer `sp` reads two texts as one of (FOLDS): "case" (an uncased tokenizer),
    "accents" (one that strips them), "punctuation spacing" (one that does not read whether a
    space stands before or after a punctuation mark: BERT's WordPiece); and where the scored text
    `lines` holds forms a Unicode normalisation changes (NORMALIZATION_FOLDS), "compatibility
    forms" (NFKC: full-width letters and punctuation, ligatures) and "composition" (NFC: a
    decomposed accent), asked of those lines. Asked of each FOLD_TEXTS text (or line) that the fold
    changes and that `sp` reads without <unk> on either side (none such: nothing is known to be
    folded). Bits per byte charge a text's bytes but score only what its tokenizer keeps: such a
    tokenizer is not charged for the information it drops, and reads lower than one that keeps
    it (docs/bits-per-byte.md)."""
    def answer(texts) -> bool | None:  # texts: (a, b) pairs; None: none read without <unk>
        read = [(sp.encode(a), sp.encode(b)) for a, b in [t for t in texts if t[0] != t[1]][:FOLD_LINES]]
        read = [(list(a), list(b)) for a, b in read if UNK_ID not in a and UNK_ID not in b]
        return all(a == b for a, b in read) if read else None

    out = [what for what, fold in FOLDS.items() if answer((t, fold(t)) for t in FOLD_TEXTS)]
    for what, (given, normal, probe) in NORMALIZATION_FOLDS.items():
        held = [(given(line), normal(line)) for line in lines]
        if any(a != b for a, b in held):
            said = answer(held)
            if said if said is not None else answer((t, probe(t)) for t in FOLD_TEXTS):
                out.append(what)
    return out


def fold_caveat(side: str, folds: list[str], other: list[str]) -> str | None:
    """The sentence that says two bits-per-byte figures are not comparable as they stand, where
    `side`'s tokenizer folds (`folds`: bpb.folds) what the `other`'s keeps; None where it folds
    nothing the other keeps."""
    lost = sorted(set(folds) - set(other))
    if not lost:
        return None
    named = " and ".join(filter(None, (", ".join(lost[:-1]), lost[-1])))
    return (f"Not comparable as they stand: {side} folds {named} where the other keeps it, so its bits "
            "per byte leave out what that carries (each byte is charged, the text it reads is poorer) and read lower "
            "than they would with it (docs/bits-per-byte.md).")


class ByteScorer:
    """Bits per byte through one primary model (a heldout.Scorer, built once): a RawText per
    language (`text`), each tokenizer's reading of it prepared once, artifacts swapped in, in
    batches of at most `batch_tokens` positions (the sums do not depend on it but for rounding)."""

    def __init__(self, scorer, seq_length: int, max_bytes: int = BPB_BYTES, batch_tokens: int = BATCH_TOKENS):
        from mmadapt.run import RUN_TOKENIZER

        self.scorer, self.seq_length, self.max_bytes, self.batch_tokens = scorer, seq_length, max_bytes, batch_tokens
        self.masked = scorer.family.objective.masked
        self.layout = Layout.of(scorer.primary.record, self.masked)
        self.own_tokenizer = Path(scorer.primary.ref["run_dir"]) / RUN_TOKENIZER
        self._texts: dict[str, RawText] = {}
        self._read: dict[tuple, Scored] = {}
        self._none: dict[RawText, float] = {}
        self._folds: dict[str, list[str]] = {}

    def text(self, data: str | Path) -> RawText:
        key = str(Path(data).resolve())
        if key not in self._texts:
            self._texts[key] = text = RawText.read(data, self.max_bytes)
            if text.bytes < min(self.max_bytes, MIN_BPB_BYTES):
                # Every row of the language is scored on these bytes: its figures are noise, but
                # they are comparable with each other, so they are given, with the reason.
                print(f"warning: bits per byte of {data} over {text.bytes} held-out bytes, all its validation "
                      f"split holds (a figure needs {MIN_BPB_BYTES}): prepare the text with a larger "
                      "--valid_fraction", flush=True)
        return self._texts[key]

    def reading(self, text: RawText, tokenizer: str | Path) -> Scored:
        """`text` as `tokenizer` reads it, ready to score (prepared once per text and tokenizer)."""
        from mmadapt.data import file_sha256
        from mmadapt.devices import device_of
        from mmadapt.tokenizer import load

        key = (text, file_sha256(tokenizer))
        if key not in self._read:
            self._read[key] = prepare(load(tokenizer), text, self.layout, self.masked, self.seq_length,
                                      device_of(self.scorer.model), self.batch_tokens)
        return self._read[key]

    def score(self, text: RawText, tokenizer: str | Path, art: dict | None = None, meta: dict | None = None
              ) -> dict[str, float]:
        """`text` read by `tokenizer` through the primary model with the artifact's tensors `art`
        swapped in (None: its own) -> {"bpb", "pieces", "unknown_share"}."""
        scored = self.reading(text, tokenizer)
        nats = self.scorer.summed(scored.on_device, art, meta)
        return {"bpb": scored.bpb(nats), "pieces": scored.pieces, "unknown_share": scored.unknown / max(scored.pieces, 1),
                "unknown_bytes": scored.unknown_bytes}

    def within(self, text: RawText, tokenizer: str | Path, rows: int, art: dict | None = None,
               meta: dict | None = None) -> float:
        """`text` read by `tokenizer` in bits per byte with every target scored under the softmax
        over the first `rows` rows alone: the others suppressed (logits -inf), as transformers'
        `generate(suppress_tokens=...)` does. An expanded artifact with `rows` its source vocabulary
        and the source's own tokenizer: the source model's own distribution (expand keeps those
        rows bit for bit), what a user gets who suppresses the new pieces in source text."""
        import torch

        scored = self.reading(text, tokenizer)
        logits = self.scorer.logits(scored.on_device, art, meta)
        nats = 0.0
        for scores, (*_, targets) in zip(logits, scored.on_device):  # scores [m, V] at the m scored positions
            if len(targets) and int(targets.max()) >= rows:
                raise ValueError(f"{tokenizer} reads the held-out text of {text.source} with pieces past the first "
                                 f"{rows} rows: pass the tokenizer of those rows")
            nats += float(-torch.log_softmax(scores[:, :rows].double(), -1).gather(1, targets[:, None]).sum())
        return scored.bpb(nats)

    def folds(self, tokenizer: str | Path, text: RawText) -> list[str]:
        """bpb.folds of `tokenizer` on `text` (read once per file and text)."""
        from mmadapt.data import file_sha256
        from mmadapt.tokenizer import load

        key = (file_sha256(tokenizer), text.digest)
        if key not in self._folds:
            self._folds[key] = folds(load(tokenizer), text.lines)
        return self._folds[key]

    def unknown_share(self, text: RawText, tokenizer: str | Path) -> float:
        """The share of `text`'s pieces, as `tokenizer` reads it, that are <unk> (no scoring)."""
        read = self.reading(text, tokenizer)
        return read.unknown / max(read.pieces, 1)

    def none(self, text: RawText) -> float:
        """No adaptation: `text` in bits per byte through the primary model with its own
        tokenizer and embeddings (scored once per text)."""
        if text not in self._none:
            self._none[text] = self.score(text, self.own_tokenizer)["bpb"]
        return self._none[text]
