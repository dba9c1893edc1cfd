"""The bert family (mmadapt/models/bert/) and headless encoders: tiny BERTs made with transformers
(random weights, cased and uncased WordPiece tokenizers trained on the English Bible, and one
trained briefly) import exactly, go out again as transformers loads them, lay a pair out with
BERT's token types, count their FLOPs exactly, and a sentence-transformers BertModel and
XLMRobertaModel go through every step and back (slow tier). Nothing is downloaded
(tests/hf_models.py makes every model here)."""

import dataclasses
import json
import shutil

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import REPO, metrics, run_pretrain, sigterm_before
from hf_models import (as_sentence_transformer, bert_body, bible_lines, framed_rows, import_all, make_bert,
                       make_headless_xlmr)
from mmadapt import adapt as A
from mmadapt.artifact import read_artifact
from mmadapt.tokenizer import pieces as tokenizer_pieces
from mmadapt.cli import main
from mmadapt.config import ModelConfig
from mmadapt.family import WORD
from mmadapt.features import encode_classify
from mmadapt.hf import export_hf, import_any, import_hf, spm_to_hf, write_hf
from mmadapt.models import get_family
from mmadapt.models.bert import BERT
from mmadapt.models.bert.model import BertEncoder, BertForTask, BertMLM
from mmadapt.models.roberta.model import BIAS
from mmadapt.predict import TaskModel
from mmadapt.readers import PairExample
from mmadapt.run import load_weights
from mmadapt.tokenizer import HFTokenizer, load
from mmadapt.tokens import BOS_ID, EOS_ID, PAD_ID

TOL = 1e-5
SEQ = 64
TEXTS = bible_lines("en", range(40, 41))[:6] + bible_lines("de", range(40, 41))[:4]  # German: unknown words
TRAIN_STEPS = 150  # the trained BERT's masked-LM updates on the English Bible
MAKERS = {"cased": dict(lowercase=False), "uncased": dict(lowercase=True),
          "trained": dict(lowercase=False, train_steps=TRAIN_STEPS)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return {name: make_bert(root / name, **kw) for name, kw in MAKERS.items()}


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    return import_all(hf_dirs, tmp_path_factory.mktemp("imported"))


def rows(sp, texts: list[str]) -> torch.Tensor:
    """[CLS] text [SEP], padded: as BERT's tokenizer and features.py lay a text out."""
    return framed_rows(sp, texts, SEQ)


def no_dropout(cfg):
    return dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)


def mlm_logits(cfg, state, ids):
    model = BertMLM(no_dropout(cfg)).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model.logits(ids)[-1]


# --- import -------------------------------------------------------------------------------------------

def test_what_a_tokenizer_folds_is_known(runs, tokenizer):
    """bpb.folds: an uncased WordPiece reads case and accents as one (bits per byte then leave out
    what they carry), and every WordPiece the spacing around punctuation (it splits there as at a
    space); mmadapt's SentencePiece keeps all three."""
    from mmadapt.bpb import folds

    wordpiece = load(runs["cased"] / "tokenizer" / "spm.model")
    assert wordpiece.encode("God, said") == wordpiece.encode("God ,said") == wordpiece.encode("God , said")
    assert folds(load(runs["uncased"] / "tokenizer" / "spm.model")) == ["case", "accents", "punctuation spacing"]
    assert folds(wordpiece) == ["punctuation spacing"]
    assert folds(load(tokenizer)) == []


def test_an_accent_stripped_costs_the_same_composed_or_decomposed(runs):
    """A WordPiece that strips accents reads "café" (NFC) and "cafe" + U+0301 (NFD) as the same
    pieces: the combining mark is part of the fold, as the composed accent is, and is not charged
    as a dropped character (it was: 16 bits); a cased WordPiece, which keeps accents, reads the
    combining mark itself."""
    from mmadapt import bpb as B

    layout = B.Layout((), (EOS_ID,))
    uncased = load(runs["uncased"] / "tokenizer" / "spm.model")
    composed, decomposed = "Und er sagte: café", "Und er sagte: cafe\u0301"
    assert uncased.encode(composed) == uncased.encode(decomposed)
    got = [B.masked_rows(uncased, B.RawText((t,), "test"), layout, 64) for t in (composed, decomposed)]
    assert got[0].rows == got[1].rows and got[0].unknown_bytes == got[1].unknown_bytes == 0
    cased = load(runs["cased"] / "tokenizer" / "spm.model")
    assert cased.encode("\u0301") != []  # kept: not the fold, and never charged as dropped

