"""Grafting Step-2 embeddings trained over a base decoder into its fine-tuned sibling (graft.py,
`export-hf --graft`): the sibling check's distances by hand, the exported directory against
mmadapt's logits, expand keeping the sibling's own source rows bit for bit, and the refusals."""

import dataclasses

import pytest
import torch

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
    if mode == "expand":  # the sibling's own source rows, bit for bit, in its own (exported) order
        rows = len(load(read_source(sibling).tokenizer).hf_ids)
        exported = hf.get_input_embeddings().weight.detach()
        sib = AutoModelForCausalLM.from_pretrained(str(sibling.parent / "hf" / f"{name}-sibling"))
        assert torch.equal(exported[:rows], sib.get_input_embeddings().weight.detach()[:rows])
        assert torch.equal(hf.get_output_embeddings().weight.detach()[:rows],
                           sib.get_output_embeddings().weight.detach()[:rows])
        assert torch.equal(own["word_embeddings.word_embeddings.weight"], state["word_embeddings.word_embeddings.weight"][
            :own["word_embeddings.word_embeddings.weight"].shape[0]])
