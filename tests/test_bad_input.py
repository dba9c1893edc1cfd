"""A table of a user's mistakes, one row each, across every command: each must end with exit
code 2, one `error:` line on stderr and no traceback, and leave every file that existed before
(the run directory, the inputs, the source run) exactly as it was."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, VOCAB
from mmadapt.cli import main
from mmadapt.data import file_sha256

# Each row: (id, argv builder, part of the message). The builder gets a Ctx and may create
# input files under ctx.tmp before the snapshot is taken.


class Ctx:
    def __init__(self, tmp: Path, corpus: Path, tokenizer: Path, primary: Path, request=None):
        self.tmp, self.corpus, self.tokenizer, self.primary = tmp, corpus, tokenizer, primary
        self.out = tmp / "run"
        self.request = request  # for the fixtures only some rows need (tiny_hf), made when first asked for
        self.inputs = [corpus.parent, tokenizer.parent, primary]  # what no row may write in (and those rows read)

    def file(self, name: str, data: bytes | str) -> str:
        p = self.tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(p)

    def dir(self, name: str) -> str:
        p = self.tmp / name
        p.mkdir(exist_ok=True)
        return str(p)

    def classifier(self, architecture: str) -> str:
        """A directory whose config.json names a sequence classifier (all that extend reads first)."""
        model_type = "bert" if architecture.startswith("Bert") else "roberta"
        self.dir("clf")
        return str(Path(self.file("clf/config.json", json.dumps({"architectures": [architecture],
                                                                 "model_type": model_type}))).parent)

    def pretrain(self, *extra: str, corpus: str | None = None, tokenizer: str | None = None) -> list[str]:
        return ["pretrain", "--recipe", "minijoint", "--preset", "tiny", "--corpus", corpus or str(self.corpus),
                "--tokenizer", tokenizer or str(self.tokenizer), "--vocab_size", str(VOCAB),
                "--output_dir", str(self.out), *extra]

    def resumed(self, **changes) -> list[str]:
        """A run directory whose run.json records this run but with `changes` in its train config."""
        from mmadapt.cli import configs_from_args, pretrain_parser
        from mmadapt.config import to_dict
        from mmadapt.engine import load_ds_config

        argv = self.pretrain("--resume")
        model, train = configs_from_args(pretrain_parser().parse_args(argv[1:]))
        (self.out / "checkpoints").mkdir(parents=True)
        ds = load_ds_config(Path(pretrain_parser().parse_args(argv[1:]).ds_config), train)
        record = {"recipe": "minijoint", "model": to_dict(model), "train": {**to_dict(train), **changes},
                  "data_path": str((self.out / "data").resolve()), "corpus": str(self.corpus.resolve()),
                  "ds_config": ds}
        (self.out / "run.json").write_text(json.dumps(record))
        return argv

    def encoded_from_another_corpus(self) -> None:
        """The run's data/ as a corpus of other text encoded it (its manifest's fingerprint)."""
        (self.out / "data").mkdir(parents=True)
        for name in ("text.bin", "text.idx", "tokenizer.model"):
            (self.out / "data" / name).write_bytes((self.primary / "data" / name).read_bytes())
        manifest = json.loads((self.primary / "data" / "manifest.json").read_text())
        manifest["corpus_fingerprint"] = {"size": 1, "sha256_sampled": "0" * 64}
        (self.out / "data" / "manifest.json").write_text(json.dumps(manifest))

    def short_held_out(self) -> str:
        """A dataset prepared with one short document held out (8 pieces or so: 'Verse 5 ...')."""
        docs = "\n\n".join(f"Verse {i} of the book of the law." for i in range(40))
        out = str(self.tmp / "short_valid")
        with contextlib.redirect_stderr(io.StringIO()):  # its warning of unknown pieces is not the row's line
            assert main(["preprocess", "--corpus", self.file("docs.txt", docs + "\n"), "--tokenizer",
                         str(self.tokenizer), "--vocab_size", str(VOCAB), "--valid_fraction", "0.05",
                         "--output_dir", out]) == 0
        return out

    def own_tokenizer_dataset(self) -> str:
        """The corpus prepared with a tokenizer trained on it: not the primary run's."""
        out = str(self.tmp / "own_tokenizer")
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["preprocess", "--corpus", str(self.corpus), "--vocab_size", "300", "--output_dir", out]) == 0
        return out

    def moved_primary(self) -> str:
        """A copy of the primary run whose record names a data_path that is not there (as once the
        run is moved with its data/ inside)."""
        moved = self.tmp / "moved"
        shutil.copytree(self.primary, moved, ignore=shutil.ignore_patterns("data"))
        record = json.loads((moved / "run.json").read_text())
        (moved / "run.json").write_text(json.dumps({**record, "data_path": str(self.tmp / "primary" / "data")}))
        return str(moved)

    def minipost(self, *extra: str, primary: str | None = None) -> list[str]:
        return ["build_minipost", "--primary", primary or str(self.primary), "--output_dir", str(self.out), *extra]

    def adapt(self, *extra: str, corpus: str | None = None, tokenizer: str | None = None) -> list[str]:
        return ["adapt", "--system", "minijoint", "--source", str(self.primary), "--lang", "de",
                "--corpus", corpus or str(self.corpus), "--tokenizer", tokenizer or str(self.tokenizer),
                "--vocab_size", str(VOCAB), "--output_dir", str(self.out), *extra]

    def expand(self, *extra: str) -> list[str]:
        """Step 2 --vocab_mode expand over the primary run, without --vocab_size (the vocabulary
        is the merged one)."""
        return ["adapt", "--system", "minijoint", "--source", str(self.primary), "--lang", "de", "--vocab_mode",
                "expand", "--output_dir", str(self.out), *extra]

    def other_dataset(self) -> str:
        """A prepared dataset (the primary run's manifest) whose tokenizer is another one."""
        out = self.tmp / "other"
        out.mkdir()
        for name in ("text.bin", "text.idx"):
            (out / name).write_bytes((self.primary / "data" / name).read_bytes())
        (out / "tokenizer.model").write_bytes(b"another tokenizer")
        manifest = json.loads((self.primary / "data" / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": file_sha256(
            out / "tokenizer.model")}))
        return str(out)

    def cut_dataset(self) -> str:
        """The primary run's prepared dataset, copied with its text.bin cut short."""
        out = self.tmp / "cut"
        shutil.copytree(self.primary / "data", out)
        with open(out / "text.bin", "r+b") as f:
            f.truncate(100)
        return str(out)

    def damaged_manifest(self, text: str) -> str:
        """The primary run's prepared dataset with its manifest.json replaced by `text`."""
        out = self.tmp / "damaged"
        shutil.copytree(self.primary / "data", out)
        (out / "manifest.json").write_text(text)
        return str(out)

    def finetune(self, *extra: str, primary: str | None = None) -> list[str]:
        return ["finetune", "--task", "bible-genre", "--primary", primary or str(self.primary),
                "--output_dir", str(self.out), *extra]

    def evaluate(self, *extra: str, embeddings: str | None = None, finetuned: str | None = None) -> list[str]:
        return ["evaluate", "--finetuned", finetuned or self.dir("ft"), "--embeddings", embeddings or self.dir("emb"),
                "--eval_file", "bible", "--output", str(self.tmp / "records.json"), *extra]

    def damaged_copy(self) -> str:
        """A copy of the primary run whose model file was cut short."""
        d = self.tmp / "primary_copy"
        shutil.copytree(self.primary, d)
        for f in (d / "checkpoints").glob("step*/mp_rank_00_model_states.pt"):
            f.write_bytes(f.read_bytes()[:500])
        return str(d)

    def records(self, data) -> str:
        return self.file("results.json", json.dumps(data))

    def artifact(self, rows: int) -> str:
        """A Step-2 artifact of the primary run whose embeddings have `rows` rows, beside the
        tokenizer's VOCAB pieces."""
        import torch

        d = self.tmp / "artifact"
        d.mkdir()
        torch.save({"word_embeddings": torch.zeros(rows, 64), "output_bias": torch.zeros(rows)}, d / "embeddings.pt")
        shutil.copyfile(self.tokenizer, d / "spm.model")
        (d / "meta.json").write_text(json.dumps({"system": "minijoint", "lang": "de", "source": str(self.primary)}))
        return str(d)

    def hf_dir(self, weights: str, data: bytes) -> str:
        """A Hugging Face XLM-R directory whose only weight file is `weights`, holding `data`."""
        d = self.tmp / "hf"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["XLMRobertaForMaskedLM"],
                                                   "model_type": "xlm-roberta", "pad_token_id": 1}))
        (d / weights).write_bytes(data)
        return str(d)

    def import_damaged(self, arch: str, config: dict | None = None, edit=None) -> list[str]:
        """import-hf of a copy of the tiny `arch` model (conftest.tiny_hf) with config.json's fields
        updated and its weights edited (hf_models.damaged_copy)."""
        from hf_models import damaged_copy

        src = self.request.getfixturevalue("tiny_hf")[arch]
        self.inputs.append(src)
        return ["import-hf", "--model", str(damaged_copy(src, self.tmp / "hf", config, edit)), "--output_dir",
                str(self.out)]

    def kind_copy_without_tokenizer(self, step: str) -> str:
        """kind_copy of a run kind that keeps no tokenizer of its own (a fine-tuning run)."""
        d = Path(self.kind_copy(step))
        shutil.rmtree(d / "tokenizer")
        return str(d)

    def kind_copy(self, step: str, **record) -> str:
        """A copy of the primary run whose run.json says it is a run of another kind (`step`)."""
        d = self.tmp / f"{step}_run"
        shutil.copytree(self.primary, d)
        run = json.loads((d / "run.json").read_text())
        (d / "run.json").write_text(json.dumps({**run, "step": step, **record}))
        return str(d)

    def nan_copy(self) -> str:
        """A copy of the primary run whose weights are all NaN, as a diverged run's would be."""
        import torch

        d = self.tmp / "nan_run"
        shutil.copytree(self.primary, d)
        for f in (d / "checkpoints").glob("step*/mp_rank_00_model_states.pt"):
            blob = torch.load(f, map_location="cpu", weights_only=False)
            for t in blob["module"].values():
                if t.is_floating_point():
                    t.fill_(float("nan"))
            torch.save(blob, f)
            complete = json.loads((f.parent / "COMPLETE").read_text())
            complete["files"] = {p.name: p.stat().st_size for p in f.parent.iterdir() if p.name != "COMPLETE"}
            (f.parent / "COMPLETE").write_text(json.dumps(complete))
        return str(d)

    def predict(self, text: str, *extra: str, run: str | None = None) -> list[str]:
        return ["predict", "--run", run or str(self.primary), "--input", self.file("in.txt", text + "\n"), *extra]

    def bert_dir(self, tokenizer: str = "wordpiece", **config) -> str:
        """A tiny Hugging Face BERT directory (tests/hf_models.py's shapes, one layer): a BertModel
        with `config` over BERT_SHAPE and a WordPiece tokenizer, or (tokenizer "bpe") a byte-level BPE."""
        from hf_models import BERT_SHAPE, make_wordpiece
        from transformers import BertConfig, BertModel

        d = self.tmp / "bert"
        if tokenizer == "bpe":
            from tokenizers import ByteLevelBPETokenizer
            from transformers import RobertaTokenizerFast

            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator(["In the beginning God created the heaven and the earth."] * 20, vocab_size=300,
                                    special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False)
            d.mkdir()
            tok = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer)
            tok.save_pretrained(str(d))
        else:
            tok = make_wordpiece(d, vocab_size=300)
        cfg = BertConfig(**{**BERT_SHAPE, "num_hidden_layers": 1, "vocab_size": len(tok),
                            "pad_token_id": tok.pad_token_id, **config})
        BertModel(cfg).save_pretrained(str(d))
        return str(d)

    def bert_config_without(self, field: str) -> list[str]:
        """import-hf of bert_dir with `field` left out of its config.json (transformers then loads
        its config class's default)."""
        d = Path(self.bert_dir())
        cfg = json.loads((d / "config.json").read_text())
        del cfg[field]
        (d / "config.json").write_text(json.dumps(cfg))
        return ["import-hf", "--model", str(d), "--output_dir", str(self.out)]

    def bert_config_with(self, **fields) -> list[str]:
        """import-hf of bert_dir with config.json's `fields` set."""
        d = Path(self.bert_dir())
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **fields}))
        return ["import-hf", "--model", str(d), "--output_dir", str(self.out)]

    def classifier_dir(self, edit=None) -> list[str]:
        """import-hf --task classify of bert_dir relabelled as a two-label BertForSequenceClassification
        (its weights a BertModel's: no classifier head), `edit(directory)` applied first."""
        d = Path(self.bert_dir())
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForSequenceClassification"],
                                                   "id2label": {"0": "neg", "1": "pos"},
                                                   "label2id": {"neg": 0, "pos": 1}}))
        if edit is not None:
            edit(d)
        return ["import-hf", "--model", str(d), "--task", "classify", "--output_dir", str(self.out)]

    def other_files(self) -> str:
        """A directory that holds a user's file and no run."""
        self.dir("mine")
        self.file("mine/notes.txt", "my notes")
        return str(self.tmp / "mine")

    def hidden_files(self) -> str:
        """A directory that holds only a user's hidden entries (a git checkout's .git), no run."""
        self.dir("repo")
        self.dir("repo/.git")
        self.file("repo/.git/HEAD", "ref: refs/heads/main")
        return str(self.tmp / "repo")

    def russian(self) -> str:
        """Russian text (Genesis): a script the tests' English tokenizers do not cover."""
        from mmadapt.corpora import write_bible_corpus

        return str(write_bible_corpus("ru", self.tmp / "ru.txt", books=range(1, 2)))

    def english_and_long_russian_lines(self, short: Path | None = None) -> str:
        """Short English lines (or `short`'s), then Russian (Genesis) in lines longer than
        SentencePiece reads (4192 bytes): a tokenizer trained on it never saw Cyrillic."""
        words = Path(self.russian()).read_text(encoding="utf-8").split()
        long = [" ".join(words[i:i + 600]) for i in range(0, len(words), 600)]
        lines = (short or self.corpus).read_text(encoding="utf-8").splitlines()[:300]
        return self.file("mix.txt", "\n".join(lines + long) + "\n")

    def graft(self, primary: str, artifact: str, *extra: str) -> list[str]:
        """export-hf of the last artifact of the graft_runs run `artifact` into the run `primary` (a
        graft_runs name, or a run's path)."""
        runs = self.request.getfixturevalue("graft_runs")
        self.request.getfixturevalue("capsys").readouterr()  # what building them printed, the first time
        self.inputs += [runs[artifact], *([runs[primary]] if primary in runs else [])]  # the runs it names
        art = sorted((runs[artifact] / "embeddings").iterdir())[-1]
        return ["export-hf", "--primary", str(runs.get(primary, primary)), "--embeddings", str(art), *extra,
                "--output_dir", str(self.out)]

    def sibling_of_another_vocabulary(self) -> str:
        """graft_runs' Llama-2 sibling copied with two of its tokenizer's pieces swapped: the same
        weights and shapes, another source vocabulary."""
        import json

        src = self.request.getfixturevalue("graft_runs")["llama2-sibling"]
        self.inputs.append(src)
        run = self.tmp / "other-vocabulary"
        shutil.copytree(src, run)
        tok = run / "tokenizer" / "spm.model"
        doc = json.loads(tok.read_text(encoding="utf-8"))
        vocab = doc["tokenizer"]["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[-2:]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        tok.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        return str(run)

    def sibling_resized(self) -> str:
        """graft_runs' Llama-2 sibling with its embeddings resized (64 rows more, as a fine-tune
        that added tokens or padded its vocabulary), imported."""
        from transformers import AutoModelForCausalLM

        from mmadapt.hf import import_hf

        src = self.request.getfixturevalue("graft_runs")["llama2-sibling"].parent / "hf" / "llama2-sibling"
        self.inputs.append(src)
        model = AutoModelForCausalLM.from_pretrained(str(src))
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + 64)
        model.save_pretrained(str(self.tmp / "hf-resized"))
        for f in src.iterdir():
            if "token" in f.name or f.name.endswith(".model"):
                shutil.copy(f, self.tmp / "hf-resized")
        import_hf(self.tmp / "hf-resized", self.tmp / "resized")
        self.request.getfixturevalue("capsys").readouterr()
        return str(self.tmp / "resized")

    def predict_graft(self, run: str, artifact: str | None, *extra: str) -> list[str]:
        """predict over the graft_runs run `run`, with the last artifact of the run `artifact`."""
        runs = self.request.getfixturevalue("graft_runs")
        self.request.getfixturevalue("capsys").readouterr()
        self.inputs += [runs[run], *([runs[artifact]] if artifact is not None else [])]
        (self.tmp / "in.txt").write_text("Im Anfang schuf Gott\n")
        art = [] if artifact is None else ["--embeddings", str(sorted((runs[artifact] / "embeddings").iterdir())[-1])]
        return ["predict", "--run", str(runs[run]), *art, *extra, "--input", str(self.tmp / "in.txt"), "--output",
                str(self.tmp / "out.jsonl")]

    def headless_run(self) -> str:
        """A headless BERT run: a BertModel imported (no MLM head)."""
        from mmadapt.hf import import_hf

        import_hf(Path(self.bert_dir()), self.tmp / "headless")
        return str(self.tmp / "headless")

    def body_with_a_head(self) -> list[str]:
        """import-hf of a BertModel directory whose weights also hold an MLM head (cls.predictions.*)."""
        import torch
        from hf_models import damaged_copy

        def add_head(state):
            h, v = state["embeddings.word_embeddings.weight"].shape[::-1]
            state.update({"cls.predictions.bias": torch.zeros(v), "cls.predictions.transform.dense.weight":
                          torch.zeros(h, h)})

        d = damaged_copy(Path(self.bert_dir()), self.tmp / "bert_with_head", None, add_head)
        return ["import-hf", "--model", str(d), "--output_dir", str(self.out)]

    def srun_tasks(self, n: int) -> None:
        """This process as one of `n` tasks that srun started straight, with no launcher between
        (SLURM_STEP_NUM_TASKS; no WORLD_SIZE)."""
        monkeypatch = self.request.getfixturevalue("monkeypatch")
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(n))

    def extend(self, *extra: str) -> list[str]:
        """mmadapt extend of a directory whose checks pass (config.json), German from the packaged
        Bible, into the run directory; `extra` after, so that a flag given there wins."""
        model = self.tmp / "hf_model"
        if not model.is_dir():
            model.mkdir()
            (model / "config.json").write_text("{}")
        return ["extend", "--model", str(model), "--lang", "de", "--corpus", "bible:de", "--output_dir", str(self.out),
                *extra]

    def expanded_with_another_tokenizer(self) -> list[str]:
        """preprocess --expand_from of German, over a dataset it prepared whose manifest records
        another tokenizer (as another target tokenizer would have made it)."""
        argv = ["preprocess", "--corpus", str(self.request.getfixturevalue("de_corpus")), "--expand_from",
                str(self.primary), "--vocab_size", "500", "--output_dir", str(self.out)]
        assert main(argv) == 0
        manifest = json.loads((self.out / "manifest.json").read_text())
        (self.out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "0" * 64}))
        return argv

    def sentence_transformers_dir(self, modules: list[dict]) -> str:
        d = Path(self.bert_dir())
        (d / "modules.json").write_text(json.dumps(modules))
        return str(d)

    def sentence_transformers_decoder(self) -> str:
        """A sentence-transformers directory whose transformer is a language model (a copy of the
        tiny Llama-2, conftest.tiny_hf), its files at the top."""
        d = self.tmp / "st_llama"
        shutil.copytree(self.request.getfixturevalue("tiny_hf")["llama"], d)
        (d / "modules.json").write_text(json.dumps([ST_TRANSFORMER]))
        return str(d)

    def own_task(self, name: str, text: str, *extra: str, task: str = "classify") -> list[str]:
        return self.finetune(*extra)[:2] + [task] + self.finetune()[3:] + ["--train_file", self.file(name, text),
                                                                          *extra]


