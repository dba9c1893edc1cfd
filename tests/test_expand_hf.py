"""Vocabulary expansion over imported Hugging Face decoders (their BPE tokenizers: Qwen2-style
byte-level and Llama-2-style SentencePiece BPE with byte fallback): the merged tokenizer
(tokenizer.expand_hf) keeps every source token and its segmentation, German gets shorter, Step 2
trains the new rows, and export-hf hands back a model and tokenizer that transformers loads, with
mmadapt's ids and logits. Tiny models made here (tests/hf_models.py); nothing is downloaded."""

import dataclasses
import json

import pytest
import torch

from conftest import REPO
from hf_models import bible_lines, make_llama2, make_qwen2
from mmadapt import steps
from mmadapt.artifact import artifact_state, read_artifact
from mmadapt.models import PRESETS
from mmadapt.hf import export_hf, import_hf
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.model import LlamaLM
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights
from mmadapt.tokenizer import load, pieces
from mmadapt.expand import EXPAND_MULTIPLE, expand
from mmadapt.models import get_family

MAKERS = {"qwen2": make_qwen2, "llama2": make_llama2}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_imported_bpe_decoder_expands_and_exports(name, de_corpus, de_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    init_parallel(1, 1)
    run = tmp_path / "run"
    import_hf(MAKERS[name](tmp_path / "hf"), run)
    source = run / "tokenizer" / "spm.model"
    e = expand(source, de_tokenizer)
    merged = e.write(tmp_path / "merged.json")
    src, got = load(source), load(merged)
    v = src.get_piece_size()
    assert pieces(merged)[:v] == pieces(source) and pieces(merged)[v:] == list(e.new)
    assert e.size % EXPAND_MULTIPLE == 0 and len(e.new) > 100 and not set(e.new) & set(pieces(source))
    # every new token is what BPE reads its own word into: its merge is the last one that word reaches
    model = got.tokenizer.model
    for i in range(v, e.size):
        token = got.tokenizer.id_to_token(int(got.hf_ids[i]))
        assert [t.value for t in model.tokenize(token)] == [token], (name, token)
    # A BPE's new merges come after the source's and a new token is no source merge's input: a text
    # whose merged encoding holds no new token has exactly the source's.
    english, german = bible_lines("en", range(40, 42)), bible_lines("de", range(40, 42))
    unchanged = [line for line in english if max(got.encode(line)) < v]
    assert len(unchanged) > len(english) // 4
    assert all(got.encode(line) == src.encode(line) for line in unchanged)
    assert sum(map(len, got.encode(german))) < 0.9 * sum(map(len, src.encode(german)))
    if name == "llama2":  # byte fallback read the English source's missing ä, ö, ß as bytes: each is a token now
        names = pieces(merged)
        for word in ("Männer", "größer"):
            assert any(names[i].startswith("<0x") for i in src.encode(word)), word
            assert not any(names[i].startswith("<0x") for i in got.encode(word)), word

    train = dataclasses.replace(PRESETS["llama-tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                seq_length=32, train_micro_batch_size_per_gpu=4, vocab_mode="expand")
    steps.adapt_embeddings(run=RunSpec(output_dir=tmp_path / "a", ds_config=REPO / "ds_configs" / "zero0.json",
                                       corpus=de_corpus, tokenizer=de_tokenizer),
                           step=steps.AdaptEmbeddings(system="bl_base", source=run, lang="de", train=train))
    artifact = tmp_path / "a" / "embeddings" / "step00000002"
    art, tok_file, meta = read_artifact(artifact)
    assert tok_file.read_bytes() == e.model and art["word_embeddings"].shape[0] == e.size

    # the source's own tokenizer settings, as an instruct model's would be: carried to the export
    config = run / "tokenizer" / "hf" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "padding_side": "left",
                                  "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    export_hf(tmp_path / "out", primary=run, embeddings=artifact)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.padding_side == "left" and tok.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    hf_ids = got.hf_ids  # mmadapt id -> the exported (source) id
    texts = english[:3] + german[:3]
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == [hf_ids[got.encode(t)].tolist()
                                                                               for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    cfg, state = LLAMA.primary_model(*load_weights(run))
    state = {**state, **artifact_state(get_family(cfg), art, meta, state)}
    model = LlamaLM(dataclasses.replace(cfg, vocab_size=e.size, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict(state)
    for text in texts:
        ids = torch.tensor([got.encode(text)])
        with torch.no_grad():
            mine = model.heads.heads[0](model.hidden_states(ids)[-1][0], model.output_weight)
            theirs = hf(input_ids=torch.from_numpy(hf_ids[ids[0].numpy()])[None]).logits[0][:, hf_ids]
        assert (mine - theirs).abs().max().item() <= 1e-5
    prompt = tok("Im Anfang", return_tensors="pt")
    assert hf.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape[1] == \
        prompt.input_ids.shape[1] + 4
