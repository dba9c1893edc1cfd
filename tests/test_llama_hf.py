"""Hugging Face decoders in and out (mmadapt/models/llama/hf.py, mmadapt/hf.py): imported Llama,
Qwen2 and Mistral checkpoints give transformers' logits, their tokenizers' special roles get
mmadapt's ids without a row added or lost, exported decoders give mmadapt's ids and logits in
transformers (...ForCausalLM and ...ForSequenceClassification), what the family cannot compute
exactly is refused in one line, and (slow) tensor parallel 2 and the whole path import ->
MINIPOST -> Step 2 (German) -> export -> generate() with transformers' loss = the plug-in loss.

The models are tiny ones made here (tests/hf_models.py; nothing is downloaded): Llama-2 and
Mistral with a SentencePiece BPE with byte fallback, Llama-3 and Qwen2 with a byte-level BPE, all
on the English Bible; the Qwen2 one is trained for 200 updates so that its logits are not
near-uniform. Logits are compared at the positions that are not padding (transformers masks
padding; mmadapt's causal attention never lets a real token see it)."""

import dataclasses
import functools
import json
import math
import shutil

import pytest
import torch

from conftest import REPO
from hf_models import (bible_lines, make_llama2, make_llama3, make_mistral, make_qwen2, make_sp_tokenizer,
                       perturb_norms_and_biases)
from mmadapt import adapt as A
from mmadapt.artifact import artifact_state, read_artifact, write_artifact
from mmadapt.tokenizer import pieces as tokenizer_pieces
from mmadapt.cli import main
from mmadapt.config import ModelConfig, PreprocessConfig, TrainConfig
from mmadapt.family import WORD
from mmadapt.features import encode_classify
from mmadapt.hf import export_hf, import_hf, write_hf
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama import hf as llama_hf
from mmadapt.models.llama.model import OUTPUT, LlamaForTask, LlamaLM
from mmadapt.readers import PairExample
from mmadapt.run import load_weights
from mmadapt.tokenizer import HFTokenizer
from mmadapt.tokenizer import load as load_sp
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID
from mmadapt.objectives import CAUSAL

TOL = 1e-5
MAKERS = {"llama2": make_llama2, "mistral": make_mistral, "llama3": make_llama3,
          "qwen2": functools.partial(make_qwen2, train_steps=200)}
