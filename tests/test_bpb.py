"""Bits per byte (bpb.py): the decoder's score against a hand computation, the encoder's
PLL-word-l2r unchanged under a vocabulary that reads the text the same way, and fair between a
coarse and a fine tokenizer on a language whose exact conditionals are known (where PLL is not);
the held-out text read back from the corpus, refused where it cannot be."""

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

from mmadapt import bpb as B
from mmadapt.config import PreprocessConfig
from mmadapt.data import TOKENIZER, DataError, file_sha256, is_validation_document
from mmadapt import heldout as H
from mmadapt.heldout import on_device
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.presets import LLAMA_TINY
from mmadapt.models.roberta import ROBERTA
from mmadapt.models.roberta.presets import PRESETS as ROBERTA_PRESETS
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, UNK_ID


class _Piece:
    def __init__(self, id, begin, end):
        self.id, self.begin, self.end = id, begin, end


class _Proto:
    def __init__(self, pieces):
        self.pieces = pieces


class Words:
    """A tokenizer of a fixed lexicon: each word of a text (split at spaces) into its listed
    pieces, with byte offsets (what bpb reads of SentencePiece's interface)."""

    def __init__(self, split: dict[str, list[tuple[str, int]]]):
        self.split = split

    def encode(self, text, out_type=int, return_type=None):
        if isinstance(text, list):
            return [self.encode(t) for t in text]
        if return_type != "proto":
            return [p.id for p in self.encode(text, return_type="proto").pieces]
        pieces, pos = [], 0
        for n, word in enumerate(text.split(" ")):
            pos += 1 if n else 0  # the space before it: a '▁' piece's span would start there
            start = pos
            for surface, i in self.split.get(word, [(word, UNK_ID)] if word else []):  # a character alone: <unk>
                pieces.append(_Piece(i, start - (1 if n and start == pos else 0), start + len(surface.encode())))
                start += len(surface.encode())
            pos = start
        return _Proto(pieces)


def two_char_pieces(words: list[str], first_id: int = 5, offset: int = 0) -> Words:
    """Every word in pieces of two characters; piece ids from `first_id` in order of first use,
    shifted by `offset`."""
    ids, split = {}, {}
    for w in words:
        split[w] = [(w[i:i + 2], first_id + offset + ids.setdefault(w[i:i + 2], len(ids)))
                    for i in range(0, len(w), 2)]
    return Words(split)


TEXT = ["alpha bravo charlie", "delta echo foxtrot golf", "bravo alpha echo", "hotel india delta alpha"]


def test_a_long_line_is_read_in_windows_cut_before_a_word():
    assert B.windows([0, 0, 1, 1, 1, 2, 3, 3], 4) == [(0, 2), (2, 6), (6, 8)]
    assert B.windows([0, 0, 0, 0, 0, 1], 2) == [(0, 2), (2, 4), (4, 6)]  # a word longer than a window
    assert B.windows([0, 1, 2], 8) == [(0, 3)]


def test_decoder_bits_per_byte_by_hand():
    """Sum over every piece of -log p(piece | the pieces before it, after </s>), / bytes / ln 2."""
    words = sorted({w for line in TEXT for w in line.split()})
    sp = two_char_pieces(words)
    cfg = dataclasses.replace(LLAMA_TINY, num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=64,
                              hidden_dropout=0.0, attention_dropout=0.0)
    model = LLAMA.build_lm(cfg).eval()
    text = B.RawText(tuple(TEXT), "test")
    layout = B.Layout((EOS_ID,), ())
    scored = B.prepare(sp, text, layout, False, 64, torch.device("cpu"))
    got = scored.bpb(H.summed_nats(model, scored.on_device))
    nats = 0.0
    with torch.no_grad():
        for line in TEXT:
            ids = torch.tensor([[EOS_ID] + sp.encode([line])[0]])
            logp = torch.log_softmax(model.logits(ids)[0][0].float(), -1)  # [s, V]
            nats -= float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].sum())
    assert scored.pieces == sum(len(x) for x in sp.encode(TEXT))
    assert text.bytes == sum(len(line.encode()) for line in TEXT)
    assert got == pytest.approx(nats / text.bytes / math.log(2), rel=1e-5)
    # With 6 positions, </s> and 5 pieces: 'delta echo foxtrot golf' (de lt a | ec ho | fo xt ro t |
    # go lf) is read in three windows, each cut before a word: de lt a ec ho | fo xt ro t | go lf.
    line = TEXT[1]
    short = B.prepare(sp, B.RawText((line,), "test"), layout, False, 6, torch.device("cpu"))
    ids = sp.encode([line])[0]
    nats = 0.0
    with torch.no_grad():
        for a, b in ((0, 5), (5, 9), (9, 11)):
            row = torch.tensor([[EOS_ID] + ids[a:b]])
            logp = torch.log_softmax(model.logits(row)[0][0].float(), -1)
            nats -= float(logp[torch.arange(b - a), row[0, 1:]].sum())
    assert short.bpb(H.summed_nats(model, short.on_device)) == pytest.approx(
        nats / len(line.encode()) / math.log(2), rel=1e-5)


