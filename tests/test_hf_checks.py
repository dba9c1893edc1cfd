"""The import's checkpoint validator (mmadapt/hf.py: imported_state, check_parity; each family's
HFMapping declarations) over damaged copies of one tiny Llama and one Qwen2 (conftest.tiny_hf,
hf_models.damaged_copy): what transformers 5 loads from the files differently from what
config.json alone says (a tie flag beside an output projection of its own) or leaves out (old
rotary buffers) is imported as transformers loads it, logits within 1e-5 of its own; a mapping
that is not exact is refused by the parity check, nothing written. The damaged copies that must
be refused (fewer or more layers in the config than in the files, a NaN weight, shape fields
that disagree with the weights, impossible config values, a tensor nobody reads) are rows of
tests/test_bad_input.py; here, the same checks' messages on the encoder's mapping too."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from hf_models import bible_lines, damaged_copy, make_roberta
from mmadapt.hf import import_hf
from mmadapt.models import get_family
from mmadapt.models.llama.hf import LlamaMapping
from mmadapt.models.roberta.model import BIAS
from mmadapt.run import load_weights
from mmadapt.tokenizer import load as load_sp

TOL = 1e-5
TEXTS = bible_lines("en", range(40, 41))[:3] + bible_lines("de", range(40, 41))[:2]


def own_head(state):  # an output projection of its own, beside tie_word_embeddings true
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.5 * torch.randn(
        state["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0))


def equal_head(state):  # the tied output projection saved as well (older save_pretrained)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()


def rotary_buffers(state):  # what transformers 4.3x saved of each layer's rotary embedding
    for i in range(3):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1e4 ** -(torch.arange(0, 8, 2) / 8)


def max_logit_difference(hf_dir, run) -> float:
    """The imported model's logits against transformers' own load of `hf_dir`, text by text."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    cfg, state = load_weights(run)
    model = get_family(cfg).build_lm(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0))
    model.load_state_dict(state)
    sp = load_sp(run / "tokenizer" / "spm.model")
    diff = 0.0
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([sp.encode(text)[:cfg.max_position_embeddings]])
            ref = hf(input_ids=torch.tensor(sp.hf_ids)[ids]).logits[..., torch.tensor(sp.hf_ids)]
            diff = max(diff, (model.eval().logits(ids)[0] - ref).abs().max().item())
    return diff


@pytest.mark.parametrize("arch, config, edit, untied", [
    ("qwen2", None, own_head, True),  # tie_word_embeddings true, an lm_head.weight that differs: untied
    ("llama", {"tie_word_embeddings": True}, None, True),  # the Llama's own lm_head under a tie flag
    ("qwen2", None, equal_head, False),  # the head saved beside the embedding it equals: tied
    ("llama", None, rotary_buffers, False),  # inv_freq buffers: transformers ignores them, so does the import
], ids=["qwen2-tie-flag-own-head", "llama-tie-flag-own-head", "qwen2-head-equals-embedding", "llama-inv-freq"])
def test_imported_as_transformers_loads_it(arch, config, edit, untied, tiny_hf, tmp_path):
    hf_dir = damaged_copy(tiny_hf[arch], tmp_path / "hf", config, edit)
    run = import_hf(hf_dir, tmp_path / "run")
    assert run["model"]["share_embeddings_and_output_weights"] == (arch == "qwen2" and not untied)
    assert ("untied: config.json's tie_word_embeddings is true" in run["imported_from"].get("note", "")) == untied
    diff = max_logit_difference(hf_dir, tmp_path / "run")
    print(f"{arch}: max abs logit difference {diff:.2e}")
    assert diff <= TOL


