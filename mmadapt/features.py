"""Task examples -> fixed-length piece-id tensors (Steps 3 and 4), and model outputs -> answers.

Layouts are a model family's `Framing` (ids from mmadapt/tokens.py, padding with PAD_ID to
seq_length); the default is RoBERTa's, which the shipped families use:
    classify, one text    <s> a </s>                      (a decoder starts as it reads text: Framing.start)
    classify, a pair      <s> a </s> </s> b </s>          (longest side truncated first)
    tag                   <s> w1 w2 ... </s>              a word's label on its first piece (a long
                                                          sentence goes on in rows of its own)
    span (extractive QA)  <s> question </s> </s> context window </s>
BERT's framing has one separator between the two texts of a pair (`[CLS] a [SEP] b [SEP]`, in
mmadapt's ids `<s> a </s> b </s>`) and marks the second segment (b, or the context) and its
closing separator with token type 1 (`Encoded.token_types`); a framing without token types
leaves them None, and the model is never given any.
A QA context longer than a window is split into windows that overlap by `doc_stride` pieces
(Hugging Face's run_qa's stride; BERT's SQuAD code moved each window on by its doc_stride); the
answer is predicted per window and the best span over all windows of a question wins. Piece
offsets come from SentencePiece (byte offsets into the original text, turned into character
offsets), so an answer is cut from the context exactly, also in languages written without
spaces.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mmadapt.readers import PairExample, QAExample, TaggedSentence
from mmadapt.tokens import BOS_ID, EOS_ID, IGNORE_INDEX, NUM_SPECIAL, PAD_ID, UNK_ID


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a model family lays a task's texts out (module docstring): `separators` </s> pieces
    between the two texts of a pair, and whether the second segment's pieces carry token type 1."""
    separators: int = 2  # RoBERTa: <s> a </s> </s> b </s>; BERT: 1
    token_types: bool = False
    # What a classify row starts with (<s> above): as the model read text in training
    # (Objective.text_start), a Step-3 run's record (run.json task_start); a decoder's </s>, or an
    # imported one's own prefix (Llama's <s>, nothing for Qwen2), since no decoder trains <s>
    start: tuple[int, ...] = (BOS_ID,)

    def pair(self, a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
        """<s> a </s> (</s>) b </s> -> (ids, token types: 0 up to a's closing separators, 1 after)."""
        first = [*self.start, *a, *[EOS_ID] * self.separators]
        second = [*b, EOS_ID]
        return first + second, [0] * len(first) + [1] * len(second)

    @property
    def pair_specials(self) -> int:
        """Special pieces in a pair's row: its start, the separators and the closing </s>."""
        return len(self.start) + 1 + self.separators


@dataclasses.dataclass
class Encoded:
    input_ids: torch.Tensor  # [n, s] int64
    labels: torch.Tensor  # classify [n]; tag [n, s] (-100 where no label); span [n, 2] (start, end)
    example: np.ndarray | None = None  # span: [n] index of the example each window comes from
    offsets: np.ndarray | None = None  # span: [n, s, 2] character span in the context, -1 outside it
    token_types: torch.Tensor | None = None  # [n, s] int64, 1 on a pair's second segment; None: no token types

    def __len__(self) -> int:
        return len(self.input_ids)

    def rows(self, index) -> dict[str, torch.Tensor]:
        """The model inputs of rows `index` beyond input_ids: {"token_types": [k, s]} where this
        encoding has them, else nothing (a family without token types is never given any)."""
        return {} if self.token_types is None else {"token_types": self.token_types[index]}

    def trained(self) -> dict[str, torch.Tensor]:
        """What a Step-3 run trains on: its rows, labels and token types (not the span windows'
        offsets, which only scoring reads)."""
        return {"input_ids": self.input_ids, "labels": self.labels,
                **({} if self.token_types is None else {"token_types": self.token_types})}


def _pad(rows: list[list[int]], seq_length: int, fill: int = PAD_ID) -> torch.Tensor:
    out = torch.full((len(rows), seq_length), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _check_seq(seq_length: int, need: int) -> None:
    if seq_length < need:
        raise ValueError(f"seq_length {seq_length} is too short for this task (need at least {need})")


def _types(rows: list[list[int]], seq_length: int, framing: Framing) -> torch.Tensor | None:
    """Token-type rows padded with 0, or None for a framing without token types."""
    return _pad(rows, seq_length, fill=0) if framing.token_types else None


def longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """How many pieces of each text of a pair to keep within `budget`, cut as transformers'
    tokenizers cut a pair (truncation="longest_first", the Rust `tokenizers` rule): the shorter
    text is kept whole where the longer fits beside it; else each keeps half, the odd piece going
    to the longer text, or to the second on a tie. A model imported with its tokenizer was trained
    and is scored on exactly these pieces; one piece off at the boundary changes its prediction."""
    if len_a + len_b <= budget:
        return len_a, len_b
    short, long = sorted((len_a, len_b))
    keep_short, keep_long = (short, budget - short) if short <= budget // 2 else (budget // 2, budget - budget // 2)
    return (keep_long, keep_short) if len_a > len_b else (keep_short, keep_long)


def encode_classify(sp, examples: list[PairExample] | list[tuple[str, int]], seq_length: int,
                    framing: Framing = Framing()) -> Encoded:
    """Single texts as (text, label) pairs, or PairExamples (sentence1, sentence2, label)."""
    _check_seq(seq_length, 8)
    rows, types, labels = [], [], []
    for ex in examples:
        if isinstance(ex, PairExample):
            a, b = sp.encode(ex.sentence1), sp.encode(ex.sentence2)
            keep_a, keep_b = longest_first(len(a), len(b), seq_length - framing.pair_specials)
            ids, t = framing.pair(a[:keep_a], b[:keep_b])
            rows.append(ids)
            types.append(t)
            labels.append(ex.label)
        else:
            text, label = ex
            rows.append([*framing.start, *sp.encode(text)[:seq_length - len(framing.start) - 1], EOS_ID])
            types.append([])
            labels.append(label)
    return Encoded(_pad(rows, seq_length), torch.tensor(labels, dtype=torch.long),
                   token_types=_types(types, seq_length, framing))


def encode_tag(sp, sentences: list[TaggedSentence], label_names: list[str], seq_length: int,
               framing: Framing = Framing()) -> Encoded:
    """One row per sentence, <s> pieces </s> (its start: `framing`'s, as the model read text),
    each word's first piece labelled. A sentence whose pieces pass seq_length goes on in further
    rows of its next words, each read on its own, so
    that every word is scored once, in the row that holds it (`example`: each row's sentence).
    Cut off instead, a tokenizer that splits words finer would be scored on fewer of them (the
    no-adaptation row, the source's pieces on target text, most of all). A word of more pieces
    than a row holds keeps its first (its label is on the first). Each word is encoded as it
    stands inside a text (`word_pieces`). A gold tag missing from `label_names` (not seen in
    training) gets the id len(label_names), which no prediction can equal."""
    _check_seq(seq_length, 4)
    index = {t: i for i, t in enumerate(label_names)}
    start = list(framing.start)
    room = seq_length - len(start) - 1
    rows, label_rows, example = [], [], []
    for k, sent in enumerate(sentences):
        ids, labels = [], []
        for word, tag in zip(sent.words, sent.tags):
            pieces = (word_pieces(sp, word) or [UNK_ID])[:room]
            if ids and len(ids) + len(pieces) > room:  # the sentence goes on in a row of its own
                rows.append([*start, *ids, EOS_ID])
                label_rows.append([IGNORE_INDEX] * len(start) + [*labels, IGNORE_INDEX])
                example.append(k)
                ids, labels = [], []
            ids += pieces
            labels += [index.get(tag, len(label_names))] + [IGNORE_INDEX] * (len(pieces) - 1)
        rows.append([*start, *ids, EOS_ID])
        label_rows.append([IGNORE_INDEX] * len(start) + [*labels, IGNORE_INDEX])
        example.append(k)
    out = torch.full((len(rows), seq_length), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(label_rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return Encoded(_pad(rows, seq_length), out, example=np.asarray(example, dtype=np.int64),
                   token_types=_types([[]] * len(rows), seq_length, framing))


def word_pieces(sp, word: str) -> list[int]:
    """The pieces of one word of a tagged sentence as it stands inside a text: a byte-level BPE
    (RoBERTa's, Qwen2's) reads a word after a space as 'Ġword', the form running text trains,
    where the word alone would read as a text's first word; Hugging Face's token classification
    reads each word so too (is_split_into_words with add_prefix_space). A SentencePiece or
    WordPiece tokenizer starts every word alike already."""
    return sp.encode(" " + word) if getattr(sp, "byte_level", False) else sp.encode(word)


def piece_offsets(sp, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Piece ids of `text` and each piece's [begin, end) character span in `text`, leading
    whitespace excluded (SentencePiece reports byte offsets that include the space a '▁' stands for)."""
    try:
        proto = sp.encode(text, return_type="proto")  # sentencepiece >= 0.2.1
    except (TypeError, ValueError):
        proto = sp.encode(text, out_type="immutable_proto")
    char_of_byte = np.zeros(len(text.encode("utf-8")) + 1, dtype=np.int64)
    pos = 0
    for i, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_of_byte[pos:pos + n] = i
        pos += n
    char_of_byte[pos] = len(text)
    ids, spans = [], []
    for p in proto.pieces:
        b, e = int(char_of_byte[p.begin]), int(char_of_byte[p.end])
        while b < e and text[b].isspace():
            b += 1
        ids.append(p.id)
        spans.append((b, e))
    return ids, spans


DOC_STRIDE = 128  # SQuAD practice (with 384-piece windows)


def encode_span(sp, examples: list[QAExample], seq_length: int, doc_stride: int | None,
                max_query_length: int, framing: Framing = Framing()) -> Encoded:
    """Windows over each context; labels are the first answer's first and last piece in the
    window, or (0, 0) (the <s> position) when the window does not hold the whole answer.
    doc_stride None: min(DOC_STRIDE, half the window). The question is the pair's first text, the
    window its second (framing)."""
    if seq_length < max_query_length + 8:
        raise ValueError(f"seq_length {seq_length} is too short for questions of up to --max_query_length "
                         f"{max_query_length} pieces (need at least {max_query_length + 8}): lower --max_query_length "
                         f"to at most {max(1, seq_length - 8)}")
    # A given stride must fit the narrowest window, beside a question of max_query_length pieces:
    # checked against the longest question only, it passes on English (short questions) in Step 3
    # and fails in Step 4 on a language whose questions take more pieces, with no flag left to fix it.
    narrowest = seq_length - max_query_length - framing.pair_specials
    if doc_stride is not None and doc_stride >= narrowest:
        raise ValueError(f"--doc_stride {doc_stride} must be smaller than the narrowest context window ({narrowest} "
                         f"pieces at seq_length {seq_length} beside a question of --max_query_length "
                         f"{max_query_length}): lower --doc_stride or leave it unset")
    rows, types, labels, example, offsets = [], [], [], [], []
    for n, ex in enumerate(examples):
        q = sp.encode(ex.question)[:max_query_length]
        ctx_ids, spans = piece_offsets(sp, ex.context)
        window = seq_length - len(q) - framing.pair_specials
        stride = min(DOC_STRIDE, window // 2) if doc_stride is None else doc_stride
        a_start = a_end = None
        if ex.answers:
            text, start = ex.answers[0]
            end = start + len(text)
            inside = [i for i, (b, e) in enumerate(spans) if e > start and b < end and e > b]
            if inside:
                a_start, a_end = inside[0], inside[-1]
        first = 0
        while True:
            last = min(first + window, len(ctx_ids))
            ids, t = framing.pair(q, ctx_ids[first:last])
            off = np.full((seq_length, 2), -1, dtype=np.int64)
            base = len(framing.start) + len(q) + framing.separators  # the window's first position
            if last > first:  # (an empty context: a window of no pieces, no answer in it)
                off[base:base + last - first] = spans[first:last]
            if a_start is not None and first <= a_start and a_end < last:
                labels.append((base + a_start - first, base + a_end - first))
            else:
                labels.append((0, 0))
            rows.append(ids)
            types.append(t)
            example.append(n)
            offsets.append(off)
            if last == len(ctx_ids):
                break
            first += window - stride
    return Encoded(_pad(rows, seq_length), torch.tensor(labels, dtype=torch.long).reshape(-1, 2),
                   np.asarray(example, dtype=np.int64), np.stack(offsets) if offsets else np.zeros((0, seq_length, 2)),
                   _types(types, seq_length, framing))


def best_spans(logits: torch.Tensor, enc: Encoded, examples: list[QAExample], max_answer_length: int,
               top_k: int = 20) -> dict[str, str]:
    """logits [n, s, 2] of encode_span's windows -> {question id: answer text} (best_span_offsets's
    span of the context, "" where none fits)."""
    spans = best_span_offsets(logits, enc, examples, max_answer_length, top_k)
    return {ex.id: ex.context[spans[ex.id][0]:spans[ex.id][1]] if spans[ex.id] else "" for ex in examples}


def best_span_offsets(logits: torch.Tensor, enc: Encoded, examples: list[QAExample], max_answer_length: int,
                      top_k: int = 20) -> dict[str, tuple[int, int] | None]:
    """logits [n, s, 2] of encode_span's windows -> {question id: (start, end) character offsets
    of the answer in its context, end exclusive, or None where no span fits}: the highest start +
    end score over all windows, with start <= end, both in the context and standing for some of
    its text (a bare '▁' piece's span is empty: an answer ending there lost its last character, or
    was empty with offsets), and at most max_answer_length pieces."""
    best: dict[int, tuple[float, int, int]] = {}
    logits = logits.float()
    for w in range(len(enc)):
        n, off = int(enc.example[w]), enc.offsets[w]
        start, end = logits[w, :, 0], logits[w, :, 1]
        for i in start.topk(min(top_k, len(start))).indices.tolist():
            for j in end.topk(min(top_k, len(end))).indices.tolist():
                if (off[i, 0] < 0 or off[j, 0] < 0 or off[i, 0] == off[i, 1] or off[j, 0] == off[j, 1] or j < i
                        or j - i + 1 > max_answer_length):
                    continue
                score = float(start[i] + end[j])
                if n not in best or score > best[n][0]:
                    best[n] = (score, int(off[i, 0]), int(off[j, 1]))
    return {ex.id: best[n][1:] if n in best else None for n, ex in enumerate(examples)}


def chunks(tags: list[str]) -> set[tuple[int, int, str]]:
    """Entity chunks (start, end, type) of an IOB1/IOB2 tag sequence, as conlleval reads them: a
    chunk starts at B-X, or at I-X after O or after another type."""
    out, start, kind = set(), None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, t = tag.partition("-")
        begins = prefix == "B" or (prefix == "I" and t != kind)
        if start is not None and (tag == "O" or begins or t != kind):
            out.add((start, i, kind))
            start, kind = None, None
        if tag != "O" and (begins or start is None):
            start, kind = i, t
    return out


def chunk_f1(gold: list[list[str]], pred: list[list[str]]) -> float:
    """Entity-level F1 in percent over sentences (CoNLL-2003's metric)."""
    g = p = both = 0
    for gs, ps in zip(gold, pred):
        cg, cp = chunks(gs), chunks(ps)
        g, p, both = g + len(cg), p + len(cp), both + len(cg & cp)
    if both == 0:
        return 0.0
    precision, recall = both / p, both / g
    return 100 * 2 * precision * recall / (precision + recall)


def is_bio(tags: list[str]) -> bool:
    """A tag set that chunk F1 reads: every tag O, B-X or I-X (IOB1 or IOB2), not all O."""
    return any(t != "O" for t in tags) and all(t == "O" or t[:2] in ("B-", "I-") for t in tags)


def macro_f1(pred: torch.Tensor, gold: torch.Tensor) -> float:
    """Mean per-class F1 in percent, over the classes that occur in `gold` or `pred` (as
    scikit-learn's f1_score(average='macro')): every class counts the same, however rare."""
    f1 = []
    for c in torch.cat([gold, pred]).unique().tolist():
        tp = int(((pred == c) & (gold == c)).sum())
        wrong = int(((pred == c) != (gold == c)).sum())  # false positives + false negatives
        f1.append(2 * tp / (2 * tp + wrong))
    return 100 * sum(f1) / len(f1) if f1 else 0.0


def special_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] True at ordinary pieces (not padding, <s>, </s>, ...): the positions pooled for
    sentence vectors."""
    return input_ids.ge(NUM_SPECIAL)


def unknown_share(input_ids: torch.Tensor) -> float:
    """The share of the text's pieces in rows [b, s] that the tokenizer read as <unk> (the text's
    pieces: every position but padding and the layout's <s>/</s>)."""
    unknown = int(input_ids.eq(UNK_ID).sum())
    pieces = unknown + int(special_mask(input_ids).sum())
    return unknown / pieces if pieces else 0.0