def test_a_tokenizer_cannot_score_well_by_reading_text_as_unknown():
    """Each byte under an <unk> piece is charged 8 bits on top of the piece's own loss: by hand,
    for a decoder and an encoder whose tokenizer reads 'golf' and 'india' as <unk>."""

    words = sorted({w for line in TEXT for w in line.split()})
    sp = two_char_pieces(words)
    blind = Words({**sp.split, "golf": [("golf", UNK_ID)], "india": [("india", UNK_ID)]})
    text = B.RawText(tuple(TEXT), "test")
    for masked in (False, True):
        layout = B.Layout((), (EOS_ID,)) if masked else B.Layout((EOS_ID,), ())
        seen, unseen = (B.prepare(t, text, layout, masked, 64, torch.device("cpu")) for t in (sp, blind))
        assert (seen.unknown, seen.unknown_bytes) == (0, 0)
        assert (unseen.unknown, unseen.unknown_bytes) == (2, len("golf") + len("india"))
        assert unseen.bpb(5.0) == pytest.approx((5.0 / math.log(2) + 8 * 9) / text.bytes)
        assert seen.bpb(5.0) == pytest.approx(5.0 / math.log(2) / text.bytes)


def test_the_bytes_of_a_character_the_normalizer_drops_are_charged_as_unknown(tokenizer):
    """SentencePiece's normalizer drops a control character (U+0007, U+007F): no piece stands for
    it (its bytes fall inside a neighbour's span), so its bytes are charged 8 bits each as <unk>'s
    are; the pieces and their scored positions are those of the text without it."""
    from mmadapt.tokenizer import load

    sp = load(tokenizer)
    assert sp.encode("\x07") == [] and sp.encode("\x7f") == []  # what the rule reads: no piece at all
    clean, marked = "In the beginning God created", "In the begin\x07ning God\x7f\x7f created"
    layout = B.Layout((EOS_ID,), ())
    a, b = (B.causal_rows(sp, B.RawText((t,), "test"), layout, 64) for t in (clean, marked))
    assert a.rows == b.rows and a.unknown == b.unknown == 0
    assert (a.unknown_bytes, b.unknown_bytes) == (0, 3)
    # One inside an <unk>'s span is charged once, with that span's bytes (it was charged twice)
    inside = B.causal_rows(sp, B.RawText(("God \u0416\x07 said",), "test"), layout, 64)
    assert (inside.unknown, inside.unknown_bytes) == (1, len("\u0416\x07".encode()))
    nats = 7.0
    assert B.RawText((marked,), "t").bytes == len(clean) + 3
    ours = B.prepare(sp, B.RawText((marked,), "t"), layout, False, 64, torch.device("cpu"))
    assert ours.bpb(nats) == pytest.approx((nats / math.log(2) + 8 * 3) / (len(clean) + 3))


def test_the_bytes_a_bpe_without_byte_pieces_drops_are_charged_as_unknown(tmp_path):
    """A SentencePiece BPE converted with byte fallback and no byte pieces (Llama's kind, trained
    without them) drops every character it cannot encode, and encodes one alone as the word start
    '▁' its pre-tokenizer puts before it: a Russian verse read through it cost 1.8 bits a byte,
    its 60 bytes of Cyrillic charged nothing. They are charged 8 bits each, as <unk>'s are."""
    import sys

    import transformers as T

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import make_sp_tokenizer
    from mmadapt.hf import import_hf
    from mmadapt.tokenizer import load

    model = tmp_path / "model"
    tok = make_sp_tokenizer(model, vocab_size=300, byte_fallback=False)
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(tok) + 2, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=32)).save_pretrained(str(model))
    import_hf(model, tmp_path / "run")
    sp = load(tmp_path / "run" / "tokenizer" / "spm.model")
    assert sp.encode("a\u0416b") == sp.encode("ab") and sp.encode("\u0416")  # dropped, alone not "no piece"
    layout = B.Layout((BOS_ID,), ())
    rows = B.causal_rows(sp, B.RawText(("God said \u0416\u0416 unto", "God said unto"), "test"), layout, 32)
    assert (rows.unknown, rows.unknown_bytes) == (0, len("\u0416\u0416".encode()))
    # what it encodes (every letter of the verse) costs nothing beyond the model's nats
    assert B.causal_rows(sp, B.RawText(("God said unto Moses",), "test"), layout, 32).unknown_bytes == 0


