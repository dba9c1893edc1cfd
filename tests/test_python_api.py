"""docs/python-api.md's example of calling the steps from Python, run as written (its updates cut)."""

from __future__ import annotations

import pytest

from conftest import REPO

MARK = "<!-- tests/test_python_api.py runs this block, its updates cut -->"
CUTS = {"train_iters=400": "train_iters=2",  # Step 1 and Step 2
        "FinetuneConfig(seq_length=train.seq_length)": "FinetuneConfig(seq_length=train.seq_length, epochs=0.02)"}


def steps_example() -> str:
    block = (REPO / "docs" / "python-api.md").read_text().split(MARK, 1)[1].split("```python\n", 1)[1]
    code = block.split("```", 1)[0]
    for old, new in CUTS.items():
        assert code.count(old) == 1, old  # the example still says it: the cut applies
        code = code.replace(old, new)
    return code


@pytest.mark.slow
def test_the_steps_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(steps_example(), "docs/python-api.md", "exec"), scope)
    assert scope["summary"]["task"] == "bible-genre" and "source_score" in scope["summary"]
    scored = {(r["system"], r["lang"]) for r in scope["records"]}
    assert ("minijoint", "de") in scored and ("no_adaptation", "de") in scored
    assert all(0.0 <= r["score"] <= 100.0 for r in scope["records"])
