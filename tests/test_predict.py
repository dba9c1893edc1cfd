"""The inference API (mmadapt/predict.py) and `mmadapt predict`: per-head logits that score each
family's own loss, an imported model's logits and fill-mask predictions equal to transformers' on
real sentences, fine-tuned predictions that score as Step 4 scores them (and equal `mmadapt
evaluate`'s on a real fine-tuned run with a real Step-2 artifact), the command on every task type,
and its bad input refused in one line."""

import csv
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, VOCAB, child_env, masked_batch
from hf_models import bible_lines, make_xlmr
from mmadapt import evaluate as E
from mmadapt import predict, steps
from mmadapt import tasks as T
from mmadapt.cli import main
from mmadapt.config import FinetuneConfig, Layout, apply_recipe
from mmadapt.models.llama.presets import LLAMA_TINY
from mmadapt.models import PRESETS
from mmadapt.corpora import bible_verses
from mmadapt.features import best_span_offsets, best_spans
from mmadapt.hf import import_hf
from mmadapt.models import get_family
from mmadapt.parallel import init_parallel
from mmadapt.readers import QAExample, TaggedSentence, squad_scores
from mmadapt.artifact import artifact_state, read_artifact
from evaluation import plugin_loss
from mmadapt.heldout import primary_head_state
from mmadapt.run import RunSpec
from mmadapt.tokenizer import load as load_sp
from mmadapt.tokens import IGNORE_INDEX, MASK_ID, PAD_ID
from mmadapt.models.roberta import ROBERTA

ZERO0 = REPO / "ds_configs" / "zero0.json"
NO_DROPOUT = Layout(hidden_dropout=0.0, attention_dropout=0.0)


# --- the models' logits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, tied", [("roberta", True), ("llama", True), ("llama", False)])
def test_logits_at_every_position_score_the_models_own_loss(family, tied):
    """Cross-entropy of logits() at the scored positions is each head's loss as forward computes
    it (MINIJOINT: two heads), so the logits are the ones the model trains."""
    base = PRESETS["tiny"][0] if family == "roberta" else LLAMA_TINY
    cfg = dataclasses.replace(base, num_layers=4, head_layers=(2, 4), vocab_size=VOCAB, hidden_dropout=0.0,
                              attention_dropout=0.0, init_method_std=0.1,
                              **({} if family == "roberta" else {"share_embeddings_and_output_weights": tied}))
    model = get_family(cfg).build_lm(cfg, seed=3).eval()
    ids, labels = masked_batch(VOCAB, b=3, s=20)
    if family == "llama":
        labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], 1)
    with torch.no_grad():
        _, per_head = model(ids, labels)
        logits = model.logits(ids)
    assert [tuple(x.shape) for x in logits] == [(3, 20, VOCAB)] * 2
    scored = labels.ne(IGNORE_INDEX)
    for got, want in zip(logits, per_head):
        assert F.cross_entropy(got[scored], labels[scored]).item() == pytest.approx(want.item(), abs=1e-5)
    assert not torch.allclose(logits[0], logits[1])  # two heads, two predictions


# --- an imported model against transformers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A tiny XLM-R (SentencePiece, fairseq's id offset) made here, and it imported."""
    root = tmp_path_factory.mktemp("hf")
    model_dir = make_xlmr(root / "xlmr")
    import_hf(model_dir, root / "run")
    return model_dir, root / "run"


# Verses cut to their first 8 words: whole, they can be longer than the tiny model's 64
# positions, which predict refuses (it never cuts a text).
SENTENCES = [" ".join(v.split()[:8])
             for v in bible_lines("en", range(40, 41))[:4] + bible_lines("de", range(40, 41))[:4]]


def _hf_logits(model_dir, texts):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    enc = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")  # the model's positions
    with torch.no_grad():
        return enc, AutoModelForMaskedLM.from_pretrained(str(model_dir)).eval()(**enc).logits


def test_imported_models_logits_and_fill_mask_are_transformers(hf_run):
    model_dir, run = hf_run
    lm = predict.load(run, device="cpu")
    assert isinstance(lm, predict.LanguageModel) and lm.heads == (4,)
    hf_ids = torch.tensor(lm.tokenizer.hf_ids)  # mmadapt id -> the source's
    enc, ref = _hf_logits(model_dir, SENTENCES)
    ids = lm.encode(SENTENCES)
    assert torch.equal(hf_ids[ids], enc.input_ids)  # the same pieces, <s> text </s>
    keep = enc.attention_mask.bool()
    got = lm.logits(SENTENCES)[4]
    diff = (got[keep] - ref[..., hf_ids][keep]).abs().max().item()
    print(f"max abs logit difference {diff:.2e} on {int(keep.sum())} positions")
    assert diff <= 1e-5
    assert float(got[keep].std()) > 0.1  # logits that say something
    assert not keep.all() and torch.equal(got[~keep], torch.zeros_like(got[~keep]))  # padding: zeros, as documented

    # fill-mask: a literal <mask> is the mask piece, its space taken with it, as transformers' tokenizer does.
    masked = ["In the beginning God created the <mask> and the earth.", "Im Anfang schuf Gott <mask> und <mask>."]
    enc, ref = _hf_logits(model_dir, masked)
    assert torch.equal(hf_ids[lm.encode(masked)], enc.input_ids)
    out = lm.fill_mask(masked, top_k=3)
    assert [len(m) for m in out] == [1, 2]
    mask_hf = int(hf_ids[MASK_ID])
    for r, text_masks in enumerate(out):
        positions = enc.input_ids[r].eq(mask_hf).nonzero().squeeze(1).tolist()
        for pos, top in zip(positions, text_masks):
            p, i = ref[r, pos].softmax(-1).topk(3)
            assert [int(hf_ids[t["id"]]) for t in top] == i.tolist()
            assert [t["prob"] for t in top] == pytest.approx(p.tolist(), abs=1e-6)
            assert all(t["text"] == t["piece"].replace("▁", " ").strip() for t in top)


