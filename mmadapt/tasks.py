"""The tasks of Steps 3 and 4: what each one reads, how its examples are encoded, how it is scored.

The paper's tasks (XNLI, PAWS-X, MLQA, XQuAD, POS, NER; their files: readers.py), the demo's
tasks on the packaged Bible (bible-genre, bible-testament; corpora.py), and your own data
(classify, pair and tag over CSV, TSV or JSON Lines, with the columns FinetuneConfig names).
A task's examples become fixed-length piece ids (features.py) and its model's logits become
every metric that applies to it (`scores`), in percent.
"""

from __future__ import annotations

import codecs
import dataclasses
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mmadapt import parallel
from mmadapt.config import COLUMN_FIELDS, OWN_TASK_COLUMNS, FinetuneConfig, given
from mmadapt.corpora import (GENRE_TEST_PER_CLASS, GENRE_TRAIN_PER_CLASS, TESTAMENT_TEST_PER_CLASS,
                             TESTAMENT_TRAIN_PER_CLASS, genre_examples, testament_examples)
from mmadapt.features import (Encoded, Framing, best_spans, chunk_f1, encode_classify, encode_span, encode_tag, is_bio,
                              macro_f1)
from mmadapt.readers import (NLI_LABELS, PairExample, read_conll2003, read_conllu, read_nli, read_pawsx, read_squad,
                             read_tagged, read_texts, squad_scores)
from mmadapt.tokens import IGNORE_INDEX


def _read_genre(spec: str, lang: str, split: str, cfg: FinetuneConfig):
    if spec != "bible":
        raise ValueError(f"the bible-genre task reads the packaged Bible: pass 'bible', not {spec!r}")
    return genre_examples(lang, split, GENRE_TRAIN_PER_CLASS if split == "train" else GENRE_TEST_PER_CLASS)


def _read_testament(spec: str, lang: str, split: str, cfg: FinetuneConfig):
    if spec != "bible":
        raise ValueError(f"the bible-testament task reads the packaged Bible: pass 'bible', not {spec!r}")
    return testament_examples(lang, split, TESTAMENT_TRAIN_PER_CLASS if split == "train" else TESTAMENT_TEST_PER_CLASS)


def _read_own(name: str) -> Callable:
    """Your own task's reader: the columns FinetuneConfig names, else OWN_TASK_COLUMNS[name].
    Columns given as numbers (--text_column 0 --label_column 1) are positions in a CSV/TSV file
    without a header line; then every column the task reads is given so."""
    defaults = OWN_TASK_COLUMNS[name]

    def read(path: str, lang: str, split: str, cfg: FinetuneConfig):
        if cfg.text_pair_column is not None and defaults[1] is None:
            raise ValueError(f"--text_pair_column is for --task pair, not {name}")
        given = {flag: getattr(cfg, flag) for flag in COLUMN_FIELDS}
        needed = [flag for flag, default in zip(given, defaults) if default is not None]
        numbered = [flag for flag in needed if given[flag] is not None and given[flag].isdigit()]
        if numbered and len(numbered) < len(needed):
            other = next(flag for flag in needed if flag not in numbered)
            raise ValueError(f"--{numbered[0]} {given[numbered[0]]} is a column number (a file without a header "
                             f"line): give --{other} as a number too")
        text, pair, label = (given[flag] or default for flag, default in zip(given, defaults))
        header = not numbered
        examples = (read_tagged(path, text, label, header) if name == "tag" else
                    read_texts(path, text, label, pair, header))
        if numbered:  # a header line read as a row: its column name a label (a class) seen once
            labels = [tuple(ex.tags) if name == "tag" else (ex.label,) for ex in examples]
            seen = Counter(labels)
            if labels[0] == (defaults[2],) and seen[labels[0]] == 1:
                raise ValueError(f"{path}: its first row is labelled {defaults[2]!r}, once: a header line, read as a "
                                 "row where the columns are given by number; name them instead "
                                 f"(--{numbered[0]} <its name>, ...)")
            # another column name (sentence,category): a class of its own, seen once where every
            # other class is seen more often; maybe a real example, so said, not refused
            if (name != "tag" and seen[labels[0]] == 1 and len(seen) > 2
                    and min(seen[o] for o in seen if o != labels[0]) > 1
                    and parallel.is_rank0()):  # (every rank reads the file)
                print(f"warning: {path}: its first row is labelled {labels[0][0]!r}, a label no other row has: if it "
                      f"is a header line, name the columns instead of numbering them (--{numbered[0]} <its name>, "
                      "...); read as an example", file=sys.stderr, flush=True)
        return examples
    return read


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # classify | tag | span (the family's task_kinds)
    metric: str  # the default headline (see `metric_names`), in percent
    lr: float  # the paper's peak fine-tuning learning rate
    read: Callable  # (path or spec, lang, split, FinetuneConfig) -> examples
    labels: tuple[str, ...] | None = None  # None: the labels seen in the training data; QA: none
    # Your own data: an evaluation label the training file did not have is an error (the head
    # has no output for it); the paper's tag sets instead score an unseen tag as wrong.
    own: bool = False
    pairs: bool = False  # classify: its examples are pairs of texts (<s> a </s></s> b </s>)
    # Its reader selects a language's examples from a source holding several (XNLI's test file,
    # the packaged Bible): one --eval_file serves every language; another task's needs {lang}
    by_lang: bool = False


