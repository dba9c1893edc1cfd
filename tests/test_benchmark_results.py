"""benchmarks/common.write_results: a dated pair of files per run, never over an earlier run's."""
from conftest import benchmark_module


def test_results_files_take_a_free_suffix_keep_dots_and_one_run_rewrites_its_own(tmp_path, monkeypatch):
    common = benchmark_module("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "hardware", lambda: "cpu2")
    first = common.write_results("tiny_lr2.5e-4", {"x": 1}, "# one")
    # the dot stays in the name (with_suffix had cut it: tiny_lr2.json, written over by every run)
    assert [p.name[:len("tiny_lr2.5e-4_cpu2_")] for p in first] == ["tiny_lr2.5e-4_cpu2_"] * 2
    assert [p.suffix for p in first] == [".json", ".md"]
    second = common.write_results("tiny_lr2.5e-4", {"x": 2}, "# two")
    assert [p.name for p in second] == [p.name.replace(".json", "b.json").replace(".md", "b.md") for p in first]
    assert first[1].read_text() == "# one\n"
    # a script that writes as it goes keeps one pair of files per run
    again = common.write_results("tiny_lr2.5e-4", {"x": 3}, "# three", second)
    assert again == second and second[1].read_text() == "# three\n" and len(list(tmp_path.iterdir())) == 4