def test_a_device_asked_for_is_where_the_model_is_built(hf_run, monkeypatch):
    """device="cpu" on a machine whose evaluation device is a GPU: the model was built there in
    bf16 and moved back, its fp32 weights rounded to bf16 on the way (and the whole model put on
    the GPU first). With the default device made the meta device (what a GPU stands for here:
    anywhere but the CPU), the model is built on the CPU at once and its logits are the same."""
    from mmadapt import evaluate, heldout

    want = predict.load(hf_run[1], device="cpu").logits(SENTENCES)[4]
    monkeypatch.setattr(heldout, "device", lambda: torch.device("meta"))
    monkeypatch.setattr(evaluate, "device", lambda: torch.device("meta"))
    lm = predict.load(hf_run[1], device="cpu")
    assert torch.equal(lm.logits(SENTENCES)[4], want)


def test_fill_mask_and_next_piece_say_what_they_are_for(hf_run, tmp_path):
    lm = predict.load(hf_run[1], device="cpu")
    with pytest.raises(ValueError, match="text 2 has no <mask>"):
        lm.fill_mask(["a <mask> b", "no mask here"])
    with pytest.raises(ValueError, match="next_piece is for decoders"):
        lm.next_piece(["In the beginning"])
    with pytest.raises(ValueError, match="heads after layers 4, not 2"):
        lm.fill_mask(["a <mask>"], head=2)
    with pytest.raises(ValueError, match="heads after layers 4, not '4'"):  # a layer number, not its text
        lm.fill_mask(["a <mask>"], head="4")
    with pytest.raises(ValueError, match=r"^text 2 holds \\ud800, half of a UTF-16 surrogate pair"):
        lm.fill_mask(["a <mask>", "b \ud800 <mask>"])
    # under mmadapt predict, an input is named by its line: blank lines are skipped ("text 2" was line 5)
    (tmp_path / "m.txt").write_text("In the <mask>.\n\n\n\nno mask here\n")
    with pytest.raises(ValueError, match=f"^{tmp_path}/m.txt:5 has no <mask>"):
        predict.predict_rows(lm, predict.read_inputs(str(tmp_path / "m.txt"), "mlm"))
    with pytest.raises(ValueError, match="^text 2 has no <mask>"):  # from Python: its place in the list, as before
        lm.fill_mask(["a <mask>", "no mask here"])
    with pytest.raises(ValueError, match="a list of texts"):
        lm.logits("one string")


# --- fine-tuned models: predictions score as Step 4 scores them -----------------------------------------

# The tiny preset at the test vocabulary, weights drawn wide so that predictions differ by input.
MODEL = dataclasses.replace(PRESETS["tiny"][0], vocab_size=VOCAB, init_method_std=0.2, hidden_dropout=0.0,
                            attention_dropout=0.0)
CFG = FinetuneConfig(seq_length=64, doc_stride=16, max_query_length=16, eval_batch_tokens=300)


def _task_model(task: str, labels: list[str], tokenizer) -> predict.TaskModel:
    t = T.get_task(task)
    state = get_family(MODEL).build_task_model(MODEL, t.kind, max(1, len(labels)), seed=5).state_dict()
    ft = E.Finetuned(ROBERTA, MODEL, t, labels, state, tokenizer, {"finetune": {"seed": 5}})
    return predict.TaskModel(Path("synthetic"), ft, CFG, load_sp(tokenizer))


def _verses(n: int, lang: str = "de") -> list[str]:
    return [text for _, _, _, text in bible_verses(lang, range(1, 2))][:n]


def test_tags_per_word_score_as_step4_scores_tokens(de_tokenizer):
    """Word-level tags read back from the first piece of each word give Step 4's token accuracy;
    a sentence longer than seq_length is read in rows of its own, and each of its words gets a
    tag (Step 4 scores every word)."""
    labels = ["B-NAME", "I-NAME", "O"]
    sentences = [t.split() for t in _verses(60)]
    gold = [["B-NAME" if w[0].isupper() else "O" for w in s] for s in sentences]
    tm = _task_model("tag", labels, de_tokenizer)
    pred = tm.predict([" ".join(s) for s in sentences])
    assert [p["words"] for p in pred] == sentences
    assert all(len(row["tags"]) == len(row["words"]) and None not in row["tags"] for row in pred)
    pairs = [(p, g) for row, gs in zip(pred, gold) for p, g in zip(row["tags"], gs)]
    long = [s for s in sentences if sum(len(tm.tokenizer.encode(w)) for w in s) + 2 > CFG.seq_length]
    assert long  # some are read in more than one row
    examples = [TaggedSentence(s, g) for s, g in zip(sentences, gold)]
    data = E.eval_set(tm.task, tm.tokenizer, examples, labels, CFG, torch.device("cpu"))
    step4 = E.score_set(tm.finetuned, data, CFG)
    assert 100 * sum(p == g for p, g in pairs) / len(pairs) == pytest.approx(step4["accuracy"], abs=1e-4)  # fp32 mean
    assert 5 < step4["accuracy"] < 95  # the random model gets some right, some wrong


