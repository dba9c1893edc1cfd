"""Grafting Step-2 embeddings trained over a base decoder into its fine-tuned sibling (graft.py,
`export-hf --graft`): the sibling check's distances by hand, the exported directory against
mmadapt's logits, expand keeping the sibling's own source rows bit for bit, and the refusals."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mmadapt import predict
from mmadapt.artifact import artifact_state, read_artifact
from mmadapt.cli import main
from mmadapt.graft import check_siblings
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.model import LlamaLM
from mmadapt.run import load_weights, read_source
from mmadapt.tokenizer import load


def _artifact(graft_runs, name: str, mode: str):
    return sorted((graft_runs[f"{name}-{mode}"] / "embeddings").iterdir())[-1]


def test_the_sibling_check_measures_each_layer_by_hand(graft_runs):
    """||sibling - base|| / ||base|| per layer; the frozen input embeddings have not moved, every
    layer has; an untied output projection that was frozen has not either."""
    for name in ("qwen2", "llama2"):
        base, sibling = read_source(graft_runs[f"{name}-base"]), read_source(graft_runs[f"{name}-sibling"])
        check = check_siblings(base, sibling, read_artifact(_artifact(graft_runs, name, "expand"))[2])
        a, b = base.weights(), sibling.weights()
        layer0 = [k for k in a if k.startswith("layers.0.")]
        by_hand = (sum(float((b[k].double() - a[k].double()).pow(2).sum()) for k in layer0)
                   / sum(float(a[k].double().pow(2).sum()) for k in layer0)) ** 0.5
        assert check.distance["layers.0"] == pytest.approx(by_hand, rel=1e-9) and by_hand > 1e-4
        assert check.distance["word_embeddings"] == 0.0
        if name == "llama2":
            assert check.distance["output_layer"] == 0.0
        assert check.lines()[0].startswith(f"graft: {sibling.path} is a sibling of {base.path}")


def test_the_sibling_check_warns_of_a_layer_that_moved_farther_than_a_fine_tune_moves_one():
    """A layer past graft.FAR (0.3 of its norm) gets one warning line naming it, the farthest; the
    distances of the siblings fine-tuned here (0.03-0.12), and the embeddings however far, get none."""
    from mmadapt.graft import FAR, SiblingCheck

    near = SiblingCheck(Path("b"), Path("s"), {"word_embeddings": 0.92, "layers.0": 0.12, "layers.1": FAR})
    assert not any(line.startswith("warning") for line in near.lines())
    far = SiblingCheck(Path("b"), Path("s"), {"word_embeddings": 0.0, "layers.0": 0.31, "layers.1": 0.49})
    warnings = [line for line in far.lines() if line.startswith("warning")]
    assert len(warnings) == 1 and "its layers.1 moved 0.49 of its norm" in warnings[0]


@pytest.mark.parametrize("name, mode", [("qwen2", "expand"), ("llama2", "expand"), ("llama2", "replace")])
def test_a_graft_exports_what_mmadapt_computes_and_expand_keeps_the_siblings_rows(name, mode, graft_runs, tmp_path,
                                                                                    capsys):
    from transformers import AutoModelForCausalLM

    artifact = _artifact(graft_runs, name, mode)
    sibling = graft_runs[f"{name}-sibling"]
    out = tmp_path / "out"
    assert main(["export-hf", "--primary", str(sibling), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"graft: {sibling} is a sibling of" in said and "layers.0" in said
    art, tok, meta = read_artifact(artifact)
    cfg, state = LLAMA.primary_model(*load_weights(sibling))
    own = dict(state)
    state = {**state, **artifact_state(LLAMA, art, meta, state)}
    vocab = art["word_embeddings"].shape[0]
    model = LlamaLM(dataclasses.replace(cfg, vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict(state)
    hf = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    sp = load(tok)
    to_hf = torch.as_tensor(getattr(sp, "hf_ids", range(vocab)))  # mmadapt id -> the exported id
    for text in ("Im Anfang schuf Gott Himmel und Erde.", "In the beginning God created the heaven."):
        ids = torch.tensor([sp.encode(text)])
        with torch.no_grad():
            mine = model.heads.heads[0](model.hidden_states(ids)[-1][0], model.output_weight)
            theirs = hf(input_ids=to_hf[ids[0]][None]).logits[0][:, to_hf]
        assert (mine - theirs).abs().max().item() <= 1e-5
    # predict --graft: the same graft for inference, its next-piece logits transformers' on its own input ids
    grafted = predict.load(sibling, artifact, graft=True, device="cpu")
    text = "Im Anfang schuf Gott Himmel und Erde."
    ids = grafted.encode([text])[0]
    with torch.no_grad():
        theirs = hf(input_ids=to_hf[ids][None]).logits[0][:, to_hf]
    assert (grafted.logits([text])[grafted.heads[0]][0] - theirs).abs().max().item() <= 1e-5
    assert f"graft: {sibling} is a sibling of" in capsys.readouterr().err
    if mode == "expand":  # the sibling's own source rows, bit for bit, in its own (exported) order
        own_tok = load(read_source(sibling).tokenizer)
        rows = len(own_tok.hf_ids)
        exported = hf.get_input_embeddings().weight.detach()
        sib = AutoModelForCausalLM.from_pretrained(str(sibling.parent / "hf" / f"{name}-sibling"))
        assert torch.equal(exported[:rows], sib.get_input_embeddings().weight.detach()[:rows])
        assert torch.equal(hf.get_output_embeddings().weight.detach()[:rows],
                           sib.get_output_embeddings().weight.detach()[:rows])
        assert torch.equal(own["word_embeddings.word_embeddings.weight"], state["word_embeddings.word_embeddings.weight"][
            :own["word_embeddings.word_embeddings.weight"].shape[0]])
        # English in the sibling's own ids: the graft's logits over the sibling's rows are the
        # sibling's, so its English predictions with the new pieces left out are the sibling's,
        # and its loss at each position rises by exactly -log(1 - the new pieces' share) there
        ids = to_hf[torch.tensor([own_tok.encode("In the beginning God created the heaven and the earth.")])]
        with torch.no_grad():
            graft_logits, own_logits = hf(input_ids=ids).logits[0], sib(input_ids=ids).logits[0]
        assert (graft_logits[:, :rows] - own_logits).abs().max().item() <= 1e-5
        share = torch.softmax(graft_logits.double(), -1)[:, rows:].sum(-1)
        next_ids = ids[0, 1:]
        rise = (torch.log_softmax(own_logits.double(), -1) - torch.log_softmax(graft_logits.double(), -1)[:, :rows]
                )[:-1].gather(1, next_ids[:, None])[:, 0]
        assert (share > 0).all()
        # (to the logits' 1e-5 above: the rise is a difference of two logsumexps over them)
        torch.testing.assert_close(rise, -torch.log1p(-share[:-1]), rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["llama2", "qwen2"])
def test_an_expand_graft_takes_the_siblings_own_input_rows_where_they_moved(name, graft_runs, tmp_path, capsys):
    """The siblings above froze their input embeddings, so their source rows are the base's (and
    the artifact's): a graft that took those rows from the artifact would pass there. Here the
    sibling's input embeddings moved (allowed: only an untied output side that moved is refused
    for expand): the export's source rows are the sibling's, the new rows the artifact's, and its
    German logits mmadapt's over the sibling's weights with the new rows appended. Qwen2's are
    tied, so its output projection moved with them: allowed, with a warning (the new pieces'
    output rows were trained beside the base's rows); Llama-2's untied projection did not move."""
    from transformers import AutoModelForCausalLM

    from mmadapt.hf import import_hf

    hf_dir = tmp_path / "hf-moved"
    sib = AutoModelForCausalLM.from_pretrained(str(graft_runs[f"{name}-sibling"].parent / "hf" / f"{name}-sibling"))
    with torch.no_grad():
        table = sib.get_input_embeddings().weight
        table.add_(0.1 * table.std() * torch.randn(table.shape, generator=torch.Generator().manual_seed(3)))
    sib.save_pretrained(str(hf_dir))
    for f in (graft_runs[f"{name}-sibling"].parent / "hf" / f"{name}-sibling").glob("*token*"):
        shutil.copy(f, hf_dir)
    moved = tmp_path / "moved"
    import_hf(hf_dir, moved)
    artifact = _artifact(graft_runs, name, "expand")
    assert main(["export-hf", "--primary", str(moved), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"graft: {moved} is a sibling of" in said
    assert ("they are its output projection too (tied)" in said) == (name == "qwen2")
    art, tok, meta = read_artifact(artifact)
    rows = meta["source_vocab_size"]
    cfg, own = LLAMA.primary_model(*load_weights(moved))
    word = LLAMA.word
    assert not torch.equal(own[word][:rows], art["word_embeddings"][:rows])  # the rows did move from the base's
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    sp = load(tok)
    to_hf = torch.as_tensor(getattr(sp, "hf_ids", range(art["word_embeddings"].shape[0])))
    exported = hf.get_input_embeddings().weight.detach()[to_hf]  # in mmadapt's order
    assert torch.equal(exported[:rows], own[word][:rows])
    assert torch.equal(exported[rows:], art["word_embeddings"][rows:])
    model = LlamaLM(dataclasses.replace(cfg, vocab_size=len(to_hf), hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict({**own, **artifact_state(LLAMA, art, meta, own)})
    ids = torch.tensor([sp.encode("Im Anfang schuf Gott Himmel und Erde.")])
    with torch.no_grad():
        mine = model.heads.heads[0](model.hidden_states(ids)[-1][0], model.output_weight)
        theirs = hf(input_ids=to_hf[ids[0]][None]).logits[0][:, to_hf]
    assert (mine - theirs).abs().max().item() <= 1e-5


def test_a_sibling_with_other_positions_or_norms_is_grafted_with_a_warning(graft_runs, tmp_path, capsys):
    """A sibling of the same shapes whose rotary base and norm epsilon differ from the base's (a
    long-context fine-tune, say): grafted, each difference named in a warning."""
    from hf_models import damaged_copy
    from mmadapt.hf import import_hf

    hf_dir = damaged_copy(graft_runs["llama2-sibling"].parent / "hf" / "llama2-sibling", tmp_path / "hf-theta",
                          {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "rms_norm_eps": 1e-5})
    import_hf(hf_dir, tmp_path / "theta")
    capsys.readouterr()
    assert main(["export-hf", "--primary", str(tmp_path / "theta"), "--embeddings",
                 str(_artifact(graft_runs, "llama2", "expand")), "--graft", "--output_dir", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "warning: its rotary_base is 500000.0, the base's 10000.0" in said, said
    assert "warning: its layernorm_epsilon is 1e-05, the base's 1e-06" in said
    assert "max_position_embeddings" not in said


CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _instruct(graft_runs, out: Path) -> Path:
    """The Qwen2 sibling's weights with an instruct model's tokenizer (Qwen2-Instruct's settings):
    eos <|im_end|>, the end of a turn, where the base's is <|endoftext|>, the end of a document;
    pad <|endoftext|>; a chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(graft_runs["qwen2-base"].parent / "hf" / "qwen2-sibling", out)
    tok = AutoTokenizer.from_pretrained(str(out), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT
    tok.save_pretrained(str(out))
    # its generation settings as Qwen2-Instruct's (both ends stop generating), with a temperature
    # and no do_sample, as some chat models ship them (transformers loads that with a warning and
    # refuses to save it edited), and a setting that names pieces by id
    ends = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": ends, "pad_token_id": ends[1], "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05,
        "suppress_tokens": [ends[1]]}))
    return out


