"""The tokenizer of a run: mmadapt's own SentencePiece model, or a source model's Hugging Face
tokenizer (byte-level BPE for RoBERTa, Llama-3 and Qwen2, SentencePiece with fairseq's id offset
for XLM-R and CamemBERT, SentencePiece BPE with byte fallback for Llama-2 and Mistral) imported
by `mmadapt import-hf`.

Every step reads a run's tokenizer from `<run>/tokenizer/spm.model` (a prepared dataset's from
`tokenizer.model`) through `load`, and uses the part of SentencePieceProcessor's interface
that mmadapt needs. An imported tokenizer is stored at the same place as one JSON document
(`HF_FORMAT`): the `tokenizers` pipeline of the source model and `hf_ids`, the permutation that
gives it mmadapt's special ids (tokens.py: <pad> 0, <unk> 1, <s> 2, </s> 3, <mask> 4, then the
source's other ids in their order). The import permutes the rows of the word embedding and of
every other tensor indexed by piece (output bias, untied output projection) the same way, so the imported model is an ordinary mmadapt model: masking, padding,
the task encodings and every step work unchanged.

Decoder tokenizers (Llama's, Qwen2's, Mistral's) lack some of those roles; the import (each
family's Hugging Face mapping: models/llama/hf.py) then gives the role a row that no text can
produce, so that `hf_ids` stays a permutation of the source's rows and the model exact.

Pieces are compared across tokenizers (Step 2's overlap initialisation) by their surface form
(`pieces`): SentencePiece pieces as they are, byte-fallback pieces of one ASCII character
(<0x41>) as that character; byte-level BPE pieces decoded to text, with the word-boundary
marker 'Ġ' (a leading space) written as SentencePiece's '▁', and bytes that are not whole UTF-8
characters written as SentencePiece's byte pieces (<0xE4>).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID

HF_FORMAT = "mmadapt-hf-tokenizer"
# mmadapt's special ids in order, named as SentencePiece models trained by mmadapt name them.
SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>", MASK_ID: "<mask>"}
SPECIAL_ROLES = ("pad", "unk", "bos", "eos", "mask")  # the same ids, by role
WORD_BOUNDARY = "▁"
# How a row past an imported tokenizer's pieces is named ("<unused 123>": a space inside, which no
# pre-tokenized word holds, so no text produces it)
UNUSED_PIECE = "<unused "


def is_hf(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(1) == b"{"  # a SentencePiece model is a protobuf and never starts with '{'


def load(path: str | os.PathLike):
    """A run's tokenizer: a SentencePieceProcessor, or an HFTokenizer with the same interface."""
    path = Path(path)
    if is_hf(path):
        return HFTokenizer.read(path)
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def kind(tokenizer: str | os.PathLike) -> str:
    """What kind of tokenizer a run's tokenizer file (or a `tokenizers` pipeline's JSON text) is:
    "sentencepiece" (a SentencePiece model, as mmadapt trains them), else the `tokenizers` model of
    an imported one, in lower case: "bpe" (byte-level BPE; SentencePiece BPE with byte fallback),
    "unigram" (XLM-R's SentencePiece, converted), "wordpiece" (BERT's). ModelFamily.tokenizer_kinds
    lists those a family takes."""
    if isinstance(tokenizer, str) and tokenizer.lstrip().startswith("{"):
        doc = json.loads(tokenizer)
    elif not is_hf(tokenizer):
        return "sentencepiece"
    else:
        doc = json.loads(Path(tokenizer).read_text(encoding="utf-8"))["tokenizer"]
    return str((doc.get("model") or {}).get("type", "unknown")).lower()