ARCH = {"llama2": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "llama3": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM"}
SEQ = {"llama2": 64, "mistral": 32, "llama3": 64, "qwen2": 64}  # Mistral's: its sliding window
TEXTS = bible_lines("en", range(40, 41))[:6] + bible_lines("de", range(40, 41))[:6]  # German: unseen pieces


@pytest.fixture(scope="session")
def dec_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_decoders")
    return {name: make(root / name) for name, make in MAKERS.items()}


@pytest.fixture(scope="session")
def dec_runs(dec_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("imported_decoders")
    for name, d in dec_dirs.items():
        import_hf(d, root / name)
    return {name: root / name for name in dec_dirs}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_subword_mean_splits_a_piece_as_it_stands_in_a_text(name, dec_runs):
    """As test_hf's, for the decoders: Llama-2's and Mistral's SentencePiece BPE puts a '▁'
    before every text (a Prepend normaliser or Metaspace), which the split must not."""
    from mmadapt.adapt import source_split

    path = dec_runs[name] / "tokenizer" / "spm.model"
    split, tok = source_split(path), load_sp(path)
    for piece in ("nd", "ing", "eth", "▁und", "▁the", "▁God", "▁nicht"):
        surfaces = [tok.id_to_piece(i) for i in split(piece)]
        assert "".join(surfaces) == piece and sum(s.startswith("▁") for s in surfaces) == piece.startswith("▁"), (
            name, piece, surfaces)


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def hf_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [b, s] and the mask of real tokens [b, s]."""
    ids = torch.full((len(rows), max(map(len, rows))), pad)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        real[i, :len(r)] = True
    return ids, real


def lm_logits(cfg: ModelConfig, state: dict, ids: torch.Tensor) -> torch.Tensor:
    """LlamaLM's primary-head logits at every position, dropout off: [b, s, V]."""
    model = LlamaLM(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model.heads.heads[-1](model.hidden_states(ids)[-1], model.output_weight)


def transformers_logits(model, rows: list[list[int]]) -> torch.Tensor:
    ids, real = padded(rows, 0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=real.long()).logits


# --- import ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MAKERS))
def test_imported_decoder_gives_transformers_logits(name, dec_dirs, dec_runs):
    tok, hf = hf_tokenizer(dec_dirs[name]), hf_lm(dec_dirs[name])
    sp = load_sp(dec_runs[name] / "tokenizer" / "spm.model")
    rows = [tok(t, truncation=True, max_length=SEQ[name]).input_ids for t in TEXTS]  # the source's template
    assert max(map(len, rows)) == SEQ[name]  # up to the positions the import keeps (Mistral: its window)
    # mmadapt's encoding is the source's, its ids a permutation of the source's.
    for t in TEXTS:
        assert sp.encode(t) == sp.to_mmadapt[tok(t, add_special_tokens=False).input_ids].tolist()
    ids, real = padded([sp.to_mmadapt[r].tolist() for r in rows], PAD_ID)
    ref = transformers_logits(hf, rows)[..., torch.tensor(sp.hf_ids)]  # columns in mmadapt's order
    diff = (lm_logits(*load_weights(dec_runs[name]), ids)[real] - ref[real]).abs().max().item()
    print(f"{name}: max abs logit difference {diff:.2e} (logits' max {ref[real].abs().max():.1f})")
    assert diff <= TOL
    run = json.loads((dec_runs[name] / "run.json").read_text())
    assert run["step"] == "pretrain" and run["recipe"] == "bl_base" and run["model"]["family"] == "llama"
    assert run["imported_from"]["architecture"] == ARCH[name]
    assert run["model"]["max_position_embeddings"] == SEQ[name]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_predict_reads_raw_text_as_transformers_does(name, dec_dirs, dec_runs):
    """mmadapt predict on raw text lays it out as the source's own tokenizer does (hf.text_layout:
    Llama-2's, Llama-3's and Mistral's <s> before it, nothing for Qwen2): its next-piece logits at
    every position are transformers' tokenizer + model's on the same text, within 1e-4."""
    from mmadapt import predict

    tok, hf = hf_tokenizer(dec_dirs[name]), hf_lm(dec_dirs[name])
    texts = ["In the beginning God created the heaven and the earth.", "Am Anfang schuf Gott Himmel und Erde."]
    lm = predict.load(dec_runs[name])
    mine = lm.logits(texts)[lm.heads[-1]]  # [n, s, V]
    layout = json.loads((dec_runs[name] / "run.json").read_text())["imported_from"]["text_layout"]
    assert layout["prefix"] == ([] if name == "qwen2" else [BOS_ID])
    for i, text in enumerate(texts):
        ids = tok(text).input_ids
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0][:, torch.tensor(lm.tokenizer.hf_ids)]
        diff = (mine[i, :len(ids)] - ref).abs().max().item()
        print(f"{name}: predict against transformers on raw text, max abs logit difference {diff:.2e}")
        assert diff <= 1e-4
    if name == "qwen2":  # nothing before a text: an empty one has no position to predict from
        with pytest.raises(ValueError, match="text 2 .* has no piece in the tokenizer of"):
            lm.next_piece([texts[0], ""])  # it raised IndexError (alone) or answered from padding (in a batch)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_plugin_metric_reads_held_out_text_as_transformers_does(name, dec_dirs, dec_runs, corpus, tmp_path):
    """An imported decoder's plug-in metric scores held-out sentences laid out as its own tokenizer
    lays out a line (data.SentenceRows: Llama-2's, Llama-3's and Mistral's <s> first, nothing for
    Qwen2), where mmadapt's packed stream puts </s> between sentences: every input row is
    transformers' tokenizer's ids for a line of the text, and the metric's loss is transformers'
    next-token loss on those rows within 1e-4 (relative)."""
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import prepare
    from mmadapt.heldout import Primary, Scorer, Text

    run, tok = dec_runs[name], hf_tokenizer(dec_dirs[name])
    sp = load_sp(run / "tokenizer" / "spm.model")
    data = tmp_path / "en"
    prepare(corpus, data, None, tokenizer=run / "tokenizer" / "spm.model", quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    scorer = Scorer(Primary.read(run))
    held = scorer.heldout(Text(data, SEQ[name], blocks=64, batch_size=16), sp.get_piece_size())
    lines = {tuple(sp.to_mmadapt[tok(l).input_ids].tolist()[:SEQ[name]])
             for l in corpus.read_text().splitlines() if l.strip()}
    rows = [tuple(r[r.ne(PAD_ID)].tolist()) for ids, _ in held.batches for r in ids]
    assert len(rows) == 64 and all(r in lines for r in rows)
    assert all(r[0] == BOS_ID for r in rows) == (name != "qwen2")
    hf = hf_lm(dec_dirs[name])
    to_hf = torch.tensor(sp.hf_ids)
    total, count = 0.0, 0
    for ids, labels in held.batches:
        scored = labels.ge(0)
        real = ids.ne(PAD_ID)
        with torch.no_grad():
            logits = hf(input_ids=to_hf[ids], attention_mask=real.long()).logits.float()[..., to_hf]
        total += torch.nn.functional.cross_entropy(logits[scored], labels[scored], reduction="sum").item()
        count += int(scored.sum())
    loss = scorer.loss(held)
    print(f"{name}: plug-in loss {loss:.6f}, transformers' on the same rows {total / count:.6f}")
    assert count == held.scored and abs(loss - total / count) <= 1e-4 * loss


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_imported_decoders_training_stream_is_its_tokenizers_reading_of_each_document(name, dec_dirs, dec_runs,
                                                                                          tmp_path):
    """data.LayoutBatches on text prepared with an imported decoder's tokenizer: each document (its
    sentences one a line) is transformers' tokenizer's ids for the document's text, lines joined
    by a newline for a byte-level BPE (Qwen2, Llama-3: line_join, its newline piece) and by a
    space for SentencePiece (Llama-2, Mistral: each line's own first piece starts with one),
    then the end-of-text (Qwen2's; Llama's and Mistral's </s>, as their pretraining packed them). (A byte-level BPE's sentences were glued: `earth.And`.) These test
    tokenizers never saw a newline, so none merges `.` with it as real vocabularies do (`.Ċ`:
    test_data's line_join test)."""
    from mmadapt.data import LayoutBatches, prepare
    from mmadapt.run import read_run, run_text_layout

    run, tok = dec_runs[name], hf_tokenizer(dec_dirs[name])
    sp = load_sp(run / "tokenizer" / "spm.model")
    docs = [["In the beginning God created the heaven and the earth.", "And the earth was without form, and void;",
             "and darkness was upon the face of the deep."], ["And God said, Let there be light: and there was light."]]
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    prepare(corpus, tmp_path / "d", None, tokenizer=run / "tokenizer" / "spm.model", quiet=True,
            cfg=PreprocessConfig(workers=1))
    layout = run_text_layout(read_run(run))
    stream = LayoutBatches(tmp_path / "d", TrainConfig(seq_length=8, train_micro_batch_size_per_gpu=1),
                           sp.get_piece_size(), layout=layout).tokens.tolist()
    sep = "\n" if name in ("qwen2", "llama3") else " "
    end = [] if layout.get("suffix", [])[-1:] == [EOS_ID] else [EOS_ID]  # every document closed by </s>
    assert stream == [i for d in docs for i in [*sp.to_mmadapt[tok(sep.join(d)).input_ids].tolist(), *end]]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bits_per_byte_of_raw_text_are_transformers_next_token_loss(name, dec_dirs, dec_runs, corpus, tmp_path):
    """bpb.ByteScorer through an imported decoder, with its own tokenizer (no adaptation): each
    held-out line (each window of a line longer than the model) as transformers' tokenizer lays out
    a text (Qwen2, which puts nothing before a text, after its end-of-text token, as lm-eval does),
    every piece of the text scored: the sum of transformers' next-token losses / the lines' UTF-8
    bytes / ln 2, within 1e-4."""
    from mmadapt.bpb import ByteScorer, windows, word_index
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import prepare
    from mmadapt.heldout import Primary, Scorer

    run, tok = dec_runs[name], hf_tokenizer(dec_dirs[name])
    data = tmp_path / "en"
    prepare(corpus, data, None, tokenizer=run / "tokenizer" / "spm.model", quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    per_byte = ByteScorer(Scorer(Primary.read(run)), SEQ[name], max_bytes=1500)
    text = per_byte.text(data)
    got = per_byte.none(text)
    hf = hf_lm(dec_dirs[name])
    nats, windowed = 0.0, 0
    for line in text.lines:
        bare = tok(line, add_special_tokens=False, return_offsets_mapping=True)
        prefix = tok(line).input_ids[:len(tok(line).input_ids) - len(bare.input_ids)] or [tok.eos_token_id]
        spans = [(b + len(line[b:e]) - len(line[b:e].lstrip()), e) for b, e in bare.offset_mapping]
        cuts = windows(word_index(line, spans), SEQ[name] - len(prefix))  # a line longer than the model: its windows
        windowed += len(cuts) > 1
        for a, b in cuts:
            ids = prefix + bare.input_ids[a:b]
            with torch.no_grad():
                logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits.float()[0], -1)
            n = b - a
            nats -= float(logp[torch.arange(len(ids) - n - 1, len(ids) - 1), torch.tensor(ids[-n:])].sum())
    expected = nats / text.bytes / math.log(2)
    print(f"{name}: {got:.6f} bits per byte, transformers' {expected:.6f} ({text.bytes} bytes, {windowed} of "
          f"{len(text.lines)} lines in windows)")
    assert abs(got - expected) <= 1e-4 * expected


def test_trained_decoder_is_not_near_uniform(dec_dirs):
    """The briefly trained Qwen2's next-token loss on a book it never saw, against log V (uniform)."""
    tok, hf = hf_tokenizer(dec_dirs["qwen2"]), hf_lm(dec_dirs["qwen2"])
    rows = [tok(t, truncation=True, max_length=64).input_ids for t in bible_lines("en", range(3, 4))[:64]]
    ids, real = padded(rows, 0)
    labels = ids.masked_fill(~real, -100)
    with torch.no_grad():
        loss = hf(input_ids=ids, attention_mask=real.long(), labels=labels).loss.item()
    print(f"trained qwen2: held-out loss {loss:.2f} nats, uniform {math.log(hf.config.vocab_size):.2f}")
    assert loss < 0.8 * math.log(hf.config.vocab_size)


# What each tokenizer lacks, and where the import found a row for it (models/llama/hf.py special_ids).
ROLES = {
    # SentencePiece BPE, 600 pieces = 600 rows: pad and mask take the byte pieces of non-UTF-8 bytes
    "llama2": {"pad": ("<0xC0>", True), "unk": ("<unk>", False), "bos": ("<s>", False), "eos": ("</s>", False),
               "mask": ("<0xC1>", True)},
    # byte-level BPE, 602 tokens = 602 rows: the unused special token, then the bytes 0xC0, 0xC1 alone
    "llama3": {"pad": ("<|reserved_special_token_0|>", True), "unk": ("À", True), "bos": ("<|begin_of_text|>", False),
               "eos": ("<|end_of_text|>", False), "mask": ("Á", True)},
    # 603 tokens, 608 rows: the rows past the tokenizer (its pad is its eos, it has no bos, no unk)
    "qwen2": {"pad": (None, True), "unk": (None, True), "bos": (None, True), "eos": ("<|endoftext|>", False),
              "mask": (None, True)},
}


@pytest.mark.parametrize("name", sorted(ROLES))
def test_special_roles_borrow_rows_no_text_produces(name, dec_dirs, dec_runs):
    tok = hf_tokenizer(dec_dirs[name])
    record = json.loads((dec_runs[name] / "run.json").read_text())["imported_from"]["special_ids"]
    assert {r: (v["token"], v["borrowed"]) for r, v in record.items()} == ROLES[name]
    vocab = tok.get_vocab()
    for role, v in record.items():
        assert v["id"] == (vocab[v["token"]] if v["token"] is not None else v["id"])
    if name == "qwen2":  # the first four rows past the tokenizer, in mmadapt's role order
        assert [record[r]["id"] for r in ("pad", "unk", "bos", "mask")] == [603, 604, 605, 606]
    sp = load_sp(dec_runs[name] / "tokenizer" / "spm.model")
    assert sorted(sp.hf_ids.tolist()) == list(range(len(sp.hf_ids)))  # a permutation: no row added or lost
    assert sp.hf_ids[:5].tolist() == [record[r]["id"] for r in ("pad", "unk", "bos", "eos", "mask")]
    assert [sp.id_to_piece(i) for i in range(5)] == ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]
    # No text produces a role's row: four books of English and German, every id is an ordinary piece.
    verses = bible_lines("en", range(1, 5)) + bible_lines("de", range(1, 5))
    assert not {i for ids in sp.encode(verses) for i in ids} & {PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID}
    # Nor does a special token's string in a text: it is text (Qwen2's "<|endoftext|>" gave EOS_ID
    # mid-document), as transformers reads it with split_special_tokens.
    specials = [a["content"] for a in sp.doc["tokenizer"]["added_tokens"] if a["special"]]
    texts = [f"In the beginning {t} God" for t in specials]
    assert texts and sp.encode(texts) == [
        sp.to_mmadapt[tok(t, add_special_tokens=False, split_special_tokens=True).input_ids].tolist() for t in texts]
    assert not {i for ids in sp.encode(texts) for i in ids} & {PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID}


def test_config_formats_and_sliding_windows(dec_dirs):
    """transformers 5's rope_parameters and the older rope_theta / rope_scaling give one config;
    a sliding window caps the positions only where a layer uses it."""
    base = json.loads((dec_dirs["llama2"] / "config.json").read_text())
    del base["rope_parameters"]
    old = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    new = {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}}
    assert llama_hf.MAPPING.model_config(old) == llama_hf.MAPPING.model_config(new)
    cfg = llama_hf.MAPPING.model_config(new)
    assert (cfg.rotary_base, cfg.seq_len_interpolation_factor, cfg.share_embeddings_and_output_weights) == \
        (5e5, 4.0, False)
    assert llama_hf.MAPPING.model_config({**base, "rope_theta": 5e5}).seq_len_interpolation_factor is None
    mistral = {**base, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "max_position_embeddings": 8192}
    assert llama_hf.MAPPING.model_config(mistral).max_position_embeddings == 4096  # transformers' default window
    assert llama_hf.MAPPING.model_config({**mistral, "sliding_window": None}).max_position_embeddings == 8192
    qwen = {**base, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
            "use_sliding_window": True}
    assert llama_hf.MAPPING.model_config({**qwen, "max_window_layers": 3}).max_position_embeddings == 64  # no layer slides
    assert llama_hf.MAPPING.model_config({**qwen, "max_window_layers": 1}).max_position_embeddings == 16
    assert llama_hf.MAPPING.model_config({**qwen, "use_sliding_window": False}).max_position_embeddings == 64
    with pytest.raises(ValueError, match="seq_len_interpolation_factor must be > 0"):
        dataclasses.replace(cfg, seq_len_interpolation_factor=0.0).validate()


def test_rope_scaling_is_positions_divided_by_the_factor():
    """Linear scaling: position p turns as p / factor does (without it, the tables that
    test_llama_model.py checks against the definition and against transformers)."""
    from mmadapt.models.llama.model import rotary_table

    x = torch.zeros(1)
    cos, sin = rotary_table(12, 8, 1e4, x, interpolation=4.0)
    inv = 1.0 / 1e4 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = (torch.arange(12, dtype=torch.float64)[:, None] / 4.0) * inv
    torch.testing.assert_close(cos, torch.cat([angles, angles], 1).cos().float(), rtol=0, atol=1e-6)
    # rotary_table's sin has its first half negated (what `rotate` multiplies)
    torch.testing.assert_close(sin, torch.cat([-angles, angles], 1).sin().float(), rtol=0, atol=1e-6)
    assert not torch.allclose(rotary_table(12, 8, 1e4, x)[0], cos)


def test_byte_pieces_and_word_boundaries_match_by_surface(dec_runs, de_tokenizer):
    """Step 2's overlap on both kinds: SentencePiece '▁' and byte-level 'Ġ' are one marker, byte
    pieces are decoded (a byte that is not a whole character is <0xNN> in both), and a German
    piece shared with the source starts from the source's row."""
    trg = tokenizer_pieces(de_tokenizer)
    kinds = {"llama2": "▁in", "qwen2": "▁in"}
    for name, word in kinds.items():
        src = tokenizer_pieces(dec_runs[name] / "tokenizer" / "spm.model")
        assert src[:5] == ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]
        assert "<0xC3>" in src and word in src  # Ã's lead byte alone; 'Ġin' read as '▁in' in qwen2
        w = torch.randn(len(src), 8)
        new, shared = A.overlap_init(src, {WORD: w, OUTPUT: -w}, trg, 0.02, 0)
        both = set(src) & set(trg)
        assert shared == len([p for p in trg if p in both]) > 20, name
        i, j = trg.index(word), src.index(word)
        assert torch.equal(new[WORD][i], w[j]) and torch.equal(new[OUTPUT][i], -w[j])
        assert torch.equal(new[WORD][EOS_ID], w[EOS_ID])  # </s>: the source's eos row, by its role name
    sp = HFTokenizer.read(dec_runs["llama2"] / "tokenizer" / "spm.model")
    surface = tokenizer_pieces(dec_runs["llama2"] / "tokenizer" / "spm.model")
    for b in range(0x20, 0x7F):  # an ASCII byte piece is its character unless the character is a piece
        m = int(sp.to_mmadapt[sp.tokenizer.token_to_id(f"<0x{b:02X}>")])
        char = chr(b).replace(" ", "▁")
        assert surface[m] == (f"<0x{b:02X}>" if sp.tokenizer.token_to_id(char) is not None else char), b
    assert len(set(surface)) == len(surface)  # one row per surface form


