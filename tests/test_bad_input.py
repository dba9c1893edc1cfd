"""A table of a user's mistakes, one row each, across every command: each must end with exit
code 2, one `error:` line on stderr and no traceback, and leave every file that existed before
(the run directory, the inputs, the source run) exactly as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import VOCAB
from mmadapt.cli import main

# Each row: (id, argv builder, part of the message). The builder gets a Ctx and may create
# input files under ctx.tmp before the snapshot is taken.


class Ctx:
    def __init__(self, tmp: Path, corpus: Path, tokenizer: Path, primary: Path):
        self.tmp, self.corpus, self.tokenizer, self.primary = tmp, corpus, tokenizer, primary
        self.out = tmp / "run"

    def file(self, name: str, data: bytes | str) -> str:
        p = self.tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(p)

    def dir(self, name: str) -> str:
        p = self.tmp / name
        p.mkdir(exist_ok=True)
        return str(p)

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
        for name in ("manifest.json", "text.bin", "text.idx"):
            (out / name).write_bytes((self.primary / "data" / name).read_bytes())
        (out / "tokenizer.model").write_bytes(b"another tokenizer")
        return str(out)

    def finetune(self, *extra: str, primary: str | None = None) -> list[str]:
        return ["finetune", "--task", "bible-genre", "--primary", primary or str(self.primary),
                "--output_dir", str(self.out), *extra]

    def evaluate(self, *extra: str, embeddings: str | None = None, finetuned: str | None = None) -> list[str]:
        return ["evaluate", "--finetuned", finetuned or self.dir("ft"), "--embeddings", embeddings or self.dir("emb"),
                "--eval_file", "bible", "--output", str(self.tmp / "records.json"), *extra]

    def damaged_copy(self) -> str:
        """A copy of the primary run whose model file was cut short."""
        import shutil

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
        import shutil

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

    def own_task(self, name: str, text: str, *extra: str, task: str = "classify") -> list[str]:
        return self.finetune(*extra)[:2] + [task] + self.finetune()[3:] + ["--train_file", self.file(name, text),
                                                                          *extra]


ZERO3 = json.dumps({"zero_optimization": {"stage": 3}})
NOT_UTF8 = "In the beginning.\n".encode() * 50 + b"caf\xe9 au lait\n"
RECORD = {"system": "bl_base", "task": "t", "lang": "de", "step": 1, "flops": 1.0, "score": 50.0}

CASES = [
    # --- pretrain: data and tokenizer
    ("corpus-not-utf8", lambda c: c.pretrain(corpus=c.file("latin1.txt", NOT_UTF8)), "is not UTF-8: byte offset 903"),
    ("corpus-is-a-directory", lambda c: c.pretrain(corpus=c.dir("texts")), "is a directory"),
    ("corpus-missing", lambda c: c.pretrain(corpus=str(c.tmp / "none.txt")), "none.txt does not exist"),
    ("corpus-empty", lambda c: c.pretrain(corpus=c.file("empty.txt", "\n \n")), "is empty"),
    ("corpus-lines-too-long", lambda c: ["pretrain", "--corpus", c.file("long.txt", ("word " * 1000 + "\n") * 20),
                                         "--vocab_size", "100", "--output_dir", str(c.out)],
     "longer than 4192 bytes"),
    ("tokenizer-not-sentencepiece", lambda c: c.pretrain(tokenizer=c.file("t.model", b"\x00not a model" * 9)),
     "is not a SentencePiece model"),
    ("tokenizer-is-a-directory", lambda c: c.pretrain(tokenizer=c.dir("tokdir")), "is a directory"),
    ("tokenizer-wrong-size", lambda c: c.pretrain("--vocab_size", "2000"), f"has {VOCAB} pieces"),
    ("data-path-and-corpus", lambda c: c.pretrain("--data_path", c.dir("prepared")), "pass one of --data_path"),
    ("data-path-not-prepared", lambda c: ["pretrain", "--data_path", c.dir("prepared"), "--output_dir", str(c.out)],
     "prepared"),
    # --- pretrain: configuration
    ("embedding-init-in-pretrain", lambda c: c.pretrain("--embedding_init", "subword_mean"),
     "embedding_init is a Step-2 setting"),
    ("embedding-init-unknown", lambda c: c.adapt("--embedding_init", "fvt"), "embedding_init must be one of overlap"),
    ("ds-config-list", lambda c: c.pretrain("--ds_config", c.file("ds.json", "[1, 2]")), "holds a JSON list"),
    ("ds-config-not-json", lambda c: c.pretrain("--ds_config", c.file("ds.json", "{stage: 1")), "is not valid JSON"),
    ("ds-config-zero3", lambda c: c.pretrain("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    ("ds-config-directory", lambda c: c.pretrain("--ds_config", c.dir("dsdir")), "is a directory"),
    ("ds-config-batch-size", lambda c: c.pretrain("--ds_config", c.file("ds.json", '{"train_batch_size": 8}')),
     "sets train_batch_size"),
    ("unknown-flag", lambda c: c.pretrain("--learning_rate", "1e-3"), "unrecognized arguments: --learning_rate"),
    ("flag-wrong-type", lambda c: c.pretrain("--train_iters", "many"), "invalid int value: 'many'"),
    ("unknown-recipe", lambda c: c.pretrain("--recipe", "bl_huge"), "invalid choice: 'bl_huge'"),
    ("mask-prob", lambda c: c.pretrain("--mask_prob", "1.5"), "mask_prob must be in (0, 1)"),
    ("seq-length-short", lambda c: c.pretrain("--seq_length", "4"), "seq_length 4 is too short"),
    ("train-iters-zero", lambda c: c.pretrain("--train_iters", "0"), "must be >= 1"),
    ("keep-last-negative", lambda c: c.pretrain("--keep_last", "-1"), "keep_last and max_skipped_steps must be >= 0"),
    ("mini-layers-too-deep", lambda c: c.pretrain("--mini_layers", "12"), "mini_layers 12 must be in 1..11"),
    ("tp-not-dividing-heads", lambda c: c.pretrain("--tensor_model_parallel_size", "3"), "is not divisible"),
    # --- pretrain: the run directory
    ("output-is-a-file", lambda c: c.pretrain()[:-1] + [c.file("run", "not a directory")], "is a file, not a directory"),
    ("output-under-a-file", lambda c: c.pretrain()[:-1] + [str(Path(c.file("f", "x")) / "run")], "cannot be created"),
    ("resume-changed-lr", lambda c: c.resumed(lr=1e-3), "train.lr is 0.002 here but 0.001"),
    ("resume-changed-seed", lambda c: c.resumed(seed=7), "train.seed is 1234 here but 7"),
    ("resume-changed-schedule", lambda c: c.resumed(train_iters=99), "train.train_iters is"),
    ("resume-changed-batch", lambda c: c.resumed(train_micro_batch_size_per_gpu=3),
     "train.train_micro_batch_size_per_gpu is"),
    ("resume-run-json-broken", lambda c: (c.resumed(), (c.out / "run.json").write_text("{"))[0], "is not valid JSON"),
    # --- Step 1b
    ("minipost-not-a-run", lambda c: c.minipost(primary=c.dir("nowhere")), "is not an mmadapt run directory"),
    ("minipost-pipeline", lambda c: c.minipost("--pipeline_model_parallel_size", "2"),
     "build_minipost does not use pipeline parallelism"),
    ("minipost-missing-tag", lambda c: c.minipost("--primary_tag", "step00000007"),
     "has no complete checkpoint step00000007"),
    ("minipost-new-layers", lambda c: c.minipost("--new_layers", "0"), "new_layers must be >= 1"),
    # --- Step 2
    ("adapt-corpus-not-utf8", lambda c: c.adapt(corpus=c.file("latin1.txt", NOT_UTF8)), "is not UTF-8"),
    ("adapt-tokenizer-garbage", lambda c: c.adapt(tokenizer=c.file("t.model", b"garbage")),
     "is not a SentencePiece model"),
    ("adapt-unknown-system", lambda c: c.adapt()[:2] + ["bl_huge"] + c.adapt()[3:], "invalid choice: 'bl_huge'"),
    ("adapt-source-tag", lambda c: c.adapt("--source_tag", "step00000009"), "has no complete checkpoint step00000009"),
    ("adapt-zero3", lambda c: c.adapt("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    # --- Step 2 --vocab_mode expand
    ("vocab-mode-unknown", lambda c: c.adapt("--vocab_mode", "merge"), "vocab_mode must be one of replace, expand"),
    ("vocab-mode-in-pretrain", lambda c: c.pretrain("--vocab_mode", "expand"), "vocab_mode is a Step-2 setting"),
    ("expand-with-vocab-size", lambda c: c.adapt("--vocab_mode", "expand"), "drop --vocab_size"),
    ("expand-vocab-size-with-tokenizer", lambda c: c.expand("--corpus", str(c.corpus), "--tokenizer", str(c.tokenizer),
                                                            "--vocab_size", "900"), "drop --vocab_size"),
    ("expand-output-start-unknown", lambda c: c.adapt("--expand_output_start", "zero"),
     "expand_output_start must be one of bounded, embedding_init"),
    ("expand-output-start-in-pretrain", lambda c: c.pretrain("--expand_output_start", "embedding_init"),
     "expand_output_start is a Step-2 setting"),
    # --- Step 2 source-language replay
    ("replay-fraction-without-data", lambda c: c.adapt("--replay_fraction", "0.25"), "go together"),
    ("replay-fraction-one", lambda c: c.adapt("--replay_fraction", "1", "--replay_data", str(c.primary / "data")),
     "replay_fraction must be in [0, 1)"),
    ("replay-in-pretrain", lambda c: c.pretrain("--replay_fraction", "0.1", "--replay_data", str(c.primary / "data")),
     "replay_data and replay_fraction are Step-2 settings"),
    ("replay-not-a-dataset", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", c.dir("nothing")),
     "holds no finished dataset"),
    ("replay-other-tokenizer", lambda c: c.adapt("--replay_fraction", "0.25", "--replay_data", c.other_dataset()),
     "was not encoded with"),
    ("replay-rounds-to-no-block", lambda c: c.adapt("--replay_fraction", "0.01", "--replay_data",
                                                    str(c.primary / "data")), "rounds to no block"),
    ("replay-replace-without-target-tokenizer",
     lambda c: [a for a in c.adapt("--replay_fraction", "0.25", "--replay_data", str(c.primary / "data"))
                if a != str(c.tokenizer) and a != "--tokenizer"], "which this run would only train"),
    ("expand-adds-no-piece", lambda c: c.expand("--corpus", str(c.corpus), "--tokenizer", str(c.tokenizer)),
     "adds no piece to the source's"),
    ("expand-data-not-an-expansion", lambda c: c.expand("--data_path", str(c.primary / "data")),
     "is not an expansion of the source's"),
    # --- Step 3
    ("finetune-not-a-run", lambda c: c.finetune(primary=c.dir("nowhere")), "is not an mmadapt run directory"),
    ("finetune-unknown-task", lambda c: c.finetune()[:2] + ["sentiment"] + c.finetune()[3:], "invalid choice"),
    ("finetune-own-task-no-file", lambda c: c.finetune()[:2] + ["classify"] + c.finetune()[3:],
     "--train_file is required"),
    ("finetune-lr", lambda c: c.finetune("--lr", "-1"), "lr must be > 0"),
    ("finetune-warmup", lambda c: c.finetune("--warmup_ratio", "1.5"), "warmup_ratio must be in [0, 1)"),
    ("finetune-pipeline", lambda c: c.finetune("--pipeline_model_parallel_size", "2"),
     "fine-tuning does not use pipeline parallelism"),
    ("finetune-zero3", lambda c: c.finetune("--ds_config", c.file("ds.json", ZERO3)), "uses ZeRO stage 3"),
    # --- Step 4
    ("evaluate-output-exists", lambda c: c.evaluate()[:-1] + [c.file("old.json", "[]")], "already exists"),
    ("evaluate-not-an-artifact", lambda c: c.evaluate(), "neither a Step-2 artifact nor an adapt run"),
    ("source-checkpoint-truncated", lambda c: c.minipost(primary=c.damaged_copy()), "cannot be read"),
    # --- report
    ("report-output-is-input", lambda c: ["report", c.records([RECORD]), "--output", str(c.tmp / "results.json")],
     "is one of the results files"),
    ("report-not-a-list", lambda c: ["report", c.records({"a": 1})], "is not a JSON list of records"),
    ("report-record-lacks-score", lambda c: ["report", c.records([{**RECORD, "score": None} | {}, {"system": "x"}])],
     "record 1 lacks 'task'"),
    ("report-not-json", lambda c: ["report", c.file("r.json", "not json")], "cannot read results file"),
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
    ("own-task-not-utf8", lambda c: c.own_task("t.csv", b"text,label\ncaf\xe9,pos\n"),
     "t.csv is not UTF-8 text (byte offset 14): save it as UTF-8"),
    ("squad-without-id", lambda c: c.own_task("q.json", json.dumps({"data": [{"paragraphs": [{
        "context": "In the beginning.", "qas": [{"question": "When?", "answers": []}]}]}]}), task="xquad"),
     "article 1, paragraph 1, question 1 has no 'id' text"),
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
    ("preprocess-sample-lines-zero", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir", str(c.out),
                                                "--tokenizer_sample_lines", "0"],
     "--tokenizer_sample_lines must be >= 1, got 0"),
    ("preprocess-tokenizer-and-other-vocab-size", lambda c: ["preprocess", "--corpus", str(c.corpus), "--output_dir",
                                                             str(c.out), "--tokenizer", str(c.tokenizer),
                                                             "--vocab_size", "2000"],
     f"has {VOCAB} pieces but the model's vocab_size is 2000"),
    ("report-score-nan", lambda c: ["report", c.file("nan.json", json.dumps([{**RECORD, "score": float("nan")}]))],
     "record 0 has score nan; scores and FLOPs are finite numbers"),
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
     "plugin_eval_blocks is a Step-2 setting"),
    # --- the decoder family
    ("decoder-given-mask-prob", lambda c: c.pretrain("--preset", "llama-tiny", "--mask_prob", "0.3"),
     "mask_prob 0.3 is a masked-LM setting; the llama family scores every next piece"),
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
]


def snapshot(*roots: Path):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for root in roots if root.exists() for p in [root, *root.rglob("*")]}


def test_the_table_is_long_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("build, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(build, message, tmp_path, corpus, tokenizer, primary_run, capsys):
    ctx = Ctx(tmp_path, corpus, tokenizer, primary_run)
    argv = build(ctx)
    before = snapshot(tmp_path, primary_run)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's error()
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert message in err, err
    assert snapshot(tmp_path, primary_run) == before


def test_bl_base_needs_no_mini_layers():
    """--num_layers 2 --recipe bl_base is a valid 2-layer model (mini_layers only shapes
    BL_SMALL and MINIJOINT)."""
    from mmadapt.cli import configs_from_args, pretrain_parser

    model, _ = configs_from_args(pretrain_parser().parse_args(
        ["--recipe", "bl_base", "--num_layers", "2", "--corpus", "x", "--output_dir", "y"]))
    assert model.num_layers == 2 and model.heads_after == (2,)
