"""Every relative link of the README and docs/ reaches a file, and every #anchor a heading of it
(as GitHub slugs headings): a renamed heading or a moved results file breaks no link unseen."""
import re

from conftest import REPO


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: backticks and punctuation dropped, lower case, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    out, seen, fence = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        fence ^= line.startswith("```")
        heading = None if fence else re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            slug = _slug(heading.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    assert _slug("The demo (2026-12-01; retrieval rerun 2026-12-02)") == (
        "the-demo-2026-12-01-retrieval-rerun-2026-12-02")
    assert _slug("`--fusion` (compiled on a GPU by default)") == "--fusion-compiled-on-a-gpu-by-default"
    broken, checked = [], 0
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            f = (doc.parent / path).resolve() if path else doc
            checked += 1
            if not f.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and f.suffix == ".md" and anchor not in _anchors(f):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert checked > 200 and not broken, broken
