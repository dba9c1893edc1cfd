"""`mmadapt demo --quick` (the README's CI setting) end to end: every stage runs, the table has
the four systems, the records hold a score-versus-compute curve per system, the plot exists."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_env

pytestmark = pytest.mark.slow

SYSTEMS = ("bl_base", "bl_small", "minijoint", "minipost")


def _demo(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmadapt.cli", "demo", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def python_api_example() -> str:
    """The runnable block of docs/python-api.md (it reads the demo's runs under runs/demo)."""
    text = (REPO / "docs" / "python-api.md").read_text()
    after = text.split("<!-- tests/test_demo.py runs this block on the demo's output -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_demo_quick_runs_all_steps_for_all_systems(tmp_path):
    out = tmp_path / "demo"
    proc = _demo("--quick", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[16/16] Step 4" in proc.stdout  # Step 4 in three runs, one per primary model

    records = json.loads((out / "results.json").read_text())
    for task in ("bible-genre", "retrieval"):
        # MINIJOINT's ceiling (Step 2 over its full model) is scored on the tasks too, named apart.
        assert {r["system"] for r in records if r["task"] == task and r["system"] != "no_adaptation"} == \
            {*SYSTEMS, "minijoint:full"}, task
        for system in SYSTEMS:
            curve = sorted((r["step"], r["flops"], r["score"]) for r in records
                           if r["task"] == task and r["system"] == system)
            # From the start (update 0: the new embeddings as initialised, no compute) to the last checkpoint.
            assert [s for s, _, _ in curve] == [0, 50, 100, 150], (task, system)
            assert all(0 <= score <= 100 for _, _, score in curve) and curve[0][1] == 0.0
            # The same Step-2 work per update, but for the head's rows (as many as the masking drew
            # in each update's blocks, counted as run): compute grows about linearly along the curve.
            assert curve[1][1] < curve[2][1] < curve[3][1] and curve[3][1] == pytest.approx(3 * curve[1][1], rel=0.01)
    # Each primary model's fine-tuned runs with no adaptation (their English tokenizer and
    # embeddings on the German test verses), beside the systems they evaluate.
    none = {tuple(r["of"]): r for r in records if r["system"] == "no_adaptation"}
    assert set(none) == {("bl_base", "minipost"), ("bl_small",), ("minijoint", "minijoint:full")}
    assert all(r["task"] == "bible-genre" and r["lang"] == "de" and 0 <= r["score"] <= 100 for r in none.values())
    # The plug-in MLM metric: every system's artifacts (and the ceiling, MINIJOINT's full model)
    # through their primary model, on the same masked held-out pieces, against the unigram
    # reference of those pieces; BL_BASE's new embeddings must use its context (gain > 0).
    plug = [r for r in records if r["task"] == "plugin-mlm"]
    assert {r["system"] for r in plug} == {*SYSTEMS, "minijoint:full"}
    assert len({(r["unigram_loss"], r["masked_pieces"]) for r in plug}) == 1
    for r in plug:
        assert r["score"] == pytest.approx(r["unigram_loss"] - r["loss"])
        assert r["chance"] == 0.0
    final = {r["system"]: r["score"] for r in plug if r["step"] == 150}
    assert final["bl_base"] > 0, final
    # The same records in bits per byte of the raw held-out verses (bpb.py), beside no adaptation:
    # one text for every system, one no-adaptation score per primary model (MINIPOST's is BL_BASE's).
    assert all(0 < r[k] < 16 for r in plug for k in ("bpb", "start_bpb", "none_bpb"))
    assert len({r["bpb_bytes"] for r in plug}) == 1
    assert len({r["none_bpb"] for r in plug if r["system"] in ("bl_base", "minipost")}) == 1
    flops = {r["system"]: r["flops"] for r in records if r.get("step") == 150 and r["task"] == "retrieval"}
    # Step 2 over the mini-models costs less than over the 12-layer model (4 and 6 of 12 layers).
    assert flops["minijoint"] < flops["minipost"] < flops["bl_base"]
    assert flops["bl_small"] == pytest.approx(flops["minijoint"])

    table = (out / "results.md").read_text()
    for system in SYSTEMS:
        assert f"| {system} |" in table
    assert "majority" in table and "retrieval" in table and "unigram reference" in table
    assert "share of the ceiling's gain" in table  # the task tables measure MINIJOINT against its ceiling
    # Both references beside every system's last score, and whether adaptation paid in German.
    assert "## bible-genre: what adaptation bought" in table and "- de: adaptation " in table
    assert "## bits per byte of held-out text: adapted against no adaptation" in table
    last_bits = {r["system"]: r for r in plug if r["step"] == 150}
    r = last_bits["bl_base"]
    assert (f"| de | bl_base | {r['flops'] / 1e18:.3g} | {r['none_bpb']:.3f} | {r['start_bpb']:.3f} | {r['bpb']:.3f} | "
            f"{r['bpb'] - r['none_bpb']:+.3f} |") in table
    assert any(line.startswith("- de: bl_base ") and "no adaptation" in line for line in table.splitlines())
    last = {r["system"]: r["score"] for r in records if r["task"] == "bible-genre" and r.get("step") == 150}
    start = {r["system"]: r["score"] for r in records if r["task"] == "bible-genre" and r.get("step") == 0}
    for of, r in none.items():
        for system in of:
            assert (f"| de | {system} | {r['score']:.1f} | {start[system]:.1f} | {last[system]:.1f}"
                    f"{' ↓' if last[system] <= r['score'] else ''} | {last[system] - r['score']:+.1f} |") in table
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "demo.json").read_text())["langs"] == ["de"]

    # docs/python-api.md's example runs on these runs as written.
    example = subprocess.run([sys.executable, "-c", python_api_example().replace("runs/demo", str(out))], cwd=REPO,
                             capture_output=True, text=True, timeout=600, env=child_env())
    assert example.returncode == 0, example.stderr[-3000:]
    assert example.stdout.splitlines()[0] == "(4, 12)" and "'label': " in example.stdout


def test_demo_refuses_an_unknown_language(tmp_path):
    proc = _demo("--langs", "xx", "--output_dir", str(tmp_path / "d"), timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --langs xx is not a target language")
    assert not (tmp_path / "d").exists()


def _finished_checkpoint(run_dir, step):
    tag = run_dir / "checkpoints" / f"step{step:08d}"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text(json.dumps({"step": step}))


def test_demo_resumes_a_step2_run_stopped_before_its_last_artifact(tmp_path, monkeypatch):
    """A Step-2 run killed between its last checkpoint and that checkpoint's artifact is resumed
    (which writes the artifact), not kept: Step 4 would score it only to its previous checkpoint."""
    from mmadapt import demo, steps

    calls = []
    monkeypatch.setattr(steps, "adapt_embeddings", lambda run, step: calls.append(run.resume))
    d = demo.Demo(demo.QUICK, tmp_path)
    run_dir = tmp_path / "adapt" / "bl_base-de"
    _finished_checkpoint(run_dir, demo.QUICK.adapt_iters)
    d.adapt("bl_base", tmp_path / "src", "de", run_dir, tmp_path / "data")
    assert calls == [True]
    artifact = run_dir / "embeddings" / f"step{demo.QUICK.adapt_iters:08d}"
    artifact.mkdir(parents=True)
    (artifact / "embeddings.pt").write_bytes(b"")
    d.adapt("bl_base", tmp_path / "src", "de", run_dir, tmp_path / "data")
    assert calls == [True], "a finished run with its last artifact is kept"


def test_demo_resumes_a_finetune_stopped_before_its_results(tmp_path, monkeypatch):
    """A fine-tune killed after its last checkpoint, before its record's results (English score,
    warnings), is resumed to write them; the demo's English accuracy never averages in a 0."""
    from mmadapt import demo, steps

    calls = []
    monkeypatch.setattr(steps, "finetune", lambda run, step: calls.append(run.resume))
    d = demo.Demo(demo.QUICK, tmp_path)
    out = tmp_path / "finetune" / "bl_base"
    _finished_checkpoint(out, 7)
    (out / "run.json").write_text(json.dumps({"step": "finetune", "updates": 7}))
    d.finetune(tmp_path / "pretrain" / "bl_base", 1, out)
    assert calls == [True]
    (out / "run.json").write_text(json.dumps({"step": "finetune", "updates": 7, "final_loss": 0.5, "warnings": []}))
    d.finetune(tmp_path / "pretrain" / "bl_base", 1, out)
    assert calls == [True], "a finished run with its results is kept"
    assert demo._mean([58.0, 57.0, None]) is None and demo._mean([58.0, 57.0]) == 57.5


def test_demo_refuses_a_language_or_seed_given_twice(tmp_path):
    """Both copies would write the same runs (and Step 4 would refuse only after all training)."""
    from mmadapt import demo

    for flag, values in (("--langs", ["de", "de"]), ("--finetune_seeds", ["1", "2", "1"])):
        with pytest.raises(ValueError, match=f"^{flag} {values[-1]} is given twice: give each once$"):
            demo.main([flag, *values, "--output_dir", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()


def test_demo_rescoring_with_other_step4_settings_keeps_the_runs(tmp_path):
    """Settings only Step 4 reads may change over a finished demo's directory (it scores every
    run again); a training setting may not."""
    from mmadapt import demo

    (tmp_path / "demo.json").write_text(json.dumps({"retrieval_pairs": 500, "plugin_blocks": 512, "bpb_bytes": 8192,
                                                    "adapt_iters": 1000}))
    demo.check_output(tmp_path, {"retrieval_pairs": 300, "plugin_blocks": 64, "bpb_bytes": 1024, "adapt_iters": 1000})
    with pytest.raises(ValueError, match="adapt_iters 1000, now 10"):
        demo.check_output(tmp_path, {"retrieval_pairs": 500, "adapt_iters": 10})


def test_a_demo_killed_while_it_wrote_its_settings_runs_again_in_its_directory(tmp_path):
    """demo.json is written whole (atomic_write): a kill in the write left its temporary alone in
    the directory, and the same command was then refused ('holds other files and no demo') for
    good. A dead process's temporary goes; a live one's (a demo starting there now) still refuses."""
    import os
    import socket
    import subprocess

    from mmadapt import demo

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    (tmp_path / f".demo.json.tmp{gone.pid}@{socket.gethostname()}").write_text('{"adapt_')
    demo.check_output(tmp_path, {"adapt_iters": 10})
    assert list(tmp_path.iterdir()) == []
    (tmp_path / f".demo.json.tmp{os.getppid()}@{socket.gethostname()}").write_text("{")
    with pytest.raises(ValueError, match="holds other files and no demo"):
        demo.check_output(tmp_path, {"adapt_iters": 10})


def test_demo_step4_scores_only_the_curve_points_of_a_continued_run(tmp_path, monkeypatch):
    """A Step-2 run stopped and continued holds the artifact of the update it stopped at (47):
    Step 4 scores update 0, every --adapt_save_interval and the last, as for an uninterrupted run,
    so no run's curve gains a point the others lack."""
    from mmadapt import demo

    d = demo.Demo(demo.QUICK, tmp_path)
    runs = [tmp_path / "adapt" / "bl_base-de", tmp_path / "adapt" / "minipost-de"]
    for run, steps in zip(runs, ((0, 47, 50, 83, 100, 150), (0, 50, 100, 150))):
        for step in steps:
            (run / "embeddings" / f"step{step:08d}").mkdir(parents=True)
            (run / "embeddings" / f"step{step:08d}" / "embeddings.pt").write_bytes(b"")
    given = {}
    monkeypatch.setattr(demo, "parallel_verses", lambda *a: [])
    monkeypatch.setattr(demo, "plugin_records", lambda primary, adapt_runs, **k: given.update(plugin=adapt_runs) or [])
    monkeypatch.setattr(demo, "evaluate_artifacts", lambda ft, artifacts, **k: given.update(task=artifacts) or [])
    monkeypatch.setattr(demo, "retrieval_records", lambda primary, adapt_runs, **k: given.update(ret=adapt_runs) or [])
    d.evaluate_primary(tmp_path / "pretrain" / "bl_base", [], runs, {"de": tmp_path / "data"})
    want = [run / "embeddings" / f"step{s:08d}" for run in runs for s in (0, 50, 100, 150)]
    assert given == {"plugin": want, "task": want, "ret": want}
