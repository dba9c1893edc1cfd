"""Evaluation-data readers on small fixtures in each format (and on the real XQuAD beside the
repository), and the SQuAD metric on hand-computed cases."""

import pytest

from conftest import REPO
from mmadapt import readers as T

XQUAD = REPO.parent / "shared" / "data" / "xquad"


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_xnli_test_tsv(tmp_path):
    header = ("language\tgold_label\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
              "sentence2_parse\tsentence1\tsentence2\tpromptID\tpairID\tgenre\tlabel1\tlabel2\tlabel3\tlabel4\t"
              "label5\tsentence1_tokenized\tsentence2_tokenized\tmatch")
    rows = [
        ["de", "entailment", "", "", "", "", 'Er sagte: "Ja".', "Er stimmte zu.", "1", "1", "g", *[""] * 8],
        ["fr", "contradiction", "", "", "", "", "Il pleut.", "Il fait beau.", "2", "2", "g", *[""] * 8],
        ["de", "-", "", "", "", "", "Unklar.", "Vielleicht.", "3", "3", "g", *[""] * 8],
        ["de", "neutral", "", "", "", "", "Ein Hund.", "Ein Tier.", "4", "4", "g", *[""] * 8],
    ]
    f = write(tmp_path / "xnli.test.tsv", header + "\n" + "".join("\t".join(r) + "\n" for r in rows))
    de = T.read_nli(f, lang="de")
    assert [(e.sentence1, e.label) for e in de] == [('Er sagte: "Ja".', 0), ("Ein Hund.", 1)]  # '-' dropped
    assert [e.label for e in T.read_nli(f)] == [0, 2, 1]


def test_a_byte_order_mark_is_no_part_of_a_dataset_file(tmp_path):
    """A file saved with a byte-order mark (a spreadsheet's, Notepad's): XNLI's first column read as
    '\ufefflanguage', so its language went unseen and every language's rows were read as the one
    asked for (scored as German, exit 0); PAWS-X's header was 'not a PAWS-X TSV'; SQuAD JSON 'not
    JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))'. Each reads as without the mark."""
    import json

    rows = "language\tgold_label\tsentence1\tsentence2\nen\tentailment\tA man.\tA person.\n" \
           "de\tneutral\tEin Mann.\tEine Person.\nfr\tcontradiction\tUn homme.\tPersonne.\n"
    squad = json.dumps({"data": [{"paragraphs": [{"context": "In the beginning God created", "qas": [
        {"id": "1", "question": "Who?", "answers": [{"text": "God", "answer_start": 17}]}]}]}]})
    for name, text, read in (("xnli.tsv", rows, lambda f: T.read_nli(f, "de")),
                             ("paws.tsv", "id\tsentence1\tsentence2\tlabel\n1\tA.\tB.\t1\n", T.read_pawsx),
                             ("squad.json", squad, T.read_squad)):
        plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
        plain.write_text(text, encoding="utf-8")
        marked.write_text(text, encoding="utf-8-sig")
        assert marked.read_bytes()[:3] == b"\xef\xbb\xbf" and read(marked) == read(plain) != []
    assert [e.sentence1 for e in T.read_nli(tmp_path / "bom-xnli.tsv", "de")] == ["Ein Mann."]


def test_multinli_train_tsv(tmp_path):
    header = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
              "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
    row = "0\t1\t1e\tgov\t( ( x ) )\t( y )\t(ROOT x)\t(ROOT y)\tThe cat sat.\tA cat sat.\tentailment\tentailment"
    ex = T.read_nli(write(tmp_path / "train.tsv", header + "\n" + row + "\n"))
    assert [(e.sentence1, e.sentence2, e.label, e.lang) for e in ex] == [("The cat sat.", "A cat sat.", 0, "")]
    with pytest.raises(ValueError, match="not an XNLI/MultiNLI TSV"):
        T.read_nli(write(tmp_path / "bad.tsv", "a\tb\n1\t2\n"))


def test_multinli_txt_rows_that_stop_after_their_one_label(tmp_path):
    """multinli_1.0_train.txt: 15 columns named, a training pair's row stopping after label1 (one
    annotator): read, as is a full row; a row lacking a column read is dropped."""
    header = ("gold_label	sentence1_binary_parse	sentence2_binary_parse	sentence1_parse	sentence2_parse	"
              "sentence1	sentence2	promptID	pairID	genre	label1	label2	label3	label4	label5")
    short = "neutral	( x )	( y )	(ROOT x)	(ROOT y)	The cat sat.	A cat sat.	1	1n	gov	neutral"
    full = "entailment	( x )	( y )	(ROOT x)	(ROOT y)	A dog.	An animal.	2	2e	gov" + "	entailment" * 5
    cut = "contradiction	( x )	( y )	(ROOT x)	(ROOT y)	Only one sentence."
    ex = T.read_nli(write(tmp_path / "multinli_1.0_train.txt", "\n".join([header, short, full, cut]) + "\n"))
    assert [(e.sentence1, e.label) for e in ex] == [("The cat sat.", 1), ("A dog.", 0)]