@pytest.mark.parametrize("name", sorted(MAKERS))
def test_imported_bert_gives_transformers_logits(name, hf_dirs, runs):
    tok = AutoTokenizer.from_pretrained(str(hf_dirs[name]))
    hf = AutoModelForMaskedLM.from_pretrained(str(hf_dirs[name])).eval()
    enc = tok(TEXTS, padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
    sp = load(runs[name] / "tokenizer" / "spm.model")
    ids, hf_ids = rows(sp, TEXTS), torch.tensor(sp.hf_ids)
    assert torch.equal(hf_ids[ids], enc.input_ids)  # the same pieces: [CLS] ... [SEP], [PAD] after
    assert hf_ids[:5].tolist() == [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
                                   tok.mask_token_id]
    with torch.no_grad():
        ref = hf(**enc).logits[..., hf_ids]
    # BERT counts positions from 0 whatever the padding: every position agrees, padding included
    diff = (mlm_logits(*load_weights(runs[name]), ids) - ref).abs().max().item()
    print(f"{name}: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    run = json.loads((runs[name] / "run.json").read_text())
    assert run["model"]["family"] == "bert" and run["model"]["max_position_embeddings"] == SEQ
    if name == "trained":  # its predictions are far from uniform (150 updates reach about the unigram
        # distribution: its likeliest piece ~40x the uniform 1/V): the comparison sees trained weights at work
        assert ref.softmax(-1).amax(-1).mean() > 20 / ref.shape[-1]


def pretraining_checkpoint(state):
    """What mBERT's BertForMaskedLM files hold beside the masked LM: the pre-training checkpoint's
    pooler and next-sentence head, and an older transformers' position-id buffer."""
    h = state["bert.embeddings.word_embeddings.weight"].shape[1]
    g = torch.Generator().manual_seed(0)
    state.update({"bert.pooler.dense.weight": torch.randn(h, h, generator=g), "bert.pooler.dense.bias": torch.zeros(h),
                  "cls.seq_relationship.weight": torch.randn(2, h, generator=g),
                  "cls.seq_relationship.bias": torch.zeros(2), "bert.embeddings.position_ids": torch.arange(SEQ)[None]})


def test_a_pretraining_checkpoint_imports_as_transformers_loads_it(hf_dirs, runs, tmp_path):
    """BertForMaskedLM files with a pooler, a next-sentence head and position ids (as mBERT's): the
    validator leaves out what transformers' BertForMaskedLM leaves out, and the import is the plain one."""
    from hf_models import damaged_copy

    import_hf(damaged_copy(hf_dirs["cased"], tmp_path / "hf", None, pretraining_checkpoint), tmp_path / "run")
    mine, plain = load_weights(tmp_path / "run")[1], load_weights(runs["cased"])[1]
    assert sorted(mine) == sorted(plain) and all(torch.equal(mine[k], plain[k]) for k in plain)


def test_cross_attention_is_refused_by_name_and_feed_forward_chunks_import(hf_dirs, runs, tmp_path):
    """add_cross_attention (a decoder's layer) was refused as "transformers cannot load it
    (ValueError: BertLayer(": the first line of a message that ends with its cause; now by its
    name. chunk_size_feed_forward (the same math in chunks) imported or not by whether the parity
    text's length was a multiple of it, with transformers' bare message: it imports, as the plain."""
    from hf_models import damaged_copy

    with pytest.raises(ValueError, match=r"add_cross_attention is True; mmadapt's bert has False"):
        import_hf(damaged_copy(hf_dirs["cased"], tmp_path / "xattn", {"add_cross_attention": True}), tmp_path / "r1")
    assert not (tmp_path / "r1").exists()
    import_hf(damaged_copy(hf_dirs["cased"], tmp_path / "chunked", {"chunk_size_feed_forward": 7}), tmp_path / "r2")
    mine, plain = load_weights(tmp_path / "r2")[1], load_weights(runs["cased"])[1]
    assert sorted(mine) == sorted(plain) and all(torch.equal(mine[k], plain[k]) for k in plain)


def test_uncased_tokenizer_normalises_as_bert(runs):
    """The imported uncased WordPiece lowercases and strips accents wherever mmadapt encodes text."""
    sp = load(runs["uncased"] / "tokenizer" / "spm.model")
    assert sp.encode("IN THE BEGINNING Gód") == sp.encode("in the beginning god")
    assert load(runs["cased"] / "tokenizer" / "spm.model").encode("GOD") != \
        load(runs["cased"] / "tokenizer" / "spm.model").encode("god")


@pytest.fixture(scope="module")
def headless(hf_dirs, tmp_path_factory):
    """The trained BERT's body as a sentence-transformers BertModel (its pooler included), imported."""
    root = tmp_path_factory.mktemp("headless")
    body = bert_body(hf_dirs["trained"], root / "hf")
    st = as_sentence_transformer(body, root / "st")
    import_any(st, root / "run")
    return {"hf": body, "st": st, "run": root / "run"}


def test_a_sentence_transformers_6_directory_encodes_as_sentence_transformers_does(headless, tmp_path):
    """sentence-transformers 6 saves its Pooling as `pooling_mode` (not one flag per mode) and the
    length a text is cut to as the tokenizer's model_max_length (not in sentence_bert_config.json):
    SentenceEncoder reads both (it raised on the first and cut at the model's positions), gives
    SentenceTransformer's vectors on short and on cut texts, and the run keeps the length where
    an export copies it from."""
    from sentence_transformers import SentenceTransformer

    from mmadapt.predict import SentenceEncoder

    st = as_sentence_transformer(headless["hf"], tmp_path / "st", max_seq_length=16)
    assert json.loads((st / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    run = tmp_path / "run"
    # --task is a classifier's: refused for a sentence encoder, its transformer at the top or in a
    # module folder (it imported a Step-1 run and ignored the flag)
    nested = as_sentence_transformer(headless["hf"], tmp_path / "nested", subfolder="0_Transformer")
    for d in (st, nested):
        with pytest.raises(ValueError, match="--task names what a sequence classifier predicts; .* drop --task"):
            import_any(d, tmp_path / "refused", task="xnli")
    assert not (tmp_path / "refused").exists()
    import_any(st, run)
    texts = [*TEXTS[:3], " ".join(TEXTS)]  # the last longer than 16 pieces: cut
    theirs = SentenceTransformer(str(st), device="cpu").encode(texts, convert_to_tensor=True)
    mine = SentenceEncoder.load(run).encode(texts)
    assert SentenceEncoder.load(run, device="cpu").max_length == 16 and (mine - theirs).abs().max().item() <= 1e-5
    from mmadapt.hf import SENTENCE_TRANSFORMERS

    assert json.loads((run / SENTENCE_TRANSFORMERS / "sentence_bert_config.json").read_text())["max_seq_length"] == 16

def test_an_encoder_gets_no_generation_config(hf_dirs, tmp_path):
    """A BERT whose config.json names an eos its WordPiece has not (RobertaConfig's defaults over
    a BertTokenizer): an encoder generates nothing, so neither its run nor its export gains the
    generation_config.json a decoder's import derives from config.json's stop tokens (it carried
    a WordPiece id as an eos the export's config.json does not name)."""
    src = tmp_path / "src"
    shutil.copytree(hf_dirs["cased"], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 0, "eos_token_id": 2}))
    import_hf(src, tmp_path / "run")
    export_hf(tmp_path / "out", primary=tmp_path / "run")
    assert not list((tmp_path / "run").rglob("generation_config.json"))
    assert not (tmp_path / "out" / "generation_config.json").exists()


def test_a_sentence_transformers_settings_file_of_an_older_name_is_read(headless, tmp_path):
    """Older sentence-transformers wrote the transformer's settings as sentence_<type>_config.json
    (Hub models ship sentence_xlm-roberta_config.json), which sentence-transformers still reads
    (the first of its names not empty). Only sentence_bert_config.json was read: the cut and the
    lower-casing were lost, in SentenceEncoder and in the export's settings file."""
    from sentence_transformers import SentenceTransformer

    from mmadapt.hf import SENTENCE_TRANSFORMERS
    from mmadapt.predict import SentenceEncoder

    st = as_sentence_transformer(headless["hf"], tmp_path / "st")
    (st / "sentence_bert_config.json").write_text("{}")  # empty: passed over, as sentence-transformers does
    (st / "sentence_xlm-roberta_config.json").write_text(json.dumps({"max_seq_length": 8, "do_lower_case": True}))
    run = tmp_path / "run"
    import_any(st, run)
    texts = [TEXTS[0].upper(), " ".join(TEXTS)]  # capitals, and longer than 8 pieces
    theirs = SentenceTransformer(str(st), device="cpu").encode(texts, convert_to_tensor=True)
    assert theirs[0].sub(SentenceTransformer(str(st), device="cpu").encode([TEXTS[0].lower()],
                                                                         convert_to_tensor=True)[0]).abs().max() == 0
    encoder = SentenceEncoder.load(run)
    assert (encoder.max_length, encoder.lower_case) == (8, True)
    assert (encoder.encode(texts) - theirs).abs().max().item() <= 1e-5
    assert json.loads((run / SENTENCE_TRANSFORMERS / "sentence_bert_config.json").read_text()) == {
        "max_seq_length": 8, "do_lower_case": True}


def test_a_pooling_sentence_encoder_does_not_compute_is_refused_where_it_loads(headless, tmp_path):
    """weightedmean and lasttoken (sentence-transformers' other modes) import and export as they
    are; SentenceEncoder refuses them in one line that says where to encode (docs/huggingface.md)."""
    from mmadapt.predict import SentenceEncoder

    st = as_sentence_transformer(headless["hf"], tmp_path / "st")
    pooling = st / "1_Pooling" / "config.json"
    for mode in ("weightedmean", "lasttoken"):
        pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode": mode}))
        import_any(st, tmp_path / mode)
        with pytest.raises(ValueError, match=f"pooling mode {mode} is not one mmadapt computes .*: encode with the "
                                             "exported directory$"):
            SentenceEncoder.load(tmp_path / mode)


def test_sentence_bert_config_settings_of_another_type_are_refused(tmp_path):
    """max_seq_length and do_lower_case are read as sentence-transformers applies them; a string
    ("128", "false") would cut nothing or lower-case every text: refused in one line naming the
    file; null is unset (the tokenizer's model_max_length then)."""
    from mmadapt.hf import sentence_settings

    path = tmp_path / "sentence_bert_config.json"
    for bad, message in (({"max_seq_length": "128"}, "max_seq_length is '128', not a whole number"),
                         ({"max_seq_length": 0}, "max_seq_length is 0"),
                         ({"max_seq_length": True}, "max_seq_length is True"),
                         ({"do_lower_case": "false"}, "do_lower_case is 'false', not true or false")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"^{path}: {message}"):
            sentence_settings(tmp_path)
    path.write_text(json.dumps({"max_seq_length": None, "do_lower_case": False}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert sentence_settings(tmp_path) == {"do_lower_case": False, "max_seq_length": 256}
    path.write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    assert sentence_settings(tmp_path) == {"max_seq_length": 128, "do_lower_case": True}


def test_a_sentence_encoders_default_prompt_goes_before_every_text(headless, tmp_path):
    """An E5-style directory whose config_sentence_transformers.json names a default prompt:
    sentence-transformers encodes "query: " + text, and so does SentenceEncoder (it encoded the
    bare text, 0.08 off on all-MiniLM-L6-v2 so configured). A Pooling module that leaves the
    prompt out (include_prompt false) is refused in one line."""
    from sentence_transformers import SentenceTransformer

    from mmadapt.predict import SentenceEncoder

    st = as_sentence_transformer(headless["hf"], tmp_path / "st", max_seq_length=16)
    config = st / "config_sentence_transformers.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prompts": {"query": "query: ", "doc": ""},
                                  "default_prompt_name": "query"}))
    import_any(st, tmp_path / "run")
    texts = [*TEXTS[:3], " ".join(TEXTS)]  # the last cut at 16 pieces, the prompt's among them
    theirs = SentenceTransformer(str(st), device="cpu").encode(texts, convert_to_tensor=True)
    encoder = SentenceEncoder.load(tmp_path / "run")
    assert encoder.prompt == "query: " and (encoder.encode(texts) - theirs).abs().max().item() <= 1e-5
    pooling = tmp_path / "run" / "sentence_transformers" / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "include_prompt": False}))
    with pytest.raises(ValueError, match="leaves the default prompt's positions out"):
        SentenceEncoder.load(tmp_path / "run")