def sp_proto(path: str | os.PathLike):
    """A SentencePiece model file as its protobuf (sentencepiece_model_pb2.ModelProto)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def bare_proto(proto):
    """A copy of the SentencePiece model `proto` (sp_proto's) that reads a piece as it is: no '▁'
    added before the text, runs of whitespace kept (a piece's own '▁'s are its text)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    bare = pb.ModelProto()
    bare.CopyFrom(proto)
    bare.normalizer_spec.add_dummy_prefix = False
    bare.normalizer_spec.remove_extra_whitespaces = False
    return bare


def unexportable(proto) -> list[str]:
    """What of a SentencePiece model (its `proto`, sp_proto's) hf.spm_to_hf's pipeline does not
    follow, named as its training flags: a model given to mmadapt preprocess --tokenizer may
    have them, one train_tokenizer trains has none. Its export gave other ids on most lines (a
    user-defined piece is matched as an added token, and the space before it lost)."""
    t, n = proto.trainer_spec, proto.normalizer_spec
    unread = [flag for flag, on in (("model_type other than unigram", t.model_type != 1),
                                    ("add_dummy_prefix=false", not n.add_dummy_prefix),
                                    ("remove_extra_whitespaces=false", not n.remove_extra_whitespaces),
                                    ("split_by_whitespace=false", not t.split_by_whitespace),
                                    ("treat_whitespace_as_suffix=true", t.treat_whitespace_as_suffix)) if on]
    # user-defined <mask>: mmadapt's tokenizers trained before 2026-12-04 (a special token in the export)
    defined = [p.piece for p in proto.pieces if p.type == 4 and p.piece != "<mask>"]
    return unread + ([f"user_defined_symbols {defined[:3]}{' ...' if len(defined) > 3 else ''}"] if defined else [])


def _byte_fallback(doc: dict) -> bool:
    """Whether a `tokenizers` pipeline `doc` (its JSON) has SentencePiece's byte fallback."""
    return bool((doc.get("model") or {}).get("byte_fallback"))


def has_byte_fallback(path: str | os.PathLike) -> bool:
    """Whether a run's tokenizer writes a character it has no piece for as the pieces of its
    UTF-8 bytes (<0xE4>) rather than <unk>: Llama-2's and Mistral's imported, or a SentencePiece
    model trained with PreprocessConfig.byte_fallback. (Reads the file's flag: no tokenizer built.)"""
    if is_hf(path):
        return _byte_fallback(json.loads(Path(path).read_text(encoding="utf-8"))["tokenizer"])
    return sp_proto(path).trainer_spec.byte_fallback


def pieces(path: str | os.PathLike) -> list[str]:
    """The surface form of every id of a tokenizer (module docstring), for matching across tokenizers."""
    sp = load(path)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table (used by every byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_level_surface(piece: str, table: dict[str, int] | None = None) -> str:
    table = table or _byte_decoder()
    try:
        raw = bytes(table[c] for c in piece)
    except KeyError:  # not a byte-level piece (an added token): as it is
        return piece
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"<0x{b:02X}>" for b in raw)
    return text.replace(" ", WORD_BOUNDARY)


# Bytes that never occur in UTF-8 text (overlong lead bytes and those past U+10FFFF): a token that
# stands for one of them alone is never produced from text.
NON_UTF8_BYTES = (0xC0, 0xC1, *range(0xF5, 0x100))
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


def surface_text(piece: str) -> str:
    """The text a piece's surface stands for alone, as transformers decodes its one id: its byte
    pieces (<0xE4>: SentencePiece's byte fallback, and byte_level_surface's form of a byte-level
    piece that is not whole characters, '<0x20><0xE0><0xA4>') as bytes, the whole decoded as
    UTF-8 with U+FFFD for bytes that are not a whole character, the word-boundary marker a space."""
    parts = re.split(r"((?:<0x[0-9A-F]{2}>)+)", piece)  # text, bytes, text, ...
    raw = b"".join(bytes(int(h, 16) for h in _BYTE_PIECE.findall(p)) if i % 2 else p.encode("utf-8")
                   for i, p in enumerate(parts))
    return raw.decode("utf-8", errors="replace").replace(WORD_BOUNDARY, " ")


def byte_piece_text(piece: str) -> str | None:
    """The text a byte-fallback piece stands for alone: an ASCII byte's character (<0x41>: 'A'),
    nothing ('') for a byte of a longer UTF-8 character (<0xE4>); None for any other piece."""
    m = _BYTE_PIECE.fullmatch(piece)
    if m is None:
        return None
    b = int(m.group(1), 16)
    return chr(b).replace(" ", WORD_BOUNDARY) if b < 0x80 else ""


def byte_surfaces(pieces: list[str]) -> list[str]:
    """A vocabulary's surface forms (`pieces`) with each ASCII byte piece (<0x0A>) written as its
    character where no piece is that character, as an imported tokenizer's are
    (HFTokenizer._fallback_surface): a SentencePiece byte-fallback model's byte pieces then meet
    the same bytes of any source. Idempotent on surfaces written so already."""
    have = set(pieces)
    out = []
    for piece in pieces:
        text = byte_piece_text(piece)
        out.append(text if text and text not in have else piece)
    return out


def never_produced(doc: dict) -> list[str]:
    """The tokens of NON_UTF8_BYTES in a `tokenizers` pipeline `doc` (its JSON): SentencePiece's
    byte-fallback pieces (<0xC0>), or a byte-level BPE's single-byte pieces (GPT-2's printable
    character for the byte); none for a tokenizer with neither."""
    if _uses_byte_level(doc):
        char = {b: c for c, b in _byte_decoder().items()}
        return [char[b] for b in NON_UTF8_BYTES]
    if _byte_fallback(doc):
        return [f"<0x{b:02X}>" for b in NON_UTF8_BYTES]
    return []


def _uses_byte_level(doc: dict) -> bool:
    pre = doc.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p and p.get("type") == "ByteLevel" for p in parts)


def is_punctuation(ch: str) -> bool:
    """BERT's punctuation (its basic tokenizer's): ASCII symbols and Unicode category P*."""
    import unicodedata

    cp = ord(ch)
    return (33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or
        unicodedata.category(ch).startswith("P"))


def is_cjk(ch: str) -> bool:
    """BERT's CJK characters (its basic tokenizer's _is_chinese_char): each a word of its own
    where its normaliser handles Chinese characters."""
    cp = ord(ch)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
            or 0x2F800 <= cp <= 0x2FA1F)


