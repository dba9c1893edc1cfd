"""Readers for the paper's evaluation data formats, and the SQuAD answer metric.

None of these datasets can be downloaded at run time here; users fetch them once:
    XNLI        https://cims.nyu.edu/~sbowman/xnli/ (XNLI-1.0.zip: xnli.dev.tsv, xnli.test.tsv);
                English training data: MultiNLI 1.0 (multinli_1.0_train.txt / train.tsv)
    PAWS-X      https://github.com/google-research-datasets/paws/tree/master/pawsx
                (x-final/en/train.tsv for Step 3; x-final/<lang>/dev_2k.tsv, test_2k.tsv)
    MLQA        https://github.com/facebookresearch/MLQA (MLQA_V1/{dev,test}/*-context-<c>-question-<q>.json)
    XQuAD       https://github.com/google-deepmind/xquad (xquad.<lang>.json), SQuAD v1.1 for English training
    POS         Universal Dependencies CoNLL-U treebanks; NER: CoNLL-2003-style column files
All readers take the file as distributed and return plain Python records. Your own data (the
classify, pair and tag tasks) is read from CSV, TSV or JSON Lines with named columns.
"""

from __future__ import annotations

import collections
import csv
import functools
import json
import os
import re
import string
import sys
import unicodedata
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
    """One SQuAD-format question: answers as (text, character offset in context); lang: the
    language MLQA's metric normalises its answers for ("" : SQuAD v1.1's, as XQuAD is scored)."""
    id: str
    context: str
    question: str
    answers: list[tuple[str, int]] = field(default_factory=list)
    lang: str = ""


@dataclass
class TaggedSentence:
    """Words and one tag per word (UPOS for CoNLL-U, NER for CoNLL-2003)."""
    words: list[str]
    tags: list[str]


def _check(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: name the data file itself (mmadapt/readers.py says which file of "
                         "each dataset is read)")
    if not path.is_file():
        raise ValueError(f"{path} does not exist: see mmadapt/readers.py for where each dataset comes from")
    return path


def _tsv(path: Path):
    csv.field_size_limit(sys.maxsize)
    # -sig: a byte-order mark (a spreadsheet's save) is no part of the first column's name (XNLI's
    # 'language' then went unseen, and every language's rows were scored as the one asked for)
    with open(path, encoding="utf-8-sig", newline="") as f:
        yield from csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)


def read_nli(path: str | os.PathLike, lang: str | None = None) -> list[PairExample]:
    """XNLI's xnli.{dev,test}.tsv (all languages in one file; `lang` selects one) or MultiNLI's
    train.tsv / dev_matched.tsv (or multinli_1.0_*.txt): columns found by header name (sentence1,
    sentence2, gold_label, language; a file without a language column is read whole). Pairs whose
    gold label is '-' (no annotator majority) are dropped, as in the official evaluation."""
    rows = _tsv(_check(path))
    header = next(rows, None)
    need = ("sentence1", "sentence2", "gold_label")
    if header is None or any(c not in header for c in need):
        raise ValueError(f"{path} is not an XNLI/MultiNLI TSV: its header lacks one of {need}")
    col = {c: header.index(c) for c in header}
    # A row needs the columns read, not every column of the header: MultiNLI's .txt files end in
    # label1..label5, where a training pair has one annotator's label and its row stops there
    needed = 1 + max(col[c] for c in (*need, *(("language",) if "language" in col else ())))
    out = []
    for r in rows:
        if len(r) < needed:
            continue
        gold, row_lang = r[col["gold_label"]], r[col["language"]] if "language" in col else ""
        if gold not in NLI_LABELS or (lang is not None and "language" in col and row_lang != lang):
            continue
        out.append(PairExample(r[col["sentence1"]], r[col["sentence2"]], NLI_LABELS.index(gold), row_lang))
    return out


def read_pawsx(path: str | os.PathLike, lang: str = "") -> list[PairExample]:
    """PAWS-X x-final/en/train.tsv (Step 3; the other languages hold translated_train.tsv) / dev_2k.tsv /
    test_2k.tsv: id, sentence1, sentence2, label
    (1 = paraphrase). Rows with an empty sentence (untranslated) are dropped."""
    rows = _tsv(_check(path))
    header = next(rows, None)
    if header is None or header[:4] != ["id", "sentence1", "sentence2", "label"]:
        raise ValueError(f"{path} is not a PAWS-X TSV: expected the header id, sentence1, sentence2, label")
    return [PairExample(r[1], r[2], int(r[3]), lang) for r in rows
            if len(r) >= 4 and r[1].strip() and r[2].strip() and r[3] in ("0", "1")]


