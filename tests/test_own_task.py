"""Your own task (`--task classify|pair|tag`): CSV, TSV and JSON Lines with default and named
columns, labels from the training file, every bad input refused in one line before anything is
written, accuracy and macro-F1 (chunk F1 for B-/I-/O tags), a learnable toy task fine-tuned on
the packaged Bible, and Step-4 records from it that `mmadapt report` reads."""

import csv
import dataclasses
import json
import random
import re
import shutil

import pytest
import torch

from conftest import REPO, base_args, pretrain_here
from mmadapt.artifact import write_artifact
from mmadapt import faults, steps
from mmadapt.cli import finetune_main, finetune_parser, finetune_summary, report_main
from mmadapt.config import FinetuneConfig, Layout, override
from mmadapt.corpora import bible_verses
from mmadapt.features import Encoded, is_bio, macro_f1
from mmadapt.family import WORD
from mmadapt.parallel import init_parallel
from mmadapt.readers import TaggedSentence, TextExample
from mmadapt.run import RunSpec, load_weights, run_fingerprint
from mmadapt.finetune import at_chance, label_counts
from mmadapt.tasks import chance_levels, get_task, headline, label_names, read_examples, scores

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


def test_a_tsv_text_starting_with_a_quote_is_refused_not_merged(tmp_path):
    """A .tsv written without quoting, one of whose texts starts with a quote: read as a quoted
    field, it swallowed the rows after it up to the next quote (4 rows read as 2, with the
    right number of fields each); refused naming the line it starts on. Texts quoted as csv
    writes them (a quote inside, a tab, a line end, a quote first) read as written."""
    for closing, what in (('She said "yes"', "a quoted field is followed by more text"),  # csv strict's
                          ('She said yes"', "a field runs over several lines and holds tabs")):
        f = write(tmp_path / "t.tsv", f'text\tlabel\nfine\tneg\n"Hi there\tpos\nNormal\tneg\n{closing}\tpos\n'
                                      'Last\tneg\n')
        with pytest.raises(ValueError, match=rf'^{re.escape(str(f))}:3: {what}: a text starting with a quote \(\"\) '
                                             'is read as a quoted field'):
            read_examples(get_task("classify"), str(f), "en", "train")
    texts = ['She said "yes"', "a\tb", "two\nlines", '"quoted" first']
    quoted = write_csv(tmp_path / "quoted.tsv", ["text", "label"], [[t, "pos"] for t in texts], "\t")
    assert [e.text for e in read_examples(get_task("classify"), str(quoted), "en", "train")] == texts
    # A text holding a tab and a line end both, quoted as csv writes it: not told apart from a
    # stray quote's swallowed rows in a .tsv, so refused, with the formats that read it as written
    both = [*texts, "Title:\tGenesis\nIn the beginning"]
    quoted = write_csv(tmp_path / "both.tsv", ["text", "label"], [[t, "pos"] for t in both], "\t")
    with pytest.raises(ValueError, match=re.escape("both.tsv:7: a field runs over several lines and holds tabs") +
                       ".*" + re.escape("(a text that holds tabs and line ends both: write the file as .csv or .jsonl)")):
        read_examples(get_task("classify"), str(quoted), "en", "train")
    for f in (write_csv(tmp_path / "both.csv", ["text", "label"], [[t, "pos"] for t in both]),
              write_jsonl(tmp_path / "both.jsonl", [{"text": t, "label": "pos"} for t in both])):
        assert [e.text for e in read_examples(get_task("classify"), str(f), "en", "train")] == both


def test_a_text_starting_with_a_quoted_word_is_refused_not_unquoted(tmp_path):
    """'"Hi" there' unquoted (a .tsv or .csv written without quoting): csv read the quoted word as
    the field's quotes and dropped them ('Hi there'), silently; a quote opened and never closed
    took the rest of the file as one field. Both refused naming the row's line."""
    for name, text, line, what in (("t.tsv", 'text\tlabel\nfine\tneg\n"Hi" there\tpos\nok\tneg\n', 3,
                                    "a quoted field is followed by more text"),
                                   ("t.csv", 'text,label\nfine,neg\n"Hi" there,pos\n', 3,
                                    "a quoted field is followed by more text"),
                                   ("u.tsv", 'text\tlabel\nfine\tneg\nok\tneg\n"Hi there\tpos\nok\tneg\n', 4,
                                    "a quoted field runs to the end of the file")):
        f = write(tmp_path / name, text)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(f))}:{line}: {what}: a text starting with a quote"):
            read_examples(get_task("classify"), str(f), "en", "train")