# --- export -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MAKERS))
def test_round_trip_gives_the_original_ids_and_logits(name, dec_dirs, dec_runs, tmp_path):
    summary = export_hf(tmp_path / "out", primary=dec_runs[name])
    assert summary["architecture"] == ARCH[name]
    tok, orig = hf_tokenizer(tmp_path / "out"), hf_tokenizer(dec_dirs[name])
    rows = [tok(t, truncation=True, max_length=SEQ[name]).input_ids for t in TEXTS]
    assert rows == [orig(t, truncation=True, max_length=SEQ[name]).input_ids for t in TEXTS]
    got = transformers_logits(hf_lm(tmp_path / "out"), rows)
    ref = transformers_logits(hf_lm(dec_dirs[name]), rows)
    real = padded(rows, 0)[1]
    diff = (got[real] - ref[real]).abs().max().item()
    print(f"{name} round trip: max abs logit difference {diff:.2e}")
    assert diff <= TOL


def test_a_decoder_whose_heads_do_not_split_the_hidden_size_imports_and_exports(tmp_path):
    """head_dim 16 with 4 heads over a hidden size of 32 (Gemma's and Qwen3's kind of shape):
    imported as megatron's kv_channels (the import's parity check against transformers passes),
    and exported with its head_dim (it was refused on import, and its export crashed)."""
    from hf_models import _decoder

    src = tmp_path / "src"
    tok = make_sp_tokenizer(src)
    _decoder("llama", len(tok), 11, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             head_dim=16).save_pretrained(str(src))
    run = import_hf(src, tmp_path / "run")
    assert run["model"]["kv_channels"] == 16
    export_hf(tmp_path / "out", primary=tmp_path / "run")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 16
    rows = [hf_tokenizer(src)(t, truncation=True, max_length=64).input_ids for t in TEXTS]
    got, ref = (transformers_logits(hf_lm(d), rows) for d in (tmp_path / "out", src))
    real = padded(rows, 0)[1]
    assert (got[real] - ref[real]).abs().max().item() <= TOL


