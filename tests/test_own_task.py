"""Your own task (`--task classify|pair|tag`): CSV, TSV and JSON Lines with default and named
columns, labels from the training file, every bad input refused in one line before anything is
written, accuracy and macro-F1 (chunk F1 for B-/I-/O tags), a learnable toy task fine-tuned on
the packaged Bible, and Step-4 records from it that `mmadapt report` reads."""

import csv
import json
import random

import pytest
import torch

from conftest import REPO, base_args, run_pretrain
from mmadapt import adapt as A
from mmadapt import steps
from mmadapt.cli import finetune_main, finetune_parser, report_main
from mmadapt.config import FinetuneConfig, Layout, override
from mmadapt.corpora import bible_verses
from mmadapt.features import Encoded, is_bio, macro_f1
from mmadapt.family import WORD
from mmadapt.parallel import init_parallel
from mmadapt.readers import TaggedSentence, TextExample
from mmadapt.run import RunSpec, load_weights
from mmadapt.tasks import get_task, headline, label_names, read_examples, scores

NO_DROPOUT = Layout(hidden_dropout=0.0, attention_dropout=0.0)


def write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def write_csv(path, header: list[str], rows: list, delimiter: str = ","):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)
    return path


def write_jsonl(path, rows: list[dict]):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


# --- reading: formats, columns, labels ----------------------------------------------------------------

def test_csv_with_quoted_delimiters_and_newlines(tmp_path):
    f = write(tmp_path / "reviews.csv", 'text,label,id\n"Good, really good",pos,1\n"Two\nlines, ""quoted""",neg,2\n'
                                        "plain,pos,3\n")
    examples = read_examples(get_task("classify"), str(f), "en", "train")
    assert examples == [TextExample("Good, really good", "pos"), TextExample('Two\nlines, "quoted"', "neg"),
                        TextExample("plain", "pos")]
    assert label_names(get_task("classify"), examples) == ["neg", "pos"]


def test_tsv_pairs_default_and_named_columns(tmp_path):
    rows = [["A man sleeps.", "Nobody sleeps.", "contradiction"], ["It rains, a lot.", "It is wet.", "entailment"]]
    default = write_csv(tmp_path / "pairs.tsv", ["sentence1", "sentence2", "label"], rows, "\t")
    named = write_csv(tmp_path / "named.tsv", ["premise", "hypothesis", "gold"], rows, "\t")
    cfg = FinetuneConfig(text_column="premise", text_pair_column="hypothesis", label_column="gold")
    expect = [TextExample(a, lab, b) for a, b, lab in rows]
    assert read_examples(get_task("pair"), str(default), "en", "train") == expect
    assert read_examples(get_task("pair"), str(named), "en", "train", cfg) == expect


def test_jsonl_integer_labels_sort_by_value_and_map_strings_alike(tmp_path):
    f = write_jsonl(tmp_path / "stars.jsonl", [{"review": "fine", "stars": 10}, {"review": "bad", "stars": 2},
                                               {"review": "ok", "stars": 1}])
    t, cfg = get_task("classify"), FinetuneConfig(text_column="review", label_column="stars")
    train = read_examples(t, str(f), "en", "train", cfg)
    labels = label_names(t, train)
    assert labels == ["1", "2", "10"]  # by value, stored as strings
    # An evaluation file may write the same classes as strings (CSV always does), and hold a subset.
    write_csv(tmp_path / "stars.de.csv", ["review", "stars"], [["gut", "10"], ["schlecht", "2"]])
    assert [ex.label for ex in read_examples(t, str(tmp_path / "stars.{lang}.csv"), "de", "test", cfg, labels)] == [
        "10", "2"]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv"])
def test_tagging_in_every_format(tmp_path, fmt):
    sentences = [(["In", "the", "beginning"], ["O", "O", "B-TIME"]), (["Moses", "went"], ["B-PER", "O"])]
    if fmt in ("jsonl", "json"):
        f = write_jsonl(tmp_path / f"tags.{fmt}", [{"words": w, "ner": t} for w, t in sentences])
    else:
        f = write_csv(tmp_path / f"tags.{fmt}", ["words", "ner"], [[" ".join(w), " ".join(t)] for w, t in sentences],
                      "\t" if fmt == "tsv" else ",")
    cfg = FinetuneConfig(text_column="words", label_column="ner")
    got = read_examples(get_task("tag"), str(f), "en", "train", cfg)
    assert got == [TaggedSentence(w, t) for w, t in sentences]
    assert label_names(get_task("tag"), got) == ["B-PER", "B-TIME", "O"]
    default = write_jsonl(tmp_path / "default.jsonl", [{"tokens": w, "tags": t} for w, t in sentences])
    assert read_examples(get_task("tag"), str(default), "en", "train") == got