def test_whitespace_a_tokenizer_collapses_is_charged_as_unknown(tokenizer):
    """SentencePiece reads a run of spaces or tabs as one word boundary: the characters after a
    run's first stand for nothing, so they are charged 8 bits a byte as a dropped character is (a
    byte-level BPE pays for every one of them); a lone tab or U+3000 read as a space is a fold, not
    a loss, and costs nothing."""
    from mmadapt.tokenizer import load

    sp = load(tokenizer)
    layout = B.Layout((EOS_ID,), ())
    texts = ["Gott sprach", "Gott    sprach", "Gott\t\tsprach", "Gott\tsprach", "Gott\u3000sprach"]
    got = [B.causal_rows(sp, B.RawText((t,), "test"), layout, 64) for t in texts]
    assert all(g.rows == got[0].rows for g in got)  # one reading of all five
    assert [g.unknown_bytes for g in got] == [0, 3, 1, 0, 0]


def test_a_control_character_python_calls_whitespace_the_normalizer_drops_is_charged(tokenizer):
    """U+000B and U+001C-U+001F are whitespace to Python and no piece to SentencePiece, whose
    normalizer deletes them ("cre\x0bated" reads as "created"): they were taken for a space (a
    fold) and charged nothing, so a text holding them scored better than the text without them.
    Charged 8 bits a byte as U+0007 is, once, also inside a run of whitespace (where the spaces
    either side of it are then a run of two, the second charged); a tab still reads as a space."""
    from mmadapt.tokenizer import load

    sp = load(tokenizer)
    assert sp.encode("cre\x0bated") == sp.encode("created") and sp.encode("\x1f") == []
    layout = B.Layout((EOS_ID,), ())
    texts = ["God created", "God cre\x0bated", "God cre\x1c\x1dated", "God\x1f created", "God \x1e created",
             "God\tcreated", "God\t\x1fcreated"]
    for rows in (B.causal_rows, lambda *a: B.masked_rows(*a[:2], B.Layout((), (EOS_ID,)), a[3])):
        got = [rows(sp, B.RawText((t,), "test"), layout, 64) for t in texts]
        assert all(g.rows == got[0].rows for g in got)  # one reading of them all
        assert [g.unknown_bytes for g in got] == [0, 1, 2, 1, 1 + 1, 0, 1]


def test_a_dropped_character_is_charged_by_a_tokenizer_without_latin_and_its_spaces_join_one_run(tmp_path):
    """A Russian SentencePiece reads "ab" as <unk>, which switched the probe off: U+000B and
    U+001F, deleted by its normalizer, were charged nothing there (a probe of its own script now).
    And the spaces either side of a character it drops are one run as it reads them ("a \x07 b"
    is "a  b"): the second space was free, so inserting the character made the text cheaper."""
    from mmadapt.corpora import write_bible_corpus
    from mmadapt.data import train_tokenizer
    from mmadapt.tokenizer import load

    corpus = write_bible_corpus("ru", tmp_path / "ru.txt", books=range(1, 3))
    sp = load(train_tokenizer(corpus, tmp_path / "spm", 1000))
    assert UNK_ID in sp.encode("ab")
    layout = B.Layout((EOS_ID,), ())
    texts = ["Бог сотворил", "Бог сотво\x0bрил", "Бог сотво\x1fрил", "Бог сотво\x07рил", "Бог  сотворил",
             "Бог \x07 сотворил", "Бог \u200b сотворил"]
    got = [B.causal_rows(sp, B.RawText((t,), "test"), layout, 64) for t in texts]
    assert all(g.rows == got[0].rows for g in got)
    assert [g.unknown_bytes for g in got] == [0, 1, 1, 1, 1, 1 + 1, 3 + 1]