def test_imported_body_gives_transformers_hidden_states(headless):
    tok = AutoTokenizer.from_pretrained(str(headless["hf"]))
    hf = AutoModel.from_pretrained(str(headless["hf"])).eval()
    enc = tok(TEXTS, padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
    cfg, state = load_weights(headless["run"])
    assert not any(k.startswith("heads.") for k in state) and "pooler.dense.weight" in state
    body = BertEncoder(no_dropout(cfg)).eval()
    body.load_state_dict({k: v for k, v in state.items() if not k.startswith("pooler.")})
    ids = rows(load(headless["run"] / "tokenizer" / "spm.model"), TEXTS)
    with torch.no_grad():
        out = hf(**enc)
        mine = body.encode(ids, (cfg.num_layers,))[0]
        pooled = torch.tanh(torch.nn.functional.linear(mine[:, 0], state["pooler.dense.weight"],
                                                       state["pooler.dense.bias"]))
    diff = (mine - out.last_hidden_state).abs().max().item()
    print(f"BertModel: max abs hidden-state difference {diff:.2e}")
    assert diff <= TOL and (pooled - out.pooler_output).abs().max().item() <= TOL
    record = json.loads((headless["run"] / "run.json").read_text())["imported_from"]
    assert record["headless"] and record["architecture"] == "BertModel"
    assert (headless["run"] / "sentence_transformers" / "modules.json").is_file()


# --- out again ---------------------------------------------------------------------------------------

def test_export_of_an_imported_bert_is_the_original(runs, hf_dirs, tmp_path):
    export_hf(tmp_path / "out", primary=runs["trained"])
    tok, orig = (AutoTokenizer.from_pretrained(str(d)) for d in (tmp_path / "out", hf_dirs["trained"]))
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(enc.input_ids, orig(TEXTS, padding=True, return_tensors="pt").input_ids)
    pair = [t("In the beginning", "God created") for t in (tok, orig)]
    assert pair[0] == pair[1] and sum(pair[0]["token_type_ids"]) > 0
    with torch.no_grad():
        got = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out")).eval()(**enc).logits
        ref = AutoModelForMaskedLM.from_pretrained(str(hf_dirs["trained"])).eval()(**enc).logits
    assert type(AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out"))).__name__ == "BertForMaskedLM"
    assert torch.equal(got, ref)  # the same weights, back in the source's order: bit for bit


def test_pair_task_token_types_and_logits_equal_bert_for_sequence_classification(runs, hf_dirs, tmp_path):
    """BERT's framing: [CLS] a [SEP] b [SEP], the second segment and its [SEP] type 1, in mmadapt's
    ids and in transformers'; the classifier (pooler -> linear) gives BertForSequenceClassification's
    logits on the same weights."""
    sp = load(runs["trained"] / "tokenizer" / "spm.model")
    short = [" ".join(t.split()[:9]) for t in TEXTS]
    pairs = [PairExample(a, b, 0) for a, b in zip(short[:5], short[5:])]
    # and pairs cut to the 61 pieces beside BERT's 3 specials: each text over 30 pieces, the first
    # longer, the second longer, a tie; the first keeps the odd piece only where it is longer
    long = [TEXTS[0] + " " + TEXTS[1], TEXTS[2] + " " + TEXTS[3]]
    pairs += [PairExample(long[0] + " " + TEXTS[4], long[1], 0), PairExample(long[1], long[0] + " " + TEXTS[4], 0),
              PairExample(long[0], long[0], 0)]
    assert all(len(sp.encode(p.sentence1)) > 30 and len(sp.encode(p.sentence2)) > 30 for p in pairs[-3:])
    enc = encode_classify(sp, pairs, SEQ, BERT.framing)
    tok = AutoTokenizer.from_pretrained(str(hf_dirs["trained"]))
    ref = tok([p.sentence1 for p in pairs], [p.sentence2 for p in pairs], padding="max_length", truncation="longest_first",
              max_length=SEQ, return_tensors="pt")
    assert torch.equal(torch.tensor(sp.hf_ids)[enc.input_ids], ref.input_ids)
    assert torch.equal(enc.token_types, ref.token_type_ids) and enc.token_types.sum() > 0
    cfg, state = load_weights(runs["trained"])
    model = BertForTask(no_dropout(cfg), "classify", 3, seed=5).eval()
    model.load_state_dict({**model.state_dict(), **BERT.task_state(cfg, state)})
    with torch.no_grad():
        mine = model(enc.input_ids, token_types=enc.token_types)[1]
        # what the types change: the body's output (the classifier's logits, a fresh random head
        # over a tanh pooler, move by only ~1e-3, too close to the tolerance to say)
        typed, typeless = (model.encode(enc.input_ids, (cfg.num_layers,), None, t)[0] for t in (enc.token_types, None))
    write_hf(BERT, tmp_path / "clf", cfg, model.state_dict(), "classify", ["a", "b", "c"],
             runs["trained"] / "tokenizer" / "spm.model", "bert")
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "clf")).eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    with torch.no_grad():
        theirs = hf(**ref).logits
    diff = (mine - theirs).abs().max().item()
    print(f"pair classifier: max abs logit difference {diff:.2e}; token types move the body's output by "
          f"{(typed - typeless).abs().max().item():.2e}")
    assert diff <= TOL and (typed - typeless).abs().max().item() > 1e3 * TOL