def test_a_blank_label_is_no_label(tmp_path):
    """A label of blanks alone (a CSV field ' ', a JSON "  ") is refused as a missing one: it is a
    string, and the refusal said it was neither a string nor an integer."""
    for name, text in (("t.csv", "text,label\nfine,pos\ngrim, \n"), ("t.jsonl", '{"text": "a", "label": "x"}\n'
                                                                                 '{"text": "b", "label": "  "}\n')):
        f = write(tmp_path / name, text)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(f))}, row 2: no label in column 'label'$"):
            read_examples(get_task("classify"), str(f), "en", "train")


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


def test_an_empty_list_written_in_a_tag_cell_is_refused_as_an_empty_row(tmp_path):
    """A CSV/TSV tag cell holding '[]' (an empty list written out) was read as the word '[]' tagged
    '[]': a class of its own, and chunk F1 refused for the file; JSON Lines refused the row."""
    for tokens, tags, what in (("[]", "[]", "empty text in column 'tokens'"),
                               ('["In", "the"]', "[]", "2 tokens but 0 tags: give one tag per token")):
        f = write_csv(tmp_path / "tags.csv", ["tokens", "tags"], [["In the beginning", "O O B-TIME"], [tokens, tags]])
        with pytest.raises(ValueError, match=re.escape(f"{f}, row 2: {what}")):
            read_examples(get_task("tag"), str(f), "en", "train")
    f = write_jsonl(tmp_path / "tags.jsonl", [{"tokens": ["In"], "tags": ["O"]}, {"tokens": [], "tags": []}])
    with pytest.raises(ValueError, match=re.escape(f"{f}, row 2: empty text in column 'tokens'")):
        read_examples(get_task("tag"), str(f), "en", "train")