def _imported_wordpiece(out: Path, lines: list[str] | None = None, lowercase: bool = False):
    """A WordPiece (hf_models.make_wordpiece: of the English Bible, or 3,000 pieces of `lines`)
    imported with a tiny BERT: the run's tokenizer."""
    import sys

    import transformers as T

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import make_wordpiece
    from mmadapt.hf import import_hf
    from mmadapt.tokenizer import load

    model = out / "model"
    tok = make_wordpiece(model, lowercase=lowercase, **({} if lines is None else {"lines": lines, "vocab_size": 3000}))
    T.BertForMaskedLM(T.BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=64)).save_pretrained(str(model))
    import_hf(model, out / "run")
    return load(out / "run" / "tokenizer" / "spm.model")


def test_a_wordpiece_isolating_chinese_characters_charges_no_space_and_a_folded_mark_joins_a_run(tmp_path):
    """The dropped-character probe of a WordPiece of Chinese text was "一二", which it reads as
    "一 二" as well: every space was then taken for a dropped character and charged 8 bits (a probe
    whose letters a space parts now). And an accent-stripper folds a combining mark away, so the
    spaces either side of it are one run as it reads them: the second space was free."""
    from mmadapt.corpora import bible_verses

    zh = _imported_wordpiece(tmp_path / "zh", [v[-1] for v in bible_verses("zh", books=range(1, 3))])
    assert UNK_ID in zh.encode("ab") and zh.encode("一 二") == zh.encode("一二")
    layout = B.Layout((BOS_ID,), (EOS_ID,))
    texts = ["起初神创造天地", "起初 神创造天地", "起初\x0b神创造天地"]
    got = [B.causal_rows(zh, B.RawText((t,), "test"), B.Layout((BOS_ID,), ()), 64) for t in texts]
    assert all(g.rows == got[0].rows for g in got) and got[0].unknown == 0  # (a space parts words: causal rows)
    assert [g.unknown_bytes for g in got] == [0, 0, 1]
    uncased = _imported_wordpiece(tmp_path / "en", lowercase=True)
    texts = ["God created", "God  created", "God \u0301 created", "God \x07 created"]
    got = [B.masked_rows(uncased, B.RawText((t,), "test"), layout, 64) for t in texts]
    assert all(g.rows == got[0].rows for g in got)
    assert [g.unknown_bytes for g in got] == [0, 1, 1, 1 + 1]  # the mark folded (free), the second space not