def read_squad(path: str | os.PathLike, lang: str = "") -> list[QAExample]:
    """SQuAD v1.1-format JSON (SQuAD, MLQA, XQuAD): data -> paragraphs -> context, qas (id,
    question, answers: text, answer_start). Anything else is refused, naming where. lang: MLQA's
    language, which its metric normalises answers for (QAExample.lang)."""
    try:
        data = json.loads(_check(path).read_text(encoding="utf-8-sig"))  # a byte-order mark is not JSON's
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg}, line {e.lineno}): SQuAD-format JSON expected") from None
    data = data.get("data") if isinstance(data, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"{path} is not SQuAD-format JSON: expected {{\"data\": [articles]}}")
    out, ids = [], set()
    for a, article in enumerate(data, 1):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise ValueError(f"{path}: article {a} has no 'paragraphs' list")
        for p, para in enumerate(paragraphs, 1):
            where = f"{path}: article {a}, paragraph {p}"
            if (not isinstance(para, dict) or not isinstance(para.get("context"), str) or
                    not isinstance(para.get("qas"), list)):
                raise ValueError(f"{where} needs a 'context' text and a 'qas' list")
            for q, qa in enumerate(para["qas"], 1):
                if not isinstance(qa, dict):
                    raise ValueError(f"{where}, question {q} is not an object")
                for key in ("id", "question"):
                    if not isinstance(qa.get(key), str):
                        raise ValueError(f"{where}, question {q} has no {key!r} text: SQuAD-format questions each "
                                         "have a unique id and a question")
                if qa["id"] in ids:
                    raise ValueError(f"{where}, question {q}: the id {qa['id']!r} is used twice; answers are scored by id")
                ids.add(qa["id"])
                answers = qa.get("answers", [])
                if not isinstance(answers, list) or not all(
                        isinstance(x, dict) and isinstance(x.get("text"), str) and isinstance(x.get("answer_start"), int)
                        for x in answers):
                    raise ValueError(f"{where}, question {qa['id']!r}: 'answers' must be a list of "
                                     "{\"text\", \"answer_start\"}")
                blank = next((x for x in answers if not x["text"].strip()), None)
                if blank is not None:
                    # a span of nothing: Step 3 trained it toward <s> (no window holds it), as an
                    # unanswerable question below; a gold answer no prediction can match
                    raise ValueError(f"{where}, question {qa['id']!r} has an empty answer {blank['text']!r} (at "
                                     f"{blank['answer_start']}): every answer is a span of the context's text; "
                                     "correct it or drop the question")
                if not answers or qa.get("is_impossible"):
                    # SQuAD 2.0's unanswerable questions: Step 3 would train them toward <s> (no
                    # span), which best_spans never predicts, and they would score EM 100, F1 0
                    raise ValueError(f"{where}, question {qa['id']!r} has no answer (a SQuAD 2.0 unanswerable "
                                     "question): the span tasks read SQuAD 1.1, every question answered; drop such "
                                     "questions")
                out.append(QAExample(qa["id"], para["context"], qa["question"],
                                     [(x["text"], x["answer_start"]) for x in answers], lang))
    return out


def read_conllu(path: str | os.PathLike) -> list[TaggedSentence]:
    """CoNLL-U: one word per line (ID FORM LEMMA UPOS ...), sentences separated by blank lines.
    Multiword-token lines (ID '1-2', e.g. Spanish 'del' = 'de' + 'el') and empty nodes ('1.1')
    are skipped: the syntactic words that follow them carry the tags."""
    out, words, tags = [], [], []
    with open(_check(path), encoding="utf-8-sig") as f:  # a byte-order mark is no column
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
    with open(_check(path), encoding="utf-8-sig") as f:
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


