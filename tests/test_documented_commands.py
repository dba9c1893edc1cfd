"""Every command the README and docs/ show is one mmadapt accepts as written: each is read out of
the Markdown code blocks (continuation lines joined), given to its command's own parser, and a
training command's flags are laid over the schedule it would start from and checked as its step
checks them before any work (TrainConfig.check_step and validate): a default that never reaches
the command line, or a flag a command no longer has, fails here, naming the file and the command.

Every subcommand's `--help` is read the same way for example command lines (none holds one today).

The commands whose parser lives in their main (flops, report, import-hf, export-hf, extend) are
also run as written in an empty directory, where they compute (flops) or refuse a missing input in
one line; neither may be an argument error. Then every block runs, with bash, at MMADAPT_TINY=1's
sizes (the section at the end): the README first, in a directory holding what a user brings, and
each document that continues it in a copy of that directory."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import child_env, shipped_zip
from mmadapt import cli, steps
from mmadapt.config import FinetuneConfig, ModelConfig, override
from mmadapt.models import find_preset

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# The command each launch script or mmadapt subcommand runs: its parser and the step whose flags it checks.
PARSED = {"pretrain": (cli.pretrain_parser, steps.Pretrain.name), "preprocess": (cli.preprocess_parser, None),
          "build_minipost": (cli.minipost_parser, steps.BuildMinipost.name),
          "fit-head": (cli.fit_head_parser, steps.FitHead.name), "adapt": (cli.adapt_parser, steps.AdaptEmbeddings.name),
          "sweep": (cli.sweep_parser, steps.AdaptEmbeddings.name), "finetune": (cli.finetune_parser, None),
          "evaluate": (cli.evaluate_parser, None), "predict": (cli.predict_parser, None)}
RUN = ("flops", "report", "import-hf", "export-hf", "extend")
# argparse's own refusals: a flag or value the command does not take
ARGUMENT_ERRORS = ("unrecognized arguments", "invalid choice", "expected one argument", "arguments are required",
                   "invalid ", "not allowed with")


def block_lines(block: str) -> list[str]:
    """A bash block's command lines: continuations joined, and a `for VAR in A ...; do` loop's
    body with $VAR as its first value (the loop lines themselves dropped)."""
    out, loop = [], None
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        line = line.strip()
        if m := re.fullmatch(r"for (\w+) in (\S+).*; do", line):
            loop = m.groups()
        elif line == "done":
            loop = None
        else:
            out.append(line if loop is None else re.sub(rf"\${{?{loop[0]}\b}}?", loop[1], line))
    return out


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, command, arguments) of every mmadapt command in a ```bash block of the docs."""
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh|shell)?\n(.*?)```", text, flags=re.S):
            for line in block_lines(block):
                if not line or line.startswith("#"):
                    continue
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
                command = _command(words)
                if command is not None:
                    out.append((f"{doc.relative_to(REPO)}: {line[:90]}", *command))
    return out


def help_text(command: str) -> str:
    """What `mmadapt <command> --help` prints."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([command, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def example_commands(text: str, where: str) -> list[tuple[str, str, list[str]]]:
    """(where, command, arguments) of every example command line in a help text: a line that
    starts with `mmadapt <command>` or `$ mmadapt <command>` (argparse's own usage line aside)."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip().removeprefix("$ ")
        if not line.startswith("mmadapt ") or line.startswith("usage:"):
            continue
        try:
            command = _command(shlex.split(line, comments=True))
        except ValueError:
            continue
        if command is not None and command[0] in cli.COMMANDS:
            out.append((f"{where}: {line[:90]}", *command))
    return out


def help_commands() -> list[tuple[str, str, list[str]]]:
    """The example commands of every subcommand's --help (checked as the docs' are)."""
    return [c for name in cli.COMMANDS for c in example_commands(help_text(name), f"mmadapt {name} --help")]


def _command(words: list[str]) -> tuple[str, list[str]] | None:
    """mmadapt CMD args..., or (deepspeed|python) ... launch/CMD.py args... -> (CMD, args)."""
    if len(words) >= 2 and words[0] == "mmadapt" and not words[1].startswith("-"):
        return words[1], words[2:]
    script = next((i for i, w in enumerate(words) if w.startswith("launch/") and w.endswith(".py")), None)
    if script is not None and words[0] in ("deepspeed", "python", "python3", "torchrun"):
        name = Path(words[script]).stem
        return {"build_minipost": "build_minipost"}.get(name, name), words[script + 1:]
    return None


def placeholder(args: list[str]) -> bool:
    """A command shown with its arguments elided or to be filled in: `...`, <a path>, $VARIABLE."""
    return any(a == "..." or a.endswith("...") or "<" in a or "$" in a for a in args)


COMMANDS = documented_commands() + help_commands()


def test_the_docs_show_commands_of_every_step():
    shown = {c for _, c, args in COMMANDS if not placeholder(args)}
    assert len(COMMANDS) >= 40 and {"pretrain", "preprocess", "adapt", "finetune", "evaluate", "extend"} <= shown


def test_every_python_example_imports_what_it_names():
    """The ```python blocks of the docs: their imports run, and every `module.name(` they call on an
    imported mmadapt module exists there (the blocks themselves train, or need a user's family)."""
    import types

    checked = 0
    for doc in DOCS:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            ns: dict = {}
            for line in block.splitlines():
                if re.match(r"(import|from) \S+", line):
                    exec(line.split("#")[0], ns)
            for module, name in re.findall(r"\b(\w+)\.(\w+)\(", block):
                if isinstance(ns.get(module), types.ModuleType) and ns[module].__name__.startswith("mmadapt"):
                    assert hasattr(ns[module], name), f"{doc.name}: {module}.{name} does not exist"
                    checked += 1
    assert checked >= 5  # steps.pretrain ... predict.load: the blocks were found and read


def test_every_help_text_is_read_for_examples():
    """Every subcommand's --help is read (none holds a complete example today: their examples are
    in the docs), and an example line in one, continued or not, is found for the checks below;
    prose that names a command, argparse's usage line and unknown commands are not examples."""
    for name in cli.COMMANDS:  # every one named as typed, the parsers launch/*.py share too
        assert help_text(name).startswith(f"usage: mmadapt {name} "), name
    text = ("Step 2 (after mmadapt preprocess).\n\nexample:\n  mmadapt adapt --system bl_base --source runs/x \\\n"
            "      --lang de\n  $ mmadapt flops --paper\n  mmadapt frobnicate --x 1\nusage: mmadapt adapt -h\n")
    assert [c[1:] for c in example_commands(text, "help")] == [
        ("adapt", ["--system", "bl_base", "--source", "runs/x", "--lang", "de"]), ("flops", ["--paper"])]


def _schedule(args, step: str):
    """The TrainConfig a later step starts from (cli._schedule without its source run: the
    --preset's schedule, else the encoder's small preset) with the command's flags over it."""
    _, _, train = find_preset(args.preset or "tiny")
    return override(train, args)


@pytest.mark.parametrize("where, command, args", [c for c in COMMANDS if c[1] in PARSED and not placeholder(c[2])],
                         ids=lambda x: x if isinstance(x, str) and ":" in x else "")
def test_a_documented_command_parses_and_its_settings_hold(where, command, args):
    make, step = PARSED[command]
    try:
        ns = make().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: the {command} parser refuses it (exit {e.code})")
    if command == "pretrain":
        model, train = cli.configs_from_args(ns)
        train.check_step(step)
        train.validate(model)
    elif step is not None:
        train = _schedule(ns, step)
        train.check_step(step)
        train.validate(ModelConfig(max_position_embeddings=max(train.seq_length, 512)))
    elif command == "finetune":
        override(FinetuneConfig(), ns)


@pytest.mark.parametrize("where, command, args", [c for c in COMMANDS if c[1] in RUN and not placeholder(c[2])],
                         ids=lambda x: x if isinstance(x, str) and ":" in x else "")
def test_a_documented_command_is_no_argument_error(where, command, args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its inputs are not here: it computes or refuses one, and writes nowhere else
    try:
        code = cli.main([command, *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2) and not any(e in err for e in ARGUMENT_ERRORS), f"{where}: {err}"
    assert "Traceback" not in err


def test_a_default_that_never_reaches_the_command_line_fails_here():
    """The check itself: d974fb8's presets held replay_fraction 0.0, so `--replay_data` alone (its
    documented default fraction 0.5) was refused; laid over such a schedule, the documented
    form fails the check above as it failed users."""
    ns = cli.adapt_parser().parse_args(["--system", "bl_base", "--source", "runs/bl_base", "--lang", "de",
                                        "--replay_data", "data/en", "--output_dir", "runs/x"])
    _, _, train = find_preset("tiny")
    old = dataclasses.replace(train, replay_fraction=0.0)  # the preset as it was
    with pytest.raises(ValueError, match="--replay_fraction needs --replay_data"):
        override(old, ns).validate(ModelConfig())
    override(train, ns).validate(ModelConfig())  # today's preset leaves it unset: the default reaches it


# --- the commands run as written ----------------------------------------------------------------------
# A documented bash block runs here as it stands, with bash, in one workspace per document, at
# MMADAPT_TINY=1's sizes (mmadapt/config.py: the one switch that shrinks them). The workspace holds
# what the docs expect the user to bring (cc100/<lang>.txt, MultiNLI and XNLI files, a downloaded
# model), made here from the packaged Bibles, and `launch/` and `ds_configs/`; on its PATH,
# `mmadapt` is this checkout's command and `deepspeed --num_gpus N script ...` runs the script in
# one process (as `python launch/X.py` does, README). A block the docs mark with NOT_RUN just
# before its fence is left out, for the reason the mark gives.
NOT_RUN = "<!-- not run by tests/test_documented_commands.py:"
DEEPSPEED_SHIM = """#!/bin/sh
# deepspeed's launcher where its GPUs are not: the script in one process
while [ $# -gt 0 ]; do
  case "$1" in
    --num_gpus|--num_nodes|--hostfile|--master_port|--include|--exclude) shift 2;;
    --*=*|--no_ssh|--no_local_rank) shift;;
    *) break;;
  esac
done
exec "{python}" "$@"
"""


HF_SHIM = """#!/bin/sh
# `hf download REPO --local-dir DIR` where nothing can be downloaded: the stand-in the test made for REPO
[ "$1" = download ] || { echo "hf (test shim): only download" >&2; exit 2; }
hub="$(dirname "$0")/../hub"; repo=$2; dir=""; shift 2
while [ $# -gt 0 ]; do case "$1" in --local-dir) dir=$2; shift 2;; *) shift;; esac; done
[ -d "$hub/$repo" ] || { echo "hf (test shim): no stand-in for $repo" >&2; exit 2; }
mkdir -p "$dir" && cp -r "$hub/$repo/." "$dir"
"""


def stand_ins(hub: Path) -> None:
    """What `hf download` gives docs/huggingface.md's commands here: tiny models of each repository's
    architecture and tokenizer kind, made with transformers (tests/hf_models.py), 6 layers deep
    (MINIPOST's default mini-model takes 4), Qwen2-0.5B's 151,936 embedding rows included (its
    preprocess line names them), and its Instruct sibling fine-tuned from it."""
    import hf_models

    if hub.is_dir():
        return
    qwen2 = hf_models.make_qwen2(hub / "Qwen/Qwen2-0.5B", train_steps=20, rows=151_936, layers=6)
    hf_models.make_sibling(qwen2, hub / "Qwen/Qwen2-0.5B-Instruct", steps=5)
    hf_models.make_xlmr(hub / "FacebookAI/xlm-roberta-base", layers=6)
    body = hf_models.make_bert(hub / "bert-body", headless=True, layers=6)
    hf_models.as_sentence_transformer(body, hub / "sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2")


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every ```bash block of a Markdown document that NOT_RUN does not mark."""
    out, lines = [], text.splitlines()
    for m in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, m.start()) + 1
        before = next((l for l in reversed(lines[:line - 1]) if l.strip()), "")
        if not before.startswith(NOT_RUN):
            out.append((line, m.group(1)))
    return out


def workspace(root: Path) -> dict[str, str]:
    """A user's directory for the docs' commands (the comment above) -> the environment to run them in."""
    import random

    from mmadapt.corpora import bible_verses, write_bible_corpus

    (root / "bin").mkdir(parents=True)
    for name in ("launch", "ds_configs"):
        (root / name).symlink_to(REPO / name)
    for lang in ("en", "de"):
        write_bible_corpus(lang, root / "cc100" / f"{lang}.txt", books=range(40, 46))  # the Gospels and Acts
        (root / "data" / "cc100").mkdir(parents=True, exist_ok=True)  # where docs/huggingface.md keeps it
        (root / "data" / "cc100" / f"{lang}.txt").symlink_to(Path("..", "..", "cc100", f"{lang}.txt"))
    labels = ("entailment", "neutral", "contradiction")
    verses = {lang: [t for *_, t in bible_verses(lang, range(40, 41))] for lang in ("en", "de")}
    rng = random.Random(0)
    (root / "data" / "MNLI").mkdir()
    (root / "data" / "XNLI-1.0").mkdir()
    with open(root / "data" / "MNLI" / "train.tsv", "w", encoding="utf-8") as f:
        f.write("index\tsentence1\tsentence2\tgold_label\n")
        f.writelines(f"{i}\t{verses['en'][i]}\t{verses['en'][i + 1]}\t{rng.choice(labels)}\n" for i in range(120))
    for split in ("dev", "test"):
        with open(root / "data" / "XNLI-1.0" / f"xnli.{split}.tsv", "w", encoding="utf-8") as f:
            f.write("language\tgold_label\tsentence1\tsentence2\n")
            f.writelines(f"{lang}\t{rng.choice(labels)}\t{v[i]}\t{v[i + 1]}\n" for lang, v in verses.items()
                         for i in range(60))
    (root / "de.txt").write_text((root / "cc100" / "de.txt").read_text(encoding="utf-8"), encoding="utf-8")
    for name, lang in (("reviews.csv", "en"), ("reviews.de.csv", "de")):  # docs/finetuning.md's own task
        with open(root / name, "w", encoding="utf-8", newline="") as f:
            rows = csv.writer(f)
            rows.writerow(["text", "label"])
            rows.writerows([v, "pos" if i % 2 else "neg"] for i, v in enumerate(verses[lang][:80]))
    with zipfile.ZipFile(shipped_zip()) as z:  # the model the README's extend example downloaded
        z.extractall(root / "models" / "all-MiniLM-L6-v2")
    (root / "bin" / "mmadapt").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mmadapt.cli "$@"\n')
    (root / "bin" / "deepspeed").write_text(DEEPSPEED_SHIM.replace("{python}", sys.executable))
    (root / "bin" / "hf").write_text(HF_SHIM)  # its stand-ins in <root>/hub (stand_ins)
    (root / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a venv's, too
    for shim in (root / "bin").iterdir():
        shim.chmod(0o755)
    return child_env(PATH=f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}", MMADAPT_TINY="1",
                     PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                     MMADAPT_CACHE=str(root / "cache"))


def run_blocks(doc: str, text: str, root: Path, env: dict[str, str]) -> list[str]:
    """Run `text`'s blocks in order in `root` -> one line per block that failed (where, exit, last error)."""
    failed = []
    for line, block in runnable_blocks(text):
        proc = subprocess.run(["bash", "-xeuo", "pipefail", "-c", block], cwd=root, env=env, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            ran = [l.lstrip("+ ") for l in said if l.startswith("+")]  # bash -x: each command as it ran
            said = [l for l in said if l.startswith("error:")] or [l for l in said if not l.startswith("+")][-3:]
            failed.append(f"{doc}:{line}: exit {proc.returncode}: {ran[-1][:160] if ran else ''}: {' | '.join(said)}")
            break  # the blocks after it build on it
    return failed


# The docs that continue the README: each runs in a copy of the README's finished workspace, less
# what its own commands write (they make it again), so that it reads the README's data and runs.
# Every other document is all NOT_RUN blocks (its reason beside each) or has no bash block.
RUN_DOCS = ("docs/pretraining.md", "docs/mini-models.md", "docs/decoders.md", "docs/finetuning.md",
            "docs/flops-and-benchmarks.md", "docs/huggingface.md")


def outputs(block: str) -> list[str]:
    """The paths a block's commands write (--output_dir, --output, report's --plots), a loop's
    variable as a wildcard; comment lines aside."""
    loop_vars = re.findall(r"for (\w+) in ", block)
    lines = [l for l in re.sub(r"\\\n\s*", " ", block).splitlines() if not l.lstrip().startswith("#")]
    found = re.findall(r"--(?:output(?:_dir)?|plots)[ =](\S+)", "\n".join(lines))
    return [re.sub(r"\$\{?(" + "|".join(loop_vars) + r")\b\}?", "*", f) if loop_vars else f for f in found]


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> tuple[Path, dict[str, str], list[str]]:
    """The README's blocks run in a fresh workspace -> (it, its environment, the blocks that failed)."""
    root = tmp_path_factory.mktemp("readme")
    env = workspace(root)
    return root, env, run_blocks("README.md", (REPO / "README.md").read_text(encoding="utf-8"), root, env)


def test_every_other_document_runs_nothing_unmarked():
    """A document outside RUN_DOCS (and the README) has no bash block left without a NOT_RUN mark:
    a new one there would never run."""
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        if name != "README.md" and name not in RUN_DOCS:
            assert runnable_blocks(doc.read_text(encoding="utf-8")) == [], f"{name}: add it to RUN_DOCS or mark it"
    assert outputs("for s in 1 2; do\n  x --output_dir runs/$s-$seed --output=r/$s.json\ndone\n# y --output z\n"
                   "mmadapt report r/*.json --plots plots/\n") == ["runs/*-$seed", "r/*.json", "plots/"]


@pytest.mark.slow
def test_the_readme_runs_as_written(readme):
    """Every bash block of the README (its two set-up lines aside), as written, in order: data,
    Steps 1, 1b, 2, 3 with three seeds, 4 and the report, and `mmadapt extend` on the real
    checkpoint; each leaves what the next one reads and what the README says it writes."""
    root, _, failed = readme
    assert failed == []
    records = json.loads((root / "results" / "minijoint-xnli-de.json").read_text())
    assert {r["lang"] for r in records} == {"de"} and (root / "report.md").is_file()
    assert {p.name for p in (root / "runs" / "ft").iterdir()} == {f"minijoint-xnli-{s}" for s in (1, 2, 3)}
    assert (root / "runs" / "minilm-de" / "export" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUN_DOCS)
def test_a_doc_runs_as_written(doc, readme, tmp_path):
    import shutil

    source, env, failed = readme
    assert failed == [], "the README's own blocks fail (test_the_readme_runs_as_written)"
    root = tmp_path / "ws"
    shutil.copytree(source, root, symlinks=True, ignore=shutil.ignore_patterns("all-MiniLM-L6-v2"))
    (root / "models" / "all-MiniLM-L6-v2").symlink_to(source / "models" / "all-MiniLM-L6-v2")
    env = {**env, "PATH": env["PATH"].replace(str(source), str(root))}
    text = (REPO / doc).read_text(encoding="utf-8")
    if "hf download" in text:
        stand_ins(root / "hub")
    for _, block in runnable_blocks(text):
        for pattern in outputs(block):
            for path in root.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    assert runnable_blocks(text), f"{doc} runs nothing: take it out of RUN_DOCS"
    assert run_blocks(doc, text, root, env) == []


def test_a_broken_example_fails_the_run(tmp_path):
    """The runner itself: a block with a flag no command has fails it, naming the document, the
    line and the command's one-line refusal; a block marked NOT_RUN is left out, the one after
    the failure never runs."""
    env = workspace(tmp_path)
    doc = ("# x\n\n```bash\nmmadapt preprocess --corpus cc100/en.txt --output_dir data/en --vocab_size 50000\n```\n\n"
           f"{NOT_RUN} a download -->\n```bash\nfalse\n```\n\n"
           "```bash\nmmadapt adapt --system bl_base --source runs/x --lang de --output_dir runs/y --frobnicate 1\n"
           "```\n\n"
           "```bash\ntouch after\n```\n")
    assert [line for line, _ in runnable_blocks(doc)] == [3, 12, 16]
    failed = run_blocks("doc.md", doc, tmp_path, env)
    assert len(failed) == 1 and failed[0].startswith("doc.md:12: exit 2: mmadapt adapt --system bl_base"), failed
    assert failed[0].endswith("unrecognized arguments: --frobnicate 1 (see --help)"), failed
    assert (tmp_path / "data" / "en" / "manifest.json").is_file() and not (tmp_path / "after").exists()