def test_a_json_lines_row_naming_a_column_twice_is_refused(tmp_path):
    """json.loads keeps the last of a key given twice: {"text": "a", "text": "b"} was read as "b",
    silently (a header line naming a column twice is refused)."""
    f = write(tmp_path / "t.jsonl", '{"text": "a", "label": "x"}\n{"text": "a", "text": "b", "label": "x"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: the object names 'text' twice: give each column once")):
        read_examples(get_task("classify"), str(f), "en", "train")


def test_files_without_a_header_line_take_column_numbers(tmp_path, capsys, monkeypatch):
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
    # A file with a header line read by number read the header as a row, its column name a class:
    # refused where the first row's label is the task's label column name, seen once
    named = write(tmp_path / "named.csv", "text,label\nfine,pos\ngood,pos\n")
    with pytest.raises(ValueError, match="named.csv: its first row is labelled 'label', once: a header line"):
        read_examples(get_task("classify"), str(named), "en", "train",
                      FinetuneConfig(text_column="0", label_column="1"))
    # another name for the label column: its class is seen once, the others often; maybe a real
    # example, so said on stderr (it trained as a class of its own without a word)
    other = write(tmp_path / "other.csv", "sentence,category\n" + "fine,pos\ngood,pos\nbad,neg\nawful,neg\n")
    assert len(read_examples(get_task("classify"), str(other), "en", "train",
                             FinetuneConfig(text_column="0", label_column="1"))) == 5
    assert capsys.readouterr().err == (f"warning: {other}: its first row is labelled 'category', a label no other row "
                                       "has: if it is a header line, name the columns instead of numbering them "
                                       "(--text_column <its name>, ...); read as an example\n")
    from mmadapt import parallel
    monkeypatch.setattr(parallel, "is_rank0", lambda: False)  # every rank reads the file: rank 0 alone says so
    read_examples(get_task("classify"), str(other), "en", "train", FinetuneConfig(text_column="0", label_column="1"))
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    named_tags = write(tmp_path / "named.tsv", "tokens\ttags\nIn the\tO O\n")
    with pytest.raises(ValueError, match="its first row is labelled 'tags', once"):
        read_examples(get_task("tag"), str(named_tags), "en", "train",
                      FinetuneConfig(text_column="0", label_column="1"))


def test_rows_a_writer_meant_otherwise_are_refused_or_read_as_meant(tmp_path):
    """Two exports joined (the second's header a row), labels differing only in case (one class to
    the writer, two to the run), and a tag task's lists written as text in a CSV cell (a JSON list,
    pandas' Python list): the first two refused in one line, the lists read as lists."""
    joined = write(tmp_path / "joined.csv", "text,label\nfine,pos\ntext,label\nbad,neg\n")
    with pytest.raises(ValueError, match=r"joined.csv:3: this row repeats the header line \(files joined\?\)"):
        read_examples(get_task("classify"), str(joined), "en", "train")
    cased = write_csv(tmp_path / "cased.csv", ["text", "label"], [["a", "pos"], ["b", "Pos"], ["c", "neg"]])
    with pytest.raises(ValueError, match="the labels 'Pos' and 'pos' differ only in case"):
        read_examples(get_task("classify"), str(cased), "en", "train")
    lists = write_csv(tmp_path / "lists.csv", ["tokens", "tags"], [['["John", "ran"]', '["B-PER", "O"]'],
                                                                   ["['Mary', 'sat']", "['B-PER', 'O']"],
                                                                   ["[ hello ]", "O B-X O"]])
    assert read_examples(get_task("tag"), str(lists), "en", "train") == [
        TaggedSentence(["John", "ran"], ["B-PER", "O"]), TaggedSentence(["Mary", "sat"], ["B-PER", "O"]),
        TaggedSentence(["[", "hello", "]"], ["O", "B-X", "O"])]


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



# --- chance levels, and a fine-tune that learned nothing ----------------------------------------------

def test_chance_levels_by_hand():
    """The majority predictor's score under each metric, on the rows as encoded."""
    cfg = FinetuneConfig()
    # Classify: gold a a b c a -> always a: accuracy 3/5; macro-F1 over a, b, c: (2*3 / (2*3 + 2) + 0 + 0) / 3.
    enc = Encoded(torch.ones(5, 4, dtype=torch.long), torch.tensor([0, 0, 1, 2, 0]))
    got = chance_levels(get_task("classify"), enc, [], ["a", "b", "c"], cfg)
    assert got == {"chance": pytest.approx(60.0), "majority_accuracy": pytest.approx(60.0),
                   "uniform_accuracy": pytest.approx(100 / 3), "scored_items": 5}
    macro = chance_levels(get_task("classify"), enc, [], ["a", "b", "c"], FinetuneConfig(metric="macro_f1"))
    assert macro["chance"] == pytest.approx(100 * 0.75 / 3) and macro["majority_accuracy"] == pytest.approx(60.0)
    # Tag: only the scored tokens (not -100) count; gold B-X O O O <unseen> (id 2) -> always O:
    # 3 of 5, and no chunk predicted (chunk F1 0).
    labels = torch.tensor([[-100, 0, 1, 1, -100], [-100, 1, 2, -100, -100]])
    enc = Encoded(torch.ones(2, 5, dtype=torch.long), labels)
    tag = chance_levels(get_task("tag"), enc, [], ["B-X", "O"], cfg)
    assert tag == {"chance": pytest.approx(60.0), "majority_accuracy": pytest.approx(60.0),
                   "uniform_accuracy": pytest.approx(50.0), "scored_items": 5}
    assert chance_levels(get_task("tag"), enc, [], ["B-X", "O"], FinetuneConfig(metric="chunk_f1"))["chance"] == 0.0
    # A tag the model cannot predict (unseen in training) is never the majority prediction: gold
    # <unseen> x3, B-X, O -> the first seen tag with the top count, B-X: 1 of 5.
    enc = Encoded(torch.ones(1, 6, dtype=torch.long), torch.tensor([[-100, 2, 2, 2, 0, 1]]))
    assert chance_levels(get_task("tag"), enc, [], ["B-X", "O"], cfg)["majority_accuracy"] == pytest.approx(20.0)
    assert chance_levels(get_task("mlqa"), enc, [], [], cfg) is None  # spans: no chance level


def test_at_chance_by_hand():
    """Balanced two classes: the chance loss is ln 2 = 0.6931; labels 3:1, the entropy
    -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623 (what predicting the frequencies costs). Majority 50%
    on 200 items: 95% interval up to 50 + 1.96 * sqrt(0.25 / 200) * 100 = 56.93."""
    chance = {"chance": 50.0, "majority_accuracy": 50.0, "uniform_accuracy": 50.0, "scored_items": 200}
    both = at_chance("classify", [300, 300], [0.71, 0.6932], 55.0, chance)
    assert [w.split(" (")[0] for w in both] == [
        "the training loss never dropped below the chance loss 0.693",
        "the source-language accuracy 55.0 is not above chance beyond noise"]
    assert "whose 95% interval on 200 items reaches 56.9" in both[1]
    assert at_chance("classify", [300, 300], [0.71, 0.60], 58.0, chance) == []
    assert at_chance("classify", [300, 300], [0.71, 0.60], None, None) == []  # no evaluation file: the loss alone
    # Imbalanced labels: below ln 2 is not enough, below their entropy is.
    assert "chance loss 0.562" in at_chance("tag", [75, 25], [0.60, 0.57], None, None)[0]
    assert at_chance("tag", [75, 25], [0.60, 0.55], None, None) == []
    assert at_chance("span", [], [9.0], 0.0, None) == []
    # one class among the counts (a built-in task's data): its entropy 0 said as 0.000, not -0.000
    assert "chance loss 0.000 (" in at_chance("tag", [0, 40], [0.0], None, None)[0]


def test_label_counts():
    enc = Encoded(torch.ones(2, 4, dtype=torch.long), torch.tensor([[-100, 1, 1, 2], [-100, 0, -100, -100]]))
    assert label_counts(get_task("tag"), enc, ["a", "b", "c"]) == [1, 2, 1]
    enc = Encoded(torch.ones(3, 4, dtype=torch.long), torch.tensor([1, 1, 0]))
    assert label_counts(get_task("classify"), enc, ["a", "b", "c"]) == [1, 2, 0]

# --- bad input: one line, exit 2, nothing written -------------------------------------------------------

@pytest.fixture(scope="module")
def fresh_primary(corpus, tokenizer, tmp_path_factory):
    """A tiny MINIJOINT primary model one update from the preset's init: the toy tasks were
    tuned on it, and one update costs a second (the updates of the session's `primary_run`
    take longer: tests/test_tiny_preset.py fine-tunes from a 60-update preset model)."""
    out = tmp_path_factory.mktemp("fresh_primary")
    pretrain_here(*base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--train_iters", "1",
                             "--save_interval", "1"))
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
    ("tag", ("t.jsonl", '{"tokens": ["a", "c"], "tags": ["B-X", "O"]}\n'),
     ("e.jsonl", '{"tokens": ["b"], "tags": ["I-Y"]}\n'),
     [], "e.jsonl has the label 'I-Y', which the model was not trained on (its labels: "),
    ("classify", ("t.csv", GOOD), None, ["--seq_length", "128"],
     "--seq_length 128 is longer than the 64-piece blocks"),
    ("xnli", ("t.tsv", GOOD), None, ["--label_column", "gold_label"],
     "--label_column names a column of your own data (--task classify, pair or tag); xnli reads its files in their "
     "own format: drop it"),
    ("classify", ("t.csv", GOOD), None, ["--doc_stride", "64"],
     "--doc_stride is for question answering (xquad, mlqa), which classify is not: drop it"),
    ("classify", ("t.csv", GOOD), None, ["--calculate_per_token_loss", "false"],
     "--calculate_per_token_loss weighs a tag task's micro-batches by their tagged words; classify scores one per "
     "row, the same either way: drop it"),
], ids=["missing_column", "unseen_eval_label", "empty_text", "empty_second_text", "no_rows", "empty_jsonl",
        "mixed_label_types", "unknown_extension", "no_label", "float_label", "bad_json_line", "pair_column_for_classify",
        "metric_for_kind", "tags_per_token", "unseen_eval_tag", "seq_length_past_pretraining",
        "column_for_a_known_task", "qa_field_for_classify",
        "per_token_loss_for_classify"])
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



