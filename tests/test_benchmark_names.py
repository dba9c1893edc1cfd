"""Every name a benchmark or launch script takes from mmadapt exists there: those scripts run on a
GPU or by hand, not in this suite, and a function moved between modules broke one unseen
(benchmarks/eval_overhead.py read evaluate.eval_dtype for five days after it moved to devices.py).
Read from each script's source: `from mmadapt[.m] import n` and every `alias.attr` of an imported
mmadapt module."""

from __future__ import annotations

import ast
import importlib

import pytest

from conftest import REPO

SCRIPTS = sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "launch").glob("*.py")])


def _missing(path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mmadapt"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "mmadapt"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmadapt") and node.level == 0:
            module = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(module, a.name):
                    try:  # a submodule
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.module}.{a.name} (line {node.lineno})")
                        continue
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            try:
                module = importlib.import_module(aliases[node.value.id])
            except ModuleNotFoundError:  # a name imported from a module, not a module
                continue
            if not hasattr(module, node.attr):
                try:
                    importlib.import_module(f"{aliases[node.value.id]}.{node.attr}")
                except ModuleNotFoundError:
                    missing.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return missing


def test_there_are_scripts():
    assert len(SCRIPTS) > 30


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_mmadapt_name_a_script_uses_exists(path):
    assert _missing(path) == []
