"""What the model-family seam refuses and owns, in one process: config fields with owners, presets
that name their family, the registry's checks, MMADAPT_IMPORT, and megatron's kv_channels in the
decoder (a head width other than hidden_size / heads, against transformers' Llama)."""

import dataclasses
import sys

import pytest
import torch

from mmadapt.cli import main
from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.family import ModelFamily
from mmadapt.models import (FAMILIES, PRESETS, REQUIRED_METHODS, find_preset, get_family, import_plugins,
                            register_family)
from mmadapt.models.llama import LLAMA
from mmadapt.models.roberta import ROBERTA, RobertaFamily
from mmadapt.objectives import MLM


def test_a_field_of_another_family_is_refused_in_one_line():
    tiny = PRESETS["tiny"][0]
    with pytest.raises(ValueError, match="^kv_channels 32 is a decoder setting; the roberta family does not use it: "
                                         "drop it$"):
        ROBERTA.validate(dataclasses.replace(tiny, kv_channels=32))
    with pytest.raises(ValueError, match="share_embeddings_and_output_weights False is a decoder setting"):
        ROBERTA.validate(dataclasses.replace(tiny, share_embeddings_and_output_weights=False))
    llama = PRESETS["llama-tiny"][0]
    with pytest.raises(ValueError, match="^output_bias_init unigram starts an MLM head's output bias; the llama "
                                         "family's LM head has none: drop it$"):
        LLAMA.validate(dataclasses.replace(llama, output_bias_init="unigram"))
    # Its own family's fields, and the defaults of the others', pass.
    assert LLAMA.validate(dataclasses.replace(llama, kv_channels=32, rotary_base=5e5)).kv_channels == 32
    assert ROBERTA.validate(tiny) is tiny


def test_a_derived_family_uses_its_bases_fields_and_a_new_one_claims_them():
    class Derived(RobertaFamily):
        name = "derived"

    class Claims(ModelFamily):
        name = "claims"
        config_fields = ("output_bias_init",)

    unigram = dataclasses.replace(PRESETS["tiny"][0], output_bias_init="unigram")
    Derived().check_fields(unigram)
    Claims().check_fields(unigram)
    with pytest.raises(ValueError, match="rotary_base 5.0 is a decoder setting; the claims family does not use it"):
        Claims().check_fields(dataclasses.replace(unigram, rotary_base=5.0))


def test_each_preset_belongs_to_one_family_and_names_it():
    for name, (model, _) in PRESETS.items():
        family, found, _ = find_preset(name)
        assert found is model and family.name == model.family and name in family.presets
        family.validate(model)
    assert {f.small_preset for f in FAMILIES.values()} >= {"tiny", "llama-tiny"}
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of"):
        find_preset("huge")


class _Toy(RobertaFamily):  # (its methods: a family defines them, models.REQUIRED_METHODS)
    name = "registry-toy"
    objective = MLM
    presets = {"registry-toy-tiny": (ModelConfig(family="registry-toy"), TrainConfig())}
    small_preset = "registry-toy-tiny"


def test_the_registry_refuses_what_would_make_a_preset_ambiguous():
    clash = type("Clash", (_Toy,), {"presets": {"tiny": PRESETS["tiny"]}, "small_preset": "tiny"})
    with pytest.raises(ValueError, match="preset 'tiny' is the roberta family's already"):
        register_family(clash())
    with pytest.raises(ValueError, match="small_preset 'nope' is not one of its presets"):
        register_family(type("NoSmall", (_Toy,), {"small_preset": "nope"})())
    alien = {"registry-toy-tiny": (ModelConfig(family="llama"), TrainConfig())}
    with pytest.raises(ValueError, match="preset 'registry-toy-tiny' has ModelConfig.family 'llama'"):
        register_family(type("Alien", (_Toy,), {"presets": alien})())
    # a name taken (mmadapt's own were replaced without a word), or none
    with pytest.raises(ValueError, match="_Toy's name 'roberta' is the name of a family registered already "
                                         r"\(RobertaFamily, mmadapt.models.roberta\): choose another name"):
        register_family(type("_Toy", (_Toy,), {"name": "roberta"})())
    with pytest.raises(ValueError, match="Nameless has no name"):
        register_family(type("Nameless", (ModelFamily,), {})())
    # a method every family defines left out: refused at registration (a run hit its bare
    # NotImplementedError after it had written its directory)
    given = ("name", "objective", "task_kinds", "presets", "small_preset")
    bare = type("Bare", (ModelFamily,), {k: getattr(_Toy, k) for k in given} | {"build_lm": RobertaFamily.build_lm})
    with pytest.raises(ValueError, match="the registry-toy family \\(Bare\\) does not define build_task_model, "
                                         "build_body, finetune_trainable, step_flops: every family defines "):
        register_family(bare())
    assert "registry-toy" not in FAMILIES and "registry-toy-tiny" not in PRESETS
    try:
        toy = register_family(_Toy())
        assert get_family(toy.name).small_preset == "registry-toy-tiny"
        assert find_preset("registry-toy-tiny")[0].name == "registry-toy"
        assert register_family(toy) is toy  # the same one again: no change
        # its class defined again (a notebook cell run twice, a module reloaded): replaces it
        again = type("_Toy", (_Toy,), {"__module__": _Toy.__module__, "__qualname__": _Toy.__qualname__,
                                       "presets": {"registry-toy-small": _Toy.presets["registry-toy-tiny"]},
                                       "small_preset": "registry-toy-small"})()
        assert register_family(again) is get_family("registry-toy") and "registry-toy-tiny" not in PRESETS
        PRESETS["registry-toy-tiny"] = PRESETS.pop("registry-toy-small")  # (what finally removes)
    finally:
        del FAMILIES["registry-toy"], PRESETS["registry-toy-tiny"]


