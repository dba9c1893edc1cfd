"""Compute tables and near-maximal-performance metrics against the paper's worked examples."""

import json
from pathlib import Path

import pytest

from mmadapt.cli import flops_main, report_main
from mmadapt.report import (Hit, adaptation_rows, mean_speedup, paper_rows, report_markdown, retention,
                            time_to_target)


def test_paper_rows_reproduce_the_paper(capsys):
    assert flops_main(["--paper"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads(json.dumps(paper_rows()))
    assert all({"system", "step", "num_layers", "eflops_paper", "eflops_exact", "v100_days"} <= set(r) for r in rows)
    by = {(r["system"], r["step"]): r for r in rows}
    # Appendix A.1: Step 2 over 4 / 6 / 12 layers; Table 2's train cost in V100-days.
    assert [round(by[(s, "adapt")]["eflops_paper"], 1) for s in ("minijoint", "minipost", "bl_base")] == [21.1, 29.3, 54.1]
    assert [round(by[(s, "adapt")]["v100_days"], 1) for s in ("minijoint", "minipost", "bl_base")] == [8.1, 11.3, 20.9]
    assert [round(by[(s, "pretrain")]["eflops_paper"], 1) for s in ("bl_small", "bl_base")] == [29.3, 78.8]
    assert round(by[("minipost", "minipost")]["eflops_paper"], 1) == 21.6
    assert [round(by[(s, "pretrain")]["v100_days"], 1) for s in ("bl_base", "minijoint")] == [30.4, 32.2]
    # The exact Step-2 count is larger: attention products cost two products in the backward pass.
    assert all(by[(s, "adapt")]["eflops_exact"] > by[(s, "adapt")]["eflops_paper"] for s in ("minijoint", "bl_base"))


def test_flops_cli_for_any_model(capsys):
    assert flops_main(["--json", "--num_layers", "24", "--hidden_size", "1024", "--num_attention_heads", "16",
                       "--ffn_hidden_size", "4096", "--mini_layers", "6", "--train_iters", "1000"]) == 0
    rows = {(r["system"], r["step"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[("bl_base", "adapt")]["num_layers"] == 24 and rows[("minijoint", "adapt")]["num_layers"] == 6
    # 48 U B s l h^2 (1 + s/4h + p/12l + pV/8hl), U = 1000, B = 2048, s = 512, V = 50k, l = 24, h = 1024
    U, B, s, l, h, p, V = 1000, 2048, 512, 24, 1024, 0.15, 50_000
    exact = 48 * U * B * s * l * h * h * (1 + s / (4 * h) + p / (12 * l) + p * V / (8 * h * l))
    assert rows[("bl_base", "adapt")]["eflops_exact"] == pytest.approx(exact / 1e18)
    assert flops_main(["--hidden_size", "100"]) == 2  # 100 not divisible by 12 heads
    assert "not divisible" in capsys.readouterr().err


def test_interpolation_example_from_the_paper():
    # Section 3: 48% at 5,000 updates and 52% at 10,000 -> 50% reached at 7,500.
    hit = time_to_target([(10_000, 52.0), (5_000, 48.0), (1_000, 30.0)], 50.0)
    assert hit == Hit(estimate=7_500, lower=5_000, upper=10_000)
    assert time_to_target([(5_000, 48.0), (10_000, 49.0)], 50.0) is None  # never reached
    assert time_to_target([(1_000, 51.0), (2_000, 53.0)], 50.0) == Hit(1_000, 0.0, 1_000)  # before the first
    assert time_to_target([(5_000, 48.0), (10_000, 50.0)], 50.0).estimate == 10_000  # reached exactly


def test_speedup_is_the_mean_of_ratios_and_retention_as_footnote_4():
    # Footnote 6: BL_BASE 2.5 days, MINIJOINT 1.0 -> 2.5x for that language.
    base = {"ar": 2.5, "de": 4.0, "tr": 3.0, "zh": None}
    mini = {"ar": 1.0, "de": 4.0, "tr": None, "zh": 1.0}
    assert mean_speedup(base, mini) == (pytest.approx((2.5 + 1.0) / 2), 2)  # not 6.5 / 5.0
    assert mean_speedup({"ar": None}, {"ar": 1.0}) == (None, 0)
    # Footnote 4: (70.3/72.0 + 56.0/56.9 + 83.5/83.4) / 3 ~= 0.987
    r = retention({"xnli": 70.3, "mlqa": 56.0, "pawsx": 83.5}, {"xnli": 72.0, "mlqa": 56.9, "pawsx": 83.4})
    assert round(r, 3) == 0.987


def test_report_from_results(tmp_path, capsys):
    day = 2.592e18  # one V100-day at 30 TFLOP/s
    records = [
        # BL_BASE ends at 60 in de -> target 57; reached between day 2 (50) and day 4 (60) -> 3.4 days.
        {"system": "bl_base", "task": "genre", "lang": "de", "step": 1, "flops": 2 * day, "score": 50.0},
        {"system": "bl_base", "task": "genre", "lang": "de", "step": 2, "flops": 4 * day, "score": 60.0},
        {"system": "minijoint", "task": "genre", "lang": "de", "step": 1, "flops": 1 * day, "score": 56.0},
        {"system": "minijoint", "task": "genre", "lang": "de", "step": 2, "flops": 2 * day, "score": 58.0},
    ]
    md = report_markdown(records)
    # Train cost: the last checkpoint's Step-2 compute (4 and 2 V100-days).
    assert "| bl_base | 10.4 | 4 | 60.0 | 60.0 | 100.0% |" in md
    assert "| minijoint | 5.18 | 2 | 58.0 | 58.0 | 96.7% |" in md
    assert "| bl_base | 3.4 (2–4) | 1.00× (1 langs) |" in md
    assert "| minijoint | 1.5 (1–2) | 2.27× (1 langs) |" in md
    f = tmp_path / "results.json"
    f.write_text(json.dumps(records))
    assert report_main([str(f), "--output", str(tmp_path / "new" / "r.md")]) == 0  # its directory made
    assert (tmp_path / "new" / "r.md").read_text().strip() == md.strip()
    capsys.readouterr()
    assert report_main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read results file")


def test_an_output_that_appears_while_the_command_runs_is_kept(tmp_path, capsys, monkeypatch):
    """--output is checked to be new at the start and created, not replaced, at the end
    (checkpoint.publish_new): another job that wrote the same file meanwhile keeps its result
    (os.replace gave the last job's silently)."""
    from mmadapt import cli
    from mmadapt.checkpoint import publish_new

    out, results = tmp_path / "r.md", tmp_path / "results.json"
    results.write_text(json.dumps([{"system": "bl_base", "task": "genre", "lang": "de", "step": 1, "flops": 1.0,
                                    "score": 50.0}]))
    real = cli.report_markdown

    def racing(*args, **kw):  # the other job finishes while this one computes
        out.write_text("the other job's report\n")
        return real(*args, **kw)

    monkeypatch.setattr(cli, "report_markdown", racing)
    assert report_main([str(results), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {out} appeared while this command ran") and len(err.splitlines()) == 1, err
    assert out.read_text() == "the other job's report\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "r.md", "results.json"]  # no temporary file left
    publish_new(tmp_path / "fresh.json", "{}\n")
    assert (tmp_path / "fresh.json").read_text() == "{}\n"
    with pytest.raises(ValueError, match="appeared while this command ran"):
        publish_new(tmp_path / "fresh.json", "[]\n")
    assert (tmp_path / "fresh.json").read_text() == "{}\n"


def test_what_a_killed_write_left_goes_with_the_next_write_of_its_file(tmp_path):
    """A process killed inside atomic_write (a run's run.json) or publish_new (evaluate's and
    report's --output) left its temporary, and every rerun that was killed so left one more,
    never read and never removed. The next write of the same file removes a dead process's; a
    live writer's, another host's (a shared file system: its pids are not this host's) and
    another file's stay; names without a host (written before 2026-12-06) go by their pid."""
    import os
    import socket
    import subprocess

    from mmadapt.checkpoint import atomic_write, publish_new

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    me, live = f"{gone.pid}@{socket.gethostname()}", f"{os.getppid()}@{socket.gethostname()}"
    dead = [f".run.json.tmp{me}", f".r.json.new{me}", f"..r.json.new{me}.tmp{me}", f".run.json.tmp{gone.pid}",
            f"..r.json.new{gone.pid}.tmp{gone.pid}"]
    kept = [f".run.json.tmp{live}", f".r.json.new{live}", f"..r.json.new{live}.tmp{live}",
            f".run.json.tmp{gone.pid}@elsewhere", f".r.json.new{gone.pid}@elsewhere",
            f"..r.json.new{gone.pid}@elsewhere.tmp{gone.pid}@elsewhere", f".other.json.tmp{me}", f".run.json.tmp{me}x"]
    for name in dead + kept:
        (tmp_path / name).write_text("{")
    atomic_write(tmp_path / "run.json", "{}")
    publish_new(tmp_path / "r.json", "[]\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["r.json", "run.json"])


def test_speedups_and_plots(tmp_path):
    day = 2.592e18
    records = []
    for lang, (b1, b2, m1, m2) in {"de": (50, 60, 56, 58), "fr": (40, 50, 48, 49)}.items():
        records += [{"system": "bl_base", "task": "genre", "lang": lang, "step": i, "flops": x * day, "score": y}
                    for i, (x, y) in enumerate([(2, b1), (4, b2)])]
        records += [{"system": "minijoint", "task": "genre", "lang": lang, "step": i, "flops": x * day, "score": y}
                    for i, (x, y) in enumerate([(1, m1), (2, m2)])]
    from mmadapt.report import plot_curves, plot_speedup, speedups

    # de: 3.4 / 1.5 (see above); fr: target 47.5, BL_BASE 2 + 7.5/10*2 = 3.5 days, MINIJOINT hits at
    # its first checkpoint (1 day) -> 3.5; mean of ratios = (3.4/1.5 + 3.5) / 2.
    assert speedups(records)[("minijoint", "genre")] == pytest.approx((3.4 / 1.5 + 3.5) / 2)
    plot_curves(records, tmp_path / "c.png")
    plot_speedup(records, tmp_path / "s.png")
    for f in ("c.png", "s.png"):
        data = (tmp_path / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # a plot that fails while it is written leaves no half PNG (a rerun refused the directory as holding it)
    from matplotlib.figure import Figure

    real = Figure.savefig

    def failing(fig, target, **kw):
        real(fig, target, **kw)
        raise OSError(28, "No space left on device")

    import unittest.mock

    with unittest.mock.patch.object(Figure, "savefig", failing):
        for plot, name in ((plot_curves, "c2.png"), (plot_speedup, "s2.png")):
            with pytest.raises(OSError):
                plot(records, tmp_path / name)
            assert not (tmp_path / name).exists(), name


def test_report_with_several_tasks_gives_the_papers_retention():
    """Footnote 4: the mean over tasks of each task's average ratio to BL_BASE (not the ratio of
    the averages over tasks)."""
    records = [{"system": s, "task": t, "lang": "de", "step": 1, "flops": 1e18, "score": v}
               for s, t, v in [("bl_base", "genre", 60.0), ("bl_base", "retrieval", 40.0),
                               ("minijoint", "genre", 58.0), ("minijoint", "retrieval", 30.0)]]
    md = report_markdown(records)
    assert "## retention against bl_base, mean over tasks (genre, retrieval)" in md
    assert "| minijoint | 85.8% |" in md  # (58/60 + 30/40) / 2; the ratio of sums would be 88.0%
    assert "| bl_base | 100.0% |" in md
    assert "retention against" not in report_markdown(records[:1] + records[2:3])  # one task: no such table


def test_task_table_gives_gains_over_chance_and_the_share_of_the_ceilings():
    """With a chance level in the records, each system's gain over it and its share of BL_BASE's
    gain and of its ceiling's (`<recipe>:full`), by hand: chance 20; BL_BASE (36 + 38) / 2 = 37,
    gain 17; MINIJOINT 33, gain 13, 13/17 = 76%; its ceiling 34, gain 14: 13/14 = 93%."""
    rec = [("bl_base", "de", 36.0), ("bl_base", "fr", 38.0), ("minijoint", "de", 32.0), ("minijoint", "fr", 34.0),
           ("minijoint:full", "de", 33.0), ("minijoint:full", "fr", 35.0)]
    records = [{"system": s, "task": "genre", "lang": l, "step": 1, "flops": 1e18, "score": v, "chance": 20.0}
               for s, l, v in rec]
    md = report_markdown(records)
    assert ("| system | Step-2 EFLOPs | v100-paper days | de | fr | avg | retention | gain over chance | "
            "share of bl_base's gain | share of the ceiling's gain |") in md
    assert "| bl_base | 1 | 0.386 | 36.0 | 38.0 | 37.0 | 100.0% | +17.0 | 100% | - |" in md
    assert "| minijoint | 1 | 0.386 | 32.0 | 34.0 | 33.0 | 89.2% | +13.0 | 76% | 93% |" in md
    assert "| minijoint:full | 1 | 0.386 | 33.0 | 35.0 | 34.0 | 91.9% | +14.0 | 82% | - |" in md
    # Two minijoint runs told apart ('minijoint [run]'): each measured against minijoint:full too
    # (the column was dropped: their ceiling was looked up as 'minijoint [a]:full')
    split = records + [{**r, "system": "minijoint [b]", "score": r["score"] - 2} for r in records[2:4]]
    for r in split[2:4]:
        r["system"] = "minijoint [a]"
    md = report_markdown(split)
    assert "| minijoint [a] | 1 | 0.386 | 32.0 | 34.0 | 33.0 | 89.2% | +13.0 | 76% | 93% |" in md
    assert "| minijoint [b] | 1 | 0.386 | 30.0 | 32.0 | 31.0 | 83.8% | +11.0 | 65% | 79% |" in md
    # No ceiling: no ceiling column; no chance level: neither gain column.
    assert "ceiling's gain" not in report_markdown(records[:4])
    assert "gain over chance" not in report_markdown([{k: v for k, v in r.items() if k != "chance"}
                                                      for r in records])


def test_a_language_never_reached_is_shown_as_never_beside_the_speedup(tmp_path):
    """MINIJOINT reaches the target in de (3.4 / 1.5 days, as above) and never in fr (target
    47.5, it ends at 45): its speedup is the mean over de alone, and the table, the speedup
    summary and the plot say that fr was never reached instead of leaving it out."""
    day = 2.592e18
    records = []
    for lang, (b1, b2, m1, m2) in {"de": (50, 60, 56, 58), "fr": (40, 50, 44, 45)}.items():
        records += [{"system": "bl_base", "task": "genre", "lang": lang, "step": i, "flops": x * day, "score": y}
                    for i, (x, y) in enumerate([(2, b1), (4, b2)])]
        records += [{"system": "minijoint", "task": "genre", "lang": lang, "step": i, "flops": x * day, "score": y}
                    for i, (x, y) in enumerate([(1, m1), (2, m2)])]
    md = report_markdown(records)
    assert "| system | de | fr | speedup | never reaches |" in md
    assert "| minijoint | 1.5 (1–2) | never | 2.27× (1 langs) | 1 (fr) |" in md
    assert "| bl_base | 3.4 (2–4) | 3.5 (2–4) | 1.00× (2 langs) | 0 |" in md
    from mmadapt.report import Speedup, plot_speedup, speedup_table, speedups

    got = speedup_table(records)[("minijoint", "genre")]
    assert got == Speedup(pytest.approx(3.4 / 1.5), 1, 1)
    assert str(got) == "2.27× (1 langs); never in 1 of 2 langs"
    assert speedups(records) == {("minijoint", "genre"): pytest.approx(3.4 / 1.5)}
    # Never reached anywhere: no mean at all, only the count.
    nowhere = [r for r in records if not (r["system"] == "minijoint" and r["lang"] == "de")]
    nowhere += [{**r, "score": 50.0} for r in records if r["system"] == "minijoint" and r["lang"] == "de"]
    assert str(speedup_table(nowhere)[("minijoint", "genre")]) == "never in 2 of 2 langs"
    assert "| minijoint | never | never | - | 2 (de, fr) |" in report_markdown(nowhere)
    plot_speedup(records, tmp_path / "s.png")  # marks the bar "never 1/2"
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gain_over_chance_uses_each_languages_own_chance_level():
    """A tagging task whose majority tag differs between languages (de 20, fr 30): each
    language's gain is over its own level. BL_BASE (40 - 20 + 50 - 30) / 2 = 20; MINIJOINT
    (30 - 20 + 45 - 30) / 2 = 12.5 -> 62% of BL_BASE's, where one level for both (the higher,
    30, as the report took before) would give 7.5 / 15 = 50%; the raw retention is 37.5 / 45."""
    rec = [("bl_base", "de", 40.0, 20.0), ("bl_base", "fr", 50.0, 30.0), ("minijoint", "de", 30.0, 20.0),
           ("minijoint", "fr", 45.0, 30.0)]
    records = [{"system": s, "task": "tag", "lang": l, "step": 1, "flops": 1e18, "score": v, "chance": c}
               for s, l, v, c in rec]
    md = report_markdown(records)
    assert "Chance level (the evaluation data's majority class or tag; 0 for the plug-in metric): de 20.0, fr 30.0." \
        in md
    assert "| bl_base | 1 | 0.386 | 40.0 | 50.0 | 45.0 | 100.0% | +20.0 | 100% |" in md
    assert "| minijoint | 1 | 0.386 | 30.0 | 45.0 | 37.5 | 83.3% | +12.5 | 62% |" in md
    # A language without a chance level: no gain columns, and the table says why.
    md = report_markdown([{**r, "chance": None} if r["lang"] == "fr" else r for r in records])
    assert "gain over chance" not in md and "No chance level in these records" in md


def test_retention_and_shares_are_over_the_languages_both_systems_have():
    """MINIJOINT run in de alone, BL_BASE in de and a hard ur: its retention is 78 / 80 = 97.5% and
    its share of BL_BASE's gain (78 - 30) / (80 - 30) = 96%, both over de; against BL_BASE's
    average over both languages they read 130.0% and 160%, better than BL_BASE where it is worse.
    The mean over tasks takes each task's shared-language retention: (97.5% + 50 / 60) / 2."""
    rec = [("bl_base", "genre", "de", 80.0), ("bl_base", "genre", "ur", 40.0), ("minijoint", "genre", "de", 78.0),
           ("bl_base", "retrieval", "de", 60.0), ("minijoint", "retrieval", "de", 50.0)]
    records = [{"system": s, "task": t, "lang": l, "step": 1, "flops": 1e18, "score": v, "chance": 30.0}
               for s, t, l, v in rec]
    md = report_markdown(records)
    assert "| bl_base | 1 | 0.386 | 80.0 | 40.0 | 60.0 | 100.0% | +30.0 | 100% |" in md
    assert "| minijoint | 1 | 0.386 | 78.0 | - | 78.0 | 97.5%* | +48.0 | 96% |" in md
    assert ("*: retention and shares over the languages it shares with bl_base (its average over its own): "
            "minijoint has de.") in md
    assert f"| minijoint | {100 * (78 / 80 + 50 / 60) / 2:.1f}% |" in md
    assert "97.5%*" not in report_markdown([r for r in records if r["lang"] == "de"])  # the same languages: no mark
    # the other way round: the baseline without ur, MINIJOINT with it: its average is over both, its retention not
    rev = [{**r, "system": {"bl_base": "minijoint", "minijoint": "bl_base"}[r["system"]]} for r in records
           if r["task"] == "genre"]
    assert "| minijoint | 1 | 0.386 | 80.0 | 40.0 | 60.0 | 102.6%* |" in report_markdown(rev)


def test_records_from_a_fine_tune_at_chance_are_flagged():
    records = [{"system": s, "task": "genre", "lang": "de", "step": 1, "flops": 1e18, "score": v, "chance": 20.0}
               for s, v in [("bl_base", 40.0), ("minijoint", 21.0)]]
    records[1]["finetune_warnings"] = ["runs/ft/mj: the source-language accuracy 20.4 is not above chance beyond noise"]
    md = report_markdown(records)
    assert "| minijoint (!) | 1 | 0.386 | 21.0 | 21.0 | 52.5% | +1.0 | 5% |" in md
    assert ("(!) minijoint: from fine-tuned runs that learned nothing measurable in the source language, so its "
            "zero-shot scores say nothing about its embeddings: runs/ft/mj: the source-language accuracy 20.4") in md
    assert "| bl_base | 1 |" in md  # its own runs were fine
    # a run that read positions its primary never trained at learned something: a caveat, not "(!)"
    from pathlib import Path

    from mmadapt.finetune import check_positions

    positions = check_positions(Path("runs/base"), {"train": {"seq_length": 128}}, 256, allow=True)
    records[0]["finetune_warnings"] = [f"runs/ft/base: {positions}"]
    md = report_markdown(records)
    assert "| bl_base | 1 |" in md and "(!) bl_base" not in md and "| minijoint (!) | 1 |" in md
    assert ("bl_base: from fine-tuned runs that read positions their primary model never trained at: runs/ft/base: "
            "seq_length 256 is longer than the 128-piece blocks runs/base was pretrained on: positions 129-256 were "
            "never trained") in md


def _curve(system: str, flops: list[float], scores: list[float], lang: str = "de") -> list[dict]:
    return [{"system": system, "task": "genre", "lang": lang, "step": i + 1, "flops": x, "score": y}
            for i, (x, y) in enumerate(zip(flops, scores))]


def test_report_without_bl_base_picks_a_baseline_says_which_and_plots_no_empty_speedup(tmp_path, capsys,
                                                                                       monkeypatch):
    """The README's MINIPOST walk-through has MINIPOST records only: the report measures it against
    itself (exit 0, one line naming it); there is no speedup to plot, so no speedup.png. The curves'
    dashed target is the tables' baseline's (it was bl_base's, or none, whatever the baseline)."""
    day = 2.592e18
    f = tmp_path / "minipost.json"
    f.write_text(json.dumps(_curve("minipost", [1 * day, 2 * day], [40.0, 50.0])))
    plots = tmp_path / "plots"
    assert report_main([str(f), "--plots", str(plots)]) == 0
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        "baseline: minipost (the only system in the records; --baseline chooses another)",
        "note: no speedup.png: no system has a speedup over minipost to plot (none but minipost reaches 95% of its "
        "final score, or minipost reaches it with no Step-2 compute)"]
    assert "| minipost | 5.18 | 2 | 50.0 | 50.0 | 100.0% |" in out.out
    assert sorted(p.name for p in plots.iterdir()) == ["curves.png"]
    # Several systems, none of them bl_base: the one that spent the most Step-2 compute (the ceiling).
    f.write_text(json.dumps(_curve("minijoint", [1 * day, 2 * day], [40.0, 50.0])
                            + _curve("minijoint:full", [3 * day, 6 * day], [45.0, 52.0])))
    assert report_main([str(f)]) == 0
    out = capsys.readouterr()
    assert out.err.strip() == ("baseline: minijoint:full (no bl_base in the records: the system with the most Step-2 "
                               "compute; --baseline chooses another)")
    assert "95% of minijoint:full's final score" in out.out
    import matplotlib.figure

    figures = []
    with monkeypatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
        assert report_main([str(f), "--plots", str(tmp_path / "p3")]) == 0
    capsys.readouterr()
    targets = {line.get_label(): line.get_ydata()[0] for fig in figures for ax in fig.axes for line in ax.get_lines()
               if line.get_label().startswith("near-max")}
    assert targets == {"near-max target (95% of minijoint:full's final)": pytest.approx(0.95 * 52.0)}
    # With bl_base in the records, nothing to say; a --baseline the records lack is still an error.
    f.write_text(json.dumps(_curve("bl_base", [2 * day, 4 * day], [50.0, 60.0]) +
                            _curve("minijoint", [1 * day, 2 * day], [56.0, 58.0])))
    assert report_main([str(f), "--plots", str(tmp_path / "p2")]) == 0
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in (tmp_path / "p2").iterdir()) == ["curves.png", "speedup.png"]
    assert report_main([str(f), "--baseline", "minipost"]) == 2
    assert "the results hold no minipost runs" in capsys.readouterr().err


def test_no_plot_is_written_without_data(tmp_path):
    from mmadapt.report import plot_curves, plot_speedup

    assert plot_curves([], tmp_path / "c.png") is False
    # Only the baseline: a speedup needs another system that reaches the target.
    assert plot_speedup(_curve("bl_base", [1.0, 2.0], [40.0, 50.0]), tmp_path / "s.png") is False
    # Another system that never reaches 95% of the baseline's final score: no speedup either.
    never = _curve("bl_base", [1.0, 2.0], [40.0, 50.0]) + _curve("minijoint", [1.0, 2.0], [10.0, 20.0])
    assert plot_speedup(never, tmp_path / "s.png") is False
    assert list(tmp_path.iterdir()) == []


def test_the_compute_axis_reads_in_days_or_flops():
    """Paper-scale Step 2 in V100-days, as Figure 3; a CPU demo's (~1e-6 days) in FLOPs with a
    prefix, not in days under a matplotlib offset."""
    from mmadapt.report import compute_axis

    day = 2.592e18  # one V100-paper day of FLOPs (flops.device_days)
    assert compute_axis(20 * day) == (pytest.approx(day), "Step-2 compute (v100-paper days)")
    assert compute_axis(3e12) == (1e12, "Step-2 compute (TFLOP)")
    assert compute_axis(1e16) == (1e15, "Step-2 compute (PFLOP)")  # 0.004 days


# --- what adaptation bought: no adaptation and the start (update 0) beside every score --------------------

def _bought_records() -> list[dict]:
    """bible-genre in de and fr for two primary models' fine-tuned runs: bl_base's (its no-adaptation
    score 30 in de, 25 in fr) and bl_small's (40 in de, 25 in fr). Each system's curve starts at
    update 0 (0 FLOPs) and ends at its last checkpoint: in de, bl_small ends at 35, below its 40 with
    no adaptation."""
    day = 2.592e18
    curves = {("bl_base", "de"): (22.0, 28.0, 36.0), ("bl_base", "fr"): (21.0, 30.0, 34.0),
              ("bl_small", "de"): (24.0, 30.0, 35.0), ("bl_small", "fr"): (20.0, 26.0, 31.0)}
    records = [{"system": s, "task": "genre", "lang": lang, "step": step, "flops": step / 100 * day, "score": y,
                "chance": 20.0}
               for (s, lang), ys in curves.items() for step, y in zip((0, 100, 200), ys)]
    records += [{"system": "no_adaptation", "task": "genre", "lang": lang, "flops": 0.0, "score": y, "chance": 20.0,
                 "of": [primary]}
                for primary, lang, y in (("bl_base", "de", 30.0), ("bl_base", "fr", 25.0), ("bl_small", "de", 40.0),
                                         ("bl_small", "fr", 25.0))]
    return records


def test_adapted_scores_beside_no_adaptation_and_the_start_with_a_mark_and_a_verdict(tmp_path, capsys):
    """The adapted embeddings of bl_small in de are worse than its fine-tuned model with no
    adaptation: the table marks the cell, the section shows no adaptation / update 0 / last for
    every system and language, and one line per language says whether adaptation paid. The
    existing tables' numbers are those of the same records without the no-adaptation rows."""
    records = _bought_records()
    md = report_markdown(records)
    plain = report_markdown([r for r in records if r["system"] != "no_adaptation"])
    # Final scores (36, 34 / 35, 31), averages, costs and gains are unchanged; only bl_small's de cell is marked.
    assert "| bl_base | 5.18 | 2 | 36.0 | 34.0 | 35.0 | 100.0% | +15.0 | 100% |" in md and \
        "| bl_base | 5.18 | 2 | 36.0 | 34.0 | 35.0 | 100.0% | +15.0 | 100% |" in plain
    assert "| bl_small | 5.18 | 2 | 35.0 ↓ | 31.0 | 33.0 | 94.3% | +13.0 | 87% |" in md
    assert "| bl_small | 5.18 | 2 | 35.0 | 31.0 | 33.0 | 94.3% | +13.0 | 87% |" in plain
    assert "↓: not above the same fine-tuned model with no adaptation" in md and "↓" not in plain
    assert md.count("| no_adaptation") == 0  # not a system of the tables: it is shown beside them
    assert "## genre: what adaptation bought" in md and "## genre: what adaptation bought" in plain
    for row in ("| de | bl_base | 30.0 | 22.0 | 36.0 | +6.0 |", "| de | bl_small | 40.0 | 24.0 | 35.0 ↓ | -5.0 |",
                "| fr | bl_base | 25.0 | 21.0 | 34.0 | +9.0 |", "| fr | bl_small | 25.0 | 20.0 | 31.0 | +6.0 |"):
        assert row in md, row
    assert "| de | bl_small | 24.0 | 35.0 |" in plain and "no adaptation" not in plain  # the start alone
    assert ("- de: adaptation did not pay for bl_small (35.0 at its last checkpoint, 40.0 with no adaptation); "
            "it paid for bl_base (+6.0).") in md
    assert "- fr: adaptation paid for every system (bl_base +9.0, bl_small +6.0 over no adaptation)." in md
    assert "adaptation paid" not in plain
    # Time to near-maximal performance counts trained checkpoints, as without the start: target 34.2
    # in de, bl_base from 28 at 1 day to 36 at 2 days -> 1 + 6.2 / 8 = 1.775 days; fr: 32.3, from 30
    # to 34 -> 1.575 (the start, 22 and 21 at 0 days, would pull both earlier).
    assert "| bl_base | 1.77 (1–2) | 1.57 (1–2) | 1.00× (2 langs) | 0 |" in md
    assert md.split("days to near-maximal")[1] == plain.split("days to near-maximal")[1]
    # `mmadapt report` prints the same, and the plot draws the no-adaptation lines.
    f = tmp_path / "records.json"
    f.write_text(json.dumps(records))
    assert report_main([str(f), "--plots", str(tmp_path / "plots")]) == 0
    assert capsys.readouterr().out.strip() == md.strip()
    assert (tmp_path / "plots" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_runs_of_one_system_and_language_stay_two_rows():
    """Two bl_base Step-2 runs in de (two starts), each with update 0 and a last checkpoint, and a
    minijoint run: evaluate's apart_runs names the bl_base records after their runs, so the
    table shows each run's own start and last score; the minijoint run keeps its name."""
    from mmadapt.evaluate import apart_runs

    def rec(system, run, step, score):
        return {"system": system, "task": "genre", "lang": "de", "step": step, "flops": step * 1e15, "score": score,
                "chance": 20.0, "artifact": f"/runs/{run}/embeddings/step{step:08d}"}
    records = [rec("bl_base", "overlap", 0, 21.0), rec("bl_base", "overlap", 100, 31.0),
               rec("bl_base", "fvt", 0, 27.0), rec("bl_base", "fvt", 100, 35.0), rec("minijoint", "mj", 0, 22.0),
               rec("minijoint", "mj", 100, 33.0)]
    apart_runs(records)
    assert [r["system"] for r in records] == ["bl_base [overlap]"] * 2 + ["bl_base [fvt]"] * 2 + ["minijoint"] * 2
    rows = {r["system"]: (r["start"], r["last"]) for r in adaptation_rows(records, "genre")}
    assert rows == {"bl_base [overlap]": (21.0, 31.0), "bl_base [fvt]": (27.0, 35.0), "minijoint": (22.0, 33.0)}


def test_two_runs_in_directories_of_one_name_stay_two_rows():
    """Two minijoint runs at /p/run and /q/run: named after their last part alone, both became
    'minijoint [run]' and one curve again. Each is named by as few of its path's parts as tell it
    apart; so across two evaluate calls' files in report."""
    from mmadapt.artifact import run_names
    from mmadapt.evaluate import apart_runs

    def rec(run, step, score):
        return {"system": "minijoint", "task": "genre", "lang": "de", "step": step, "flops": step * 1e15,
                "score": score, "chance": 20.0, "artifact": f"{run}/embeddings/step{step:08d}"}
    def two_runs():
        return [rec(run, step, score) for run, step, score in (("/x/p/run", 0, 21.0), ("/x/p/run", 100, 31.0),
                                                               ("/x/q/run", 0, 27.0), ("/x/q/run", 100, 35.0))]
    records = two_runs()
    apart_runs(records)
    assert [r["system"] for r in records] == ["minijoint [p/run]"] * 2 + ["minijoint [q/run]"] * 2
    rows = {r["system"]: (r["start"], r["last"]) for r in adaptation_rows(records, "genre")}
    assert rows == {"minijoint [p/run]": (21.0, 31.0), "minijoint [q/run]": (27.0, 35.0)}
    assert run_names([Path("/a/b/run"), Path("/c/b/run"), Path("/d/fvt")]) == {
        Path("/a/b/run"): "a/b/run", Path("/c/b/run"): "c/b/run", Path("/d/fvt"): "fvt"}
    across = two_runs()
    for i, r in enumerate(across):
        r["_file"] = f"f{i // 2}.json"
    from mmadapt.report import _apart_across_files
    _apart_across_files(across)
    assert [r["system"] for r in across] == ["minijoint [p/run]"] * 2 + ["minijoint [q/run]"] * 2


def test_the_verdict_names_a_text_the_adapted_tokenizer_cannot_read():
    """bl_small's German tokenizer read 60% of the de file's pieces as <unk> at one checkpoint
    (evaluate's unknown_share): the de line says so after its verdict; bl_base's 1% and every fr
    record leave their lines as they were."""
    records = _bought_records()
    for r in records:
        if r["system"] != "no_adaptation":
            r["unknown_share"] = 0.6 if (r["system"], r["lang"], r["step"]) == ("bl_small", "de", 100) else 0.01
    md = report_markdown(records)
    assert ("- de: adaptation did not pay for bl_small (35.0 at its last checkpoint, 40.0 with no adaptation); "
            "it paid for bl_base (+6.0). bl_small's tokenizer reads 60% of the de text's pieces as <unk>: the file "
            "is not text it covers, and the score says nothing of the adaptation.") in md
    assert "- fr: adaptation paid for every system (bl_base +9.0, bl_small +6.0 over no adaptation)." in md
    assert md.count("<unk>") == 1


def test_a_start_already_at_the_target_is_said_apart_and_not_counted_as_a_checkpoint():
    """bl_small's start (update 0) in de already scores above 95% of bl_base's final: the near-
    maximal table still times its trained checkpoints (the first reaching at 1 day, lower bound 0),
    and a line says it was there before any update, instead of a time of 0 that the speedup
    would silently drop."""
    records = [r for r in _bought_records() if r["system"] != "no_adaptation"]
    for r in records:
        if (r["system"], r["lang"], r["step"]) == ("bl_small", "de", 0):
            r["score"] = 35.0
        if (r["system"], r["lang"], r["step"]) == ("bl_small", "de", 100):
            r["score"] = 34.5
    md = report_markdown(records)
    assert "| bl_small | 1 (0–1) | never | 1.77× (1 langs) | 1 (fr) |" in md  # 1.775 / 1
    assert ("Already at the target before any Step-2 update (the start, update 0, which the table does not count "
            "as a checkpoint): bl_small in de (35.0).") in md


def test_a_scored_fraction_keeps_its_curves_apart_and_meets_its_own_ceiling():
    """Records of a decoder's Step 2 at score_fraction p are labelled `<system> p=<p>` (adapt.
    system_label), so the report shows p and never merges them with full scoring's curves; each
    label's ceiling is the one scored at the same p."""
    from mmadapt.artifact import run_label, system_label, system_of_run
    from mmadapt.report import ceiling_of, plugin_markdown

    assert system_label({"system": "minijoint", "score_fraction": 0.25}) == "minijoint p=0.25"
    assert system_label({"system": "minijoint"}) == "minijoint"
    assert [ceiling_of(s) for s in ("minijoint", "minijoint@4 p=0.5", "minijoint p=0.25")] == \
        ["minijoint:full", "minijoint:full p=0.5", "minijoint:full p=0.25"]
    told_apart = run_label("minijoint@4 p=0.5", "run-a")  # one of several runs meets the same ceiling
    assert system_of_run(told_apart) == "minijoint@4 p=0.5" and ceiling_of(told_apart) == "minijoint:full p=0.5"
    base = {"task": "plugin-lm", "lang": "de", "step": 10, "unigram_loss": 5.0, "masked_pieces": 64,
            "start_loss": 6.0}
    records = [{**base, "system": s, "flops": f, "score": g, "loss": 5.0 - g}
               for s, f, g in (("minijoint", 4e18, 1.0), ("minijoint p=0.25", 2e18, 0.9),
                               ("minijoint:full", 8e18, 1.25), ("minijoint:full p=0.25", 6e18, 1.2))]
    rows = {line.split(" | ")[0][2:]: line for line in plugin_markdown(records).splitlines() if line.startswith("| m")}
    assert rows["minijoint"].endswith("| 80% at 50% of its compute |")
    assert rows["minijoint p=0.25"].endswith("| 75% at 33% of its compute |")
    out = report_markdown(records, baseline="minijoint:full")
    assert "| minijoint p=0.25 | 2 |" in out and "| minijoint | 4 |" in out


def _bpb_records():
    """Plug-in records with bits per byte, by hand: in de, bl_base passes no adaptation (2.7) at
    its second checkpoint; minipost never does; an expanded run carries its source-text cost."""
    base = {"task": "plugin-mlm", "lang": "de", "unigram_loss": 5.0, "masked_pieces": 64, "start_loss": 6.0,
            "start_gain": -1.0, "none_bpb": 2.7, "bpb_bytes": 8100}
    out = []
    for system, pts, extra in (("bl_base", [(0, 0.0, 3.0), (10, 2e18, 2.6), (20, 4e18, 2.4)], {}),
                               ("minipost", [(0, 0.0, 3.1), (20, 1e17, 2.9)], {}),
                               ("expand", [(0, 0.0, 3.2), (20, 3e18, 2.65)],
                                {"source_bpb": 1.2050, "source_none_bpb": 1.2000})):
        for step, flops, bpb in pts:
            out.append({**base, **extra, "system": system, "step": step, "flops": flops, "score": 3.0 - bpb,
                        "loss": 2.0 + bpb, "bpb": bpb, "start_bpb": pts[0][2]})
    return out


def test_bits_per_byte_table_and_verdict_by_hand(tmp_path):
    from mmadapt.report import bpb_markdown, plot_curves

    md = bpb_markdown(_bpb_records())
    assert "| de | bl_base | 4 | 2.700 | 3.000 | 2.400 | -0.300 | - |" in md
    assert "| de | minipost | 0.1 | 2.700 | 3.100 | 2.900 | +0.200 | - |" in md
    assert "| de | expand | 3 | 2.700 | 3.200 | 2.650 | -0.050 | 1.2000 → 1.2050 |" in md
    assert ("- de: bl_base beats no adaptation by 0.300 bits per byte (2.400 against 2.700) at 4 EFLOPs of Step 2, "
            "first below it at 2 EFLOPs; expand beats no adaptation by 0.050 bits per byte (2.650 against 2.700) at "
            "3 EFLOPs of Step 2; minipost does not beat no adaptation (2.900 bits per byte against 2.700) after 0.1 "
            "EFLOPs of Step 2. (8,100 bytes)") in md
    assert bpb_markdown([{k: v for k, v in r.items() if "bpb" not in k} for r in _bpb_records()]) == ""
    assert "†" not in md  # source text the primary may have trained on is marked
    assert "Not comparable" not in md
    uncased = bpb_markdown([{**r, "none_bpb_folds": ["case"], "bpb_folds": []} for r in _bpb_records()])
    assert ("Not comparable as they stand: the primary model's own tokenizer (no adaptation) folds case where the "
            "other keeps it") in uncased
    assert "Not one scale" not in md
    # Records of one language scored by different calls: other windows, or other held-out text
    records = _bpb_records()
    windows = bpb_markdown([{**r, "bpb_seq_length": 128 if r["system"] == "minipost" else 512} for r in records]
                           + [{**records[0], "lang": "fr"}])
    assert ("Not one scale in de: its records were scored at windows of 128 and 512 positions, and bits per byte "
            "move with both; score every system's checkpoints in one `mmadapt evaluate` call.") in windows
    assert "Not one scale in fr" not in windows
    sizes = bpb_markdown([{**r, "bpb_bytes": 9000} if r["step"] == 0 else r for r in records])
    assert "Not one scale in de: its records were scored on 8,100 and 9,000 held-out bytes, and" in sizes
    apart = bpb_markdown([{**r, "bpb_bytes": 130} if r["system"] == "minipost" else r for r in records])
    assert "Not one scale in de: its records were scored on 130 and 8,100 held-out bytes, and" in apart
    assert "(bl_base on 8,100; expand on 8,100; minipost on 130 bytes: not one scale)" in apart  # each its own
    same_size = bpb_markdown([{**r, "bpb_text": "a" * 16 if r["system"] == "bl_base" else "b" * 16} for r in records])
    assert "Not one scale in de: its records were scored on 2 different held-out texts of as many bytes" in same_size
    assert "Not one scale" not in bpb_markdown([{**r, "bpb_text": "a" * 16} for r in records[:3]] + records[3:])
    # a record from before windows were recorded matches any
    assert "Not one scale" not in bpb_markdown([{**r, "bpb_seq_length": 512} for r in records[:3]] + records[3:])
    seen = bpb_markdown([{**r, "source_bpb_pretrained_on": True} for r in _bpb_records()])
    assert "| 1.2000 → 1.2050 † |" in seen and "†: source text the primary model may have trained on" in seen
    # In the report, and a panel of its own in the plot.
    assert "## bits per byte of held-out text" in report_markdown(_bpb_records())
    assert plot_curves(_bpb_records(), tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 0


# --- edges of the records a report is given ---------------------------------------------------

def test_a_task_the_baseline_was_not_run_on_is_reported_without_a_target():
    """bl_base and minijoint in genre, minijoint alone in retrieval: the retrieval tables say there
    is no baseline (a KeyError before), genre's are unchanged, and the mean over tasks is '-'."""
    day = 2.592e18
    records = (_curve("bl_base", [2 * day, 4 * day], [50.0, 60.0]) + _curve("minijoint", [1 * day, 2 * day], [56.0, 58.0])
               + [{**r, "task": "retrieval"} for r in _curve("minijoint", [1 * day, 2 * day], [30.0, 40.0])])
    md = report_markdown(records)
    assert "| minijoint | 1.5 (1–2) | 2.27× (1 langs) | 0 |" in md  # genre, as test_report_from_results
    assert "| minijoint | 5.18 | 2 | 40.0 | 40.0 | - |" in md
    assert "No bl_base records for retrieval: no retention or share of its gain." in md
    assert ("## retrieval: v100-paper days to near-maximal performance: no bl_base records for retrieval, so no "
            "target") in md
    assert "| minijoint | - |" in md.split("mean over tasks")[1]


def test_a_baseline_score_of_zero_or_below_sets_no_target_and_no_retention():
    """bl_base ends at 0 in one task (the mean over tasks divided by it) and a plug-in contextual
    gain below 0 in fr (95% of -0.2 is above it: 'never' for bl_base itself): '-' and a line
    saying why, no error and no target."""
    day = 2.592e18
    records = [{"system": s, "task": t, "lang": "de", "step": 1, "flops": 1e18, "score": v}
               for s, t, v in [("bl_base", "genre", 60.0), ("bl_base", "retrieval", 0.0),
                               ("minijoint", "genre", 58.0), ("minijoint", "retrieval", 30.0)]]
    md = report_markdown(records)
    assert "| minijoint | 1 | 0.386 | 30.0 | 30.0 | - |" in md and "| minijoint | - |" in md.split("over tasks")[1]
    assert "No target in de: bl_base's final score there is not above 0." in md
    plugin = []
    for lang, (b1, b2, m1, m2) in {"de": (0.5, 0.6, 0.56, 0.58), "fr": (-0.4, -0.2, -0.3, -0.1)}.items():
        plugin += [{**r, "task": "plugin-mlm", "lang": lang, "chance": 0.0}
                   for r in _curve("bl_base", [2 * day, 4 * day], [b1, b2]) + _curve("minijoint", [day, 2 * day],
                                                                                     [m1, m2])]
    md = report_markdown(plugin)
    assert "| bl_base | 3.4 (2–4) | - | 1.00× (1 langs) | 0 |" in md
    assert "| minijoint | 1.5 (1–2) | - | 2.27× (1 langs) | 0 |" in md
    assert "No target in fr: bl_base's final score there is not above 0." in md


def test_a_baseline_with_its_start_alone_sets_no_target_there():
    """bl_base in fr has only its update-0 record (a run still training, or stopped there): fr has
    no target, so minijoint is not 'never' there against 95% of an untrained start, the table and
    speedup_table (the plot's 'never k/n') agree, and a line says why."""
    day = 2.592e18
    records = _curve("bl_base", [2 * day, 4 * day], [50, 60]) + _curve("minijoint", [day, 2 * day], [56, 58])
    records += [{**r, "lang": "fr"} for r in _curve("minijoint", [day, 2 * day], [20, 25])]
    records += [{"system": "bl_base", "task": "genre", "lang": "fr", "step": 0, "flops": 0.0, "score": 30.0}]
    from mmadapt.report import Speedup, speedup_table

    md = report_markdown(records)
    assert "| minijoint | 1.5 (1–2) | - | 2.27× (1 langs) | 0 |" in md
    assert "No target in fr: bl_base has no trained checkpoint there (its start, update 0, alone)." in md
    assert "bl_base in fr" not in md  # (was 'already at the target before any Step-2 update': its start, itself)
    assert speedup_table(records)[("minijoint", "genre")] == Speedup(pytest.approx(3.4 / 1.5), 1, 0)


def test_every_system_of_a_plot_has_a_colour_of_its_own():
    """minijoint@2, minijoint@4 and a run told apart were drawn in the colours the cycle restarts
    at, bl_base's and minijoint's; the same colour in both plots."""
    from mmadapt.report import COLORS, system_colors

    names = ["bl_base", "minijoint", "minijoint@2", "minijoint@4", "bl_base [fvt]", "minijoint p=0.25"]
    colors = system_colors([r for s in names for r in _curve(s, [1e18], [50])])
    assert {s: colors[s] for s in ("bl_base", "minijoint")} == {s: COLORS[s] for s in ("bl_base", "minijoint")}
    assert len({str(colors[s]) for s in names}) == len(names)


def test_a_language_a_system_was_not_run_in_is_not_counted_as_never_reached():
    """bl_base in de and fr, minijoint in de only: its speedup is de's, and fr is no failure."""
    from mmadapt.report import speedup_table

    day = 2.592e18
    records = (_curve("bl_base", [2 * day, 4 * day], [50.0, 60.0]) + _curve("bl_base", [2 * day, 4 * day], [40.0, 50.0],
                                                                             lang="fr")
               + _curve("minijoint", [1 * day, 2 * day], [56.0, 58.0]))
    assert str(speedup_table(records)[("minijoint", "genre")]) == "2.27× (1 langs)"  # it said "never in 1 of 2 langs"
    assert "| minijoint | 1.5 (1–2) | - | 2.27× (1 langs) | 0 |" in report_markdown(records)


def test_a_sweeps_records_are_reported_from_its_sweep_json(tmp_path):
    """`mmadapt report <output_dir>/sweep.json` was refused ('not a JSON list of records'): the
    sweep's records, which evaluate's are, had to be cut out of it by hand. Its share of the
    ceiling's gain, by hand: minijoint@2 0.30 / 0.25 = 120%, minijoint@4 0.20 / 0.25 = 80%."""
    from mmadapt.report import plugin_markdown, read_results

    base = {"task": "plugin-mlm", "lang": "de", "unigram_loss": 5.0, "masked_pieces": 256, "start_loss": 5.0,
            "start_gain": 0.0}
    records = [{**base, "system": system, "step": step, "flops": step * cost, "score": gain * step / 4,
                "loss": 5.0 - gain * step / 4} for system, cost, gain in (("minijoint@2", 1e9, 0.30),
                                                                           ("minijoint@4", 2e9, 0.20),
                                                                           ("minijoint:full", 6e9, 0.25))
               for step in (0, 2, 4)]
    sweep, listed = tmp_path / "sweep.json", tmp_path / "records.json"
    sweep.write_text(json.dumps({"source": "/runs/src", "records": records, "summary": {}, "key": {}}))
    listed.write_text(json.dumps(records))
    assert read_results([str(sweep)]) == read_results([str(listed)]) == records
    rows = {line.split(" | ")[0][2:]: line for line in plugin_markdown(read_results([str(sweep)])).splitlines()
            if line.startswith("| minijoint@")}
    assert rows["minijoint@2"].endswith("| 120% at 17% of its compute |"), rows  # 4e9 / 24e9 FLOPs
    assert rows["minijoint@4"].endswith("| 80% at 33% of its compute |"), rows
    # two sweeps in one report: every run told apart, each measured against its own sweep's
    # ceiling (every share read '-': `minijoint:full` was no record name any more)
    for name, scale in (("a", 1.0), ("b", 0.5)):
        mine = [{**r, "score": r["score"] * (scale if r["system"] != "minijoint:full" else 1.0),
                 "artifact": f"/runs/{name}/{r['system'].split('@')[-1].replace('minijoint:', '')}/embeddings/"
                             f"step{r['step']:08d}"} for r in records]
        (tmp_path / f"{name}.json").write_text(json.dumps({"source": "/runs/src", "records": mine, "summary": {}}))
    both = read_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert {r["system"] for r in both} >= {"minijoint@2 [a/2]", "minijoint:full [a/full]", "minijoint@2 [b/2]"}
    rows = {line.split(" | ")[0][2:]: line for line in plugin_markdown(both).splitlines() if "@" in line}
    assert rows["minijoint@2 [a/2]"].endswith("| 120% at 17% of its compute |"), rows
    assert rows["minijoint@2 [b/2]"].endswith("| 60% at 17% of its compute |"), rows
    assert rows["minijoint@4 [b/4]"].endswith("| 40% at 33% of its compute |"), rows
    # matched by the runs' directories, not their labels' spelling (run_names shortens each group's
    # paths apart: `[mini]` beside `[exp1/full]`; `[runs/a/2]` beside `[a/full]`)
    def sweep(file, runs, ceiling_gain):
        rows = [{**r, "score": r["score"] * (ceiling_gain / 0.25 if r["system"] == "minijoint:full" else 1.0),
                 "artifact": f"{runs[r['system']]}/embeddings/step{r['step']:08d}"}
                for r in records if r["system"] in runs]
        (tmp_path / file).write_text(json.dumps({"records": rows, "summary": {}}))
        return str(tmp_path / file)
    for layout, want in (
            ([({"minijoint@2": "/w/exp1/mini", "minijoint:full": "/w/exp1/full"}, 0.25),
              ({"minijoint@2": "/w/exp2/mini_b", "minijoint:full": "/w/exp2/full"}, 0.5)],
             {"minijoint@2 [mini]": "120%", "minijoint@2 [mini_b]": "60%"}),
            ([({"minijoint@2": "/runs/a/2", "minijoint:full": "/runs/a/full"}, 0.25),
              ({"minijoint@2": "/runs/b/2", "minijoint:full": "/runs/b/full"}, 0.5),
              ({"minijoint@2": "/old/a/2"}, None)],
             {"minijoint@2 [runs/a/2]": "120%", "minijoint@2 [b/2]": "60%", "minijoint@2 [old/a/2]": "-"}),
            # a ceiling scored from the directory above (relative) beside runs given absolute paths
            ([({"minijoint@2": "/w/runs/a/2"}, None), ({"minijoint:full": "runs/a/full"}, 0.25),
              ({"minijoint@2": "/w/runs/b/2", "minijoint:full": "/w/runs/b/full"}, 0.5)],
             {"minijoint@2 [a/2]": "120%", "minijoint@2 [b/2]": "60%"}),
            # a ceiling given from inside its sweep's directory ('.': it ended every other directory)
            ([({"minijoint@2": "/w/runs/a/2"}, None), ({"minijoint:full": "full_a"}, 0.25),
              ({"minijoint@2": "/w/runs/b/2", "minijoint:full": "/w/runs/b/full"}, 0.5),
              ({"minijoint@2": "/x/c/2"}, None)],
             {"minijoint@2 [a/2]": "-", "minijoint@2 [b/2]": "60%", "minijoint@2 [c/2]": "-"})):
        got = read_results([sweep(f"{i}.json", runs, gain) for i, (runs, gain) in enumerate(layout)])
        rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1].split()[0] for line in plugin_markdown(got).splitlines()
                if line.startswith("| minijoint@")}
        assert rows == want, rows


def test_two_sweeps_spelt_alike_from_two_directories_stay_two_and_meet_their_own_ceilings(tmp_path, monkeypatch):
    """Two sweeps, each run as `--output_dir sweep-de` from its own directory (exp1/, exp2/): their
    sweep.json files record the same relative artifacts, which read as one run scored twice
    (refused: 'one checkpoint evaluated twice'). A sweep.json's artifacts are where the file lies
    beside its runs. Shares by hand: 0.30 / 0.25 = 120% in exp1, 0.30 / 0.50 = 60% in exp2."""
    from mmadapt.report import plugin_markdown, read_results

    base = {"task": "plugin-mlm", "lang": "de", "unigram_loss": 5.0, "masked_pieces": 256, "start_loss": 5.0,
            "start_gain": 0.0}
    files = []
    for exp, ceiling_gain in (("exp1", 0.25), ("exp2", 0.5)):
        out = tmp_path / exp / "sweep-de"
        records = []
        for system, run, cost, gain in (("minijoint@2", "2", 1e9, 0.30),
                                        ("minijoint:full", "full", 6e9, ceiling_gain)):
            for step in (0, 2, 4):
                (out / run / "embeddings" / f"step{step:08d}").mkdir(parents=True)
                records.append({**base, "system": system, "step": step, "flops": step * cost,
                                "score": gain * step / 4, "loss": 5.0 - gain * step / 4,
                                "artifact": f"sweep-de/{run}/embeddings/step{step:08d}"})
        (out / "sweep.json").write_text(json.dumps({"records": records, "summary": {}}))
        files.append(str(out / "sweep.json"))
    monkeypatch.chdir(tmp_path)
    two_sweeps = {f"{s} [exp{i}/sweep-de/{run}]" for i in (1, 2)
                  for s, run in (("minijoint@2", "2"), ("minijoint:full", "full"))}
    got = read_results(files)
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1].split()[0] for line in plugin_markdown(got).splitlines()
            if line.startswith("| minijoint@")}
    assert rows == {"minijoint@2 [exp1/sweep-de/2]": "120%", "minijoint@2 [exp2/sweep-de/2]": "60%"}, rows
    # a sweep.json copied away from its runs keeps its records as written (one of them alone reports)
    (tmp_path / "copy.json").write_text((tmp_path / "exp1" / "sweep-de" / "sweep.json").read_text())
    assert {r["artifact"] for r in read_results([str(tmp_path / "copy.json")])} == {
        f"sweep-de/{run}/embeddings/step{step:08d}" for run in ("2", "full") for step in (0, 2, 4)}
    # a checkpoint removed since it was scored is still its sweep's (by its run's directory): it
    # went to the other sweep, one checkpoint scored twice
    (tmp_path / "exp1" / "sweep-de" / "2" / "embeddings" / "step00000000").rmdir()
    assert {r["system"] for r in read_results(files)} == two_sweeps
    # the same runs scored again by evaluate, given them as ../sweep-de/2 (from exp1/evals), or
    # through a link to exp1 as the sweep.json is given: one checkpoint scored twice, refused
    # (re-anchored, the sweep's spelling had ended neither and they read as two runs). A link is
    # not resolved: one pointed elsewhere since may hold another run.
    (tmp_path / "exp1" / "evals").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "exp1")
    sweep = json.loads((tmp_path / "exp1" / "sweep-de" / "sweep.json").read_text())["records"]
    for i, (spelt, given) in enumerate((("../sweep-de/", files[0]),
                                        (f"{tmp_path}/link/sweep-de/", f"{tmp_path}/link/sweep-de/sweep.json"))):
        again = tmp_path / "exp1" / "evals" / f"de{i}.json"
        again.write_text(json.dumps([{**r, "artifact": spelt + r["artifact"].removeprefix("sweep-de/")}
                                     for r in sweep]))
        with pytest.raises(ValueError, match=r"both hold minijoint@2's plugin-mlm score in de at step 0: one "
                                             "checkpoint evaluated twice"):
            read_results([given, str(again)])
    # a link given as the working directory (PWD, as the shell spells it): the sweep.json given from
    # there is re-anchored through it, as evaluate recorded the run typed from there
    monkeypatch.chdir(tmp_path / "link")
    monkeypatch.setenv("PWD", str(tmp_path / "link"))
    with pytest.raises(ValueError, match=r"both hold minijoint@2's plugin-mlm score in de at step 0: one "
                                         "checkpoint evaluated twice"):
        read_results(["sweep-de/sweep.json", str(tmp_path / "exp1" / "evals" / "de1.json")])
    # ... but not where that spelling names another file: from a link to exp1/evals, ../sweep-de
    # folded against the link's name is tmp/sweep-de, where the file read is exp1's (its records
    # kept exp1's relative spelling, which ended exp2's run: one checkpoint scored twice)
    (tmp_path / "to-evals").symlink_to(tmp_path / "exp1" / "evals")
    monkeypatch.chdir(tmp_path / "to-evals")
    monkeypatch.setenv("PWD", str(tmp_path / "to-evals"))
    assert {r["system"] for r in read_results(["../sweep-de/sweep.json", files[1]])} == two_sweeps


def test_a_run_meets_its_own_sweeps_ceiling_where_another_languages_is_named_plainly(tmp_path):
    """The task table pools every language's systems: de's two sweeps (a, b) name their ceilings
    apart, fr's one sweep (c) names its own `minijoint:full` plainly, which every de run took for
    its ceiling (no de score of it: each de share read '-'). Shares by hand: de's a 10 / 20 = 50%,
    b 10 / 40 = 25%, fr's 10 / 20 = 50%."""
    from mmadapt.report import read_results, report_markdown

    def rec(system, lang, run, score):
        return {"system": system, "task": "genre", "lang": lang, "step": 1, "flops": 1e18, "score": score,
                "chance": 20.0, "artifact": f"/w/{run}/embeddings/step00000001"}
    files = {"de_a": [rec("minijoint@2", "de", "de/a/2", 30.0), rec("minijoint:full", "de", "de/a/full", 40.0)],
             "de_b": [rec("minijoint@2", "de", "de/b/2", 30.0), rec("minijoint:full", "de", "de/b/full", 60.0)],
             "fr_c": [rec("minijoint@2", "fr", "fr/c/2", 30.0), rec("minijoint:full", "fr", "fr/c/full", 40.0)],
             "base": [rec("bl_base", lang, f"base/{lang}", 50.0) for lang in ("de", "fr")]}
    for name, records in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(records))
    table = report_markdown(read_results([str(tmp_path / f"{name}.json") for name in files]))
    shares = {}
    for line in table.splitlines():  # the task table's rows (the first of each name); its last column the share
        if line.startswith("| minijoint@2"):
            shares.setdefault(line.split(" | ")[0][2:], line.split(" | ")[-1].split()[0])
    assert shares == {"minijoint@2": "50%", "minijoint@2 [a/2]": "50%", "minijoint@2 [b/2]": "25%"}, shares
    # fr's plain ceiling scored with relative paths (`sweep/full`, which ends de's /x/sweep and
    # /y/sweep): each de run still meets the ceiling of its own directory, not the plain one
    files["fr_c"] = [rec("minijoint@2", "fr", "../sweep/2", 30.0), rec("minijoint:full", "fr", "../sweep/full", 40.0)]
    files["de_a"] = [rec("minijoint@2", "de", "x/sweep/2", 30.0), rec("minijoint:full", "de", "x/sweep/full", 40.0)]
    files["de_b"] = [rec("minijoint@2", "de", "y/sweep/2", 30.0), rec("minijoint:full", "de", "y/sweep/full", 60.0)]
    for name, records in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps([{**r, "artifact": r["artifact"].replace("/w/../", "")}
                                                           for r in records]))
    table = report_markdown(read_results([str(tmp_path / f"{name}.json") for name in files]))
    shares = {}
    for line in table.splitlines():
        if line.startswith("| minijoint@2"):
            shares.setdefault(line.split(" | ")[0][2:], line.split(" | ")[-1].split()[0])
    assert shares == {"minijoint@2": "50%", "minijoint@2 [x/sweep/2]": "50%", "minijoint@2 [y/sweep/2]": "25%"}, shares


def test_spellings_of_runs_merge_only_where_they_name_one_directory(tmp_path):
    """A relative spelling is the run whose path it ends, but one that ends two runs (../../sweep/2
    ends de-1/sweep/2 and de-2/sweep/2) is a run of its own: taken for one of them, its steps 6 and
    8 joined that run's curve (or, as three files, made the two one run scored twice). An absolute
    spelling is kept as given: a link resolved when the report runs (`latest`, pointed at another
    sweep since it was scored) made two runs one, and its labels named directories nobody typed."""
    import os

    from mmadapt.report import read_results

    def rec(artifact, step, score):
        return {"system": "minijoint@2", "task": "genre", "lang": "de", "step": step, "flops": step * 1e15,
                "score": score, "artifact": f"{artifact}/embeddings/step{step:08d}"}
    files = {"a": [rec("de-1/sweep/2", s, 30.0 + s) for s in (0, 2, 4)],
             "b": [rec("de-2/sweep/2", s, 20.0 + s) for s in (0, 2, 4)],
             "c": [rec("../../sweep/2", s, 40.0 + s) for s in (6, 8)]}
    for name, records in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(records))
    got = read_results([str(tmp_path / f"{n}.json") for n in files])
    assert sorted({r["system"] for r in got}) == ["minijoint@2 [../sweep/2]", "minijoint@2 [de-1/sweep/2]",
                                                  "minijoint@2 [de-2/sweep/2]"]
    for name in ("sweep-1201", "sweep-1207"):
        (tmp_path / name / "2").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "sweep-1207")  # scored as latest/2 while it was sweep-1201
    (tmp_path / "a.json").write_text(json.dumps([rec(f"{tmp_path}/latest/2", s, 30.0 + s) for s in (0, 2, 4)]))
    (tmp_path / "b.json").write_text(json.dumps([rec(f"{tmp_path}/sweep-1207/2", s, 20.0 + s) for s in (0, 2, 4)]))
    assert os.path.realpath(tmp_path / "latest") == str(tmp_path / "sweep-1207")
    got = read_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert sorted({r["system"] for r in got}) == ["minijoint@2 [latest/2]", "minijoint@2 [sweep-1207/2]"]


