"""Readers for the paper's evaluation data formats, and the SQuAD answer metric.

None of these datasets can be downloaded at run time here; users fetch them once:
    XNLI        https://cims.nyu.edu/~sbowman/xnli/ (XNLI-1.0.zip: xnli.dev.tsv, xnli.test.tsv);
                English training data: MultiNLI 1.0 (multinli_1.0_train.txt / train.tsv)
    PAWS-X      https://github.com/google-research-datasets/paws/tree/master/pawsx
                (x-final/<lang>/translated_train.tsv, dev_2k.tsv, test_2k.tsv)
    MLQA        https://github.com/facebookresearch/MLQA (MLQA_V1/{dev,test}/*-context-<c>-question-<q>.json)
    XQuAD       https://github.com/google-deepmind/xquad (xquad.<lang>.json), SQuAD v1.1 for English training
    POS         Universal Dependencies CoNLL-U treebanks; NER: CoNLL-2003-style column files
All readers take the file as distributed and return plain Python records. Your own data (the
classify, pair and tag tasks) is read from CSV, TSV or JSON Lines with named columns.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

NLI_LABELS = ("entailment", "neutral", "contradiction")


@dataclass
class PairExample:
    """A sentence pair with a class label (XNLI, MultiNLI, PAWS-X)."""
    sentence1: str
    sentence2: str
    label: int
    lang: str = ""


@dataclass
class QAExample:
    """One SQuAD-format question: answers as (text, character offset in context)."""
    id: str
    context: str
    question: str
    answers: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class TaggedSentence:
    """Words and one tag per word (UPOS for CoNLL-U, NER for CoNLL-2003)."""
    words: list[str]
    tags: list[str]


def _check(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: see mmadapt/readers.py for where each dataset comes from")
    return path


def _tsv(path: Path):
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        yield from csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)


def read_nli(path: str | os.PathLike, lang: str | None = None) -> list[PairExample]:
    """XNLI's xnli.{dev,test}.tsv (all languages in one file; `lang` selects one) or MultiNLI's
    train.tsv / dev_matched.tsv: columns found by header name (sentence1, sentence2, gold_label,
    language; a file without a language column is read whole). Pairs whose gold label is '-' (no annotator majority) are dropped, as in the
    official evaluation."""
    rows = _tsv(_check(path))
    header = next(rows, None)
    need = ("sentence1", "sentence2", "gold_label")
    if header is None or any(c not in header for c in need):
        raise ValueError(f"{path} is not an XNLI/MultiNLI TSV: its header lacks one of {need}")
    col = {c: header.index(c) for c in header}
    out = []
    for r in rows:
        if len(r) < len(header):
            continue
        gold, row_lang = r[col["gold_label"]], r[col["language"]] if "language" in col else ""
        if gold not in NLI_LABELS or (lang is not None and "language" in col and row_lang != lang):
            continue
        out.append(PairExample(r[col["sentence1"]], r[col["sentence2"]], NLI_LABELS.index(gold), row_lang))
    return out


def read_pawsx(path: str | os.PathLike, lang: str = "") -> list[PairExample]:
    """PAWS-X translated_train.tsv / dev_2k.tsv / test_2k.tsv: id, sentence1, sentence2, label
    (1 = paraphrase). Rows with an empty sentence (untranslated) are dropped."""
    rows = _tsv(_check(path))
    header = next(rows, None)
    if header is None or header[:4] != ["id", "sentence1", "sentence2", "label"]:
        raise ValueError(f"{path} is not a PAWS-X TSV: expected the header id, sentence1, sentence2, label")
    return [PairExample(r[1], r[2], int(r[3]), lang) for r in rows
            if len(r) >= 4 and r[1].strip() and r[2].strip() and r[3] in ("0", "1")]


def read_squad(path: str | os.PathLike) -> list[QAExample]:
    """SQuAD v1.1-format JSON (SQuAD, MLQA, XQuAD): data -> paragraphs -> context, qas."""
    try:
        data = json.loads(_check(path).read_text(encoding="utf-8"))["data"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path} is not SQuAD-format JSON (a 'data' list of articles)") from None
    out = []
    for article in data:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                out.append(QAExample(qa["id"], para["context"], qa["question"],
                                     [(a["text"], int(a["answer_start"])) for a in qa.get("answers", [])]))
    return out


def read_conllu(path: str | os.PathLike) -> list[TaggedSentence]:
    """CoNLL-U: one word per line (ID FORM LEMMA UPOS ...), sentences separated by blank lines.
    Multiword-token lines (ID '1-2', e.g. Spanish 'del' = 'de' + 'el') and empty nodes ('1.1')
    are skipped: the syntactic words that follow them carry the tags."""
    out, words, tags = [], [], []
    with open(_check(path), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                if words:
                    out.append(TaggedSentence(words, tags))
                words, tags = [], []
                continue
            if line.startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) != 10:
                raise ValueError(f"{path}:{n}: a CoNLL-U word line has 10 tab-separated columns, this one {len(cols)}")
            if "-" in cols[0] or "." in cols[0]:
                continue
            words.append(cols[1])
            tags.append(cols[3])
    if words:
        out.append(TaggedSentence(words, tags))
    return out


def read_conll2003(path: str | os.PathLike) -> list[TaggedSentence]:
    """CoNLL-2003-style columns (word ... NER tag last), blank lines between sentences,
    -DOCSTART- lines ignored."""
    out, words, tags = [], [], []
    with open(_check(path), encoding="utf-8") as f:
        for line in f:
            cols = line.split()
            if not cols or cols[0] == "-DOCSTART-":
                if words:
                    out.append(TaggedSentence(words, tags))
                words, tags = [], []
                continue
            if len(cols) < 2:
                raise ValueError(f"{path}: a CoNLL-2003 line needs a word and a tag: {line.strip()!r}")
            words.append(cols[0])
            tags.append(cols[-1])
    if words:
        out.append(TaggedSentence(words, tags))
    return out


# --- your own data: CSV, TSV or JSON Lines with named columns ----------------------------------------

# By file extension; a .json file is read as JSON Lines (one object per line), as many tools write it.
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass
class TextExample:
    """A text, or a pair of texts, with its label as the file gives it: a string, or an integer
    in JSON. Labels become class ids only against a run's label list (finetune.encode), so an
    evaluation file is mapped with the training file's classes."""
    text: str
    label: str | int
    text_pair: str | None = None