def test_a_pair_classifier_over_a_one_type_bert_exports_to_what_transformers_runs(runs, de_tokenizer, tmp_path):
    """A BERT with one token-type row reads a pair's second segment as type 0; its export, with the
    imported WordPiece or an mmadapt SentencePiece, gives type 0 there too (transformers raised
    IndexError on every pair when the tokenizer gave type 1), and transformers' logits on the
    exported tokenizer's pairs equal mmadapt's."""
    cfg, state = load_weights(runs["trained"])
    cfg = dataclasses.replace(cfg, type_vocab_size=1)
    state = {**state, "embeddings.token_type_embeddings.weight": state["embeddings.token_type_embeddings.weight"][:1]}
    model = BertForTask(no_dropout(cfg), "classify", 3, seed=5).eval()
    model.load_state_dict({**model.state_dict(), **BERT.task_state(cfg, state)})
    tokenizer = runs["trained"] / "tokenizer" / "spm.model"
    write_hf(BERT, tmp_path / "clf", cfg, model.state_dict(), "classify", ["a", "b", "c"], tokenizer, "bert")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "clf"))
    short = [" ".join(t.split()[:9]) for t in TEXTS]
    pairs = [PairExample(a, b, 0) for a, b in zip(short[:5], short[5:])]
    ref = tok([p.sentence1 for p in pairs], [p.sentence2 for p in pairs], padding="max_length", max_length=SEQ,
              truncation="longest_first", return_tensors="pt")
    enc = encode_classify(load(tokenizer), pairs, SEQ, BERT.framing)
    assert torch.equal(torch.tensor(load(tokenizer).hf_ids)[enc.input_ids], ref.input_ids)
    assert int(ref.token_type_ids.max()) == 0
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "clf")).eval()
    with torch.no_grad():
        diff = (model(enc.input_ids, token_types=enc.token_types)[1] - hf(**ref).logits).abs().max().item()
    assert diff <= TOL, diff
    own = spm_to_hf(de_tokenizer, SEQ, BERT.hf.tokenizer_layout("classify", False, cfg))
    assert set(own("Am Anfang", "schuf Gott").token_type_ids) == {0}


def test_exported_sentencepiece_lays_a_pair_out_as_bert(de_tokenizer):
    """A Step-2 vocabulary goes out with BERT's template: its pair's second segment type 1."""
    tok, sp = spm_to_hf(de_tokenizer, SEQ, BERT.hf.tokenizer_layout(None, False, ModelConfig(type_vocab_size=2))), \
        load(de_tokenizer)
    a, b = sp.encode("Am Anfang"), sp.encode("schuf Gott")
    got = tok("Am Anfang", "schuf Gott")
    assert got.input_ids == BERT.framing.pair(a, b)[0] == [BOS_ID, *a, EOS_ID, *b, EOS_ID]
    assert got.token_type_ids == BERT.framing.pair(a, b)[1] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert tok("Am Anfang").input_ids == [BOS_ID, *a, EOS_ID]