def test_two_runs_in_two_results_files_stay_two_curves_and_one_checkpoint_twice_is_refused(tmp_path, capsys):
    """Two bl_base runs in de, each evaluated by its own `mmadapt evaluate` call: named after their
    runs as evaluate names two runs of one call (one curve took one run's start and the better
    last score); one file given under two names is refused, and so is one checkpoint's score in
    two files."""
    from mmadapt.report import read_results

    def rec(run, step, score):
        return {"system": "bl_base", "task": "genre", "lang": "de", "step": step, "flops": step * 1e15,
                "score": score, "artifact": f"/runs/{run}/embeddings/step{step:08d}"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([rec("overlap", s, v) for s, v in ((0, 21.0), (100, 31.0), (200, 33.0))]))
    b.write_text(json.dumps([rec("fvt", s, v) for s, v in ((0, 27.0), (100, 35.0), (200, 30.0))]))
    got = read_results([str(a), str(b)])
    assert [r["system"] for r in got] == ["bl_base [overlap]"] * 3 + ["bl_base [fvt]"] * 3
    assert got[0].keys() == rec("overlap", 0, 0.0).keys()
    assert [r["system"] for r in read_results([str(a)])] == ["bl_base"] * 3  # one run: its own name
    rows = {r["system"]: (r["start"], r["last"]) for r in adaptation_rows(got, "genre")}
    assert rows == {"bl_base [overlap]": (21.0, 33.0), "bl_base [fvt]": (27.0, 30.0)}
    # each call's no-adaptation record names "bl_base": it stays that of its own file's run (the
    # renamed rows found none, and the no-adaptation columns and verdict were dropped)
    none = {"system": "no_adaptation", "task": "genre", "lang": "de", "flops": 0, "score": 25.0, "of": ["bl_base"]}
    a.write_text(json.dumps([rec("overlap", s, v) for s, v in ((0, 21.0), (100, 31.0), (200, 33.0))] + [none]))
    b.write_text(json.dumps([rec("fvt", s, v) for s, v in ((0, 27.0), (100, 35.0), (200, 30.0))]
                            + [{**none, "score": 29.0}]))
    got = read_results([str(a), str(b)])
    assert [r["of"] for r in got if r["system"] == "no_adaptation"] == [["bl_base [overlap]"], ["bl_base [fvt]"]]
    assert {r["system"]: r["none"] for r in adaptation_rows(got, "genre")} == {"bl_base [overlap]": 25.0,
                                                                               "bl_base [fvt]": 29.0}
    b.write_text(json.dumps([rec("overlap", 200, 33.5)]))
    assert report_main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {a} and {b} both hold bl_base's genre score in de at step 200") and err.count("\n") == 1
    a.write_text(json.dumps([rec("overlap", 0, 21.0), rec("overlap", 0, 21.0)]))
    assert report_main([str(a)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {a} holds bl_base's genre score in de at step 0")
    # one run, its artifacts named relative to where one evaluate call ran and absolute in another
    a.write_text(json.dumps([rec("overlap", 200, 33.0)]))
    b.write_text(json.dumps([{**rec("overlap", 200, 33.5), "artifact": "overlap/embeddings/step00000200"}]))
    assert report_main([str(a), str(b)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {a} and {b} both hold bl_base's genre score in de at step 200")


def test_a_curve_of_other_than_one_runs_checkpoints_is_refused(tmp_path, capsys):
    """One checkpoint's score twice where one record has its step and the other none (its key was
    the step in one, the FLOPs in the other: never equal), and a curve whose FLOPs fall as its step
    rises (records of two runs, or edited): each gave a table, the curve ending on the better score
    (time to target '2 (2–2)', 1.70× for 2.27×) or an earlier step taken for the last checkpoint
    (the target every system is measured by); now refused in one line. An empty results file and
    a JSON Lines one are named as such, with the fix."""
    day = 2.592e18
    good = [{"system": s, "task": "genre", "lang": "de", "step": k, "flops": d * day, "score": v}
            for s, k, d, v in (("bl_base", 1, 2, 50.0), ("bl_base", 2, 4, 60.0), ("minijoint", 1, 1, 56.0),
                               ("minijoint", 2, 2, 58.0))]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(good))
    assert report_main([str(a)]) == 0 and "| minijoint | 1.5 (1–2) | 2.27× (1 langs) |" in capsys.readouterr().out
    b.write_text(json.dumps([{k: v for k, v in good[3].items() if k != "step"} | {"score": 40.0}]))
    assert report_main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {a} and {b} both hold minijoint's genre score in de at 5.184e+18 FLOPs (no step "
                          "recorded): one checkpoint evaluated twice") and err.count("\n") == 1, err
    a.write_text(json.dumps([good[0] | {"flops": 5 * day}, *good[1:]]))
    assert report_main([str(a)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {a} holds bl_base's genre records in de whose FLOPs fall as the step rises "
                          "(step 1: 1.296e+19, step 2: 1.037e+19)") and err.count("\n") == 1, err
    for text, what in (("", "it is empty"), ("\n".join(json.dumps(r) for r in good), "it holds more than one JSON "
                                                                                     "value (JSON Lines?)")):
        a.write_text(text)
        assert report_main([str(a)]) == 2
        assert capsys.readouterr().err == (f"error: cannot read results file {a}: {what}; pass the JSON list `mmadapt "
                                           "evaluate --output` writes\n")


def test_a_no_adaptation_score_that_names_the_system_is_its_own_whatever_the_files_order(tmp_path):
    """A no-adaptation record naming the systems of its evaluate call ("of") is theirs; one naming
    none (hand-written; "of": null too) stands for every other system. Which applied followed the
    files' order, and a null "of" was a traceback."""
    from mmadapt.report import read_results

    def rec(system, score, **more):
        return {"system": system, "task": "genre", "lang": "de", "step": 100, "flops": 1e15, "score": score, **more}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([rec("bl_base", 60.0), rec("no_adaptation", 50.0, step=0, flops=0, of=None)]))
    b.write_text(json.dumps([rec("minijoint", 68.0), rec("no_adaptation", 68.5, step=0, flops=0, of=["minijoint"])]))
    for files in ([a, b], [b, a]):
        rows = {r["system"]: (r["none"], r["paid"]) for r in adaptation_rows(read_results(list(map(str, files))),
                                                                            "genre")}
        assert rows == {"bl_base": (50.0, True), "minijoint": (68.5, False)}


def test_plugin_records_of_one_language_through_different_tokenizers_are_noted(tmp_path, capsys):
    """Plug-in records of one language that two `mmadapt evaluate` calls scored through two
    datasets' tokenizers (a 1,000- and an 8,000-piece replace): reported together, as comparing
    vocabularies in bits per byte needs, with a line saying their nats per piece are not one
    scale; other languages, and records without `heldout_tokenizer` (older files), without it."""
    records = _bpb_records()
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "report.md"
    a.write_text(json.dumps([{**r, "heldout_tokenizer": "1" * 16} for r in records if r["system"] != "minipost"]))
    b.write_text(json.dumps([{**r, "heldout_tokenizer": "8" * 16} for r in records if r["system"] == "minipost"]))
    assert report_main([str(a), str(b), "--output", str(out)]) == 0
    assert ("Per piece, not one scale in de: its plug-in records were read through 2 tokenizers, so their losses and "
            "contextual gains (nats per piece, and the retention and speedups taken from them) set pieces of other "
            "lengths side by side; compare them here, in bits per byte.") in out.read_text()
    assert "| de | minipost | 0.1 | 2.700 | 3.100 | 2.900 | +0.200 | - |" in out.read_text()
    for other in ([{**r, "heldout_tokenizer": "8" * 16, "lang": "fr"} for r in records if r["system"] == "minipost"],
                  [r for r in records if r["system"] == "minipost"]):
        b.write_text(json.dumps(other))
        again = tmp_path / f"report{len(list(tmp_path.iterdir()))}.md"
        assert report_main([str(a), str(b), "--output", str(again)]) == 0
        assert "Per piece, not one scale" not in again.read_text()
    capsys.readouterr()
    b.write_text(json.dumps([{**r, "heldout_tokenizer": ["8"]} for r in records if r["system"] == "minipost"]))
    assert report_main([str(a), str(b)]) == 2
    assert "has heldout_tokenizer ['8']; heldout_tokenizer must be a text" in capsys.readouterr().err


def test_records_of_one_task_scored_by_different_metrics_are_refused(tmp_path, capsys):
    """A task's records whose fine-tuning runs were scored by different --metric (ner: chunk F1 for
    one system, accuracy for another) would meet on one curve, one target and one retention:
    refused in one line naming both; records without `metric` (older files) are read as before."""
    def rec(system, step, score, metric):
        return {"system": system, "task": "ner", "lang": "de", "step": step, "flops": step * 1e15,
                "score": score, **({"metric": metric} if metric else {})}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([rec("bl_base", s, 60.0 + s / 100, "chunk_f1") for s in (0, 100, 200)]))
    b.write_text(json.dumps([rec("minijoint", s, 90.0 + s / 100, "accuracy") for s in (0, 100, 200)]))
    assert report_main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: the ner records are scored by different metrics (chunk_f1 in {a}, accuracy in {b}): one "
                   "curve compares one metric; report them apart\n")
    b.write_text(json.dumps([rec("minijoint", s, 50.0 + s / 100, "chunk_f1") for s in (0, 100, 200)]))
    assert report_main([str(a), str(b)]) == 0
    b.write_text(json.dumps([rec("minijoint", s, 50.0 + s / 100, None) for s in (0, 100, 200)]))
    assert report_main([str(a), str(b)]) == 0