def test_a_resume_over_an_edited_training_file_is_refused(fresh_primary, tmp_path, capsys):
    """Stopped at update 1, its file edited (two labels swapped: the same rows, labels and
    counts, so nothing else recorded differs), --resume is refused in one line and leaves the
    run as it was; the file restored, it resumes."""
    init_parallel(1, 1)
    rows = [("What a fine day", "pos"), ("A grim day", "neg"), ("Light and joy", "pos"), ("Dark and cold", "neg")] * 4
    def text(rows):
        return "text,label\n" + "".join(f"{t},{label}\n" for t, label in rows)
    write(tmp_path / "t.csv", text(rows))
    out = tmp_path / "run"
    argv = ["--task", "classify", "--primary", str(fresh_primary), "--train_file", str(tmp_path / "t.csv"),
            "--seq_length", "32", "--train_micro_batch_size_per_gpu", "4", "--epochs", "1", "--output_dir", str(out),
            "--ds_config", str(REPO / "ds_configs" / "zero0.json")]
    assert finetune_main([*argv, "--exit_interval", "1"]) == faults.EXIT_PAUSED
    record = (out / "run.json").read_text()
    swapped = {"pos": "neg", "neg": "pos"}
    edited = [(t, swapped[label] if i < 2 else label) for i, (t, label) in enumerate(rows)]
    write(tmp_path / "t.csv", text(edited))
    capsys.readouterr()
    assert finetune_main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --resume of a changed run: the rows of {tmp_path / 't.csv'} (its examples, as the "
                   f"primary's tokenizer encodes them) are not those {out / 'run.json'} recorded (the file edited, "
                   "or the tokenizer replaced?); resume with that data, or start a new --output_dir"), err
    assert (out / "run.json").read_text() == record
    write(tmp_path / "t.csv", text(rows))
    assert finetune_main([*argv, "--resume"]) == 0
    assert json.loads((out / "run.json").read_text())["updates"] == 4