def test_answers_score_as_step4_scores_spans(de_tokenizer, capsys):
    texts = _verses(160)
    examples = []
    for i in range(0, 150, 5):
        context = " ".join(texts[i:i + 5])
        word = context.split()[7]
        examples.append(QAExample(str(i), context, texts[i + 5][:60], [(word, context.index(word))]))
    tm = _task_model("xquad", [], de_tokenizer)
    pred = tm.predict([(ex.question, ex.context) for ex in examples])
    assert all(p["answer"] in ex.context for p, ex in zip(pred, examples))
    data = E.eval_set(tm.task, tm.tokenizer, examples, [], CFG, torch.device("cpu"))
    step4 = E.score_set(tm.finetuned, data, CFG)
    mine = squad_scores({ex.id: p["answer"] for ex, p in zip(examples, pred)}, examples)
    assert mine["f1"] == pytest.approx(step4["squad_f1"]) and mine["exact_match"] == pytest.approx(step4["exact_match"])
    # best_spans over Step 4's logits: the same answers.
    logits = E.set_logits(tm.finetuned, data)
    assert best_spans(logits, data.enc, examples, CFG.max_answer_length) == {ex.id: p["answer"]
                                                                             for ex, p in zip(examples, pred)}
    # ... and each answer's character offsets in its context (a word can occur there more than once)
    assert best_span_offsets(logits, data.enc, examples, CFG.max_answer_length) == {
        ex.id: (p["start"], p["end"]) for ex, p in zip(examples, pred)}
    assert all(ex.context[p["start"]:p["end"]] == p["answer"] != "" for ex, p in zip(examples, pred))
    # A question past max_query_length is cut as fine-tuning and evaluate cut it, and said so.
    capsys.readouterr()
    long = " ".join(texts[:10])
    tm.predict([("Wer schuf?", examples[0].context), (long, examples[0].context)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: input 2's question is {len(tm.tokenizer.encode(long))} pieces "
                                                f"long; the xquad model reads its first {CFG.max_query_length}")


def test_nan_outputs_name_the_input_of_the_row(de_tokenizer):
    """A damaged piece's row that only the last input reads: the refusal names that input, where a
    tagger reads a long sentence in rows and QA a long context in windows (their row's number was
    named: 'input 6' of 3, 'window 6')."""
    long = " ".join(_verses(6))
    for task, labels in (("tag", ["B", "I", "O"]), ("xquad", [])):
        tm = _task_model(task, labels, de_tokenizer)
        seen = set(tm.tokenizer.encode(long) + tm.tokenizer.encode("Wer?") + tm.tokenizer.encode("Gott"))
        bad = next(p for p in tm.tokenizer.encode("Zebra Xylophon Quak") if p not in seen and p > 5)
        tm.finetuned.model().state_dict()[ROBERTA.word][bad] = float("nan")
        first = [long] if task == "tag" else [("Wer?", long)]
        assert len(tm.encode(tm.examples(first)).input_ids) > 2  # read in rows (windows) of its own
        last = tm.tokenizer.decode([bad])
        inputs = [long, "Gott", "Gott " + last] if task == "tag" else [("Wer?", long), ("Wer?", "Gott"),
                                                                     ("Wer?", "Gott " + last)]
        with pytest.raises(ValueError, match="gives NaN or infinite outputs for input 3: its weights are damaged"):
            tm.predict(inputs)


def test_classifier_probabilities_and_input_checks(de_tokenizer):
    genres = list(T.get_task("bible-genre").labels)
    tm = _task_model("bible-genre", genres, de_tokenizer)
    texts = _verses(20)
    pred = tm.predict(texts)
    _, _, logits = tm.logits(texts)
    assert [p["label"] for p in pred] == [genres[i] for i in logits.argmax(-1).tolist()]
    for p in pred:
        assert set(p["probs"]) == set(genres) and sum(p["probs"].values()) == pytest.approx(1.0, abs=1e-5)
        assert max(p["probs"], key=p["probs"].get) == p["label"]
    assert len({p["label"] for p in pred}) > 1
    with pytest.raises(ValueError, match="input 2: the bible-genre model classifies single texts"):
        tm.predict(["a", ("b", "c")])
    pair = _task_model("pair", ["no", "yes"], de_tokenizer)
    with pytest.raises(ValueError, match="input 1: the pair model classifies pairs of texts"):
        pair.predict(["only one text"])
    assert [p["label"] in ("no", "yes") for p in pair.predict([("Er schläft.", "Niemand schläft.")])] == [True]


def test_a_cut_input_is_said_as_it_is_cut(de_tokenizer, capsys):
    """A classifier reads a single text's first seq_length pieces, a pair's seq_length with the
    longer text cut first: the note said "its first N" of a pair, whose second text loses pieces."""
    long = " ".join(_verses(12))
    for task, labels, x, read in (("bible-genre", list(T.get_task("bible-genre").labels), long, "its first"),
                                  ("pair", ["no", "yes"], ("Er schläft.", long), "")):
        tm = _task_model(task, labels, de_tokenizer)
        capsys.readouterr()
        tm.predict([x])
        err = capsys.readouterr().err.strip().splitlines()
        n = CFG.seq_length
        want = f"its first {n} (" if read else f"{n} of them, the longer text cut first (the run's seq_length"
        assert len(err) == 1 and err[0].startswith("note: input 1 is ") and f"model reads {want}" in err[0], err


# --- mmadapt predict's input ----------------------------------------------------------------------------

def test_read_inputs_lines_tabs_and_json_lines(tmp_path):
    f = tmp_path / "pairs.txt"
    f.write_text("Er schläft.\tNiemand schläft.\n\nEs regnet.\tEs ist nass.\n", encoding="utf-8")
    assert predict.read_inputs(str(f), "pair") == [{"text": "Er schläft.", "text_pair": "Niemand schläft."},
                                                   {"text": "Es regnet.", "text_pair": "Es ist nass."}]
    with pytest.raises(ValueError, match=r"pairs.txt:1: a classify input is text on one line; this line has 2 "
                                         r"tab-separated fields; a text holding tabs goes in JSON Lines \(--jsonl, "
                                         r'\{"text": ...\} per line\)$'):
        predict.read_inputs(str(f), "classify")
    # a JSON value that is no text: refused naming its line (it was 'text 1 is a int', from the model)
    (tmp_path / "n.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"n.jsonl:2: 'text' is a int, not a text: write it as a JSON string$"):
        predict.read_inputs(str(tmp_path / "n.jsonl"), "mlm")
    (tmp_path / "w.jsonl").write_text('{"words": ["a", 1]}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:1: 'words' is \[\"a\", 1\]: a tag input is a text, or its words "
                                         r"as a list of strings$"):
        predict.read_inputs(str(tmp_path / "w.jsonl"), "tag")
    j = tmp_path / "qa.jsonl"
    j.write_text(json.dumps({"question": "Wer?", "context": "Gott.", "id": 7}) + "\n")
    assert predict.read_inputs(str(j), "span") == [{"question": "Wer?", "context": "Gott."}]
    j.write_text(j.read_text() + json.dumps({"words": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"qa.jsonl:2: the object lacks 'question'"):
        predict.read_inputs(str(j), "span")
    (tmp_path / "t.jsonl").write_text(json.dumps({"words": ["Im", "Anfang"]}) + "\n")
    assert predict.read_inputs(str(tmp_path / "t.jsonl"), "tag") == [{"text": ["Im", "Anfang"]}]
    # JSON's escape of half a surrogate pair is no text (the tokenizer failed on it with a traceback)
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n\n{"text": "lone \\ud800 half"}\n{"words": ["a\\udc80"]}\n')
    with pytest.raises(ValueError, match=r"s.jsonl:3: 'text' holds \\ud800, half of a UTF-16 surrogate pair, which is "
                                         r"no character: write the character itself \(or both halves of its pair\)$"):
        predict.read_inputs(str(tmp_path / "s.jsonl"), "mlm")
    with pytest.raises(ValueError, match=r"s.jsonl:3: 'text' holds \\ud800"):
        predict.read_inputs(str(tmp_path / "s.jsonl"), "tag")
    (tmp_path / "s.jsonl").write_text('{"words": ["a\\udc80"]}\n')
    with pytest.raises(ValueError, match=r"s.jsonl:1: 'words' holds \\udc80"):
        predict.read_inputs(str(tmp_path / "s.jsonl"), "tag")
    # each input keeps its line (blank lines are skipped): what predict_rows' messages name
    assert predict.read_inputs(str(f), "pair").names == (f"{f}:1", f"{f}:3")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text \(byte offset 3\)"):
        predict.read_inputs(str(tmp_path / "latin1.txt"), "mlm")
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no inputs"):
        predict.read_inputs(str(tmp_path / "blank.txt"), "mlm")
    # Lines end at a line end alone: a form feed, U+0085 or U+2028 inside a line (which predict's own
    # JSON output may hold, unescaped) is part of it; CRLF and CR end lines too.
    odd = tmp_path / "odd.txt"
    odd.write_bytes("a\x0cb <mask>\r\nc\u2028d <mask>\re\x85f <mask>\n".encode("utf-8"))
    assert predict.read_inputs(str(odd), "mlm") == [{"text": "a\x0cb <mask>"}, {"text": "c\u2028d <mask>"},
                                                    {"text": "e\x85f <mask>"}]
    row = json.dumps({"text": "a\u2028b <mask>"}, ensure_ascii=False)
    (tmp_path / "own.jsonl").write_text(row + "\n", encoding="utf-8")
    assert predict.read_inputs(str(tmp_path / "own.jsonl"), "mlm") == [{"text": "a\u2028b <mask>"}]
    # stdin is UTF-8 whatever the locale says, its BOM dropped, as a file's is
    import io
    stdin = io.TextIOWrapper(io.BytesIO("\ufeffcafé <mask>\n".encode("utf-8")), encoding="latin-1")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "stdin", stdin)
        assert predict.read_inputs("-", "mlm") == [{"text": "café <mask>"}]
        m.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="latin-1"))
        with pytest.raises(ValueError, match=r"stdin is not UTF-8 text \(byte offset 3\)"):
            predict.read_inputs("-", "mlm")


@pytest.mark.parametrize("argv, message", [
    (lambda t, run: ["--run", str(t)], "is not an mmadapt run directory (no run.json)"),
    (lambda t, run: ["--run", str(run), "--input", str(t / "none.txt")], "none.txt does not exist"),
    (lambda t, run: ["--run", str(run), "--output", str(t / "old.jsonl")], "old.jsonl already exists"),
    (lambda t, run: ["--run", str(run), "--input", str(t / "in.txt"), "--top_k", "0"], "--top_k: must be >= 1, got 0"),
    (lambda t, run: ["--run", str(run), "--input", str(t / "in.txt"), "--embeddings", str(t)],
     "is not a Step-2 embedding artifact"),
])
def test_predict_bad_input_is_one_line(argv, message, tmp_path, hf_run, capsys):
    (tmp_path / "old.jsonl").write_text("{}\n")
    (tmp_path / "in.txt").write_text("a <mask>\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(["predict", *argv(tmp_path, hf_run[1])])
    except SystemExit as stop:  # the argument parser refuses a flag's value itself
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_predict_output_dash_is_stdout(tmp_path, hf_run, capsys, monkeypatch):
    """--output -, like --input -, is the standard stream: no file named '-'."""
    (tmp_path / "in.txt").write_text("Im Anfang schuf <mask> Himmel.\n")
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--run", str(hf_run[1]), "--input", "in.txt", "--output", "-", "--top_k", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == ["Im Anfang schuf <mask> Himmel."] and len(rows[0]["masks"][0]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@pytest.mark.slow
def test_mmadapt_predict_fill_mask_from_stdin(hf_run):
    proc = subprocess.run([sys.executable, "-m", "mmadapt.cli", "predict", "--run", str(hf_run[1]), "--top_k", "2"],
                          input="Im Anfang schuf <mask> Himmel.\n", cwd=REPO, capture_output=True, text=True,
                          env=child_env(PYTHONPATH=str(REPO)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    text = "Im Anfang schuf <mask> Himmel."
    assert rows == [{"text": text, "masks": predict.load(hf_run[1], device="cpu").fill_mask([text], 2)[0]}]
    assert not any("warn" in line.lower() for line in proc.stderr.splitlines()), proc.stderr


# --- real runs: Step 3 and Step 2, then the API against `mmadapt evaluate` (slow) ----------------------

def _pretrain(out: Path, corpus, tokenizer, preset: str, **model) -> Path:
    """A source model one update from its init, in this process: fine-tuning from it learns (the
    session's `primary_run` sits on the unigram plateau, where its last layer is the same for
    every input; tests/test_own_task.py's fresh_primary says more)."""
    cfg, train = PRESETS[preset]
    cfg = apply_recipe(dataclasses.replace(cfg, vocab_size=VOCAB, **model), "minijoint")
    steps.pretrain(run=RunSpec(output_dir=out, ds_config=ZERO0, corpus=str(corpus), tokenizer=tokenizer),
                   # blocks as long as any fine-tuning here runs (Step 3 refuses positions never trained)
                   step=steps.Pretrain(model=cfg, train=dataclasses.replace(train, train_iters=1, save_interval=1,
                                                                           seq_length=128), recipe="minijoint"))
    return out


@pytest.fixture(scope="module")
def sources(corpus, tokenizer, tmp_path_factory):
    """{"roberta", "llama"}: a fresh MINIJOINT source of each family (init std 0.07, the demo's)."""
    init_parallel(1, 1)
    root = tmp_path_factory.mktemp("sources")
    return {"roberta": _pretrain(root / "roberta", corpus, tokenizer, "tiny", init_method_std=0.07),
            "llama": _pretrain(root / "llama", corpus, tokenizer, "llama-tiny")}


SHORT = FinetuneConfig(seq_length=64, train_micro_batch_size_per_gpu=16, epochs=0.04, log_interval=5, lr=5e-4)


def _finetune(out: Path, primary: Path, task: str, cfg: FinetuneConfig = SHORT, train_file: str | None = None) -> Path:
    steps.finetune(run=RunSpec(output_dir=out, ds_config=ZERO0, layout=NO_DROPOUT),
                   step=steps.Finetune(task=task, primary=primary, cfg=cfg, train_file=train_file))
    return out


@pytest.fixture(scope="module")
def zero_shot(sources, de_tokenizer, de_corpus, tmp_path_factory):
    """A bible-genre run of the encoder source (13 updates) and German embeddings for it (6 Step-2
    updates over the MINIJOINT mini-model, an artifact at 3 and 6)."""
    root = tmp_path_factory.mktemp("zero_shot")
    _finetune(root / "ft", sources["roberta"], "bible-genre")
    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=6, save_interval=3, log_interval=3, seq_length=32)
    steps.adapt_embeddings(run=RunSpec(output_dir=root / "adapt", ds_config=ZERO0, corpus=str(de_corpus),
                                       tokenizer=de_tokenizer),
                           step=steps.AdaptEmbeddings(system="minijoint", source=sources["roberta"], lang="de",
                                                      train=train, vocab_size=VOCAB))
    return root / "ft", root / "adapt" / "embeddings" / "step00000006"


@pytest.mark.slow
def test_api_predictions_are_mmadapt_evaluates(zero_shot, tmp_path):
    """The fine-tuned run with the Step-2 artifact swapped in, through the API and through `mmadapt
    predict`, predicts on the German test verses what `mmadapt evaluate` scores: its accuracy is
    the record's score, its labels the argmax of Step 4's logits."""
    ft, artifact = zero_shot
    records = tmp_path / "records.json"
    assert main(["evaluate", "--finetuned", str(ft), "--embeddings", str(artifact), "--eval_file", "bible",
                 "--output", str(records)]) == 0
    record = json.loads(records.read_text())[0]
    test = T.read_examples(T.get_task("bible-genre"), "bible", "de", "test")
    model = predict.load(ft, embeddings=artifact)
    assert isinstance(model, predict.TaskModel) and model.embeddings == artifact
    with pytest.MonkeyPatch.context() as m:  # built where it is asked for (test_a_device_asked_for_...)
        m.setattr(E, "device", lambda: torch.device("meta"))
        on_cpu = predict.load(ft, embeddings=artifact, device="cpu")
        assert on_cpu.predict(_verses(3)) == model.predict(_verses(3))
    pred = model.predict([text for text, _ in test])
    genres = model.labels
    accuracy = 100 * sum(p["label"] == genres[gold] for p, (_, gold) in zip(pred, test)) / len(test)
    assert accuracy == pytest.approx(record["score"], abs=1e-4)  # fp32 mean; one verse is 0.04 points
    # A model this briefly trained may predict one genre throughout, so the probabilities are
    # compared too: those of Step 4's own path (the artifact's tokenizer, its embeddings swapped in).
    cfg = E.recorded_config(model.finetuned)
    data = E.eval_set(model.task, load_sp(artifact / "spm.model"), test, genres, cfg, torch.device("cpu"))
    step4 = E.set_logits(model.finetuned, data, model.artifact).softmax(-1)
    probs = torch.tensor([[p["probs"][g] for g in genres] for p in pred])
    torch.testing.assert_close(probs, step4, rtol=0, atol=1e-6)
    assert [p["label"] for p in pred] == [genres[i] for i in step4.argmax(-1).tolist()]
    assert float(probs.max(-1).values.std()) > 1e-3  # they differ from verse to verse
    # The source-language model (no artifact) gives other probabilities on German text.
    own = predict.load(ft).predict([text for text, _ in test[:50]])
    assert max(abs(a["probs"][g] - b["probs"][g]) for a, b in zip(own, pred) for g in genres) > 1e-2
    # The command: the same labels, one JSON object per line.
    (tmp_path / "de.txt").write_text("".join(text.replace("\t", " ") + "\n" for text, _ in test[:30]), encoding="utf-8")
    out = tmp_path / "pred.jsonl"
    assert main(["predict", "--run", str(ft), "--embeddings", str(artifact), "--input", str(tmp_path / "de.txt"),
                 "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["label"] for r in rows] == [p["label"] for p in pred[:30]]
    for r, p in zip(rows, pred):  # other batches (30 rows, not 2499): equal to rounding
        assert r["probs"] == pytest.approx(p["probs"], abs=1e-6)
    assert rows[0]["text"] == test[0][0] and set(rows[0]["probs"]) == set(genres)
    # An artifact of another primary model (another path and other weights) is refused, in one line.
    other = tmp_path / "other_art"
    shutil.copytree(artifact, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "source": str(ft), "primary_fingerprint": "0" * 64}))
    with pytest.raises(ValueError, match="holds embeddings for the model of"):
        predict.load(ft, embeddings=other)
    (other / "meta.json").write_text(json.dumps({**meta, "source": str(tmp_path / "gone")}))
    with pytest.raises(ValueError, match="which is no longer an mmadapt run"):
        predict.load(ft, embeddings=other)


@pytest.mark.slow
def test_language_model_with_an_artifact_is_the_plugin_metrics_model(zero_shot, sources):
    """With an artifact, the LM is the primary model with its primary head and the artifact's
    embeddings and bias: the cross-entropy of its logits at held-out masked positions is the
    plug-in metric's loss on them."""
    _, artifact = zero_shot
    primary_run = sources["roberta"]
    lm = predict.load(primary_run, embeddings=artifact)
    assert lm.heads == (12,) and lm.cfg.vocab_size == VOCAB
    assert predict.load(primary_run).heads == (4, 12)
    texts = _verses(8)
    ids = lm.encode(texts)
    g = torch.Generator().manual_seed(0)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & ids.ne(PAD_ID) & ids.ge(5), ids, IGNORE_INDEX)
    masked = ids.masked_fill(labels.ge(0), MASK_ID)
    cfg, state = primary_head_state(primary_run)
    emb, _, _ = read_artifact(artifact)
    want = plugin_loss(ROBERTA, cfg, {**state, **artifact_state(ROBERTA, emb)}, [(masked, labels)])
    with torch.no_grad():
        got = lm.model.logits(masked)[0]
    assert F.cross_entropy(got[labels.ge(0)], labels[labels.ge(0)]).item() == pytest.approx(want, abs=1e-5)
    # logits(texts) is the model's at every real position of encode(texts).
    real = ids.ne(PAD_ID)
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(texts)[12][real], lm.model.logits(ids)[0][real], rtol=0, atol=1e-5)


# --- `mmadapt predict` on every kind of run (slow) ------------------------------------------------------

def _verse_pairs(n: int) -> list[list[str]]:
    """(verse, the next verse) "next" and (verse, a verse far away) "far": a pair task."""
    verses = _verses(2 * n + 40, "en")
    return [[verses[i], verses[i + 1], "next"] if i % 2 else [verses[i], verses[i + 37], "far"] for i in range(n)]


def _tagged(n: int) -> list[dict]:
    return [{"tokens": v.split(), "tags": ["B-GOD" if w.strip(",.;:") == "God" else "O" for w in v.split()]}
            for v in _verses(n, "en")]


def _squad(n: int) -> dict:
    verses, qas = _verses(3 * n + 3, "en"), []
    for i in range(n):
        context = " ".join(verses[3 * i:3 * i + 3])
        word = context.split()[5]
        qas.append({"context": context, "qas": [{"id": str(i), "question": verses[3 * i][:40],
                                                 "answers": [{"text": word, "answer_start": context.index(word)}]}]})
    return {"data": [{"title": "Genesis", "paragraphs": qas}]}


def _own_task_run(kind: str, root: Path, primary: Path) -> tuple[Path, list[str]]:
    """A fine-tuning run of `kind` (2 updates) and five predict input lines for it."""
    one_epoch = dataclasses.replace(SHORT, epochs=1.0, seq_length=48)
    if kind == "pair":
        rows = _verse_pairs(32)
        f = root / "pairs.csv"
        with open(f, "w", encoding="utf-8", newline="") as fh:
            csv.writer(fh).writerows([["sentence1", "sentence2", "label"], *rows])
        return _finetune(root / kind, primary, "pair", one_epoch, str(f)), [f"{a}\t{b}" for a, b, _ in rows[:5]]
    if kind == "tag":
        rows = _tagged(32)
        f = root / "tags.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return _finetune(root / kind, primary, "tag", one_epoch, str(f)), [" ".join(r["tokens"]) for r in rows[:5]]
    squad = _squad(32)
    f = root / "squad.json"
    f.write_text(json.dumps(squad), encoding="utf-8")
    paragraphs = squad["data"][0]["paragraphs"][:5]
    return (_finetune(root / kind, primary, "xquad", dataclasses.replace(one_epoch, seq_length=96), str(f)),
            [f"{p['qas'][0]['question']}\t{p['context']}" for p in paragraphs])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["classify", "pair", "tag", "span", "mlm", "causal", "decoder-classify"])