def test_the_export_stops_generating_where_the_source_does(tmp_path):
    """A model whose config.json lists several stop tokens (Llama-3.1's), with no
    generation_config.json or with the one transformers derives from config.json: transformers
    generates with the list; the export's config.json names the tokenizer's one eos, and the list
    was lost (greedy generation ran past the second stop token)."""
    from transformers import GenerationConfig

    from hf_models import _decoder

    src = tmp_path / "src"
    tok = make_sp_tokenizer(src)
    _decoder("llama", len(tok), 11, bos_token_id=1, eos_token_id=[2, 7], tie_word_embeddings=False
             ).save_pretrained(str(src))
    derived = GenerationConfig.from_pretrained(str(src)).to_dict()
    assert derived["eos_token_id"] == [2, 7] and derived["_from_model_config"]
    for name, keep in (("derived", True), ("none", False)):
        if not keep:
            (src / "generation_config.json").unlink()
        import_hf(src, tmp_path / f"run-{name}")
        export_hf(tmp_path / f"out-{name}", primary=tmp_path / f"run-{name}")
        out = tmp_path / f"out-{name}"
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
        assert GenerationConfig.from_pretrained(str(out)).eos_token_id == [2, 7], name
        assert hf_lm(out).generation_config.eos_token_id == [2, 7], name