def _encoder(vocab: int, seed: int = 0) -> torch.nn.Module:
    cfg = dataclasses.replace(ROBERTA_PRESETS["tiny"][0], num_layers=2, head_layers=(2,), vocab_size=vocab,
                              max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    return ROBERTA.build_lm(cfg, seed=seed).eval()


def _encoder_bpb(model, sp, text, whole_word=True) -> float:
    rows = B.masked_rows(sp, text, B.Layout.of({}, masked=True), 60, whole_word=whole_word)  # an mmadapt encoder's
    return H.summed_nats(model, on_device(B.batches(rows), torch.device("cpu"))) / text.bytes / math.log(2)


def test_encoder_score_is_the_pll_word_l2r_by_hand():
    """Each piece scored with itself and the rest of its word masked, every other word visible."""
    words = sorted({w for line in TEXT for w in line.split()})
    sp = two_char_pieces(words)
    model = _encoder(64)
    text = B.RawText(tuple(TEXT[:2]), "test")
    nats = 0.0
    with torch.no_grad():
        for line in text.lines:
            spans = []  # (first piece, end) of each word
            ids = []
            for w in line.split():
                spans.append((len(ids), len(ids) + len(sp.split[w])))
                ids += [i for _, i in sp.split[w]]
            for a, b in spans:
                for j in range(a, b):
                    row = [BOS_ID] + ids[:j] + [MASK_ID] * (b - j) + ids[b:] + [EOS_ID]
                    logp = torch.log_softmax(model.logits(torch.tensor([row]))[0][0, 1 + j].float(), -1)
                    nats -= float(logp[ids[j]])
    assert _encoder_bpb(model, sp, text) == pytest.approx(nats / text.bytes / math.log(2), rel=1e-5)


@pytest.mark.parametrize("objective", ["mlm", "causal"])
def test_a_model_mmadapt_trained_reads_a_text_as_its_objective_frames_one(objective):
    """Bits per byte's layout for a model mmadapt trained (no imported tokenizer layout) is its
    objective's lm_row: an encoder's `<s> text </s>` (every training block starts with <s>; the
    layout had nothing before the text), a decoder's `</s> text`."""
    from mmadapt.objectives import OBJECTIVES

    obj, pieces = OBJECTIVES[objective], [7, 8, 9]
    layout = B.Layout.of({"model": {}}, masked=obj.masked)
    assert [*layout.prefix, *pieces, *layout.suffix] == obj.lm_row(pieces, 64)
    imported = {"imported_from": {"text_layout": {"prefix": [0], "suffix": [2]}}}
    assert B.Layout.of(imported, masked=True) == B.Layout((0,), (2,))  # an imported tokenizer's own


def test_encoder_score_is_unchanged_by_a_larger_vocabulary_that_splits_every_word_the_same():
    """The same model in a vocabulary of 40 more pieces, which the text never uses and the model
    gives no probability, with the ids of every piece moved: the same pieces, the same score."""
    words = sorted({w for line in TEXT for w in line.split()})
    sp, bigger = two_char_pieces(words), two_char_pieces(words, offset=40)
    small, large = _encoder(64), _encoder(104)
    state = small.state_dict()
    big = {k: v.clone() for k, v in large.state_dict().items()}
    for k, v in state.items():
        if v.shape[:1] == (64,) and big[k].shape[:1] == (104,):  # rows indexed by piece
            fill = -1e4 if v.ndim == 1 else 0.0  # the extra pieces: never predicted
            big[k] = torch.full_like(big[k], fill)
            big[k][:5], big[k][45:] = v[:5], v[5:]
        else:
            big[k] = v
    large.load_state_dict(big)
    text = B.RawText(tuple(TEXT), "test")
    assert _encoder_bpb(large, bigger, text) == pytest.approx(_encoder_bpb(small, sp, text), rel=1e-5)


# --- fair between tokenizers: a language whose exact conditionals are known ---------------------------

PREFIXES, SUFFIXES = ["ka", "lo", "mi", "nu"], [a + b for a in "bcdf" for b in "aeiu"]
LEXICON = [PREFIXES[i % 4] + SUFFIXES[i] for i in range(16)]  # 16 words; its suffix gives a word away


class Oracle(torch.nn.Module):
    """The exact masked-LM of a text of words drawn independently and uniformly from `LEXICON`,
    each word `width` pieces (`words`: the lexicon's piece ids): a masked piece's distribution is
    that of the lexicon words agreeing with the visible pieces of its own word (other words say
    nothing). Rows: <s>, the words' pieces, then </s> (an mmadapt encoder's layout)."""

    def __init__(self, words: list[tuple[int, ...]]):
        super().__init__()
        self.words, self.width = words, len(words[0])

    def forward(self, ids, labels=None, *, masked_index, targets, padding=None):
        b, s = ids.shape
        nats = 0.0
        for flat, target in zip(masked_index.tolist(), targets.tolist()):
            row, pos = divmod(flat, s)
            first = pos - (pos - 1) % self.width  # the word's first piece (position 0 holds <s>)
            seen = {k: int(ids[row, first + k]) for k in range(self.width) if int(ids[row, first + k]) != MASK_ID}
            agree = [w for w in self.words if all(w[k] == v for k, v in seen.items())]
            nats -= math.log(sum(w[pos - first] == target for w in agree) / len(agree))
        return torch.tensor(nats / len(targets)), None


def test_word_l2r_is_fair_between_a_coarse_and_a_fine_tokenizer_where_pll_is_not():
    """Coarse: one piece a word. Fine: two, its prefix (shared by 4 words) then its suffix (its
    own). With each tokenizer's exact model both are equally good: 4 bits a word. PLL-word-l2r
    gives both exactly that; PLL (one piece masked at a time) lets the visible suffix give the
    prefix away and scores the fine tokenizer 2 bits a word: it flatters finer tokenizations."""
    coarse = Words({w: [(w, 5 + i)] for i, w in enumerate(LEXICON)})
    fine = Words({w: [(w[:2], 5 + i % 4), (w[2:], 9 + i)] for i, w in enumerate(LEXICON)})
    rng = random.Random(0)
    text = B.RawText(tuple(" ".join(rng.choice(LEXICON) for _ in range(6)) for _ in range(20)), "synthetic")
    n_words = 6 * 20
    exact = n_words * 4 / text.bytes
    coarse_model = Oracle([(5 + i,) for i in range(16)])
    fine_model = Oracle([(5 + i % 4, 9 + i) for i in range(16)])
    assert _encoder_bpb(coarse_model, coarse, text) == pytest.approx(exact, rel=1e-6)
    assert _encoder_bpb(fine_model, fine, text) == pytest.approx(exact, rel=1e-6)
    assert _encoder_bpb(fine_model, fine, text, whole_word=False) == pytest.approx(exact / 2, rel=1e-6)
    assert _encoder_bpb(coarse_model, coarse, text, whole_word=False) == pytest.approx(exact, rel=1e-6)


def test_a_lone_word_boundary_piece_belongs_to_the_word_after_it():
    #                 spans: '▁' of no character at 0, 'ab' [0, 2); '▁' [3, 3), 'cd' [3, 5)
    assert B.word_index("ab cd", [(0, 0), (0, 2), (3, 3), (3, 5)]) == [0, 0, 1, 1]
    assert B.word_index(" ab", [(1, 3)]) == [0]


# --- the held-out text ------------------------------------------------------------------------------

def test_heldout_lines_are_the_validation_documents(english, corpus):
    docs = B.heldout_lines(english, 4000)
    manifest = json.loads((english / "manifest.json").read_text())
    assert manifest["valid_seed"] == PreprocessConfig.tokenizer_seed
    assert sum(len(line.encode()) for d in docs for line in d) >= 4000
    # By hand: the corpus's documents (blank-line separated) whose first line the split holds out.
    held = [d for d in (b.strip().splitlines() for b in corpus.read_text().split("\n\n")) if d
            and is_validation_document(d[0].strip(), 0.1, manifest["valid_seed"])]
    assert docs[0] == [line.strip() for line in held[0]][:len(docs[0])]
    assert [line for d in docs for line in d] == [line.strip() for d in held for line in d][:sum(map(len, docs))]


def test_heldout_lines_split_lines_at_newlines_alone_as_prepare_does(tokenizer, tmp_path):
    """A lone carriage return inside a line is part of the line for prepare (it splits at \\n):
    the held-out lines read back keep it (they were split at it too, and the check against the
    stored split refused the text, with no fix that worked)."""
    from mmadapt.data import prepare

    corpus = tmp_path / "cr.txt"
    with open(corpus, "w", encoding="utf-8", newline="") as f:
        f.write("".join(f"In the beginning {i}.\rAnd the earth was.\nAnd God said.\n\n" for i in range(40)))
    prepare(corpus, tmp_path / "prep", 1000, tokenizer=tokenizer, quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.5))
    docs = B.heldout_lines(tmp_path / "prep", 10_000)
    assert docs and all(d[0].endswith(".\rAnd the earth was.") and d[1:] == ["And God said."] for d in docs)


