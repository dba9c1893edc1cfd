"""The decoder family's model math (mmadapt/models/llama/model.py) in one process: one layer against
its definition written out by hand, transformers' Llama / Qwen2 / Mistral against the same
weights, seeded initialisation and parameter names, MINIJOINT's heads, the task head's pooling,
the pinned parameter counts, and (slow) tensor parallel 2 against one process."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_pretrain
from mmadapt.models.layers import count_parameters
from mmadapt.models.llama import LLAMA
from mmadapt.models.llama.hf import MAPPING
from mmadapt.models.llama.model import DecoderLayer, LlamaForTask, LlamaLM, rotary_table, task_param_name
from mmadapt.models.llama.presets import LLAMA_TINY as TINY
from mmadapt.config import ModelConfig
from mmadapt.models.llama.presets import QWEN2_0_5B
from mmadapt.tokens import IGNORE_INDEX, PAD_ID

V = 128


def tiny(**kw) -> ModelConfig:
    """3 layers of h 32, 4 heads of 8 in 2 key/value groups, ffn 48."""
    return dataclasses.replace(TINY, num_layers=3, hidden_size=32, ffn_hidden_size=48, vocab_size=V, **kw)


def perturb_norms_and_biases(module: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights start at ones and biases at zeros; a test that is to see them needs other values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if n.endswith("norm.weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))


def lm_batch(b=3, s=12, seed=0):
    """Random ids [b, s] and their next tokens as labels (the last position is not scored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), IGNORE_INDEX)], dim=1)
    return ids, labels


# --- one layer by hand --------------------------------------------------------------------------------