def test_every_languages_evaluation_file_is_read_before_any_is_scored(fresh_primary, de_tokenizer, tmp_path,
                                                                     monkeypatch, capsys):
    """Step 4 read each language's file when it came to score it: a missing fr file (or one with
    a label the model never saw) was refused after every en artifact had been scored, minutes of
    work on real runs. Every file is read and checked first."""
    init_parallel(1, 1)
    write(tmp_path / "t.csv", GOOD)
    write(tmp_path / "en.csv", GOOD)
    write(tmp_path / "de.csv", "text,label\nein Tag,maybe\n")
    assert finetune_main(["--task", "classify", "--primary", str(fresh_primary), "--train_file",
                          str(tmp_path / "t.csv"), "--seq_length", "64", "--train_micro_batch_size_per_gpu", "2",
                          "--output_dir", str(tmp_path / "ft"), "--ds_config", str(REPO / "ds_configs" / "zero0.json")
                          ]) == 0
    assert "global batch" not in capsys.readouterr().out  # 2 rows, a batch of 2: no note
    english = load_weights(fresh_primary)[1][WORD]
    arts = [_artifact(tmp_path / "en", "bl_base", "en", english, fresh_primary / "tokenizer" / "spm.model",
                      fresh_primary, 1),
            _artifact(tmp_path / "de", "bl_base", "de", english.clone()[:1000], de_tokenizer, fresh_primary, 1)]
    from mmadapt.evaluate import Scoring

    monkeypatch.setattr(Scoring, "_fields", lambda *a: pytest.fail("an artifact was scored before every file was read"))
    with pytest.raises(ValueError, match="de.csv has the label 'maybe', which the model was not trained on"):
        steps.evaluate([tmp_path / "ft"], embeddings=arts, eval_file=str(tmp_path / "{lang}.csv"))


def test_positions_past_the_pretraining_blocks_only_when_allowed(fresh_primary, tmp_path, capsys):
    """fresh_primary was pretrained on 64-piece blocks. --allow_untrained_positions fine-tunes
    at 96 with a warning in the log and run.json; Step 4 then evaluates the run (its record
    allows it) with the warning on every record. A run recorded without the allowance (as runs
    before the check were) is refused by Step 4 unless its flag is given; the plug-in metric
    defaults to the primary's block length and refuses a longer one."""
    init_parallel(1, 1)
    write(tmp_path / "t.csv", GOOD)
    out = tmp_path / "long"
    capsys.readouterr()
    assert finetune_main(["--task", "classify", "--primary", str(fresh_primary), "--train_file", str(tmp_path / "t.csv"),
                          "--seq_length", "96", "--allow_untrained_positions", "true", "--output_dir", str(out),
                          "--ds_config", str(REPO / "ds_configs" / "zero0.json")]) == 0
    what = f"seq_length 96 is longer than the 64-piece blocks {fresh_primary} was pretrained on: positions 65-96 " \
           "were never trained"
    log = capsys.readouterr().out
    assert f"warning: {what}" in log and what in log.splitlines()[-1]  # the summary line too
    # the default micro-batch (32) over the file's 2 rows: each update reads them 16 times, said once
    assert log.count("note: a global batch of 32 rows is more than the 2 training rows: each update reads rows "
                     "more than once") == 1
    run = json.loads((out / "run.json").read_text())
    assert run["warnings"][0] == what and run["finetune"]["allow_untrained_positions"] is True

    english = load_weights(fresh_primary)[1][WORD]
    art = _artifact(tmp_path / "en", "bl_base", "en", english, fresh_primary / "tokenizer" / "spm.model",
                    fresh_primary, 1)
    records = steps.evaluate([out], embeddings=[art], eval_file=str(tmp_path / "t.csv"))
    # The run's own warnings (a loss left at chance, which this tiny fine-tune's dropout draws decide),
    # then the position warning, once.
    assert records[0]["finetune_warnings"] == [f"{out}: {w}" for w in run["warnings"] if w != what] + [f"{out}: {what}"]
    (out / "run.json").write_text(json.dumps({**run, "finetune": {**run["finetune"], "allow_untrained_positions": False},
                                              "warnings": []}))
    with pytest.raises(ValueError) as refused:
        steps.evaluate([out], embeddings=[art], eval_file=str(tmp_path / "t.csv"))
    # named as the run's, with flags Step 4 takes (it refuses --seq_length for a task)
    assert str(refused.value) == (f"{out}: {what}, and its run.json does not allow that (it was "
                                  "fine-tuned before Step 3 checked): pass --allow_untrained_positions true to score "
                                  "it anyway, with a warning, or fine-tune it again at --seq_length 64 or less")
    allowed = steps.evaluate([out], embeddings=[art], eval_file=str(tmp_path / "t.csv"), allow_untrained_positions=True)
    assert allowed[0]["finetune_warnings"] == [f"{out}: {what}"]
    with pytest.raises(ValueError, match="--seq_length 128 is longer than the 64-piece blocks"):
        steps.evaluate_plugin(fresh_primary, embeddings=[art], data=str(tmp_path / "none"), seq_length=128)
    # Stopped after its last checkpoint, before its results (and warnings) were written: Step 4
    # refuses it (its records would carry no warning); --resume writes them, training nothing.
    (out / "run.json").write_text(json.dumps({k: v for k, v in run.items() if k != "warnings"}))
    with pytest.raises(ValueError, match=f"^{out} finished its updates but stopped before writing its results "):
        steps.evaluate([out], embeddings=[art], eval_file=str(tmp_path / "t.csv"))
    assert finetune_main(["--task", "classify", "--primary", str(fresh_primary), "--train_file",
                          str(tmp_path / "t.csv"), "--seq_length", "96", "--allow_untrained_positions", "true",
                          "--output_dir", str(out), "--ds_config", str(REPO / "ds_configs" / "zero0.json"),
                          "--resume"]) == 0
    assert json.loads((out / "run.json").read_text())["warnings"] == run["warnings"]
    assert steps.evaluate([out], embeddings=[art], eval_file=str(tmp_path / "t.csv"))[0]["finetune_warnings"]
    # Artifacts of two languages and one evaluation file without {lang}: the French artifact was
    # scored on the (here English) file and recorded as French; refused, as the plug-in metric's
    # one dataset is (a prepared dataset holds one language)
    art_fr = _artifact(tmp_path / "fr", "bl_base", "fr", english, fresh_primary / "tokenizer" / "spm.model",
                       fresh_primary, 1)
    one_file = (f"--eval_file {tmp_path / 't.csv'} is one file for the artifacts' 2 languages (en, fr): each would "
                "be scored on it and recorded as its own language; put {lang} in the path")
    with pytest.raises(ValueError, match=re.escape(one_file)):
        steps.evaluate([out], embeddings=[art, art_fr], eval_file=str(tmp_path / "t.csv"))
    with pytest.raises(ValueError, match=re.escape(f"--plugin_data {tmp_path / 'none'} is one file for the ")):
        steps.evaluate_plugin(fresh_primary, embeddings=[art, art_fr], data=str(tmp_path / "none"))
    (tmp_path / "fr.csv").write_text((tmp_path / "t.csv").read_text())
    (tmp_path / "en.csv").write_text((tmp_path / "t.csv").read_text())
    assert sorted((r["system"] == "no_adaptation", r["lang"]) for r in steps.evaluate(
        [out], embeddings=[art, art_fr], eval_file=str(tmp_path / "{lang}.csv"))) == [
        (False, "en"), (False, "fr"), (True, "en"), (True, "fr")]


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