def test_heldout_lines_refuse_a_split_they_cannot_read_back(english, tmp_path):
    """A manifest whose seed is not the one the split was made with: the lines read back are not
    the split's, refused in one line (not scored as if they were)."""
    import shutil

    bad = tmp_path / "en"
    shutil.copytree(english, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "valid_seed": manifest["valid_seed"] + 1}))
    with pytest.raises(DataError, match="not those of .* validation split"):
        B.heldout_lines(bad, 2000)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "valid_fraction": 0.0, "valid": None}))
    with pytest.raises(DataError, match="has no validation split: .* --valid_fraction"):
        B.heldout_lines(bad, 2000)


def test_the_primarys_own_rows_as_an_artifact_are_no_adaptation(primary_run, english, tokenizer, tmp_path):
    """plugin_records through the primary: an 'artifact' of its own embeddings and primary-head
    bias with its own tokenizer scores exactly what no adaptation scores; a later one (its bias
    moved) scores otherwise, and its start is update 0's score."""
    from mmadapt import plugin as P
    from mmadapt.artifact import write_artifact
    from mmadapt.checkpoint import tag_for
    from mmadapt.family import WORD
    from mmadapt.run import load_weights
    from conftest import PRIMARY_ITERS

    cfg, state = load_weights(primary_run)
    run = tmp_path / "adapt"
    meta = {"system": "bl_base", "lang": "en", "step": 0, "flops": 0.0, "flops_paper": 0.0, "v100_days": 0.0,
            "tokens": 0, "source": str(primary_run), "source_tag": tag_for(PRIMARY_ITERS)}
    own = {"word_embeddings": state[WORD], "output_bias": state["heads.heads.1.bias"]}
    moved = {**own, "output_bias": own["output_bias"] + torch.randn(own["output_bias"].shape,
                                                                     generator=torch.Generator().manual_seed(0))}
    for step, art in ((0, own), (3, moved)):
        write_artifact(run / "embeddings" / tag_for(step), art, tokenizer, {**meta, "step": step})
    (run / "run.json").write_text(json.dumps({"system": "bl_base", "lang": "en", "train": {"seed": 1}}))
    records = P.plugin_records(primary_run, [run], {"en": english}, 32, blocks=16, batch_size=16, bpb_bytes=2000)
    assert [r["step"] for r in records] == [0, 3]
    first, later = records
    assert first["bpb"] == pytest.approx(first["none_bpb"], rel=1e-6)
    assert later["bpb"] > later["none_bpb"] + 0.01 and later["start_bpb"] == first["bpb"]
    for r in records:
        assert 0.9 * 2000 < r["bpb_bytes"] < 2000 + 1000  # the lines read, less the spaces where they are cut
        assert r["bpb_seq_length"] == 32  # the window it was scored at (report.mixed_scales)
        # the text and the tokenizer it was scored through (report.bpb_markdown: mixed_scales, the tokenizers)
        assert r["bpb_text"] == B.RawText.read(english, 2000).digest
        assert r["heldout_tokenizer"] == file_sha256(Path(english) / TOKENIZER)[:16]