def test_export_of_a_bert_mmadapt_pretrained(corpus, tokenizer, tmp_path, capsys):
    """bert-tiny pretrained here (2 updates), out as BertForMaskedLM with its SentencePiece. Its
    preset's warm-up (20 updates) is longer than the run: accepted, and said once."""
    from mmadapt import steps
    from mmadapt.config import apply_recipe
    from mmadapt.models import PRESETS
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    model = dataclasses.replace(apply_recipe(PRESETS["bert-tiny"][0], "bl_base"), num_layers=2, head_layers=(2,),
                                vocab_size=load(tokenizer).get_piece_size(), max_position_embeddings=SEQ)
    train = dataclasses.replace(PRESETS["bert-tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                train_micro_batch_size_per_gpu=4, seq_length=SEQ, extra_save_steps=(1, 5))
    run = tmp_path / "run"
    steps.pretrain(run=RunSpec(output_dir=run, corpus=corpus, ds_config=REPO / "ds_configs" / "zero0.json",
                               tokenizer=tokenizer), step=steps.Pretrain(model=model, train=train, recipe="bl_base"))
    out = capsys.readouterr().out
    # a save asked for past the run's end: said, as the warm-up is
    assert [line for line in out.splitlines() if "extra_save_steps" in line] == [
        "note: --extra_save_steps 5 is past the run's last update (2): no checkpoint is saved there"]
    said = [line for line in out.splitlines() if "warm-up" in line]
    assert said == [f"note: the learning-rate warm-up ({train.lr_warmup_iters} updates, --lr_warmup_iters) is longer "
                    f"than the run (2): the rate peaks at {2 / train.lr_warmup_iters:.0%} of --lr and never decays; "
                    "set --lr_warmup_iters below 2"]
    assert export_hf(tmp_path / "out", primary=run)["architecture"] == "BertForMaskedLM"
    enc = AutoTokenizer.from_pretrained(str(tmp_path / "out"))(TEXTS, padding=True, truncation=True, max_length=SEQ,
                                                               return_tensors="pt")
    ids = rows(load(tokenizer), TEXTS)  # cut as rows cuts: [CLS], the first SEQ - 2 pieces, [SEP]
    assert torch.equal(enc.input_ids, ids)
    with torch.no_grad():
        theirs = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out")).eval()(**enc).logits
    diff = (mlm_logits(*load_weights(run), ids) - theirs).abs().max().item()
    assert diff <= TOL, diff


# --- WordPiece as a source tokenizer: surfaces, overlap, subword mean, expansion, predict -----------

def test_wordpiece_surface_forms(runs):
    sp = load(runs["cased"] / "tokenizer" / "spm.model")
    raw = sp.tokenizer
    piece = {t: sp.id_to_piece(int(sp.to_mmadapt[i])) for t, i in raw.get_vocab().items()}
    assert piece["the"] == "▁the" and piece[","] == "," and piece["."] == "."
    continuation = next(t for t in raw.get_vocab() if t.startswith("##") and len(t) > 3)
    assert piece[continuation] == continuation[2:]
    surfaces = tokenizer_pieces(runs["cased"] / "tokenizer" / "spm.model")
    assert len(set(surfaces)) == len(surfaces)  # one row per surface form


def test_a_character_bert_isolates_surfaces_as_its_bare_token(tmp_path):
    """Punctuation (and CJK, where the normaliser handles Chinese characters) is a word of its own
    wherever it stands, so BERT produces its bare token even after a word (`God,`): that row is
    the surface `,` a target piece matches and a word-internal split takes; the continuation
    `##,` that real BERT vocabularies also hold is never produced and matches nothing."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", "##,", "God", "and", "##d", "中", "##中", "##文"]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    sp = HFTokenizer(HFTokenizer.document(tok.to_str(), list(range(len(vocab))), "test"))
    surface = {t: sp.id_to_piece(i) for i, t in enumerate(vocab) if i >= 5}
    assert surface == {",": ",", "##,": "##,", "God": "▁God", "and": "▁and", "##d": "d", "中": "中", "##中": "##中",
                       "##文": "##文"}  # never produced either: 文 is a word of its own
    assert [vocab[i] for i in tok.encode("God, and").ids] == ["God", ",", "and"]  # the bare ',' after a word
    assert sp.split_surface(",") == [vocab.index(",")] and sp.split_surface("中") == [vocab.index("中")]
    assert sp.split_surface("d") == [vocab.index("##d")]  # a word's inside is still a continuation
    # a target piece of such a character matches its bare row at a word's start too ...
    assert [sp.source_form(p) for p in ("▁,", "▁中", "▁and", "d")] == [",", "中", "▁and", "d"]
    # ... and an expansion adds it as its bare token, under the surface it is named by, and
    # leaves out a piece the pipeline would cut into characters (never produced)
    from mmadapt.tokenizer import expand_hf
    source = tmp_path / "wordpiece.json"
    source.write_text(json.dumps(sp.doc))
    merged, new = expand_hf(source, ["字", "nd", "文字", "▁bis"], 1)
    grown = HFTokenizer(json.loads(merged))
    assert new == ["字", "nd", "▁bis"] and [grown.id_to_piece(i) for i in range(len(vocab), len(vocab) + 3)] == new
    assert [grown.tokenizer.id_to_token(int(grown.hf_ids[len(vocab)]))] == ["字"]
    # an uncased source strips accents: a lone combining mark (Hindi's virama, anusvara) normalises
    # to nothing, a token it would never match; it is left out (it was added, a row no text reaches)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    uncased = tmp_path / "uncased.json"
    uncased.write_text(json.dumps(HFTokenizer.document(tok.to_str(), list(range(len(vocab))), "test")))
    assert expand_hf(uncased, ["\u094d", "▁\u0902", "▁bis"], 1)[1] == ["▁bis"]


def test_overlap_with_a_wordpiece_source(runs, de_tokenizer):
    """German SentencePiece pieces start from the English WordPiece rows of the same text: `▁in` from
    `in`, `,` from `,`; an uncased source matches `▁Israel` with `israel`."""
    trg = tokenizer_pieces(de_tokenizer)
    for name in ("cased", "uncased"):
        src_tok = runs[name] / "tokenizer" / "spm.model"
        src = tokenizer_pieces(src_tok)
        w = torch.randn(len(src), 8)
        new, counts = A.init_rows("overlap", src_tok, {WORD: w}, trg, 0.02, 0)
        for t, s in (("▁in", "▁in"), (",", ","), ("▁Israel", "▁israel" if name == "uncased" else "▁Israel")):
            assert torch.equal(new[WORD][trg.index(t)], w[src.index(s)]), (name, t)
        print(f"{name}: {counts['shared_pieces']} of {len(trg)} German pieces shared")
        assert counts["shared_pieces"] > 100


def test_subword_mean_splits_with_wordpiece_continuations(runs, hf_dirs):
    """A word-internal piece splits into `##` continuations, as WordPiece splits it inside a word."""
    src_tok = runs["cased"] / "tokenizer" / "spm.model"
    sp = load(src_tok)
    split = A.source_split(src_tok)
    tok = AutoTokenizer.from_pretrained(str(hf_dirs["cased"]))
    word = next(w for w in "Pharaoh Egyptians wilderness firstborn Philistines tabernacle Canaanites".split()
                if len(tok.tokenize(w)) >= 3)
    pieces = tok.tokenize(word)
    inside = word[len(pieces[0]):]
    assert split(inside) == [sp.piece_to_id(p) for p in pieces[1:]]
    assert split("▁" + word) == sp.encode(word)
    w = torch.randn(sp.get_piece_size(), 4)
    new, counts = A.init_rows("subword_mean", src_tok, {WORD: w}, [inside], 0.02, 0)
    assert counts["subword_mean_pieces"] == 1
    torch.testing.assert_close(new[WORD][0], w[split(inside)].mean(0))


@pytest.mark.parametrize("name", ["cased", "uncased"])
def test_wordpiece_vocabulary_expands(name, runs, de_tokenizer, tmp_path):
    """--vocab_mode expand: the German pieces a WordPiece lacks, appended as tokens (`##` for
    word-internal ones; an uncased source's in lower case); the source's ids keep their pieces."""
    from mmadapt.expand import check_expansion, expand

    src_tok = runs[name] / "tokenizer" / "spm.model"
    expansion = expand(src_tok, de_tokenizer)
    merged = expansion.write(tmp_path / "merged.model")
    assert check_expansion(src_tok, merged) == expansion.source_size and expansion.size % 8 == 0
    tok, src = HFTokenizer.read(merged), load(src_tok)
    german = bible_lines("de", range(1, 2))[:200]
    new_used = sum(i >= expansion.source_size for t in german for i in tok.encode(t))
    assert new_used > 0 and len(expansion.new) > 50
    if name == "uncased":
        assert all(p == p.lower() for p in expansion.new)
    english = bible_lines("en", range(1, 2))[:200]
    same = sum(tok.encode(t) == src.encode(t) for t in english)
    print(f"{name}: {len(expansion.new)} new pieces; {same} of {len(english)} English verses keep their pieces")
    assert same > 0.5 * len(english)


def test_an_expanded_bert_tokenizer_exports_with_its_token_types(runs, de_tokenizer, tmp_path):
    """An expanded vocabulary of an imported two-type BERT exports its merged document as the
    tokenizer (hf._document_tokenizer): it gives token_type_ids, the pair's second segment type 1,
    as the source's does (PreTrainedTokenizerFast's own input names leave them out, and
    transformers then reads every position as type 0)."""
    from mmadapt.expand import expand
    from mmadapt.hf import export_tokenizer

    src_tok = runs["trained"] / "tokenizer" / "spm.model"
    merged = expand(src_tok, de_tokenizer).write(tmp_path / "merged.model")
    cfg, _ = load_weights(runs["trained"])
    assert cfg.type_vocab_size == 2
    hf_tok, _ = export_tokenizer(BERT.hf, merged, "classify", cfg, source_hf=runs["trained"] / "tokenizer" / "hf")
    pair = hf_tok("Am Anfang schuf Gott", "Himmel und Erde")
    ref = AutoTokenizer.from_pretrained(str(runs["trained"] / "tokenizer" / "hf"))("In the beginning", "God created")
    assert "token_type_ids" in pair and "token_type_ids" in ref
    assert pair["token_type_ids"][0] == 0 and pair["token_type_ids"][-1] == 1


def test_a_wordpiece_whose_model_has_rows_past_it_expands(hf_dirs, de_tokenizer, tmp_path):
    """A model with embedding rows past its WordPiece (a vocabulary padded to a multiple): the
    merged tokenizer's filler tokens for those rows keep the surface the source gives them, so
    the expansion checks (they were written as word starts, and --vocab_mode expand refused it)."""
    from transformers import AutoModelForMaskedLM

    from mmadapt.expand import check_expansion, expand
    from mmadapt.hf import import_hf

    tok = AutoTokenizer.from_pretrained(str(hf_dirs["cased"]))
    hf = AutoModelForMaskedLM.from_pretrained(str(hf_dirs["cased"]))
    hf.resize_token_embeddings(len(tok) + 3)
    hf.save_pretrained(str(tmp_path / "hf"))
    tok.save_pretrained(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "run")
    src_tok = tmp_path / "run" / "tokenizer" / "spm.model"
    expansion = expand(src_tok, de_tokenizer)
    assert check_expansion(src_tok, expansion.write(tmp_path / "merged.model")) == len(tok) + 3


def test_predict_shows_wordpiece_surfaces(runs):
    from mmadapt import predict

    lm = predict.load(runs["trained"], device="cpu")
    out = lm.fill_mask(["In the beginning God created the heaven and the <mask>."], top_k=20)[0][0]
    assert len(out) == 20 and not any("##" in c["text"] or "▁" in c["text"] for c in out), out
    assert any(not c["piece"].startswith("▁") for c in out)  # a continuation or punctuation among them


# --- FLOPs: RoBERTa's counts, checked on BERT's modules ---------------------------------------------

@pytest.mark.parametrize("step", ["pretrain", "adapt", "minipost", "fit_head"])
def test_bert_flops_equal_exact(step):
    from mmadapt.flops import counted_flops
    from mmadapt.models import PRESETS
    from mmadapt.parallel import init_parallel

    init_parallel(1, 1)
    cfg = dataclasses.replace(BERT.one_head(PRESETS["bert-tiny"][0], 4), vocab_size=300, attention_impl="math",
                              hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (3, 32), generator=g)
    labels = torch.full_like(ids, -100)
    flat = torch.randperm(ids.numel(), generator=g)[:14]
    labels.view(-1)[flat] = ids.view(-1)[flat]
    model = BertMLM(cfg)
    trainable = {"pretrain": None, "adapt": (WORD, BIAS), "minipost": BERT.minipost_trainable(2, 2),
                 "fit_head": (BERT.heads_prefix,)}[step]
    if trainable is not None:
        from mmadapt.engine import trainable_by_names
        keep = trainable_by_names(trainable)
        for n, p in model.named_parameters():
            p.requires_grad_(keep(n))

    def update():
        model(ids, labels)[0].backward()
    counted = counted_flops(update)
    exact = 3 * BERT.step_flops(step, cfg, 32, 14 / ids.numel(), trainable_layers=2)
    assert counted == pytest.approx(exact, rel=1e-9)


# --- tensor parallel 2 (slow) -------------------------------------------------------------------------

@pytest.mark.slow
def test_imported_bert_under_tensor_parallel_2(hf_dirs, runs, tmp_path):
    args = []
    for name in ("trained", "uncased"):
        sp = load(runs[name] / "tokenizer" / "spm.model")
        torch.save(rows(sp, TEXTS), tmp_path / f"{name}.pt")
        args += [str(runs[name]), str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}_logits.pt")]
    run_pretrain(2, *args, script=str(REPO / "tests" / "hf_tp_worker.py"))
    for name in ("trained", "uncased"):
        sp = load(runs[name] / "tokenizer" / "spm.model")
        tok = AutoTokenizer.from_pretrained(str(hf_dirs[name]))
        enc = tok(TEXTS, padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
        with torch.no_grad():
            ref = AutoModelForMaskedLM.from_pretrained(str(hf_dirs[name])).eval()(**enc).logits[..., torch.tensor(sp.hf_ids)]
        diff = (torch.load(tmp_path / f"{name}_logits.pt") - ref).abs().max().item()
        print(f"{name} at tensor parallel 2: max abs logit difference {diff:.2e}")
        assert diff <= TOL


@pytest.mark.slow
def test_an_imported_bert_vocabulary_that_tensor_parallel_2_pads(tmp_path):
    """A BERT with an odd number of rows (multilingual BERT's 119,547 divide by no tensor-parallel
    size), imported, at tensor parallel 2, padded by one row (ModelConfig.padded_vocab_size): the
    word embedding, and BERT's own output bias beside it, give transformers' logits over the
    WordPiece and -inf in the padding column."""
    hf_dir = make_bert(tmp_path / "hf", odd=True)
    run = import_all({"odd": hf_dir}, tmp_path / "imported")["odd"]
    cfg, _ = load_weights(run)
    assert cfg.vocab_size % 2 == 1 and dataclasses.replace(cfg, tensor_model_parallel_size=2).padded_vocab_size == \
        cfg.vocab_size + 1
    sp = load(run / "tokenizer" / "spm.model")
    torch.save(rows(sp, TEXTS), tmp_path / "ids.pt")
    run_pretrain(2, str(run), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"),
                 script=str(REPO / "tests" / "hf_tp_worker.py"))
    got = torch.load(tmp_path / "logits.pt")
    assert got.shape[-1] == cfg.vocab_size + 1 and torch.isneginf(got[..., -1]).all()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    enc = tok(TEXTS, padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
    with torch.no_grad():
        ref = AutoModelForMaskedLM.from_pretrained(str(hf_dir)).eval()(**enc).logits[..., torch.tensor(sp.hf_ids)]
    diff = (got[..., :-1] - ref).abs().max().item()
    print(f"an odd BERT vocabulary at tensor parallel 2: max abs logit difference {diff:.2e}")
    assert diff <= TOL


# --- headless encoders end to end (slow): import -> fit-head -> MINIPOST -> Step 2 -> 3 -> 4 -> export ---

E2E_SCHEDULE = ["--seq_length", str(SEQ), "--train_micro_batch_size_per_gpu", "8", "--log_interval", "5",
                "--ds_config", str(REPO / "ds_configs" / "zero0.json")]
HEAD_UPDATES = 200  # from a head whose random logits spread by 1 nat (steps.head_scale) to below the reference


@pytest.fixture(scope="module")
def headless_xlmr(tmp_path_factory):
    """An XLMRobertaModel body (its masked LM trained briefly, the head dropped) saved as a
    sentence-transformers directory, its transformer in 0_Transformer/ (as some checkpoints lay it out)."""
    root = tmp_path_factory.mktemp("xlmr")
    body = make_headless_xlmr(root / "hf", train_steps=TRAIN_STEPS)
    return {"st": as_sentence_transformer(body, root / "st", subfolder="0_Transformer")}


def sentence_vectors(family, cfg, state, ids: torch.Tensor) -> torch.Tensor:
    """mmadapt's own sentence vectors: the body's last layer, mean over the non-padding positions
    (sentence-transformers' mean pooling), normalised."""
    body = family.build_body(no_dropout(cfg)).eval()
    body.load_state_dict({k: v for k, v in state.items() if k in body.state_dict()})
    with torch.no_grad():
        x = body.encode(ids, (cfg.num_layers,))[0]
    keep = ids.ne(PAD_ID)[..., None].float()
    return torch.nn.functional.normalize((x * keep).sum(1) / keep.sum(1), dim=-1)


def test_a_head_fit_on_too_little_text_says_it_cannot_judge(headless, tmp_path, capsys):
    """Three verses, 64 times over: every block of the text is the same one, too few distinct
    blocks and masked pieces to set a head against the unigram reference, which the head fit
    says (below_unigram None) instead of a verdict drawn from copies of one block."""
    text = "In the beginning God created the heaven and the earth.\nAnd the earth was without form.\nAnd God said.\n\n"
    corpus = tmp_path / "three.txt"
    corpus.write_text(text * 64)
    assert main(["fit-head", "--primary", str(headless["run"]), "--corpus", str(corpus), "--output_dir",
                 str(tmp_path / "head"), "--train_iters", "2", "--save_interval", "2", *E2E_SCHEDULE]) == 0
    record = json.loads((tmp_path / "head" / "run.json").read_text())
    out = capsys.readouterr().out
    assert record["below_unigram"] is None and "too little text to judge" in out, out


def test_a_sigterm_while_the_fitted_head_is_scored_stops_the_fit_for_resume(headless, corpus, tmp_path, capsys,
                                                                              monkeypatch):
    """fit-head scores its head against the unigram reference after its last checkpoint: a SIGTERM
    there (scancel, preemption) killed it with 143 and no word, which the SLURM templates requeue
    only after their own warning. It stops as in the training loop (75, one line); --resume
    then scores the head without training."""
    from mmadapt import steps

    args = ["fit-head", "--primary", str(headless["run"]), "--corpus", str(corpus), "--output_dir",
            str(tmp_path / "head"), "--train_iters", "2", "--save_interval", "2", *E2E_SCHEDULE]
    scored = steps.masked_loss
    monkeypatch.setattr(steps, "masked_loss", sigterm_before(scored, wait=2))
    assert main(args) == 75
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("stopped by SIGTERM at update 2: checkpoint "
                                                                "step00000002 is complete; run the same command "
                                                                "with --resume to continue")
    record, logged = json.loads((tmp_path / "head" / "run.json").read_text()), metrics(tmp_path / "head")
    assert "below_unigram" not in record and record.get("finished_at") is None
    monkeypatch.setattr(steps, "masked_loss", scored)
    assert main([*args, "--resume"]) == 0
    assert "below_unigram" in json.loads((tmp_path / "head" / "run.json").read_text())
    assert metrics(tmp_path / "head") == logged  # nothing trained again


def test_a_head_fit_stopped_after_its_last_save_keeps_its_final_loss(headless, corpus, tmp_path, capsys):
    """A head fit stopped after it saved its last update, before it finished its record: resumed,
    it trains nothing in that process, yet its record and done line keep the run's final training
    loss (read from the run's log; its record had final_loss None and no done line)."""
    args = ["fit-head", "--primary", str(headless["run"]), "--corpus", str(corpus), "--output_dir",
            str(tmp_path / "head"), "--train_iters", "4", "--save_interval", "4", *E2E_SCHEDULE, "--log_interval", "2"]
    assert main(args) == 0
    path = tmp_path / "head" / "run.json"
    finished = json.loads(path.read_text())
    done = [l for l in capsys.readouterr().out.splitlines() if l.startswith("done: step 4, loss ")]
    assert finished["final_loss"] is not None and len(done) == 1
    # its cost: the 4 updates of 8 blocks, and the rows the head projected, recounted from the data
    # (the masking draws among ordinary pieces only: fewer than mask_prob of every position)
    from conftest import scored_rows
    from mmadapt.config import ModelConfig, TrainConfig

    model, train = ModelConfig(**finished["model"]), TrainConfig(**finished["train"])
    rows = scored_rows(BERT, finished["data_path"], model, train, 4)
    base, per_row = BERT.row_flops("fit_head", model, SEQ)
    assert finished["scored_rows"] == rows < train.mask_prob * 4 * 8 * SEQ
    assert finished["flops"] == pytest.approx(base * 4 * 8 + per_row * rows, rel=1e-12)
    started = {k: v for k, v in finished.items() if k not in ("final_loss", "heldout_loss", "below_unigram", "flops",
                                                                "v100_days", "scored_rows")}
    path.write_text(json.dumps(started, indent=2))  # the record as the run left it when stopped
    assert main([*args, "--resume"]) == 0
    resumed = json.loads(path.read_text())
    assert resumed["final_loss"] == finished["final_loss"] and resumed["heldout_loss"] == finished["heldout_loss"]
    assert (resumed["flops"], resumed["scored_rows"]) == (finished["flops"], finished["scored_rows"])  # its checkpoint's
    assert [l for l in capsys.readouterr().out.splitlines() if l.startswith("done: ")] == done


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_headless_sentence_encoder_end_to_end(kind, headless, headless_xlmr, corpus, de_corpus, de_tokenizer,
                                              tmp_path, capsys):
    """A sentence-transformers BertModel (the trained BERT's body) and XLMRobertaModel: import,
    a head fit whose final loss is below the unigram reference, MINIPOST, German Step 2, Step 3,
    Step 4, export: the exported sentence-transformers directory encodes German sentences as
    mmadapt's body does with the German embeddings."""
    from sentence_transformers import SentenceTransformer

    from mmadapt.parallel import init_parallel

    init_parallel(1, 1)
    st = (headless if kind == "bert" else headless_xlmr)["st"]
    run, head, mp, ad, ft, out = (tmp_path / d for d in ("run", "head", "minipost", "adapt", "ft", "export"))
    assert main(["import-hf", "--model", str(st), "--output_dir", str(run)]) == 0
    assert main(["fit-head", "--primary", str(run), "--corpus", str(corpus), "--output_dir", str(head),
                 "--train_iters", str(HEAD_UPDATES), "--save_interval", str(HEAD_UPDATES), "--lr", "1e-2",
                 *E2E_SCHEDULE]) == 0
    record = json.loads((head / "run.json").read_text())
    print(f"{kind} head fit: {record['heldout_loss']:.4f} on the text's blocks, unigram reference "
          f"{record['unigram_loss']:.4f}")
    # The head starts about the unigram reference (output bias at the log-frequencies, its random
    # logits spread by 1 nat: steps.head_scale) and goes below it by reading the body's context.
    assert record["below_unigram"] and record["heldout_loss"] < record["unigram_loss"]
    assert record["step"] == "fit_head" and record["trainable"] == ["heads.heads."] and record["flops"] > 0
    assert main(["build_minipost", "--primary", str(head), "--output_dir", str(mp), "--mini_layers", "2",
                 "--new_layers", "1", "--train_iters", "4", "--save_interval", "4", *E2E_SCHEDULE]) == 0
    assert main(["adapt", "--system", "minipost", "--source", str(mp), "--lang", "de", "--corpus", str(de_corpus),
                 "--tokenizer", str(de_tokenizer), "--output_dir", str(ad), "--train_iters", "4",
                 "--save_interval", "4", "--lr", "5e-3", *E2E_SCHEDULE]) == 0
    assert main(["finetune", "--task", "bible-genre", "--primary", str(head), "--output_dir", str(ft),
                 "--seq_length", str(SEQ), "--epochs", "0.02", "--ds_config", str(REPO / "ds_configs" / "zero0.json")]) == 0
    artifact = ad / "embeddings" / "step00000004"
    assert main(["evaluate", "--finetuned", str(ft), "--embeddings", str(artifact), "--eval_file", "bible",
                 "--output", str(tmp_path / "step4.json")]) == 0
    assert json.loads((tmp_path / "step4.json").read_text())[0]["lang"] == "de"
    capsys.readouterr()
    # the adapt run itself, as evaluate takes it: its last artifact (step 4), said so
    assert main(["export-hf", "--primary", str(head), "--embeddings", str(ad), "--output_dir", str(out)]) == 0
    assert f"its last artifact, {artifact}, is used" in capsys.readouterr().err
    # the fine-tuned classifier with the German embeddings: transformers' class, mmadapt's logits
    assert main(["export-hf", "--finetuned", str(ft), "--embeddings", str(artifact), "--output_dir",
                 str(tmp_path / "clf")]) == 0
    capsys.readouterr()
    texts = bible_lines("de", range(2, 3))[:6]
    _, _, mine = TaskModel.load(ft, artifact).logits(texts)
    clf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "clf")).eval()
    assert type(clf).__name__ == ("BertForSequenceClassification" if kind == "bert" else
                                  "XLMRobertaForSequenceClassification")
    with torch.no_grad():
        theirs = clf(**AutoTokenizer.from_pretrained(str(tmp_path / "clf"))(
            texts, padding=True, truncation=True, max_length=SEQ, return_tensors="pt")).logits
    print(f"{kind}: exported zero-shot classifier vs mmadapt's logits, max abs difference "
          f"{(theirs - mine).abs().max().item():.2e}")
    assert (theirs - mine).abs().max().item() <= TOL

    german = bible_lines("de", range(1, 2))[:8]
    model = SentenceTransformer(str(out / "sentence_transformers"), device="cpu", local_files_only=True)
    assert model.max_seq_length == 64  # the source's (as_sentence_transformer), kept through the import
    got = torch.from_numpy(model.encode(german))
    cfg, state = load_weights(head)
    emb, tokenizer, _ = read_artifact(artifact)
    state = {**state, WORD: emb["word_embeddings"]}
    cfg = dataclasses.replace(cfg, vocab_size=emb["word_embeddings"].shape[0])
    mine = sentence_vectors(get_family(cfg), cfg, state, rows(load(tokenizer), german))
    diff = (got - mine).abs().max().item()
    print(f"{kind}: exported sentence-transformers vs mmadapt's German sentence vectors, max abs difference {diff:.2e}")
    assert got.shape == (8, cfg.hidden_size) and diff <= TOL


# --- parallel layouts against one process (slow): tensor, pipeline and ZeRO as RoBERTa's ----------

def _pretrain_args(corpus, tokenizer, out, *extra):
    from conftest import NO_DROPOUT, base_args

    return base_args(corpus, tokenizer, out, "--preset", "bert-tiny", "--recipe", "minijoint", "--train_iters", "3",
                     "--log_interval", "1", "--train_micro_batch_size_per_gpu", "8", *NO_DROPOUT, *extra)


@pytest.fixture(scope="module")
def bert_single(corpus, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_single")
    run_pretrain(1, *_pretrain_args(corpus, tokenizer, out, "--ds_config", "ds_configs/zero0.json",
                                    "--gradient_accumulation_steps", "2"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "zero2_dp2"])
def test_bert_layout_matches_single_process(layout, bert_single, corpus, tokenizer, tmp_path):
    """BERT pretraining (MINIJOINT: a head after layer 4 and 12) at TP 2, PP 2 (BERT's embeddings
    in the pipeline's layer 1) and ZeRO-2 over 2 gloo ranks: the losses and weights of one process."""
    from conftest import LAYOUTS, metrics

    from mmadapt.checkpoint import load_full_state_dict

    nproc, extra = LAYOUTS[layout]
    run_pretrain(nproc, *_pretrain_args(corpus, tokenizer, tmp_path, *extra))
    ref, got = metrics(bert_single), metrics(tmp_path)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in ref]),
                               rtol=1e-5, atol=0)
    mine, single = load_full_state_dict(tmp_path / "checkpoints"), load_full_state_dict(bert_single / "checkpoints")
    assert sorted(mine) == sorted(single) and "embeddings.token_type_embeddings.weight" in mine
    for name, w in single.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name} differs")