def read_table(path: str | os.PathLike, header: bool = True) -> tuple[list[str], list[dict]]:
    """(column names, rows as {column: value}) of a CSV or TSV file (the same quoting in both: a
    quoted field may hold the delimiter, quotes doubled, and newlines; a leading BOM is dropped)
    or of JSON Lines (one object per line; values keep their JSON types). A CSV/TSV file's first
    line names its columns, each once, and every row has as many fields, so a row cut or shifted
    by an unquoted delimiter is refused, naming its line. header=False (CSV/TSV only): no header
    line; the columns are named by their 0-based position, "0", "1", ..."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: name the data file itself ({', '.join(TABLE_FORMATS)})")
    kind = TABLE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown file type {path.suffix or '(no extension)'!r}; your own data is read "
                         f"from {', '.join(TABLE_FORMATS)} (.json: one object per line)")
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    if kind == "jsonl":
        if not header:
            raise ValueError(f"{path}: JSON Lines rows name their columns: give --text_column and --label_column as "
                             "names, not numbers (mmadapt evaluate reads a file as its fine-tuned run read its own: "
                             "CSV or TSV without a header line, for a run given column numbers)")
        rows = []
        with open(path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=one_key_each)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg}); JSON Lines hold one object per line") from None
                except TwiceNamed as e:  # json keeps the last silently; a header line's twice is refused
                    raise ValueError(f"{path}:{n}: the object names {e.args[0]!r} twice: give each column once, so "
                                     "that the row is read as written") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: a JSON Lines row must be an object {{column: value}}, "
                                     f"not a {type(row).__name__}")
                rows.append(row)
        columns = list(dict.fromkeys(k for r in rows for k in r))
    else:
        delimiter = "," if kind == "csv" else "\t"
        csv.field_size_limit(sys.maxsize)
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: spreadsheets write a BOM
            # strict: a quote closing a field before its end ('"Hi" there', a text that starts with
            # a quote) and a quoted field open at the end of the file are refused; csv otherwise
            # drops the quotes ('Hi there') or takes the rest of the file as one field, silently
            reader, end = csv.reader(f, delimiter=delimiter, strict=True), 0
            try:
                columns = next((r for r in reader if r), []) if header else []
                first_line = reader.line_num
                seen = {}
                for i, name in enumerate(columns):
                    if name in seen:
                        raise ValueError(f"{path}: the header line names column {name!r} twice (columns "
                                         f"{seen[name] + 1} and {i + 1}): rename one, so that each column is read once")
                    seen[name] = i
                records, end = [], reader.line_num
                for r in reader:
                    if r:  # ([] is a blank line)
                        records.append((end + 1, r))  # the line a row starts on (a quoted field may span several)
                    end = reader.line_num
            except csv.Error as e:
                what = ("a quoted field runs to the end of the file" if "end of data" in str(e) else
                        "a quoted field is followed by more text")
                raise ValueError(f"{path}:{end + 1}: {what}: a text starting with a quote (\") is read as a quoted "
                                 'field; quote such a text whole, its quotes doubled ("""Hi"" there"), or drop the '
                                 "quote") from None
        width = len(columns) if header else len(records[0][1]) if records else 0
        where = "the header line" if header else f"line {records[0][0] if records else first_line}"
        for line, r in records:
            if kind == "tsv" and any("\n" in v and "\t" in v for v in r):
                # a text that starts with a quote, unquoted, opened a field that swallowed the rows
                # after it (tabs, line ends and all) up to the next quote: rows lost, no count off
                raise ValueError(f"{path}:{line}: a field runs over several lines and holds tabs: a text starting with "
                                 'a quote (") is read as a quoted field; quote such a text whole, its quotes doubled '
                                 '("""Hi"" there"), or drop the quote (a text that holds tabs and line ends both: '
                                 "write the file as .csv or .jsonl)")
            if len(r) != width:
                raise ValueError(f"{path}:{line}: {len(r)} field{'s' if len(r) != 1 else ''} where {where} has "
                                 f"{width}: quote a field that holds a {'comma' if kind == 'csv' else 'tab'} "
                                 '("like, this"), or fill in the missing one')
        again = next((line for line, r in records if header and r == columns), None)
        if again is not None:  # two exports joined: the second's header a row of the first's, its label a class
            raise ValueError(f"{path}:{again}: this row repeats the header line (files joined?): drop it")
        if not header:
            columns = [str(i) for i in range(width)]
        rows = [dict(zip(columns, r)) for _, r in records]
    if not rows:
        raise ValueError(f"{path} holds no rows" + ("" if kind == "jsonl" or not header else " under its header line"))
    return columns, rows