def test_pawsx_tsv(tmp_path):
    f = write(tmp_path / "translated_train.tsv", "id\tsentence1\tsentence2\tlabel\n"
              "1\tDer Fluss fließt.\tDer Strom fließt.\t1\n2\t\tLeer.\t0\n3\tA.\tB.\t0\n")
    ex = T.read_pawsx(f, lang="de")
    assert [(e.sentence1, e.label, e.lang) for e in ex] == [("Der Fluss fließt.", 1, "de"), ("A.", 0, "de")]
    with pytest.raises(ValueError, match="not a PAWS-X TSV"):
        T.read_pawsx(write(tmp_path / "x.tsv", "sentence1\tsentence2\tlabel\n"))


def test_conllu_with_multiword_tokens(tmp_path):
    f = write(tmp_path / "es.conllu", "\n".join([
        "# sent_id = 1", "# text = Vino del mar.",
        "1\tVino\tvenir\tVERB\t_\t_\t0\troot\t_\t_",
        "2-3\tdel\t_\t_\t_\t_\t_\t_\t_\t_",
        "2\tde\tde\tADP\t_\t_\t4\tcase\t_\t_",
        "3\tel\tel\tDET\t_\t_\t4\tdet\t_\t_",
        "4\tmar\tmar\tNOUN\t_\t_\t1\tobl\t_\t_",
        "4.1\tx\tx\tX\t_\t_\t_\t_\t_\t_",
        "5\t.\t.\tPUNCT\t_\t_\t1\tpunct\t_\t_", "",
        "1\tSí\tsí\tINTJ\t_\t_\t0\troot\t_\t_", ""]))
    sents = T.read_conllu(f)
    assert [(s.words, s.tags) for s in sents] == [
        (["Vino", "de", "el", "mar", "."], ["VERB", "ADP", "DET", "NOUN", "PUNCT"]), (["Sí"], ["INTJ"])]
    with pytest.raises(ValueError, match="10 tab-separated columns"):
        T.read_conllu(write(tmp_path / "bad.conllu", "1\tword\tlemma\n"))
    # A file saved with a byte-order mark (Windows editors) reads as the same file without one
    bom = tmp_path / "bom.conllu"
    bom.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    assert [(s.words, s.tags) for s in T.read_conllu(bom)] == [(s.words, s.tags) for s in sents]


def test_conll2003(tmp_path):
    f = write(tmp_path / "eng.train", "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n"
              "German JJ B-NP B-MISC\n\nPeter NNP B-NP B-PER\n")
    assert [(s.words, s.tags) for s in T.read_conll2003(f)] == [
        (["EU", "rejects", "German"], ["B-ORG", "O", "B-MISC"]), (["Peter"], ["B-PER"])]
    bom = tmp_path / "bom.train"
    bom.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    assert [(s.words, s.tags) for s in T.read_conll2003(bom)] == [(s.words, s.tags) for s in T.read_conll2003(f)]


def test_squad_metric_by_hand():
    assert T.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert T.exact_match("the Eiffel Tower", "Eiffel tower!") == 1.0
    # prediction [in, year, 1889] vs gold [1889]: precision 1/3, recall 1 -> F1 0.5
    assert T.f1_score("in the year 1889", "1889") == pytest.approx(0.5)
    assert T.f1_score("Paris", "London") == 0.0
    examples = [T.QAExample("q1", "c", "?", [("1889", 0), ("in 1889", 0)]),
                T.QAExample("q2", "c", "?", [("Gustave Eiffel", 0)]),
                T.QAExample("q3", "c", "?", [("a b c d", 0)])]
    # q1: EM 1 (second answer), F1 1; q2: "Eiffel" -> p 1, r 1/2 -> F1 2/3, EM 0; q3: no prediction -> 0
    scores = T.squad_scores({"q1": "in 1889", "q2": "Eiffel"}, examples)
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)