def test_what_a_family_of_ones_own_leaves_out_is_refused_in_one_line(monkeypatch):
    """What docs/model-families.md's template leaves out, refused before a run writes anything:
    no objective (an AttributeError as pretrain started), no output_path under --vocab_mode expand
    (a bare NotImplementedError after the run had written its tokenizer), no compiled_kinds under
    --fusion compile (the run trained eager and recorded 'compile')."""
    from mmadapt.adapt import check_output_start
    from mmadapt.fusion import check_device

    with pytest.raises(ValueError, match=r"^the registry-toy family \(NoObjective\) does not set objective: every "
                                         "family sets objective, task_kinds"):
        register_family(type("NoObjective", (ModelFamily,), {k: getattr(_Toy, k) for k in (
            "name", "task_kinds", "presets", "small_preset", *REQUIRED_METHODS)})())
    assert "registry-toy" not in FAMILIES
    # the class where its instance is meant (as a decorator): registered with none of its methods
    # checked, it failed later in a run ('missing 1 required positional argument')
    with pytest.raises(ValueError, match=r"^register_family takes a family, an instance: register_family\(Bare\(\)\), "
                                         "not the class Bare$"):
        register_family(type("Bare", (ModelFamily,), {"name": "registry-toy"}))
    assert "registry-toy" not in FAMILIES
    no_output = type("NoOutput", (_Toy,), {"output_path": ModelFamily.output_path})()
    check_output_start(no_output, TrainConfig(), ModelConfig())  # replace mode: not asked
    with pytest.raises(ValueError, match=r"^the registry-toy family does not define output_path .*: define it "
                                         r"\(docs/model-families.md\), or use --vocab_mode replace$"):
        check_output_start(no_output, TrainConfig(vocab_mode="expand"), ModelConfig())
    check_device(ModelConfig(fusion="compile"), _Toy())  # roberta's layers
    check_device(ModelConfig(fusion="auto"), type("Eager", (_Toy,), {"compiled_kinds": ()})())
    with pytest.raises(ValueError, match=r"^--fusion compile: the registry-toy family names no modules to compile "
                                         r"\(ModelFamily.compiled_kinds\): use --fusion none, or set compiled_kinds"):
        check_device(ModelConfig(fusion="compile"), type("Eager", (_Toy,), {"compiled_kinds": ()})())
    # --fusion cudagraphs (on a CUDA device): graphed kinds that are no compiled kinds, which
    # apply_fusion never reaches (it replays compiled modules alone): the run trained eager
    monkeypatch.setattr("mmadapt.fusion.parallel.device", lambda: torch.device("cuda", 0))
    check_device(ModelConfig(fusion="cudagraphs"), _Toy())
    for graphed in ((), (torch.nn.Linear,)):
        with pytest.raises(ValueError, match=r"^--fusion cudagraphs: the registry-toy family names no modules to "
                                             r"replay as CUDA graphs \(ModelFamily.graphed_kinds, among its "
                                             "compiled_kinds\): use --fusion none"):
            check_device(ModelConfig(fusion="cudagraphs"), type("Ungraphed", (_Toy,), {"graphed_kinds": graphed})())
    # a compiled kind of one's own derived from the graphed one: its frozen layers are replayed
    from mmadapt.models.roberta.model import MLMHeads, TransformerLayer
    mine = type("MyLayer", (TransformerLayer,), {})
    check_device(ModelConfig(fusion="cudagraphs"), type("Derived", (_Toy,), {"compiled_kinds": (mine, MLMHeads)})())


