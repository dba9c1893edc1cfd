"""Tokenizer training, one-time corpus encoding, and deterministic MLM batches.

Corpus format: plain UTF-8 text, one sentence (or document line) per line, a blank line between
documents - the layout CC-100 ships in.

Blocks follow RoBERTa's FULL-SENTENCES packing: consecutive whole sentences fill a block of at
most seq_length tokens as `<s> sent sent ... </s>`; blocks may cross document boundaries, with
an extra `</s>` between documents; a sentence longer than a block is split. The packed blocks
are written once to `tokens.bin` (a flat numpy memmap) with `blocks.npy` ([n, 2]: offset,
length), so training reads them without re-tokenising.

Batches are a pure function of (seed, update step): the global sample index of micro-batch j,
data-parallel rank r, row i of update t is
    g = t * global_batch + (j * dp_world + r) * micro_batch + i
and sample g is block perm_e[g mod n] of epoch e = g // n, masked with an RNG seeded by
(seed, g) (RoBERTa's dynamic masking: a block seen again gets a new mask). Resuming therefore
needs only the update step, and a data-parallel run sees exactly the micro-batches of a
single-process run with gradient accumulation over the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from mmadapt.tokens import BOS_ID, EOS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL, PAD_ID


class DataError(ValueError):
    """A user-facing problem with the corpus or the tokenizer."""


def check_corpus(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus {path} does not exist: pass --corpus a UTF-8 text file (one sentence per line)")
    with open(path, encoding="utf-8", errors="replace") as f:
        if not any(line.strip() for line in f):
            raise DataError(f"corpus {path} is empty: it needs at least one non-blank line of text")
    return path


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def train_tokenizer(corpus: str | os.PathLike, model_prefix: str | os.PathLike, vocab_size: int,
                    seed: int = 1234, max_sentences: int = 10_000_000) -> Path:
    """Train a SentencePiece unigram model with mmadapt's special ids; returns `<prefix>.model`."""
    import sentencepiece as spm

    corpus, model_prefix = check_corpus(corpus), Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    tmp = model_prefix.with_name(model_prefix.name + f".tmp{os.getpid()}")
    try:
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(tmp), vocab_size=vocab_size, model_type="unigram",
            character_coverage=0.9995, pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID,
            user_defined_symbols=["<mask>"], input_sentence_size=max_sentences,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as e:
        raise DataError(f"SentencePiece could not train a {vocab_size}-piece vocabulary on {corpus}: "
                        f"{str(e).splitlines()[0]}") from None
    for ext in (".model", ".vocab"):
        os.replace(f"{tmp}{ext}", f"{model_prefix}{ext}")
    return Path(f"{model_prefix}.model")


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """Load a SentencePiece model; check its special ids and (if given) its vocabulary size."""
    import sentencepiece as spm

    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist: pass a SentencePiece .model file")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    if vocab_size is not None and sp.get_piece_size() != vocab_size:
        raise DataError(f"tokenizer {path} has {sp.get_piece_size()} pieces but the model's vocab_size is "
                        f"{vocab_size}: pass --vocab_size {sp.get_piece_size()} or a matching tokenizer")
    if (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.piece_to_id("<mask>")) != (PAD_ID, BOS_ID, EOS_ID, MASK_ID):
        raise DataError(f"tokenizer {path} does not use mmadapt's special ids (pad 0, <s> 2, </s> 3, "
                        "<mask> 4): train it with `mmadapt.data.train_tokenizer`")
    return sp


def _sentences(corpus: Path):
    """Yield (is_new_document, line) for every non-blank line."""
    new_doc = True
    with open(corpus, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                new_doc = True
                continue
            yield new_doc, line
            new_doc = False


def pack_blocks(sentences, seq_length: int):
    """FULL-SENTENCES packing of token lists. sentences: iterable of (is_new_document, ids)."""
    cap = seq_length - 2  # room left by <s> ... </s>
    block: list[int] = []
    for new_doc, ids in sentences:
        if new_doc and block:
            if len(block) + 1 + len(ids) <= cap:
                block.append(EOS_ID)  # document separator inside a block
            else:
                yield [BOS_ID, *block, EOS_ID]
                block = []
        if len(block) + len(ids) > cap:
            if block:
                yield [BOS_ID, *block, EOS_ID]
            block = []
            while len(ids) > cap:
                yield [BOS_ID, *ids[:cap], EOS_ID]
                ids = ids[cap:]
        block.extend(ids)
    if block:
        yield [BOS_ID, *block, EOS_ID]


def encode_corpus(corpus: str | os.PathLike, tokenizer: str | os.PathLike, out_dir: str | os.PathLike,
                  seq_length: int, batch_lines: int = 10_000) -> Path:
    """Tokenise and pack `corpus` once into `out_dir` (reused while the corpus file, tokenizer and
    seq_length are unchanged). Files appear atomically, so concurrent writers are harmless."""
    corpus, tokenizer, out_dir = check_corpus(corpus), Path(tokenizer), Path(out_dir)
    # The corpus is keyed by size and mtime, not content: hashing CC-100's English (301 GB) on every
    # start would cost more than encoding small corpora. The tokenizer is small: hash it.
    st = corpus.stat()
    meta = {"corpus": str(corpus.resolve()), "corpus_size": st.st_size, "corpus_mtime_ns": st.st_mtime_ns,
            "tokenizer_sha": _sha(tokenizer), "seq_length": seq_length}
    meta_path = out_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == meta:
        return out_dir
    sp = load_tokenizer(tokenizer)
    dtype = np.uint16 if sp.get_piece_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    out_dir.mkdir(parents=True, exist_ok=True)

    def encoded():
        pending: list[tuple[bool, str]] = []
        for item in _sentences(corpus):
            pending.append(item)
            if len(pending) == batch_lines:
                yield from zip((d for d, _ in pending), sp.encode([t for _, t in pending]))
                pending = []
        if pending:
            yield from zip((d for d, _ in pending), sp.encode([t for _, t in pending]))

    tag = f".tmp{os.getpid()}"
    offsets, lengths, total = [], [], 0
    with open(out_dir / f"tokens.bin{tag}", "wb") as f:
        for block in pack_blocks(encoded(), seq_length):
            np.asarray(block, dtype=dtype).tofile(f)
            offsets.append(total)
            lengths.append(len(block))
            total += len(block)
    np.save(out_dir / f"blocks{tag}.npy", np.stack([np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)], 1))
    os.replace(out_dir / f"tokens.bin{tag}", out_dir / "tokens.bin")
    os.replace(out_dir / f"blocks{tag}.npy", out_dir / "blocks.npy")
    (out_dir / f"meta.json{tag}").write_text(json.dumps({"key": meta, "dtype": np.dtype(dtype).name,
                                                         "num_blocks": len(offsets), "num_tokens": total}))
    os.replace(out_dir / f"meta.json{tag}", meta_path)
    return out_dir