@pytest.mark.slow  # end to end: the toy task's Step 3 (113 updates) and what it records
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
    # Learned: no warning in the record or on the summary line, which shows the chance level.
    assert run["source_chance"] == {"chance": 50.0, "majority_accuracy": 50.0, "uniform_accuracy": 50.0,
                                    "scored_items": 200}
    assert run["warnings"] == [] and summary["warnings"] == []
    line = finetune_summary(run, d / "ft")
    assert f"en accuracy {acc:.1f} (chance 50.0)" in line and "WARNING" not in line


@pytest.mark.slow  # on the toy task's Step 3 run
def test_a_fine_tune_resumed_with_another_metric_records_it_with_its_score(toy_run, fresh_primary, tmp_path):
    """--metric may change on --resume (CHANGEABLE_ON_RESUME): the finished run, resumed with
    macro_f1, records macro_f1 as its headline (run.json's metric and finetune.metric) with
    its score, and Step 4 scores in it. The record kept accuracy, by a macro-F1 score."""
    d, _ = toy_run
    shutil.copytree(d / "ft", tmp_path / "ft")
    recorded = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert recorded["source_scores"]["accuracy"] != recorded["source_scores"]["macro_f1"]  # else nothing is told apart
    cfg = FinetuneConfig(**{**recorded["finetune"], "metric": "macro_f1"})
    steps.finetune(run=RunSpec(output_dir=tmp_path / "ft", ds_config=REPO / "ds_configs" / "zero0.json",
                               layout=NO_DROPOUT, resume=True),
                   step=steps.Finetune(task="classify", primary=fresh_primary, cfg=cfg, train_file=str(d / "train.csv"),
                                       eval_file=str(d / "verses.{lang}.csv")))
    run = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert run["metric"] == run["finetune"]["metric"] == "macro_f1"
    assert run["source_eval_file"] == str(d / "verses.{lang}.csv")  # the file the score is on
    assert run["source_score"] == run["source_scores"]["macro_f1"] == recorded["source_scores"]["macro_f1"]
    assert f"en macro_f1 {run['source_score']:.1f}" in finetune_summary(run, tmp_path / "ft")
    art = _artifact(tmp_path / "en", "bl_base", "en", load_weights(fresh_primary)[1][WORD],
                    fresh_primary / "tokenizer" / "spm.model", fresh_primary, 1)
    en = steps.evaluate([tmp_path / "ft"], embeddings=[art], eval_file=str(d / "verses.{lang}.csv"))[0]
    assert en["metric"] == "macro_f1" and en["score"] == pytest.approx(run["source_score"])
    # resumed again with accuracy and no eval file: the headline and its score from the scores recorded
    steps.finetune(run=RunSpec(output_dir=tmp_path / "ft", ds_config=REPO / "ds_configs" / "zero0.json",
                               layout=NO_DROPOUT, resume=True),
                   step=steps.Finetune(task="classify", primary=fresh_primary, train_file=str(d / "train.csv"),
                                       cfg=dataclasses.replace(cfg, metric="accuracy")))
    again = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert again["metric"] == again["finetune"]["metric"] == "accuracy"
    assert again["source_score"] == recorded["source_scores"]["accuracy"]