def de_artifact(run, de_tokenizer, out):
    """Random German embeddings (and output projection, for an untied model) for the imported `run`:
    export must carry them exactly."""
    cfg = load_weights(run)[0]
    g = torch.Generator().manual_seed(0)
    v = load_sp(de_tokenizer).get_piece_size()
    tensors = {"word_embeddings": torch.randn(v, 32, generator=g) * 0.3}
    if not cfg.share_embeddings_and_output_weights:
        tensors["output_layer"] = torch.randn(v, 32, generator=g) * 0.3
    return write_artifact(out / "step00000001", tensors, de_tokenizer,
                            {"source": str(run), "lang": "de", "step": 1, "system": "bl_base"})


@pytest.mark.parametrize("name, arch, start", [("llama2", "LlamaForCausalLM", BOS_ID),
                                               ("qwen2", "LlamaForCausalLM", EOS_ID)])
def test_export_of_an_adapted_causal_lm(name, arch, start, dec_runs, de_tokenizer, tmp_path):
    """The German LM: its prompt starts as a document starts in the blocks Step 2 trains on over
    the import (data.LayoutBatches): Llama-2's <s> text; </s> text for Qwen2, whose tokenizer puts
    nothing before a text and whose end-of-text closes each document. mmadapt's ids and logits,
    and generate() runs. A Qwen2 body with another tokenizer goes out as Llama with
    attention_bias (AutoTokenizer would rebuild any tokenizer of a qwen2 directory as Qwen2's
    byte-level BPE), its o_proj bias zero."""
    out, artifact = tmp_path / "out", de_artifact(dec_runs[name], de_tokenizer, tmp_path / "art")
    assert main(["export-hf", "--primary", str(dec_runs[name]), "--embeddings", str(artifact),
                 "--output_dir", str(out)]) == 0
    tok, sp = hf_tokenizer(out), load_sp(de_tokenizer)
    verses = bible_lines("de", range(40, 44))  # the Gospels
    assert tok(verses)["input_ids"] == [[start, *ids] for ids in sp.encode(verses)]
    hf = hf_lm(out)
    assert type(hf).__name__ == arch
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (start, EOS_ID, PAD_ID)
    cfg, state = LLAMA.primary_model(*load_weights(dec_runs[name]))
    assert hf.config.tie_word_embeddings == cfg.share_embeddings_and_output_weights
    assert hf.config.attention_bias == cfg.add_qkv_bias
    rows = [[start, *sp.encode(v)][:64] for v in TEXTS[6:]]
    emb, _, _ = read_artifact(artifact)
    state = {**state, **artifact_state(LLAMA, emb)}
    ids, real = padded(rows, PAD_ID)
    mine = lm_logits(dataclasses.replace(cfg, vocab_size=len(emb["word_embeddings"])), state, ids)
    diff = (mine[real] - transformers_logits(hf, rows)[real]).abs().max().item()
    print(f"{name}, adapted causal LM: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    # predict with the artifact reads raw text as the exported tokenizer lays it out (Qwen2's </s>
    # first: it read bare text, up to 0.7 apart in its logits)
    from mmadapt import predict

    lm = predict.load(dec_runs[name], artifact)
    texts = [v[:120] for v in TEXTS[6:]]
    theirs = [tok(t).input_ids for t in texts]
    assert theirs[0][0] == start
    got, ref = lm.logits(texts)[lm.heads[-1]], transformers_logits(hf, theirs)
    for i, row in enumerate(theirs):
        assert (got[i, :len(row)] - ref[i, :len(row)]).abs().max().item() <= TOL
    prompt = tok("Am Anfang", return_tensors="pt")
    new = hf.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, prompt.input_ids.shape[1]:]
    assert len(new) == 5
    # ... and it imports again: the same model, its roles where mmadapt had them (<s> and <mask> are
    # the exported tokenizer's special tokens without a role there)
    import_hf(out, tmp_path / "again")
    again = load_sp(tmp_path / "again" / "tokenizer" / "spm.model")
    assert again.hf_ids.tolist() == list(range(len(again.hf_ids)))
    assert torch.equal(lm_logits(*load_weights(tmp_path / "again"), ids), mine)


def test_step2_over_a_byte_fallback_source_keeps_byte_fallback(dec_runs, de_corpus, tmp_path, capsys):
    """Llama-2's tokenizer reads any text (a character without a piece is its bytes' pieces): so
    does the new vocabulary Step 2 trains on a raw corpus over it (before, a Unigram without byte
    fallback, whose export read emoji, CJK and every rare letter as <unk>). Its byte pieces start
    from the source's rows of the same bytes, and the exported tokenizer encodes and decodes as
    mmadapt's own. A byte-level source (Qwen2) has no byte fallback to keep."""
    from mmadapt.tokenizer import has_byte_fallback

    src = dec_runs["llama2"]
    assert has_byte_fallback(src / "tokenizer" / "spm.model")
    assert not has_byte_fallback(dec_runs["qwen2"] / "tokenizer" / "spm.model")
    ad, out = tmp_path / "adapt", tmp_path / "out"
    assert main(["adapt", "--system", "bl_base", "--source", str(src), "--lang", "de", "--corpus", str(de_corpus),
                 "--vocab_size", "1000", "--output_dir", str(ad), "--train_iters", "1", "--save_interval", "1",
                 "--seq_length", "32", "--train_micro_batch_size_per_gpu", "4",
                 "--ds_config", str(REPO / "ds_configs" / "zero0.json")]) == 0
    sp = load_sp(ad / "data" / "tokenizer.model")
    assert has_byte_fallback(ad / "data" / "tokenizer.model")
    assert json.loads((ad / "data" / "manifest.json").read_text())["unknown"] == 0
    # a byte piece starts from the source's row of that byte (<0xC0>, <0xC1>: the source's pad and mask)
    start, _, _ = read_artifact(ad / "embeddings" / "step00000000")
    source_state = load_weights(src)[1]
    theirs = load_sp(src / "tokenizer" / "spm.model")
    # every byte no vocabulary has a piece of its own for: the control bytes (Llama-2's surface of
    # <0x0A> is '\n': they met by surface only once the target's were written so) and the bytes of
    # longer characters (<0xC0>, <0xC1>: no text's; the source's pad and mask rows)
    for b in [*range(0x20), *range(0x80, 0xC0), *range(0xC2, 0x100)]:
        piece = f"<0x{b:02X}>"
        for key, name in (("word_embeddings", "word_embeddings.word_embeddings.weight"),
                          ("output_layer", "output_layer.weight")):
            assert torch.equal(start[key][sp.piece_to_id(piece)], source_state[name][theirs.piece_to_id(piece)]), \
                (piece, key)
    assert main(["export-hf", "--primary", str(src), "--embeddings", str(ad / "embeddings" / "step00000001"),
                 "--output_dir", str(out)]) == 0
    tok = hf_tokenizer(out)
    # a byte piece's name in text is that text, as SentencePiece reads it (its pieces never match text)
    for text in ("Grüße 😀 你好 Привет", "Ça va? naïve", bible_lines("de", range(40, 41))[0],
                 "a<0x41>b <0x0A><0xE4> <<0xC3><0xA4>>"):
        ids = sp.encode(text)
        assert tok(text).input_ids == [BOS_ID, *ids] and UNK_ID not in ids
        assert tok.decode(ids) == sp.decode(ids) == text
    # a dataset prepared beforehand without it: Step 2 says what its <unk> pieces are and how to keep them
    from mmadapt.data import prepare
    from mmadapt.run import RunSpec

    text = tmp_path / "de.txt"
    text.write_text("".join(f"{v} 😀\n" for v in bible_lines("de", range(40, 41))))
    unknown = prepare(text, tmp_path / "de", 1000, cfg=PreprocessConfig(workers=1), quiet=True)["unknown"]
    capsys.readouterr()
    A.Step2Plan.of(RunSpec(output_dir=tmp_path / "x", data_path=tmp_path / "de"),
                   A.AdaptEmbeddings(system="bl_base", source=src, lang="de", train=TrainConfig()))
    assert unknown > 0 and (f"and {tmp_path / 'de'}'s does not: {unknown:,} of its pieces are <unk>; prepare the "
                            "text with mmadapt preprocess --byte_fallback true") in capsys.readouterr().out
    # a run that prepared its corpus without it (before the setting existed) resumes with what it has
    shutil.copytree(tmp_path / "de", tmp_path / "old" / "data")
    manifest = tmp_path / "old" / "data" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "byte_fallback"}))
    for out, kept in ((tmp_path / "old", False), (ad, True)):
        plan = A.Step2Plan.of(RunSpec(output_dir=out, corpus=de_corpus, resume=True),
                              A.AdaptEmbeddings(system="bl_base", source=src, lang="de", train=TrainConfig()))
        assert plan.run.prep.byte_fallback is kept