def _column(path: Path, columns: list[str], name: str, flag: str) -> str:
    if name not in columns:
        if name.isdigit():
            raise ValueError(f"{path} has {len(columns)} column{'s' if len(columns) != 1 else ''}, numbered from 0: "
                             f"--{flag} {name} is past them")
        raise ValueError(f"{path} has no column {name!r} (its columns: {', '.join(map(repr, columns))}): "
                         f"name the right one with --{flag} (mmadapt evaluate reads the columns its fine-tuned run "
                         "read: give the file those)")
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
    raise ValueError(f"{path}, row {n}: no label in column {column!r}" +  # (a blank string is none)
                     ("" if value is None or isinstance(value, str) else
                      f" ({value!r} is neither a string nor an integer)"))


def read_texts(path: str | os.PathLike, text: str, label: str, text_pair: str | None = None,
               header: bool = True) -> list[TextExample]:
    """Your own sentence (or sentence-pair, `text_pair` set) classification data: the named
    columns of a read_table file (header False: numbered ones). Every text must be non-empty, and
    a file's labels all strings or all integers (JSON 1 and "1" are one class to the run, but a
    file mixing them is likely a mistake)."""
    path = Path(path)
    columns, rows = read_table(path, header)
    flags = {"text_column": text, "text_pair_column": text_pair, "label_column": label}
    for flag, name in flags.items():
        if name is not None:
            _column(path, columns, name, flag)
    _own_columns(path, flags)
    out = [TextExample(_text(path, n, r, text), _label(path, n, r, label),
                       None if text_pair is None else _text(path, n, r, text_pair)) for n, r in enumerate(rows, 1)]
    kinds = {type(ex.label): ex.label for ex in out}
    if len(kinds) > 1:
        raise ValueError(f"{path}: the labels mix integers and strings (e.g. {kinds[int]!r} and {kinds[str]!r}): "
                         "write every label the same way")
    _one_spelling(path, {ex.label for ex in out if isinstance(ex.label, str)})
    return out


def _own_columns(path: Path, flags: dict[str, str | None]) -> None:
    """Refuse two column flags (flag -> the column it names, None: not given) naming one column."""
    named = [(flag, name) for flag, name in flags.items() if name is not None]
    for i, (flag, name) in enumerate(named):
        other = next((f for f, n in named[:i] if n == name), None)
        if other is not None:
            raise ValueError(f"{path}: --{other} and --{flag} both name column {name!r}: each reads its own column")


class TwiceNamed(Exception):
    """A JSON object naming one key twice (args: the key)."""