@pytest.mark.slow  # end to end: the toy task's Step 3 (113 updates) and what it records
def test_a_fine_tune_on_shuffled_labels_is_flagged_at_chance(toy_run, fresh_primary, capsys):
    """The toy task's training verses with their labels shuffled (the same held-out file, true
    labels): nothing to learn, so the run warns in its log, its run.json and its summary line."""
    d, _ = toy_run
    rows = list(csv.reader(open(d / "train.csv", encoding="utf-8")))
    labels = [r[2] for r in rows[1:]]
    random.Random(1).shuffle(labels)
    write_csv(d / "shuffled.csv", rows[0], [[*r[:2], lab] for r, lab in zip(rows[1:], labels)])
    capsys.readouterr()
    out = d / "ft-shuffled"
    assert finetune_main(["--task", "classify", "--primary", str(fresh_primary), "--train_file", str(d / "shuffled.csv"),
                          "--eval_file", str(d / "verses.{lang}.csv"), "--text_column", "verse", "--label_column",
                          "names_the_lord", "--seq_length", "48", "--train_micro_batch_size_per_gpu", "16",
                          "--epochs", "1", "--lr", "5e-4", "--log_interval", "1", "--hidden_dropout", "0",
                          "--attention_dropout", "0", "--ds_config", str(REPO / "ds_configs" / "zero0.json"),
                          "--output_dir", str(out)]) == 0
    log = capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert any("not above chance beyond noise" in w for w in run["warnings"]), run["warnings"]
    done = next(line for line in log.splitlines() if line.startswith("done: "))
    assert "(chance 50.0); model in" in done and "; WARNING: " in done and run["warnings"][0] in done
    assert all(f"warning: {w}" in log for w in run["warnings"])


def _artifact(path, system, lang, emb, tokenizer, source, step):
    meta = {"system": system, "lang": lang, "step": step, "source": str(source), "flops": 1e12 * step,
            "flops_paper": 1e12 * step, "v100_days": 1e-6 * step, "tokens": 1000 * step}
    return write_artifact(path, {"word_embeddings": emb, "output_bias": torch.zeros(len(emb))}, tokenizer, meta)


@pytest.mark.slow  # end to end: the toy task's Step 3 (113 updates) and what it records
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
    en, de, none_en, none_de = records
    # No adaptation, per language: the run's own tokenizer and embeddings, which in English are
    # exactly what the English artifact swaps in.
    assert [(r["system"], r["lang"], r["of"]) for r in (none_en, none_de)] == [
        ("no_adaptation", "en", ["minijoint:full"]), ("no_adaptation", "de", ["minijoint:full"])]
    # (German: the English tokenizer on German text; test_eval_device checks it against Step 4's
    # path with no artifact. Its scores need not differ from the untrained German embeddings':
    # both can sit at the majority class.)
    assert none_en["scores"] == en["scores"]
    assert (en["task"], en["lang"], de["lang"], en["metric"]) == ("classify", "en", "de", "accuracy")
    assert en["score"] == pytest.approx(run["source_score"]) and en["scores"] == pytest.approx(run["source_scores"])
    assert set(de["scores"]) == {"accuracy", "macro_f1"} and de["score"] == de["scores"]["accuracy"]
    assert 0 <= de["scores"]["macro_f1"] <= 100
    # Full-model embeddings over the MINIJOINT primary are its ceiling: the report is measured against it.
    assert {r["system"] for r in records[:2]} == {"minijoint:full"}
    assert report_main([str(out), "--baseline", "minijoint:full"]) == 0
    assert "## classify: score at the last checkpoint" in capsys.readouterr().out

    # Step 4 knows the primary model by its weights' fingerprint (Step 3 recorded it): English
    # embeddings whose artifact names a byte-identical copy of the primary run are the same
    # model's, and score as before; without a fingerprint (older artifacts) the path decides.
    assert run["primary"]["fingerprint"] == run_fingerprint(fresh_primary)
    copy = tmp_path / "copy_of_primary"
    shutil.copytree(fresh_primary, copy)
    moved = _artifact(tmp_path / "en-copy", "bl_base", "en", english, copy / "tokenizer" / "spm.model", copy, 1)
    meta = json.loads((moved / "meta.json").read_text())
    (moved / "meta.json").write_text(json.dumps({**meta, "primary_fingerprint": run_fingerprint(copy)}))
    again = steps.evaluate([d / "ft"], embeddings=[moved], eval_file=str(d / "verses.{lang}.csv"))
    assert again[0]["score"] == pytest.approx(run["source_score"])
    (moved / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"holds embeddings for the primary model {copy}, but the fine-tuned runs "
                                         f"start from {fresh_primary}: evaluate them"):
        steps.evaluate([d / "ft"], embeddings=[moved], eval_file=str(d / "verses.{lang}.csv"))

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
    # The source-language score of 4 updates is the majority tag's: the run says so.
    assert summary["source_chance"]["chance"] == summary["source_scores"]["accuracy"]
    assert any("not above chance beyond noise" in w for w in summary["warnings"]), summary["warnings"]