def test_the_parity_check_refuses_a_mapping_that_is_not_exact(tiny_hf, tmp_path, monkeypatch):
    """A mapping that gets one weight of layer 0 slightly wrong passes every shape check; the
    first layer's output against transformers' does not."""
    exact = LlamaMapping.from_hf

    def off(self, cfg, hf, hf_ids, hf_cfg):
        state = exact(self, cfg, hf, hf_ids, hf_cfg)
        return {**state, "layers.0.fc2.weight": state["layers.0.fc2.weight"] * 1.01}

    monkeypatch.setattr(LlamaMapping, "from_hf", off)
    with pytest.raises(ValueError, match=r"is not the one transformers loads from these files \(its first layer's "
                                         r"logits differ by up to"):
        import_hf(tiny_hf["llama"], tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    return make_roberta(tmp_path_factory.mktemp("tiny_roberta") / "roberta")


def old_buffers(state):
    """An older transformers' checkpoint: position ids, a pooler, the decoder saved beside the
    embedding it is tied to, and a decoder bias apart from lm_head.bias (what the head adds)."""
    state["roberta.embeddings.position_ids"] = torch.arange(66)[None]
    state["roberta.pooler.dense.weight"], state["roberta.pooler.dense.bias"] = torch.zeros(32, 32), torch.zeros(32)
    state["lm_head.decoder.weight"] = state["roberta.embeddings.word_embeddings.weight"].clone()
    state["lm_head.decoder.bias"] = state["lm_head.bias"] + 0.25


@pytest.mark.parametrize("config, edit, message", [
    ({"num_hidden_layers": 3}, None, "its weights hold roberta.encoder.layer.3.attention.output.LayerNorm.bias (and "
     "15 more tensors), which the model config.json describes has no place for: config.json's num_hidden_layers "
     "is 3, but the weights hold layer 3"),
    ({"intermediate_size": 48}, None, "roberta.encoder.layer.0.intermediate.dense.weight has shape (64, 32), but "
     "config.json implies (48, 32) (dimension 1: intermediate_size 48)"),
    ({"max_position_embeddings": 2}, None, "config.json's max_position_embeddings 2 leaves no position after the 2 "
     "rows a RoBERTa-family model skips"),
    (None, lambda s: s["lm_head.dense.bias"].__setitem__(0, float("inf")),
     "its weight lm_head.dense.bias holds 1 infinite value (of 32)"),
    (None, lambda s: s.__setitem__("lm_head.decoder.weight", -s["roberta.embeddings.word_embeddings.weight"]),
     "lm_head.decoder.weight differs from the word embeddings: transformers loads this model untied"),
], ids=["fewer-layers", "intermediate-size", "no-positions", "inf-weight", "untied-decoder"])
def test_the_encoder_mapping_is_checked_the_same_way(config, edit, message, tiny_roberta, tmp_path):
    hf_dir = damaged_copy(tiny_roberta, tmp_path / "hf", config, edit)
    with pytest.raises(ValueError) as e:
        import_hf(hf_dir, tmp_path / "run")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_an_encoder_config_without_its_defaulted_fields_reads_as_transformers_reads_it(tiny_roberta, tmp_path):
    """config.json without layer_norm_eps is RobertaConfig's 1e-12 (it was read as 1e-5 and the
    import refused by its parity check); without max_position_embeddings, 512, which these
    weights' 66 position rows refuse in one line (it was a KeyError)."""
    import json

    run = import_hf(damaged_copy(tiny_roberta, tmp_path / "hf", {"layer_norm_eps": None}), tmp_path / "run")
    assert run["model"]["layernorm_epsilon"] == 1e-12
    with pytest.raises(ValueError) as e:
        import_hf(damaged_copy(tiny_roberta, tmp_path / "hf2", {"max_position_embeddings": None}), tmp_path / "run2")
    assert "max_position_embeddings 512" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run2").exists() and json.loads((tmp_path / "run" / "run.json").read_text())


def test_the_encoder_ignores_what_transformers_ignores(tiny_roberta, tmp_path):
    """Position ids and a pooler left out, the decoder weight tied, and the decoder's own bias
    taken, as transformers' RobertaForMaskedLM loads them: the import passes its parity check."""
    hf_dir = damaged_copy(tiny_roberta, tmp_path / "hf", None, old_buffers)
    run = import_hf(hf_dir, tmp_path / "run")
    assert run["imported_from"]["architecture"] == "RobertaForMaskedLM"
    decoder_bias = load_file(str(hf_dir / "model.safetensors"))["lm_head.decoder.bias"]
    hf_ids = torch.tensor(load_sp(tmp_path / "run" / "tokenizer" / "spm.model").hf_ids)
    assert torch.equal(load_weights(tmp_path / "run")[1][BIAS], decoder_bias[hf_ids])


def test_a_model_directory_is_known_by_its_files_not_its_path(tiny_hf, tmp_path):
    """hf.model_dir_files and files_digest (extend's sources.json): a copy elsewhere has the same
    digest; a README, a hidden file or a Trainer's checkpoint folder added changes nothing; one
    value of the weights changed, or a file added, gives another; a sentence-transformers module
    folder counts. A file whose size and mtime a former result records is not hashed again (its
    recorded hash is taken), one saved since is."""
    import os
    import shutil

    from safetensors.torch import save_file

    from mmadapt.hf import files_differ, files_digest, model_dir_files

    src = tiny_hf["qwen2"]
    copy = shutil.copytree(src, tmp_path / "copy")
    first = files_digest(model_dir_files(src))
    assert files_digest(model_dir_files(copy)) == first and "model.safetensors" in model_dir_files(copy)
    (copy / "README.md").write_text("a model card\n")
    for junk in (".cache", "checkpoint-500", "runs"):
        (copy / junk).mkdir()
        (copy / junk / "state.bin").write_bytes(b"x")
    for log in ("trainer_state.json", "training_args.bin", "eval_results.json"):
        (copy / log).write_text("{}")
    assert files_digest(model_dir_files(copy)) == first
    # a file touched (another mtime, the same bytes): hashed again, the same digest
    files = model_dir_files(copy)
    config = copy / "config.json"
    os.utime(config, ns=(files["config.json"]["mtime_ns"] + 10**9,) * 2)
    fake = {rel: {**f, "sha256": "0" * 64} for rel, f in files.items()}
    touched = model_dir_files(copy, known=fake)
    assert touched["config.json"]["sha256"] == files["config.json"]["sha256"] and files_digest(touched) != files_digest(
        fake)
    weights = copy / "model.safetensors"
    state = load_file(weights)
    name = sorted(state)[-1]
    state[name] = state[name].clone()
    state[name].view(-1)[-1] += 1
    files = model_dir_files(copy)
    save_file(state, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(files["model.safetensors"]["mtime_ns"] + 10**9,) * 2)
    changed = model_dir_files(copy, known=files)
    assert files_digest(changed) != first and changed["model.safetensors"]["size"] == files["model.safetensors"]["size"]
    # a recorded hash is taken while its file's size and mtime hold
    fake = {rel: {**f, "sha256": "0" * 64} for rel, f in changed.items()}
    assert all(f["sha256"] == "0" * 64 for f in model_dir_files(copy, known=fake).values())
    (copy / "generation_config.json").write_text("{}")
    assert files_digest(model_dir_files(copy)) not in (first, files_digest(changed))
    # a sentence-transformers directory: the module folders modules.json names count
    (copy / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"}, '
                                       '{"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"}]')
    (copy / "1_Pooling").mkdir()
    (copy / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    before = files_digest(model_dir_files(copy))
    (copy / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert "1_Pooling/config.json" in model_dir_files(copy) and files_digest(model_dir_files(copy)) != before
    # its transformer in a module folder of its own
    st = tmp_path / "st"
    shutil.copytree(src, st / "0_Transformer")
    (st / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "0_Transformer", "type": "x.Transformer"}]')
    listed = model_dir_files(st)
    assert "0_Transformer/model.safetensors" in listed and "0_Transformer/config.json" in listed
    assert files_differ(listed, {**listed, "0_Transformer/config.json": {"sha256": "1"}}) == (
        "0_Transformer/config.json changed")


def test_an_output_dir_that_is_the_working_directory_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    """import-hf and export-hf write their directory whole beside it, then move it into place:
    `--output_dir .` (an empty working directory) failed after the model was read with
    "PosixPath('.') has an empty name"; moved into place it would have left the shell in a
    removed directory."""
    from mmadapt.hf import _fresh_output

    monkeypatch.chdir(tmp_path)
    for given in (Path("."), tmp_path, Path("sub/..")):
        with pytest.raises(ValueError, match=f"^--output_dir {re.escape(str(given))} is the directory this command "
                                             "runs in, which the written directory would take the place of: name a "
                                             r"new one \(--output_dir export\)$"):
            _fresh_output(given)
    _fresh_output(Path("export"))  # a new one inside it


def test_a_model_type_other_than_its_architectures_is_named_as_such(tiny_hf, tmp_path):
    """config.json naming LlamaForCausalLM with model_type qwen2 was refused as 'holds a
    LlamaForCausalLM (model_type qwen2); import-hf supports ..., LlamaForCausalLM, ...'."""
    hf_dir = damaged_copy(tiny_hf["llama"], tmp_path / "hf", {"model_type": "qwen2"})
    with pytest.raises(ValueError, match=re.escape(f"{hf_dir / 'config.json'}: its model_type is 'qwen2' but its "
                                                   "architectures names LlamaForCausalLM (model_type 'llama'): fix "
                                                   "config.json, or save the model again (save_pretrained)")):
        import_hf(hf_dir, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_weight_file_holding_objects_beside_its_tensors_is_not_called_truncated(tmp_path):
    """A whole pytorch_model.bin that weights_only refuses (an object a load would run) was
    reported as 'truncated or not a PyTorch file; restore or recreate it', with torch's terminal
    escapes, cut short."""
    from mmadapt.checkpoint import load_pt

    torch.save({"w": torch.zeros(2), "x": _Runs()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=re.escape(f"weight file {tmp_path / 'pytorch_model.bin'} holds objects other "
                                                   "than tensors, which mmadapt does not load (a pickle runs code): "
                                                   "save its weights as safetensors")):
        load_pt(tmp_path / "pytorch_model.bin", "weight file", weights_only=True)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "pytorch_model.bin").read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot be read .*: it is truncated or not a PyTorch file"):
        load_pt(tmp_path / "cut.bin", "weight file", weights_only=True)


class _Runs:
    def __reduce__(self):
        return (print, ("a pickle ran",))