def test_records_of_no_adaptation_alone_are_refused_in_one_line(tmp_path, capsys):
    f = tmp_path / "none.json"
    f.write_text(json.dumps([{"system": "no_adaptation", "task": "genre", "lang": "de", "flops": 0, "score": 40.0,
                              "of": ["bl_base"]}]))
    assert report_main([str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {f} hold only no-adaptation records: no Step-2 checkpoint") and err.count("\n") == 1


def test_bits_per_byte_records_without_a_step_are_read():
    from mmadapt.report import bpb_markdown

    md = bpb_markdown([{k: v for k, v in r.items() if k != "step"} for r in _bpb_records()])
    assert "| de | bl_base | 4 | 2.700 | 3.000 | 2.400 | -0.300 | - |" in md


def test_the_bits_per_byte_panel_draws_each_primary_models_own_no_adaptation():
    """The demo scores three primary models: each one's own tokenizer and embeddings read the text
    at their own bits per byte, and every system was drawn against the first record's."""
    from mmadapt.report import _bpb_panel, pyplot, system_colors

    plt = pyplot()
    records = [{**r, "none_bpb": 2.9} if r["system"] == "minipost" else r for r in _bpb_records()]
    fig, ax = plt.subplots()
    _bpb_panel(ax, records, ["bl_base", "expand", "minipost"], 1e18, system_colors(records))
    nones = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "-."}
    assert nones == {"no adaptation (bl_base, expand's primary model)": 2.7,
                     "no adaptation (minipost's primary model)": 2.9}
    ax.clear()
    _bpb_panel(ax, _bpb_records(), ["bl_base", "expand", "minipost"], 1e18, system_colors(records))
    assert [line.get_label() for line in ax.get_lines() if line.get_linestyle() == "-."] == [
        "no adaptation (own tokenizer and embeddings)"]
    plt.close(fig)


def test_a_tokenizer_that_reads_a_text_as_unk_is_said_so_in_the_verdict():
    """docs/bits-per-byte.md: above 25% <unk> pieces the verdict says the tokenizer does not cover
    the text (English pieces read Russian almost wholly as <unk>); the records carry each share."""
    from mmadapt.report import bpb_markdown

    records = [{**r, "none_bpb_unknown_share": 0.93, "bpb_unknown_share": 0.30 if r["system"] == "expand" else 0.01}
               for r in _bpb_records()]
    md = bpb_markdown(records)
    assert ("EFLOPs of Step 2. (no adaptation's tokenizer reads 93% of its pieces as <unk>; expand's tokenizer reads "
            "30% of its pieces as <unk>: it does not cover the text)") in md
    assert "<unk>" not in bpb_markdown(_bpb_records())  # records from before carry no share: nothing said


def _run_curve(system: str, run: str, flops: list[float], scores: list[float], lang: str) -> list[dict]:
    return [{**r, "artifact": f"runs/{run}/embeddings/step{r['step']:08d}"}
            for r in _curve(system, flops, scores, lang)]


def test_a_baseline_told_apart_into_runs_is_named_not_dropped_unsaid(tmp_path, capsys):
    """Two BL_BASE runs (seeds) of one language are two systems `bl_base [run]`: that language has
    no target and every average against bl_base leaves it out, which the report now says (its
    tables showed '-' with no reason); with no plain bl_base left at all, the baseline line said
    "no bl_base in the records" and took whatever spent most: it names bl_base's runs."""
    day = 2.592e18
    f = tmp_path / "seeds.json"
    f.write_text(json.dumps(_run_curve("bl_base", "bl-ar", [2 * day, 4 * day], [60.0, 70.0], "ar")
                            + _run_curve("bl_base", "bl-de-s1", [2 * day, 4 * day], [75.0, 80.0], "de")
                            + _run_curve("bl_base", "bl-de-s2", [2 * day, 4 * day], [74.0, 79.0], "de")
                            + _run_curve("minijoint", "mj-ar", [1 * day, 2 * day], [60.0, 69.0], "ar")
                            + _run_curve("minijoint", "mj-de", [1 * day, 2 * day], [70.0, 78.0], "de")))
    assert report_main([str(f)]) == 0
    out = capsys.readouterr()
    note = ("No bl_base target in de: 2 runs of bl_base in de (bl_base [bl-de-s1], bl_base [bl-de-s2]), told apart "
            "by their directories; pass --baseline with one of them, or report each run's records apart.")
    assert out.out.count(note) == 2 and out.err == ""  # under the final scores and under the near-maximal table
    f.write_text(json.dumps(_run_curve("bl_base", "bA", [2 * day, 4 * day], [60.0, 70.0], "de")
                            + _run_curve("bl_base", "bB", [2 * day, 5 * day], [61.0, 71.0], "de")
                            + _run_curve("minijoint:full", "full", [3 * day, 9 * day], [62.0, 72.0], "de")))
    assert report_main([str(f)]) == 0
    assert capsys.readouterr().err.strip() == (
        "baseline: bl_base [bB] (bl_base has 2 runs in the records, told apart by their directories (bl_base [bA], "
        "bl_base [bB]): the one with the most Step-2 compute; --baseline chooses another)")