def task_model(cfg: ModelConfig, state: dict, num_labels: int = 3) -> tuple[LlamaForTask, dict]:
    """The primary model's body and final norm with a random score head, as Step 3 starts it."""
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    model = LlamaForTask(cfg, "classify", num_labels, seed=7).eval()
    full = {**model.state_dict(), **LLAMA.task_state(cfg, state)}
    model.load_state_dict(full)
    return model, full


@pytest.mark.parametrize("name, german", [("qwen2", False), ("llama2", False), ("llama3", False), ("qwen2", True)])
def test_export_of_a_decoder_classifier(name, german, dec_runs, de_tokenizer, tmp_path):
    """...ForSequenceClassification whose tokenizer gives mmadapt's task rows (a </s>, started as
    the source's tokenizer starts a text: Qwen2 with nothing, Llama-2 with <s>; padded with
    mmadapt's pad) and whose config pads with that id: the source's tokenizer with roles that
    rows past it (qwen2) or byte pieces (llama2) hold, or the German SentencePiece swapped in (a
    Qwen2 body then goes out as Llama with attention_bias)."""
    from mmadapt.run import run_text_layout

    from transformers import AutoModelForSequenceClassification, pipeline

    cfg, state = LLAMA.primary_model(*load_weights(dec_runs[name]))
    tokenizer = dec_runs[name] / "tokenizer" / "spm.model"
    if german:
        g = torch.Generator().manual_seed(1)
        tokenizer, v = de_tokenizer, load_sp(de_tokenizer).get_piece_size()
        state, cfg = {**state, WORD: torch.randn(v, 32, generator=g) * 0.3}, dataclasses.replace(cfg, vocab_size=v)
    model, full = task_model(cfg, state)
    labels = ["a", "b", "c"]
    record = json.loads((dec_runs[name] / "run.json").read_text())
    model_type = record["imported_from"]["model_type"]
    framing = LLAMA.task_framing(run_text_layout(record).get("prefix"))  # as Step 3 lays its rows out
    assert framing.start == {"qwen2": (), "llama2": (BOS_ID,), "llama3": (BOS_ID,)}[name]
    summary = write_hf(LLAMA, tmp_path / "out", cfg, full, "classify", labels, tokenizer, model_type,
                       task_start=framing.start)
    arch = "LlamaForCausalLM" if german else ARCH[name]  # a Qwen2 body with another tokenizer: Llama
    assert summary["architecture"] == arch.replace("CausalLM", "SequenceClassification")
    sp = load_sp(tokenizer)
    to_hf = torch.tensor(sp.hf_ids) if not german else torch.arange(cfg.vocab_size)
    texts = TEXTS[6:] if german else TEXTS
    enc = encode_classify(sp, [(t, 0) for t in texts], 64, framing)  # Step 3's rows at the model's 64 positions
    tok = hf_tokenizer(tmp_path / "out")
    batch = tok(texts, padding=True, truncation=True, return_tensors="pt")  # truncated to model_max_length 64
    assert torch.equal(batch.input_ids, to_hf[enc.input_ids[:, :batch.input_ids.shape[1]]])
    pair = tok("Am Anfang", "schuf Gott").input_ids
    assert pair == to_hf[[*framing.start, *sp.encode("Am Anfang"), EOS_ID, EOS_ID, *sp.encode("schuf Gott"),
                          EOS_ID]].tolist()
    enc_pair = encode_classify(sp, [PairExample("Am Anfang", "schuf Gott", 0)], 48, framing)
    assert pair == to_hf[enc_pair.input_ids[0, :len(pair)]].tolist()
    # a character whose byte token the import lent a role (llama3's unk: "À") is text, as Step 3 read it
    assert tok("À Dieu", add_special_tokens=False).input_ids == to_hf[sp.encode("À Dieu")].tolist()
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    assert hf.config.pad_token_id == int(to_hf[PAD_ID]) and hf.config.id2label == dict(enumerate(labels))
    with torch.no_grad():
        mine = model(enc.input_ids)[1]
        theirs = hf(**batch).logits
    diff = (mine - theirs).abs().max().item()
    print(f"{name}{' + German' if german else ''} classifier: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    got = pipeline("text-classification", model=str(tmp_path / "out"), tokenizer=str(tmp_path / "out"))(
        texts, truncation=True)
    assert [r["label"] for r in got] == [labels[i] for i in mine.argmax(-1).tolist()]