def read_table(path: str | os.PathLike) -> tuple[list[str], list[dict]]:
    """(column names, rows as {column: value}) of a CSV or TSV file with a header line (the
    same quoting in both: a quoted field may hold the delimiter, quotes doubled, and newlines)
    or of JSON Lines (one object per line; values keep their JSON types)."""
    path = Path(path)
    kind = TABLE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown file type {path.suffix or '(no extension)'!r}; your own data is read "
                         f"from {', '.join(TABLE_FORMATS)} (.json: one object per line)")
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    if kind == "jsonl":
        rows = []
        with open(path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg}); JSON Lines hold one object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: a JSON Lines row must be an object {{column: value}}, "
                                     f"not a {type(row).__name__}")
                rows.append(row)
        columns = list(dict.fromkeys(k for r in rows for k in r))
    else:
        csv.field_size_limit(sys.maxsize)
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: spreadsheets write a BOM
            reader = csv.DictReader(f, delimiter="," if kind == "csv" else "\t")
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    if not rows:
        raise ValueError(f"{path} holds no rows" + ("" if kind == "jsonl" else " under its header line"))
    return columns, rows


def _column(path: Path, columns: list[str], name: str, flag: str) -> str:
    if name not in columns:
        raise ValueError(f"{path} has no column {name!r} (its columns: {', '.join(map(repr, columns))}): "
                         f"name the right one with --{flag}")
    return name


def _text(path: Path, n: int, row: dict, column: str) -> str:
    value = row.get(column)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}, row {n}: column {column!r} holds a {type(value).__name__}, not a text")
    if not value or not value.strip():
        raise ValueError(f"{path}, row {n}: empty text in column {column!r}")
    return value


def _label(path: Path, n: int, row: dict, column: str) -> str | int:
    value = row.get(column)
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{path}, row {n}: no label in column {column!r}" +
                     ("" if value is None or value == "" else f" ({value!r} is neither a string nor an integer)"))


def read_texts(path: str | os.PathLike, text: str, label: str, text_pair: str | None = None) -> list[TextExample]:
    """Your own sentence (or sentence-pair, `text_pair` set) classification data: the named
    columns of a read_table file. Every text must be non-empty, and a file's labels all strings
    or all integers (JSON 1 and "1" are one class to the run, but a file mixing them is likely a
    mistake)."""
    path = Path(path)
    columns, rows = read_table(path)
    for name, flag in ((text, "text_column"), (text_pair, "text_pair_column"), (label, "label_column")):
        if name is not None:
            _column(path, columns, name, flag)
    out = [TextExample(_text(path, n, r, text), _label(path, n, r, label),
                       None if text_pair is None else _text(path, n, r, text_pair)) for n, r in enumerate(rows, 1)]
    kinds = {type(ex.label): ex.label for ex in out}
    if len(kinds) > 1:
        raise ValueError(f"{path}: the labels mix integers and strings (e.g. {kinds[int]!r} and {kinds[str]!r}): "
                         "write every label the same way")
    return out


def _tokens(path: Path, n: int, row: dict, column: str) -> list[str]:
    value = row.get(column)
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return [str(v).strip() for v in value]
    raise ValueError(f"{path}, row {n}: column {column!r} must hold a list of strings (JSON) or space-separated "
                     f"ones, not {value!r}")


def read_tagged(path: str | os.PathLike, tokens: str, tags: str) -> list[TaggedSentence]:
    """Your own tagging data: one sentence per row, its tokens and one tag per token in two
    columns (JSON Lines: lists; CSV/TSV: space-separated)."""
    path = Path(path)
    columns, rows = read_table(path)
    _column(path, columns, tokens, "text_column")
    _column(path, columns, tags, "label_column")
    out = []
    for n, row in enumerate(rows, 1):
        words, labels = _tokens(path, n, row, tokens), _tokens(path, n, row, tags)
        if not words or not all(words):
            raise ValueError(f"{path}, row {n}: empty text in column {tokens!r}")
        if len(words) != len(labels) or not all(labels):
            raise ValueError(f"{path}, row {n}: {len(words)} tokens but {len([t for t in labels if t])} tags: "
                             "give one tag per token")
        out.append(TaggedSentence(words, labels))
    return out


# --- the official SQuAD v1.1 answer metric ------------------------------------------------------

def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def squad_scores(predictions: dict[str, str], examples: list[QAExample]) -> dict[str, float]:
    """{'exact_match', 'f1'} in percent: per question the best over its gold answers, averaged
    over all questions (a question without a prediction scores 0)."""
    em = f1 = 0.0
    for ex in examples:
        truths = [t for t, _ in ex.answers] or [""]
        pred = predictions.get(ex.id, "")
        em += max(exact_match(pred, t) for t in truths)
        f1 += max(f1_score(pred, t) for t in truths)
    n = max(1, len(examples))
    return {"exact_match": 100 * em / n, "f1": 100 * f1 / n}