def source_form(tokenizer: str | os.PathLike):
    """piece -> its form in the source tokenizer `tokenizer` (HFTokenizer.source_form; the
    identity for a SentencePiece model): how Step 2 matches target pieces with source rows."""
    return load(tokenizer).source_form if is_hf(tokenizer) else (lambda piece: piece)


class _Piece:
    __slots__ = ("id", "begin", "end", "piece")

    def __init__(self, id: int, begin: int, end: int, piece: str):
        self.id, self.begin, self.end, self.piece = id, begin, end, piece


class _Proto:
    """What features.piece_offsets reads of SentencePiece's proto: pieces with byte offsets."""

    def __init__(self, pieces: list[_Piece]):
        self.pieces = pieces


class HFTokenizer:
    """An imported Hugging Face fast tokenizer with mmadapt's ids (module docstring)."""

    def __init__(self, doc: dict):
        if doc.get("format") != HF_FORMAT:
            raise ValueError(f"not an imported tokenizer (format {doc.get('format')!r}, expected {HF_FORMAT!r})")
        self.doc = doc
        runtime, self._renamed = _control_pieces_unreachable(doc["tokenizer"])
        self.tokenizer = _whole_texts(runtime)
        # A special token's string in a text is text ("<pad>" in a web page is five characters):
        # matched, it put a role's id inside a row (RoBERTa's "<pad>" and BERT's "[PAD]" gave
        # PAD_ID, which the padding mask and the varlen layout read as the row's end; Qwen2's
        # "<|endoftext|>" gave EOS_ID mid-document). mmadapt lays every role's id out itself
        # (features.py, data.py); predict reads a literal <mask> before encoding. (A Unigram's own
        # pieces for them are out of reach too: _control_pieces_unreachable.)
        self.tokenizer.encode_special_tokens = True
        self.hf_ids = np.asarray(doc["hf_ids"], dtype=np.int64)  # mmadapt id -> source id
        self.to_mmadapt = np.empty(len(self.hf_ids), dtype=np.int64)  # source id -> mmadapt id
        self.to_mmadapt[self.hf_ids] = np.arange(len(self.hf_ids))
        self.byte_level = _uses_byte_level(doc["tokenizer"])
        self.byte_fallback = _byte_fallback(doc["tokenizer"])
        model = doc["tokenizer"].get("model") or {}
        # WordPiece (BERT): word-initial tokens bare, continuations behind a prefix ("##")
        self.continuation = model.get("continuing_subword_prefix", "##") if model.get("type") == "WordPiece" else None
        self._surface = None

    @classmethod
    def read(cls, path: str | os.PathLike) -> "HFTokenizer":
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    @staticmethod
    def document(tokenizer_json: str, hf_ids: list[int], source: str) -> dict:
        return {"format": HF_FORMAT, "source": source, "hf_ids": [int(i) for i in hf_ids],
                "tokenizer": json.loads(tokenizer_json)}

    def source_tokenizer(self):
        """The document's `tokenizers` pipeline as the source ships it (what an export writes),
        without a length to cut to or padding: `self.tokenizer` reads special tokens' strings as
        text and renames a Unigram's control pieces (__init__)."""
        return _whole_texts(self.doc["tokenizer"])

    def token(self, h: int) -> str | None:
        """The source token of source id `h` (None for a row past the tokenizer)."""
        t = self.tokenizer.id_to_token(int(h))
        return self._renamed.get(t, t)

    def vocabulary(self) -> dict[str, int]:
        """token -> source id, added tokens included, as the source document holds them."""
        return {self._renamed.get(t, t): i for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items()}

    def same_vocabulary(self, vocab: dict[str, int], rows: int) -> bool:
        """Whether a tokenizer whose `tokenizers` vocabulary (added tokens included) is `vocab`,
        over a model of `rows` embedding rows, is this one's source vocabulary: every token at the
        same source id, the same rows (the special roles' rows may differ: hf_ids)."""
        return len(self.hf_ids) == rows and self.vocabulary() == vocab

    # --- SentencePieceProcessor's interface, the part mmadapt uses
    def get_piece_size(self) -> int:
        return len(self.hf_ids)

    def pad_id(self) -> int:
        return PAD_ID

    def unk_id(self) -> int:
        return UNK_ID

    def bos_id(self) -> int:
        return BOS_ID

    def eos_id(self) -> int:
        return EOS_ID

    def id_to_piece(self, i: int) -> str:
        """The surface form of id `i` (module docstring); the special ids under mmadapt's names."""
        if self._surface is None:
            table = _byte_decoder() if self.byte_level else None
            out = []
            for m, h in enumerate(self.hf_ids.tolist()):
                token = self.token(h)
                if m in SPECIAL_PIECES:
                    out.append(SPECIAL_PIECES[m])
                elif token is None:  # an embedding row that the tokenizer never produces
                    out.append(f"{UNUSED_PIECE}{h}>")
                elif token.startswith(UNUSED_PIECE):  # such a row's filler token in a merged vocabulary (expand_hf)
                    out.append(token)
                elif self.byte_level:
                    out.append(byte_level_surface(token, table))
                elif self.continuation is not None:
                    out.append(self._wordpiece_surface(token))
                else:
                    out.append(self._fallback_surface(token) if self.byte_fallback else token)
            self._surface = out
        return self._surface[i]

    def _wordpiece_surface(self, token: str) -> str:
        """A WordPiece token as SentencePiece writes the same text: a continuation `##oo` as `oo`, a
        word-initial `foo` as `▁foo`, except a character BERT's pre-tokenizer always makes a word
        of its own (`isolates`: punctuation, and CJK where the normaliser handles it), although it
        follows a word with no space (`God,`: SentencePiece's `▁God` `,`): its bare token is the
        one produced wherever it stands, written bare; its continuation (`##,`, which real BERT
        vocabularies hold) is never produced and keeps a surface no piece has."""
        prefix = self.continuation
        if len(token) == 1 and self.isolates(token):
            return token
        if token.startswith(prefix) and len(token) > len(prefix):
            return token if len(token) == len(prefix) + 1 and self.isolates(token[-1]) else token[len(prefix):]
        return WORD_BOUNDARY + token

    def isolates(self, ch: str) -> bool:
        """Whether BERT's pipeline cuts `ch` into a word of its own: punctuation always (its
        pre-tokenizer), a CJK character where its normaliser handles Chinese characters."""
        if is_punctuation(ch):
            return True
        return is_cjk(ch) and self._handles_chinese

    @functools.cached_property
    def _handles_chinese(self) -> bool:
        normalizer = self.doc["tokenizer"].get("normalizer") or {}
        parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
        return any(n.get("type") == "BertNormalizer" and n.get("handle_chinese_chars", True) for n in parts)

    def source_form(self, piece: str) -> str:
        """A surface form (another tokenizer's piece) as this tokenizer's normaliser writes its
        text: an uncased WordPiece lowercases and strips accents (`▁Gott` -> `▁gott`), so that a
        target piece is matched with the source row its text reaches; as it is for every other
        tokenizer, and where normalising would split it (BERT's spaces around CJK characters). A
        character a WordPiece pipeline isolates is its bare token at a word's start and inside a
        word alike (`_wordpiece_surface`): `▁:` and `▁中` are read as `:` and `中`."""
        normalizer = self.tokenizer.normalizer
        if self.continuation is not None and len(piece) == 2 and piece[0] == WORD_BOUNDARY and self.isolates(piece[1]):
            return piece[1]
        if self.continuation is None or normalizer is None:
            return piece
        start = WORD_BOUNDARY if piece.startswith(WORD_BOUNDARY) else ""
        text = normalizer.normalize_str(piece[len(start):])
        return start + text if text and not any(c.isspace() for c in text) else piece

    def split_surface(self, piece: str) -> list[int]:
        """The ids this tokenizer gives the text of a surface form `piece` where it stands in a text
        (adapt.source_split): '▁' a word start, a bare piece the inside of a word, so a WordPiece
        continues it with `##` pieces; nothing added around it. Pieces of an unknown word are left out."""
        if self.byte_level:  # its pipeline adds no prefix space: the piece's text, '▁' a space
            return [i for i in self.encode(piece.replace(WORD_BOUNDARY, " ")) if i != UNK_ID]
        if self.continuation is None:
            # SentencePiece's kind (XLM-R's Unigram, Llama-2's BPE): its pipeline puts a '▁' before
            # every text (Metaspace, Prepend), which made every piece a word start ('nd' split as
            # '▁' 'n' 'd'); its model reads the piece as it is, '▁' and all
            return [i for i in self._ids([t.id for t in self.tokenizer.model.tokenize(piece)]) if i != UNK_ID]
        inside = not piece.startswith(WORD_BOUNDARY)
        text = piece.lstrip(WORD_BOUNDARY)
        if self.tokenizer.normalizer is not None:
            text = self.tokenizer.normalizer.normalize_str(text)
        words = self.words(text)
        ids = []
        for n, word in enumerate(words):  # a character the pipeline isolates is a word of its own anywhere
            ids += self._wordpiece(word, continued=inside and n == 0 and not (len(word) == 1 and self.isolates(word)))
        return self._ids(ids)

    def words(self, text: str) -> list[str]:
        """`text` cut into words as this tokenizer's pre-tokenizer cuts it (BERT's: at spaces and
        around every punctuation character)."""
        pre = self.tokenizer.pre_tokenizer
        return [w for w, _ in pre.pre_tokenize_str(text)] if pre is not None else text.split()

    @functools.cached_property
    def _vocab(self) -> dict[str, int]:
        """token -> source id, read once: tokenizers builds the dict anew at every get_vocab (a
        WordPiece's split of 16,000 new pieces spent 62 s rebuilding it)."""
        return self.tokenizer.get_vocab()

    def _wordpiece(self, word: str, continued: bool) -> list[int]:
        """WordPiece's greedy longest-match-first split of one pre-tokenized word into source ids;
        continued: the word goes on a word (its first piece is a continuation too). [] where it is
        unknown (a piece of it matches nothing: WordPiece gives the whole word [UNK])."""
        vocab, prefix, out, start = self._vocab, self.continuation, [], 0
        while start < len(word):
            end = len(word)
            while end > start and (prefix if start or continued else "") + word[start:end] not in vocab:
                end -= 1
            if end == start:
                return []
            out.append(vocab[(prefix if start or continued else "") + word[start:end]])
            start = end
        return out

    def _fallback_surface(self, token: str) -> str:
        """A SentencePiece byte-fallback piece of a whole character (<0x41>: 'A') written as that
        character, as a byte-level BPE's is, unless the vocabulary has the character as a piece of
        its own (which then keeps the surface: one row per surface form)."""
        text = byte_piece_text(token)
        return text if text and self.tokenizer.token_to_id(text) is None else token

    def piece_to_id(self, piece: str) -> int:
        if piece in SPECIAL_PIECES.values():
            return next(m for m, p in SPECIAL_PIECES.items() if p == piece)
        h = self.tokenizer.token_to_id(next((r for r, t in self._renamed.items() if t == piece), piece))
        return UNK_ID if h is None else int(self.to_mmadapt[h])

    def _ids(self, hf: list[int]) -> list[int]:
        return self.to_mmadapt[np.asarray(hf, dtype=np.int64)].tolist() if hf else []

    def encode(self, text, out_type=int, num_threads=None, return_type=None):
        """ids of `text` (or of each text of a list), without <s> and </s>; with return_type
        "proto" (or out_type "immutable_proto") an object whose pieces carry byte offsets."""
        if isinstance(text, list):
            return [self._ids(e.ids) for e in self.tokenizer.encode_batch(text, add_special_tokens=False)]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        if return_type == "proto" or out_type == "immutable_proto":
            byte_of_char = np.zeros(len(text) + 1, dtype=np.int64)
            np.cumsum([len(ch.encode("utf-8")) for ch in text], out=byte_of_char[1:])
            return _Proto([_Piece(m, int(byte_of_char[b]), int(byte_of_char[e]), t) for m, (b, e), t in
                           zip(self._ids(enc.ids), enc.offsets, enc.tokens)])
        if out_type is str:
            return enc.tokens
        return self._ids(enc.ids)