ZERO3 = json.dumps({"zero_optimization": {"stage": 3}})
ST_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
NOT_UTF8 = "In the beginning.\n".encode() * 50 + b"caf\xe9 au lait\n"
RECORD = {"system": "bl_base", "task": "t", "lang": "de", "step": 1, "flops": 1.0, "score": 50.0}

CASES = [
    # --- pretrain: data and tokenizer
    ("corpus-not-utf8", lambda c: c.pretrain(corpus=c.file("latin1.txt", NOT_UTF8)), "is not UTF-8: byte offset 903"),
    ("corpus-is-a-directory", lambda c: c.pretrain(corpus=c.dir("texts")),
     "is a directory: pass --corpus a UTF-8 text file"),
    ("corpus-missing", lambda c: c.pretrain(corpus=str(c.tmp / "none.txt")), "none.txt does not exist"),
    # a pipe (mkfifo, <(zcat c.gz)) or a device exists: it was said not to
    ("corpus-not-a-regular-file", lambda c: c.pretrain(corpus="/dev/null"),
     "corpus /dev/null is not a regular file (a pipe or a device): write the text to a file first"),
    ("corpus-empty", lambda c: c.pretrain(corpus=c.file("empty.txt", "\n \n")),
     "is empty: it needs at least one non-blank line of text"),
    ("corpus-old-mac-line-ends", lambda c: c.pretrain(corpus=c.file("cr.txt", "In the beginning.\rAnd God said.\r" * 50)),
     "ends 100 of its lines with '\\r' alone (old Mac line endings), and every stage reads a line up to a "
     "newline: convert them (tr "),
    ("corpus-gzip", lambda c: c.pretrain(corpus=c.file("c.txt.gz", __import__("gzip").compress(b"In the beginning.\n"))),
     "is a compressed file: unpack it (gunzip) and pass the text"),
    # no byte-order mark: it decodes as UTF-8 (NUL after every ASCII letter), trained to one-letter pieces
    ("corpus-utf16-no-bom",
     lambda c: c.pretrain(corpus=c.file("u16.txt", "In the beginning.\n".encode("utf-16-le") * 50)),
     "u16.txt looks like UTF-16 (50% of its first bytes are NUL): convert it (iconv -f UTF-16LE -t UTF-8)"),
    ("corpus-utf16be-no-bom", lambda c: c.pretrain(corpus=c.file("b16.txt", "Im Anfang.\n".encode("utf-16-be") * 50)),
     "b16.txt looks like UTF-16 (50% of its first bytes are NUL): convert it (iconv -f UTF-16BE -t UTF-8)"),
    ("corpus-unicode-blanks-only", lambda c: c.pretrain(corpus=c.file("blank.txt", "\u3000\n\u2028\n\x85\n")),
     "is empty: it needs at least one non-blank line of text"),
    # zero-width spaces are no blanks to str.isspace, but SentencePiece's normalization drops them: its
    # internal check '(all_chars_count) > (0)' was the line
    ("corpus-invisible-characters-only",
     lambda c: c.pretrain(corpus=c.file("zw.txt", "\u200b\n\u200b \u00a0\n\n\u200b\n")),
     "zw.txt holds no character a tokenizer keeps (only blanks and invisible ones, such as zero-width spaces, which "
     "SentencePiece's normalization drops): pass a file of text"),
    ("corpus-zero-width-spaces-only", lambda c: c.pretrain(corpus=c.file("zw.txt", "\u200b\n" * 5)),
     "zw.txt holds no character a tokenizer keeps"),  # (the tokenizer's training saw no character at all)
    ("corpus-lines-too-long", lambda c: ["pretrain", "--corpus", c.file("long.txt", ("word " * 1000 + "\n") * 20),
                                         "--vocab_size", "100", "--output_dir", str(c.out)],
     "longer than 4192 bytes"),
    ("tokenizer-not-sentencepiece", lambda c: c.pretrain(tokenizer=c.file("t.model", b"\x00not a model" * 9)),
     "is not a SentencePiece model"),
    ("tokenizer-is-a-directory", lambda c: c.pretrain(tokenizer=c.dir("tokdir")),
     "is a directory: pass a SentencePiece .model file"),
    ("tokenizer-wrong-size", lambda c: c.pretrain("--vocab_size", "2000"), f"has {VOCAB} pieces"),
    # --- pretrain: fusion
    ("cudagraphs-off-cuda", lambda c: c.pretrain("--fusion", "cudagraphs"),
     "--fusion cudagraphs needs a CUDA device (this process trains on cpu): use --fusion compile"),
    ("cudagraphs-with-tensor-parallelism", lambda c: c.pretrain("--fusion", "cudagraphs",
                                                                "--tensor_model_parallel_size", "2"),
     "--fusion cudagraphs captures whole layers, at tensor and pipeline parallel size 1 (here 2 and 1)"),
    ("cudagraphs-with-varlen", lambda c: c.pretrain("--fusion", "cudagraphs", "--attention_impl", "varlen"),
     "--fusion cudagraphs replays fixed shapes, and --attention_impl varlen changes them"),
    ("data-path-and-corpus", lambda c: c.pretrain("--data_path", c.dir("prepared")), "pass one of --data_path"),
    ("data-path-with-a-tokenizer-that-does-not-exist", lambda c: [
        "pretrain", "--recipe", "bl_base", "--preset", "tiny", "--data_path", str(c.primary / "data"), "--tokenizer",
        str(c.tmp / "typo.model"), "--output_dir", str(c.out)], "typo.model does not exist: pass a SentencePiece"),
    ("data-path-not-prepared", lambda c: ["pretrain", "--data_path", c.dir("prepared"), "--output_dir", str(c.out)],
     "holds no finished dataset (no manifest.json"),
    # a damaged manifest: a bare "Expecting property name" line, or a KeyError / AttributeError traceback
    ("data-path-manifest-not-json", lambda c: ["pretrain", "--data_path", c.damaged_manifest('{"corpus": '),
                                               "--output_dir", str(c.out)], "manifest.json is not valid JSON ("),
    ("data-path-manifest-a-list", lambda c: ["pretrain", "--data_path", c.damaged_manifest("[]"), "--output_dir",
                                             str(c.out)],
     "manifest.json is not a prepared dataset's manifest (it lacks a JSON object, not a list)"),
    ("plugin-data-manifest-without-corpus", lambda c: [
        "evaluate", "--primary", str(c.primary), "--plugin_data", c.damaged_manifest(json.dumps(
            {k: v for k, v in json.loads((c.primary / "data" / "manifest.json").read_text()).items()
             if k != "corpus"})), "--embeddings", c.artifact(VOCAB), "--output", str(c.tmp / "r.json")],
     "manifest.json is not a prepared dataset's manifest (it lacks corpus): prepare the dataset again"),
    # --- pretrain: configuration
    ("embedding-init-in-pretrain", lambda c: c.pretrain("--embedding_init", "subword_mean"),
     "unrecognized arguments: --embedding_init"),
    ("embedding-init-unknown", lambda c: c.adapt("--embedding_init", "fvt"), "embedding_init must be one of overlap"),
    ("primary-calibration-unknown", lambda c: c.adapt("--primary_calibration", "temperature"),
     "primary_calibration must be one of none, bias, scale"),
    ("primary-calibration-over-the-full-model", lambda c: c.adapt()[:2] + ["bl_base"] + c.adapt(
        "--primary_calibration", "scale")[3:], "--primary_calibration scale fits a mini-model's artifacts to the "
     "primary model (minijoint or minipost, replace mode, the output bias trained), and this run has none to fit: it "
     "trains over the full model; drop the flag"),
    ("primary-calibration-with-a-frozen-bias", lambda c: c.adapt("--train_output_bias", "false",
                                                                 "--primary_calibration", "none"),
     "has none to fit: its output bias is frozen (--train_output_bias false); drop the flag"),
    ("primary-calibration-in-pretrain", lambda c: c.pretrain("--primary_calibration", "scale"),
     "unrecognized arguments: --primary_calibration"),
    ("ds-config-list", lambda c: c.pretrain("--ds_config", c.file("ds.json", "[1, 2]")), "holds a JSON list"),
    ("ds-config-not-json", lambda c: c.pretrain("--ds_config", c.file("ds.json", "{stage: 1")), "is not valid JSON"),
    ("ds-config-zero3", lambda c: c.pretrain("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    ("ds-config-directory", lambda c: c.pretrain("--ds_config", c.dir("dsdir")), "dsdir is a directory"),
    ("ds-config-batch-size", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"train_batch_size": 8}')),
     "sets train_batch_size"),
    ("ds-config-clipping", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"gradient_clipping": 1.0}')),
     "sets gradient_clipping: the clipping comes from mmadapt's --gradient_clipping"),
    ("ds-config-optimizer", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"optimizer": {"type": "SGD"}}')),
     "sets optimizer: mmadapt builds the optimizer and its schedule from its own flags"),
    ("ds-config-scheduler", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"scheduler": {"type": "WarmupLR"}}')),
     "sets scheduler: mmadapt builds the optimizer"),
    ("ds-config-bf16-true", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"bf16": true}')),
     'its bf16 is true, where DeepSpeed reads an object ({"enabled": true})'),
    ("ds-config-zero-number", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"zero_optimization": 1}')),
     'its zero_optimization is 1, where DeepSpeed reads an object ({"stage": 1})'),
    ("ds-config-stage-string", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"zero_optimization": '
                                                                          '{"stage": "2"}}')),
     'its zero_optimization.stage is "2", not a number'),
    ("ds-config-enabled-string", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"fp16": {"enabled": "yes"}}')),
     'its fp16.enabled is "yes", not true or false'),
    ("ds-config-two-precisions", lambda c: c.pretrain("--ds_config", c.file(
        "ds.json", '{"bf16": {"enabled": true}, "fp16": {"enabled": true}}')), "enables both bf16 and fp16"),
    # (the suite runs on a CPU) DeepSpeed's own refusal came after the model was built, with no fix
    ("ds-config-fp16-off-a-gpu", lambda c: c.pretrain("--ds_config", str(REPO / "ds_configs" / "zero2_fp16.json")),
     "zero2_fp16.json enables fp16, which DeepSpeed trains on a GPU only (this process trains on cpu): use "
     "ds_configs/zero2_bf16.json or zero2.json"),
    ("ds-config-not-utf8", lambda c: c.pretrain("--ds_config", c.file("ds.json", b'{"bf16": "\xe9"}')),
     "is not UTF-8 text"),
    # (DeepSpeed trained "bfloat16" as bf16 on its unfused path, where mmadapt read fp32 and saved no
    # fp32 master weights: later steps started from bf16-rounded weights)
    ("ds-config-bfloat16", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"bfloat16": {"enabled": true}}')),
     'sets "bfloat16", DeepSpeed\'s older name for "bf16", which mmadapt reads'),
    # (DeepSpeed's own refusal came inside deepspeed.initialize, after the run had written its directory)
    ("ds-config-deepspeed-refuses",
     lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"amp": {"enabled": true}}')),
     "DeepSpeed refuses it (NVIDIA Apex AMP integration has been removed"),
    # (a field of another type or name: pydantic's error, let through, came from deepspeed.initialize
    # after the model was built, in five lines)
    ("ds-config-field-of-another-type", lambda c: c.pretrain("--ds_config", c.file("ds.json", json.dumps(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": None}}}))),
     "DeepSpeed refuses it (DeepSpeedZeroConfig: offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme')"),
    ("ds-config-misspelt-field", lambda c: c.pretrain("--ds_config", c.file("ds.json", json.dumps(
        {"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}}))),
     "DeepSpeed refuses it (DeepSpeedZeroConfig: offload_optimiser: Extra inputs are not permitted)"),
    # (DeepSpeed's default, copied from its examples: ZeRO-Offload then refused mmadapt's AdamW inside
    # deepspeed.initialize, a traceback and exit 1, the run's tokenizer left behind)
    ("ds-config-forces-deepspeeds-cpu-adam", lambda c: c.pretrain("--ds_config", c.file("ds.json", json.dumps(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
         "zero_force_ds_cpu_optimizer": True}))),
     "sets zero_force_ds_cpu_optimizer true beside offload_optimizer, which refuses any optimizer but DeepSpeed's "
     "CPU Adam"),
    ("unknown-flag", lambda c: c.pretrain("--learning_rate", "1e-3"), "unrecognized arguments: --learning_rate"),
    ("flag-wrong-type", lambda c: c.pretrain("--train_iters", "many"), "invalid int value: 'many'"),
    ("unknown-recipe", lambda c: c.pretrain("--recipe", "bl_huge"), "invalid choice: 'bl_huge'"),
    ("mask-prob", lambda c: c.pretrain("--mask_prob", "1.5"), "mask_prob must be in (0, 1)"),
    ("seq-length-short", lambda c: c.pretrain("--seq_length", "4"), "--seq_length must be >= 8, got 4"),
    ("train-iters-zero", lambda c: c.pretrain("--train_iters", "0"), "--train_iters must be >= 1, got 0"),
    ("keep-last-negative", lambda c: c.pretrain("--keep_last", "-1"), "--keep_last must be >= 0, got -1"),
    ("mini-layers-too-deep", lambda c: c.pretrain("--mini_layers", "12"), "mini_layers 12 must be in 1..11"),
    ("mini-layers-for-bl-base", lambda c: c.pretrain("--mini_layers", "99", "--recipe", "bl_base"),
     "bl_base trains one head after its last layer (--num_layers): drop --mini_layers"),
    ("tp-not-dividing-heads", lambda c: c.pretrain("--tensor_model_parallel_size", "3"),
     "num_attention_heads 4 is not divisible by tensor_model_parallel_size 3"),
    # --- pretrain: the run directory
    ("output-is-a-file", lambda c: c.pretrain()[:-1] + [c.file("run", "not a directory")], "is a file, not a directory"),
    ("output-under-a-file", lambda c: c.pretrain()[:-1] + [str(Path(c.file("f", "x")) / "run")], "cannot be created"),
    ("resume-changed-lr", lambda c: c.resumed(lr=1e-3), "train.lr is 0.002 here but 0.001"),
    ("resume-changed-seed", lambda c: c.resumed(seed=7), "train.seed is 1234 here but 7"),
    ("resume-changed-schedule", lambda c: c.resumed(train_iters=99), "train.train_iters is"),
    ("resume-changed-batch", lambda c: c.resumed(train_micro_batch_size_per_gpu=3),
     "train.train_micro_batch_size_per_gpu is"),
    ("resume-run-json-broken", lambda c: (c.resumed(), (c.out / "run.json").write_text("{"))[0], "is not valid JSON"),
    ("resume-corpus-edited", lambda c: (c.resumed(), c.encoded_from_another_corpus())[0],
     "changed since this run encoded it into"),
    ("resume-another-tokenizer", lambda c: (c.resumed(), c.dir("run/tokenizer"), c.file("run/tokenizer/spm.model",
                                                                                      b"its own"))[0],
     "--resume with another tokenizer: "),
    # --- Step 1b
    ("minipost-not-a-run", lambda c: c.minipost(primary=c.dir("nowhere")), "is not an mmadapt run directory"),
    ("minipost-pipeline", lambda c: c.minipost("--pipeline_model_parallel_size", "2"),
     "build_minipost does not use pipeline parallelism"),
    ("minipost-missing-tag", lambda c: c.minipost("--primary_tag", "step00000007"),
     "has no complete checkpoint step00000007"),
    ("minipost-new-layers", lambda c: c.minipost("--new_layers", "0"), "new_layers must be >= 1"),
    # the primary moved, its data/ with it: the line advised preparing data at the old place
    ("minipost-primary-moved", lambda c: c.minipost(primary=c.moved_primary()),
     "/primary/data, which does not exist (moved since?): pass the source-language data with --data_path or --corpus"),
    # it ended "or, where you chose the run's with --tokenizer, drop it": build_minipost takes no --tokenizer
    ("minipost-data-of-another-tokenizer", lambda c: c.minipost("--data_path", c.own_tokenizer_dataset()),
     "/tokenizer/spm.model; where the command took a --tokenizer, dropping it lets the run take the dataset's)"),
    # positions the primary never trained, which Step 1b (and Step 2) keep as they are: refused
    ("minipost-seq-past-blocks", lambda c: c.minipost("--seq_length", "96"),
     "--seq_length 96 is longer than the 64-piece blocks"),
    # --- Step 2
    ("adapt-corpus-not-utf8", lambda c: c.adapt(corpus=c.file("latin1.txt", NOT_UTF8)), "is not UTF-8"),
    ("adapt-seq-past-blocks", lambda c: c.adapt("--seq_length", "96"),
     "pretrained on: positions 65-96 were never trained, and Step 2 trains none; pass --seq_length 64 or less"),
    ("adapt-tokenizer-garbage", lambda c: c.adapt(tokenizer=c.file("t.model", b"garbage")),
     "is not a SentencePiece model"),
    ("adapt-tokenizer-garbage-sizes-the-model", lambda c: [a for a in c.adapt(tokenizer=c.file("t.model", b"garbage"))
                                                           if a not in ("--vocab_size", str(VOCAB))],
     "is not a SentencePiece model"),
    ("adapt-over-artifacts-without-checkpoints", lambda c: (c.dir("run"), c.dir("run/embeddings"),
                                                            c.dir("run/embeddings/step00000004"),
                                                            c.file("run/embeddings/step00000004/embeddings.pt", b"x"))
     and c.adapt("--resume"), "holds the Step-2 artifacts of a run (embeddings/step00000004) and no checkpoint to "
     "continue it from: choose a new --output_dir"),
    ("adapt-bible-of-another-language", lambda c: c.adapt(corpus="bible:fr"),
     "--corpus bible:fr is the fr Bible, but --lang is de: pass --corpus bible:de, or --lang fr"),
    ("extend-bible-of-another-language", lambda c: c.extend("--corpus", "bible:fr"),
     "--corpus bible:fr is the fr Bible, but --lang is de"),
    # a --lang with no packaged Bible: its own Bible is not advised (bible:xx was then refused)
    ("extend-bible-for-a-lang-not-packaged", lambda c: c.extend("--lang", "xx", "--corpus", "bible:de"),
     "--corpus bible:de is the de Bible, but --lang is xx: pass --corpus a text file in xx, or --lang de"),
    # a Bible not packaged: said so (the advice to pass --lang xx led to this refusal), also for an empty name
    ("extend-bible-not-packaged", lambda c: c.extend("--corpus", "bible:xx"), "--corpus bible:xx: no packaged Bible "
     "for 'xx'; choose one of"),
    ("adapt-bible-not-packaged", lambda c: c.adapt(corpus="bible:"), "--corpus bible:: no packaged Bible for ''"),
    ("adapt-unknown-system", lambda c: c.adapt()[:2] + ["bl_huge"] + c.adapt()[3:], "invalid choice: 'bl_huge'"),
    ("adapt-source-tag", lambda c: c.adapt("--source_tag", "step00000009"), "has no complete checkpoint step00000009"),
    ("adapt-zero3", lambda c: c.adapt("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    # --- Step 2 --vocab_mode expand
    ("vocab-mode-unknown", lambda c: c.adapt("--vocab_mode", "merge"), "vocab_mode must be one of replace, expand"),
    ("vocab-mode-in-pretrain", lambda c: c.pretrain("--vocab_mode", "expand"), "unrecognized arguments: --vocab_mode"),
    ("expand-with-vocab-size", lambda c: c.adapt("--vocab_mode", "expand"), "drop --vocab_size"),
    ("expand-vocab-size-with-tokenizer", lambda c: c.expand("--corpus", str(c.corpus), "--tokenizer", str(c.tokenizer),
                                                            "--vocab_size", "900"), "drop --vocab_size"),
    ("expand-tokenizer-garbage", lambda c: c.expand("--corpus", str(c.corpus), "--tokenizer",
                                                    c.file("t.model", b"garbage")), "is not a SentencePiece model"),
    ("expand-output-start-unknown", lambda c: c.adapt("--expand_output_start", "zero"),
     "expand_output_start must be one of bounded, worst_case, embedding_init"),
    ("expand-output-start-in-pretrain", lambda c: c.pretrain("--expand_output_start", "embedding_init"),
     "unrecognized arguments: --expand_output_start"),
    ("expand-source-nats-zero", lambda c: c.adapt("--expand_source_nats", "0"), "expand_source_nats must be > 0"),
    ("expand-source-nats-in-pretrain", lambda c: c.pretrain("--expand_source_nats", "0.02"),
     "unrecognized arguments: --expand_source_nats"),
    # --- Step 2 source-language replay
    ("replay-fraction-without-data", lambda c: c.adapt("--replay_fraction", "0.25"), "--replay_fraction needs --replay_data"),
    ("replay-fraction-one", lambda c: c.adapt("--replay_fraction", "1", "--replay_data", str(c.primary / "data")),
     "replay_fraction must be in [0, 1)"),
    ("replay-in-pretrain", lambda c: c.pretrain("--replay_fraction", "0.1", "--replay_data", str(c.primary / "data")),
     "unrecognized arguments: --replay_fraction 0.1 --replay_data"),
    ("replay-not-a-dataset", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", c.dir("nothing")),
     "holds no finished dataset"),
    ("replay-raw-text", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", str(c.corpus)),
     "is a file, not a dataset prepared by mmadapt preprocess: prepare it first"),
    ("adapt-from-a-finetune-run", lambda c: c.adapt()[:4] + [c.kind_copy_without_tokenizer("finetune")] + c.adapt()[5:],
     "is a finetune run (Step 3: a task model), which reads the tokenizer of the run it was trained from"),
    ("replay-other-tokenizer", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", c.other_dataset()),
     "was not encoded with"),
    ("replay-cut-short", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", c.cut_dataset()),
     "cut/text.bin holds 100 bytes where the"),
    ("replay-rounds-to-no-block", lambda c: c.adapt("--replay_fraction", "0.01", "--replay_data",
                                                    str(c.primary / "data")), "rounds to no block"),
    ("replay-fills-the-batch", lambda c: c.adapt("--replay_fraction", "0.99", "--replay_data",
                                                 str(c.primary / "data")), "leaving no target text"),
    ("replay-replace-without-target-tokenizer",
     lambda c: [a for a in c.adapt("--replay_fraction", "0.25", "--replay_data", str(c.primary / "data"))
                if a != str(c.tokenizer) and a != "--tokenizer"], "which this run would only train"),
    ("expand-adds-no-piece", lambda c: c.expand("--corpus", str(c.corpus), "--tokenizer", str(c.tokenizer)),
     "adds no piece to the source's"),
    ("expand-data-not-an-expansion", lambda c: c.expand("--data_path", str(c.primary / "data")),
     "is not an expansion of the source's"),
    # --- Step 3
    # it named "a pretrain or build_minipost run", and finetune refuses the latter
    ("finetune-not-a-run", lambda c: c.finetune(primary=c.dir("nowhere")), "is not an mmadapt run directory (no "
     "run.json): pass the --output_dir of the run meant (the kinds a flag takes: the command's --help)"),
    ("finetune-unknown-task", lambda c: c.finetune()[:2] + ["sentiment"] + c.finetune()[3:], "invalid choice"),
    ("finetune-own-task-no-file", lambda c: c.finetune()[:2] + ["classify"] + c.finetune()[3:],
     "--train_file is required"),
    ("finetune-train-file-a-directory", lambda c: ["finetune", "--task", "xnli", "--primary", str(c.primary),
                                                   "--train_file", c.dir("mnli"), "--output_dir", str(c.out)],
     "mnli is a directory: name the data file itself"),
    ("finetune-own-train-file-a-directory", lambda c: ["finetune", "--task", "classify", "--primary", str(c.primary),
                                                       "--train_file", c.dir("x.csv"), "--output_dir", str(c.out)],
     "x.csv is a directory: name the data file itself"),
    ("finetune-lr", lambda c: c.finetune("--lr", "-1"), "lr must be > 0"),
    ("finetune-warmup", lambda c: c.finetune("--warmup_ratio", "1.5"), "warmup_ratio must be in [0, 1)"),
    ("finetune-pipeline", lambda c: c.finetune("--pipeline_model_parallel_size", "2"),
     "fine-tuning does not use pipeline parallelism"),
    ("finetune-zero3", lambda c: c.finetune("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    # --- Step 4
    ("evaluate-output-exists", lambda c: c.evaluate()[:-1] + [c.file("old.json", "[]")], "already exists"),
    ("evaluate-not-an-artifact", lambda c: c.evaluate(), "neither a Step-2 artifact nor an adapt run"),
    ("evaluate-an-artifact-twice", lambda c: ["evaluate", "--finetuned", c.dir("ft"), "--embeddings",
                                              (a := c.artifact(VOCAB)), a + "/", "--eval_file", "bible", "--output",
                                              str(c.tmp / "r.json")],
     "given twice (also as"),
    # an adapt run and one of its artifacts: both named as the user gave them (the line named the artifact twice)
    ("evaluate-a-run-and-its-artifact-named", lambda c: (c.dir("run"), c.dir("run/embeddings"), a := c.artifact(VOCAB),
                                                         shutil.move(a, c.tmp / "run/embeddings/step00000004"))
     and c.evaluate(embeddings=str(c.tmp / "run"))[:5] + [str(c.tmp / "run/embeddings/step00000004")]
     + c.evaluate()[5:], "run/embeddings/step00000004 in the adapt run "),
    ("evaluate-a-seed-twice", lambda c: ["evaluate", "--finetuned", (f := c.dir("ft")), f, "--embeddings",
                                         c.artifact(VOCAB), "--eval_file", "bible", "--output", str(c.tmp / "r.json")],
     "given twice (also as"),
    ("evaluate-task-with-bpb-bytes", lambda c: c.evaluate("--bpb_bytes", "4096"),
     "--bpb_bytes sizes the plug-in score of --plugin_data; a task (--finetuned, --eval_file) reads"),
    ("evaluate-task-with-plugin-blocks-at-default", lambda c: c.evaluate("--plugin_blocks", "256"),
     "--plugin_blocks sizes the plug-in score"),
    ("evaluate-no-adaptation-with-plugin", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                                      c.dir("data"), "--embeddings", c.dir("emb"),
                                                      "--no_adaptation_baseline", "false", "--output",
                                                      str(c.tmp / "r.json")],
     "--no_adaptation_baseline scores fine-tuned runs on a task"),
    # each of the two mistakes named (both said "pass --primary, not --finetuned/--eval_file", whichever was made)
    ("evaluate-plugin-without-primary", lambda c: ["evaluate", "--plugin_data", c.dir("data"), "--embeddings",
                                                   c.dir("emb"), "--output", str(c.tmp / "r.json")],
     "--plugin_data scores the artifacts through their primary model: pass --primary with the run"),
    ("evaluate-plugin-with-a-task", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                               c.dir("data"), "--embeddings", c.dir("emb"), "--eval_file", "bible",
                                               "--output", str(c.tmp / "r.json")],
     "not fine-tuned runs on a task: drop --finetuned/--eval_file"),
    ("source-checkpoint-truncated", lambda c: c.minipost(primary=c.damaged_copy()),
     "'s checkpoint step00000050 is damaged ("),
    # --- report
    ("report-output-is-input", lambda c: ["report", c.records([RECORD]), "--output", str(c.tmp / "results.json")],
     "is one of the results files"),
    # the table written, then a plot over it (exit 0) or refused as a file in the way of the directory
    ("report-output-is-a-plot", lambda c: ["report", c.records([RECORD]), "--output", str(c.tmp / "p" / "curves.png"),
                                           "--plots", str(c.tmp / "p")], "is where --plots"),
    ("report-output-is-the-plots", lambda c: ["report", c.records([RECORD]), "--output", str(c.tmp / "p"),
                                              "--plots", str(c.tmp / "p")], "is where --plots"),
    ("report-not-a-list", lambda c: ["report", c.records({"a": 1})], "is not a JSON list of records"),
    ("report-record-lacks-task", lambda c: ["report", c.records([RECORD, {"system": "x"}])],
     "record 1 lacks 'task'"),
    ("report-record-score-none", lambda c: ["report", c.records([RECORD, {**RECORD, "score": None}])],
     "record 1 has score None; scores are finite numbers"),
    ("report-not-json", lambda c: ["report", c.file("r.json", "not json")], "cannot read results file"),
    # fields the report reads, of another type: each failed with a TypeError or KeyError traceback
    ("report-record-lang-null", lambda c: ["report", c.records([RECORD, {**RECORD, "lang": None}])],
     "record 1 has lang None; lang must be a text"),
    ("report-record-chance-text", lambda c: ["report", c.records([{**RECORD, "chance": "x"}])],
     "record 0 has chance 'x'; chance must be a finite number"),
    ("report-record-bpb-without-its-reference", lambda c: ["report", c.records([
        {**RECORD, "task": "plugin-mlm", "bpb": 1.5, "start_bpb": 2.0}])],
     "record 0 has none_bpb None; none_bpb must be given beside bpb"),
    ("report-record-bpb-without-its-bytes", lambda c: ["report", c.records([  # a KeyError traceback
        {**RECORD, "task": "plugin-mlm", "bpb": 1.5, "start_bpb": 2.0, "none_bpb": 2.5}])],
     "record 0 has bpb_bytes None; bpb_bytes must be given beside bpb: the held-out bytes it was scored on"),
    ("report-record-artifact-a-number", lambda c: ["report", c.records([{**RECORD, "artifact": 5}])],
     "record 0 has artifact 5; artifact must be a text"),
    ("report-record-of-a-number", lambda c: ["report", c.records([RECORD, {**RECORD, "system": "no_adaptation",
                                                                           "of": 3}])],
     "record 1 has of 3; of must be a list of system names"),
    ("report-record-unknown-share-text", lambda c: ["report", c.records([{**RECORD, "unknown_share": "0.3"}])],
     "record 0 has unknown_share '0.3'; unknown_share must be a finite number"),
    ("report-record-warnings-a-text", lambda c: ["report", c.records([{**RECORD, "finetune_warnings": "at chance"}])],
     "record 0 has finetune_warnings 'at chance'; finetune_warnings must be a list of texts"),
    # one checkpoint twice where no step (or one file no artifact) told it apart: the curve ended on the better
    ("report-checkpoint-twice-without-a-step", lambda c: ["report", c.records([
        {k: v for k, v in RECORD.items() if k != "step"}, {k: v for k, v in RECORD.items() if k != "step"} | {
            "score": 40.0}])], "holds bl_base's t score in de at 1 FLOPs (no step recorded): one checkpoint"),
    ("report-checkpoint-twice-one-with-its-artifact", lambda c: ["report", c.records([RECORD]), c.file(
        "more.json", json.dumps([{**RECORD, "score": 45.0, "artifact": "runs/a/embeddings/step00000001"}]))],
     "results.json and "),
    ("report-two-no-adaptation-scores", lambda c: ["report", c.records([RECORD, {
        **RECORD, "system": "no_adaptation", "step": 0, "score": 50.0}]), c.file("more.json", json.dumps([
            {**RECORD, "system": "minijoint"}, {**RECORD, "system": "no_adaptation", "step": 0, "score": 60.0}]))],
     "bl_base's t in de has two no-adaptation scores, 50 ("),
    # --- preprocess
    ("preprocess-not-utf8", lambda c: ["preprocess", "--corpus", c.file("latin1.txt", NOT_UTF8), "--output_dir",
                                       str(c.out)], "is not UTF-8"),
    ("preprocess-workers", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir", str(c.out),
                                      "--workers", "0"], "--workers must be >= 1"),
    ("no-such-command", lambda c: ["pretrian"], "unknown command 'pretrian': did you mean pretrain?"),
    # --- your own task's files (they trained on the wrong data, or ended in a traceback)
    ("own-csv-duplicate-column", lambda c: c.own_task("t.csv", "text,label,text\nfine,pos,X\ngrim,neg,X\n"),
     "the header line names column 'text' twice (columns 1 and 3): rename one"),
    ("own-csv-unquoted-comma", lambda c: c.own_task("t.csv", "text,label\nfine,pos\nI think, that it was good,pos\n"),
     "t.csv:3: 3 fields where the header line has 2: quote a field that holds a comma"),
    ("own-tsv-missing-field", lambda c: c.own_task("t.tsv", "text\tlabel\nfine\tpos\ngrim\n"),
     "t.tsv:3: 1 field where the header line has 2"),
    ("own-csv-one-column-by-number", lambda c: c.own_task("t.csv", "fine,pos\n", "--text_column", "0"),
     "--text_column 0 is a column number (a file without a header line): give --label_column as a number too"),
    ("own-csv-column-number-past-the-end", lambda c: c.own_task("t.csv", "fine,pos\n", "--text_column", "0",
                                                                  "--label_column", "2"),
     "t.csv has 2 columns, numbered from 0: --label_column 2 is past them"),
    ("own-jsonl-column-numbers", lambda c: c.own_task("t.jsonl", '{"text": "a", "label": "b"}\n', "--text_column", "0",
                                                      "--label_column", "1"), "JSON Lines rows name their columns"),
    ("adapt-expand-flag-in-replace-mode", lambda c: c.adapt("--expand_output_start", "worst_case"),
     "--expand_output_start sets how an expanded vocabulary starts, and this run replaces the vocabulary: drop it"),
    ("adapt-into-a-directory-of-other-files", lambda c: c.adapt("--output_dir", c.other_files()),
     "holds other files (notes.txt) and no mmadapt run: choose a new or empty directory"),
    ("fit-head-into-a-directory-of-other-files", lambda c: ["fit-head", "--primary", c.headless_run(), "--corpus",
                                                            str(c.corpus), "--output_dir", c.other_files()],
     "holds other files (notes.txt) and no mmadapt run"),
    ("preprocess-into-a-directory-of-other-files", lambda c: ["preprocess", "--corpus", str(c.corpus), "--tokenizer",
                                                              str(c.tokenizer), "--output_dir", c.other_files()],
     "holds other files (notes.txt) and no prepared dataset"),
    ("preprocess-into-a-directory-of-hidden-files", lambda c: ["preprocess", "--corpus", str(c.corpus), "--tokenizer",
                                                               str(c.tokenizer), "--output_dir", c.hidden_files()],
     "holds other files (.git) and no prepared dataset"),
    ("own-pair-one-column-twice", lambda c: c.own_task("t.csv", "a,label\nfine,pos\ngrim,neg\n", "--text_column", "a",
                                                       "--text_pair_column", "a", task="pair"),
     "--text_column and --text_pair_column both name column 'a': each reads its own column"),
    ("own-tags-one-column-twice", lambda c: c.own_task("t.jsonl", '{"tokens": ["a"], "tags": ["B"]}\n',
                                                       "--text_column", "tags", task="tag"),
     "--text_column and --label_column both name column 'tags': each reads its own column"),
    ("own-labels-one-number-two-ways", lambda c: c.own_task("t.csv", "text,label\nfine,0\ngrim,0.0\nbad,1\n"),
     "the labels '0' and '0.0' are one number written two ways"),
    ("own-task-one-class", lambda c: c.own_task("t.csv", "text,label\nfine,pos\ngrim,pos\n"),
     "has one label (pos) in every example: a task model learns from at least two classes"),
    ("own-tags-one-tag", lambda c: c.own_task("t.jsonl", '{"tokens": ["a", "b"], "tags": ["O", "O"]}\n'
                                                         '{"tokens": ["c"], "tags": ["O"]}\n', task="tag"),
     "has one tag (O) on every token: a tagger learns from at least two tags (check --label_column)"),
    ("own-task-not-utf8", lambda c: c.own_task("t.csv", b"text,label\ncaf\xe9,pos\n"),
     "t.csv is not UTF-8 text (byte offset 14): save it as UTF-8"),
    ("squad-without-id", lambda c: c.own_task("q.json", json.dumps({"data": [{"paragraphs": [{
        "context": "In the beginning.", "qas": [{"question": "When?", "answers": []}]}]}]}), task="xquad"),
     "article 1, paragraph 1, question 1 has no 'id' text"),
    ("ner-iobes-tags", lambda c: c.own_task("ner.txt", "Abraham S-PER\nbegat O\nIsaac S-PER\n\nAnd O\n", task="ner"),
     "ner.txt: the ner task scores entity chunks of O, B-X and I-X tags (IOB1 or IOB2), and its tags include 'S-PER': "
     "convert them"),
    ("ner-iobes-eval-tags", lambda c: c.own_task("ner.txt", "Abraham B-PER\nbegat O\nIsaac B-PER\n\nAnd O\n",
                                                 "--eval_file", c.file("ner-test.txt", "Isaac S-PER\nJacob E-PER\n"),
                                                 task="ner"),
     "ner-test.txt: the ner task scores entity chunks of O, B-X and I-X tags (IOB1 or IOB2), and its tags include "
     "'E-PER': convert them (IOBES S-X to B-X, E-X to I-X)"),
    ("squad-unanswerable-question", lambda c: c.own_task("q.json", json.dumps({"data": [{"paragraphs": [{
        "context": "In the beginning.", "qas": [{"id": "q1", "question": "Who?", "answers": [],
                                                  "is_impossible": True}]}]}]}), task="xquad"),
     "article 1, paragraph 1, question 'q1' has no answer (a SQuAD 2.0 unanswerable question)"),
    ("squad-blank-answer", lambda c: c.own_task("q.json", json.dumps({"data": [{"paragraphs": [{
        "context": "In the beginning.", "qas": [{"id": "q1", "question": "When?", "answers": [
            {"text": "the beginning", "answer_start": 3}, {"text": " ", "answer_start": 2}]}]}]}]}), task="xquad"),
     "article 1, paragraph 1, question 'q1' has an empty answer ' ' (at 2): every answer is a span of the context's "
     "text; correct it or drop the question"),
    ("squad-data-not-a-list", lambda c: c.own_task("q.json", '{"data": 5}', task="xquad"),
     "is not SQuAD-format JSON: expected {\"data\": [articles]}"),
    # --- Step 4 and predict: an artifact whose embeddings have fewer rows than its tokenizer's pieces
    ("embeddings-fewer-rows-than-pieces", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                                     c.dir("data"), "--embeddings", c.artifact(VOCAB - 100),
                                                     "--output", str(c.tmp / "r.json")],
     f"its embeddings have {VOCAB - 100} rows but its tokenizer spm.model has {VOCAB} pieces"),
    ("predict-embeddings-fewer-rows", lambda c: ["predict", "--run", str(c.primary), "--embeddings",
                                                 c.artifact(VOCAB - 1), "--input", c.file("in.txt", "a <mask>\n")],
     f"its embeddings have {VOCAB - 1} rows"),
    # --- import-hf: weight files cut short or damaged
    ("import-hf-truncated-safetensors", lambda c: ["import-hf", "--model", c.hf_dir("model.safetensors",
                                                                                   b"\x10\x00" + b"{" * 40),
                                                   "--output_dir", str(c.out)],
     "model.safetensors cannot be read as safetensors"),
    ("import-hf-corrupt-bin", lambda c: ["import-hf", "--model", c.hf_dir("pytorch_model.bin", b"garbage" * 9),
                                         "--output_dir", str(c.out)], "pytorch_model.bin cannot be read"),
    # --- settings that were accepted and meant something else
    ("preprocess-vocab-size-3", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir", str(c.out),
                                          "--vocab_size", "3"], "argument --vocab_size: must be >= 8, got 3"),
    ("preprocess-sample-lines-zero", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir", str(c.out),
                                                "--tokenizer_sample_lines", "0"],
     "--tokenizer_sample_lines must be >= 1, got 0"),
    ("preprocess-tokenizer-and-other-vocab-size", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir",
                                                             str(c.out), "--tokenizer", str(c.tokenizer),
                                                             "--vocab_size", "2000"],
     f"has {VOCAB} pieces but the model's vocab_size is 2000"),
    ("report-score-nan", lambda c: ["report", c.file("nan.json", json.dumps([{**RECORD, "score": float("nan")}]))],
     "record 0 has score nan; scores are finite numbers"),
    # --- output paths that are files, a run directory that cannot take checkpoints
    ("preprocess-output-is-a-file", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir",
                                               c.file("afile", "x")], "afile is a file, not a directory"),
    ("evaluate-output-under-a-file", lambda c: c.evaluate()[:-1] + [str(Path(c.file("afile", "x")) / "r.json")],
     "afile is a file, not a directory"),
    ("report-plots-is-a-file", lambda c: ["report", c.records([RECORD]), "--plots", c.file("afile", "x")],
     "afile is a file: name a directory for the plots"),
    ("predict-output-under-a-file", lambda c: ["predict", "--run", str(c.primary), "--input",
                                               c.file("in.txt", "a <mask>\n"), "--output",
                                               str(Path(c.file("afile", "x")) / "p.jsonl")], "afile is a file"),
    ("demo-output-is-a-file", lambda c: ["demo", "--output_dir", c.file("afile", "x")], "afile is a file"),
    ("demo-threads-negative", lambda c: ["demo", "--output_dir", str(c.out), "--threads", "-1"],
     "--threads must be >= 0"),
    ("demo-eval-batch-zero", lambda c: ["demo", "--output_dir", str(c.out), "--eval_batch_tokens", "0"],
     "--eval_batch_tokens must be >= 1"),
    ("resume-checkpoints-not-a-directory", lambda c: (c.resumed(), (c.out / "checkpoints").rmdir(),
                                                      (c.out / "checkpoints").write_text("x"))[0],
     "checkpoints is not a directory: the run writes its checkpoints there"),
    # --- Step 2's progress signal needs held-out target text, and is Step 2's alone
    ("plugin-eval-without-validation-data", lambda c: c.adapt("--plugin_eval_blocks", "64"),
     "--plugin_eval_blocks scores held-out target text: pass --data_path"),
    ("plugin-eval-in-pretrain", lambda c: c.pretrain("--plugin_eval_blocks", "64"),
     "unrecognized arguments: --plugin_eval_blocks"),
    # --- the decoder family
    ("decoder-corpus-shorter-than-one-block", lambda c: c.pretrain("--preset", "llama-tiny", "--seq_length", "64",
                                                                    corpus=c.file("one.txt", "In the beginning.\n")),
     "fewer than one block of --seq_length 64 reads (65): lower --seq_length, or give more text"),
    # into an empty --output_dir made beforehand: the data/ prepared there went only with a directory the
    # run made, and the corrected command was refused as another corpus's dataset
    ("decoder-corpus-shorter-than-one-block-into-an-empty-dir",
     lambda c: (c.out.mkdir(), c.pretrain("--preset", "llama-tiny", "--seq_length", "64",
                                          corpus=c.file("one.txt", "In the beginning.\n")))[1],
     "fewer than one block of --seq_length 64 reads (65): lower --seq_length, or give more text"),
    ("decoder-validation-split-shorter-than-one-block",
     lambda c: ["pretrain", "--recipe", "bl_base", "--preset", "llama-tiny", "--seq_length", "64", "--data_path",
                c.short_held_out(), "--tokenizer", str(c.tokenizer), "--vocab_size", str(VOCAB), "--eval_interval", "1",
                "--output_dir", str(c.out)],
     "'s validation split holds 16 tokens, fewer than one block of --seq_length 64 reads (65): prepare the text "
     "with a larger --valid_fraction, or pass --eval_interval 0"),
    ("decoder-given-mask-prob", lambda c: c.pretrain("--preset", "llama-tiny", "--mask_prob", "0.3"),
     "mask_prob 0.3 is a masked-LM setting; the llama family scores next pieces"),
    ("decoder-groups-not-dividing-heads", lambda c: c.pretrain("--preset", "llama-tiny", "--num_query_groups", "3"),
     "num_query_groups 3 does not divide num_attention_heads 4"),
    ("decoder-groups-not-dividing-tp", lambda c: c.pretrain("--preset", "llama-tiny",
                                                            "--tensor_model_parallel_size", "4"),
     "num_query_groups 2 is not divisible by tensor_model_parallel_size 4"),
    ("decoder-rotary-base", lambda c: c.pretrain("--preset", "llama-tiny", "--rotary_base", "0"),
     "rotary_base must be > 0"),
    ("encoder-given-decoder-option", lambda c: c.pretrain("--num_query_groups", "2"),
     "num_query_groups 2 is a decoder setting"),
    ("encoder-source-decoder-step", lambda c: c.adapt("--preset", "llama-tiny"),
     "--preset llama-tiny is a llama preset, but"),
    # --- the model family: its preset picks it, its fields are its own
    ("family-is-the-presets", lambda c: c.pretrain("--family", "llama"), "unrecognized arguments: --family llama"),
    ("encoder-given-kv-channels", lambda c: c.pretrain("--kv_channels", "32"),
     "kv_channels 32 is a decoder setting; the roberta family does not use it: drop it"),
    ("decoder-kv-channels-zero", lambda c: c.pretrain("--preset", "llama-tiny", "--kv_channels", "0"),
     "kv_channels must be >= 1"),
    ("head-layers-and-mini-layers", lambda c: c.pretrain("--head_layers", "4", "12", "--mini_layers", "4"),
     "--head_layers places every head itself, --mini_layers places MINIJOINT's secondary heads: pass one of them"),
    ("unknown-preset-flops", lambda c: ["flops", "--preset", "huge"], "invalid choice: 'huge'"),
    ("flops-paper-with-a-shape", lambda c: ["flops", "--paper", "--device", "h100", "--num_layers", "3"],
     "--paper prints the paper's fixed settings: drop --device, --num_layers, or drop --paper"),
    # --- import-hf: damaged copies of a tiny Llama and Qwen2 (issue 41); each loads differently from what
    # config.json says, or not at all, in transformers
    ("import-hf-output-under-a-file", lambda c: c.import_damaged("llama")[:-1] + [str(Path(c.file("afile", "x")) /
                                                                                     "run")],
     "run cannot be created: "),
    ("export-hf-output-under-a-file", lambda c: c.graft("llama2-expand", "llama2-expand", "--output_dir",
                                                        str(Path(c.file("afile", "x")) / "run"))[:-2],
     "run cannot be created: "),
    ("extend-output-under-a-file", lambda c: c.extend("--output_dir", str(Path(c.file("afile", "x")) / "run")),
     "run cannot be created: "),
    ("import-hf-fewer-layers-in-config", lambda c: c.import_damaged("llama", {"num_hidden_layers": 2}),
     "its weights hold model.layers.2.input_layernorm.weight (and 8 more tensors), which the model config.json "
     "describes has no place for: config.json's num_hidden_layers is 2, but the weights hold layer 2"),
    ("import-hf-more-layers-in-config", lambda c: c.import_damaged("llama", {"num_hidden_layers": 4}),
     "the weights lack model.layers.3.self_attn.q_proj.weight, which config.json implies (num_hidden_layers 4)"),
    ("import-hf-nan-weight", lambda c: c.import_damaged("llama", edit=lambda s: s["model.layers.1.mlp.up_proj.weight"]
                                                      .__setitem__((3, 4), float("nan"))),
     "its weight model.layers.1.mlp.up_proj.weight holds 1 NaN value (of 1536): the checkpoint is damaged"),
    ("import-hf-hidden-size-disagrees", lambda c: c.import_damaged("qwen2", {"hidden_size": 16}),
     "model.embed_tokens.weight has shape (608, 32), but config.json implies (608, 16) (dimension 2: hidden_size 16)"),
    ("import-hf-kv-heads-disagree", lambda c: c.import_damaged("llama", {"num_key_value_heads": 4}),
     "model.layers.0.self_attn.k_proj.weight has shape (16, 32), but config.json implies (32, 32) (dimension 1: "
     "num_key_value_heads 4 x head dim 8)"),
    ("import-hf-vocab-size-disagrees", lambda c: c.import_damaged("qwen2", {"vocab_size": 700}),
     "model.embed_tokens.weight has shape (608, 32), but config.json implies (700, 32) (dimension 1: vocab_size 700)"),
    # smaller than the tokenizer: 'the model 602 embedding rows' (the weights hold 608) and no fix
    ("import-hf-vocab-size-below-the-tokenizer", lambda c: c.import_damaged("qwen2", {"vocab_size": 602}),
     "tokens but config.json's vocab_size is 602: where tokens were added to the tokenizer, resize the model to it "
     "(model.resize_token_embeddings(len(tokenizer))) and save both again; where vocab_size is wrong, set it to the "
     "word embeddings' rows"),
    ("import-hf-ffn-size-disagrees", lambda c: c.import_damaged("llama", {"intermediate_size": 64}),
     "model.layers.0.mlp.gate_proj.weight has shape (48, 32), but config.json implies (64, 32) (dimension 1: "
     "intermediate_size 64)"),
    ("import-hf-zero-heads", lambda c: c.import_damaged("llama", {"num_attention_heads": 0}),
     "config.json's num_attention_heads is 0; it must be a whole number >= 1"),
    ("import-hf-heads-not-dividing-hidden", lambda c: c.import_damaged("llama", {"num_attention_heads": 5}),
     "The hidden size (32) is not a multiple of the number of attention heads (5)"),
    ("import-hf-layers-not-a-number", lambda c: c.import_damaged("llama", {"num_hidden_layers": "3"}),
     "config.json's num_hidden_layers is '3'; it must be a whole number >= 1"),
    ("import-hf-negative-positions", lambda c: c.import_damaged("qwen2", {"max_position_embeddings": -1}),
     "config.json's max_position_embeddings is -1; it must be a whole number >= 1"),
    ("import-hf-eos-outside-vocab", lambda c: c.import_damaged("qwen2", {"eos_token_id": 5000}),
     "config.json's eos_token_id 5000 is not a token id of its vocabulary (0..607, vocab_size 608): fix config.json (the "
     "id, or a vocab_size that disagrees with the weights)"),
    ("import-hf-rope-theta-zero", lambda c: c.import_damaged("qwen2", {"rope_parameters": {"rope_type": "default",
                                                                                            "rope_theta": 0.0}}),
     "config.json's rope_theta is 0.0; it must be > 0: it cannot describe a working model"),
    ("import-hf-norm-eps-negative", lambda c: c.import_damaged("llama", {"rms_norm_eps": -1.0}),
     "config.json's rms_norm_eps is -1.0; it must be >= 0"),
    ("import-hf-tensor-nobody-reads", lambda c: c.import_damaged("llama", edit=lambda s: s.__setitem__(
        "model.layers.0.mlp.extra.weight", s["model.norm.weight"].clone())),
     "its weights hold model.layers.0.mlp.extra.weight, which the model config.json describes has no place for: "
     "transformers would leave it out with a warning"),
    ("import-hf-bert-norm-eps-negative", lambda c: c.bert_config_with(layer_norm_eps=-1),
     "config.json (StrictDataclassFieldValidationError: Validation error for field 'layer_norm_eps'"),
    ("import-hf-bert-dropout-a-string", lambda c: c.bert_config_with(attention_probs_dropout_prob="0.1"),
     "transformers rejects its config.json (StrictDataclassFieldValidationError: Validation error for field "
     "'attention_probs_dropout_prob'"),
    ("import-hf-bert-relu", lambda c: c.bert_config_with(hidden_act="relu"),
     "hidden_act is 'relu'; mmadapt's bert has 'gelu' (import-hf supports BertForMaskedLM, BertModel with exact GELU"),
    ("import-hf-untied-flag-without-head", lambda c: c.import_damaged("qwen2", {"tie_word_embeddings": False}),
     "the weights lack lm_head.weight, which config.json implies (tie_word_embeddings false"),
    # --- predict never cuts a text, never writes NaN, runs on a device that is there
    ("predict-text-longer-than-positions", lambda c: c.predict("In the beginning <mask> created the heaven. " * 40),
     "reads at most 126 (128 positions, 2 of them its layout's): shorten or split it (predict does not cut a text)"),
    ("predict-mask-past-positions", lambda c: c.predict("and the earth " * 80 + "was without <mask>."),
     "reads at most 126 (128 positions, 2 of them its layout's)"),
    ("predict-nan-outputs", lambda c: c.predict("In the beginning <mask> created the heaven.", run=c.nan_copy()),
     "in.txt:1: its weights are damaged or diverged (nothing is written)"),  # the input named by its line
    ("predict-device-not-there", lambda c: c.predict("a <mask>", "--device", "cuda:7"),
     "--device cuda:7: this machine has"),
    ("predict-device-not-a-device", lambda c: c.predict("a <mask>", "--device", "gpu0"),
     "--device 'gpu0' is not a device: use cpu or cuda[:i]"),
    # --- every bound declared once, checked before any work, naming the flag typed (issue 41)
    ("flops-global-batch-zero", lambda c: ["flops", "--global_batch", "0"],
     "argument --global_batch: must be >= 1, got 0"),
    ("flops-global-batch-negative", lambda c: ["flops", "--global_batch", "-8"],
     "argument --global_batch: must be >= 1, got -8"),
    ("flops-train-iters-negative", lambda c: ["flops", "--train_iters", "-1"], "--train_iters must be >= 1, got -1"),
    ("flops-mask-prob-zero", lambda c: ["flops", "--mask_prob", "0"], "--mask_prob must be in (0, 1), got 0.0"),
    ("flops-new-layers-zero", lambda c: ["flops", "--new_layers", "0"], "--new_layers must be >= 1, got 0"),
    ("flops-seq-past-positions", lambda c: ["flops", "--seq_length", "1024"],
     "seq_length 1024 exceeds max_position_embeddings 512"),
    ("demo-seq-past-positions", lambda c: ["demo", "--output_dir", str(c.out), "--seq_length", "1000"],
     "seq_length 1000 exceeds max_position_embeddings 128"),
    ("demo-heldout-fraction-one", lambda c: ["demo", "--output_dir", str(c.out), "--heldout_fraction", "1"],
     "--heldout_fraction must be in (0, 1), got 1.0"),
    ("demo-adapt-iters-zero", lambda c: ["demo", "--output_dir", str(c.out), "--adapt_iters", "0"],
     "--adapt_iters must be >= 1, got 0"),
    ("demo-lr-nan", lambda c: ["demo", "--output_dir", str(c.out), "--finetune_lr", "nan"],
     "--finetune_lr must be a finite number, got nan"),
    ("demo-retrieval-pairs-past-the-verses", lambda c: ["demo", "--output_dir", str(c.out), "--quick",
                                                        "--retrieval_pairs", "100000"],
     "--retrieval_pairs 100000: the held-out books hold 6577 de verses parallel to English: choose at most 6577"),
    ("evaluate-plugin-primary-is-a-finetune-run", lambda c: ["evaluate", "--primary", c.kind_copy("finetune"),
                                                             "--plugin_data", c.dir("d"), "--embeddings",
                                                             c.artifact(VOCAB), "--output", str(c.tmp / "r.json")],
     "finetune_run is a finetune run (Step 3: a task model); this needs a pretrain or import-hf run (Step 1)"),
    ("demo-output-bias-init-unknown", lambda c: ["demo", "--output_dir", str(c.out), "--output_bias_init", "ones"],
     "--output_bias_init must be one of zeros, unigram, got 'ones'"),
    ("adam-beta-one", lambda c: c.pretrain("--adam_beta2", "1"), "--adam_beta2 must be in [0, 1), got 1.0"),
    ("finetune-dropout-over-one", lambda c: c.finetune("--hidden_dropout", "1.5"),
     "--hidden_dropout must be in [0, 1), got 1.5"),
    ("preprocess-valid-fraction-one", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir", str(c.out),
                                                 "--valid_fraction", "1"],
     "--valid_fraction must be in [0, 1), got 1.0"),
    ("sweep-near-max-over-one", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                           str(c.out), "--near_max", "1.5"], "--near_max must be in (0, 1], got 1.5"),
    ("sweep-bpb-bytes-under-256", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                             str(c.out), "--bpb_bytes", "100"], "--bpb_bytes must be >= 256, got 100"),
    ("sweep-ds-config-batch-before-its-data", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de",
                                                         "--output_dir", str(c.out), "--corpus", str(c.corpus),
                                                         "--valid_fraction", "0.03", "--ds_config",
                                                         c.file("ds.json", '{"train_batch_size": 8}')],
     "sets train_batch_size"),
    # (each refused by the depth's start_run, after the corpus was prepared into <output_dir>/data)
    ("sweep-fusion-before-its-data", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                                str(c.out), "--corpus", str(c.corpus), "--valid_fraction", "0.03",
                                                "--fusion", "cudagraphs"],
     "--fusion cudagraphs needs a CUDA device"),
    ("sweep-ranks-before-its-data", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                               str(c.out), "--corpus", str(c.corpus), "--valid_fraction", "0.03",
                                               "--tensor_model_parallel_size", "2"],
     "1 ranks cannot hold tensor_model_parallel_size x pipeline_model_parallel_size = 2"),
    ("sweep-positions-before-its-data", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                                   str(c.out), "--corpus", str(c.corpus), "--valid_fraction", "0.03",
                                                   "--seq_length", "96"],
     "--seq_length 96 is longer than the 64-piece blocks"),
    ("sweep-calibration-before-its-data", lambda c: [
        "sweep", "--source", str(c.primary), "--lang", "de", "--output_dir", str(c.out), "--corpus", str(c.corpus),
        "--valid_fraction", "0.03", "--train_output_bias", "false", "--primary_calibration", "scale"],
     "and this run has none to fit: its output bias is frozen (--train_output_bias false); drop the flag"),
    ("sweep-data-path-with-corpus-settings", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de",
                                                       "--output_dir", str(c.out), "--data_path", c.dir("d"),
                                                       "--vocab_size", "100", "--valid_fraction", "0.1"],
     "--vocab_size and --valid_fraction prepare a --corpus; --data_path"),
    ("sweep-over-a-bl-base-run", lambda c: ["sweep", "--source", c.kind_copy("pretrain", recipe="bl_base"),
                                            "--lang", "de", "--output_dir",
                                            str(c.out), "--corpus", str(c.corpus), "--valid_fraction", "0.03"],
     "has recipe bl_base: pretrain with --recipe minijoint --mini_layers N [M ...], or over this model build one "
     "mini-model per depth (mmadapt build_minipost --mini_layers N)"),
    ("sweep-into-its-source", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                         str(c.primary), "--corpus", str(c.corpus), "--valid_fraction", "0.03"],
     "holds other files (checkpoints, metrics.jsonl, run.json, ...) and no sweep"),
    ("sweep-over-other-files", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                          (Path(c.dir("mine")) / "sweep.md").write_text("mine") and c.dir("mine"),
                                          "--corpus", str(c.corpus), "--valid_fraction", "0.03"],
     "holds other files (sweep.md) and no sweep"),
    # (a sweep.json of the user's was written over; a depth's directory of other files was refused after the corpus
    # was prepared into the output, and an output that is a file as 'data: Not a directory')
    ("sweep-over-a-sweep-json-no-sweep-wrote", lambda c: [
        "sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
        (Path(c.dir("mine")) / "sweep.json").write_text('{"my": "results"}') and c.dir("mine"), "--corpus",
        str(c.corpus), "--valid_fraction", "0.03"], "holds a sweep.json that no sweep wrote: choose a new"),
    ("sweep-over-a-depth-of-other-files", lambda c: [
        "sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
        (Path(c.dir("mine")) / "4").mkdir() or (c.tmp / "mine" / "4" / "keep.txt").write_text("mine")
        and c.dir("mine"),
        "--corpus", str(c.corpus), "--valid_fraction", "0.03"], "holds other files (keep.txt) and no mmadapt run"),
    ("sweep-into-a-file", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir",
                                     (c.tmp / "afile").write_text("x") and str(c.tmp / "afile"), "--corpus",
                                     str(c.corpus), "--valid_fraction", "0.03"], "afile is a file, not a directory"),
    ("sweep-depth-zero", lambda c: ["sweep", "--source", str(c.primary), "--lang", "de", "--output_dir", str(c.out),
                                    "--corpus", str(c.corpus), "--mini_layers", "0"],
     "--mini_layers must be >= 1, got 0"),
    ("demo-over-other-files", lambda c: ["demo", "--quick", "--output_dir", (Path(c.dir("mine")) / "results.md")
                                         .write_text("mine") and c.dir("mine")],
     "holds other files and no demo (its demo.json)"),
    ("demo-changed-settings", lambda c: ["demo", "--quick", "--output_dir", (Path(c.dir("d")) / "demo.json")
                                         .write_text('{"finetune_lr": 0.123, "workers": 7}') and c.dir("d")],
     "holds a demo with other settings (finetune_lr 0.123, now 0.0005), whose finished runs it would keep"),
    ("demo-bpb-bytes-under-256", lambda c: ["demo", "--output_dir", str(c.out), "--quick", "--bpb_bytes", "10"],
     "--bpb_bytes must be >= 256, got 10"),
    ("evaluate-plugin-blocks-zero", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data", c.dir("d"),
                                               "--embeddings", c.dir("e"), "--output", str(c.tmp / "r.json"),
                                               "--plugin_blocks", "0"],
     "argument --plugin_blocks: must be >= 1, got 0"),
    # past the model's positions, the untrained ones allowed (or an imported model's, whose blocks are unknown): the
    # encoder's forward failed with a traceback after the model had loaded
    ("evaluate-plugin-seq-length-past-the-positions", lambda c: [
        "evaluate", "--primary", str(c.primary), "--plugin_data", c.dir("d"), "--embeddings", c.dir("e"), "--output",
        str(c.tmp / "r.json"), "--seq_length", "100000", "--allow_untrained_positions", "true"],
     "error: --seq_length 100000 exceeds max_position_embeddings"),
    # the flag's declared range (FinetuneConfig.eval_batch_tokens): 0 ran at 16384 tokens, -1 named a Python argument
    ("evaluate-plugin-eval-batch-tokens-zero", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                                          c.dir("d"), "--embeddings", c.dir("e"), "--output",
                                                          str(c.tmp / "r.json"), "--eval_batch_tokens", "0"],
     "error: --eval_batch_tokens must be >= 1, got 0"),
    # --- a run of the wrong kind: what it got and what it needs, in one line (issue 41)
    # (it named "or a build_minipost run (Step 1b)", and build_minipost over one built a mini-model of a mini-model)
    ("minipost-primary-is-a-finetune-run", lambda c: c.minipost(primary=c.kind_copy("finetune", task="bible-genre")),
     "is a finetune run (Step 3: a task model); this needs a pretrain or import-hf run (Step 1)"),
    ("minipost-primary-is-a-minipost-run", lambda c: c.minipost(primary=c.kind_copy("minipost")),
     "is a build_minipost run (Step 1b); this needs a pretrain or import-hf run (Step 1)"),
    # (a run of a kind neither step takes: the schedule's read named build_minipost runs among those to pass)
    *[row for command in ("minipost", "finetune") for row in (
        (f"{command}-primary-is-an-adapt-run",
         lambda c, command=command: getattr(c, command)(primary=c.kind_copy("adapt")),
         "is an adapt run (Step 2: its products are the artifacts under its embeddings/); this needs a pretrain or "
         "import-hf run (Step 1)$"),
        (f"{command}-primary-is-a-finetune-run-of-its-own",
         lambda c, command=command: getattr(c, command)(primary=c.kind_copy_without_tokenizer("finetune")),
         "which reads the tokenizer of the run it was trained from: pass a pretrain or import-hf run (Step 1)$"))],
    ("fit-head-primary-is-a-minipost-run", lambda c: ["fit-head", "--primary", c.kind_copy("minipost"), "--corpus",
                                                      str(c.corpus), "--output_dir", str(c.out)],
     "is a build_minipost run (Step 1b); this needs a pretrain or import-hf run (Step 1)"),
    ("adapt-source-is-an-adapt-run", lambda c: c.adapt()[:4] + [c.kind_copy("adapt")] + c.adapt()[5:],
     "is an adapt run (Step 2: its products are the artifacts under its embeddings/); this needs a pretrain"),
    ("finetune-primary-is-a-minipost-run", lambda c: c.finetune(primary=c.kind_copy("minipost")),
     "is a build_minipost run (Step 1b); this needs a pretrain or import-hf run (Step 1)"),
    ("export-finetuned-is-a-pretrain-run", lambda c: ["export-hf", "--finetuned", str(c.primary), "--output_dir",
                                                      str(c.out)],
     "is a pretrain or import-hf run (Step 1); this needs a finetune run (Step 3: a task model)"),
    # --- scoring a fraction of the positions: the decoder's, in (0, 1]
    ("encoder-given-score-fraction", lambda c: c.pretrain("--score_fraction", "0.5"),
     "score_fraction 0.5 is a causal-LM setting; the roberta family scores its masked pieces"),
    ("encoder-flops-given-score-fraction", lambda c: ["flops", "--score_fraction", "0.5"],
     "score_fraction 0.5 is a causal-LM setting"),
    ("decoder-score-fraction-zero", lambda c: c.pretrain("--preset", "llama-tiny", "--score_fraction", "0"),
     "--score_fraction must be in (0, 1], got 0.0"),
    # --- BERT and headless encoders (issue 37)
    ("bert-three-token-types", lambda c: ["import-hf", "--model", c.bert_dir(type_vocab_size=3), "--output_dir",
                                          str(c.out)], "type_vocab_size is 3; mmadapt's BERT has 1 or 2 token types"),
    ("bert-tokenizer-kind", lambda c: ["import-hf", "--model", c.bert_dir("bpe"), "--output_dir", str(c.out)],
     "its tokenizer is a bpe tokenizer; the bert family takes sentencepiece, wordpiece tokenizers"),
    ("bert-preset-token-types", lambda c: c.pretrain("--preset", "bert-tiny", "--type_vocab_size", "4"),
     "type_vocab_size 4: BERT has 1 or 2 token types"),
    ("encoder-given-token-types", lambda c: c.pretrain("--type_vocab_size", "1"),
     "type_vocab_size 1 sets BERT's token types; the roberta family has none: drop it"),
    ("headless-to-step2", lambda c: ["adapt", "--system", "bl_base", "--source", c.headless_run(), "--lang", "de",
                                     "--output_dir", str(c.out)],
     "is a headless encoder (a BertModel imported without an MLM head), and Step 2 needs one: fit it first with "
     "`mmadapt fit-head --primary"),
    ("headless-to-minipost", lambda c: c.minipost(primary=c.headless_run()), "and build_minipost needs one"),
    ("preprocess-text-the-tokenizer-cannot-read", lambda c: ["preprocess", "--corpus", c.russian(), "--tokenizer",
                                                             str(c.tokenizer), "--output_dir", str(c.out)],
     "are unknown to the tokenizer"),
    # named as given: it named <output_dir>/tokenizer.model, removed by the refusal (an expansion's: a
    # temporary file)
    ("preprocess-expand-text-the-tokenizer-cannot-read", lambda c: [
        "preprocess", "--corpus", c.russian(), "--expand_from", str(c.primary), "--tokenizer",
        str(c.request.getfixturevalue("de_tokenizer")), "--output_dir", str(c.out)],
     "'s vocabulary expanded by --tokenizer "),
    ("preprocess-text-the-tokenizer-trained-here-cannot-read", lambda c: [
        "preprocess", "--corpus", c.english_and_long_russian_lines(), "--vocab_size", "500",
        "--output_dir", str(c.out)],
     ("are unknown to the tokenizer trained on it (500 pieces, --vocab_size) ",
      "the sample of its lines it was trained on lacks that text: split lines longer than 4192 bytes (SentencePiece "
      "skips them), or raise --tokenizer_sample_lines")),
    # (an expansion whose target tokenizer was trained here: the same fix, not "--vocab_size N, no
    # --tokenizer", which is what was run)
    ("preprocess-expand-text-the-target-trained-here-cannot-read", lambda c: [
        "preprocess", "--corpus", c.english_and_long_russian_lines(c.request.getfixturevalue("de_corpus")),
        "--expand_from", str(c.primary), "--vocab_size", "500", "--output_dir", str(c.out)],
     ("'s vocabulary expanded by a target tokenizer trained on the corpus (",
      "does not cover this text's script; the sample of its lines it was trained on lacks that text: split lines "
      "longer than 4192 bytes")),
    ("fit-head-text-the-tokenizer-cannot-read", lambda c: ["fit-head", "--primary", c.headless_run(), "--corpus",
                                                           c.russian(), "--output_dir", str(c.out)],
     "are unknown to the tokenizer"),
    ("fit-head-has-a-head", lambda c: ["fit-head", "--primary", str(c.primary), "--corpus", str(c.corpus),
                                       "--output_dir", str(c.out)], "has its MLM head already"),
    ("bert-body-holding-an-mlm-head", lambda c: c.body_with_a_head(),
     "its weights hold cls.predictions.bias (and 1 more tensor), which the model config.json describes has no place "
     "for: config.json names a BertModel, a body without an MLM head, but the weights hold one: set architectures "
     "to [\"BertForMaskedLM\"]"),
    # --- grafting Step-2 embeddings into a fine-tuned sibling (issue 54)
    ("export-hf-embeddings-the-folder-above-the-artifact",
     lambda c: [str(Path(a).parent) if a.endswith("step00000002") else a
                for a in c.graft("llama2-base", "llama2-expand")],
     "embeddings is not a Step-2 embedding artifact (no embeddings.pt): pass a directory under "
     "<adapt run>/embeddings/"),
    ("graft-into-another-architecture", lambda c: c.graft("qwen2-sibling", "llama2-expand", "--graft"),
     "is not a sibling of"),
    ("graft-into-a-resized-vocabulary", lambda c: c.graft(c.sibling_resized(), "llama2-expand", "--graft"),
     "its vocabulary has 664 rows, the base's 600 (tokens added, or its embeddings resized)"),
    ("graft-into-another-vocabulary", lambda c: c.graft(c.sibling_of_another_vocabulary(), "llama2-expand", "--graft"),
     "its tokenizer has another vocabulary (a source vocabulary other than the base's); run Step 2 over it instead"),
    ("graft-expand-into-moved-output-rows", lambda c: c.graft("llama2-sibling-output", "llama2-expand", "--graft"),
     "its untied output rows (output_layer.weight) moved from the base's"),
    ("graft-without-the-flag", lambda c: c.graft("llama2-sibling", "llama2-replace"),
     "if it is a model fine-tuned from that one (the same architecture and vocabulary; an imported classifier), "
     "pass --graft"),
    ("graft-into-the-base-itself", lambda c: c.graft("llama2-base", "llama2-replace", "--graft"), "drop --graft"),
    ("predict-graft-without-embeddings", lambda c: c.predict_graft("llama2-sibling", None, "--graft"),
     "--graft puts Step-2 embeddings into a sibling: pass --embeddings too"),
    ("predict-graft-into-another-architecture", lambda c: c.predict_graft("qwen2-sibling", "llama2-expand", "--graft"),
     "is not a sibling of"),
    ("predict-graft-without-the-flag", lambda c: c.predict_graft("llama2-sibling", "llama2-replace"),
     "(or, into a model fine-tuned from that one, pass --graft)"),
    ("predict-graft-into-the-base-itself", lambda c: c.predict_graft("llama2-base", "llama2-replace", "--graft"),
     "drop --graft"),
    # --- an outside probe of the surfaces, 2026-11-28 (issue 52): the kinds it found
    ("hf-config-a-json-list", lambda c: ["import-hf", "--model", c.dir("hfl") and str(
        Path(c.file("hfl/config.json", "[1, 2]")).parent), "--output_dir", str(c.out)],
     "config.json holds a JSON list, not an object"),
    # --- extend's and import-hf's model files, 2026-12-04
    ("hf-config-saved-as-utf-16", lambda c: ["import-hf", "--model", c.dir("hfu") and str(Path(c.file(
        "hfu/config.json", '{"model_type": "bert"}'.encode("utf-16"))).parent), "--output_dir", str(c.out)],
     "hfu/config.json is not JSON (not UTF-8 text: invalid start byte)"),
    ("sentence-transformers-modules-saved-as-utf-16", lambda c: ["import-hf", "--model", (
        d := c.sentence_transformers_dir([])) and c.file("bert/modules.json", "[]".encode("utf-16")) and d,
        "--output_dir", str(c.out)], "bert/modules.json is not JSON (not UTF-8 text"),
    ("sentence-transformers-refused-into-new-parents", lambda c: ["import-hf", "--model", (
        d := c.sentence_transformers_dir([{"idx": 0, "name": "0", "path": "",
                                           "type": "sentence_transformers.models.Transformer"}])) and c.file(
        "bert/model.safetensors", (Path(d) / "model.safetensors").read_bytes()[:100]) and d,
        "--output_dir", str(c.tmp / "new" / "sub" / "run")], "cannot be read as safetensors"),
    ("hf-config-architectures-a-string", lambda c: c.import_damaged("qwen2", {"architectures": "Qwen2ForCausalLM"}),
     'its architectures is "Qwen2ForCausalLM", not a list of class names'),
    ("run-json-without-a-model", lambda c: ["export-hf", "--primary", c.kind_copy("pretrain", model=None),
                                            "--output_dir", str(c.out)],
     "pretrain_run/run.json holds no model config: it was not written by this mmadapt, or was edited"),
    ("export-hf-graft-without-embeddings", lambda c: ["export-hf", "--primary", str(c.primary), "--graft",
                                                      "--output_dir", str(c.out)],
     "--graft puts Step-2 embeddings into a sibling: pass --embeddings too"),
    ("predict-top-k-for-a-classifier", lambda c: c.predict("fine", "--top_k", "3",
                                                           run=c.kind_copy("finetune", task="bible-genre")),
     "--top_k lists a language model's pieces; "),
    ("evaluate-plugin-data-not-prepared", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                                     str(c.tmp / "no_data"), "--embeddings", c.artifact(VOCAB),
                                                     "--output", str(c.tmp / "r.json")],
     "no_data does not exist: run `mmadapt preprocess"),
    # (held-out data it could score: the data's checks come before the primary's weights are read)
    ("evaluate-plugin-graft-into-the-base-itself", lambda c: ["evaluate", "--primary", str(c.primary), "--plugin_data",
                                                              c.short_held_out(), "--embeddings", c.artifact(VOCAB),
                                                              "--graft",
                                                              "--output", str(c.tmp / "r.json")], "drop --graft"),
    ("report-output-exists", lambda c: ["report", c.records([RECORD]), "--output", c.file("report.md", "mine")],
     "report.md already exists: choose a new --output (nothing is overwritten)"),
    ("report-plots-exist", lambda c: ["report", c.records([RECORD]), "--plots", c.dir("plots") and str(
        Path(c.file("plots/curves.png", "mine")).parent)], "holds curves.png already: choose a new directory"),
    ("report-one-file-twice", lambda c: ["report", c.records([RECORD]), str(c.tmp / "results.json")],
     "results.json is given twice: its records would count twice"),
    ("report-flops-negative", lambda c: ["report", c.records([{**RECORD, "flops": -1.0}])],
     "record 0 has flops -1.0; scores are finite numbers and FLOPs finite and >= 0"),
    ("report-step-negative", lambda c: ["report", c.records([{**RECORD, "step": -3}])],
     "record 0 has step -3; a step is a Step-2 update, a whole number >= 0"),
    ("tiny-switch-not-one", lambda c: c.request.getfixturevalue("monkeypatch").setenv("MMADAPT_TINY", "yes")
     or c.pretrain(), "MMADAPT_TINY is 'yes': set it to 1 for the tiny sizes, or to 0"),
    ("extend-corpus-empty", lambda c: c.extend("--corpus", c.file("empty.txt", "\n \n")),
     "empty.txt is empty: it needs at least one non-blank line"),
    ("extend-source-corpus-missing", lambda c: c.extend("--source_corpus", str(c.tmp / "none.txt")),
     "none.txt does not exist"),
    ("extend-lr-nan", lambda c: c.extend("--lr", "nan"), "lr must be a finite number, got nan"),
    ("extend-launched-on-two-ranks", lambda c: c.request.getfixturevalue("monkeypatch").setenv("WORLD_SIZE", "2")
     or c.extend(), "mmadapt extend runs in one process (the launcher started 2): run it as `mmadapt extend`"),
    ("demo-launched-on-two-ranks", lambda c: c.request.getfixturevalue("monkeypatch").setenv("WORLD_SIZE", "2")
     or ["demo", "--output_dir", str(c.out)], "mmadapt demo runs in one process (the launcher started 2): run it as "
     "`mmadapt demo`"),
    # `srun -n 4 python launch/pretrain.py`: four worlds of one, each training into the same directory
    ("pretrain-srun-tasks-without-a-launcher", lambda c: c.srun_tasks(4) or c.pretrain(),
     "srun started 4 tasks of this command and no launcher told them of each other (WORLD_SIZE is unset), so each "
     "would train alone: launch one task per node through `mmadapt slurm-env`"),
    # (0 or null is false to DeepSpeed too: it trains)
    ("ds-config-forces-deepspeeds-cpu-adam-with-one", lambda c: c.pretrain("--ds_config", c.file("ds.json", json.dumps(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
         "zero_force_ds_cpu_optimizer": 1}))), "sets zero_force_ds_cpu_optimizer 1 beside offload_optimizer"),
    ("extend-srun-tasks-without-a-launcher", lambda c: c.srun_tasks(2) or c.extend(),
     "srun started 2 tasks of this command and no launcher told them of each other"),
    ("extend-plugin-eval-blocks-zero", lambda c: c.extend("--plugin_eval_blocks", "0"),
     "argument --plugin_eval_blocks: must be >= 1, got 0"),
    ("extend-lang-with-a-slash", lambda c: c.extend("--lang", "de/x"), "argument --lang: 'de/x' is no language code"),
    ("adapt-lang-blank", lambda c: c.adapt("--lang", ""), "argument --lang: '' is no language code"),
    ("extend-model-not-a-model", lambda c: c.extend("--model", c.dir("mine")),
     "is not a Hugging Face or sentence-transformers model directory (no config.json or modules.json)"),
    ("extend-model-import-refuses", lambda c: c.extend("--model", str(Path(c.file("gpt/config.json", json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})) if c.dir("gpt") else "").parent)),
     "holds a GPT2LMHeadModel (model_type gpt2); import-hf supports"),
    ("extend-into-the-model-itself", lambda c: c.extend("--into", str(c.tmp / "hf_model")),
     "is --model itself: its extension is <output_dir>/export; drop --into"),
    ("import-hf-config-without-intermediate-size", lambda c: c.bert_config_without("intermediate_size"),
     "intermediate_size 3072"),
    ("import-classifier-without-its-head", lambda c: c.classifier_dir(),
     "its weights lack classifier.bias, classifier.weight (or hold another shape), which a "
     "BertForSequenceClassification holds: transformers would start them at random"),
    ("import-classifier-without-tokenizer", lambda c: c.classifier_dir(lambda d: [
        (d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
        if (d / f).exists()]), "has no tokenizer files: expected one of"),
    ("import-classifier-weights-truncated", lambda c: c.classifier_dir(lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:100])), "cannot be read as safetensors"),
    ("extend-into-a-classifier", lambda c: c.extend("--into", c.classifier("RobertaForSequenceClassification")),
     "is a sequence classifier: extend takes language models; graft the extension's embeddings into a classifier "
     "with `mmadapt import-hf"),
    ("extend-into-a-classifier-names-the-graft", lambda c: c.extend(
        "--adapt_iters", "40", "--into", c.classifier("RobertaForSequenceClassification")),
     "--task <task> --output_dir <run>` and `mmadapt export-hf --finetuned <run> --graft --embeddings "),
    ("extend-into-a-classifier-names-its-artifact", lambda c: c.extend(
        "--adapt_iters", "40", "--into", c.classifier("RobertaForSequenceClassification")),
     "/run/adapt/embeddings/step00000040 --output_dir <dir>` (docs/huggingface.md)"),
    ("extend-a-classifier", lambda c: c.extend("--model", c.classifier("BertForSequenceClassification")),
     "is a sequence classifier: extend takes language models; graft the extension's embeddings into a classifier "
     "with `mmadapt import-hf --model "),
    ("extend-a-classifier-names-its-base-s-extension", lambda c: c.extend(
        "--model", c.classifier("BertForSequenceClassification")),
     "--graft --embeddings <the extension of its base>/adapt/embeddings/step00000600 --output_dir <dir>`"),
    ("extend-into-a-headless-encoder", lambda c: c.extend("--into", c.bert_dir()),
     "bert is a headless encoder (a BertModel): extend grafts the embeddings into a language model fine-tuned from "
     "--model; a headless model is extended as --model itself: drop --into"),
    ("extend-into-a-sentence-transformers-directory", lambda c: c.extend("--into", c.sentence_transformers_dir(
        [ST_TRANSFORMER])), "bert is a headless encoder (a sentence-transformers directory)"),
    # refused before --model is imported into the output, as the import of --into would refuse it
    ("extend-into-a-sentence-transformers-directory-of-no-modules", lambda c: c.extend(
        "--into", c.sentence_transformers_dir([])), "bert: its modules.json lists no modules; import-hf takes a "
     "sentence-transformers model of a Transformer followed by"),
    ("extend-into-a-sentence-transformers-decoder", lambda c: c.extend("--into", c.sentence_transformers_decoder()),
     "st_llama: its transformer is a LlamaForCausalLM; import-hf takes a sentence-transformers model whose "
     "transformer is an encoder's body (BertModel, "),
    ("import-sentence-transformers-decoder", lambda c: ["import-hf", "--model", c.sentence_transformers_decoder(),
                                                        "--output_dir", str(c.out)],
     "st_llama: its transformer is a LlamaForCausalLM; import-hf takes a sentence-transformers model whose "
     "transformer is an encoder's body (BertModel, "),
    ("extend-source-corpus-of-another-script", lambda c: c.extend("--model", c.bert_dir(), "--system", "bl_base",
                                                                  "--source_corpus", c.russian()),
     "of the pieces of its first lines are unknown to"),
    ("extend-minipost-of-a-one-layer-model", lambda c: c.extend("--model", c.bert_dir()),
     "has one layer: too few for a mini-model below it (Step 1b keeps its bottom layers); pass --system bl_base"),
    ("extend-seq-length-past-the-models-positions", lambda c: c.extend(
        "--model", str(c.request.getfixturevalue("tiny_hf")["qwen2"]), "--seq_length", "100000"),
     "seq_length 100000 exceeds max_position_embeddings"),
    ("preprocess-corpus-too-small-for-the-vocabulary", lambda c: ["preprocess", "--corpus", c.file(
        "one.txt", "In the beginning God created the heaven and the earth.\n"), "--vocab_size", "300", "--output_dir",
        str(c.out)], "one.txt is too small for a 300-piece vocabulary: SentencePiece finds at most"),
    ("preprocess-vocabulary-smaller-than-the-characters", lambda c: ["preprocess", "--corpus", c.file(
        "chars.txt", "".join(chr(0x4E00 + i) * 2 + ("\n" if i % 20 == 19 else "") for i in range(400))), "--vocab_size",
        "100", "--output_dir", str(c.out)],
     "chars.txt holds more characters than a 100-piece vocabulary holds: SentencePiece needs 406 pieces for its "
     "characters and special pieces; pass --vocab_size 406 or more"),
    ("preprocess-expand-tokenizer-of-another-size", lambda c: ["preprocess", "--corpus", str(c.corpus), "--expand_from",
                                                               str(c.primary), "--tokenizer", str(c.tokenizer),
                                                               "--vocab_size", "9", "--output_dir", str(c.out)],
     "pieces but --vocab_size is 9: drop --vocab_size or pass a matching tokenizer"),
    ("preprocess-byte-fallback-with-a-tokenizer", lambda c: ["preprocess", "--corpus", str(c.corpus), "--tokenizer",
                                                             str(c.tokenizer), "--byte_fallback", "true",
                                                             "--output_dir", str(c.out)],
     "--byte_fallback trains the vocabulary with byte pieces, and --tokenizer gives one, with or without its own: "
     "drop --byte_fallback"),
    ("preprocess-byte-fallback-expanding", lambda c: ["preprocess", "--corpus", str(c.corpus), "--expand_from",
                                                      str(c.primary), "--vocab_size", "500", "--byte_fallback", "true",
                                                      "--output_dir", str(c.out)],
     "--expand_from extends the run's, which keeps its own or none: drop --byte_fallback"),
    ("preprocess-vocab-size-zero", lambda c: ["preprocess", "--corpus", str(c.corpus), "--vocab_size", "0",
                                              "--output_dir", str(c.out)], "argument --vocab_size: must be >= 8, got 0"),
    # an expansion's target tokenizer is built in a temporary directory: the refusal named that file,
    # deleted by then, where the user gave a run and a seed
    ("preprocess-expand-again-with-another-target-tokenizer", lambda c: c.expanded_with_another_tokenizer(),
     "'s vocabulary expanded by a target tokenizer trained on the corpus: choose a new --output_dir (nothing was "
     "overwritten)"),
    ("preprocess-expand-by-a-target-of-no-new-piece", lambda c: [
        "preprocess", "--corpus", str(c.corpus), "--expand_from", str(c.primary), "--vocab_size", "500",
        "--output_dir", str(c.out)],
     "the target tokenizer trained on the corpus (--vocab_size) adds no piece to the source's"),
    ("preprocess-expand-from-an-adapt-run", lambda c: ["preprocess", "--corpus", str(c.corpus), "--expand_from",
                                                       c.kind_copy("adapt"), "--output_dir", str(c.out)],
     "is an adapt run (Step 2: its products are the artifacts under its embeddings/); this needs a pretrain"),
    ("fit-head-corpus-and-data-path", lambda c: ["fit-head", "--primary", c.headless_run(), "--corpus", str(c.corpus),
                                                 "--data_path", c.dir("prepared"), "--output_dir", str(c.out)],
     "pass one of --data_path (a prepared dataset) and --corpus (raw text)"),
    ("predict-tag-of-a-fine-tuning-run", lambda c: c.predict("fine", "--tag", "step00000001",
                                                             run=c.kind_copy("finetune", task="bible-genre")),
     "its model is its final checkpoint (drop --tag)"),
    ("sentence-transformers-module-without-a-type", lambda c: ["import-hf", "--model", c.sentence_transformers_dir(
        [{"idx": 0}]), "--output_dir", str(c.out)],
     "modules.json: its entry 0 names no module type or no folder inside the directory"),
    ("sentence-transformers-module-without-a-folder", lambda c: ["import-hf", "--model", c.sentence_transformers_dir(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "type": "sentence_transformers.models.Pooling"}]), "--output_dir", str(c.out)],
     "modules.json: its entry 1 names no module type or no folder inside the directory"),
    ("sentence-transformers-module-folder-dot", lambda c: ["import-hf", "--model", c.sentence_transformers_dir([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "./", "type": "sentence_transformers.models.Pooling"}]), "--output_dir",
        str(c.out)], "modules.json: its entry 1 names no module type or no folder inside the directory"),
    ("sentence-transformers-module-folder-outside", lambda c: ["import-hf", "--model", (
        d := c.sentence_transformers_dir([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "../pool", "type": "sentence_transformers.models.Pooling"}])) and c.dir(
        "pool") and c.file("pool/config.json", "{}") and d, "--output_dir", str(c.out)],
     "modules.json: its entry 1 names no module type or no folder inside the directory"),
    ("import-hf-output-inside-the-model", lambda c: ["import-hf", "--model", (d := c.bert_dir()), "--output_dir",
                                                     str(Path(d) / "run")], "/run is inside --model "),
    ("export-hf-output-inside-the-primary", lambda c: ["export-hf", "--primary", str(c.primary), "--output_dir",
                                                       str(c.primary / "export")],
     "/export is inside --primary "),
    ("adapt-output-inside-the-source", lambda c: c.adapt("--output_dir", str(c.primary / "de")),
     "/de is inside --source "),
    ("export-hf-primary-tag-of-a-fine-tuning-run", lambda c: ["export-hf", "--finetuned", str(c.tmp / "ft"),
                                                             "--primary_tag", "step00000001", "--output_dir",
                                                             str(c.out)],
     "a fine-tuned model is its final checkpoint: drop --primary_tag"),
    ("preprocess-output-inside-the-run-it-expands", lambda c: ["preprocess", "--corpus", str(c.corpus),
                                                              "--expand_from", str(c.primary), "--output_dir",
                                                              str(c.primary / "expanded")],
     "/expanded is inside --expand_from "),
    ("output-dir-empty", lambda c: ["pretrain", "--corpus", str(c.corpus), "--output_dir", ""],
     "error: mmadapt pretrain: --output_dir is given an empty value: give it one (an unset shell variable?)"),
    ("primary-blank", lambda c: ["export-hf", "--primary", " ", "--output_dir", str(c.out)],
     "--primary is given an empty value"),
    ("one-of-several-runs-empty", lambda c: ["evaluate", "--finetuned", str(c.primary), "", "--embeddings",
                                             str(c.primary), "--output", str(c.out / "r.json")],
     "--finetuned is given an empty value"),
    ("sentence-transformers-module", lambda c: ["import-hf", "--model", c.sentence_transformers_dir(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_CNN", "type": "sentence_transformers.models.CNN"}]),
        "--output_dir", str(c.out)], "lists Transformer, CNN; import-hf takes a sentence-transformers model"),
]


