"""Data: tokenizer training, one-time parallel encoding into an indexed dataset ("prepare
once, train many"), FULL-SENTENCES blocks and deterministic MLM batches.

Corpus format: plain UTF-8 text, one sentence (or document line) per line, a blank line between
documents - the layout CC-100 ships in.

A prepared dataset (`prepare`, the `mmadapt preprocess` command) is a directory:
    tokenizer.model      the SentencePiece model the text was encoded with
    text.bin, text.idx   megatron-core's indexed dataset (megatron.core.datasets.indexed_dataset):
                         one sequence per sentence, its pieces then `</s>` (fairseq's per-line
                         eos), and after each document's last sentence a sequence holding a lone
                         `</s>` (fairseq's empty line): the document separator
    manifest.json        corpus path, size and content fingerprint, tokenizer fingerprint,
                         vocabulary size, counts, mmadapt version; written last and atomically,
                         so a directory without it is not a dataset
    blocks_s<S>.npy      the block index for seq_length S, [n, 2] int64 (token offset, length),
                         made on first use and memory-mapped afterwards
Encoding runs in `workers` processes over byte ranges aligned to document boundaries; shards
are concatenated in corpus order, so the dataset is byte-identical for any number of workers.

Masked-LM blocks (the encoder's objective, MLMBatches; objectives.py) follow RoBERTa's FULL-SENTENCES packing
(fairseq's `--sample-break-mode complete`): each block is `<s>` followed by consecutive whole
sequences (sentences with their `</s>`, document separators) up to seq_length tokens, crossing
document boundaries; a sentence longer than a block is split. A block is therefore one
contiguous range of the token stream. Next-token blocks (the decoder's objective,
CausalBatches) are GPT-style packing of the same stream: consecutive chunks of seq_length + 1
tokens, each position scored on its next piece.

Batches are a pure function of (seed, update step): the global sample index of micro-batch j,
data-parallel rank r, row i of update t is
    g = t * global_batch + (j * dp_world + r) * micro_batch + i
and sample g is block perm_e(g mod n) of epoch e = g // n (a seeded permutation computed per
index, never materialised), for MLM masked with an RNG seeded by (seed, g) (RoBERTa's dynamic
masking: a block seen again gets a new mask), and for a causal LM that scores a fraction of its
positions (TrainConfig.score_fraction < 1) those drawn likewise. Resuming therefore needs only
the update step, and a data-parallel run sees exactly the micro-batches of a single-process run
with gradient accumulation over the same global batch.

Step 2's source-language replay (ReplayBatches) keeps both properties: R of the B blocks of every
update come from a second dataset, spread evenly over the update's micro-batches (micro-batch q of
the M = gradient_accumulation_steps * dp_world, q = j * dp_world + r, takes R_q = floor((q + 1) R /
M) - floor(q R / M) of them, as its first rows), and each dataset is read by its own global sample
index, t * R + ... for the replay text and t * (B - R) + ... for the target text, each in its
own seeded order: a pure function of (seed, update, micro-batch, row) again.
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

from mmadapt import __version__
from mmadapt.checkpoint import WRITE_TEMPORARY, atomic_write, refuse_other_files, write_temporary
from mmadapt.config import TINY_ENV, TINY_FLAGS, LoopConfig, PreprocessConfig, TrainConfig, scored_positions
from mmadapt.faults import pid_alive
from mmadapt.tokenizer import has_byte_fallback, is_hf, load, sp_proto, unexportable
from mmadapt.tokens import BOS_ID, EOS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL, PAD_ID, UNK_ID

TEXT = "text"  # prefix of the indexed dataset inside a prepared directory
VALID = "valid"  # prefix of its held-out documents (prepare's valid_fraction)
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
# The largest vocabulary whose tokens are stored as uint16; a larger one (XLM-R's 250,002 pieces,
# Qwen2's 151,646, Llama-3's 128,256) is stored as int32, twice the bytes.
UINT16_MAX_PIECES = 65_535
FORMAT = 1  # version of the prepared-dataset layout
# What every manifest prepare has written holds and the readers index (check_prepared, bpb, heldout)
MANIFEST_KEYS = ("corpus", "corpus_fingerprint", "tokenizer_sha256", "vocab_size", "dtype", "tokens")
# A training command encodes a raw --corpus itself only below this size; larger corpora are
# prepared once with `mmadapt preprocess` (parallel, shared by every run that uses them).
RAW_CORPUS_LIMIT_BYTES = 1 << 30


class DataError(ValueError):
    """A user-facing problem with the corpus or the tokenizer."""


class NothingHeldOut(DataError):
    """prepare's valid_fraction drew none of the corpus's `documents` (a caller with no such flag
    words its own fix)."""

    def __init__(self, message: str, documents: int):
        super().__init__(message)
        self.documents = documents

    def __reduce__(self):  # pickled by its fields (faults.Stopped's)
        return type(self), (str(self), self.documents)


def check_corpus(path: str | os.PathLike) -> Path:
    """A readable, non-empty UTF-8 text file, or a DataError naming the problem (for text that
    is not UTF-8: the byte offset of the first bad sequence; it is never decoded with
    replacement characters). One streaming pass, ~1 GB/s."""
    import codecs

    path = Path(path)
    if path.is_dir():
        raise DataError(f"corpus {path} is a directory: pass --corpus a UTF-8 text file (one sentence per line)")
    if path.exists() and not path.is_file():  # every stage reads it more than once, seeking: a pipe cannot serve
        raise DataError(f"corpus {path} is not a regular file (a pipe or a device): write the text to a file first "
                        "and pass that (a UTF-8 text file, one sentence per line)")
    if not path.is_file():
        raise DataError(f"corpus {path} does not exist: pass --corpus a UTF-8 text file (one sentence per line)")
    decoder, offset, text = codecs.getincrementaldecoder("utf-8")(), 0, False
    # '\r's that end a line alone (not before a '\n' or another '\r': a '\r\r\n' line reads as
    # its text), '\n's, '\r\n's; whether a '\r' ended the last read
    lone, newlines, crlf, cut = 0, 0, 0, False
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            if offset == 0:
                packed = next((tool for magic, tool in PACKED.items() if chunk.startswith(magic)), None)
                if packed:  # (its bytes read as a bad UTF-8 sequence at offset 1, with iconv advised)
                    raise DataError(f"corpus {path} is a compressed file: unpack it ({packed}) and pass the text")
                # UTF-16 without a byte-order mark decodes as UTF-8 (its ASCII as letters and NULs):
                # refused, not read as a text of one-letter pieces and <unk> (NUL is no text's byte)
                head = chunk[:1 << 16]
                if head and head.count(0) > len(head) // 4:
                    order = "LE" if head[1::2].count(0) > head[0::2].count(0) else "BE"
                    raise DataError(f"corpus {path} looks like UTF-16 ({head.count(0) / len(head):.0%} of its first "
                                    f"bytes are NUL): convert it (iconv -f UTF-16{order} -t UTF-8)")
            held = decoder.getstate()[0]  # bytes of a character cut by the previous chunk
            try:
                decoded = decoder.decode(chunk)
            except UnicodeDecodeError as e:  # e.start counts from the held bytes, which come first
                raise DataError(f"corpus {path} is not UTF-8: byte offset {offset - len(held) + e.start} "
                                f"({(held + chunk)[e.start:e.start + 4]!r}); convert it (e.g. iconv -f <encoding> -t "
                                "utf-8)") from None
            if offset == 0:  # a byte-order mark is no text (line_text): a file of one alone is empty
                decoded = decoded.removeprefix("\ufeff")
            text = text or bool(decoded.strip())  # as the encoder reads a line: Unicode's blanks are blank
            lone += len(LONE_CR.findall(chunk)) + (cut and chunk[:1] not in b"\r\n")
            crlf += chunk.count(b"\r\n") + (cut and chunk.startswith(b"\n"))
            newlines, cut = newlines + chunk.count(b"\n"), chunk.endswith(b"\r")
            offset += len(chunk)
        lone += cut  # (a '\r' ends the file)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"corpus {path} is not UTF-8: it ends inside a multi-byte character (byte offset "
                            f"{offset})") from None
    if not text:
        raise DataError(f"corpus {path} is empty: it needs at least one non-blank line of text")
    if lone and lone >= newlines:  # every stage reads a line up to a '\n': the text between two, one sentence
        # (or none, skipped in training for its length); a stray '\r' among '\n' lines is read inside its line
        rest = f" and {newlines:,} with a newline" if newlines else ""
        fix = "sed -e 's/\\r*$//' -e 's/\\r/\\n/g'" if crlf else "tr '\\r' '\\n'"  # (tr: a CRLF a document's end)
        raise DataError(f"corpus {path} ends {lone:,} of its lines with '\\r' alone (old Mac line endings){rest}, "
                        f"and every stage reads a line up to a newline: convert them ({fix} < {path.name} > "
                        f"{path.stem}-lf{path.suffix})")
    return path


LONE_CR = re.compile(rb"\r(?=[^\r\n])")  # a '\r' a line's text follows (within one read)

# a compressed corpus's first bytes -> the tool that unpacks it
PACKED = {b"\x1f\x8b": "gunzip", b"BZh": "bunzip2", b"\xfd7zXZ\x00": "unxz", b"\x28\xb5\x2f\xfd": "unzstd",
          b"PK\x03\x04": "unzip"}


SP_MAX_SENTENCE_BYTES = 4192  # SentencePiece's max_sentence_length default: longer lines are skipped


def train_tokenizer(corpus: str | os.PathLike, model_prefix: str | os.PathLike, vocab_size: int,
                    seed: int = 1234, max_sentences: int = 10_000_000, threads: int | None = None,
                    byte_fallback: bool = False) -> Path:
    """Train a SentencePiece unigram model with mmadapt's special ids; returns `<prefix>.model`.
    `threads` (default: the CPU count) changes the vocabulary (PreprocessConfig.tokenizer_threads);
    byte_fallback: PreprocessConfig.byte_fallback (its 256 byte pieces at ids 5-260)."""
    import sentencepiece as spm

    corpus, model_prefix = check_corpus(corpus), Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    tmp = model_prefix.with_name(model_prefix.name + f".tmp{os.getpid()}")
    sample = Path(f"{tmp}.sample")
    try:
        counts = _line_counts(corpus)  # one pass: the sample's size and the long lines' warning
        text = _sample(corpus, sample, max_sentences, seed, counts)
        _train_sentencepiece(corpus, text, tmp, vocab_size, max_sentences, threads or os.cpu_count() or 1, counts,
                             byte_fallback)
    except BaseException:  # stopped (Ctrl-C) or refused: no half-trained model is left beside the output
        for ext in (".model", ".vocab"):
            Path(f"{tmp}{ext}").unlink(missing_ok=True)
        raise
    finally:
        sample.unlink(missing_ok=True)
    _name_prefix(Path(f"{tmp}.model"), model_prefix)
    for ext in (".model", ".vocab"):
        os.replace(f"{tmp}{ext}", f"{model_prefix}{ext}")
    return Path(f"{model_prefix}.model")


def _name_prefix(model: Path, prefix: Path) -> None:
    """Record the name of `prefix` as the model's trainer_spec.model_prefix, where SentencePiece
    wrote the temporary path it trained into (.tmp<pid>), and no input file: both as given would
    make the model's bytes, and with them the sha256 a prepared dataset's manifest and every run
    on it record, differ from one preparation of the same corpus to the next (another process, or
    the same paths spelt from another directory), and a --resume over a dataset prepared again
    alike be refused as holding another tokenizer. (The vocabulary itself is the same for the same
    text, seed and num_threads: SentencePiece's EM sums each thread's share apart; the manifest
    names the corpus.)"""
    proto = sp_proto(model)
    proto.trainer_spec.model_prefix = Path(prefix).name
    del proto.trainer_spec.input[:]
    model.write_bytes(proto.SerializeToString())


def line_text(raw: bytes, first: bool = False) -> str:
    """A corpus line's text as every stage reads it (the encoder, bits per byte's held-out lines,
    the tokenizer's training text): decoded (`first`: the file's first line, whose byte-order mark
    is no text) and stripped at both ends as str.strip strips (a CRLF file's \r, U+0085, U+2028);
    "" for a blank line, a document's end. (UnicodeDecodeError: check_corpus refuses it first.)"""
    return raw.decode("utf-8-sig" if first else "utf-8").strip()


def _sentences(f) -> Iterator[bytes]:
    """The sentences SentencePiece trains on, of a corpus open in binary from its start, in order:
    each line's text (line_text) that is not empty and at most SP_MAX_SENTENCE_BYTES bytes."""
    for i, line in enumerate(f):
        text = line_text(line, first=not i).encode()
        if 0 < len(text) <= SP_MAX_SENTENCE_BYTES:
            yield text


class LineCounts(NamedTuple):
    lines: int
    sentences: int  # the lines SentencePiece trains on (_sentences)
    long_lines: int  # those it skips for their length
    long_bytes: int  # their bytes
    unclean: int  # lines whose bytes are not their text (line_text): a CRLF file's, one ending in U+0085


def _line_counts(corpus: Path) -> LineCounts:
    """`corpus`'s LineCounts: one pass."""
    lines = sentences = long_lines = long_bytes = unclean = 0
    with open(corpus, "rb") as f:
        for line in f:
            text = line_text(line, first=not lines).encode()
            lines += 1
            sentences += 0 < len(text) <= SP_MAX_SENTENCE_BYTES  # (_sentences' rule)
            if len(text) > SP_MAX_SENTENCE_BYTES:
                long_lines, long_bytes = long_lines + 1, long_bytes + len(line)
            unclean += text != (line[:-1] if line.endswith(b"\n") else line)
    return LineCounts(lines, sentences, long_lines, long_bytes, unclean)


def _sample(corpus: Path, out: Path, most: int, seed: int, counts: LineCounts | None = None) -> Path:
    """What SentencePiece trains on: `corpus` itself where it holds at most `most` sentences and
    every line is its text (`counts`: its _line_counts, or counted here), else `out`: a seeded
    sample of `most` of its sentences in corpus order, or, where they all fit, every line as its
    text (line_text), so that the vocabulary learns no character the encoder strips and a CRLF
    file trains the tokenizer its LF twin does. SentencePiece's own reservoir sample ignores its
    seed: the same corpus gave another tokenizer at every preparation (one that every run on the
    first refused as another tokenizer)."""
    counts = _line_counts(corpus) if counts is None else counts
    if counts.sentences <= most and not counts.unclean:
        return corpus
    with open(corpus, "rb") as f, open(out, "wb") as w:
        if counts.sentences <= most:  # every line (a blank one too: the text SentencePiece reads is the clean twin's)
            for n, line in enumerate(f):
                w.write(line_text(line, first=not n).encode() + b"\n")
            return out
        keep = np.sort(np.random.default_rng(seed).choice(counts.sentences, most, replace=False, shuffle=False))
        at = 0  # the next kept sentence's index in `keep`
        for n, body in enumerate(_sentences(f)):
            if at < most and keep[at] == n:
                w.write(body + b"\n")
                at += 1
    return out


def _train_sentencepiece(corpus: Path, text: Path, prefix: Path, vocab_size: int, max_sentences: int,
                         threads: int, counts: LineCounts, byte_fallback: bool = False) -> None:
    """SentencePiece's trainer on `text` (`corpus` or its _sample) into `prefix`.model/.vocab,
    its failures as one-line DataErrors naming `corpus` (`counts`: its _line_counts)."""
    import sentencepiece as spm

    try:
        spm.SentencePieceTrainer.train(
            # a list: the wrapper quotes it as CSV, which is how SentencePiece reads `input`
            # (a path holding a comma, given as text, was read as two files)
            input=[str(text)], model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
            character_coverage=0.9995, pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID,
            # a control piece, as <s> and </s> are: no text produces it (a user-defined one made a
            # literal "<mask>" in a corpus the mask id, unlabelled in training and scored in bits
            # per byte as a piece no model predicts); predict inserts it where a text marks one
            # `text` holds at most max_sentences sentences (_sample): SentencePiece keeps them all,
            # in order (the same call as before the sample was ours: the same tokenizer's bytes)
            control_symbols=["<mask>"], input_sentence_size=max_sentences, byte_fallback=byte_fallback,
            shuffle_input_sentence=True, num_threads=threads, minloglevel=2)
    except RuntimeError as e:
        if "sentences_.empty()" in str(e):  # every line was dropped, most often for its length
            if counts.long_lines:
                raise DataError(f"corpus {corpus}: SentencePiece skips lines longer than {SP_MAX_SENTENCE_BYTES} "
                                f"bytes and {counts.long_lines} of its lines are, leaving nothing to train on: split "
                                "the text into one sentence per line") from None
        most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", str(e))
        if most:  # a small text holds fewer distinct pieces than were asked for
            raise DataError(f"corpus {corpus} is too small for a {vocab_size}-piece vocabulary: SentencePiece finds "
                            f"at most {most.group(1)} pieces in it; pass --vocab_size {most.group(1)} or less, or more "
                            "text") from None
        fewest = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", str(e))
        if fewest:  # (SentencePiece's own fix names its --character_coverage, which mmadapt does not take)
            need = int(fewest.group(1))
            # MMADAPT_TINY=1 caps --vocab_size: the size the fix names would be capped again
            tiny = os.environ.get(TINY_ENV) == "1" and need > TINY_FLAGS["vocab_size"]
            raise DataError(f"corpus {corpus} holds more characters than a {vocab_size}-piece vocabulary holds: "
                            f"SentencePiece needs {need} pieces for its characters"
                            f"{', 256 byte pieces' if byte_fallback else ''} and special pieces"
                            + (f", and {TINY_ENV}=1 caps --vocab_size at {TINY_FLAGS['vocab_size']}: run it without "
                               f"{TINY_ENV}=1, with --vocab_size {need} or more" if tiny else
                               f"; pass --vocab_size {need} or more")) from None
        if "(all_chars_count) > (0)" in str(e):  # every character dropped by its normalization (nmt_nfkc)
            raise no_text(corpus) from None
        raise DataError(f"SentencePiece could not train a {vocab_size}-piece vocabulary on {corpus}: "
                        f"{str(e).splitlines()[0]}") from None
    lines, _, long_lines, long_bytes, _ = counts
    if long_lines:  # trained on the rest, unsaid: a script found only in long lines became <unk>
        print(f"warning: {long_lines:,} of the {lines:,} lines of {corpus} ({long_bytes / corpus.stat().st_size:.0%} "
              f"of its bytes) are longer than {SP_MAX_SENTENCE_BYTES} bytes, which SentencePiece skips: the "
              "vocabulary was trained on the rest; split the text into one sentence per line", flush=True)


def read_tokenizer(path: str | os.PathLike):
    """Load a SentencePiece model (or an imported tokenizer: mmadapt/tokenizer.py), with one line
    (DataError) for a path that is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer {path} " + ("is a directory" if path.is_dir() else "does not exist")
                        + ": pass a SentencePiece .model file")
    try:
        return load(path)
    except (RuntimeError, OSError, ValueError) as e:
        raise DataError(f"tokenizer {path} is not a SentencePiece model ({str(e).splitlines()[0][:100]}): pass a "
                        ".model file made by SentencePiece") from None


def load_checked_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """read_tokenizer, then check its special ids and (if given) its vocabulary size."""
    sp = read_tokenizer(path)
    if vocab_size is not None and sp.get_piece_size() != vocab_size:
        raise DataError(f"tokenizer {path} has {sp.get_piece_size()} pieces but the model's vocab_size is "
                        f"{vocab_size}: pass --vocab_size {sp.get_piece_size()} or a matching tokenizer")
    if (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.piece_to_id("<mask>")) != (PAD_ID, BOS_ID, EOS_ID, MASK_ID):
        raise DataError(f"tokenizer {path} does not use mmadapt's special ids (pad 0, <s> 2, </s> 3, "
                        "<mask> 4): train it with `mmadapt.data.train_tokenizer`")
    return sp


def corpus_fingerprint(path: str | os.PathLike) -> dict:
    """Size and a SHA-256 over the whole file when small, else over 64 evenly spaced 64 KiB
    chunks plus the first and last MiB: cheap on a 300 GB corpus, and any edit that changes
    the size or a sampled region shows."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 16 << 20:
            h.update(f.read())
        else:
            spans = [(0, 1 << 20), (size - (1 << 20), 1 << 20)]
            spans += [(i * (size - (64 << 10)) // 63, 64 << 10) for i in range(64)]
            for offset, length in spans:
                f.seek(offset)
                h.update(f.read(length))
    return {"size": size, "sha256_sampled": h.hexdigest()}


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _doc_boundary(f, offset: int, size: int) -> int:
    """The first document start at or after byte `offset`: just after a blank line (or 0/EOF)."""
    if offset <= 0:
        return 0
    f.seek(offset - 1)
    f.readline()  # the rest of the line that `offset` falls in (or the newline just before it)
    pos = f.tell()
    while pos < size:
        line = f.readline()
        pos += len(line)
        if not line.strip():
            return pos
    return size


class _Shard:
    """One worker's output: the tokens written as they come, each sentence's length and each
    document's end held as 4 and 8 bytes (megatron's IndexedDatasetBuilder held a Python int per
    sentence and built another per pointer at its finalize: ~90 bytes a sentence)."""

    def __init__(self, prefix: str, dtype: str, sp):
        self.data = open(prefix + ".bin", "wb")
        self.lengths, self.doc_ends = array.array("i"), array.array("q", [0])  # as megatron's: the first 0
        self.prefix, self.dtype, self.sp = prefix, dtype, sp
        self.items: list[str | None] = []  # a sentence, or None: the current document ends here
        self.counts = [0, 0, 0, 0]  # sentences, documents, tokens, unknown pieces (<unk>)
        self.open_sentences = 0  # of the document not yet ended (it may span flushes)

    def add(self, item: str | None) -> None:
        self.items.append(item)
        if len(self.items) >= 10_000 and item is not None:
            self.flush()

    def flush(self) -> None:
        items = self.items
        ids = iter(self.sp.encode([t for t in items if t is not None], num_threads=1))
        seqs, doc_ends, before = [], [], len(self.lengths)
        for t in items:
            if t is None:  # fairseq's empty line: a lone </s> between documents
                if self.open_sentences:  # (a document all of whose lines encode to nothing is none)
                    seqs.append([EOS_ID])
                    doc_ends.append(before + len(seqs))
                self.open_sentences = 0
            else:  # fairseq's line: its pieces and </s>
                pieces = next(ids)
                # A line of characters the tokenizer drops (U+200B, U+FEFF, controls) adds nothing:
                # stored as a lone </s>, it would read as a document's end
                if pieces:
                    seqs.append(pieces + [EOS_ID])
                    self.open_sentences += 1
        flat = np.fromiter((t for q in seqs for t in q), dtype=self.dtype)
        self.data.write(flat.tobytes(order="C"))
        self.lengths.extend(len(q) for q in seqs)
        self.doc_ends.extend(doc_ends)
        self.counts[0] += len(seqs) - len(doc_ends)
        self.counts[1] += len(doc_ends)
        self.counts[2] += len(flat)
        self.counts[3] += int(np.count_nonzero(flat == UNK_ID))
        items.clear()

    def finalize(self) -> list[int]:
        self.flush()
        self.data.close()
        lengths, doc_ends = np.frombuffer(self.lengths, np.int32), np.frombuffer(self.doc_ends, np.int64)
        write_index(self.prefix + ".idx", np.dtype(self.dtype).type, [(lengths, doc_ends)])
        return self.counts


def is_validation_document(first_line: str, fraction: float, seed: int) -> bool:
    """Held out by a seeded hash of the document's first line: the same split whichever worker
    reads the document (and whatever the number of workers), and a document repeated in the
    corpus (web crawls repeat many) on the side of its copies, never both; documents that merely
    begin alike go together too (prepare's refusals say so)."""
    if fraction <= 0:
        return False
    import zlib

    return _mix64(seed ^ zlib.crc32(first_line.encode("utf-8"))) < fraction * 2.0**64


def _encode_range(job: tuple) -> tuple[list[int], list[int]]:
    """Worker: encode the documents in bytes [start, end) of the corpus (both document starts)
    into the indexed datasets `prefix` and `prefix`.valid (.bin/.idx).
    -> (sentences, documents, tokens, unknown pieces) of each."""
    corpus, start, end, tokenizer, prefix, dtype, valid_fraction, seed = job
    sp = load(tokenizer)
    train, valid = _Shard(prefix, dtype, sp), _Shard(prefix + ".valid", dtype, sp)
    shard = None  # where the open document goes; None: no document is open
    with open(corpus, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            raw = f.readline()
            if not raw:
                break
            try:
                # a byte-order mark is no text (bpb.heldout_lines reads it so): a byte-fallback tokenizer
                # encoded it as 3 pieces, and it entered the first document's held-out draw
                text = line_text(raw, first=pos == 0)
            except UnicodeDecodeError as e:
                raise DataError(f"corpus {corpus} is not UTF-8: byte {pos + e.start} (in the line starting at "
                                f"byte {pos}) is invalid; convert it to UTF-8 first (e.g. with iconv)") from None
            pos += len(raw)
            if not text:
                if shard is not None:
                    shard.add(None)
                shard = None
                continue
            if shard is None:
                shard = valid if is_validation_document(text, valid_fraction, seed) else train
            shard.add(text)
    if shard is not None:  # the last document of the corpus (no blank line after it)
        shard.add(None)
    return train.finalize(), valid.finalize()


INDEX_CHUNK = 1 << 22  # sentences write_index holds at once: 64 MiB of lengths and pointers


def write_index(idx_path: str, dtype, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """megatron-core's .idx (indexed_dataset._IndexWriter's bytes, no sequence modes) of the
    sentences of `parts` in order, each (its sentence lengths [n_i] int32, its document ends
    [d_i + 1] int64 from its own 0, as IndexedDatasetBuilder counts them), written INDEX_CHUNK
    sentences at a time: memory is a chunk's, not the dataset's (megatron's writer builds a
    Python int per sentence pointer, and holds every length: ~90 bytes a sentence, 12 GB per
    100 GB of text). Arrays may be memory maps of shards (_merge): they are read, never loaded."""
    import struct

    from mmadapt.mcore import indexed_dataset

    size = indexed_dataset.DType.size(dtype)

    def chunks(a: np.ndarray):
        for i in range(0, len(a), INDEX_CHUNK):
            yield a[i:i + INDEX_CHUNK]

    with open(idx_path, "wb") as f:
        f.write(indexed_dataset._INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", indexed_dataset.DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", sum(len(lengths) for lengths, _ in parts)))
        f.write(struct.pack("<Q", 1 + sum(len(ends) - 1 for _, ends in parts)))
        for lengths, _ in parts:
            for c in chunks(lengths):
                f.write(np.asarray(c, np.int32).tobytes())
        start = 0  # the byte each sentence starts at in the .bin
        for lengths, _ in parts:
            for c in chunks(lengths):
                ends = np.cumsum(c, dtype=np.int64) * size + start
                f.write((ends - np.asarray(c, np.int64) * size).tobytes())
                start = int(ends[-1]) if len(ends) else start
        f.write(np.zeros(1, np.int64).tobytes())
        sentences = 0
        for lengths, ends in parts:
            for c in chunks(ends[1:]):
                f.write((np.asarray(c, np.int64) + sentences).tobytes())
            sentences += len(lengths)


def _merge(prefixes: list[str], out_prefix: str, dtype) -> None:
    """Concatenate shard datasets in order into `out_prefix` (megatron's format)."""
    from mmadapt.mcore import indexed_dataset

    with open(out_prefix + ".bin", "wb") as out:
        for prefix in prefixes:
            with open(prefix + ".bin", "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    indexes = [indexed_dataset._IndexReader(prefix + ".idx", multimodal=False) for prefix in prefixes]
    write_index(out_prefix + ".idx", np.dtype(dtype).type,
                [(index.sequence_lengths, index.document_indices) for index in indexes])
    del indexes


def follows_byte_fallback(out_dir: Path, source_tokenizer: Path, vocab_mode: str) -> bool:
    """PreprocessConfig.byte_fallback of the target corpus a Step-2 run (adapt, a sweep, extend)
    prepares into `out_dir` over a source with the tokenizer `source_tokenizer`: none under
    --vocab_mode expand (the merged vocabulary is the source's kind, its byte fallback the
    source's own); what a dataset already there was prepared with (a stopped run's own, resumed:
    one made before the setting existed has none); else the source's (has_byte_fallback), so that
    the new vocabulary reads any text the source reads."""
    if vocab_mode == "expand":
        return False
    if (out_dir / MANIFEST).is_file():
        return bool(read_manifest(out_dir).get("byte_fallback"))
    return has_byte_fallback(source_tokenizer)


def read_manifest(data_path: str | os.PathLike) -> dict:
    """The manifest of a finished prepared dataset (DataError if there is none)."""
    data_path = Path(data_path)
    if data_path.is_file():
        raise DataError(f"{data_path} is a file, not a dataset prepared by mmadapt preprocess: prepare it first "
                        f"(mmadapt preprocess --corpus {data_path} --output_dir <a new directory>, with the "
                        "tokenizer the run reads) and pass that directory")
    if data_path.parts[0].startswith("bible:") and len(data_path.parts) == 1 and not data_path.exists():
        # a corpus spec, bible:<lang>, not a directory to make
        raise DataError(f"{data_path} is a corpus, not a dataset prepared by mmadapt preprocess: prepare it first "
                        f"(mmadapt preprocess --corpus {data_path} --output_dir <a new directory> --valid_fraction "
                        "0.03, with the tokenizer the run reads) and pass that directory")
    if not (data_path / MANIFEST).is_file():
        what = ("does not exist" if not data_path.exists() else "holds no finished dataset (no manifest.json: "
            "its preparation did not finish)")
        raise DataError(f"prepared dataset {data_path} {what}: run `mmadapt preprocess --corpus <text> "
                        f"--output_dir {data_path}`")
    try:
        manifest = json.loads((data_path / MANIFEST).read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # a bare "Expecting value", naming neither the file nor a fix
        raise DataError(f"{data_path / MANIFEST} is not valid JSON ({str(e).splitlines()[0][:120]}): prepare the "
                        "dataset again into a new directory") from None
    missing = ([k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict)
               else [f"a JSON object, not a {type(manifest).__name__}"])
    if missing:  # each reader indexed it and failed with a KeyError or AttributeError traceback
        raise DataError(f"{data_path / MANIFEST} is not a prepared dataset's manifest (it lacks {', '.join(missing)}): "
                        "prepare the dataset again into a new directory")
    for f in (TEXT + ".bin", TEXT + ".idx", TOKENIZER):
        if not (data_path / f).is_file():
            raise DataError(f"prepared dataset {data_path} lacks {f}: prepare it again into a new directory")
    return manifest


def check_prepared(data_path: str | os.PathLike, vocab_size: int | None = None,
                   tokenizer: str | os.PathLike | None = None, manifest: dict | None = None) -> dict:
    """Refuse a prepared dataset that does not fit the run: its token file is not the size its
    manifest says or its tokenizer file is not the one it was encoded with (a copy cut short, a
    file replaced by hand: the blocks would be read past the file's end, or in another
    tokenizer's ids), its corpus changed since it was prepared, its tokenizer is not
    `tokenizer`, or its vocabulary is not the model's. -> its manifest (`manifest`: read already)."""
    data_path = Path(data_path)
    manifest = manifest or read_manifest(data_path)
    # every split the manifest counts (the held-out one is written last: a copy cut short loses it first)
    for name, tokens in ((TEXT, manifest["tokens"]), (VALID, (manifest.get("valid") or {}).get("tokens"))):
        if tokens is None:
            continue
        for f in (name + ".bin", name + ".idx"):
            if not (data_path / f).is_file():
                raise DataError(f"prepared dataset {data_path} lacks {f}: prepare it again into a new directory")
        split, want = data_path / (name + ".bin"), tokens * np.dtype(manifest["dtype"]).itemsize
        if split.stat().st_size != want:
            raise DataError(f"{split} holds {split.stat().st_size:,} bytes where the {tokens:,} tokens its "
                            f"manifest counts take {want:,}: it was cut short or replaced; prepare the dataset again "
                            "(mmadapt preprocess) into a new --output_dir")
    if file_sha256(data_path / TOKENIZER) != manifest["tokenizer_sha256"]:
        raise DataError(f"{data_path / TOKENIZER} is not the tokenizer {data_path} was encoded with (its sha256 is "
                        "not the manifest's): it was replaced; put the original back, or prepare the dataset again "
                        "into a new --output_dir")
    corpus = Path(manifest["corpus"])
    if corpus.is_file() and corpus_fingerprint(corpus) != manifest["corpus_fingerprint"]:
        raise DataError(f"corpus {corpus} changed since {data_path} was prepared from it: prepare it again "
                        "(mmadapt preprocess) into a new --output_dir")
    if tokenizer is not None and not Path(tokenizer).is_file():
        read_tokenizer(tokenizer)  # one line: a --tokenizer that does not exist (it was dropped unsaid)
    if tokenizer is not None and file_sha256(tokenizer) != manifest["tokenizer_sha256"]:
        raise DataError(f"{data_path} was encoded with another tokenizer ({data_path / TOKENIZER}) than the run's "
                        f"{tokenizer}: pass a dataset prepared with the run's (mmadapt preprocess --tokenizer "
                        f"{tokenizer}; where the command took a --tokenizer, dropping it lets the run take the "
                        "dataset's)")
    if vocab_size is not None and manifest["vocab_size"] != vocab_size:
        raise DataError(f"{data_path} was encoded with a {manifest['vocab_size']}-piece tokenizer but the "
                        f"model's vocab_size is {vocab_size}: pass --vocab_size {manifest['vocab_size']}")
    return manifest


# The share of a text's pieces (its sentences' </s> left out) that its tokenizer reads as <unk>
# above which a step says so, and above which it refuses the text. Measured on Genesis: a
# 2,000-piece SentencePiece model trained on the English text leaves 0.19% of its pieces <unk>
# there (character_coverage 0.9995), and 45% of the Russian text's (each Cyrillic word "▁" and
# one <unk>: a script the tokenizer does not cover shows as about half, never all, of the pieces).
# Trained on such a text, a model learns nothing of it and fails late (a head fit "diverges").
UNKNOWN_WARN, UNKNOWN_REFUSE = 0.02, 0.25


def check_coverage(corpus: Path, tokenizer: str | os.PathLike, counts: list[list[int]],
                   trained: bool = False) -> float:
    """Refuse a text whose tokenizer (`tokenizer`: as the user knows it; `trained`: on a sample of
    this text, by the call) reads more than UNKNOWN_REFUSE of its pieces as <unk>; say so
    above UNKNOWN_WARN (on stderr, quiet or not). counts: per shard (sentences, documents, tokens,
    unknown), tokens holding one </s> per sentence and per document end. -> the share."""
    unknown = sum(c[3] for c in counts)
    pieces = sum(c[2] - c[0] - c[1] for c in counts)
    share = unknown / pieces if pieces else 0.0
    if share > UNKNOWN_REFUSE:
        fix = (f"the sample of its lines it was trained on lacks that text: split lines longer than "
               f"{SP_MAX_SENTENCE_BYTES} bytes (SentencePiece skips them), or raise --tokenizer_sample_lines"
               if trained else "pass text in a language it was made for, or prepare this one with a tokenizer trained "
               "on it (preprocess --vocab_size N, no --tokenizer)")
        raise DataError(f"{share:.0%} of the pieces of {corpus} are unknown to the tokenizer {tokenizer} ({unknown:,} "
                        f"<unk> of {pieces:,}): it does not cover this text's script; {fix}")
    if share > UNKNOWN_WARN:
        print(f"warning: {share:.1%} of the pieces of {corpus} are unknown to the tokenizer ({unknown:,} <unk>): the "
              "model learns nothing of them", file=sys.stderr)
    return share


def sample_unknown_share(corpus: Path, tokenizer: Path, lines: int = 2_000) -> float:
    """The share of the pieces of `corpus`'s first `lines` non-blank lines (their </s> left out)
    that `tokenizer` reads as <unk>: check_coverage's measure on a sample, for a step that must
    refuse a text of another script before it prepares the whole (a script the tokenizer does not
    cover shows in any sample)."""
    sample = []
    with open(corpus, encoding="utf-8-sig", errors="replace") as f:
        for raw in f:
            if raw.strip():
                sample.append(raw.strip())
            if len(sample) >= lines:
                break
    ids = load(tokenizer).encode(sample, num_threads=1) if sample else []
    pieces = sum(map(len, ids))
    return sum(i.count(UNK_ID) for i in ids) / pieces if pieces else 0.0


def _links(path: Path) -> list[Path]:
    """`path` (absolute) and each link it leads through to the file, in order."""
    chain = [Path(os.path.abspath(path))]
    while chain[-1].is_symlink() and len(chain) < 40:  # (a loop of links: open() refuses it later)
        chain.append(Path(os.path.abspath(chain[-1].parent / os.readlink(chain[-1]))))
    return chain


def no_text(corpus) -> DataError:
    """A corpus whose every line a tokenizer reads as nothing: blanks str.isspace does not know and
    invisible characters (zero-width spaces), which SentencePiece's normalization drops."""
    return DataError(f"corpus {corpus} holds no character a tokenizer keeps (only blanks and invisible ones, such as "
                     "zero-width spaces, which SentencePiece's normalization drops): pass a file of text")


def _dataset_entry(name: str) -> bool:
    """A file a preparation (finished or stopped) writes in its directory (a tokenizer killed while
    training leaves train_tokenizer's tokenizer.tmp<pid>.model, .vocab and .sample). Of the hidden names,
    only its own: the encoding's shards (.shards<pid>) and the temporaries of its atomic writes
    (.<name>.tmp<pid>[.npy|.bin]); a .git or .DS_Store there is somebody's, and a stopped
    preparation's clean-up removes every entry this matches."""
    return (name in (TOKENIZER, MANIFEST, *(s + e for s in (TEXT, VALID) for e in (".bin", ".idx")))
            or re.fullmatch(rf"\.shards\d+|{WRITE_TEMPORARY}(\.npy|\.bin)?", name) is not None
            or re.fullmatch(rf"({VALID}_)?blocks_s\d+\.npy", name) is not None  # block_index_path
            or re.fullmatch(rf"({TEXT}|{VALID})_layout_[0-9a-f]{{16}}\.(bin|json)", name) is not None  # layout_stream
            or re.fullmatch(re.escape(Path(TOKENIZER).stem) + r"\.tmp\d+\.(model|vocab|sample)", name) is not None)


def check_own_tokenizer_kept(out_dir: str | os.PathLike, tokenizer: str | os.PathLike | None,
                             merged: bool = False) -> None:
    """Refuse to prepare into `out_dir` over a tokenizer.model someone put there (mmadapt
    preprocess): one with no dataset beside it (no manifest, and no trace of a stopped preparation,
    which prepare leaves from before its tokenizer lands: its .shards<pid>) that `tokenizer` does
    not name. prepare would train a new one over it or copy `tokenizer` onto it, and a refusal
    then deleted it. merged: the tokenizer prepare copies in is one made from `tokenizer` (an
    expansion's), so even the directory's own is replaced."""
    out_dir = Path(out_dir)
    tok = out_dir / TOKENIZER
    if not tok.is_file() or any(e.name != TOKENIZER and _dataset_entry(e.name) for e in out_dir.iterdir()):
        return
    if tokenizer is not None and not merged and os.path.samefile(tokenizer, tok):
        return
    fix = ("move it out of the directory or choose another --output_dir" if merged else
           f"pass --tokenizer {tok} to encode the corpus with it, or move it out of the directory")
    raise DataError(f"--output_dir {out_dir} holds a {TOKENIZER} but no prepared dataset, which this preparation "
                    f"would replace: {fix} (nothing was changed)")


def prepare(corpus: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int | None,
            tokenizer: str | os.PathLike | None = None, cfg: PreprocessConfig = PreprocessConfig(),
            quiet: bool = False, named: str | None = None, target_trained: bool = False) -> dict:
    """Prepare `corpus` once: train a `vocab_size`-piece SentencePiece model on a seeded sample of at
    most cfg.tokenizer_sample_lines lines, or copy `tokenizer` (`named`: how messages name it where it
    is a file the caller built, an expansion's; `target_trained`: that expansion's target tokenizer
    was trained on a sample of this corpus, as this call would have; vocab_size None: its size; another
    size is refused), encode with cfg.workers processes
    (default: the CPU count) into megatron's indexed dataset (cfg.valid_fraction of the documents
    into a validation set beside it), write the manifest last. A no-op (said so) when `out_dir`
    already holds this corpus prepared with this tokenizer and split. -> the manifest."""
    corpus, out_dir = check_corpus(corpus), Path(out_dir)
    valid_fraction, seed = cfg.valid_fraction, cfg.tokenizer_seed
    workers = (os.cpu_count() or 1) if cfg.workers is None else cfg.workers  # cfg's ranges: config.check_declared
    threads = (os.cpu_count() or 1) if cfg.tokenizer_threads is None else cfg.tokenizer_threads
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--output_dir {out_dir} is a file, not a directory: choose a directory for the dataset")
    # named as a dataset file (text.bin), the clean-up deleted it; a link there (of a chain), the link
    where = out_dir.resolve()
    if any(where == d or where in d.parents for d in (*(link.parent.resolve() for link in _links(corpus)),
                                                       corpus.resolve().parent)):
        raise DataError(f"corpus {corpus} is inside --output_dir {out_dir}, where the dataset is written: move the "
                        "corpus out of it, or choose another --output_dir (nothing was changed)")
    if not (out_dir / MANIFEST).is_file():
        refuse_other_files(out_dir, _dataset_entry, "prepared dataset")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    shown = named or tokenizer  # (the tokenizer copied into out_dir is gone once a refusal cleans up)
    if tokenizer is not None:
        vocab_size = load_checked_tokenizer(tokenizer, vocab_size).get_piece_size()
        unread = [] if is_hf(tokenizer) else unexportable(sp_proto(tokenizer))
        if unread:  # the runs train and score with it; only their Hugging Face export is refused
            fix = ("the expansion keeps the kind of the run's tokenizer: to export, expand a run whose tokenizer "
                   "mmadapt trained" if named else
                   "to export, prepare with a tokenizer mmadapt trains (no --tokenizer)")
            say(f"note: {shown} was trained with {', '.join(unread)}: runs on this data train and score, but "
                f"mmadapt export-hf will refuse them (its tokenizer would read text otherwise); {fix}")
    elif vocab_size is None:
        raise DataError("a vocabulary size is needed to train a tokenizer: pass --vocab_size (or --tokenizer)")
    fingerprint = corpus_fingerprint(corpus)
    if (out_dir / MANIFEST).is_file():
        old = read_manifest(out_dir)
        seeded = tokenizer is None or valid_fraction > 0  # the seed trains the tokenizer, or draws the split
        old_seed = old.get("valid_seed", PreprocessConfig.tokenizer_seed)
        old_fraction = old.get("valid_fraction", 0.0)
        # what differs, in this order, named (each test is made only if those before it pass)
        differs = (
            (lambda: old["corpus"] != str(corpus.resolve()), lambda: f"from {old['corpus']}, not {corpus.resolve()}"),
            (lambda: old["corpus_fingerprint"] != fingerprint,
             lambda: f"from {corpus} as it was: its content changed since"),
            (lambda: old["vocab_size"] != vocab_size, lambda: f"at {old['vocab_size']} pieces, not {vocab_size}"),
            (lambda: tokenizer is not None and old["tokenizer_sha256"] != file_sha256(tokenizer),
             lambda: f"with another tokenizer than {shown}"),
            (lambda: tokenizer is None and bool(old.get("byte_fallback")) != cfg.byte_fallback,
             lambda: f"{'without' if cfg.byte_fallback else 'with'} byte fallback, not "
                     f"{'with' if cfg.byte_fallback else 'without'} (--byte_fallback)"),
            (lambda: old_fraction != valid_fraction,
             lambda: f"with --valid_fraction {old_fraction}, not {valid_fraction}"),
            (lambda: seeded and old_seed != seed, lambda: f"with --tokenizer_seed {old_seed}, not {seed}"),
            (lambda: tokenizer is None and not _same_sample(old, cfg.tokenizer_sample_lines, corpus),
             lambda: f"with --tokenizer_sample_lines {old['tokenizer_sample_lines']}, "
                     f"not {cfg.tokenizer_sample_lines}"),
            # threads asked for: a tokenizer trained with others (the default, another machine's
            # CPU count, is not compared: the dataset as it stands serves it)
            (lambda: tokenizer is None and cfg.tokenizer_threads not in (None, old.get("tokenizer_threads")),
             lambda: f"with --tokenizer_threads {old['tokenizer_threads']}, not {cfg.tokenizer_threads}"
             if old.get("tokenizer_threads") is not None else  # (a call without --tokenizer reuses it as it is)
             f"with a tokenizer given to it (--tokenizer), not one trained with --tokenizer_threads "
             f"{cfg.tokenizer_threads}"))
        why = next((say_it() for test, say_it in differs if test()), None)
        if why is not None:
            raise DataError(f"{out_dir} already holds a dataset prepared {why}: choose a new --output_dir (nothing "
                            "was overwritten)")
        say(f"{out_dir} already holds {corpus} prepared with this tokenizer: nothing to do")
        return old
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = out_dir / TOKENIZER
    # This preparation's trace (.shards<pid>) is made before it looks for another's: of two started
    # at once, one sees the other (each looked first, then made its own: both went on, and each
    # one's clean-up below could remove the other's shards). Made before the tokenizer lands
    # (_encode_into fills it): a preparation stopped after that leaves it beside the tokenizer,
    # which tells its tokenizer from one put there by hand (check_own_tokenizer_kept).
    own = out_dir / f".shards{os.getpid()}"
    own.mkdir(exist_ok=True)
    try:
        _refuse_live_preparation(out_dir)
    except DataError:
        own.rmdir()
        if created:  # unless another's trace is in it by now (a removal of the tree removed that)
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    # What a preparation here left without finishing (no manifest): the indexes derived from its
    # text (a block index is keyed by seq_length alone, and would be read over the new text) and a
    # killed run's shards (a live one's stay: this one's, and one started since). Its tokenizer is
    # replaced below.
    _remove_encoded(out_dir, keep_live=True)
    # what a preparation killed while its tokenizer trained left (train_tokenizer's files, its pid's)
    for stale in out_dir.glob(f"{tok.stem}.tmp*"):
        if _dataset_entry(stale.name):
            stale.unlink()
    t0 = time.perf_counter()
    # --tokenizer may be the directory's own tokenizer.model (put there first, or a stopped
    # preparation's): it is then used in place, and a refusal below leaves it where it was
    given_here = tokenizer is not None and tok.is_file() and os.path.samefile(tokenizer, tok)
    try:
        if tokenizer is not None:
            if not given_here:
                shutil.copyfile(tokenizer, tok)
        else:
            say(f"training a {vocab_size}-piece SentencePiece model on up to {cfg.tokenizer_sample_lines:,} sampled "
                "lines")
            train_tokenizer(corpus, tok.with_suffix(""), vocab_size, seed=seed, max_sentences=cfg.tokenizer_sample_lines,
                            threads=threads, byte_fallback=cfg.byte_fallback)
            tok.with_suffix(".vocab").unlink(missing_ok=True)
    except DataError:  # refused before this call put a tokenizer there: a directory it made, or its shards
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            _remove_encoded(out_dir)
        raise
    try:
        return _encode_into(out_dir, tok, corpus, fingerprint, vocab_size, cfg, workers, say,
                            threads if tokenizer is None else None, time.perf_counter() - t0, shown,
                            target_trained)
    except DataError:  # refused: what this call wrote goes (a directory it made; else the tokenizer it put
        if created:    # there and the encoded text: a split that held out every document had written it)
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            _remove_encoded(out_dir)
            if not given_here:
                tok.unlink(missing_ok=True)
        raise


def _refuse_live_preparation(out_dir: Path) -> None:
    """Refuse to prepare into `out_dir` while another process on this host prepares there (its
    `.shards<pid>`, made before its tokenizer trains, and its pid running): the clean-up of what a
    stopped preparation left removed the live one's shards, and it failed with a raw OSError."""
    if not out_dir.is_dir():
        return
    for entry in out_dir.iterdir():
        m = re.fullmatch(r"\.shards(\d+)", entry.name)
        if m and int(m.group(1)) != os.getpid() and pid_alive(int(m.group(1))):
            raise DataError(f"{out_dir} is being prepared by process {m.group(1)}: wait for it to finish, or choose "
                            f"another --output_dir (if no such preparation runs, delete {entry})")


def _remove_encoded(out_dir: Path, keep_live: bool = False) -> None:
    """Every entry of a preparation in `out_dir` but its tokenizer and manifest: the encoded text
    and split, indexes derived from them, shards, temporaries (_dataset_entry). keep_live: but
    the shards of a process that runs (`.shards<pid>`: this one's, or another's started since it
    looked: that one refuses, seeing this one's)."""
    for entry in out_dir.iterdir():
        live = keep_live and (m := re.fullmatch(r"\.shards(\d+)", entry.name)) and pid_alive(int(m.group(1)))
        if entry.name not in (TOKENIZER, MANIFEST) and _dataset_entry(entry.name) and not live:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _same_sample(manifest: dict, lines: int, corpus: Path) -> bool:
    """Whether a tokenizer trained on `corpus` with a sample of at most `lines` lines is the one
    `manifest` records (the same corpus, seed and size): the same sample size, or two that both
    reach past the corpus's every sentence (SentencePiece then samples nothing: it trains on all
    of them). A sentence is a line as SentencePiece loads one (_sentences). A manifest that records
    no sample size (written before it did, or for a tokenizer given with --tokenizer, which a call
    without one reuses) is not compared."""
    old = manifest.get("tokenizer_sample_lines")
    if old is None or old == lines:
        return True
    with open(corpus, "rb") as f:  # counted no further than needed: is there a sentence past the smaller size?
        return next(itertools.islice(_sentences(f), min(old, lines), None), None) is None


def _encode_into(out_dir: Path, tok: Path, corpus: Path, fingerprint: dict, vocab_size: int | None,
                 cfg: PreprocessConfig, workers: int, say, threads: int | None, t_tok: float,
                 shown: str | os.PathLike | None = None, target_trained: bool = False) -> dict:
    """`prepare`'s encoding, once its tokenizer is at `tok` in `out_dir` (`threads`: trained here
    with that many, on a sample of cfg.tokenizer_sample_lines lines; None: copied; `t_tok`: the
    seconds it took; `shown`, `target_trained`: a copied one as the user named it, and whether it was
    trained on a sample of this corpus all the same, prepare's): the text and its validation split
    encoded, the manifest written last. -> the manifest."""
    valid_fraction, seed = cfg.valid_fraction, cfg.tokenizer_seed
    sp = load_checked_tokenizer(tok, vocab_size)
    dtype = np.dtype(np.uint16 if sp.get_piece_size() <= UINT16_MAX_PIECES else np.int32).name
    # More ranges than workers so that uneven documents still balance; any split gives the same bytes.
    size = fingerprint["size"]
    n_ranges = max(1, min(4 * workers, size // (64 << 10)))
    with open(corpus, "rb") as f:
        # in order, each from past the last boundary found: a target before it has that boundary
        # (no document starts between), so every byte is read once, where a corpus with few blank
        # lines had every target scan to the end of the file (128 ranges of 22 MB: 5 s; of 100 GB, hours)
        found, last = {size}, 0
        for i in range(n_ranges):
            if i * size // n_ranges < last:
                continue
            last = _doc_boundary(f, i * size // n_ranges, size)
            found.add(last)
        cuts = sorted(found)
    if workers > 1 and len(cuts) - 1 < min(workers, n_ranges) and size > 64 << 20:
        say(f"note: {corpus} has {len(cuts) - 1} document start(s) to cut it at: {len(cuts) - 1} worker(s) encode it; "
            "separate its documents by blank lines to encode in parallel")
    shard_dir = out_dir / f".shards{os.getpid()}"
    shard_dir.mkdir(exist_ok=True)
    jobs = [(str(corpus), a, b, str(tok), str(shard_dir / f"{i:05d}"), dtype, valid_fraction, seed)
            for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a]
    say(f"encoding {size / 1e6:.1f} MB in {len(jobs)} ranges with {workers} worker(s)")
    t1 = time.perf_counter()
    # The objects that exist now (torch, megatron: a large heap) leave the garbage collector's
    # sight while the encoder allocates millions of small lists: rescanning them cost a third of
    # the encoding time. Frozen before forking, so workers do not copy the heap to freeze it.
    # A command's process froze its imports already (cli.run_process): that freeze outlives this one.
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    stopped = False
    try:
        if workers == 1 or len(jobs) == 1:
            counts = [_encode_range(j) for j in jobs]
        else:
            with mp.get_context("fork").Pool(min(workers, len(jobs))) as pool:
                counts = pool.map(_encode_range, jobs, chunksize=1)
        # (a tokenizer trained here is named as asked for: the refusal removes the file)
        check_coverage(corpus, shown or f"trained on it ({sp.get_piece_size()} pieces, --vocab_size)",
                       [c[0] for c in counts] + [c[1] for c in counts], trained=threads is not None or target_trained)
        _merge([j[4] for j in jobs], str(out_dir / TEXT), dtype)
        if valid_fraction > 0:
            _merge([j[4] + ".valid" for j in jobs], str(out_dir / VALID), dtype)
    except DataError:  # refused: prepare removes what it wrote, its tokenizer too
        raise
    except BaseException:
        stopped = True
        raise
    finally:  # a failed preparation leaves no shards behind (and no manifest: not a dataset)
        if not frozen_before:
            gc.unfreeze()
        shutil.rmtree(shard_dir, ignore_errors=True)
        if stopped:  # Ctrl-C, a full disk: its tokenizer stays, and beside it the trace that says a stopped
            shard_dir.mkdir(exist_ok=True)  # preparation put it there (check_own_tokenizer_kept): the same
            # command again prepares anew, where it was refused as over a tokenizer put there by hand
    valid_counts = [int(sum(c[1][k] for c in counts)) for k in range(4)]  # sentences, documents, tokens, <unk>
    unknown = int(sum(c[0][3] for c in counts)) + valid_counts[3]  # the whole text's, as check_coverage reads it
    t_enc = time.perf_counter() - t1
    sentences, documents, tokens = (int(sum(c[0][k] for c in counts)) for k in range(3))
    if sentences == 0 and valid_counts[0]:
        raise DataError(f"--valid_fraction {valid_fraction} held out every document of {corpus} "
                        f"({valid_counts[1]:,} of them): lower it, or give the corpus more documents (a document "
                        "ends at a blank line; documents that begin with the same line are held out together)")
    if sentences == 0:  # every line encoded to no piece
        raise no_text(corpus)
    if valid_fraction > 0 and valid_counts[0] == 0:
        raise NothingHeldOut(f"--valid_fraction {valid_fraction} held out none of the {documents:,} documents of "
                             f"{corpus} (a document ends at a blank line; documents that begin with the same line "
                             "are held out together): raise it, or give the corpus more documents",
                             documents)
    if corpus_fingerprint(corpus) != fingerprint:  # edited while the tokenizer trained or the text was encoded
        raise DataError(f"corpus {corpus} changed while it was prepared: the tokens would not be the text its "
                        "manifest records; run the command again once the file stays as it is")
    manifest = {"format": FORMAT, "corpus": str(corpus.resolve()), "corpus_fingerprint": fingerprint,
                "tokenizer_sha256": file_sha256(tok), "vocab_size": sp.get_piece_size(), "dtype": dtype,
                "sentences": sentences, "documents": documents, "tokens": tokens, "unknown": unknown,
                "valid_fraction": valid_fraction, "valid_seed": seed,
                "tokenizer_sample_lines": None if threads is None else cfg.tokenizer_sample_lines,
                "tokenizer_threads": threads,  # None: a tokenizer given (--tokenizer), not trained here
                "byte_fallback": None if threads is None else cfg.byte_fallback,
                # `unknown` above counts both splits (the text the coverage check read); the held-out split's own here
                "valid": (dict(zip(("sentences", "documents", "tokens", "unknown"), valid_counts))
                          if valid_fraction > 0 else None),
                "mmadapt_version": __version__}
    tmp = out_dir / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out_dir / MANIFEST)
    say(f"prepared {out_dir}: {sentences:,} sentences in {documents:,} documents, {tokens:,} tokens "
        f"(tokenizer {t_tok:.1f} s, encoding {t_enc:.1f} s, {size / 1e6 / max(t_enc, 1e-9):.1f} MB/s)")
    return manifest


def pack_blocks(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """FULL-SENTENCES blocks over sequences of `lengths` tokens stored back to back: each block is
    the longest run of whole sequences that fits seq_length - 1 tokens (room for `<s>`); a longer
    sequence is split into pieces of that size. -> [n, 2] int64 (token offset, length)."""
    cap = seq_length - 1
    lengths = np.asarray(lengths, dtype=np.int64)
    cum = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    out = np.empty((max(16, int(cum[-1]) // max(1, cap) * 2 + len(lengths) // 64 + 16), 2), dtype=np.int64)
    n, i, total = 0, 0, len(lengths)
    while i < total:
        if lengths[i] > cap:  # split a long sentence
            pieces = np.arange(cum[i], cum[i + 1], cap)
            if n + len(pieces) > len(out):
                out = np.resize(out, (2 * (n + len(pieces)), 2))
            out[n:n + len(pieces), 0] = pieces
            out[n:n + len(pieces), 1] = np.minimum(cap, cum[i + 1] - pieces)
            n, i = n + len(pieces), i + 1
            continue
        j = int(np.searchsorted(cum, cum[i] + cap, side="right")) - 1  # sequences i..j-1 fit
        if n == len(out):
            out = np.resize(out, (2 * n, 2))
        out[n] = cum[i], cum[j] - cum[i]
        n, i = n + 1, j
    return out[:n].copy()


def block_index_path(data_path: Path, seq_length: int, split: str = TEXT) -> Path:
    return Path(data_path) / f"{'blocks' if split == TEXT else split + '_blocks'}_s{seq_length}.npy"


def block_index(data_path: str | os.PathLike, seq_length: int, split: str = TEXT) -> Path | None:
    """The cached block index of a prepared dataset's `split` (TEXT or VALID) for `seq_length`
    (built once, atomically); None where none is built and the dataset's directory cannot be
    written (a shared read-only copy): its readers pack the blocks in memory (read_blocks)."""
    data_path = Path(data_path)
    path = block_index_path(data_path, seq_length, split)
    if not path.is_file():
        if not os.access(data_path, os.W_OK):
            return None
        tmp = write_temporary(path.with_suffix(""), ".npy")  # a killed run's goes at the next build
        np.save(tmp, _packed(data_path, seq_length, split))
        os.replace(tmp, path)
    return path


def read_blocks(data_path: str | os.PathLike, seq_length: int, split: str = TEXT) -> np.ndarray:
    """The blocks of block_index [n, 2]: its file, memory-mapped, or, in a dataset directory this
    process cannot write, packed in its own memory (a pass over the sentence lengths)."""
    path = block_index(data_path, seq_length, split)
    return np.load(path, mmap_mode="r") if path is not None else _packed(Path(data_path), seq_length, split)


def _packed(data_path: Path, seq_length: int, split: str) -> np.ndarray:
    from mmadapt.mcore import indexed_dataset  # imports all of megatron.core

    index = indexed_dataset._IndexReader(str(data_path / (split + ".idx")), multimodal=False)
    return pack_blocks(index.sequence_lengths, seq_length)


def wait_for(path: Path, what: str, poll_s: float = 0.25) -> None:
    """Wait until `path`, which global rank 0 wrote (parallel.rank0_prepares), shows in this rank's
    view of the shared file system (another node's can lag: NFS caches a name's absence), saying
    why. No collective: the ranks' next one comes under MMADAPT_DIST_TIMEOUT_S, and a short poll
    (a stat call) keeps this rank from arriving there up to a whole poll after rank 0."""
    if path.exists():
        return
    print(f"rank {os.environ.get('RANK', '?')}: waiting for {what}, which rank 0 prepared, to show here",
          file=sys.stderr, flush=True)
    while not path.exists():
        time.sleep(poll_s)


def mask_tokens(block: np.ndarray, rng: np.random.Generator, vocab_size: int, mask_prob: float):
    """BERT/RoBERTa masking of one block: select p of the ordinary tokens; of those, 80% become
    <mask>, 10% a random ordinary token, 10% stay. Returns (input_ids, labels); labels are
    IGNORE_INDEX except at selected positions. At least one position is selected where the block
    has an ordinary token; one that has none (pack_blocks' last piece of a sentence exactly k
    blocks long is its lone </s>) scores nothing: layers.head_losses gives a micro-batch of such
    blocks a zero loss."""
    ids = block.astype(np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    candidates = np.flatnonzero(ids >= NUM_SPECIAL)
    if len(candidates) == 0:
        return ids, labels
    n = min(len(candidates), max(1, int(mask_prob * len(candidates) + rng.random())))
    chosen = np.sort(rng.choice(candidates, n, replace=False))
    labels[chosen] = ids[chosen]
    u = rng.random(n)
    ids[chosen[u < 0.8]] = MASK_ID
    random_pos = chosen[(u >= 0.8) & (u < 0.9)]
    ids[random_pos] = rng.integers(NUM_SPECIAL, vocab_size, len(random_pos))
    return ids, labels


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a cheap 64-bit integer hash."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class EpochOrder:
    """Global sample index g -> item perm_e(g mod n) of epoch e = g // n: a fresh seeded
    permutation of range(n) per epoch, a pure function of (seed, g).

    The permutation is computed per index (a 4-round Feistel network on the smallest even power
    of two >= n, cycle-walking back into [0, n)), never materialised: no rank builds an array of
    n indices per epoch, so 45 million blocks cost nothing at start-up."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise DataError("no items to order: the dataset is empty")
        self.n, self.seed = n, seed
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self._epoch, self._keys = -1, ()

    def __call__(self, g: int) -> int:
        epoch, x = divmod(g, self.n)
        if epoch != self._epoch:
            self._epoch = epoch
            self._keys = tuple(_mix64(_mix64(_mix64(self.seed) ^ epoch) ^ r) for r in range(4))
        while True:  # cycle-walking: at most a few rounds, as the domain is < 4n
            left, right = x >> self.half, x & self.mask
            for key in self._keys:
                left, right = right, left ^ (_mix64(right ^ key) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


def micro_batch_range(step: int, micro_step: int, loop: LoopConfig, dp_rank: int, dp_world: int) -> range:
    """Global sample indices of one micro-batch: update `step`, micro-batch `micro_step`, DP rank
    `dp_rank` (loop: the batch fields). Data-parallel ranks together see the micro-batches of one
    process accumulating gradients over the same global batch."""
    micro = loop.train_micro_batch_size_per_gpu
    first = step * loop.global_batch(dp_world) + (micro_step * dp_world + dp_rank) * micro
    return range(first, first + micro)


class BlockBatches:
    """Micro-batches of blocks of a prepared dataset's token stream, a pure function of (seed,
    step, micro step, dp rank): what every language-model objective shares. A subclass says how
    many blocks there are (`__len__`) and what block g's (input_ids, labels) are (`sample`).
    Everything is memory-mapped: start-up reads no index into memory."""
    indexed = False  # whether its blocks need `block_index` (made once, before training)

    def __init__(self, data_path: str | os.PathLike, train: TrainConfig, vocab_size: int, dp_rank: int = 0,
                 dp_world: int = 1, split: str = TEXT):
        """train: the seed, seq_length, mask_prob and the batch fields (TrainConfig's)."""
        self.data_path = Path(data_path)
        manifest = read_manifest(self.data_path)
        if split == VALID and not manifest.get("valid"):
            raise DataError(f"{self.data_path} holds no validation data: prepare it with --valid_fraction > 0 "
                            "(or set --eval_interval 0)")
        self.split = split
        self.tokens = self._stream(np.memmap(self.data_path / (split + ".bin"), dtype=manifest["dtype"], mode="r"))
        self.seq_length, self.vocab_size, self.seed, self.mask_prob = (train.seq_length, vocab_size, train.seed,
            train.mask_prob)
        self.train = train
        self.micro_batch_size, self.gas = train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.global_batch = train.global_batch(dp_world)
        self.blocks = self._block_index()
        if len(self) == 0 and split == VALID:  # its fix is the split's, not the corpus's
            raise DataError(f"{self.data_path}'s validation split holds no block of {self.seq_length} "
                            f"({len(self.tokens):,} tokens): prepare the text with a larger --valid_fraction")
        if len(self) == 0:
            raise DataError(f"{self.data_path} holds no blocks of {self.seq_length}: the corpus produced too few "
                            f"tokens ({len(self.tokens):,}): lower --seq_length, or give more text")
        self.order = EpochOrder(len(self), train.seed)

    def _stream(self, tokens: np.ndarray) -> np.ndarray:
        """The token stream the blocks are cut from: the split's own, memory-mapped."""
        return tokens

    def _sequence_lengths(self) -> np.ndarray:
        """The length of every sequence of the split (a sentence with its </s>, or a lone </s>)."""
        from mmadapt.mcore import indexed_dataset

        index = indexed_dataset._IndexReader(str(self.data_path / (self.split + ".idx")), multimodal=False)
        lengths = np.array(index.sequence_lengths, dtype=np.int64)  # copied while the index's memory map is open
        del index
        return lengths

    def _block_index(self) -> np.ndarray | None:
        """[n, 2] (token offset, length) of each block, when blocks are not evenly spaced."""
        return None

    def __len__(self) -> int:
        raise NotImplementedError

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def micro_batch(self, step: int, micro_step: int):
        """-> (input_ids, labels), each [micro_batch_size, seq_length] int64, padded with PAD_ID."""
        samples = micro_batch_range(step, micro_step, self.train, self.dp_rank, self.dp_world)
        ids = np.full((self.micro_batch_size, self.seq_length), PAD_ID, np.int64)
        labels = np.full((self.micro_batch_size, self.seq_length), IGNORE_INDEX, np.int64)
        for i, g in enumerate(samples):
            x, y = self.sample(g)
            ids[i, :len(x)], labels[i, :len(y)] = x, y
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def step_batches(self, step: int):
        """The gradient_accumulation_steps micro-batches of this rank for one update."""
        return [self.micro_batch(step, j) for j in range(self.gas)]


class ReplayBatches:
    """Micro-batches of which `replay_blocks` of each update's `global_batch` blocks are the
    `replay` dataset's (Step 2's source-language replay; the module docstring says which), the
    rest `target`'s: two batch objects of one objective over the same TrainConfig, the replay
    one seeded apart. A micro-batch is (input_ids, labels, replay rows): its replay blocks come
    first, so their scored positions are the first ones (layers.head_losses logs them apart)."""

    def __init__(self, target: BlockBatches, replay: BlockBatches, replay_blocks: int):
        self.target, self.replay, self.replay_blocks = target, replay, replay_blocks
        self.global_batch, self.gas = target.global_batch, target.gas
        self.micro_batch_size, self.seq_length = target.micro_batch_size, target.seq_length
        self.dp_rank, self.dp_world = target.dp_rank, target.dp_world

    def _first(self, q: int) -> int:
        """Replay blocks of the micro-batches before micro-batch q of an update."""
        return q * self.replay_blocks // (self.gas * self.dp_world)

    def micro_batch(self, step: int, micro_step: int):
        """-> (input_ids, labels) as BlockBatches.micro_batch's, and the number of replay rows."""
        q, r = micro_step * self.dp_world + self.dp_rank, self.replay_blocks
        first, rows = self._first(q), self._first(q + 1) - self._first(q)
        ids = np.full((self.micro_batch_size, self.seq_length), PAD_ID, np.int64)
        labels = np.full((self.micro_batch_size, self.seq_length), IGNORE_INDEX, np.int64)
        for i in range(self.micro_batch_size):
            if i < rows:
                x, y = self.replay.sample(step * r + first + i)
            else:
                x, y = self.target.sample(step * (self.global_batch - r) + q * self.micro_batch_size - first + i - rows)
            ids[i, :len(x)], labels[i, :len(y)] = x, y
        return torch.from_numpy(ids), torch.from_numpy(labels), rows

    def step_batches(self, step: int):
        return [self.micro_batch(step, j) for j in range(self.gas)]


def replay_blocks(fraction: float, global_batch: int) -> int:
    """The replay blocks of each update: `fraction` of the global batch, rounded."""
    return round(fraction * global_batch)


class MLMBatches(BlockBatches):
    """Masked blocks (the encoder's objective): FULL-SENTENCES blocks (`block_index`), `<s>` first,
    masked with an RNG seeded by (seed, g): RoBERTa's dynamic masking."""
    indexed = True

    def _block_index(self) -> np.ndarray:
        return read_blocks(self.data_path, self.seq_length, self.split)

    def __len__(self) -> int:
        return len(self.blocks)

    def sample(self, g: int):
        offset, length = self.blocks[self.order(g)]
        block = np.concatenate([[BOS_ID], self.tokens[offset:offset + length]])
        return mask_tokens(block, np.random.default_rng([self.seed, 1, g]), self.vocab_size, self.mask_prob)


class CausalBatches(BlockBatches):
    """Packed blocks for next-token prediction (the decoder's objective): the token stream cut
    into consecutive chunks of seq_length + 1 tokens (sentences with their `</s>`, documents
    separated by a lone `</s>`, so blocks cross documents as GPT-style packing does); block g's
    input is its chunk's first seq_length tokens and its labels the last seq_length: every
    position is scored on its next piece. No padding, no masking, no block index: chunk k starts
    at token k * seq_length.

    With TrainConfig.score_fraction p < 1, block g scores `config.scored_positions` of its
    positions, drawn (`score_subset`) by an RNG seeded by (seed, g) as MLMBatches' masking is: a
    block seen again gets a new subset, and the batches stay a pure function of (seed, update).
    The input is never changed; p = 1 draws nothing."""

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def sample(self, g: int):
        start = self.order(g) * self.seq_length
        chunk = self.tokens[start:start + self.seq_length + 1].astype(np.int64)
        if self.train.score_fraction == 1:
            return chunk[:-1], chunk[1:]
        scored = scored_positions(self.seq_length, self.train.score_fraction)
        return chunk[:-1], score_subset(chunk[1:], np.random.default_rng([self.seed, 2, g]), scored)


class SentenceRows(BlockBatches):
    """One sentence of the dataset per row, laid out as an imported decoder's own tokenizer lays
    out a text: `prefix` (run.run_text_layout: Llama's and Mistral's <s>, nothing for Qwen2) then
    the sentence's pieces (its </s> left out, as the tokenizer leaves it), cut to seq_length,
    padded; every next piece scored (position i's label is the row's piece i + 1). Its rows are
    what transformers' tokenizer gives for the sentence's line (tests/test_llama_hf.py), where
    CausalBatches' packed blocks are mmadapt's stream, `</s>` between sentences. The plug-in
    metric's held-out rows of an imported decoder."""

    def __init__(self, data_path: str | os.PathLike, train: TrainConfig, vocab_size: int, prefix: list[int],
                 split: str = VALID):
        self.prefix = [int(i) for i in prefix]
        super().__init__(data_path, train, vocab_size, split=split)

    def _block_index(self) -> np.ndarray:
        """[n, 2] (token offset, pieces) of every sentence (not the lone </s> that ends a document)."""
        lengths = self._sequence_lengths()
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        keep = lengths > 1  # a sentence's pieces and its </s>
        return np.stack([offsets[keep], lengths[keep] - 1], axis=1)

    def __len__(self) -> int:
        return len(self.blocks)

    def sample(self, g: int):
        offset, pieces = self.blocks[self.order(g)]
        row = np.concatenate([np.array(self.prefix, np.int64),
                              self.tokens[offset:offset + pieces].astype(np.int64)])[:self.seq_length]
        return row, np.concatenate([row[1:], [IGNORE_INDEX]])


def line_join(sp) -> list[int]:
    """The pieces tokenizer `sp` puts between two lines of one text (a document's sentences, one a
    line in the corpus, joined by a newline), where it encodes each line as it encodes the lines
    apart: a byte-level BPE's newline piece (Qwen2's, Llama-3's `Ċ`); none where the text whole
    reads each line otherwise (SentencePiece: the newline is a space, and each line's own first
    `▁` already stands for it). The stream then reads the document's text, though not always in
    its tokenizer's pieces: a sentence ending in `.` gets `.` and `Ċ` where the tokenizer on the
    whole text merges them into `.Ċ` (each line is encoded once, at prepare)."""
    # lines that end in a letter: a byte-level BPE merges punctuation with the newline after it
    # (Qwen2's and Llama-3's `.Ċ`), which would hide the newline piece from this comparison
    a, b = "In the beginning God created the heaven and the earth", "And the earth was without form"
    first, second, whole = sp.encode(a), sp.encode(b), sp.encode(a + "\n" + b)
    between = len(whole) - len(first) - len(second)
    if between > 0 and whole[:len(first)] == first and whole[len(whole) - len(second):] == second:
        return [int(i) for i in whole[len(first):len(first) + between]]
    return []


class LayoutBatches(CausalBatches):
    """CausalBatches over the stream as an imported decoder's own tokenizer lays out text
    (run.run_text_layout: `layout`'s prefix and suffix ids): each document is the prefix, its
    sentences' pieces one after the other (their </s> left out: the source never saw one inside
    a text), joined as the dataset's tokenizer joins two lines of a text (line_join: a byte-level
    BPE's newline piece, or nothing), then the suffix, then the end-of-text token (mmadapt's
    </s>, that tokenizer's eos) unless the suffix ends with it (stream_ids). So Llama's and
    Mistral's documents each read `<s> text </s>`, as their pretraining packed documents (torchtitan
    encodes each with bos and eos): a model that never reads </s> as a next piece learns to push
    its logit down at every position and never ends a text; no </s> stands between sentences;
    Qwen2's documents are each closed by its end-of-text, which separates documents there; and a
    Qwen2 document reads `earth.\nAnd`, not `earth.And`. The stream is a file of the dataset,
    built once per split and layout
    (layout_stream: global rank 0 builds it before training, train.lm_batches) and memory-mapped
    as the split's own tokens are; blocks are cut from it as CausalBatches cuts them."""

    def __init__(self, data_path: str | os.PathLike, train: TrainConfig, vocab_size: int, dp_rank: int = 0,
                 dp_world: int = 1, split: str = TEXT, layout: dict | None = None, join: list[int] | None = None):
        """join: line_join of the dataset's tokenizer, where the caller has it already."""
        self.layout = layout or {}
        self.join = line_join(load(Path(data_path) / TOKENIZER)) if join is None else join
        super().__init__(data_path, train, vocab_size, dp_rank, dp_world, split)

    def _stream(self, tokens: np.ndarray) -> np.ndarray:
        """The laid-out stream: layout_stream's file (built here if no rank built it yet), or, in a
        dataset directory this process cannot write, built in its own memory (the pieces alone,
        a chunk of temporaries at a time)."""
        path = layout_stream_path(self.data_path, self.split, self.layout, self.join)
        if not path.with_suffix(".json").is_file() and not os.access(self.data_path, os.W_OK):
            return layout_stream(self.data_path, self.split, self.layout, self.join, in_memory=True)
        layout_stream(self.data_path, self.split, self.layout, self.join)
        dtype = np.dtype(json.loads(path.with_suffix(".json").read_text())["dtype"])
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


def stream_ids(layout: dict, join: list[int]) -> dict[str, list[int]]:
    """The ids LayoutBatches' stream puts before a document, after it and between two of its
    sentences: `layout`'s prefix, its suffix closed by the end-of-text token (</s>) where the
    suffix does not end with it, and `join`."""
    prefix, suffix = ([int(i) for i in layout.get(k, [])] for k in ("prefix", "suffix"))
    return {"prefix": prefix, "suffix": suffix if suffix[-1:] == [EOS_ID] else [*suffix, EOS_ID],
            "join": [int(i) for i in join]}


def layout_stream_path(data_path: str | os.PathLike, split: str, layout: dict, join: list[int]) -> Path:
    """Where layout_stream keeps the stream of `split` laid out as `layout` and `join` say, keyed
    by the ids it puts (stream_ids): a stream built by an older rule has another name."""
    key = hashlib.sha256(json.dumps(stream_ids(layout, join), sort_keys=True).encode()).hexdigest()[:16]
    return Path(data_path) / f"{split}_layout_{key}.bin"


def layout_stream(data_path: str | os.PathLike, split: str, layout: dict, join: list[int],
                  chunk: int = 1 << 18, in_memory: bool = False):
    """The file of a prepared dataset's `split` laid out as LayoutBatches says (prefix, suffix
    and join ids), built once, atomically, beside the split, in its dtype unless a layout id
    does not fit it (a .json beside it names the dtype, written last: the stream is whole). Built
    `chunk` sequences at a time into the file, so that its memory is a chunk's, not the split's: a
    CC-100 split holds billions of tokens, and the stream built whole in memory held several
    token-sized temporaries on every rank. in_memory: the stream itself, in an array of this
    process (for a directory it cannot write), no file."""
    from mmadapt.mcore import indexed_dataset

    data_path = Path(data_path)
    path = layout_stream_path(data_path, split, layout, join)
    if path.is_file() and path.with_suffix(".json").is_file():
        return path
    manifest = read_manifest(data_path)
    tokens = np.memmap(data_path / (split + ".bin"), dtype=manifest["dtype"], mode="r")
    index = indexed_dataset._IndexReader(str(data_path / (split + ".idx")), multimodal=False)
    lengths = np.array(index.sequence_lengths, dtype=np.int64)
    del index
    ids = stream_ids(layout, join)
    prefix, suffix, join = (np.array(ids[k], np.int64) for k in ("prefix", "suffix", "join"))
    dtype = np.dtype(manifest["dtype"])
    if max([*prefix.tolist(), *suffix.tolist(), *join.tolist(), 0]) > np.iinfo(dtype).max:
        dtype = np.dtype(np.int64)  # an id the dataset's dtype cannot hold
    size = laid_out(tokens, lengths, prefix, suffix, join, None, chunk)
    if in_memory:
        out = np.empty(size, dtype)
        laid_out(tokens, lengths, prefix, suffix, join, out, chunk)
        return out
    tmp = write_temporary(path.with_suffix(""), ".bin")  # a killed run's (a split's size) goes at the next build
    out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(size,)) if size else None
    if out is not None:
        laid_out(tokens, lengths, prefix, suffix, join, out, chunk)
        out.flush()
        del out
    else:
        tmp.write_bytes(b"")
    os.replace(tmp, path)
    meta = {"dtype": dtype.name, "tokens": int(size), "layout": {"prefix": prefix.tolist(), "suffix": suffix.tolist(),
                                                                 "join": join.tolist()}}
    atomic_write(path.with_suffix(".json"), json.dumps(meta))
    return path


def laid_out(tokens: np.ndarray, lengths: np.ndarray, prefix: np.ndarray, suffix: np.ndarray, join: np.ndarray,
             out: np.ndarray | None, chunk: int) -> int:
    """The layout rule (LayoutBatches) over the sequences of `lengths` (a sentence with its </s>,
    or a lone </s> that ends a document) stored back to back in `tokens`: written into `out`
    (None: only counted), `chunk` sequences at a time with whole-array operations (no Python loop
    over sentences). -> the stream's length. Tokens past the last sequence are not read."""
    text = lengths > 1  # a sentence (its pieces and its </s>); a lone </s> ends a document
    ends = np.cumsum(lengths)
    written = 0
    for a in range(0, len(lengths), chunk):
        b = min(a + chunk, len(lengths))
        t = text[a:b]
        before = np.concatenate([[a > 0 and bool(text[a - 1])], t[:-1]])  # the segment before is a sentence
        after = np.concatenate([t[1:], [b < len(lengths) and bool(text[b])]])  # the segment after is one
        opens, closes, joined = t & ~before, t & ~after, t & after  # a document's first, last; a join after
        n = np.where(t, lengths[a:b] - 1, 0)  # each segment's pieces kept (a sentence's, without its </s>)
        size = opens * len(prefix) + n + joined * len(join) + closes * len(suffix)  # each segment's share
        if out is not None:
            at = written + np.cumsum(size) - size  # where each segment's share starts
            first = int(ends[a - 1]) if a else 0
            local_ends = ends[a:b] - first
            keep = np.ones(int(local_ends[-1]), bool)
            keep[local_ends - 1] = False  # every </s>: sentences' and documents' ends
            body = at + opens * len(prefix)  # where each segment's pieces go
            out[np.repeat(body - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))] = \
                tokens[first:first + int(local_ends[-1])][keep]
            for ids, starts in ((prefix, at[opens]), (join, (body + n)[joined]), (suffix, (body + n)[closes])):
                if len(ids):
                    out[(starts[:, None] + np.arange(len(ids))).ravel()] = np.tile(ids.astype(out.dtype), len(starts))
        written += int(size.sum())
    return written


def score_subset(labels: np.ndarray, rng: np.random.Generator, scored: int) -> np.ndarray:
    """labels [s] -> a copy with IGNORE_INDEX everywhere but `scored` positions drawn uniformly
    without replacement."""
    out = np.full_like(labels, IGNORE_INDEX)
    keep = rng.choice(len(labels), scored, replace=False)
    out[keep] = labels[keep]
    return out