def test_a_head_fit_is_bound_to_its_body_by_content(headless, corpus, tmp_path, capsys):
    """A head fit keeps only its head and reads its body from the headless run at every load: a
    body replaced by another of the same shape is refused in one line naming both runs (the
    fingerprint of its content it recorded, run.sampled_fingerprint), and so is a body that is
    gone; the original body loads."""
    from mmadapt.checkpoint import write_weights_only
    from mmadapt.cli import main as cli
    from mmadapt.parallel import init_parallel
    from mmadapt.run import read_run

    init_parallel(1, 1)
    body = tmp_path / "body"
    shutil.copytree(headless["run"], body)
    head = tmp_path / "head"
    assert cli(["fit-head", "--primary", str(body), "--corpus", str(corpus), "--output_dir", str(head),
                "--train_iters", "2", "--save_interval", "2", *E2E_SCHEDULE]) == 0
    assert json.loads((head / "run.json").read_text())["frozen_from"]["fingerprint"]
    load_weights(head)
    cfg, state = load_weights(body)
    other = {k: v + 0.01 for k, v in state.items()}
    shutil.rmtree(body / "checkpoints")
    write_weights_only(body / "checkpoints", 0, other, json.loads((body / "run.json").read_text())["model"])
    read_run(body)
    capsys.readouterr()
    text = tmp_path / "in.txt"
    text.write_text("In the <mask> God created the heaven.\n")
    assert cli(["predict", "--run", str(head), "--input", str(text)]) == 2
    err = capsys.readouterr().err
    assert f"{head} was built on {body.resolve()}" in err and "whose weights have changed since" in err
    assert err.count("\n") == 1
    shutil.rmtree(body)
    assert cli(["predict", "--run", str(head), "--input", str(text)]) == 2
    assert "which is gone" in capsys.readouterr().err