# --- what cannot be exact: one line, exit 2, nothing written ----------------------------------------------

REFUSED = {
    "dynamic_rope": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    "yarn_rope": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                       "original_max_position_embeddings": 32}}, "rope scaling type 'yarn'"),
    "llama3_rope": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}}, "rope scaling type 'llama3'"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias is true"),
    # a head size of its own is imported (below); config.json's alone, over weights of another, is refused
    "head_dim": ({"head_dim": 16}, "config.json implies (64, 32) (dimension 1: num_attention_heads 4 x head dim 16)"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    "gemma": ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
}


def _check_refused(argv, out, want, capsys):
    capsys.readouterr()  # what the test itself wrote (transformers' progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and want in err, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return err


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_what_cannot_be_exact_is_refused(what, dec_dirs, tmp_path, capsys):
    change, want = REFUSED[what]
    model = tmp_path / "model"
    shutil.copytree(dec_dirs["llama2"], model)
    cfg = json.loads((model / "config.json").read_text())
    if "rope_scaling" in change:  # the older format
        del cfg["rope_parameters"]
    (model / "config.json").write_text(json.dumps({**cfg, **change}))
    err = _check_refused(["import-hf", "--model", str(model), "--output_dir", str(tmp_path / "run")],
                         tmp_path / "run", want, capsys)
    if what == "gemma":
        assert "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM" in err


def test_swish_is_silu(dec_dirs, tmp_path):
    """hidden_act 'swish' is transformers' other name of SiLU (ACT2FN gives the same nn.SiLU): it
    was refused as an activation other than SiLU; it imports, and the import's parity check
    against transformers holds."""
    model = tmp_path / "model"
    shutil.copytree(dec_dirs["llama2"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_act": "swish"}))
    assert main(["import-hf", "--model", str(model), "--output_dir", str(tmp_path / "run")]) == 0


def test_llama_attention_bias_is_refused_unless_o_proj_has_none(dec_dirs, tmp_path, capsys):
    """Llama's attention_bias puts a bias on o_proj too: refused when it is not zero (a Qwen2 body
    that mmadapt exported has a zero one, and imports: test_export_of_an_adapted_causal_lm)."""
    import transformers as T

    model = tmp_path / "model"
    shutil.copytree(dec_dirs["llama2"], model)
    hf = T.LlamaForCausalLM.from_pretrained(str(model))
    biased = T.LlamaForCausalLM(T.LlamaConfig(**{**hf.config.to_dict(), "attention_bias": True}))
    biased.load_state_dict(hf.state_dict(), strict=False)
    perturb_norms_and_biases(biased)
    biased.save_pretrained(str(model))
    _check_refused(["import-hf", "--model", str(model), "--output_dir", str(tmp_path / "run")], tmp_path / "run",
                   "model.layers.0.self_attn.o_proj.bias is not zero (Llama's attention_bias)", capsys)


def test_a_tokenizer_without_spare_rows_is_refused(tmp_path, capsys):
    """SentencePiece BPE without byte fallback, as many rows as tokens: no row for pad and mask."""
    import transformers as T

    model = tmp_path / "model"
    tok = make_sp_tokenizer(model, vocab_size=300, byte_fallback=False)
    assert len(tok) == 300
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)).save_pretrained(str(model))
    _check_refused(["import-hf", "--model", str(model), "--output_dir", str(tmp_path / "run")], tmp_path / "run",
                   "its tokenizer has no token of its own for pad, mask and only 0 rows that no text can produce", capsys)


def test_sliding_window_caps_the_sequence_length(dec_dirs, tmp_path, capsys, corpus):
    """The import says so; a longer --seq_length is refused; and past the window transformers'
    Mistral computes something else (why the cap is needed)."""
    run = tmp_path / "run"
    assert main(["import-hf", "--model", str(dec_dirs["mistral"]), "--output_dir", str(run)]) == 0
    assert "capped at its sliding window of 32 tokens" in capsys.readouterr().out
    out = tmp_path / "minipost"
    _check_refused(["build_minipost", "--primary", str(run), "--corpus", str(corpus), "--seq_length", "48",
                    "--mini_layers", "2", "--new_layers", "1", "--output_dir", str(out),
                    "--ds_config", str(REPO / "ds_configs" / "zero0.json")], out,
                   "seq_length 48 exceeds max_position_embeddings 32", capsys)
    tok, sp = hf_tokenizer(dec_dirs["mistral"]), load_sp(run / "tokenizer" / "spm.model")
    row = tok(" ".join(TEXTS[6:]), truncation=True, max_length=48).input_ids
    assert len(row) == 48
    ref = transformers_logits(hf_lm(dec_dirs["mistral"]), [row])[0][:, torch.tensor(sp.hf_ids)]
    mine = lm_logits(dataclasses.replace(load_weights(run)[0], max_position_embeddings=48), load_weights(run)[1],
                     torch.tensor([sp.to_mmadapt[row].tolist()]))[0]
    assert (mine[:32] - ref[:32]).abs().max() <= TOL < (mine[32:] - ref[32:]).abs().max()


# --- slow: tensor parallel 2, and the whole path ---------------------------------------------------------

@pytest.mark.slow
def test_imported_decoders_under_tensor_parallel_2(dec_dirs, dec_runs, tmp_path):
    """Every imported decoder on 2 gloo ranks (vocab-parallel embedding and output projection, one
    key/value group per rank; tests/hf_tp_worker.py, one launch for all) against transformers."""
    from conftest import run_pretrain

    args, refs = [], {}
    for name in sorted(MAKERS):
        tok, sp = hf_tokenizer(dec_dirs[name]), load_sp(dec_runs[name] / "tokenizer" / "spm.model")
        rows = [tok(t, truncation=True, max_length=SEQ[name]).input_ids for t in TEXTS]
        ids, real = padded([sp.to_mmadapt[r].tolist() for r in rows], PAD_ID)
        torch.save(ids, tmp_path / f"{name}.pt")
        args += [str(dec_runs[name]), str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}.logits.pt")]
        refs[name] = transformers_logits(hf_lm(dec_dirs[name]), rows)[..., torch.tensor(sp.hf_ids)], real
    run_pretrain(2, *args, script=str(REPO / "tests" / "hf_tp_worker.py"))
    for name, (ref, real) in refs.items():
        diff = (torch.load(tmp_path / f"{name}.logits.pt")[real] - ref[real]).abs().max().item()
        print(f"{name} at tensor parallel 2: max abs logit difference {diff:.2e}")
        assert diff <= TOL, name