def test_within_the_source_rows_an_expanded_artifact_reads_source_text_as_no_adaptation(primary_run, english,
                                                                                          tokenizer):
    """ByteScorer.within: over every row it is the model's own score; an expanded artifact (the
    model's own rows and 16 new ones, given the source's largest output bias so that they take a
    share of the softmax) raises the source text's bits per byte, and within the source rows (the
    new pieces suppressed) gives back exactly the model's own; a reading past the rows is refused."""
    from mmadapt.family import WORD
    from mmadapt.heldout import Primary, Scorer
    from mmadapt.run import load_weights

    _, state = load_weights(primary_run)
    own, bias = state[WORD].float(), state["heads.heads.1.bias"].float()
    rows = own.shape[0]
    per_byte = B.ByteScorer(Scorer(Primary.read(primary_run)), 32, 2000)
    raw = per_byte.text(english)
    none = per_byte.none(raw)
    assert per_byte.within(raw, tokenizer, rows) == pytest.approx(none, rel=1e-6)
    new = torch.randn(16, own.shape[1], generator=torch.Generator().manual_seed(0)) * own.std()
    art = {"word_embeddings": torch.cat([own, new]), "output_bias": torch.cat([bias, bias.max().expand(16)])}
    meta = {"vocab_mode": "expand", "source_vocab_size": rows}
    assert per_byte.score(raw, tokenizer, art, meta)["bpb"] > none + 1e-3
    assert per_byte.within(raw, tokenizer, rows, art, meta) == pytest.approx(none, rel=1e-6)
    with pytest.raises(ValueError, match="past the first 10 rows"):
        per_byte.within(raw, tokenizer, 10)


def test_the_batch_size_moves_bits_per_byte_by_rounding_alone(primary_run, english, tokenizer):
    """ByteScorer's batch_tokens (the demo passes 2048 on a CPU, the default is a GPU's 16384):
    batches of at most that many positions, and the same bits per byte to rounding."""
    from mmadapt.heldout import Primary, Scorer

    scorer = Scorer(Primary.read(primary_run))
    small, large = (B.ByteScorer(scorer, 32, 2000, batch_tokens=n) for n in (256, B.BATCH_TOKENS))
    raw = small.text(english)
    read = small.reading(raw, tokenizer)
    assert len(read.on_device) > 4 and all(ids.numel() <= 256 for ids, *_ in read.on_device)
    assert len(large.reading(raw, tokenizer).on_device) < len(read.on_device)
    assert small.none(raw) == pytest.approx(large.none(raw), rel=1e-6)


