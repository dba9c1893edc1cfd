"""The model-family seam (family.py): a second architecture, defined here and nowhere else, goes
through every step that trains and the plug-in metric with no change to mmadapt.

The toy family is RoBERTa with pre-LayerNorm layers (x + Attn(LN(x)), then x + FFN(LN(x))):
the same parameter names and shapes as the encoder, another function of them. It pretrains as
MINIJOINT, builds a MINIPOST mini-model, trains German embeddings over both mini-models (Step 2)
and scores them with the plug-in metric, in one process, and each step is checked to have built
the toy family's model, not RoBERTa's."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, VOCAB
from mmadapt import steps
from mmadapt.config import MiniModelConfig, PreprocessConfig, apply_recipe
from mmadapt.models import FAMILIES, PRESETS, register_family
from mmadapt.models.roberta import RobertaFamily
from mmadapt.models.roberta.model import RobertaMLM, TransformerLayer
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights, read_run

ZERO0 = REPO / "ds_configs" / "zero0.json"


class PreLNLayer(TransformerLayer):
    def forward(self, x, mask=None):
        x = x + self.dropout(self.attention(self.attn_layernorm(x), mask))
        f, _ = self.fc1(self.ffn_layernorm(x))
        f, _ = self.fc2(F.gelu(f))
        return x + self.dropout(f)


class PreLNRobertaMLM(RobertaMLM):
    def __init__(self, config, seed=1234):
        super().__init__(config, seed)
        self.layers = torch.nn.ModuleList(PreLNLayer(config, i, seed) for i in range(1, config.num_layers + 1))


class PreLNFamily(RobertaFamily):
    name = "toy-preln"
    compiled_kinds = (PreLNLayer,)
    # A family's presets are its own, named uniquely across families.
    presets = {"toy-preln-tiny": (dataclasses.replace(PRESETS["tiny"][0], family="toy-preln"), PRESETS["tiny"][1])}
    small_preset = "toy-preln-tiny"

    def __init__(self):
        self.built = 0  # LMs built through the seam (training, evaluation, shape checks)

    def build_lm(self, cfg, seed=1234):
        self.built += 1
        return PreLNRobertaMLM(cfg, seed)


@pytest.fixture(scope="module")
def toy():
    family = register_family(PreLNFamily())
    yield family
    del FAMILIES[family.name]
    for name in family.presets:
        del PRESETS[name]


def _train(iters, **changes):
    return dataclasses.replace(PRESETS["tiny"][1], train_iters=iters, save_interval=iters, log_interval=1, seq_length=32,
                               train_micro_batch_size_per_gpu=4, lr=1e-3, **changes)


def test_a_family_defined_outside_mmadapt_runs_every_step(toy, corpus, tokenizer, de_corpus, de_tokenizer, tmp_path):
    init_parallel(1, 1)
    shape = dict(vocab_size=VOCAB, num_layers=4, hidden_dropout=0.0, attention_dropout=0.0)
    toy_model = apply_recipe(dataclasses.replace(PRESETS["tiny"][0], family=toy.name, **shape), "minijoint", 2)
    raw = RunSpec(output_dir=tmp_path / "x", ds_config=ZERO0, corpus=corpus, tokenizer=tokenizer)

    # Step 1, MINIJOINT (heads after layers 2 and 4), and the same run with RoBERTa's layers: the
    # same parameter names, initial weights and batches, so different trained weights can only
    # come from the toy's layers.
    for name, model in (("toy", toy_model), ("roberta", dataclasses.replace(toy_model, family="roberta"))):
        steps.pretrain(run=dataclasses.replace(raw, output_dir=tmp_path / name),
                       step=steps.Pretrain(model=model, train=_train(4), recipe="minijoint"))
    assert toy.built == 1
    assert read_run(tmp_path / "toy")["model"]["family"] == toy.name
    cfg, state = load_weights(tmp_path / "toy")
    _, roberta = load_weights(tmp_path / "roberta")
    assert state.keys() == roberta.keys()
    assert not torch.equal(state["layers.0.qkv.weight"], roberta["layers.0.qkv.weight"])

    # Step 1b: MINIPOST from the toy primary (bottom layer + 1 new one), trained on its own data.
    steps.build_minipost(run=RunSpec(output_dir=tmp_path / "minipost", ds_config=ZERO0),
                         step=steps.BuildMinipost(primary=tmp_path / "toy", train=_train(2),
                                                  mini=MiniModelConfig(mini_layers=1, new_layers=1)))
    post_cfg, post = load_weights(tmp_path / "minipost")
    assert post_cfg.family == toy.name and post_cfg.num_layers == 2
    assert torch.equal(post["layers.0.qkv.weight"], state["layers.0.qkv.weight"])  # copied, frozen
    built, init = toy.minipost_start(cfg, state, 1, 1)  # the new layer's seeded start (the primary's differs)
    start = {**PreLNRobertaMLM(built, read_run(tmp_path / "minipost")["train"]["seed"]).state_dict(), **init}
    assert not torch.equal(post["layers.1.qkv.weight"], start["layers.1.qkv.weight"])  # new, trained

    # Step 2 over both mini-models, German data prepared once with a validation split.
    german = tmp_path / "de"
    steps.preprocess(de_corpus, output_dir=german, vocab_size=VOCAB, tokenizer=de_tokenizer,
                     cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    for system, source in (("minijoint", tmp_path / "toy"), ("minipost", tmp_path / "minipost")):
        before = toy.built
        steps.adapt_embeddings(run=RunSpec(output_dir=tmp_path / f"adapt-{system}", ds_config=ZERO0, data_path=german),
                               step=steps.AdaptEmbeddings(system=system, source=source, lang="de", train=_train(2)))
        assert toy.built > before
        assert read_run(tmp_path / f"adapt-{system}")["model"]["family"] == toy.name

    # Step 4 without a task: every artifact through the toy primary model.
    before = toy.built
    records = steps.evaluate_plugin(tmp_path / "toy", embeddings=[tmp_path / "adapt-minijoint",
                                                                   tmp_path / "adapt-minipost"],
                                    data=str(german), seq_length=32, blocks=32)
    assert toy.built > before
    assert [(r["system"], r["step"]) for r in records] == [("minijoint", 0), ("minijoint", 2), ("minipost", 0),
                                                            ("minipost", 2)]  # each run's start and checkpoint
    for r in records:
        assert r["task"] == "plugin-mlm" and r["score"] == pytest.approx(r["unigram_loss"] - r["loss"])
        assert 0 < r["loss"] < 20 and r["masked_pieces"] > 0


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "qwen2-0.5b"])
def test_param_names_builds_nothing_in_memory(preset):
    """family.param_names (what an import checks shapes against) builds the model on the meta
    device: every parameter stays there (init_like_megatron used to materialise each layer on the
    CPU, 2 GB for Qwen2-0.5B, 28 GB for a 7B model), and the names and shapes are the real model's."""
    from mmadapt.models import get_family

    cfg = PRESETS[preset][0]
    family = get_family(cfg)
    with torch.device("meta"):
        devices = {p.device.type for p in family.build_lm(cfg).parameters()}
    assert devices == {"meta"}
    if preset != "qwen2-0.5b":  # small enough to build for real
        real = {n: tuple(p.shape) for n, p in family.build_lm(cfg).named_parameters()}
        assert family.param_names(cfg) == real