def test_mlqa_metric_normalises_answers_per_language_by_hand():
    """MLQA's official normalisation (its evaluation script): Unicode punctuation (the Devanagari
    danda, guillemets), each language's articles, Chinese cut into characters; SQuAD v1.1's (no
    language, XQuAD's) keeps them."""
    # 北京大学 vs 北京: four character tokens against two, two shared -> p 1/2, r 1 -> F1 2/3
    assert T.f1_score("北京大学", "北京", "zh") == pytest.approx(2 / 3) and T.f1_score("北京大学", "北京") == 0.0
    assert T.exact_match("दिल्ली।", "दिल्ली", "hi") == 1.0 and T.exact_match("दिल्ली।", "दिल्ली") == 0.0
    assert T.exact_match("der Rhein", "Rhein", "de") == 1.0 and T.exact_match("der Rhein", "Rhein") == 0.0
    assert T.exact_match("el río Ebro", "río Ebro", "es") == 1.0
    assert T.f1_score("«Berlin»", "Berlin", "en") == 1.0 and T.f1_score("«Berlin»", "Berlin") == 0.0
    assert T.normalize_answer("The  Eiffel Tower!", "en") == "eiffel tower"
    # A language code with a region or script (which --langs takes) scores by its language's rules
    assert T.f1_score("北京大学", "北京", "zh_Hant") == pytest.approx(2 / 3)
    assert T.exact_match("der Rhein", "Rhein", "de-DE") == 1.0
    ex = [T.QAExample("q", "c", "?", [("北京", 0)], "zh")]  # squad_scores reads each question's language
    assert T.squad_scores({"q": "北京大学"}, ex)["f1"] == pytest.approx(100 * 2 / 3)


@pytest.mark.skipif(not XQUAD.is_dir(), reason="../shared/data/xquad is not beside the repository")
@pytest.mark.parametrize("lang", ["en", "de", "zh"])
def test_real_xquad(lang):
    ex = T.read_squad(XQUAD / f"xquad.{lang}.json")
    assert len(ex) == 1190  # XQuAD: 240 paragraphs, 1190 question-answer pairs per language
    for e in ex:
        for text, start in e.answers:
            assert e.context[start:start + len(text)] == text
    assert T.squad_scores({e.id: e.answers[0][0] for e in ex}, ex) == {"exact_match": 100.0, "f1": 100.0}


def test_training_answers_must_be_at_their_offsets(tmp_path):
    """Step 3 learns a question's span from its first answer's answer_start: an offset past the
    context (or one counted in bytes) trained every window toward no span, unsaid. Refused for
    training data, naming the first and how many; evaluation data is scored by the answers' text,
    so taken as it is."""
    import json

    from mmadapt.tasks import TASKS, read_examples

    context = "Paris is the capital of France. Berlin is the capital of Germany."
    qas = [{"id": "q1", "question": "Capital of France?", "answers": [{"text": "Paris", "answer_start": 0}]},
           {"id": "q2", "question": "Capital of Germany?", "answers": [{"text": "Berlin", "answer_start": 100032}]},
           {"id": "q3", "question": "Of which country?", "answers": [{"text": "Germany", "answer_start": 56}]}]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [{"context": context, "qas": qas}]}]}))
    with pytest.raises(ValueError) as e:
        read_examples(TASKS["xquad"], str(path), "en", "train")
    assert str(e.value) == (f"{path}: the answer 'Berlin' of question 'q2' is not at its answer_start 100032 (the "
                            "context holds '' there) (and 1 more of the 3 questions): answer_start counts the "
                            "context's characters from 0; correct the offsets")
    assert len(read_examples(TASKS["xquad"], str(path), "en", "test")) == 3
    qas[1]["answers"][0]["answer_start"], qas[2]["answers"][0]["answer_start"] = 32, 57
    path.write_text(json.dumps({"data": [{"paragraphs": [{"context": context, "qas": qas}]}]}))
    assert [ex.answers[0][1] for ex in read_examples(TASKS["xquad"], str(path), "en", "train")] == [0, 32, 57]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        T.read_squad(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="not SQuAD-format JSON"):
        T.read_squad(write(tmp_path / "x.json", '{"version": 1}'))


def test_a_model_whose_outputs_are_in_another_order_is_scored_by_its_labels(tokenizer):
    """An imported classifier's outputs follow its id2label (MNLI's contradiction, neutral,
    entailment), not XNLI's order: gold ids are mapped to its outputs, so a model that is always
    right scores 100, as predict (which names its outputs) says; in the task's own order, as
    before."""
    import torch

    from mmadapt.config import FinetuneConfig
    from mmadapt.tasks import encode, get_task, scores
    from mmadapt.tokenizer import load

    task, sp, cfg = get_task("xnli"), load(tokenizer), FinetuneConfig(seq_length=32)
    examples = [T.PairExample("a b", "c d", gold) for gold in (0, 1, 2, 0)]
    for order in (list(task.labels), ["contradiction", "neutral", "entailment"]):
        enc = encode(task, sp, examples, order, cfg)
        right = [order.index(task.labels[ex.label]) for ex in examples]  # the output naming the gold label
        logits = torch.nn.functional.one_hot(torch.tensor(right), 3).float()
        assert enc.labels.tolist() == right
        assert scores(task, logits, enc, examples, order, cfg)["accuracy"] == 100.0