def test_a_validation_split_too_small_for_a_figure_is_scored_with_a_warning(primary_run, english, tokenizer,
                                                                           tmp_path, capsys):
    """A validation split under MIN_BPB_BYTES: every row of the language is still scored on it
    (comparable with each other), with one warning line naming the fix; a split that holds
    enough gives none."""
    from mmadapt.data import prepare
    from mmadapt.heldout import Primary, Scorer

    corpus = tmp_path / "few.txt"
    corpus.write_text("".join(f"In the beginning {i}.\nAnd God said.\n\n" for i in range(40)), encoding="utf-8")
    prepare(corpus, tmp_path / "few", 1000, tokenizer=tokenizer, quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    per_byte = B.ByteScorer(Scorer(Primary.read(primary_run)), 32, 2000)
    per_byte.text(english)
    assert "warning" not in capsys.readouterr().out
    raw = per_byte.text(tmp_path / "few")
    assert 0 < raw.bytes < B.MIN_BPB_BYTES
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and f"over {raw.bytes} held-out bytes" in out and "--valid_fraction" in out
    per_byte.text(tmp_path / "few")  # read once: no second warning
    assert "warning" not in capsys.readouterr().out


def test_a_normalisation_is_a_fold_where_the_scored_text_holds_its_forms(de_tokenizer, tmp_path):
    """SentencePiece's NFKC reads a ligature or full-width letters as the plain ones, and NFC a
    decomposed accent as the composed one: the same pieces for more bytes, a lower figure, where a
    tokenizer that normalises nothing (Llama-2's byte fallback) pays for each byte, and nothing
    said so. Named as folds of the text scored (the Bibles here are NFC; the Chinese one's
    punctuation is full-width): where it holds no such form there is nothing to flatter. (A German
    tokenizer: an English one reads every accented probe with <unk>, which answers nothing.)"""
    from mmadapt.tokenizer import load

    sp = load(de_tokenizer)
    assert sp.encode("And he said \ufb01ne") == sp.encode("And he said fine")  # the reviewer's pair
    assert B.folds(sp) == B.folds(sp, ["And God said, Let there be light"]) == []
    assert B.folds(sp, ["And he said \ufb01ne"]) == ["compatibility forms"]
    assert B.folds(sp, ["Und Gott sprach\uff0c Es werde Licht"]) == ["compatibility forms"]  # a full-width comma
    # asked of the scored lines: a Chinese tokenizer reads every probe of FOLD_TEXTS with <unk>,
    # and was said to fold nothing on the Chinese Bible, whose punctuation is full-width
    from mmadapt.corpora import write_bible_corpus
    from mmadapt.data import train_tokenizer

    zh = load(train_tokenizer(write_bible_corpus("zh", tmp_path / "zh.txt", books=range(1, 2)), tmp_path / "zh",
                              2000, threads=1))
    verses = (tmp_path / "zh.txt").read_text(encoding="utf-8").splitlines()[:40]
    assert any("\uff0c" in v for v in verses) and all(UNK_ID in zh.encode(t) for t in B.FOLD_TEXTS)
    assert B.folds(zh, verses) == ["compatibility forms"]
    # and a tokenizer that reads none of those lines without <unk> (the German one, of Chinese) is
    # asked the probes made of such forms: it folds them too (it was said to keep them: a caveat
    # beside the Chinese one that two NFKC tokenizers do not compare)
    assert all(UNK_ID in sp.encode(v) for v in verses if "\uff0c" in v)
    assert B.folds(sp, verses) == ["compatibility forms"]
    assert B.fold_caveat("the target", B.folds(zh, verses), B.folds(sp, verses)) is None
    assert B.folds(sp, ["Und Gott segnete die So\u0308hne Noahs"]) == ["composition"]

    class Verbatim:  # reads every character as it is (no normaliser)
        def encode(self, text):
            return [ord(c) for c in text]
    lines = ["And he said \ufb01ne", "Und Gott segnete die So\u0308hne Noahs"]
    assert B.folds(Verbatim(), lines) == []
    assert B.fold_caveat("the target", B.folds(sp, lines), B.folds(Verbatim(), lines)).startswith(
        "Not comparable as they stand: the target folds compatibility forms and composition where the other keeps it")


def test_a_tokenizer_of_another_script_is_not_said_to_fold_what_it_reads_as_unknown(tmp_path):
    """A Russian SentencePiece reads the Latin probes as <unk>s on both sides, the same pieces:
    it was said to fold case and accents (a false 'not comparable' beside a cased English
    tokenizer, and a real fold of an uncased source left unnamed). Its own script's texts
    answer: it keeps case, and the same tokenizer reading lower-cased text folds it."""
    from mmadapt.corpora import write_bible_corpus
    from mmadapt.data import train_tokenizer
    from mmadapt.tokenizer import load

    sp = load(train_tokenizer(write_bible_corpus("ru", tmp_path / "ru.txt", books=range(1, 3)), tmp_path / "ru", 1000,
                              threads=1))
    assert UNK_ID in sp.encode("The Lord God said unto Moses")
    assert B.folds(sp) == []

    class Uncased:
        def encode(self, text):
            return sp.encode(text.lower())

    assert B.folds(Uncased()) == ["case"]