TASKS = {
    # XNLI: MultiNLI train.tsv for English training; xnli.test.tsv (every language, filtered by lang).
    "xnli": Task("xnli", "classify", "accuracy", 1e-5, lambda p, lang, split, cfg: read_nli(p, lang), NLI_LABELS,
                 pairs=True, by_lang=True),
    "pawsx": Task("pawsx", "classify", "accuracy", 1e-5, lambda p, lang, split, cfg: read_pawsx(p, lang),
                  ("different", "paraphrase"), pairs=True),
    # MLQA's metric normalises answers per language (readers.normalize_answer); XQuAD is scored as SQuAD v1.1
    "mlqa": Task("mlqa", "span", "squad_f1", 3e-5, lambda p, lang, split, cfg: read_squad(p, lang), ()),
    "xquad": Task("xquad", "span", "squad_f1", 3e-5, lambda p, lang, split, cfg: read_squad(p), ()),
    "pos": Task("pos", "tag", "accuracy", 3e-5, lambda p, lang, split, cfg: read_conllu(p)),
    "ner": Task("ner", "tag", "chunk_f1", 3e-5, lambda p, lang, split, cfg: read_conll2003(p)),
    # The demo's task on the packaged Bible (mmadapt/corpora.py): a verse's book genre.
    "bible-genre": Task("bible-genre", "classify", "accuracy", 3e-5, _read_genre,
                        ("law_history", "poetry_wisdom", "prophets", "gospels_acts", "letters"), by_lang=True),
    "bible-testament": Task("bible-testament", "classify", "accuracy", 3e-5, _read_testament, ("old", "new"),
                            by_lang=True),
    # Your own data (CSV, TSV, JSON Lines), labels from the training file. 3e-5: the paper's rate
    # for its smaller training sets (QA, tagging), as for bible-genre.
    "classify": Task("classify", "classify", "accuracy", 3e-5, _read_own("classify"), own=True),
    "pair": Task("pair", "classify", "accuracy", 3e-5, _read_own("pair"), own=True, pairs=True),
    "tag": Task("tag", "tag", "accuracy", 3e-5, _read_own("tag"), own=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


# FinetuneConfig fields only QA reads (your own files' columns: config.COLUMN_FIELDS)
SPAN_FIELDS = ("doc_stride", "max_query_length", "max_answer_length")


def check_task_fields(task: Task, cfg: FinetuneConfig) -> None:
    """Refuse, in one line, a field set away from its default that `task` never reads (before,
    `--task xnli --label_column gold_label` trained with the flag dropped unsaid)."""
    defaults = FinetuneConfig()
    for name in SPAN_FIELDS:  # under MMADAPT_TINY=1 a default is capped (max_query_length), not given either
        if task.kind != "span" and given(name, getattr(cfg, name), getattr(defaults, name)):
            raise ValueError(f"--{name} is for question answering (xquad, mlqa), which {task.name} is not: drop it")
    if task.kind != "tag" and cfg.calculate_per_token_loss != defaults.calculate_per_token_loss:
        raise ValueError(f"--calculate_per_token_loss weighs a tag task's micro-batches by their tagged words; "
                         f"{task.name} scores one per row, the same either way: drop it")
    for name in COLUMN_FIELDS:
        if not task.own and getattr(cfg, name) is not None:
            raise ValueError(f"--{name} names a column of your own data (--task classify, pair or tag); "
                             f"{task.name} reads its files in their own format: drop it")


def check_one_file_per_language(spec: str, langs: list[str], flag: str, by_lang: bool = False) -> None:
    """`spec` (an evaluation file, or a prepared dataset) serves every language of `langs`: {lang}
    in it, or (by_lang) a task whose reader selects each language from one source (Task.by_lang).
    Refused otherwise: every language was scored on one file and recorded as its own."""
    if len(langs) > 1 and "{lang}" not in spec and not by_lang:
        raise ValueError(f"{flag} {spec} is one file for the artifacts' {len(langs)} languages ({', '.join(langs)}): "
                         f"each would be scored on it and recorded as its own language; put {{lang}} in the path (it "
                         "stands for each artifact's language), or evaluate each language apart")


def read_examples(task: Task, spec: str, lang: str, split: str, cfg: FinetuneConfig | None = None,
                  labels: list[str] | None = None) -> list:
    """A task's examples from a file (or 'bible' for bible-genre); `{lang}` in the path is
    replaced by the language. `cfg` names your own task's columns; `labels` (evaluation data):
    the run's labels, which your own task's file must not go beyond."""
    spec = spec.replace("{lang}", lang)
    try:
        examples = task.read(spec, lang, split, cfg or FinetuneConfig())
    except UnicodeDecodeError:
        raise ValueError(f"{spec} is not UTF-8 text{_bad_byte(spec)}: save it as UTF-8") from None
    if not examples:
        raise ValueError(f"{spec} holds no {task.name} examples for language {lang!r}")
    if task.kind == "span" and split == "train":
        check_answer_offsets(examples, spec)
    if labels is not None:
        check_labels(task, examples, labels, spec)
        if task.metric == "chunk_f1":  # (a tagging task's examples: a classification task's may be tuples)
            check_chunk_tags(task, sorted({t for ex in examples for t in ex.tags}), spec, evaluation=True)
    return examples


def check_answer_offsets(examples: list, path: str) -> None:
    """Step 3 learns each question's span from its first answer's answer_start (features.encode_span):
    an offset that does not hold the answer's text (one counted in bytes, or a context edited
    after) trained the span there, or none where it fell outside the context, unsaid. Refused,
    naming the first and how many. (Evaluation scores answers by their text: not checked there.)"""
    def at_offset(ex) -> bool:
        text, start = ex.answers[0]
        return 0 <= start and ex.context[start:start + len(text)] == text
    wrong = [ex for ex in examples if not at_offset(ex)]
    if wrong:
        text, start = wrong[0].answers[0]
        held = wrong[0].context[start:start + len(text)] if start >= 0 else ""
        more = f" (and {len(wrong) - 1} more of the {len(examples)} questions)" if len(wrong) > 1 else ""
        raise ValueError(f"{path}: the answer {text!r} of question {wrong[0].id!r} is not at its answer_start {start} "
                         f"(the context holds {held!r} there){more}: answer_start counts the context's characters "
                         "from 0; correct the offsets")


def _bad_byte(path: str) -> str:
    """' (byte offset N)': where a file stops being UTF-8 (a leading BOM allowed)."""
    data = Path(path).read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        return f" (byte offset {bom + e.start})"
    return ""


def _gold(task: Task, ex) -> list:
    return ex.tags if task.kind == "tag" else [ex.label]


def label_names(task: Task, examples: list) -> list[str]:
    """The task's fixed labels, else those of the training examples, sorted (integers by value)
    and as strings: what run.json stores and evaluation maps labels by."""
    if task.labels is not None:
        return list(task.labels)
    return [str(label) for label in sorted({g for ex in examples for g in _gold(task, ex)})]


def check_chunk_tags(task: Task, labels: list[str], where: str, evaluation: bool = False) -> None:
    """A task scored by entity chunks (ner) needs O, B-X and I-X tags (IOB1 or IOB2, features.
    chunks): refuse, in one line, another scheme, which chunk F1 would read silently wrong (IOBES's
    S-PER S-PER as one entity, plain types as untyped chunks). evaluation: the gold tags of a file
    scored against a model (the chunks are read from them as written), which may hold no entity."""
    if task.metric != "chunk_f1" or is_bio(labels) or (evaluation and set(labels) <= {"O"}):
        return
    bad = next((t for t in labels if t != "O" and t[:2] not in ("B-", "I-")), "O")
    raise ValueError(f"{where}: the {task.name} task scores entity chunks of O, B-X and I-X tags (IOB1 or IOB2), and "
                     f"its tags include {bad!r}" + (" alone" if bad == "O" else "") + ": convert them (IOBES S-X to "
                     "B-X, E-X to I-X)" + ("" if evaluation else ", or fine-tune on them as your own --task tag "
                                           "(scored by accuracy)"))


def check_labels(task: Task, examples: list, labels: list[str], where: str = "the data") -> None:
    """Your own task: every label of `examples` must be one of the run's."""
    if task.own:
        known = set(labels)
        unseen = next((g for ex in examples for g in _gold(task, ex) if str(g) not in known), None)
        if unseen is not None:
            raise ValueError(f"{where} has the label {unseen!r}, which the model was not trained on (its labels: "
                             f"{', '.join(labels)})")


def encode(task: Task, sp, examples: list, labels: list[str], cfg: FinetuneConfig,
           framing: Framing = Framing()) -> Encoded:
    """The task's examples as the rows its model reads, laid out by the model family's `framing`."""
    if task.kind == "classify":
        if task.own:  # file labels -> class ids of the run's label list
            check_labels(task, examples, labels)
            index = {name: i for i, name in enumerate(labels)}
            examples = [(ex.text, index[str(ex.label)]) if ex.text_pair is None else
                        PairExample(ex.text, ex.text_pair, index[str(ex.label)]) for ex in examples]
        elif task.labels is not None and list(labels) != list(task.labels):
            # a model whose outputs are in another order than the task's (an imported classifier:
            # its id2label): each gold id becomes the model's output of that label
            to_model = [list(labels).index(name) for name in task.labels]
            examples = [dataclasses.replace(ex, label=to_model[ex.label]) if isinstance(ex, PairExample)
                        else (ex[0], to_model[ex[1]]) for ex in examples]
        return encode_classify(sp, examples, cfg.seq_length, framing)
    if task.kind == "tag":
        check_labels(task, examples, labels)
        return encode_tag(sp, examples, labels, cfg.seq_length, framing)
    return encode_span(sp, examples, cfg.seq_length, cfg.doc_stride, cfg.max_query_length, framing)


def metric_names(task: Task, labels: list[str]) -> tuple[str, ...]:
    """The metrics `scores` computes for a task: classify accuracy and macro-F1; span SQuAD F1
    and exact match; tag accuracy, and chunk F1 when the tags are B-/I-/O (NER, your own BIO tags)."""
    if task.kind == "classify":
        return ("accuracy", "macro_f1")
    if task.kind == "span":
        return ("squad_f1", "exact_match")
    return ("accuracy", "chunk_f1") if task.metric == "chunk_f1" or is_bio(labels) else ("accuracy",)


def headline(task: Task, labels: list[str], cfg: FinetuneConfig) -> str:
    """The metric a run is scored by: --metric, else the task's."""
    names = metric_names(task, labels)
    if cfg.metric is not None and cfg.metric not in names:
        raise ValueError(f"--metric {cfg.metric} does not apply to {task.name}"
                         + (" with these tags" if task.kind == "tag" else "") + f": choose {' or '.join(names)}")
    return cfg.metric or task.metric


def percent(hits: torch.Tensor) -> float:
    """The share of True in `hits` in percent, from the counts (an fp32 mean gave 13 of 40 as
    32.499998807907104, as macro_f1 counts)."""
    return 100 * int(hits.sum()) / hits.numel() if hits.numel() else float("nan")


def scores(task: Task, logits: torch.Tensor, enc: Encoded, examples: list, labels: list[str],
           cfg: FinetuneConfig) -> dict[str, float]:
    """Every metric of `metric_names`, in percent, from the logits of `encode`'s rows."""
    pred = logits.argmax(-1)
    if task.kind == "classify":
        return {"accuracy": percent(pred == enc.labels), "macro_f1": macro_f1(pred, enc.labels)}
    if task.kind == "span":
        s = squad_scores(best_spans(logits, enc, examples, cfg.max_answer_length), examples)
        return {"squad_f1": s["f1"], "exact_match": s["exact_match"]}
    scored = enc.labels.ne(-100)
    out = {"accuracy": percent(pred[scored] == enc.labels[scored])}
    if "chunk_f1" in metric_names(task, labels):
        names = [*labels, "<unseen>"]
        pred_tags = sentence_tags(enc, pred, names)  # at the scored positions: each sentence's words
        # the gold chunks as the file writes them: a tag the training file lacked (B-PER of an IOB2
        # target against IOB1 CoNLL-2003 English) keeps its type and boundary, where its id
        # (len(labels), "<unseen>") would merge or split the entity; from the ids where no
        # examples are given
        gold = [list(ex.tags) for ex in examples]
        if not (len(gold) == len(pred_tags) and all(len(g) == len(p) for g, p in zip(gold, pred_tags))):
            gold = sentence_tags(enc, enc.labels, names)
        out["chunk_f1"] = chunk_f1(gold, pred_tags)
    return out


def sentence_tags(enc: Encoded, ids: torch.Tensor, names: list[str]) -> list[list[str]]:
    """Per sentence, the tags `ids` [rows, s] give its words (each word's first piece: encode_tag's
    labelled positions), a sentence's rows joined in order: a chunk may run across two rows."""
    scored = enc.labels.ne(-100)
    out: dict[int, list[str]] = {}
    for r in range(len(enc)):
        k = int(enc.example[r]) if enc.example is not None else r
        out.setdefault(k, []).extend(names[i] for i in ids[r][scored[r]].tolist())
    return list(out.values())


def score(task: Task, logits: torch.Tensor, enc: Encoded, examples: list, labels: list[str],
          cfg: FinetuneConfig) -> float:
    """The headline metric (`headline`), in percent."""
    return scores(task, logits, enc, examples, labels, cfg)[headline(task, labels, cfg)]


def chance_levels(task: Task, enc: Encoded, examples: list, labels: list[str], cfg: FinetuneConfig) -> dict | None:
    """What a model that learned nothing scores on `encode`'s rows of an evaluation set
    (classify and tag; None for QA, whose answers are spans):
        chance             the headline metric (`headline`) of always predicting the most frequent
                           gold label of these rows (a tag task: of its scored tokens), via `scores`
        majority_accuracy  that predictor's accuracy, the rate `at_chance` tests a score against
        uniform_accuracy   a uniform guess's expected accuracy, 100 / C for the C labels
        scored_items       rows (classify) or scored tokens (tag): the binomial n
    A tag no training example had (index C, scored as wrong) is never the predicted one."""
    if task.kind == "span":
        return None
    gold = enc.labels if task.kind == "classify" else enc.labels[enc.labels.ne(IGNORE_INDEX)]
    top = int(torch.bincount(gold, minlength=len(labels) + 1)[:len(labels)].argmax())
    logits = torch.zeros(*enc.labels.shape, len(labels))  # classify [n, C]; tag [n, s, C]
    logits[..., top] = 1.0
    majority = scores(task, logits, enc, examples, labels, cfg)
    return {"chance": majority[headline(task, labels, cfg)], "majority_accuracy": majority["accuracy"],
            "uniform_accuracy": 100 / len(labels), "scored_items": len(gold)}