def test_files_without_a_header_line_take_column_numbers(tmp_path):
    """--text_column 0 --label_column 1: a CSV/TSV file with no header line (a spreadsheet's BOM
    ignored), columns counted from 0, other columns left alone; pairs and tags alike."""
    f = tmp_path / "plain.csv"
    f.write_bytes("\ufeffGood, really good,pos,1\nplain,neg,2\n".encode("utf-8").replace(b"Good, really good",
                                                                                         b'"Good, really good"'))
    cfg = FinetuneConfig(text_column="0", label_column="1")
    assert read_examples(get_task("classify"), str(f), "en", "train", cfg) == [
        TextExample("Good, really good", "pos"), TextExample("plain", "neg")]
    # Column 2 is the label instead: the same file, other columns.
    assert [ex.label for ex in read_examples(get_task("classify"), str(f), "en", "train",
                                             FinetuneConfig(text_column="0", label_column="2"))] == ["1", "2"]
    pairs = write(tmp_path / "pairs.tsv", "yes\tA man sleeps.\tA man rests.\n")
    cfg = FinetuneConfig(text_column="1", text_pair_column="2", label_column="0")
    assert read_examples(get_task("pair"), str(pairs), "en", "train", cfg) == [
        TextExample("A man sleeps.", "yes", "A man rests.")]
    tags = write(tmp_path / "tags.tsv", "In the beginning\tO O B-TIME\n")
    assert read_examples(get_task("tag"), str(tags), "en", "train", FinetuneConfig(text_column="0", label_column="1")) \
        == [TaggedSentence(["In", "the", "beginning"], ["O", "O", "B-TIME"])]
    # A file with a header line read by number would read the header as a row: names are for those.
    named = write(tmp_path / "named.csv", "text,label\nfine,pos\n")
    assert len(read_examples(get_task("classify"), str(named), "en", "train",
                             FinetuneConfig(text_column="0", label_column="1"))) == 2


def test_column_flags_are_finetune_config_fields():
    args = finetune_parser().parse_args(["--task", "pair", "--primary", "p", "--output_dir", "o", "--text_column", "q",
                                         "--text_pair_column", "a", "--label_column", "y", "--metric", "macro_f1"])
    cfg = override(FinetuneConfig(), args)
    assert (cfg.text_column, cfg.text_pair_column, cfg.label_column, cfg.metric) == ("q", "a", "y", "macro_f1")
    helps = {a.dest: a.help for a in finetune_parser()._actions}
    assert "text for classify, sentence1 for pair, tokens for tag" in helps["text_column"]
    assert "label for classify, label for pair, tags for tag" in helps["label_column"]


# --- metrics from hand-built logits ---------------------------------------------------------------------

def test_classification_scores_accuracy_and_macro_f1():
    gold, pred = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 1, 0])
    # Per class F1 = 2tp / (2tp + fp + fn): class 0 2/4, class 1 4/5, class 2 0 -> mean 43.33.
    assert macro_f1(pred, gold) == pytest.approx(100 * (0.5 + 0.8 + 0.0) / 3)
    logits = torch.nn.functional.one_hot(pred, 3).float()
    enc = Encoded(torch.ones(5, 4, dtype=torch.long), gold)
    t, labels = get_task("classify"), ["a", "b", "c"]
    got = scores(t, logits, enc, [], labels, FinetuneConfig())
    assert got == {"accuracy": pytest.approx(60.0), "macro_f1": pytest.approx(43.333, abs=1e-3)}
    assert headline(t, labels, FinetuneConfig()) == "accuracy"
    assert headline(t, labels, FinetuneConfig(metric="macro_f1")) == "macro_f1"