def heldout_loss_in_transformers(model, data, vocab_size: int, prefix: list[int] | None = None) -> float:
    """transformers' own next-token loss over exactly the rows the plug-in metric scores
    (heldout.heldout_batches with the imported run's `prefix`, its defaults): each row's scored
    positions, padding masked out of attention."""
    from mmadapt.heldout import Text, heldout_batches

    total, count = 0.0, 0
    for ids, labels in heldout_batches(Text(data, 64, 256, 32, 0), vocab_size, CAUSAL, prefix):
        scored = labels.ge(0)
        real = torch.arange(ids.shape[1])[None, :] < ids.ne(PAD_ID).sum(1, keepdim=True)  # right-padded rows
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=real.long()).logits.float()
        total += torch.nn.functional.cross_entropy(logits[scored], labels[scored], reduction="sum").item()
        count += int(scored.sum())
    return total / count


@pytest.mark.slow
def test_import_minipost_german_export_generate(dec_dirs, corpus, de_corpus, tmp_path, capsys):
    """import-hf (the briefly trained Qwen2) -> MINIPOST Step 1b on English in its own tokenizer ->
    Step 2 over the mini-model with a German SentencePiece from `mmadapt preprocess` -> export-hf
    of the primary model with the German embeddings: transformers loads it, generate() writes
    German pieces, its tokenizer gives mmadapt's ids on the whole German Bible, and its loss on
    the held-out German blocks is the plug-in loss. Then Step 3 on the imported model and the
    zero-shot German classifier exported: transformers predicts what Step 4 scored."""
    from transformers import AutoModelForCausalLM, pipeline

    from evaluation import predict, swap_embeddings
    from mmadapt.evaluate import load_finetuned
    from mmadapt.config import FinetuneConfig
    from mmadapt.parallel import init_parallel
    from mmadapt.tasks import encode, get_task, read_examples

    init_parallel(1, 1)
    run, mp, de, ad, out, ft, clf = (tmp_path / d for d in ("run", "minipost", "de", "adapt", "lm", "ft", "clf"))
    zero0 = str(REPO / "ds_configs" / "zero0.json")
    sched = ["--seq_length", "64", "--train_micro_batch_size_per_gpu", "8", "--ds_config", zero0]
    assert main(["import-hf", "--model", str(dec_dirs["qwen2"]), "--output_dir", str(run)]) == 0
    assert main(["build_minipost", "--primary", str(run), "--corpus", str(corpus), "--output_dir", str(mp),
                 "--mini_layers", "2", "--new_layers", "1", "--train_iters", "20", "--save_interval", "20",
                 *sched]) == 0
    assert main(["preprocess", "--corpus", str(de_corpus), "--output_dir", str(de), "--vocab_size", "1000",
                 "--valid_fraction", "0.1", "--workers", "1"]) == 0
    assert main(["adapt", "--system", "minipost", "--source", str(mp), "--lang", "de", "--data_path", str(de),
                 "--output_dir", str(ad), "--train_iters", "40", "--save_interval", "40", "--lr", "5e-3",
                 *sched]) == 0
    artifact = ad / "embeddings" / "step00000040"
    assert json.loads((artifact / "meta.json").read_text())["shared_pieces"] > 20
    assert main(["export-hf", "--primary", str(run), "--embeddings", str(artifact), "--output_dir", str(out)]) == 0
    assert main(["evaluate", "--primary", str(run), "--embeddings", str(artifact), "--plugin_data", str(de),
                 "--seq_length", "64", "--output", str(tmp_path / "plugin.json")]) == 0
    record = json.loads((tmp_path / "plugin.json").read_text())[0]
    capsys.readouterr()

    tok = hf_tokenizer(out)
    sp = load_sp(de / "tokenizer.model")
    verses = bible_lines("de", range(1, 67))
    assert len(verses) > 30_000 and tok(verses)["input_ids"] == [[EOS_ID, *ids] for ids in sp.encode(verses)]
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.attention_bias  # Qwen2's body
    assert model.config.vocab_size == sp.get_piece_size()
    # the rows the plug-in metric scores: Qwen2 (nothing before a text) in a new vocabulary reads
    # </s> first (run.text_prefix), as its Step 2 and the exported tokenizer above do
    from mmadapt.run import RUN_TOKENIZER, read_run, text_prefix

    prefix = text_prefix(read_run(run), run / RUN_TOKENIZER, de / "tokenizer.model")
    assert json.loads((run / "run.json").read_text())["imported_from"]["text_layout"]["prefix"] == []
    assert prefix == [EOS_ID]
    loss = heldout_loss_in_transformers(model, de, sp.get_piece_size(), prefix)
    print(f"full path: transformers' held-out loss {loss:.6f}, mmadapt's plug-in loss {record['loss']:.6f} "
          f"(relative difference {abs(loss - record['loss']) / record['loss']:.1e}; unigram "
          f"{record['unigram_loss']:.3f})")
    assert abs(loss - record["loss"]) <= 1e-4 * record["loss"]
    prompt = tok("Und Gott sprach", return_tensors="pt")
    new = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, prompt.input_ids.shape[1]:]
    print("generated:", repr(tok.decode(new)))
    assert len(new) == 8

    # Step 3 on the imported model (English bible-genre), the German classifier exported
    assert main(["finetune", "--task", "bible-genre", "--primary", str(run), "--output_dir", str(ft),
                 "--seq_length", "64", "--epochs", "0.2", "--lr", "1e-3", "--ds_config", zero0]) == 0
    assert main(["export-hf", "--finetuned", str(ft), "--embeddings", str(artifact), "--output_dir", str(clf)]) == 0
    examples = read_examples(get_task("bible-genre"), "bible", "de", "test")[::10]
    finetuned = load_finetuned(ft)
    emb, _, _ = read_artifact(artifact)
    model = dataclasses.replace(finetuned, state=swap_embeddings(finetuned.state, emb)).model()
    assert finetuned.framing.start == ()  # Qwen2 starts a text with nothing: so do its task rows
    enc = encode(finetuned.task, sp, examples, finetuned.labels, FinetuneConfig(**finetuned.run["finetune"]),
                 finetuned.framing)
    mine = predict(model, enc.input_ids, 4096)
    got = pipeline("text-classification", model=str(clf), tokenizer=str(clf))([t for t, _ in examples],
                                                                              truncation=True, batch_size=64)
    assert [r["label"] for r in got] == [finetuned.labels[i] for i in mine.argmax(-1).tolist()]