def test_mmadapt_predict_on_every_kind_of_run(kind, sources, zero_shot, tmp_path):
    """One JSON object per input line, as the API predicts (the command reads the same run);
    each kind's output says what it should: a label of the run's with probabilities summing to 1,
    a tag per word, an answer cut from the context, the top pieces at each <mask> or next."""
    if kind == "classify":
        run, lines = zero_shot[0], _verses(5, "en")
    elif kind in ("pair", "tag", "span"):
        run, lines = _own_task_run(kind, tmp_path, sources["roberta"])
    elif kind == "decoder-classify":
        run, lines = _finetune(tmp_path / "ft", sources["llama"], "bible-genre"), _verses(5, "en")
    elif kind == "mlm":
        run, lines = sources["roberta"], ["In the beginning God created the <mask>.", "And <mask> said, Let there be"]
    else:
        run, lines = sources["llama"], ["In the beginning God created the", "And God said, Let there be"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "new" / "out.jsonl"  # in a directory that does not exist yet: made, after the work
    top_k = 3 if kind in ("mlm", "causal") else None  # a language model's option (a task model's is refused)
    assert main(["predict", "--run", str(run), "--input", str(tmp_path / "in.txt"), "--output", str(out),
                 *(["--top_k", str(top_k)] if top_k else [])]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == len(lines)
    model = predict.load(run)
    expected = predict.predict_rows(model, predict.read_inputs(str(tmp_path / "in.txt"), predict.kind_of(run)),
                                    top_k)
    assert rows == json.loads(json.dumps(expected))
    for row, line in zip(rows, lines):
        if kind in ("classify", "pair", "decoder-classify"):
            assert row["label"] in model.labels and sum(row["probs"].values()) == pytest.approx(1.0, abs=1e-5)
            assert row["text"] == line.split("\t")[0]
        elif kind == "tag":
            assert row["words"] == line.split() and len(row["tags"]) == len(row["words"])
            assert set(row["tags"]) <= {"B-GOD", "O"}
        elif kind == "span":
            assert row["context"][row["start"]:row["end"]] == row["answer"] and row["question"] == line.split("\t")[0]
        elif kind == "mlm":
            assert len(row["masks"]) == line.count("<mask>") and all(len(m) == 3 for m in row["masks"])
            assert all(m[0]["prob"] >= m[1]["prob"] >= m[2]["prob"] for m in row["masks"])
        else:
            assert len(row["next"]) == 3 and row["next"][0]["prob"] >= row["next"][2]["prob"]


@pytest.mark.parametrize("x", [None, 7, {"Im": 1}, []])
def test_a_tagger_refuses_an_input_that_is_no_text_or_list_of_words(x, de_tokenizer):
    """A tagger's input is a text or a list of words; None or a number (a JSON Lines value such as
    {"words": null}) raised a TypeError (a traceback), a dict was read as its keys."""
    tm = _task_model("tag", ["B-NAME", "O"], de_tokenizer)
    with pytest.raises(ValueError, match=r"^input 2: a tagger takes a text or a list of words, not "):
        tm.predict(["Im Anfang", x])


def test_a_tagger_under_predict_names_an_input_by_its_line(de_tokenizer, tmp_path):
    """mmadapt predict skips blank lines: a tag input that is only spaces (or no words) was
    refused as 'input 2' for line 4; half a surrogate pair in a word failed in the tokenizer."""
    tm = _task_model("tag", ["B-NAME", "O"], de_tokenizer)
    f = tmp_path / "t.jsonl"
    f.write_text('{"words": ["Im"]}\n\n\n{"text": "   "}\n')
    with pytest.raises(ValueError, match=f"^{f}:4: a tagger takes a text or a list of words, not '   '$"):
        predict.predict_rows(tm, predict.read_inputs(str(f), "tag"))
    with pytest.raises(ValueError, match=r"^input 2 holds \\udc80, half of a UTF-16 surrogate pair"):
        tm.predict(["Im Anfang", ["a\udc80"]])


def test_an_empty_text_is_refused_as_steps_3_and_4_refuse_it(de_tokenizer, tmp_path):
    """A blank text (a pair line with a trailing tab, {"text": "   "}, a QA line's empty context)
    was classified or answered (""), where fine-tuning and evaluation refuse it in one line; a
    JSON Lines key given twice was read as its last value."""
    pair, genre = _task_model("pair", ["no", "yes"], de_tokenizer), _task_model("bible-genre", ["a", "b"], de_tokenizer)
    qa = _task_model("xquad", [], de_tokenizer)
    f = tmp_path / "pair.txt"
    f.write_text("Er schläft.\tNiemand schläft.\n\nIm Anfang\t\n")
    with pytest.raises(ValueError, match=f"^{f}:3: 'text_pair' is empty: every input needs its text and text_pair"):
        predict.predict_rows(pair, predict.read_inputs(str(f), "pair"))
    f = tmp_path / "genre.jsonl"
    f.write_text('{"text": "Im Anfang"}\n{"text": "   "}\n')
    with pytest.raises(ValueError, match=f"^{f}:2: 'text' is empty: every input needs its text "):
        predict.predict_rows(genre, predict.read_inputs(str(f), "classify"))
    with pytest.raises(ValueError, match="^input 1: 'context' is empty: every input needs its question and context"):
        qa.predict([("Wer?", " ")])
    assert set(qa.predict([("", "Im Anfang schuf Gott")])[0]) == {"answer", "start", "end"}  # as SQuAD's files read
    tagger = _task_model("tag", ["B-NAME", "O"], de_tokenizer)
    for words in ([" "], ["Im", "\xa0", "Anfang"]):  # Step 3 refuses a blank word (readers._tokens)
        with pytest.raises(ValueError, match="^input 1: a tagger takes a text or a list of words, not "):
            tagger.predict([words])
    with pytest.raises(ValueError, match="^input 2: 'text' is empty"):
        genre.predict(["Im Anfang", ""])
    f.write_text('{"text": "Im Anfang", "text": "Gott"}\n')
    with pytest.raises(ValueError, match=f"^{f}:1: the object names 'text' twice: give each key once$"):
        predict.read_inputs(str(f), "classify")
    assert [p["label"] in ("no", "yes") for p in pair.predict([("Er schläft.", "Niemand schläft.")])] == [True]


def test_a_byte_piece_is_reported_as_the_text_it_stands_for():
    """fill_mask's and next_piece's `text` of a byte-fallback vocabulary's byte piece: its ASCII
    character (transformers' token_str), U+FFFD for a byte of a longer character; it was the
    piece's name, '<0x29>'. Other pieces: the word-boundary marker as a space, stripped."""
    class Pieces:
        def id_to_piece(self, i):
            # (a byte-level piece of a space and a character's first bytes, of bytes ending one
            # character and holding a whole one, as byte_level_surface writes them: they were
            # reported as their escapes)
            return ["<0x29>", "<0xC3>", "▁Gott", "<0x20>", "<s>", "<0x20><0xE0><0xA4>", "<0x94><0xE0><0xA4><0xB0>"][i]

    assert [predict._surface(Pieces(), i)["text"] for i in range(7)] == [")", "\ufffd", "Gott", "", "<s>", "\ufffd",
                                                                        "\ufffdर"]
    assert predict._surface(Pieces(), 0) == {"id": 0, "piece": "<0x29>", "text": ")"}