def _whole_texts(doc: dict):
    """The `tokenizers` pipeline of document `doc` giving a text's pieces whole: a document can
    carry a length to cut to and padding (exports of sentence-transformers ship 128 and Fixed
    128), which would cut every QA context and task row and pad each encoding; mmadapt lays out,
    cuts and pads rows itself."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(doc))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _control_pieces_unreachable(doc: dict) -> tuple[dict, dict[str, str]]:
    """A `tokenizers` document whose Unigram model cannot produce a special token from text,
    and {the name it gives such a token: the token}. SentencePiece never produces a control piece
    (<s>, </s>, <pad>) from text, but the conversion to a Unigram `tokenizers` model keeps each as
    an ordinary piece of score 0, the highest of all: XLM-R's "Gott <pad> sprach" became PAD_ID
    however added tokens are read. The piece and its added token are renamed with a space inside,
    which no pre-tokenized word holds; ids and scores stay (`vocabulary` and `token` give the
    names back). The document itself (`doc`, what is written and exported) is not changed."""
    model = doc.get("model") or {}
    special = {a["content"] for a in doc.get("added_tokens", []) if a.get("special")}
    inside = {p for p, _ in model["vocab"]} & special if model.get("type") == "Unigram" else set()
    if not inside:
        return doc, {}
    renamed = {f"{p} ": p for p in inside}
    vocab = [[f"{p} " if p in inside else p, score] for p, score in model["vocab"]]
    added = [{**a, "content": f"{a['content']} "} if a["content"] in inside else a for a in doc["added_tokens"]]
    return {**doc, "model": {**model, "vocab": vocab}, "added_tokens": added}, renamed


def cut_to_multiple(rows: int, new: list, multiple: int) -> list:
    """`new`, cut (its last items dropped, fewer than `multiple`) to the count that makes
    rows + len(new) a multiple of `multiple`: a tensor-parallel vocabulary splits evenly."""
    return new[:max((rows + len(new)) // multiple * multiple - rows, 0)]


def expand_hf(source: str | os.PathLike, candidates: list[str], multiple: int,
              scores: dict[str, float] | None = None) -> tuple[bytes, list[str]]:
    """An imported BPE, WordPiece or Unigram tokenizer (`source`, HFTokenizer's document) with the
    pieces `candidates` (surface forms, in order of preference; `scores`: their log-probabilities
    in the target's unigram model, which a Unigram source needs) appended after every row of its
    model: the merged document and the pieces it adds, in id order (expand.py's --vocab_mode
    expand).

    A Unigram (XLM-R's SentencePiece, converted; a SentencePiece model exported by mmadapt) gets
    each candidate as a piece of its target score shifted so that the best sits just under the
    source's worst piece, as expand.expand does to a SentencePiece unigram model: Viterbi then
    takes a new piece only where it replaces several source pieces, and a text whose best
    segmentation uses none keeps the source's ids exactly (the source's scores are unchanged).

    A BPE produces a token only through a merge of two tokens it has, so a candidate is added with
    the merge of a split of it whose two halves are tokens (`_bpe_additions`); a candidate with no
    such split is left out. A new character needs no merge (BPE looks characters up first). The
    merges come after every source merge, so a text keeps the source's segmentation unless a new
    merge or character applies. As many are kept (the shortest) as make the
    vocabulary a multiple of `multiple`. Each new token's id follows the model's rows (so ids past
    the tokenizer that the import borrowed for roles are not reused), and hf_ids gives it the next
    mmadapt id."""
    doc = json.loads(Path(source).read_text(encoding="utf-8"))
    model = doc["tokenizer"]["model"]
    if model.get("type") not in ("BPE", "WordPiece", "Unigram"):
        raise ValueError(f"the imported tokenizer {source} is a {model.get('type')} model: --vocab_mode expand "
                         "merges SentencePiece models and imported BPE (byte-level or with byte fallback), "
                         "WordPiece and Unigram tokenizers")
    if model["type"] == "Unigram":
        return _expand_unigram(doc, candidates, multiple, scores)
    if model["type"] == "BPE":
        added, merges = _bpe_additions(doc["tokenizer"], candidates)
    else:
        added, merges = _wordpiece_additions(HFTokenizer(doc), candidates), []
    vocab, rows = dict(model["vocab"]), len(doc["hf_ids"])
    # tokenizers numbers added tokens after the model's vocabulary (its size, not its largest id):
    # the model's vocabulary must hold every id below the new ones, so the added tokens go in at
    # their ids and each row past the tokenizer gets a token no text produces, named as
    # id_to_piece names such a row
    for a in doc["tokenizer"].get("added_tokens", []):
        vocab.setdefault(a["content"], a["id"])
    taken = set(vocab.values())
    vocab.update({f"{UNUSED_PIECE}{h}>": h for h in range(rows) if h not in taken})
    new = cut_to_multiple(rows, list(added), multiple)
    kept = {added[p] for p in new}
    # tokens were added shortest first and a token's halves are shorter than it, so cutting the
    # list (its longest tokens go) never strands a kept token's merge
    if merges:
        string_merges = bool(model["merges"]) and isinstance(model["merges"][0], str)
        model["merges"] = list(model["merges"]) + [f"{a} {b}" if string_merges else [a, b]
                                                   for a, b in merges if a + b in kept]
    model["vocab"] = {**vocab, **{added[p]: rows + j for j, p in enumerate(new)}}
    doc["hf_ids"] = list(doc["hf_ids"]) + [rows + j for j in range(len(new))]
    return json.dumps(doc, ensure_ascii=False).encode("utf-8"), new


def _expand_unigram(doc: dict, candidates: list[str], multiple: int, scores: dict[str, float] | None
                    ) -> tuple[bytes, list[str]]:
    """expand_hf for a Unigram model (its docstring). Its vocabulary is a list whose index is the
    id: rows of the model past the tokenizer (borrowed for roles) get pieces no text produces
    (a space inside a piece: the Metaspace pre-tokenizer never leaves one), so that the new
    pieces take the ids after every row."""
    if scores is None:
        raise ValueError("a Unigram tokenizer is expanded with the target pieces' scores: pass them")
    model, rows = doc["tokenizer"]["model"], len(doc["hf_ids"])
    vocab = [list(v) for v in model["vocab"]]
    have = {piece for piece, _ in vocab} | {a["content"] for a in doc["tokenizer"].get("added_tokens", [])}
    # a piece with a word boundary inside it is never produced (the pre-tokenizer splits there)
    added = [p for p in candidates if p not in have and WORD_BOUNDARY not in p[1:]]
    added = cut_to_multiple(rows, added, multiple)
    # the new pieces' ids must follow the model's rows, and no added token may sit past the
    # vocabulary list (tokenizers would number it after the new pieces, moving its id)
    past = [a["content"] for a in doc["tokenizer"].get("added_tokens", []) if a["id"] >= len(vocab)]
    if len(vocab) > rows or past:
        raise ValueError(f"the imported tokenizer holds {len(vocab)} pieces for {rows} rows of its model"
                         + (f" and the added tokens {', '.join(past)} past them" if past else "")
                         + ": it cannot be expanded")
    # an earlier expansion's filler rows (below) do not count: they are never produced
    lowest = min(score for piece, score in vocab if not piece.startswith(UNUSED_PIECE))
    shift = lowest - 1 - max((scores[p] for p in added), default=0.0)
    new = [[p, scores[p] + shift] for p in added]
    filler = min([lowest] + [score for _, score in new]) - 1e3  # never produced; scored below everything anyway
    vocab += [[f"{UNUSED_PIECE}{h}>", filler] for h in range(len(vocab), rows)] + new
    model["vocab"] = vocab
    doc["hf_ids"] = list(doc["hf_ids"]) + [rows + j for j in range(len(added))]
    return json.dumps(doc, ensure_ascii=False).encode("utf-8"), added


def _wordpiece_additions(tok: HFTokenizer, candidates: list[str]) -> dict[str, str]:
    """The candidates (surface forms, in the source's normal form) a WordPiece `tok` can be given,
    in their order (the target's: the most useful first): {piece: its token}. WordPiece has no merges: a token is produced wherever it is
    the longest match, so each is appended as it is (`▁foo` as the word-initial `foo`, `oo` as the
    continuation `##oo`); a character the pipeline isolates (punctuation; CJK where its
    normaliser handles it: HFTokenizer.isolates) as its bare token wherever it stands. A piece
    that the pipeline would cut (a longer piece holding such a character) is never produced
    and left out, and so is one its normaliser changes (an uncased BERT strips a lone combining
    mark, Hindi's virama, to nothing: that token would never be matched)."""
    vocab, added, normalizer = tok.tokenizer.get_vocab(), {}, tok.tokenizer.normalizer
    for piece in candidates:
        text = piece[len(WORD_BOUNDARY):] if piece.startswith(WORD_BOUNDARY) else piece
        if normalizer is not None and normalizer.normalize_str(text).strip() != text:  # (CJK: spaces around it)
            continue
        if any(map(tok.isolates, text)):
            if len(text) > 1:
                continue
            token = text
        else:
            token = text if piece.startswith(WORD_BOUNDARY) else tok.continuation + text
        if token in vocab or token in added.values() or tok.words(text) != [text]:
            continue
        added[piece] = token
    return added


def _bpe_additions(pipeline: dict, candidates: list[str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The candidates (surface forms) a BPE `pipeline` (its `tokenizers` JSON) can be given, shortest
    first: {piece: its token} and the merges that produce them. BPE reads a word by its merges in
    rank order, and the new merges rank after every source merge: so a candidate's word is read
    by the merges there are (the source's, and those added for shorter candidates) as far as they
    go (`segment`), and the candidate is added with the merge of the two tokens that leaves, the
    one merge that then produces it. A candidate left in more than two tokens would need merges
    of tokens no candidate is, and one that a byte-level pre-tokenizer would cut is never
    produced: both are left out. (A split of the candidate into any two tokens, as before, gave
    a merge that its word never reached for about one new token in five: '▁der' read as '▁d'
    'er' where the merge was '▁' 'der'.)"""
    from tokenizers import Tokenizer

    byte_level = _uses_byte_level(pipeline)
    char = {b: c for c, b in _byte_decoder().items()}

    def token_of(piece: str) -> str:
        """The source vocabulary's spelling of a surface form (the inverse of id_to_piece)."""
        m = _BYTE_PIECE.fullmatch(piece)
        raw = bytes([int(m.group(1), 16)]) if m else piece.replace(WORD_BOUNDARY, " ").encode()
        return "".join(char[b] for b in raw) if byte_level else piece

    pre = Tokenizer.from_str(json.dumps(pipeline)).pre_tokenizer
    order = {p: i for i, p in enumerate(candidates)}
    vocab, added, merges = pipeline["model"]["vocab"], {}, []
    ranks = {tuple(m.split(" ")) if isinstance(m, str) else tuple(m): r
             for r, m in enumerate(pipeline["model"]["merges"])}

    chars: set[str] = set()  # the new characters added so far (each a token of its own, no merge)

    def segment(token: str) -> list[str] | None:
        """The tokens BPE reads `token`'s word into with the merges in `ranks` (the lowest-ranked
        adjacent pair merged first, the leftmost of equals, as tokenizers does); None where a
        character of it is no token (a byte-fallback model reads it as bytes)."""
        parts = list(token)
        if any(c not in vocab and c not in chars for c in parts):
            return None
        while len(parts) > 1:
            rank, i = min((ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    for piece in sorted(candidates, key=lambda p: (len(token_of(p)), order[p])):
        token = token_of(piece)
        if token in vocab or token in added.values():
            continue
        # a byte-level pre-tokenizer cuts text into words before BPE: a token it would cut is never produced
        if byte_level and pre is not None and [w for w, _ in pre.pre_tokenize_str(
                bytes(_byte_decoder()[c] for c in token).decode("utf-8", "replace"))] != [token]:
            continue
        if len(token) == 1:
            # a character: BPE looks every character up before it merges, so a new one (a script
            # a byte-fallback model read as bytes) needs no merge, and the pieces on it become formable
            added[piece] = token
            chars.add(token)
            continue
        parts = segment(token)
        if parts is not None and len(parts) == 2:
            added[piece] = token
            merges.append((parts[0], parts[1]))
            ranks[parts[0], parts[1]] = len(pipeline["model"]["merges"]) + len(merges)  # after every other
    return added, merges