def test_an_instruct_sibling_grafts_once_imported_with_its_bases_roles(graft_runs, tmp_path, capsys):
    """An instruct sibling's tokenizer names another eos than its base's, so its import gives
    mmadapt's roles other rows and no piece keeps its id: the graft is refused in one line naming
    import-hf --roles_from. Imported with the base's roles, it grafts: the export's weights are
    those of the graft into the same weights under the base's tokenizer settings, bit for bit,
    and its tokenizer keeps the instruct model's eos, pad and chat template (and, as the base's
    export, no bos: Qwen2 has none, where mmadapt's <s> borrowed a row)."""
    from transformers import AutoConfig, AutoTokenizer
    from safetensors.torch import load_file

    base, artifact = graft_runs["qwen2-base"], _artifact(graft_runs, "qwen2", "expand")
    instruct = _instruct(graft_runs, tmp_path / "hf-instruct")
    assert main(["import-hf", "--model", str(instruct), "--output_dir", str(tmp_path / "plain")]) == 0
    export = ["export-hf", "--embeddings", str(artifact), "--graft", "--output_dir"]
    capsys.readouterr()
    assert main([*export, str(tmp_path / "no"), "--primary", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--roles_from {base}" in err and "eos <|im_end|>" in err, err
    assert not (tmp_path / "no").exists()
    # another vocabulary is refused by --roles_from itself, nothing written
    llama = graft_runs["qwen2-base"].parent / "hf" / "llama2-sibling"
    assert main(["import-hf", "--model", str(llama), "--output_dir", str(tmp_path / "bad"), "--roles_from",
                 str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has another vocabulary than that run's model" in err, err
    assert not (tmp_path / "bad").exists()

    assert main(["import-hf", "--model", str(instruct), "--output_dir", str(tmp_path / "roles"), "--roles_from",
                 str(base)]) == 0
    record = json.loads((tmp_path / "roles" / "run.json").read_text())["imported_from"]
    assert record["special_ids"]["eos"]["token"] == "<|endoftext|>" and record["roles_from"] == str(base.resolve())
    assert main([*export, str(tmp_path / "graft"), "--primary", str(tmp_path / "roles")]) == 0
    assert main([*export, str(tmp_path / "ref"), "--primary", str(graft_runs["qwen2-sibling"])]) == 0
    mine, ref = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("graft", "ref"))
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in mine)
    tok, ref_tok = (AutoTokenizer.from_pretrained(str(tmp_path / d)) for d in ("graft", "ref"))
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.chat_template) == ("<|im_end|>", "<|endoftext|>",
                                                                                  None, CHAT)
    assert (ref_tok.eos_token, ref_tok.pad_token, ref_tok.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    assert tok.get_vocab() == ref_tok.get_vocab()  # the same merged vocabulary, new pieces and all
    cfg = AutoConfig.from_pretrained(str(tmp_path / "graft"))
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>") and cfg.bos_token_id is None
    # and the instruct model's generation settings (both ends stop it; sampled), as its own file says
    assert json.loads((tmp_path / "graft" / "generation_config.json").read_text()) == json.loads(
        (instruct / "generation_config.json").read_text())
    # a replaced vocabulary's export: the same settings, its special ids the new tokenizer's
    replaced = ["export-hf", "--embeddings", str(_artifact(graft_runs, "qwen2", "replace")), "--graft"]
    assert main([*replaced, "--output_dir", str(tmp_path / "replaced"), "--primary", str(tmp_path / "roles")]) == 0
    new_tok = AutoTokenizer.from_pretrained(str(tmp_path / "replaced"))
    generation = json.loads((tmp_path / "replaced" / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (new_tok.eos_token_id, new_tok.pad_token_id)
    assert (generation["temperature"], generation["top_p"]) == (0.7, 0.8) and "suppress_tokens" not in generation


def test_evaluate_scores_the_graft_in_bits_per_byte_beside_the_siblings_own(graft_runs, de_corpus, de_tokenizer,
                                                                             tmp_path, capsys, monkeypatch):
    """`evaluate --plugin_data --graft`: the base's German artifacts through the sibling, with no
    adaptation the sibling's own tokenizer and embeddings (not the base's); without --graft,
    refused in one line naming it. Its bits-per-byte rows in batches of --eval_batch_tokens."""
    import json

    from mmadapt import bpb
    from mmadapt.bpb import ByteScorer
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import prepare
    from mmadapt.heldout import Primary, Scorer

    data = tmp_path / "de"
    prepare(de_corpus, data, None, tokenizer=de_tokenizer, quiet=True, cfg=PreprocessConfig(workers=1,
                                                                                            valid_fraction=0.1))
    sibling, runs = graft_runs["llama2-sibling"], str(graft_runs["llama2-replace"])
    argv = ["evaluate", "--primary", str(sibling), "--embeddings", runs, "--plugin_data", str(data),
            "--seq_length", "32", "--plugin_blocks", "16", "--bpb_bytes", "1024"]
    assert main([*argv, "--output", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "score the graft with --graft" in err
    assert not (tmp_path / "no.json").exists()
    sizes, batches = [], bpb.batches
    monkeypatch.setattr(bpb, "batches", lambda rows, batch_tokens: sizes.append(batch_tokens) or batches(rows,
                                                                                                        batch_tokens))
    assert main([*argv, "--graft", "--eval_batch_tokens", "256", "--output", str(tmp_path / "r.json")]) == 0
    assert sizes and set(sizes) == {256}
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert f"graft: {sibling} is a sibling of" in out and "## bits per byte of held-out text" in out
    records = json.loads((tmp_path / "r.json").read_text())
    assert [r["step"] for r in records] == [0, 2]
    system = json.loads((Path(runs) / "run.json").read_text())["system"]
    assert {(r["system"], r["grafted_into"]) for r in records} == {(f"{system} [graft into {sibling.name}]",
                                                                    str(sibling))}
    # the same embeddings through the base itself, reported beside the graft: two curves, not one
    assert main(["evaluate", "--primary", str(graft_runs["llama2-base"]), *argv[3:], "--output",
                 str(tmp_path / "base.json")]) == 0
    assert "grafted_into" not in json.loads((tmp_path / "base.json").read_text())[0]
    assert main(["report", str(tmp_path / "r.json"), str(tmp_path / "base.json"), "--output",
                 str(tmp_path / "report.md")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert f"| {system} [graft into {sibling.name}] |" in report and f"| {system} |" in report
    per_byte = {name: ByteScorer(Scorer(Primary.read(graft_runs[name])), 32, 1024) for name in
                ("llama2-sibling", "llama2-base")}
    none = {name: s.none(s.text(data)) for name, s in per_byte.items()}
    assert all(r["none_bpb"] == pytest.approx(none["llama2-sibling"], rel=1e-6) for r in records)
    assert abs(none["llama2-sibling"] - none["llama2-base"]) > 1e-3  # the sibling's own, not the base's
    assert all(0 < r["bpb"] < 16 for r in records)


def test_extend_into_a_sibling_grafts_and_scores_it(graft_runs, corpus, de_corpus, tmp_path, capsys, monkeypatch):
    """`mmadapt extend --into`: the extension of the tiny Qwen2 base (schedules of 2 updates) also
    grafted into its sibling, scored through it beside its own no adaptation; a model that is
    not a sibling is refused in one line before anything trains, and leaves nothing behind; a
    later call may change --into, and a refused one leaves the last graft as it was; an instruct
    sibling is imported with the base's special roles (import-hf --roles_from). A model directory
    is known by its files, not its path (sources.json): the same --into saved again is imported,
    exported and scored again, a repeated call scores nothing, and --model saved again is
    refused in one line, nothing written; an extension from before sources.json has its --model
    taken as it is and its sibling imported again."""
    hf = graft_runs["qwen2-base"].parent / "hf"
    base = tmp_path / "qwen2-base"  # a copy: saved again below
    shutil.copytree(hf / "qwen2-base", base)
    argv = ["extend", "--model", str(base), "--lang", "de", "--corpus", str(de_corpus),
            "--source_corpus", str(corpus), "--vocab_size", "500", "--minipost_iters", "2", "--adapt_iters", "2",
            "--batch", "4", "--seq_length", "32", "--plugin_eval_blocks", "8", "--bpb_bytes", "512"]
    bad = tmp_path / "new" / "deep" / "bad"
    assert main([*argv, "--output_dir", str(bad), "--into", str(hf / "llama2-sibling")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a sibling of" in err, err
    assert not (tmp_path / "new").exists()  # the imports it made before the check are gone with it, and its parents
    # a copy of --model (the same files elsewhere) is --model itself: refused as that before anything
    # trains (it passed the check, trained, and the graft at the end refused, naming a --graft)
    assert main([*argv, "--output_dir", str(bad), "--into", str(hf / "qwen2-base")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --into {hf / 'qwen2-base'} holds the same weights as --model {base} (a copy of it): its extension "
        "is <output_dir>/export; drop --into (it takes a model fine-tuned from --model)")
    assert not (tmp_path / "new").exists()
    # ... judged as the graft at the end judges it (the sampled fingerprint): a sibling whose changes
    # all fall between the sampled elements is refused up front as well, not after Step 2
    from safetensors.torch import load_file, save_file

    from mmadapt.run import SAMPLED_ELEMENTS
    sparse = tmp_path / "sparse"
    shutil.copytree(hf / "qwen2-base", sparse)
    state = load_file(sparse / "model.safetensors")
    flat = state["model.layers.0.mlp.down_proj.weight"].reshape(-1).clone()
    between = torch.ones(flat.numel(), dtype=torch.bool)
    between[torch.linspace(0, flat.numel() - 1, SAMPLED_ELEMENTS).long()] = False
    assert between.any()
    flat[between] += 0.05
    state["model.layers.0.mlp.down_proj.weight"] = flat.reshape(state["model.layers.0.mlp.down_proj.weight"].shape)
    save_file(state, str(sparse / "model.safetensors"), metadata={"format": "pt"})
    assert main([*argv, "--output_dir", str(bad), "--into", str(sparse)]) == 2
    assert "holds the same weights as --model" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    out = tmp_path / "ext"
    assert main([*argv, "--output_dir", str(out), "--into", str(hf / "qwen2-sibling")]) == 0
    said = capsys.readouterr().out
    assert "is a sibling of" in said and f"Grafted into {hf / 'qwen2-sibling'}: de at " in said
    assert (out / "export-into" / "config.json").is_file() and (out / "export" / "config.json").is_file()

    def imported_from(run):
        return json.loads((run / "run.json").read_text())["imported_from"]["model"]

    # --into changed on a later call: the new sibling (the same weights elsewhere) is imported and
    # grafted, and that is the one named; nothing trains again
    other = tmp_path / "sibling-copy"
    shutil.copytree(hf / "qwen2-sibling", other)
    assert main([*argv, "--output_dir", str(out), "--into", str(other)]) == 0
    said = capsys.readouterr().out
    assert f"with one into {other}" in said and f"Grafted into {other}: de at " in said
    assert said.count("done already") == 2 and "Step 2:" in said  # Step 1b and Step 2 kept
    assert imported_from(out / "sibling") == str(other)
    assert json.loads((out / "exports.json").read_text())["export-into"]["imported_from"] == str(other)
    # a model that is not a sibling, on a continued extension: refused in one line naming it,
    # the last sibling and its graft left as they were
    graft_config = (out / "export-into" / "config.json").stat().st_mtime_ns
    assert main([*argv, "--output_dir", str(out), "--into", str(hf / "llama2-sibling")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a sibling of" in err and "llama2-sibling" in err, err
    assert imported_from(out / "sibling") == str(other) and not (out / "sibling.new").exists()
    assert (out / "export-into" / "config.json").stat().st_mtime_ns == graft_config
    # the same extension from another working directory, its paths relative: continued, not refused
    monkeypatch.chdir(tmp_path)
    relative = [a if not a.startswith("/") else os.path.relpath(a) for a in argv]
    summary = (out / "summary.json").stat().st_mtime_ns
    graft = (out / "graft.json").stat().st_mtime_ns
    assert main([*relative, "--output_dir", "ext", "--into", str(other)]) == 0
    said = capsys.readouterr().out
    assert f"Grafted into {other}: de at " in said and "export the extended model" not in said
    assert (out / "summary.json").stat().st_mtime_ns == summary  # its summary kept, not scored again
    assert (out / "graft.json").stat().st_mtime_ns == graft  # and the graft's scores
    # the same --into saved again with other weights: imported, exported and scored again
    scores, exported = json.loads((out / "graft.json").read_text()), (out / "export-into" / "config.json")
    _save_scaled(other, 1.05)
    assert main([*relative, "--output_dir", "ext", "--into", str(other)]) == 0
    said = capsys.readouterr().out
    assert f"import the sibling {other} again (its files changed" in said and "with the one as it is now" in said
    assert said.count("done already") == 2 and (out / "summary.json").stat().st_mtime_ns == summary
    now = json.loads((out / "graft.json").read_text())
    assert now["graft_bpb"] != scores["graft_bpb"] and now["graft_no_adaptation_bpb"] != scores[
        "graft_no_adaptation_bpb"]
    assert exported.stat().st_mtime_ns != graft_config
    graft_config = exported.stat().st_mtime_ns
    # a copy of the directory, continued: its kept summary names the copy's export, not the original's
    shutil.copytree(out, tmp_path / "ext-copy")
    assert main([*relative, "--output_dir", "ext-copy", "--into", str(other)]) == 0
    said = capsys.readouterr().out
    assert "\nExtended model: ext-copy/export\n" in said and f"Extended model: {out}" not in said, said
    # a refusal there names the models as given, not the runs made of them
    assert main([*relative, "--output_dir", "ext", "--into", str(hf / "llama2-sibling")]) == 2
    err = capsys.readouterr().err
    assert f"--into {hf / 'llama2-sibling'} is not a sibling of --model {base}" in err, err
    # a stop between Step 2's last checkpoint and its artifact: the next call writes the artifact
    final = out / "adapt" / "embeddings" / "step00000002"
    shutil.rmtree(final)
    assert main([*relative, "--output_dir", "ext", "--into", str(other)]) == 0
    assert (final / "embeddings.pt").is_file() and "Grafted into" in capsys.readouterr().out
    # an instruct sibling (another eos): imported again with the base's roles, and grafted
    instruct = _instruct(graft_runs, tmp_path / "hf-instruct")
    assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 0
    assert f"Grafted into {instruct}: de at " in capsys.readouterr().out
    assert json.loads((out / "sibling" / "run.json").read_text())["imported_from"]["roles_from"] == str(
        (out / "import").resolve())
    # --model saved again: refused in one line (the extension trained over it as it was), nothing written
    sources = (out / "sources.json").read_bytes()
    kept = shutil.copytree(base, tmp_path / "base-kept")
    _save_scaled(base, 1.05)
    assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and f"--model {base} changed since this extension read it (model." in err, err
    assert (out / "sources.json").read_bytes() == sources and "[extend" not in captured.out
    shutil.rmtree(base)
    shutil.copytree(kept, base)  # restored: continued as before
    assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 0
    assert "Grafted into" in capsys.readouterr().out
    # an extension from before sources.json: --model taken as it is, the sibling imported again
    (out / "sources.json").unlink()
    assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 0
    said = capsys.readouterr().out
    assert "again (no record of the files it was imported from)" in said and said.count("done already") == 2
    assert set(json.loads((out / "sources.json").read_text())) == {"model", "into"}
    # --model's record is written before its import: an import that stops leaves it recorded
    import mmadapt.extend

    def stopped(*a, **k):
        raise ValueError("the import stopped")

    shutil.rmtree(out / "import")
    (out / "sources.json").unlink()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mmadapt.extend, "import_any", stopped)
        assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 2
    assert "the import stopped" in capsys.readouterr().err and not (out / "import").exists()
    assert set(json.loads((out / "sources.json").read_text())) == {"model"}
    assert main([*relative, "--output_dir", "ext", "--into", str(instruct)]) == 0  # imported again, nothing trains
    assert capsys.readouterr().out.count("done already") == 2
    # a moved extension (its artifacts name their runs where they were), grafted into another
    # sibling: refused in one line, the last graft left as it was
    moved = shutil.move(out, tmp_path / "ext-moved")
    exported = (moved / "export-into" / "config.json").read_bytes()
    assert main([*relative, "--output_dir", "ext-moved", "--into", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no run.json now (moved or deleted?)" in err, err
    assert (moved / "export-into" / "config.json").read_bytes() == exported


def _save_scaled(model_dir: Path, scale: float) -> None:
    """`model_dir` saved again (save_pretrained) with one MLP's output weights scaled: a fine-tune
    that moved, under the same path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(str(model_dir))


def test_a_sigterm_while_extend_scores_its_summary_stops_it_for_the_same_command(graft_runs, corpus, de_corpus,
                                                                                   tmp_path, capsys, monkeypatch):
    """extend exports and scores its summary (bits per byte three times) after Step 2's last
    checkpoint: a SIGTERM there killed it with 143 and no word. It stops as a training loop does
    (75, one line: the same command again); run again, it trains nothing and gives the summary."""
    from conftest import sigterm_before
    from mmadapt import extend

    argv = ["extend", "--model", str(graft_runs["qwen2-base"].parent / "hf" / "qwen2-base"), "--lang", "de",
            "--corpus", str(de_corpus), "--source_corpus", str(corpus), "--vocab_size", "500", "--minipost_iters", "2",
            "--adapt_iters", "2", "--batch", "4", "--seq_length", "32", "--bpb_bytes", "512",
            "--output_dir", str(tmp_path / "ext")]
    summary = extend._summary
    monkeypatch.setattr(extend, "_summary", sigterm_before(summary, wait=2))
    assert main(argv) == 75
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("stopped by SIGTERM at update 2: checkpoint "
                                                                "step00000002 is complete; run the same command "
                                                                "again to continue")
    logged = (tmp_path / "ext" / "adapt" / "metrics.jsonl").read_text()
    monkeypatch.setattr(extend, "_summary", summary)
    assert main(argv) == 0
    assert "done already" in capsys.readouterr().out and (tmp_path / "ext" / "summary.json").is_file()
    assert (tmp_path / "ext" / "adapt" / "metrics.jsonl").read_text() == logged  # nothing trained again


def test_extend_refuses_a_target_corpus_it_cannot_prepare_before_anything_trains(graft_runs, corpus, de_corpus,
                                                                                 tmp_path, capsys, monkeypatch):
    """The target corpus is prepared right after the import: one with no document for the 3%
    held out (no blank line: one document), or too small for --vocab_size, is refused in one line
    naming extend's own fix, before any training, and the output directory is gone with it (so
    the fix, another --vocab_size, is a new extension, not one refused as changed)."""
    hf = graft_runs["qwen2-base"].parent / "hf"
    one_doc = tmp_path / "one.txt"
    one_doc.write_text("".join(f"Das ist der Satz Nummer {i} im kleinen Korpus.\n" for i in range(300)))
    argv = ["extend", "--model", str(hf / "qwen2-base"), "--lang", "de", "--source_corpus", str(corpus),
            "--minipost_iters", "2", "--adapt_iters", "2", "--batch", "4", "--seq_length", "32"]
    out = tmp_path / "ext"
    for vocab, fix in (("60", "extend holds out 3% of its documents"), ("5000", "pass --vocab_size")):
        assert main([*argv, "--corpus", str(one_doc), "--vocab_size", vocab, "--output_dir", str(out)]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and fix in err, err
        assert "Step 1b" not in captured.out and not out.exists()
    # A flag of a stage this extension does not run: refused (it trained nothing, and recorded it
    # made a later call without it another extension's), nothing left
    i = argv.index("--minipost_iters")
    bl_base = [*argv[:i], *argv[i + 2:], "--system", "bl_base"]
    for extra, message in (([*argv, "--system", "bl_base"], "--minipost_iters 2 is for Step 1b, which --system "
                            "bl_base does not run: drop it"),
                           ([*argv, "--head_iters", "3"], f"--head_iters 3 is for fit-head, which {hf / 'qwen2-base'}"
                            " needs not (it has its own MLM head): drop it"),
                           (bl_base, f"--source_corpus {corpus} is for fit-head and Step 1b, neither of which runs "
                            f"here (--system bl_base; {hf / 'qwen2-base'} has its MLM head): drop it")):
        assert main([*extra, "--corpus", str(de_corpus), "--vocab_size", "60", "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {message}" and not out.exists(), err
    # MMADAPT_TINY=1 caps a stage's updates by default (head_iters 500 -> 8): no flag given, so
    # extend goes on to the corpus (this one refused there), where it refused '--minipost_iters 8'
    monkeypatch.setenv("MMADAPT_TINY", "1")
    assert main([*bl_base[:bl_base.index("--source_corpus")], "--system", "bl_base", "--corpus", str(one_doc),
                 "--vocab_size", "60", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "extend holds out 3% of its documents" in err and not out.exists(), err
    monkeypatch.delenv("MMADAPT_TINY")
    # A decoder's Step 2 cuts whole blocks of --seq_length from the text: too short for one is refused
    # with the corpus (it was refused when Step 2 started, after Step 1b, and the fix it named, a lower
    # --seq_length, was then refused as another extension's). "Das Wort 26." starts the held-out
    # document (data.is_validation_document); the 4 others hold ~40 pieces.
    short = tmp_path / "short.txt"
    short.write_text("".join(f"Das Wort {i}.\n\n" for i in (26, *range(4))))
    for seq_length, code in (("64", 2), ("16", 0)):  # (20 pieces: all SentencePiece finds in it)
        capsys.readouterr()
        code_got = main([*argv, "--corpus", str(short), "--vocab_size", "20", "--output_dir", str(out),
                         "--seq_length", seq_length, "--bpb_bytes", "256"])
        captured = capsys.readouterr()
        assert code_got == code, captured.err
        if code:
            err = captured.err.strip()
            assert len(err.splitlines()) == 1 and "holds no blocks of 64" in err and "lower --seq_length" in err, err
            assert "Step 1b" not in captured.out and not out.exists()
    shutil.rmtree(out)
    # --vocab_mode expand over the tied Qwen2 with subword_mean's start: refused before Step 1b
    # (it was refused when Step 2 started, and extend had no flag to pass its fix), then taken
    # with the flag the refusal names
    german = tmp_path / "de.txt"
    shutil.copyfile(de_corpus, german)
    expand = [*argv, "--corpus", str(german), "--vocab_size", "500", "--vocab_mode", "expand",
              "--plugin_eval_blocks", "8", "--bpb_bytes", "512", "--output_dir", str(out)]
    assert main(expand) == 2
    captured = capsys.readouterr()
    assert "pass --expand_output_start embedding_init" in captured.err and "Step 1b" not in captured.out
    assert not out.exists()
    assert main([*expand, "--expand_output_start", "embedding_init"]) == 0
    # the corpus edited since: the continued extension refuses it (its data were reused as prepared)
    with open(german, "a", encoding="utf-8") as f:
        f.write("Ein neuer Satz am Ende.\n")
    capsys.readouterr()
    assert main([*expand, "--expand_output_start", "embedding_init"]) == 2
    assert "changed since this extension prepared it" in capsys.readouterr().err


def _base_copy(graft_runs, tmp_path) -> tuple[Path, Path, Path, dict]:
    """A copy of the Qwen2 base and of a replace artifact naming it -> (base, its sibling, the
    artifact, its meta.json): the shared runs stay as they are for the other tests (pytest-xdist
    workers read them while one of these edits its copy)."""
    base, artifact = tmp_path / "qwen2-base", tmp_path / "artifact"
    shutil.copytree(graft_runs["qwen2-base"], base)
    shutil.copytree(_artifact(graft_runs, "qwen2", "replace"), artifact)
    meta = {**read_artifact(artifact)[2], "source": str(base)}
    (artifact / "meta.json").write_text(json.dumps(meta))
    return base, graft_runs["qwen2-sibling"], artifact, meta


def test_a_graft_over_a_base_changed_since_step2_is_refused(graft_runs, tmp_path, capsys):
    """The artifact records its base's weights (primary_fingerprint, and the sampled one a load
    checks): other weights of the same shapes under the base's path, and export-hf --graft and
    the sibling check refuse in one line, nothing written, for an artifact written before the
    sampled fingerprint too (by the full one); with the base restored, the graft exports."""
    import json
    import shutil

    from mmadapt.checkpoint import write_weights_only

    from mmadapt.artifact import SAMPLED_KEY

    base, sibling, artifact, meta = _base_copy(graft_runs, tmp_path)
    assert meta["primary_fingerprint"] and meta[SAMPLED_KEY]
    # an artifact written before the sampled fingerprint: checked by the full one
    older = tmp_path / "older"
    shutil.copytree(artifact, older)
    (older / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != SAMPLED_KEY}))
    _, state = load_weights(base)
    kept = tmp_path / "kept"
    shutil.move(base / "checkpoints", kept)
    try:
        write_weights_only(base / "checkpoints", 0, {k: v + 0.01 for k, v in state.items()},
                           json.loads((base / "run.json").read_text())["model"])
        for embeddings in (artifact, older):
            argv = ["export-hf", "--primary", str(sibling), "--embeddings", str(embeddings), "--graft",
                    "--output_dir", str(tmp_path / "out")]
            capsys.readouterr()
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert "have changed since" in err and str(base) in err and err.count("\n") == 1
            assert not (tmp_path / "out").exists()
    finally:
        shutil.rmtree(base / "checkpoints")
        shutil.move(kept, base / "checkpoints")
    assert main(argv) == 0 and (tmp_path / "out" / "config.json").is_file()


def test_a_byte_identical_copy_of_the_base_is_the_base_for_every_command(graft_runs, tmp_path, capsys):
    """The base imported (or copied) again at another path holds the weights Step 2 recorded: it is
    the model the artifact was trained for, by content, for export-hf and predict as for evaluate
    (PrimaryRef.same): exported without --graft, and --graft refused (export-hf and predict asked
    for --graft by path while evaluate refused it by content)."""
    base, artifact = graft_runs["qwen2-base"], _artifact(graft_runs, "qwen2", "replace")
    copy = shutil.copytree(base, tmp_path / "copy")
    out = {}
    for name, primary in (("base", base), ("copy", copy)):
        out[name] = tmp_path / f"out-{name}"
        assert main(["export-hf", "--primary", str(primary), "--embeddings", str(artifact),
                     "--output_dir", str(out[name])]) == 0
    weights = sorted(p.name for p in out["base"].iterdir() if p.suffix == ".safetensors")
    assert weights and all((out["base"] / w).read_bytes() == (out["copy"] / w).read_bytes() for w in weights)
    capsys.readouterr()
    assert main(["export-hf", "--primary", str(copy), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(tmp_path / "grafted")]) == 2
    err = capsys.readouterr().err
    assert "drop --graft" in err and err.count("\n") == 1 and not (tmp_path / "grafted").exists()
    texts = ["Im Anfang schuf Gott Himmel und Erde."]
    mine, theirs = (predict.load(run, artifact, device="cpu").logits(texts) for run in (copy, base))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match="drop --graft"):
        predict.load(copy, artifact, graft=True)
    # weights that differ from the recorded ones at the copy's path are not the base: a graft's
    _, state = load_weights(copy)
    shutil.rmtree(copy / "checkpoints")
    from mmadapt.checkpoint import write_weights_only
    write_weights_only(copy / "checkpoints", 0, {k: v + 0.01 for k, v in state.items()},
                       json.loads((copy / "run.json").read_text())["model"])
    with pytest.raises(ValueError, match="pass --graft"):
        predict.load(copy, artifact)


def test_the_sibling_check_reads_each_artifacts_record_not_only_its_bases_first(graft_runs, tmp_path, capsys):
    """Two artifacts over one base whose Step 2 recorded the base's weights differently (here one
    edited to say so): the check refuses in either order (it once ran per base, with the first
    artifact's record), and prints the base's distances once."""
    from mmadapt.artifact import SAMPLED_KEY, PrimaryRef
    from mmadapt.evaluate import graft_check

    artifact = _artifact(graft_runs, "qwen2", "replace")
    meta = read_artifact(artifact)[2]
    other = tmp_path / "other"
    shutil.copytree(artifact, other)
    (other / "meta.json").write_text(json.dumps({**meta, SAMPLED_KEY: "0" * 64, "primary_fingerprint": "0" * 64}))
    sibling = PrimaryRef(graft_runs["qwen2-sibling"])
    first = sorted((graft_runs["qwen2-replace"] / "embeddings").iterdir())[0]
    graft_check([first, artifact], sibling)
    assert capsys.readouterr().out.count("is a sibling of") == 1
    for paths in ([artifact, other], [other, artifact]):
        with pytest.raises(ValueError, match="have changed since"):
            graft_check(paths, sibling)


def test_step2_over_an_imported_decoder_packs_its_blocks_as_its_tokenizer_lays_out_text(graft_runs):
    """Step 2 over an imported decoder trains on blocks laid out as the source's tokenizer lays
    out a text (data.LayoutBatches), recorded in its run.json: Llama-2's <s> before each
    document, nothing for Qwen2 (its end-of-text between documents)."""
    import json

    from mmadapt.tokens import BOS_ID

    for name, prefix in (("llama2", [BOS_ID]), ("qwen2", [])):
        for mode in ("replace", "expand"):
            record = json.loads((graft_runs[f"{name}-{mode}"] / "run.json").read_text())
            assert record["text_layout"] == {"prefix": prefix, "suffix": []}, (name, mode)


@pytest.mark.parametrize("name, first", [("llama2", "bos"), ("qwen2", "eos")])
def test_an_exported_step2_vocabulary_prompts_as_its_blocks_started(name, first, graft_runs, tmp_path):
    """export-hf of an imported decoder with its German Step-2 vocabulary: the tokenizer starts a
    text as Step 2's blocks started a document (Llama-2: its <s>, the bos; Qwen2: the end-of-text
    that closed the document before, </s>, as GPT-2's <|endoftext|>)."""
    from transformers import AutoTokenizer

    from mmadapt.tokens import BOS_ID, EOS_ID

    artifact = _artifact(graft_runs, name, "replace")
    out = tmp_path / "out"
    assert main(["export-hf", "--primary", str(graft_runs[f"{name}-base"]), "--embeddings", str(artifact),
                 "--output_dir", str(out)]) == 0
    tok, sp = AutoTokenizer.from_pretrained(str(out)), load(read_artifact(artifact)[1])
    text = "Im Anfang schuf Gott Himmel und Erde."
    start = {"bos": BOS_ID, "eos": EOS_ID}[first]
    assert tok(text).input_ids == [start, *sp.encode(text)] and tok.bos_token_id == start


# --- an encoder base and its masked-LM sibling -----------------------------------------------------

@pytest.fixture(scope="module")
def encoder_pair(de_corpus, de_tokenizer, tmp_path_factory):
    """A tiny RoBERTa base (byte-level BPE) and two masked-LM siblings fine-tuned from it with
    transformers (hf_models.make_mlm_sibling: `sibling` with the output bias frozen,
    `sibling-bias` with it trained), imported; German Step-2 artifacts over the base (2 updates),
    `expand` and `replace`."""
    from conftest import REPO
    from hf_models import make_mlm_sibling, make_roberta
    from mmadapt import steps
    from mmadapt.hf import import_hf
    from mmadapt.models import PRESETS
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    root = tmp_path_factory.mktemp("encoder_graft")
    base = make_roberta(root / "hf" / "base")
    runs = {"base": root / "base", "hf": root / "hf"}
    import_hf(base, runs["base"])
    for name, train_bias in (("sibling", False), ("sibling-bias", True)):
        runs[name] = root / name
        import_hf(make_mlm_sibling(base, root / "hf" / name, train_bias=train_bias), runs[name])
    for mode in ("expand", "replace"):
        train = dataclasses.replace(PRESETS["tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                    seq_length=32, train_micro_batch_size_per_gpu=4, vocab_mode=mode)
        runs[mode] = root / mode
        steps.adapt_embeddings(run=RunSpec(output_dir=runs[mode], corpus=de_corpus, tokenizer=de_tokenizer,
                                           ds_config=REPO / "ds_configs" / "zero0.json"),
                               step=steps.AdaptEmbeddings(system="bl_base", source=runs["base"], lang="de",
                                                          train=train))
    return runs


@pytest.mark.parametrize("mode", ["expand", "replace"])
def test_an_encoders_graft_exports_what_mmadapt_computes(mode, encoder_pair, tmp_path, capsys):
    """The graft into a masked-LM sibling: transformers' logits of the exported directory are
    mmadapt's (the sibling's body and head, the artifact's rows); expand keeps the sibling's own
    source rows and output bias bit for bit."""
    from transformers import AutoModelForMaskedLM

    from mmadapt.models.roberta import ROBERTA
    from mmadapt.models.roberta.model import BIAS, RobertaMLM
    from mmadapt.tokens import BOS_ID, EOS_ID

    artifact = sorted((encoder_pair[mode] / "embeddings").iterdir())[-1]
    sibling, out = encoder_pair["sibling"], tmp_path / "out"
    assert main(["export-hf", "--primary", str(sibling), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"graft: {sibling} is a sibling of {encoder_pair['base']}" in said and "layers.0" in said
    art, tok, meta = read_artifact(artifact)
    cfg, own = ROBERTA.primary_model(*load_weights(sibling))
    state = {**own, **artifact_state(ROBERTA, art, meta, own)}
    vocab = art["word_embeddings"].shape[0]
    model = RobertaMLM(dataclasses.replace(cfg, vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict(state)
    hf = AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    sp = load(tok)
    to_hf = torch.as_tensor(getattr(sp, "hf_ids", range(vocab)))  # mmadapt id -> the exported id
    from transformers import AutoTokenizer

    exported, own_tok = (AutoTokenizer.from_pretrained(str(d)) for d in (out, sibling / "tokenizer" / "hf"))
    # the sibling's mask, cls and sep tokens (an expanded vocabulary's export lost them: no fill-mask)
    assert (exported.mask_token, exported.cls_token, exported.sep_token) == \
        (own_tok.mask_token, own_tok.cls_token, own_tok.sep_token) and exported.mask_token is not None
    for text in ("Im Anfang schuf Gott Himmel und Erde.", "In the beginning God created the heaven."):
        ids = torch.tensor([[BOS_ID, *sp.encode(text), EOS_ID]])  # <s> text </s>, mmadapt's ids
        with torch.no_grad():
            mine = model.heads.heads[-1](model.hidden_states(ids)[-1], model.word_embeddings.weight)[0]
            theirs = hf(input_ids=to_hf[ids[0]][None]).logits[0][:, to_hf]
        assert (mine - theirs).abs().max().item() <= 1e-5
    if mode == "expand":
        rows = own[ROBERTA.word].shape[0]
        assert torch.equal(state[ROBERTA.word][:rows], own[ROBERTA.word]) and torch.equal(state[BIAS][:rows], own[BIAS])
        sib = AutoModelForMaskedLM.from_pretrained(str(encoder_pair["hf"] / "sibling"))
        hf_rows = sib.get_input_embeddings().weight.shape[0]
        assert torch.equal(hf.get_input_embeddings().weight.detach()[:hf_rows], sib.get_input_embeddings().weight.detach())
        assert torch.equal(hf.get_output_embeddings().bias.detach()[:hf_rows], sib.get_output_embeddings().bias.detach())


def test_an_encoders_expand_graft_takes_the_siblings_own_rows_where_they_moved(encoder_pair, tmp_path, capsys):
    """The encoder siblings above froze their word embeddings, so their source rows are the base's
    (and the artifact's): a graft that took them from the artifact would pass there. Here the
    sibling's word embeddings (tied: its output projection too) moved, its bias did not: the
    export's source rows are the sibling's, its new rows the artifact's, and the bias the
    sibling's own followed by the artifact's new entries."""
    from transformers import AutoModelForMaskedLM

    from mmadapt.hf import import_hf
    from mmadapt.models.roberta import ROBERTA
    from mmadapt.models.roberta.model import BIAS

    sib = AutoModelForMaskedLM.from_pretrained(str(encoder_pair["hf"] / "sibling"))
    with torch.no_grad():
        table = sib.get_input_embeddings().weight
        table.add_(0.1 * table.std() * torch.randn(table.shape, generator=torch.Generator().manual_seed(3)))
    hf_dir, moved = tmp_path / "hf-moved", tmp_path / "moved"
    sib.save_pretrained(str(hf_dir))
    for f in (encoder_pair["hf"] / "sibling").iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, hf_dir)
    import_hf(hf_dir, moved)
    artifact = sorted((encoder_pair["expand"] / "embeddings").iterdir())[-1]
    assert main(["export-hf", "--primary", str(moved), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(tmp_path / "out")]) == 0
    assert "they are its output projection too (tied)" in capsys.readouterr().out
    art, tok, meta = read_artifact(artifact)
    rows = meta["source_vocab_size"]
    _, own = ROBERTA.primary_model(*load_weights(moved))
    assert not torch.equal(own[ROBERTA.word][:rows], art["word_embeddings"][:rows])  # they did move from the base's
    hf = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out"))
    to_hf = torch.as_tensor(getattr(load(tok), "hf_ids", range(art["word_embeddings"].shape[0])))
    exported = hf.get_input_embeddings().weight.detach()[to_hf]  # in mmadapt's order
    bias = hf.get_output_embeddings().bias.detach()[to_hf]
    assert torch.equal(exported[:rows], own[ROBERTA.word][:rows]) and torch.equal(bias[:rows], own[BIAS][:rows])
    assert torch.equal(exported[rows:], art["word_embeddings"][rows:]) and torch.equal(bias[rows:],
                                                                                       art["output_bias"][rows:])


def test_an_expand_graft_into_a_sibling_whose_output_bias_moved_is_refused(encoder_pair, tmp_path, capsys):
    """The new pieces' output bias was trained beside the base's source entries: a sibling that
    trained its own is refused for an expanded artifact in one line, nothing written; a replaced
    vocabulary brings its whole bias and is grafted."""
    sibling = encoder_pair["sibling-bias"]
    for mode, code in (("expand", 2), ("replace", 0)):
        artifact = sorted((encoder_pair[mode] / "embeddings").iterdir())[-1]
        out = tmp_path / mode
        assert main(["export-hf", "--primary", str(sibling), "--embeddings", str(artifact), "--graft",
                     "--output_dir", str(out)]) == code
        if code:
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "output bias" in err and "moved from the base's" in err, err
            assert not out.exists()
        else:
            assert (out / "config.json").is_file()


# --- a task model fine-tuned from an encoder base with transformers (hf_classifier.py) ---------------

@pytest.fixture(scope="module")
def classifiers(de_corpus, de_tokenizer, tmp_path_factory):
    """For a RoBERTa (byte-level BPE) and a BERT (WordPiece) base, imported: a German Step-2
    artifact over the base (replace, 2 updates), and a sequence classifier fine-tuned from the
    base with transformers (hf_models.make_classifier), its Hugging Face directory, `<name>-clf`."""
    from conftest import REPO
    from hf_models import make_bert, make_classifier, make_roberta
    from mmadapt import steps
    from mmadapt.hf import import_hf
    from mmadapt.models import PRESETS
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    root, runs = tmp_path_factory.mktemp("classifiers"), {}
    for name, make in (("roberta", make_roberta), ("bert", make_bert)):
        base = make(root / "hf" / name)
        runs[name] = root / name
        import_hf(base, runs[name])
        runs[f"{name}-clf"] = make_classifier(base, root / "hf" / f"{name}-clf")
        for mode, suffix in (("replace", ""), ("expand", "-expand")):
            train = dataclasses.replace(PRESETS["tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                        seq_length=32, train_micro_batch_size_per_gpu=4, vocab_mode=mode)
            runs[f"{name}-de{suffix}"] = root / f"{name}-de{suffix}"
            steps.adapt_embeddings(run=RunSpec(output_dir=runs[f"{name}-de{suffix}"], corpus=de_corpus,
                                               tokenizer=de_tokenizer, ds_config=REPO / "ds_configs" / "zero0.json"),
                                   step=steps.AdaptEmbeddings(system="bl_base", source=runs[name], lang="de",
                                                              train=train))
    return runs


TEXTS = ("In the beginning God created the heaven and the earth.", "Im Anfang schuf Gott Himmel und Erde.")


def _mine(run, texts, art=None, tok=None, meta=None):
    """The imported run's classifier logits [C] per text (its own tokenizer, or the artifact's
    `tok` with its word embeddings `art` swapped in: an expanded one's (`meta`) after the run's
    own source rows), in its labels' order."""
    from mmadapt.evaluate import load_finetuned

    ft = load_finetuned(run)
    if art is not None:
        rows = art["word_embeddings"]
        if (meta or {}).get("vocab_mode") == "expand":
            rows = torch.cat([ft.state[ft.family.word], rows[meta["source_vocab_size"]:]])
        ft.state = {**ft.state, ft.family.word: rows}
        ft.cfg = dataclasses.replace(ft.cfg, vocab_size=rows.shape[0])
    model = ft.family.build_task_model(dataclasses.replace(ft.cfg, hidden_dropout=0.0, attention_dropout=0.0),
                                       "classify", len(ft.labels)).eval()
    model.load_state_dict(ft.state)
    sp = load(tok or ft.tokenizer)
    out = []
    for text in texts:
        from mmadapt.tokens import BOS_ID, EOS_ID

        with torch.no_grad():
            out.append(model(torch.tensor([[BOS_ID, *sp.encode(text), EOS_ID]]))[1][0])
    return ft, out


def _assert_transformers_logits(hf_dir, mine) -> None:
    """transformers' classifier in `hf_dir`, with its own tokenizer, gives the logits `mine` [C]
    on each of TEXTS within 1e-5."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(str(hf_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    for text, logits in zip(TEXTS, mine):
        with torch.no_grad():
            theirs = hf(**tok(text, return_tensors="pt")).logits[0]
        assert (logits - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["roberta", "bert"])
def test_an_imported_classifier_gives_transformers_logits(name, classifiers, tmp_path, capsys):
    """import-hf --task of a sequence classifier: a Step-3 run whose labels are the classifier's
    outputs in its own order, and whose model gives transformers' logits on English and German."""
    from transformers import AutoConfig

    hf_dir, run = classifiers[f"{name}-clf"], tmp_path / "clf"
    assert main(["import-hf", "--model", str(hf_dir), "--task", "bible-genre", "--output_dir", str(run)]) == 0
    assert "as a bible-genre fine-tuning run" in capsys.readouterr().out
    id2label = AutoConfig.from_pretrained(str(hf_dir)).id2label
    ft, mine = _mine(run, TEXTS)
    assert ft.labels == [id2label[i] for i in range(len(ft.labels))] != sorted(ft.labels)
    _assert_transformers_logits(hf_dir, mine)


def test_a_camembert_classifier_imports(tmp_path, capsys):
    """A CamembertForSequenceClassification imports as the XLM-R one does: its encoder is a
    CamembertModel, taken headless (it was refused as an unknown class in a temporary directory)."""
    from hf_models import make_camembert, make_classifier

    hf_dir = make_classifier(make_camembert(tmp_path / "camembert"), tmp_path / "camembert-clf")
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["CamembertForSequenceClassification"]
    run = tmp_path / "clf"
    assert main(["import-hf", "--model", str(hf_dir), "--task", "bible-genre", "--output_dir", str(run)]) == 0
    assert "imported CamembertForSequenceClassification as a bible-genre fine-tuning run" in capsys.readouterr().out
    _assert_transformers_logits(hf_dir, _mine(run, TEXTS)[1])


def test_an_imported_classifier_reads_what_transformers_reads(tmp_path):
    """A classifier of 256 positions whose tokenizer sets no limit of its own reads a text of
    ~200 pieces whole in transformers (truncation=True); imported, it is recorded at seq_length
    256 and predict gives transformers' probabilities. It was recorded at Step 3's default, 128,
    and cut the text there."""
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaForSequenceClassification

    from hf_models import SHAPE, _perturb, bible_lines, make_xlmr

    tok = AutoTokenizer.from_pretrained(str(make_xlmr(tmp_path / "xlmr")))
    torch.manual_seed(0)
    hf = XLMRobertaForSequenceClassification(XLMRobertaConfig(
        vocab_size=len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2,
        **{**SHAPE, "max_position_embeddings": 258},
        num_labels=2, id2label={0: "old", 1: "new"}, label2id={"old": 0, "new": 1})).eval()
    _perturb(hf, 3)
    hf.save_pretrained(str(tmp_path / "clf"))
    tok.save_pretrained(str(tmp_path / "clf"))
    run = tmp_path / "run"
    assert main(["import-hf", "--model", str(tmp_path / "clf"), "--task", "bible-testament", "--output_dir",
                 str(run)]) == 0
    assert json.loads((run / "run.json").read_text())["finetune"]["seq_length"] == 256
    text = " ".join(bible_lines("en")[:6])
    whole, cut = (tok(text, truncation=True, max_length=n, return_tensors="pt") for n in (256, 128))
    assert 128 < whole.input_ids.shape[1] < 256
    with torch.no_grad():
        theirs, theirs_cut = (hf(**ids).logits.softmax(-1)[0].tolist() for ids in (whole, cut))
    mine = predict.load(run, device="cpu").predict([text])[0]["probs"]
    assert [mine["old"], mine["new"]] == pytest.approx(theirs, abs=1e-6)
    assert abs(theirs[0] - theirs_cut[0]) > 1e-5  # (what the cut text gave: another answer)


@pytest.mark.parametrize("name", ["roberta", "bert"])
def test_a_graft_into_an_imported_classifier_scores_and_exports(name, classifiers, tmp_path, capsys):
    """Step-2 embeddings trained over the base, grafted into the classifier fine-tuned from it:
    evaluate --graft prints the sibling check over the encoders and scores German zero-shot
    beside no adaptation (without --graft, refused in one line, nothing written); export-hf
    --finetuned --graft writes a classifier whose German logits are mmadapt's."""
    import json

    run = tmp_path / "clf"
    assert main(["import-hf", "--model", str(classifiers[f"{name}-clf"]), "--task", "bible-genre",
                 "--output_dir", str(run)]) == 0
    adapt = classifiers[f"{name}-de"]
    argv = ["evaluate", "--finetuned", str(run), "--embeddings", str(adapt), "--eval_file", "bible"]
    capsys.readouterr()
    assert main([*argv, "--output", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pass --graft" in err and not (tmp_path / "no.json").exists()
    assert main([*argv, "--graft", "--output", str(tmp_path / "r.json")]) == 0
    said = capsys.readouterr().out
    assert f"graft: {run / 'body'} is a sibling of {classifiers[name]}" in said and "word_embeddings" in said
    records = json.loads((tmp_path / "r.json").read_text())
    assert [r["system"] for r in records] == ["bl_base [graft into clf]"] * 2 + ["no_adaptation"]  # not the base's
    assert [r.get("grafted_into") for r in records] == [str(run)] * 2 + [None]
    assert all(r["lang"] == "de" and 0 <= r["score"] <= 100 for r in records)

    artifact = sorted((adapt / "embeddings").iterdir())[-1]
    out = tmp_path / "out"
    assert main(["export-hf", "--finetuned", str(run), "--embeddings", str(artifact), "--output_dir", str(out)]) == 2
    assert "pass --graft" in capsys.readouterr().err and not out.exists()
    assert main(["export-hf", "--finetuned", str(run), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(out)]) == 0
    art, tok, _ = read_artifact(artifact)
    _, mine = _mine(run, TEXTS, art, tok)
    _assert_transformers_logits(out, mine)
    grafted = predict.load(run, artifact, graft=True, device="cpu")  # predict --graft: the same classifier
    _assert_transformers_logits(out, grafted.logits(list(TEXTS))[2])


def _regression(base, tmp_path):
    """A one-output (regression) head on `base`: a cross-encoder's shape."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "regression"
    AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def test_an_imported_classifier_is_refused_in_one_line_where_it_cannot_be(classifiers, tmp_path, capsys):
    """No --task; a task whose labels are not the classifier's; --task for a model that is not a
    classifier; a one-output (regression) head; a graft into the classifier of another base: one
    line each, nothing written."""
    from hf_models import damaged_copy

    clf = classifiers["roberta-clf"]
    cases = [
        (["import-hf", "--model", str(clf)], "pass --task"),
        (["import-hf", "--model", str(clf), "--task", "bible-testament"], "are not bible-testament's"),
        (["import-hf", "--model", str(classifiers["roberta"].parent / "hf" / "roberta"), "--task", "bible-genre"],
         "drop --task"),
        (["import-hf", "--model", str(_regression(classifiers["roberta"].parent / "hf" / "roberta", tmp_path)),
          "--task", "classify"], "not a classifier of one label per text"),
        # the encoder's refusal named the temporary directory it was saved to, gone by then
        (["import-hf", "--model", str(damaged_copy(clf, tmp_path / "relu", {"hidden_act": "relu"})), "--task",
          "bible-genre"], f"error: {tmp_path / 'relu'} (the encoder of its RobertaForSequenceClassification): "
                          "hidden_act is 'relu'"),
    ]
    for i, (argv, said) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert main([*argv, "--output_dir", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
        assert not out.exists()
    run = tmp_path / "bert-clf"
    assert main(["import-hf", "--model", str(classifiers["bert-clf"]), "--task", "bible-genre",
                 "--output_dir", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "cross.json"
    assert main(["evaluate", "--finetuned", str(run), "--embeddings", str(classifiers["roberta-de"]), "--eval_file",
                 "bible", "--graft", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a sibling of" in err and not out.exists()


def test_an_imported_classifier_that_reads_other_logits_is_refused(classifiers, tmp_path, monkeypatch, capsys):
    """The import compares mmadapt's classifier with transformers' on the same texts: a mapping
    that passes every shape check and reads the text otherwise (the tokenizer's id permutation with the
    ordinary pieces' ids reversed) is refused in one line, and
    nothing is left."""
    from mmadapt import hf_classifier

    read = hf_classifier.HFTokenizer.read

    def reversed_ids(path):
        tok = read(path)
        tok.to_mmadapt[5:] = tok.to_mmadapt[5:][::-1].copy()
        return tok

    monkeypatch.setattr(hf_classifier.HFTokenizer, "read", staticmethod(reversed_ids))
    out = tmp_path / "clf"
    assert main(["import-hf", "--model", str(classifiers["roberta-clf"]), "--task", "bible-genre",
                 "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gives other logits than transformers'" in err, err
    assert not out.exists()


@pytest.mark.parametrize("name", ["roberta", "bert"])
def test_an_expanded_graft_keeps_the_classifiers_own_rows(name, classifiers, tmp_path, capsys):
    """An expanded vocabulary grafted into an imported classifier: its own (fine-tuned) source rows
    stay, bit for bit, and only the new pieces' rows come from the artifact, in evaluate and in
    the export, whose German logits are mmadapt's."""
    import json

    from transformers import AutoModelForSequenceClassification

    run = tmp_path / "clf"
    assert main(["import-hf", "--model", str(classifiers[f"{name}-clf"]), "--task", "bible-genre",
                 "--output_dir", str(run)]) == 0
    adapt = classifiers[f"{name}-de-expand"]
    assert main(["evaluate", "--finetuned", str(run), "--embeddings", str(adapt), "--eval_file", "bible", "--graft",
                 "--output", str(tmp_path / "r.json")]) == 0
    assert [r["system"] for r in json.loads((tmp_path / "r.json").read_text())] == (["bl_base [graft into clf]"] * 2
                                                                                   + ["no_adaptation"])
    artifact, out = sorted((adapt / "embeddings").iterdir())[-1], tmp_path / "out"
    assert main(["export-hf", "--finetuned", str(run), "--embeddings", str(artifact), "--graft",
                 "--output_dir", str(out)]) == 0
    art, tok, meta = read_artifact(artifact)
    _, mine = _mine(run, TEXTS, art, tok, meta)
    hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    own = AutoModelForSequenceClassification.from_pretrained(str(classifiers[f"{name}-clf"])).eval()
    rows = own.get_input_embeddings().weight.shape[0]
    assert torch.equal(hf.get_input_embeddings().weight.detach()[:rows], own.get_input_embeddings().weight.detach())
    _assert_transformers_logits(out, mine)
    # predict --graft: the classifier's own source rows there too, so transformers' logits again
    _assert_transformers_logits(out, predict.load(run, artifact, graft=True, device="cpu").logits(list(TEXTS))[2])


def test_an_expanded_graft_is_scored_on_the_source_language(classifiers, tmp_path, monkeypatch):
    """evaluate_artifacts(lang="en"): an expanded (German) artifact grafted into a classifier is
    scored on the English test file read by the artifact's merged tokenizer (what the graft costs
    the source task), beside the classifier's own English score; each is the accuracy of
    predict's forward with (without) the same graft. (This random classifier predicts one genre
    for every verse, so the read each score is drawn from is checked too.)"""
    from mmadapt import evaluate
    from mmadapt.tasks import get_task, read_examples

    run = tmp_path / "clf"
    assert main(["import-hf", "--model", str(classifiers["roberta-clf"]), "--task", "bible-genre",
                 "--output_dir", str(run)]) == 0
    artifact = sorted((classifiers["roberta-de-expand"] / "embeddings").iterdir())[-1]
    reads, fields = [], evaluate.Scoring.fields
    monkeypatch.setattr(evaluate.Scoring, "fields", lambda self, lang, tok, art, meta=None: (
        reads.append((lang, Path(tok).resolve(), art is not None)) or fields(self, lang, tok, art, meta)))
    grafted, none = evaluate.evaluate_artifacts([run], [artifact], "bible", graft=True, lang="en")
    ft = evaluate.load_finetuned(run)
    assert reads == [("en", Path(read_artifact(artifact)[1]).resolve(), True), ("en", Path(ft.tokenizer).resolve(),
                                                                                  False)]
    assert (grafted["lang"], none["lang"], none["system"]) == ("en", "en", "no_adaptation")
    examples = read_examples(get_task("bible-genre"), "bible", "en", "test", labels=ft.labels)
    gold = torch.tensor([label for _, label in examples])
    for record, embeddings in ((grafted, artifact), (none, None)):
        logits = predict.load(run, embeddings, graft=embeddings is not None, device="cpu").logits(
            [text for text, _ in examples])[2]
        assert record["score"] == pytest.approx(100 * logits.argmax(-1).eq(gold).double().mean().item(), abs=1e-4)


def test_a_half_precision_classifier_imports(classifiers, tmp_path):
    """A classifier saved in bf16 (as many are shared) imports: its logits are compared in fp32."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src, half = classifiers["roberta-clf"], tmp_path / "bf16"
    AutoModelForSequenceClassification.from_pretrained(str(src)).to(torch.bfloat16).save_pretrained(str(half))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(half))
    assert main(["import-hf", "--model", str(half), "--task", "bible-genre", "--output_dir", str(tmp_path / "r")]) == 0


def test_a_tied_decoders_new_rows_are_recorded_as_starting_at_the_source_mean(graft_runs, capsys):
    """Expand over Qwen2 (output tied to the input rows, no bias) with the bounded output start:
    the new rows' output start is their input start too, every one at the source rows' mean,
    whatever --embedding_init drew. run.json and the artifacts say so (`mean_row_pieces`), where
    they said k drawn from N(0, std); the untied Llama-2's input rows are --embedding_init's."""
    from mmadapt.adapt import say_start
    from mmadapt.config import ModelConfig

    run = graft_runs["qwen2-expand"]
    record = json.loads((run / "run.json").read_text())
    size, frozen = record["model"]["vocab_size"], record["model"]["frozen_vocab_size"]
    emb, _, meta = read_artifact(run / "embeddings" / "step00000000")
    new = emb["word_embeddings"][frozen:]
    assert len(new) == size - frozen > 0 and torch.equal(new, new[0].expand_as(new))
    for r in (record, meta):
        assert (r["mean_row_pieces"], r["random_pieces"], r["subword_mean_pieces"]) == (size - frozen, 0, 0)
    untied = json.loads((graft_runs["llama2-expand"] / "run.json").read_text())
    assert "mean_row_pieces" not in untied and untied["random_pieces"] > 0
    say_start("de", "overlap", ModelConfig(vocab_size=size, frozen_vocab_size=frozen), record)
    assert capsys.readouterr().out.startswith(f"de: {size - frozen} new pieces after the source's {frozen} (frozen; "
                                              "only the new rows train), all at the source rows' mean")


def test_a_minijoint_base_is_compared_by_its_primary_model(primary_run):
    """A MINIJOINT base holds two heads (after layers 4 and 12); its export, and so a model
    fine-tuned from it, holds the primary alone (as head 0). The sibling check compares that
    primary model: it refused such a sibling as 'another architecture' (heads.heads.1 absent), and
    would have set the base's mini-model head against the sibling's primary head."""
    base = read_source(primary_run)
    assert len(base.cfg.heads_after) == 2
    cfg, state = base.family.primary_model(base.cfg, base.weights())
    tuned = {k: v + 0.01 if k.startswith("layers.0.") else v for k, v in state.items()}
    sibling = dataclasses.replace(base, cfg=cfg)  # the fine-tuned export's import: one head
    check = check_siblings(base, sibling, {}, sibling_weights=tuned)
    assert check.distance["layers.1"] == 0.0 and check.distance["layers.0"] > 0
    heads = [k for k in check.distance if "head" in k]
    assert heads and all(check.distance[k] == 0.0 for k in heads), check.distance


def test_a_graft_reads_its_base_at_the_checkpoint_step2_read(graft_runs, tmp_path, capsys):
    """A base that trained on (a newer checkpoint) after Step 2 read it is the same model at the
    checkpoint the artifact records (source_tag): export-hf --graft reads the base there, as the
    non-graft paths do, where it read the newest and refused the graft as a base 'changed since'
    (no flag picks the base's checkpoint)."""
    from mmadapt import checkpoint
    from mmadapt.checkpoint import write_weights_only

    base, sibling, artifact, meta = _base_copy(graft_runs, tmp_path)
    _, state = load_weights(base)
    write_weights_only(base / "checkpoints", 1000, {k: v + 0.01 for k, v in state.items()},
                       json.loads((base / "run.json").read_text())["model"])
    assert checkpoint.latest_tag(base / "checkpoints") != meta["source_tag"]
    argv = ["export-hf", "--primary", str(sibling), "--embeddings", str(artifact), "--graft", "--output_dir",
            str(tmp_path / "out")]
    assert main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_sibling_with_other_heads_in_tensors_of_the_same_shapes_is_refused(graft_runs, tmp_path, capsys):
    """The Llama-2 sibling read as 2 heads of 16 (1 key/value group) where the base has 4 of 8
    (2 groups): every tensor keeps its shape, the attention is another; refused by name, where
    it was grafted as 'the same architecture'."""
    from hf_models import damaged_copy
    from mmadapt.hf import import_hf

    hf_dir = damaged_copy(graft_runs["llama2-sibling"].parent / "hf" / "llama2-sibling", tmp_path / "hf-heads",
                          {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    import_hf(hf_dir, tmp_path / "heads")
    capsys.readouterr()
    assert main(["export-hf", "--primary", str(tmp_path / "heads"), "--embeddings",
                 str(_artifact(graft_runs, "llama2", "expand")), "--graft", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its num_attention_heads is 2, the base's 4" in err, err
    assert not (tmp_path / "out").exists()


def test_a_half_precision_siblings_frozen_output_rows_are_not_read_as_moved(graft_runs, tmp_path, capsys):
    """The Llama-2 sibling saved in bf16 (its untied output projection frozen in its fine-tune,
    so the fp32 base's rows rounded): an expanded graft goes in, its output rows those bf16
    rows, where it was refused as 'moved'; one whose output rows were trained is still refused."""
    from safetensors.torch import load_file

    from hf_models import damaged_copy
    from mmadapt.hf import import_hf

    def bf16(state):
        for k in state:
            state[k] = state[k].to(torch.bfloat16)

    hf = graft_runs["llama2-sibling"].parent / "hf"
    art = str(_artifact(graft_runs, "llama2", "expand"))
    for name, expect in (("llama2-sibling", 0), ("llama2-sibling-output", 2)):
        hf_dir = damaged_copy(hf / name, tmp_path / f"hf-{name}", {"dtype": "bfloat16", "torch_dtype": "bfloat16"},
                              edit=bf16)
        import_hf(hf_dir, tmp_path / name)
        out = tmp_path / f"out-{name}"
        assert main(["export-hf", "--primary", str(tmp_path / name), "--embeddings", art, "--graft",
                     "--output_dir", str(out)]) == expect, capsys.readouterr()
        if expect:
            assert "untied output rows (output_layer.weight) moved" in capsys.readouterr().err
            continue
        mine, theirs = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
        rows = mine["lm_head.weight"].shape[0]
        assert theirs["lm_head.weight"].dtype == torch.bfloat16
        assert torch.equal(theirs["lm_head.weight"][:rows], mine["lm_head.weight"])


def test_each_artifacts_own_sibling_warning_is_printed_in_either_order(graft_runs, tmp_path, capsys):
    """A Qwen2 sibling whose tied embeddings moved, checked for a replace and an expand artifact
    over one base: the expand one's warning comes in either order (it was lost behind a replace
    artifact checked first), the base's distances once."""
    from hf_models import damaged_copy
    from mmadapt.graft import check_once
    from mmadapt.hf import import_hf

    def move(state):
        t = state["model.embed_tokens.weight"]
        state["model.embed_tokens.weight"] = t + 0.05 * t.std() * torch.randn(
            t.shape, generator=torch.Generator().manual_seed(0))

    hf_dir = damaged_copy(graft_runs["qwen2-sibling"].parent / "hf" / "qwen2-sibling", tmp_path / "hf-moved", edit=move)
    import_hf(hf_dir, tmp_path / "moved")
    metas = {m: read_artifact(_artifact(graft_runs, "qwen2", m))[2] for m in ("replace", "expand")}
    for order in (("replace", "expand"), ("expand", "replace")):
        capsys.readouterr()
        checked = {}
        for mode in order:
            check_once(checked, graft_runs["qwen2-base"].resolve(), tmp_path / "moved", metas[mode])
        said = capsys.readouterr().out
        assert said.count("is a sibling of") == 1 and said.count("warning: its word embeddings moved") == 1, said
