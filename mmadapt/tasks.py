"""Readers for the paper's evaluation data formats, and the SQuAD answer metric.

None of these datasets can be downloaded at run time here; users fetch them once:
    XNLI        https://cims.nyu.edu/~sbowman/xnli/ (XNLI-1.0.zip: xnli.dev.tsv, xnli.test.tsv);
                English training data: MultiNLI 1.0 (multinli_1.0_train.txt / train.tsv)
    PAWS-X      https://github.com/google-research-datasets/paws/tree/master/pawsx
                (x-final/<lang>/translated_train.tsv, dev_2k.tsv, test_2k.tsv)
    MLQA        https://github.com/facebookresearch/MLQA (MLQA_V1/{dev,test}/*-context-<c>-question-<q>.json)
    XQuAD       https://github.com/google-deepmind/xquad (xquad.<lang>.json), SQuAD v1.1 for English training
    POS         Universal Dependencies CoNLL-U treebanks; NER: CoNLL-2003-style column files
All readers take the file as distributed and return plain Python records.
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
        raise ValueError(f"{path} does not exist: see mmadapt/tasks.py for where each dataset comes from")
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