def test_tagging_scores_chunk_f1_only_for_bio_tags():
    assert is_bio(["B-PER", "I-PER", "O"]) and not is_bio(["NOUN", "O"]) and not is_bio(["O"])
    labels = torch.tensor([[-100, 0, 1, 2, -100]])
    enc = Encoded(torch.ones(1, 5, dtype=torch.long), labels)
    logits = torch.nn.functional.one_hot(torch.tensor([[2, 0, 2, 2, 2]]), 3).float()
    t = get_task("tag")
    # Gold PER(0-2); predicted PER(0-1): no chunk right; tokens 2 of 3.
    assert scores(t, logits, enc, [], ["B-PER", "I-PER", "O"], FinetuneConfig()) == {
        "accuracy": pytest.approx(200 / 3), "chunk_f1": 0.0}
    assert set(scores(t, logits, enc, [], ["DET", "NOUN", "VERB"], FinetuneConfig())) == {"accuracy"}
    assert headline(t, ["B-PER", "I-PER", "O"], FinetuneConfig(metric="chunk_f1")) == "chunk_f1"
    with pytest.raises(ValueError, match="--metric chunk_f1 does not apply to tag with these tags: choose accuracy"):
        headline(t, ["DET", "NOUN"], FinetuneConfig(metric="chunk_f1"))


# --- bad input: one line, exit 2, nothing written -------------------------------------------------------

@pytest.fixture(scope="module")
def fresh_primary(corpus, tokenizer, tmp_path_factory):
    """A tiny MINIJOINT primary model one update from an init of std 0.07 (the demo's, for h = 64).

    Not the session's `primary_run`: its 150 updates at the preset's std 0.02 put the 12 x 64
    post-LayerNorm model on the unigram plateau, where its last layer is the same for every input
    (std across verses ~1e-6, see README "The demo"), and fine-tuning from it stays at chance
    whatever the label. A fresh model still passes its input up."""
    out = tmp_path_factory.mktemp("fresh_primary")
    run_pretrain(1, *base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--train_iters", "1",
                               "--save_interval", "1", "--init_method_std", "0.07"))
    return out


GOOD = "text,label\nWhat a fine day,pos\nA grim day,neg\n"