def mask_tokens(block: np.ndarray, rng: np.random.Generator, vocab_size: int, mask_prob: float):
    """BERT/RoBERTa masking of one block: select p of the ordinary tokens; of those, 80% become
    <mask>, 10% a random ordinary token, 10% stay. Returns (input_ids, labels); labels are
    IGNORE_INDEX except at selected positions. At least one position is selected."""
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


class EpochOrder:
    """Global sample index g -> item index: item perm_e[g mod n] of epoch e = g // n, with a
    fresh seeded permutation per epoch. A pure function of (seed, g)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def __call__(self, g: int) -> int:
        epoch, pos = divmod(g, self.n)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, 0, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[pos])


def micro_batch_range(step: int, micro_step: int, micro_batch_size: int, gradient_accumulation_steps: int,
                      dp_rank: int, dp_world: int) -> range:
    """Global sample indices of one micro-batch: update `step`, micro-batch `micro_step`, DP rank
    `dp_rank`. Data-parallel ranks together see the micro-batches of one process accumulating
    gradients over the same global batch."""
    global_batch = micro_batch_size * gradient_accumulation_steps * dp_world
    first = step * global_batch + (micro_step * dp_world + dp_rank) * micro_batch_size
    return range(first, first + micro_batch_size)


class MLMBatches:
    """Micro-batches of masked blocks as a pure function of (seed, step, micro step, dp rank)."""

    def __init__(self, data_dir: str | os.PathLike, seq_length: int, vocab_size: int, seed: int,
                 mask_prob: float, micro_batch_size: int, gradient_accumulation_steps: int,
                 dp_rank: int = 0, dp_world: int = 1):
        data_dir = Path(data_dir)
        meta = json.loads((data_dir / "meta.json").read_text())
        self.tokens = np.memmap(data_dir / "tokens.bin", dtype=meta["dtype"], mode="r")
        self.blocks = np.load(data_dir / "blocks.npy")
        if len(self.blocks) == 0:
            raise DataError(f"{data_dir} holds no blocks: the corpus produced no tokens")
        if int(self.blocks[:, 1].max()) > seq_length:
            raise DataError(f"{data_dir} was packed for longer blocks than seq_length {seq_length}")
        self.seq_length, self.vocab_size, self.seed, self.mask_prob = seq_length, vocab_size, seed, mask_prob
        self.micro_batch_size, self.gas = micro_batch_size, gradient_accumulation_steps
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.global_batch = micro_batch_size * gradient_accumulation_steps * dp_world
        self.order = EpochOrder(len(self.blocks), seed)

    def __len__(self) -> int:
        return len(self.blocks)

    def sample(self, g: int):
        offset, length = self.blocks[self.order(g)]
        block = np.asarray(self.tokens[offset:offset + length])
        return mask_tokens(block, np.random.default_rng([self.seed, 1, g]), self.vocab_size, self.mask_prob)

    def micro_batch(self, step: int, micro_step: int):
        """-> (input_ids, labels), each [micro_batch_size, seq_length] int64, padded with PAD_ID."""
        samples = micro_batch_range(step, micro_step, self.micro_batch_size, self.gas, self.dp_rank, self.dp_world)
        ids = np.full((self.micro_batch_size, self.seq_length), PAD_ID, np.int64)
        labels = np.full((self.micro_batch_size, self.seq_length), IGNORE_INDEX, np.int64)
        for i, g in enumerate(samples):
            x, y = self.sample(g)
            ids[i, :len(x)], labels[i, :len(y)] = x, y
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def step_batches(self, step: int):
        """The gradient_accumulation_steps micro-batches of this rank for one update."""
        return [self.micro_batch(step, j) for j in range(self.gas)]