def one_key_each(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: the object, or TwiceNamed for a key given twice."""
    row = dict(pairs)
    if len(row) != len(pairs):
        raise TwiceNamed(next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])))
    return row


def _one_spelling(path: Path, labels: set[str]) -> None:
    """Refuse one number written two ways as labels ("0" and "0.0", "1" and "01"), or one word in
    two cases ("pos" and "Pos"): two classes to the run, one to whoever wrote the file."""
    by_value, by_case = {}, {}
    for label in sorted(labels):
        if label.casefold() in by_case:
            raise ValueError(f"{path}: the labels {by_case[label.casefold()]!r} and {label!r} differ only in case, "
                             "which would be two classes: write each class one way")
        by_case[label.casefold()] = label
        try:
            value = float(label)
        except ValueError:
            continue
        if value in by_value:
            raise ValueError(f"{path}: the labels {by_value[value]!r} and {label!r} are one number written two ways, "
                             "which would be two classes: write each class one way")
        by_value[value] = label


def _tokens(path: Path, n: int, row: dict, column: str) -> list[str]:
    value = row.get(column)
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        # a list written as text (a JSON list in a CSV cell, pandas' ['a', 'b']): split at its
        # spaces, its brackets, quotes and commas became tokens and tags ('["B-PER",')
        listed = _listed(value.strip())  # ('[]' is an empty list: refused as an empty one is)
        value = value if listed is None else listed
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return [str(v).strip() for v in value]
    raise ValueError(f"{path}, row {n}: column {column!r} must hold a list of strings (JSON) or space-separated "
                     f"ones, not {value!r}")


def _listed(text: str) -> list | None:
    """`text` read as a JSON or Python list of strings or integers, or None (tokens that merely
    start and end with brackets: '[ hello ]')."""
    import ast

    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            return value
    return None


def read_tagged(path: str | os.PathLike, tokens: str, tags: str, header: bool = True) -> list[TaggedSentence]:
    """Your own tagging data: one sentence per row, its tokens and one tag per token in two
    columns (JSON Lines: lists; CSV/TSV: space-separated; header False: numbered columns)."""
    path = Path(path)
    columns, rows = read_table(path, header)
    _column(path, columns, tokens, "text_column")
    _column(path, columns, tags, "label_column")
    _own_columns(path, {"text_column": tokens, "label_column": tags})  # (else each word its own tag)
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


# --- the official SQuAD v1.1 and MLQA answer metrics --------------------------------------------

# MLQA's evaluation script (mlqa_evaluation_v1.py): each language's articles, removed after the
# punctuation; Hindi and Chinese have none, and Chinese is cut into its characters ("mixed
# segmentation") before F1 counts tokens. A language MLQA does not have keeps its articles.
MLQA_ARTICLES = {"en": r"\b(a|an|the)\b", "es": r"\b(un|una|unos|unas|el|la|los|las)\b",
                 "vi": r"\b(của|là|cái|chiếc|những)\b",
                 "de": r"\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b",
                 "ar": r"\sال^|ال", "hi": None, "zh": None}
_HAN = re.compile(r"[\u4e00-\u9fa5]")
_ASCII_PUNCTUATION = frozenset(string.punctuation)  # what SQuAD v1.1's metric removes


@functools.cache
def unicode_punctuation() -> frozenset[str]:
    """Every character of a Unicode punctuation category (P*) and ASCII's punctuation: what
    MLQA's metric removes (SQuAD v1.1's removes ASCII's alone)."""
    return frozenset(chr(i) for i in range(sys.maxunicode + 1)
                     if unicodedata.category(chr(i)).startswith("P")) | _ASCII_PUNCTUATION


def _mixed_segmentation(text: str) -> list[str]:
    """MLQA's Chinese tokens: each Han character (or punctuation mark) alone, the rest split at whitespace."""
    out, run = [], ""
    for ch in text:
        if _HAN.match(ch) or ch in unicode_punctuation():
            out += run.split() + [ch]
            run = ""
        else:
            run += ch
    return out + run.split()


def normalize_answer(s: str, lang: str = "") -> str:
    """SQuAD v1.1's (lang ""): lower-case, drop ASCII punctuation and the articles a/an/the,
    collapse whitespace. MLQA's (its language): lower-case, drop Unicode punctuation, then the
    language's articles, then whitespace (Chinese: mixed segmentation)."""
    s = s.lower()
    if not lang:
        s = "".join(ch for ch in s if ch not in _ASCII_PUNCTUATION)
        s = re.sub(r"\b(a|an|the)\b", " ", s)
        return " ".join(s.split())
    punct = unicode_punctuation()
    s = "".join(ch for ch in s if ch not in punct)
    lang = re.split("[-_]", lang)[0].lower()  # zh_Hant, de-DE: MLQA's rules are per language
    if MLQA_ARTICLES.get(lang):
        s = re.sub(MLQA_ARTICLES[lang], " ", s)
    return " ".join(t for t in (_mixed_segmentation(s) if lang == "zh" else s.split()) if t.strip())


def f1_score(prediction: str, truth: str, lang: str = "") -> float:
    pred, gold = normalize_answer(prediction, lang).split(), normalize_answer(truth, lang).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str, lang: str = "") -> float:
    return float(normalize_answer(prediction, lang) == normalize_answer(truth, lang))


def squad_scores(predictions: dict[str, str], examples: list[QAExample]) -> dict[str, float]:
    """{'exact_match', 'f1'} in percent: per question the best over its gold answers, averaged
    over all questions (a question without a prediction scores 0); each question's answers
    normalised for its language where MLQA's (QAExample.lang), as SQuAD v1.1's elsewhere."""
    em = f1 = 0.0
    for ex in examples:
        truths = [t for t, _ in ex.answers] or [""]
        pred = predictions.get(ex.id, "")
        em += max(exact_match(pred, t, ex.lang) for t in truths)
        f1 += max(f1_score(pred, t, ex.lang) for t in truths)
    n = max(1, len(examples))
    return {"exact_match": 100 * em / n, "f1": 100 * f1 / n}