@pytest.mark.parametrize("task, train, evaluation, extra, message", [
    ("classify", ("t.csv", "sentence,label\nhi,pos\n"), None, [],
     "t.csv has no column 'text' (its columns: 'sentence', 'label'): name the right one with --text_column"),
    ("classify", ("t.csv", GOOD), ("e.csv", "text,label\nno idea,maybe\n"), [],
     "e.csv has the label 'maybe', which the model was not trained on (its labels: neg, pos)"),
    ("classify", ("t.csv", 'text,label\nfine,pos\n" ",neg\n'), None, [], "t.csv, row 2: empty text in column 'text'"),
    ("pair", ("t.tsv", "sentence1\tsentence2\tlabel\na\t\tyes\n"), None, [],
     "t.tsv, row 1: empty text in column 'sentence2'"),
    ("classify", ("t.csv", "text,label\n"), None, [], "t.csv holds no rows under its header line"),
    ("classify", ("t.jsonl", ""), None, [], "t.jsonl holds no rows"),
    ("classify", ("t.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n'), None, [],
     "the labels mix integers and strings (e.g. 1 and 'pos'): write every label the same way"),
    ("classify", ("t.xlsx", GOOD), None, [], "t.xlsx: unknown file type '.xlsx'; your own data is read from .csv, "
     ".tsv, .jsonl, .json"),
    ("classify", ("t.csv", "text,label\nhi,\n"), None, [], "t.csv, row 1: no label in column 'label'"),
    ("classify", ("t.jsonl", '{"text": "a", "label": 1.5}\n'), None, [],
     "row 1: no label in column 'label' (1.5 is neither a string nor an integer)"),
    ("classify", ("t.jsonl", '{"text": "a", "label": 1}\nnot json\n'), None, [], "t.jsonl:2: not JSON"),
    ("classify", ("t.csv", GOOD), None, ["--text_pair_column", "x"], "--text_pair_column is for --task pair"),
    ("classify", ("t.csv", GOOD), None, ["--metric", "chunk_f1"],
     "--metric chunk_f1 does not apply to classify: choose accuracy or macro_f1"),
    ("tag", ("t.jsonl", '{"tokens": ["a", "b"], "tags": ["O"]}\n'), None, [],
     "t.jsonl, row 1: 2 tokens but 1 tags: give one tag per token"),
    ("tag", ("t.jsonl", '{"tokens": ["a"], "tags": ["B-X"]}\n'), ("e.jsonl", '{"tokens": ["b"], "tags": ["I-Y"]}\n'),
     [], "e.jsonl has the label 'I-Y', which the model was not trained on (its labels: B-X)"),
], ids=["missing_column", "unseen_eval_label", "empty_text", "empty_second_text", "no_rows", "empty_jsonl",
        "mixed_label_types", "unknown_extension", "no_label", "float_label", "bad_json_line", "pair_column_for_classify",
        "metric_for_kind", "tags_per_token", "unseen_eval_tag"])
def test_bad_input_is_one_error_line_and_writes_nothing(fresh_primary, tmp_path, capsys, task, train, evaluation,
                                                         extra, message):
    paths = []
    for name, text in filter(None, (train, evaluation)):
        paths.append(write(tmp_path / name, text))
    out = tmp_path / "run"
    argv = ["--task", task, "--primary", str(fresh_primary), "--train_file", str(paths[0]), "--output_dir", str(out),
            *(["--eval_file", str(paths[1])] if evaluation else []), *extra]
    assert finetune_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err, err
    assert len(err.splitlines()) == 1, err
    assert not out.exists()


# --- a learnable toy task, Step 3 and Step 4 ---------------------------------------------------------------

# Label: does an English (KJV) verse name "the LORD"? The testament of a verse was the first
# choice, but from a model this small and fresh it reaches only 60-66% on held-out verses; one
# frequent word is learnable in 113 updates (76-93% over seeds 1-8).
PER_CLASS_TRAIN, PER_CLASS_TEST = 300, 100


def lord_verses() -> tuple[list, list]:
    """(train, test): ((book, chapter, verse), text, label) of disjoint balanced samples."""
    by_label = {"lord": [], "other": []}
    for b, c, v, text in bible_verses("en"):
        if len(text) >= 20:
            by_label["lord" if "LORD" in text else "other"].append(((b, c, v), text))
    rng = random.Random(0)
    train, test = [], []
    for label, verses in sorted(by_label.items()):
        picked = rng.sample(verses, PER_CLASS_TRAIN + PER_CLASS_TEST)
        train += [(k, t, label) for k, t in picked[:PER_CLASS_TRAIN]]
        test += [(k, t, label) for k, t in picked[PER_CLASS_TRAIN:]]
    return train, test


@pytest.fixture(scope="module")
def toy_run(fresh_primary, tmp_path_factory):
    """Step 3 on the toy task, from a CSV with named columns; the evaluation files beside it."""
    init_parallel(1, 1)
    d = tmp_path_factory.mktemp("own_task")
    train, test = lord_verses()
    header = ["ref", "verse", "names_the_lord"]
    write_csv(d / "train.csv", header, [[f"{k}", t, lab] for k, t, lab in train])
    write_csv(d / "verses.en.csv", header, [[f"{k}", t, lab] for k, t, lab in test])
    # German text of the same held-out verses, labelled by the English verse.
    de = {(b, c, v): t for b, c, v, t in bible_verses("de")}
    write_csv(d / "verses.de.csv", header, [[f"{k}", de[k], lab] for k, _, lab in test if k in de])
    cfg = FinetuneConfig(seq_length=48, train_micro_batch_size_per_gpu=16, epochs=3.0, lr=5e-4, log_interval=10,
                         text_column="verse", label_column="names_the_lord")
    summary, _ = steps.finetune(run=RunSpec(output_dir=d / "ft", ds_config=REPO / "ds_configs" / "zero0.json",
                                            layout=NO_DROPOUT),
                                step=steps.Finetune(task="classify", primary=fresh_primary, cfg=cfg,
                                                    train_file=str(d / "train.csv"),
                                                    eval_file=str(d / "verses.{lang}.csv")))
    return d, summary


def test_the_toy_task_is_learned(toy_run):
    d, summary = toy_run
    run = json.loads((d / "ft" / "run.json").read_text())
    assert run["labels"] == ["lord", "other"] and run["metric"] == "accuracy"
    assert run["finetune"]["text_column"] == "verse" and run["finetune"]["label_column"] == "names_the_lord"
    assert summary["updates"] == 113  # 3 epochs of 600 verses in batches of 16
    acc, f1 = run["source_scores"]["accuracy"], run["source_scores"]["macro_f1"]
    assert run["source_score"] == acc
    # Balanced held-out classes, chance 50%; 200 verses put chance + 3 std at about 61%.
    assert acc > 65, run["source_scores"]
    assert f1 > 60, run["source_scores"]  # balanced classes: near accuracy unless one class swallows the other


def _artifact(path, system, lang, emb, tokenizer, source, step):
    meta = {"system": system, "lang": lang, "step": step, "source": str(source), "flops": 1e12 * step,
            "flops_paper": 1e12 * step, "v100_days": 1e-6 * step, "tokens": 1000 * step}
    return A.write_artifact(path, {"word_embeddings": emb, "output_bias": torch.zeros(len(emb))}, tokenizer, meta)


def test_zero_shot_records_go_into_the_report(toy_run, fresh_primary, de_tokenizer, tmp_path, capsys):
    d, _ = toy_run
    run = json.loads((d / "ft" / "run.json").read_text())
    # The primary's own English embeddings and tokenizer: the swap changes nothing, so Step 4
    # must reproduce Step 3's scores. German: embeddings of the right shape, never trained.
    english = load_weights(fresh_primary)[1][WORD]
    german = torch.randn(1000, english.shape[1], generator=torch.Generator().manual_seed(0)) * 0.07
    arts = [_artifact(tmp_path / "en", "bl_base", "en", english, fresh_primary / "tokenizer" / "spm.model",
                      fresh_primary, 1),
            _artifact(tmp_path / "de", "bl_base", "de", german, de_tokenizer, fresh_primary, 1)]
    out = tmp_path / "records.json"
    records = steps.evaluate([d / "ft"], embeddings=arts, eval_file=str(d / "verses.{lang}.csv"), output=out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    en, de = records
    assert (en["task"], en["lang"], de["lang"], en["metric"]) == ("classify", "en", "de", "accuracy")
    assert en["score"] == pytest.approx(run["source_score"]) and en["scores"] == pytest.approx(run["source_scores"])
    assert set(de["scores"]) == {"accuracy", "macro_f1"} and de["score"] == de["scores"]["accuracy"]
    assert 0 <= de["scores"]["macro_f1"] <= 100
    # Full-model embeddings over the MINIJOINT primary are its ceiling: the report is measured against it.
    assert {r["system"] for r in records} == {"minijoint:full"}
    assert report_main([str(out), "--baseline", "minijoint:full"]) == 0
    assert "## classify: score at the last checkpoint" in capsys.readouterr().out

    # A target file with a class the run never saw is refused by name, and no records are written.
    write_csv(tmp_path / "bad.de.csv", ["verse", "names_the_lord"], [["Im Anfang", "lord"], ["Und Gott", "god"]])
    with pytest.raises(ValueError, match="bad.de.csv has the label 'god', which the model was not trained on"):
        steps.evaluate([d / "ft"], embeddings=arts[1:], eval_file=str(tmp_path / "bad.{lang}.csv"),
                       output=tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_tagging_end_to_end_with_bio_tags(fresh_primary, tmp_path):
    """Step 3 and the source score for a tagging file (JSON Lines, default columns): a BIO tag set
    is scored by accuracy and chunk F1."""
    init_parallel(1, 1)
    rows = []
    for _, _, _, text in bible_verses("en", range(1, 2)):
        words = text.split()[:20]
        rows.append({"tokens": words, "tags": ["B-LORD" if w.strip(",.;:") == "LORD" else "O" for w in words]})
        if len(rows) == 64:
            break
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = FinetuneConfig(seq_length=48, train_micro_batch_size_per_gpu=16, epochs=1.0, lr=5e-4, log_interval=1)
    summary, _ = steps.finetune(run=RunSpec(output_dir=tmp_path / "ft", ds_config=REPO / "ds_configs" / "zero0.json",
                                            layout=NO_DROPOUT),
                                step=steps.Finetune(task="tag", primary=fresh_primary, cfg=cfg,
                                                    train_file=str(tmp_path / "train.jsonl"),
                                                    eval_file=str(tmp_path / "train.jsonl")))
    assert summary["labels"] == ["B-LORD", "O"] and summary["updates"] == 4
    assert set(summary["source_scores"]) == {"accuracy", "chunk_f1"}
    assert summary["source_score"] == summary["source_scores"]["accuracy"]