def snapshot(*roots: Path):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for root in roots if root.exists() for p in [root, *root.rglob("*")]}


def test_the_table_is_long_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("build, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(build, message, tmp_path, corpus, tokenizer, primary_run, capsys, request):
    ctx = Ctx(tmp_path, corpus, tokenizer, primary_run, request)
    argv = build(ctx)
    before = snapshot(tmp_path, *ctx.inputs)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's error()
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    # (a tuple: every part in the one line, e.g. what was named and the fix; a part ending in "$" ends it)
    assert all(err.endswith(m[:-1]) if m.endswith("$") else m in err
               for m in ((message,) if isinstance(message, str) else message)), err
    assert snapshot(tmp_path, *ctx.inputs) == before


def test_bl_base_needs_no_mini_layers():
    """--num_layers 2 --recipe bl_base is a valid 2-layer model (mini_layers only shapes
    BL_SMALL and MINIJOINT)."""
    from mmadapt.cli import configs_from_args, pretrain_parser

    model, _ = configs_from_args(pretrain_parser().parse_args(
        ["--recipe", "bl_base", "--num_layers", "2", "--corpus", "x", "--output_dir", "y"]))
    assert model.num_layers == 2 and model.heads_after == (2,)


def test_report_plots_without_matplotlib_write_nothing(tmp_path, capsys, monkeypatch):
    """report --plots where matplotlib is missing: refused in one line before the plots'
    directory is made (it was made, then the plot refused, and the table never printed)."""
    import sys

    from mmadapt.cli import main

    records = tmp_path / "r.json"
    records.write_text(json.dumps([RECORD]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["report", str(records), "--plots", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: plots need matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