def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rotary_by_hand(x, base):
    """x [s, hd]: dimensions (d, d + hd/2) as one complex number, turned by position * base^(-2d/hd)."""
    s, hd = x.shape
    theta = base ** (-torch.arange(hd // 2, dtype=torch.float64) * 2 / hd)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta  # [s, hd/2]
    turn = torch.polar(torch.ones_like(angle), angle)
    z = torch.complex(x[:, :hd // 2].double(), x[:, hd // 2:].double()) * turn
    return torch.cat([z.real, z.imag], dim=1).to(x.dtype)


def layer_by_hand(layer: DecoderLayer, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """x [b, s, h] -> the layer's output, head by head from the weights' documented layout."""
    nh, ng, hd = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    r, eps, s = nh // ng, cfg.layernorm_epsilon, x.shape[1]
    w = layer.qkv.weight.view(ng, r + 2, hd, -1)  # [group, its r queries + key + value, hd, h]
    bias = layer.qkv.bias.view(ng, r + 2, hd) if cfg.add_qkv_bias else torch.zeros(ng, r + 2, hd)
    out = []
    for row in x:  # [s, h]
        xn = rms_norm(row, layer.input_layernorm.weight, eps)
        heads = []
        for i in range(nh):
            g, j = divmod(i, r)
            q = rotary_by_hand(xn @ w[g, j].T + bias[g, j], cfg.rotary_base)
            k = rotary_by_hand(xn @ w[g, r].T + bias[g, r], cfg.rotary_base)
            v = xn @ w[g, r + 1].T + bias[g, r + 1]
            scores = q @ k.T / math.sqrt(hd)
            scores = torch.where(torch.ones(s, s).tril().bool(), scores, torch.tensor(float("-inf")))
            heads.append(torch.softmax(scores, -1) @ v)
        row = row + torch.cat(heads, dim=1) @ layer.attn_out.weight.T
        xn = rms_norm(row, layer.post_attention_layernorm.weight, eps)
        gate, up = xn @ layer.fc1.weight[0::2].T, xn @ layer.fc1.weight[1::2].T  # rows interleaved
        out.append(row + (gate * torch.sigmoid(gate) * up) @ layer.fc2.weight.T)
    return torch.stack(out)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_decoder_layer_equals_its_definition(groups, bias, impl):
    cfg = tiny(num_query_groups=groups, add_qkv_bias=bias, attention_impl=impl)
    layer = DecoderLayer(cfg, 2, seed=3)
    perturb_norms_and_biases(layer)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    got = layer(x, rotary_table(9, cfg.head_dim, cfg.rotary_base, x))
    torch.testing.assert_close(got, layer_by_hand(layer, cfg, x), rtol=0, atol=1e-6)


# --- transformers' models on the same weights ----------------------------------------------------------

def hf_model(arch: str, cfg: ModelConfig):
    """transformers' model of `cfg`'s shape, random weights with every norm perturbed too."""
    import transformers as T

    shape = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim, max_position_embeddings=64,
                 rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base, initializer_range=0.1,
                 tie_word_embeddings=cfg.share_embeddings_and_output_weights, pad_token_id=PAD_ID,
                 attn_implementation="eager")
    if arch == "mistral":  # Mistral is Llama with a sliding window; ours has none
        shape["sliding_window"] = None
    config, model = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                     "mistral": (T.MistralConfig, T.MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    hf = model(config(**shape)).eval()
    perturb_norms_and_biases(hf, seed=1)
    return hf


def state_from_hf(hf, cfg: ModelConfig) -> dict:
    """transformers' names and layouts -> LlamaLM's: the library's mapping (models/llama/hf.py: q/k/v
    fused into rows per key/value group, gate/up interleaved row by row, the final norm to the
    primary head), with the rows in the source's order."""
    return MAPPING.from_hf(cfg, hf.state_dict(), list(range(cfg.vocab_size)), hf.config.to_dict())


def primary_logits(model: LlamaLM, ids: torch.Tensor) -> torch.Tensor:
    """[b, s, V]: the primary head at every position."""
    hidden = model.hidden_states(ids)[-1]
    return model.heads.heads[-1](hidden.flatten(0, 1), model.output_weight).view(*ids.shape, -1)


@pytest.mark.parametrize("arch, groups, bias, tied, base", [
    ("llama", 2, False, True, 10000.0),
    ("llama", 4, False, False, 500000.0),
    ("qwen2", 2, True, True, 1e6),
    ("mistral", 1, False, False, 10000.0),
])
def test_transformers_gives_the_same_logits(arch, groups, bias, tied, base):
    cfg = tiny(num_query_groups=groups, add_qkv_bias=bias, share_embeddings_and_output_weights=tied,
               rotary_base=base, layernorm_epsilon=1e-6)
    hf = hf_model(arch, cfg)
    model = LlamaLM(cfg).eval()
    model.load_state_dict(state_from_hf(hf, cfg))
    ids, _ = lm_batch(s=16)
    ids[1, 10:] = PAD_ID  # right padding: HF masks it, we rely on causality alone
    ids[2, 5:] = PAD_ID
    real = ids.ne(PAD_ID)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=real.long()).logits
        ours = primary_logits(model, ids)
    diff = (ours[real] - ref[real]).abs().max().item()
    print(f"{arch}: max abs logit difference {diff:.2e} (logits' max {ref[real].abs().max():.2f})")
    assert diff <= 1e-5


# --- initialisation, names, counts ---------------------------------------------------------------------

def test_initialisation_depends_only_on_seed_and_module():
    cfg = tiny()
    model = LlamaLM(cfg, seed=3)
    torch.randn(1000)  # disturb the global RNG
    again = LlamaLM(cfg, seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    alone = DecoderLayer(cfg, 2, seed=3)
    assert torch.equal(alone.qkv.weight, model.layers[1].qkv.weight)
    assert not torch.equal(model.layers[0].qkv.weight, model.layers[1].qkv.weight)
    assert not torch.equal(LlamaLM(cfg, seed=4).layers[1].qkv.weight, alone.qkv.weight)


def test_residual_outputs_use_the_scaled_init():
    cfg = dataclasses.replace(TINY, vocab_size=V)  # 12 layers: the output projections' std is 0.05 / sqrt(24)
    layer = DecoderLayer(cfg, 1)
    std = cfg.init_method_std
    for name, want in [("qkv", std), ("fc1", std), ("attn_out", std / math.sqrt(24)), ("fc2", std / math.sqrt(24))]:
        got = getattr(layer, name).weight.std().item()
        assert got == pytest.approx(want, rel=0.05), name


def layer_names(i: int, bias: bool) -> set[str]:
    names = ["qkv.weight", "attn_out.weight", "fc1.weight", "fc2.weight", "input_layernorm.weight",
             "post_attention_layernorm.weight"] + (["qkv.bias"] if bias else [])
    return {f"layers.{i}.{n}" for n in names}


@pytest.mark.parametrize("tied, bias", [(True, False), (False, True)])
def test_parameter_names_and_shapes(tied, bias):
    cfg = tiny(share_embeddings_and_output_weights=tied, add_qkv_bias=bias)
    shapes = {n: tuple(p.shape) for n, p in LlamaLM(cfg).named_parameters()}
    expect = {"word_embeddings.word_embeddings.weight", "heads.heads.0.norm.weight"} | (
        set() if tied else {"output_layer.weight"})
    for i in range(3):
        expect |= layer_names(i, bias)
    assert set(shapes) == expect
    # 4 heads of 8 in 2 groups: (4 + 2 x 2) x 8 QKV rows; gate and up: 2 x 48 rows.
    assert shapes["layers.0.qkv.weight"] == (64, 32) and shapes["layers.0.fc1.weight"] == (96, 32)
    if not tied:
        assert shapes["output_layer.weight"] == (V, 32)


def test_tied_model_projects_with_its_embedding():
    tied, untied = LlamaLM(tiny(), seed=2), LlamaLM(tiny(share_embeddings_and_output_weights=False), seed=2)
    assert tied.output_weight is tied.word_embeddings.weight
    assert untied.output_weight is untied.output_layer.weight
    # The same seeded weights everywhere else; the untied projection is a draw of its own.
    assert torch.equal(tied.layers[2].fc2.weight, untied.layers[2].fc2.weight)
    assert not torch.equal(untied.output_layer.weight, untied.word_embeddings.weight)
    assert count_parameters(untied) - count_parameters(tied) == V * 32


def test_preset_parameter_counts(monkeypatch):
    """TINY built; QWEN2_0_5B on the meta device, against transformers' count of Qwen2-0.5B."""
    assert count_parameters(LlamaLM(TINY)) == 682_560
    import mmadapt.models.layers as layers

    # init_like_megatron materialises every linear on the CPU: 2 GB and seconds for nothing here.
    monkeypatch.setattr(layers, "init_like_megatron", lambda module, init: module)
    with torch.device("meta"):
        assert count_parameters(LlamaLM(QWEN2_0_5B)) == 494_032_768


def test_no_weight_is_left_without_a_gradient():
    model = LlamaLM(tiny(share_embeddings_and_output_weights=False, add_qkv_bias=True, head_layers=(1, 3)))
    perturb_norms_and_biases(model)
    model(*lm_batch())[0].backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


# --- heads -----------------------------------------------------------------------------------------------

def heads_by_hand(model: LlamaLM, ids, labels) -> list[torch.Tensor]:
    """Each head's loss from its definition: run the layers, norm the scored rows, project, CE."""
    x = model.word_embeddings(ids)
    rope = rotary_table(ids.shape[1], model.config.head_dim, model.config.rotary_base, x)
    outs = {}
    for layer in model.layers:
        x = layer(x, rope)
        outs[layer.layer_number] = x
    scored = labels >= 0
    losses = []
    for head, l in zip(model.heads.heads, model.config.heads_after):
        h = rms_norm(outs[l][scored], head.norm.weight, model.config.layernorm_epsilon)
        losses.append(F.cross_entropy(h @ model.output_weight.T, labels[scored]))
    return losses


@pytest.mark.parametrize("weights", [(), (3.0, 1.0)])
def test_minijoint_loss_is_the_mean_of_heads_computed_separately(weights):
    model = LlamaLM(tiny(head_layers=(1, 3), head_weights=weights, share_embeddings_and_output_weights=False), seed=7)
    perturb_norms_and_biases(model)
    ids, labels = lm_batch()
    labels[0, :4] = IGNORE_INDEX
    loss, per_head = model(ids, labels)
    by_hand = heads_by_hand(model, ids, labels)
    torch.testing.assert_close(per_head, torch.stack(by_hand).detach())
    w = torch.tensor(weights or (1.0, 1.0))
    torch.testing.assert_close(loss, (w / w.sum() * torch.stack(by_hand)).sum())


def test_logits_at_rows_are_the_whole_logits_at_those_rows():
    """Every head's next-piece logits at given flat positions (heldout.Scorer's scored ones):
    [m, V], equal to its whole [b, s, V] logits gathered there (the last layer run at those rows
    alone: DecoderLayer.forward's rows)."""
    model = LlamaLM(tiny(head_layers=(2, 3))).eval()
    perturb_norms_and_biases(model)
    ids, _ = lm_batch()
    rows = torch.tensor([0, 5, 13, 20, 35])
    with torch.no_grad():
        whole, at_rows = model.logits(ids), model.logits(ids, rows=rows)
    assert [t.shape for t in at_rows] == [(len(rows), V)] * 2
    for w, r in zip(whole, at_rows):
        torch.testing.assert_close(r, w.reshape(-1, V)[rows], rtol=0, atol=1e-5)


def test_causal_padding_needs_no_mask():
    """A right-padded row's real positions see exactly what the unpadded row alone sees."""
    model = LlamaLM(tiny(), seed=1).eval()
    ids, _ = lm_batch(b=2, s=14)
    ids[0, 9:] = PAD_ID
    with torch.no_grad():
        padded = model.hidden_states(ids)[0][0, :9]
        alone = model.hidden_states(ids[:1, :9])[0][0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-6)


def test_varlen_is_refused_in_one_line():
    with pytest.raises(ValueError, match="use sdpa: causal attention on right-padded rows needs no mask") as e:
        LlamaLM(tiny(attention_impl="varlen"))
    assert "\n" not in str(e.value)


# --- task head -----------------------------------------------------------------------------------------

def test_task_head_pools_the_last_real_token():
    cfg = tiny(share_embeddings_and_output_weights=False)
    model = LlamaForTask(cfg, "classify", 3, seed=5).eval()
    ids, _ = lm_batch(b=3, s=10)
    ids[1, 6:] = PAD_ID
    ids[2, 8:] = PAD_ID
    labels = torch.tensor([2, 0, 1])
    loss, logits = model(ids, labels)
    assert logits.shape == (3, 3)
    for i, n in enumerate([10, 6, 8]):  # each row alone, unpadded
        torch.testing.assert_close(logits[i], model(ids[i:i + 1, :n])[1][0], rtol=1e-5, atol=1e-6)
    last = model.encode(ids, (3,))[0][[0, 1, 2], [9, 5, 7]]
    torch.testing.assert_close(logits, model.score(model.norm(last))[0])
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))


def test_evaluation_runs_the_last_layer_at_the_last_real_tokens_alone():
    """In evaluation the task model's last layer runs its output projection and MLP at each
    row's last real token alone (the attention over every position as before): the logits of the
    whole layer (training, here without dropout: the same math), the lower layers untouched."""
    model = LlamaForTask(tiny(hidden_dropout=0.0, attention_dropout=0.0), "classify", 3, seed=5)
    perturb_norms_and_biases(model)
    ids, _ = lm_batch(b=3, s=10)
    ids[1, 6:] = PAD_ID
    ids[2, 8:] = PAD_ID
    seen = {layer.layer_number: [] for layer in model.layers}
    for layer in model.layers:
        layer.fc2.register_forward_hook(lambda mod, args, out, n=layer.layer_number: seen[n].append(args[0].shape[:-1]))
    whole = model.train()(ids)[1]
    with torch.no_grad():
        at_last = model.eval()(ids)[1]
    assert seen[3] == [(3, 10), (3,)] and seen[1] == [(3, 10), (3, 10)]
    torch.testing.assert_close(at_last, whole.detach(), rtol=0, atol=1e-6)


def test_task_model_loads_a_pretrained_lm():
    cfg = tiny(head_layers=(1, 3))
    lm = LlamaLM(cfg, seed=1)
    perturb_norms_and_biases(lm)
    state = lm.state_dict()
    task = LlamaForTask(cfg, "classify", 2, seed=9)
    names = {n: task_param_name(n, cfg) for n, _ in task.named_parameters()}
    assert names["norm.weight"] == "heads.heads.1.norm.weight"  # the primary head's
    missing = task.load_state_dict({n: state[full] for n, full in names.items() if full in state}, strict=False)
    assert missing.missing_keys == ["score.weight"] and missing.unexpected_keys == []
    ids, _ = lm_batch()
    torch.testing.assert_close(task.encode(ids, (3,))[0], lm.hidden_states(ids)[-1])


def test_task_kinds_other_than_classify_are_refused():
    with pytest.raises(ValueError, match="task kind must be one of classify for the decoder family"):
        LlamaForTask(tiny(), "span", 2)


# --- pipeline stages -------------------------------------------------------------------------------------

@pytest.fixture
def world_of_one():
    from mmadapt.parallel import init_parallel

    init_parallel(1, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_one_stage_pipeline_is_the_model(tied, world_of_one):
    """Every pipeline parameter maps to a LlamaLM name (each once), starts from its weight, and
    the stage list computes LlamaLM's loss (MINIJOINT: the carried head) and gradients."""
    from mmadapt.models.llama.pipeline import to_pipeline

    pipeline_param_name = LLAMA.pipeline_param_name
    cfg = tiny(share_embeddings_and_output_weights=tied, add_qkv_bias=True, head_layers=(1, 3))
    pipe = to_pipeline(cfg, seed=5, data_parallel_size=1)
    model = LlamaLM(cfg, seed=5)
    names = {n: pipeline_param_name(n, cfg) for n, _ in pipe.named_parameters()}
    assert sorted(names.values()) == sorted(n for n, _ in model.named_parameters())
    ours = dict(model.named_parameters())
    for n, p in pipe.named_parameters():
        assert torch.equal(p, ours[names[n]]), n
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for n, p in pipe.named_parameters():
            p.copy_(ours[names[n]])
    ids, labels = lm_batch()
    loss = pipe((ids, labels))
    want, per_head = model(ids, labels)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(pipe.forward_funcs[-1].head_losses[-1], per_head)
    loss.backward()
    want.backward()
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ours[names[n]].grad, msg=lambda m: f"{n}: {m}")


def test_pipeline_names_of_every_stage_layout():
    """The name map over the whole layer list, without building stages: both ends, tied or not."""
    pipeline_param_name = LLAMA.pipeline_param_name
    cfg = tiny(share_embeddings_and_output_weights=False)
    assert pipeline_param_name("0.word_embeddings.weight", cfg) == "word_embeddings.word_embeddings.weight"
    assert pipeline_param_name("tied_modules.word.word_embeddings.weight", cfg) == (
        "word_embeddings.word_embeddings.weight")
    assert pipeline_param_name("3.fc2.weight", cfg) == "layers.2.fc2.weight"
    assert pipeline_param_name("4.output_layer.weight", cfg) == "output_layer.weight"
    assert pipeline_param_name("5.heads.0.norm.weight", cfg) == "heads.heads.0.norm.weight"
    with pytest.raises(AssertionError, match="unexpected pipeline parameter 6.x"):
        pipeline_param_name("6.x", cfg)


# --- tensor parallel 2 against one process -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_tensor_parallel_2_matches_one_process(tied, tmp_path):
    """2 gloo ranks (tests/llama_tp_worker.py) start from TP = 1's full weights for the same seed,
    and give its losses and every full gradient."""
    cfg = tiny(share_embeddings_and_output_weights=tied, add_qkv_bias=True, head_layers=(2, 3))
    model = LlamaLM(cfg, seed=11)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    perturb_norms_and_biases(model)
    ids, labels = lm_batch(b=4, s=16)
    torch.save({"config": vars(cfg), "seed": 11, "state": model.state_dict(), "ids": ids, "labels": labels},
               tmp_path / "in.pt")
    run_pretrain(2, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"),
                 script=str(REPO / "tests" / "llama_tp_worker.py"))
    tp2 = torch.load(tmp_path / "out.pt")
    assert set(tp2["init"]) == set(init)
    for n, w in init.items():
        assert torch.equal(tp2["init"][n], w), n
    loss, per_head = model(ids, labels)
    loss.backward()
    torch.testing.assert_close(tp2["per_head"], per_head.detach(), rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(tp2["grads"][n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_a_row_longer_than_the_positions_is_refused():
    """An imported sliding-window model (Mistral) has its positions capped at the window, within
    which its attention is exactly causal: a longer row would run full causal attention silently."""
    from mmadapt.models import PRESETS, get_family

    cfg = dataclasses.replace(PRESETS["llama-tiny"][0], max_position_embeddings=16)
    model = get_family(cfg).build_lm(cfg)
    model.encode(torch.zeros(1, 16, dtype=torch.long), (cfg.num_layers,))
    with pytest.raises(ValueError, match="^17 positions exceed the model's max_position_embeddings 16"):
        model.encode(torch.zeros(1, 17, dtype=torch.long), (cfg.num_layers,))