def test_a_tagging_record_carries_its_majority_tag_rate(fresh_primary, de_tokenizer, tmp_path, capsys):
    """Step 4 on a tagging file per language: each record carries the majority tag's rate of its
    own language's file (counted here from the file: every word of these 8-word sentences is
    scored), the uniform rate, and the warnings of the fine-tune behind it (4 updates: at chance);
    `mmadapt report`'s table for the task has the gain-over-chance columns and marks the system."""
    init_parallel(1, 1)

    def tagged(lang: str, book: int, lord: tuple) -> list[dict]:
        rows = []
        for _, _, _, text in bible_verses(lang, range(book, book + 1)):
            words = text.split()[:8]
            rows.append({"tokens": words, "tags": ["B-LORD" if w.strip(",.;:") in lord else "O" for w in words]})
        return rows[:80]

    write_jsonl(tmp_path / "train.jsonl", tagged("en", 1, ("LORD",)))
    # The German file tags Mose too: aligned verses would otherwise give both files the same rate.
    files = {"en": tagged("en", 2, ("LORD",)), "de": tagged("de", 2, ("HERR", "HERRN", "Mose"))}
    for lang, rows in files.items():
        write_jsonl(tmp_path / f"tags.{lang}.jsonl", rows)
    cfg = FinetuneConfig(seq_length=48, train_micro_batch_size_per_gpu=16, epochs=0.5, lr=5e-4, log_interval=1)
    summary, _ = steps.finetune(run=RunSpec(output_dir=tmp_path / "ft", ds_config=REPO / "ds_configs" / "zero0.json",
                                            layout=NO_DROPOUT),
                                step=steps.Finetune(task="tag", primary=fresh_primary, cfg=cfg,
                                                    train_file=str(tmp_path / "train.jsonl"),
                                                    eval_file=str(tmp_path / "tags.{lang}.jsonl")))
    assert summary["updates"] == 3 and summary["warnings"]
    english = load_weights(fresh_primary)[1][WORD]
    german = torch.randn(1000, english.shape[1], generator=torch.Generator().manual_seed(0)) * 0.07
    arts = [_artifact(tmp_path / "en", "bl_base", "en", english, fresh_primary / "tokenizer" / "spm.model",
                      fresh_primary, 1),
            _artifact(tmp_path / "de", "bl_base", "de", german, de_tokenizer, fresh_primary, 1)]
    capsys.readouterr()
    records = steps.evaluate([tmp_path / "ft"], embeddings=arts, eval_file=str(tmp_path / "tags.{lang}.jsonl"),
                             output=tmp_path / "records.json")
    assert "warning: " in capsys.readouterr().out
    for r in records:
        tags = [t for row in files[r["lang"]] for t in row["tags"]]
        majority = 100 * max(tags.count("O"), tags.count("B-LORD")) / len(tags)
        # every word, also where the English tokenizer cuts German words into more pieces than a
        # row of 48 holds (no adaptation, de): a long sentence goes on in rows of its own
        assert r["metric"] == "accuracy" and r["chance"] == pytest.approx(majority)
        assert r["majority_accuracy"] == pytest.approx(majority) and r["uniform_accuracy"] == 50.0
        assert r["scored_items"] == len(tags)
        assert r["finetune_warnings"] == [f"{tmp_path / 'ft'}: {w}" for w in summary["warnings"]]
    en, de, none_en, _ = records
    assert en["chance"] != de["chance"]  # each language's own file
    assert none_en["system"] == "no_adaptation" and none_en["scores"] == en["scores"]  # the same model, as above
    capsys.readouterr()
    assert report_main([str(tmp_path / "records.json"), "--baseline", "minijoint:full"]) == 0
    md = capsys.readouterr().out
    assert ("| system | Step-2 EFLOPs | v100-paper days | de | en | avg | retention | gain over chance | "
            "share of minijoint:full's gain |") in md
    assert f"de {de['chance']:.1f}, en {en['chance']:.1f}." in md
    assert "| minijoint:full (!) |" in md and "(!) minijoint:full: from fine-tuned runs that learned nothing" in md