def test_mmadapt_import_names_the_module_it_cannot_import(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MMADAPT_IMPORT", "no_such_family_module")
    assert main(["flops", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: MMADAPT_IMPORT: cannot import no_such_family_module") and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="has no function nothing to register its families"):
        import_plugins("mmadapt.objectives:nothing")
    # a module of the user's that fails as it is imported or registers: one line naming it, not a
    # traceback and exit 1 (an internal error's); one whose own import is missing says to install it
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "raising_family.py").write_text("raise RuntimeError('boom')\n")
    (plugins / "needs_dep.py").write_text("import not_installed_dep_xyz\n")
    (plugins / "bad_register.py").write_text("def register():\n    return {}['x']\n")
    (plugins / "bad_value.py").write_text("LIMIT = int('x')\n")
    (plugins / "mypkg").mkdir()
    (plugins / "mypkg" / "__init__.py").write_text("import mypkg.helpers_typo\n")
    (plugins / "otherpkg").mkdir()  # a family module within a package, importing a misnamed sibling
    (plugins / "otherpkg" / "__init__.py").write_text("")
    (plugins / "otherpkg" / "families.py").write_text("import otherpkg.helpers_typo\n")
    (plugins / "nspkg" / "myplug").mkdir(parents=True)  # a namespace package: its others are other distributions
    (plugins / "nspkg" / "myplug" / "__init__.py").write_text("import nspkg.cloud_extra\n")
    (plugins / "optional_dep.py").write_text("raise ModuleNotFoundError('optional dependency foo missing')\n")
    (plugins / "lazy_register.py").write_text("def register():\n    import some_missing_dep_xyz\n")
    (plugins / "nspkg" / "mmfamily").mkdir()  # a regular package within it, importing its own misnamed module
    (plugins / "nspkg" / "mmfamily" / "__init__.py").write_text("")
    (plugins / "nspkg" / "mmfamily" / "families.py").write_text("import nspkg.mmfamily.helpers_typo\n")
    monkeypatch.syspath_prepend(str(plugins))
    for spec, message in (("raising_family", "MMADAPT_IMPORT: importing raising_family failed (RuntimeError: boom): "
                                             "fix the module"),
                          ("needs_dep", "MMADAPT_IMPORT: needs_dep imports not_installed_dep_xyz, which is not "
                                        "installed: install it"),
                          ("bad_register:register", "MMADAPT_IMPORT: bad_register:register() failed (KeyError: 'x'): "
                                                    "fix it"),
                          # (its own ValueError passed as it was, naming neither)
                          ("bad_value", "MMADAPT_IMPORT: importing bad_value: invalid literal for int()"),
                          # (told to install its own misnamed submodule)
                          ("mypkg", "MMADAPT_IMPORT: mypkg imports mypkg.helpers_typo, which mypkg does not have: "
                                    "fix that import"),
                          ("otherpkg.families", "MMADAPT_IMPORT: otherpkg.families imports otherpkg.helpers_typo, "
                                                "which otherpkg does not have: fix that import"),
                          ("otherpkg.missing", "MMADAPT_IMPORT: cannot import otherpkg.missing"),
                          ("nspkg.myplug", "MMADAPT_IMPORT: nspkg.myplug imports nspkg.cloud_extra, which is not "
                                           "installed: install it"),
                          ("nspkg.mmfamily.families", "MMADAPT_IMPORT: nspkg.mmfamily.families imports "
                                                      "nspkg.mmfamily.helpers_typo, which nspkg.mmfamily does not "
                                                      "have: fix that import"),
                          # (found, its own code raising: was told to put it on PYTHONPATH)
                          ("optional_dep", "MMADAPT_IMPORT: importing optional_dep failed (ModuleNotFoundError: "
                                           "optional dependency foo missing): fix the module"),
                          # (a function's import of a missing package: was told to fix the function)
                          ("lazy_register:register", "MMADAPT_IMPORT: lazy_register:register() imports "
                                                     "some_missing_dep_xyz, which is not installed: install it"),
                          # (a relative name: was 'importing .fam failed (TypeError ...): fix the module')
                          *((spec, f"MMADAPT_IMPORT: {spec!r} does not name a module: give its full dotted name")
                            for spec in (".raising_family", ":register", "otherpkg..families"))):
        monkeypatch.setenv("MMADAPT_IMPORT", spec)
        assert main(["flops", "--preset", "tiny"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    # a file name import_module takes though it is no identifier: imported, as it was
    (plugins / "my-family.py").write_text("IMPORTED = True\n")
    import_plugins("my-family")
    assert sys.modules["my-family"].IMPORTED
    monkeypatch.delitem(sys.modules, "my-family")
    monkeypatch.delenv("MMADAPT_IMPORT")
    with pytest.raises(ValueError, match="unknown model family 'nowhere'.*MMADAPT_IMPORT=<module>"):
        get_family("nowhere")


def test_kv_channels_is_the_decoders_head_width_as_transformers_head_dim():
    """A decoder whose heads are 32 wide at hidden size 64 and 4 heads (transformers' head_dim, as
    Gemma's 256 at 3072 and 16): the same logits as LlamaForCausalLM on the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmadapt.models.llama.hf import MAPPING

    cfg = dataclasses.replace(PRESETS["llama-tiny"][0], num_layers=2, kv_channels=32, vocab_size=96)
    LLAMA.validate(cfg)
    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         rms_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=True, attention_bias=False)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(hf_cfg).eval()
    assert theirs.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    mine = LLAMA.build_lm(cfg).eval()
    mine.load_state_dict(MAPPING.from_hf(cfg, theirs.state_dict(), list(range(96)), hf_cfg.to_dict()))
    assert mine.layers[0].qkv.weight.shape == ((4 + 2 * 2) * 32, 64)
    ids = torch.randint(5, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mine.logits(ids)[0], theirs(ids).logits, rtol=1e-5, atol=1e-5)