def test_a_resume_over_a_changed_source_is_refused(runs, de_corpus, de_tokenizer, tmp_path, capsys, monkeypatch):
    """Step 2 and Step 3 record their source's weights (Step 2 its sampled fingerprint, Step 3
    the primary's full one); a --resume after the source was replaced by other weights of the
    same shape under the same path is refused in one line before anything trains, the run left
    as it was, and so are predict and export-hf of a Step-2 artifact swapped into the changed
    primary (its meta's fingerprints); over the source as it was, all of them work, and the
    load hashes a sample of the primary's weights, not all of them."""
    from mmadapt.checkpoint import write_weights_only
    from mmadapt.cli import main as cli
    from mmadapt.parallel import init_parallel

    init_parallel(1, 1)
    source = tmp_path / "source"
    shutil.copytree(runs["trained"], source)
    adapt = ["adapt", "--system", "bl_base", "--source", str(source), "--lang", "de", "--corpus", str(de_corpus),
             "--tokenizer", str(de_tokenizer), "--output_dir", str(tmp_path / "adapt"), "--train_iters", "2",
             "--save_interval", "1", "--lr", "5e-3", *E2E_SCHEDULE]
    finetune = ["finetune", "--task", "bible-genre", "--primary", str(source), "--output_dir", str(tmp_path / "ft"),
                "--seq_length", str(SEQ), "--epochs", "0.02", "--save_interval", "1",
                "--ds_config", str(REPO / "ds_configs" / "zero0.json")]
    assert cli([*adapt, "--exit_interval", "1"]) == 76 and cli([*finetune, "--exit_interval", "1"]) == 76
    assert json.loads((tmp_path / "adapt" / "run.json").read_text())["source_fingerprint"]
    cfg, state = load_weights(source)
    kept = tmp_path / "kept"
    shutil.move(source / "checkpoints", kept)
    write_weights_only(source / "checkpoints", 0, {k: v + 0.01 for k, v in state.items()},
                       json.loads((source / "run.json").read_text())["model"])
    capsys.readouterr()
    def content(d) -> list:
        return sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else None) for p in d.rglob("*"))
    for name, argv in (("adapt", adapt), ("ft", finetune)):
        before = content(tmp_path / name)
        assert cli([*argv, "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"{source.resolve()} changed since {tmp_path / name} started over it" in err and err.count("\n") == 1
        assert content(tmp_path / name) == before
    # a Step-3 run recorded before the sampled fingerprint: its resume is checked by the full one
    record = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert record["primary"].pop("sampled_fingerprint")
    (tmp_path / "ft" / "run.json").write_text(json.dumps(record, indent=2))
    before = content(tmp_path / "ft")
    assert cli([*finetune, "--resume"]) == 2
    assert "changed since" in capsys.readouterr().err and content(tmp_path / "ft") == before
    # the Step-2 artifact swapped into its changed primary: refused by predict and export-hf alike
    artifact = str(tmp_path / "adapt" / "embeddings" / "step00000001")
    text = tmp_path / "in.txt"
    text.write_text("Am Anfang <mask> Gott Himmel und Erde.\n")
    for argv in (["predict", "--run", str(source), "--embeddings", artifact, "--input", str(text)],
                 ["export-hf", "--primary", str(source), "--embeddings", artifact, "--output_dir", str(tmp_path / "x")]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert "and they have changed since (other weights under the same path)" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    shutil.rmtree(source / "checkpoints")
    shutil.move(kept, source / "checkpoints")
    # the source's weights as they were, its tokenizer replaced by another of its size (shared pieces
    # copied by another vocabulary)
    from mmadapt.data import train_tokenizer

    spm = source / "tokenizer" / "spm.model"
    own = spm.read_bytes()
    size = json.loads((source / "run.json").read_text())["model"]["vocab_size"]
    spm.write_bytes(train_tokenizer(de_corpus, tmp_path / "tok" / "other", size).read_bytes())
    before = content(tmp_path / "adapt")
    assert cli([*adapt, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{source.resolve()} changed since {tmp_path / 'adapt'} started over it (its tokenizer differs" in err, err
    assert err.count("\n") == 1 and content(tmp_path / "adapt") == before
    spm.write_bytes(own)
    assert cli([*adapt, "--resume"]) == 0 and cli([*finetune, "--resume"]) == 0
    # a load checks the primary by its sampled fingerprint: no full hash of its weights
    import mmadapt.artifact as artifact_module

    def full_hash(_):
        raise AssertionError("a load hashed every weight")
    monkeypatch.setattr(artifact_module, "weights_fingerprint", full_hash)
    assert cli(["predict", "--run", str(source), "--embeddings", artifact, "--input", str(text)]) == 0
