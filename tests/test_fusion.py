"""Fused execution (ModelConfig.fusion, mmadapt/fusion.py) against the eager model, the reference.

With dropout off, compiled and eager models give the same losses and gradients in fp32 (to
rounding, rtol 1e-5) in each step's training setting: Step 1 MINIJOINT (two heads, everything
trained), Step 1b MINIPOST (lower layers frozen), Step 2 (word embeddings and output bias only),
Step 3 (a task model, word embeddings frozen), and launched two-rank runs under tensor and
pipeline parallelism. With dropout on, the compiled model trains and is deterministic for a
seed. TorchInductor builds C++ kernels on first use (tens of seconds on 2 cores), so every test
that compiles is slow; the config, CLI and resume checks are not.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import NO_DROPOUT, base_args, masked_batch, metrics, run_pretrain
from mmadapt.config import ModelConfig, TrainConfig, to_dict
from mmadapt.models import PRESETS
from mmadapt.engine import trainable_by_names
from mmadapt.fusion import apply_fusion, is_fused
from mmadapt.models.roberta.model import MLMHeads, RobertaForTask, RobertaMLM, TransformerLayer
from mmadapt.tokens import IGNORE_INDEX, PAD_ID
from mmadapt.models.roberta import ROBERTA

# Two layers keep compile time down; heads after both: MINIJOINT's shape with N = 1.
TWO_HEADS = dataclasses.replace(PRESETS["tiny"][0], num_layers=2, head_layers=(1, 2), hidden_dropout=0.0,
                                attention_dropout=0.0)


def _compiled(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, fusion="compile")


# --- config, CLI, resume (no compilation) ---------------------------------------------------------------

def test_fusion_is_validated_in_one_line():
    assert TWO_HEADS.fusion == "auto"  # compiled on a CUDA device, eager elsewhere (fusion.resolved)
    _compiled(TWO_HEADS).validate()
    with pytest.raises(ValueError, match=r"^--fusion must be one of auto, none, compile, cudagraphs, got 'inductor'$"):
        dataclasses.replace(TWO_HEADS, fusion="inductor").validate()
    graphed = dataclasses.replace(TWO_HEADS, fusion="cudagraphs")
    graphed.validate()
    for layout in ({"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}):
        with pytest.raises(ValueError, match=r"^--fusion cudagraphs captures whole layers, at tensor and pipeline "
                                             r"parallel size 1 \(here [12] and [12]\): use --fusion compile$"):
            dataclasses.replace(graphed, **layout).validate()
    with pytest.raises(ValueError, match=r"^--fusion cudagraphs replays fixed shapes, and --attention_impl varlen "
                                         r"changes them with every batch's lengths: use --attention_impl sdpa, or "
                                         r"--fusion compile$"):
        dataclasses.replace(graphed, attention_impl="varlen").validate()


def test_auto_compiles_on_a_cuda_device_only(monkeypatch):
    import mmadapt.fusion as fusion

    assert [fusion.resolved(f) for f in ("auto", "none", "compile")] == ["none", "none", "compile"]  # this CPU
    model = RobertaMLM(TWO_HEADS, seed=1)
    assert apply_fusion(model, TWO_HEADS, ROBERTA.compiled_kinds) is model and not is_fused(model)
    monkeypatch.setattr(fusion.parallel, "device", lambda: torch.device("cuda", 0))
    assert [fusion.resolved(f) for f in ("auto", "none", "compile")] == ["compile", "none", "compile"]
    assert is_fused(apply_fusion(RobertaMLM(TWO_HEADS, seed=1), TWO_HEADS, ROBERTA.compiled_kinds))


def test_cudagraphs_graphs_frozen_layers_alone_on_a_cuda_device_only(monkeypatch):
    """fusion 'cudagraphs': refused in one line off CUDA; on a CUDA device every module of the
    family's compiled_kinds is compiled as with 'compile', and each frozen layer (graphed_kinds, no
    parameter requiring a gradient) twice: its training calls whose input needs a gradient
    (Step 2's, below the trained embeddings) with CUDA graphs at static shapes, its other calls
    (evaluation; forward-only training calls, as Step 1b's copied layers make) as 'compile'
    compiles them; a trained layer and the heads once, as 'compile' does (tests/test_gpu.py runs
    it on a GPU)."""
    import mmadapt.fusion as fusion

    cfg = dataclasses.replace(TWO_HEADS, fusion="cudagraphs")
    with pytest.raises(ValueError, match=r"^--fusion cudagraphs needs a CUDA device \(this process trains on cpu\): "
                                         r"use --fusion compile$"):
        apply_fusion(RobertaMLM(cfg, seed=1), cfg, ROBERTA.compiled_kinds, ROBERTA.graphed_kinds)
    compiled, called = [], []

    def fake_compile(fn, **kw):  # what torch.compile was asked for, and which compiled call runs
        compiled.append((type(fn.__self__), kw))
        return lambda *args, **kwargs: called.append((type(fn.__self__), kw)) or fn(*args, **kwargs)
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fusion.parallel, "device", lambda: torch.device("cuda", 0))

    def fused(fusion_: str, frozen_layers: int) -> RobertaMLM:
        compiled.clear()
        model = RobertaMLM(cfg, seed=1)
        _freeze(model, lambda name: not any(name.startswith(f"layers.{i}.") for i in range(frozen_layers)))
        return apply_fusion(model, dataclasses.replace(cfg, fusion=fusion_), ROBERTA.compiled_kinds,
                            ROBERTA.graphed_kinds)

    graphed, plain = {"dynamic": False, "options": fusion.GRAPHED}, {}
    model = fused("cudagraphs", 2)
    assert compiled == [(TransformerLayer, graphed), (TransformerLayer, plain)] * 2 + [(MLMHeads, plain)]
    ids, labels = masked_batch(cfg.vocab_size, b=2, s=16, seed=0)
    model(ids, labels)
    assert called == [(TransformerLayer, graphed)] * 2 + [(MLMHeads, plain)], called
    called.clear()
    with torch.no_grad():
        model(ids, labels)
    assert called == [(TransformerLayer, plain)] * 2 + [(MLMHeads, plain)], called
    called.clear()
    _freeze(model, lambda name: name.startswith("heads."))  # nothing below the layers trains: forward only
    model(ids, labels)
    assert called == [(TransformerLayer, plain)] * 2 + [(MLMHeads, plain)], called
    fused("cudagraphs", 1)
    assert compiled == [(TransformerLayer, graphed), (TransformerLayer, plain)] * 1 + [
        (TransformerLayer, plain), (MLMHeads, plain)]
    fused("cudagraphs", 0)
    assert compiled == [(TransformerLayer, plain)] * 2 + [(MLMHeads, plain)]
    fused("compile", 2)
    assert compiled == [(TransformerLayer, plain)] * 2 + [(MLMHeads, plain)]
    assert fusion.GRAPHED == torch._inductor.list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}


def test_fusion_is_a_flag_of_every_training_command():
    from mmadapt.cli import adapt_parser, configs_from_args, finetune_parser, minipost_parser, pretrain_parser

    args = pretrain_parser().parse_args(["--corpus", "x", "--output_dir", "y", "--fusion", "compile"])
    assert configs_from_args(args)[0].fusion == "compile"
    assert configs_from_args(pretrain_parser().parse_args(["--corpus", "x", "--output_dir", "y"]))[0].fusion == "auto"
    # Later steps take it as a layout setting (config.LAYOUT_FIELDS), over the source run's.
    for parser, required in ((minipost_parser, ["--primary", "p"]), (adapt_parser, ["--system", "bl_base",
                             "--source", "s", "--lang", "de"]), (finetune_parser, ["--task", "xnli", "--primary", "p"])):
        args = parser().parse_args([*required, "--output_dir", "y", "--fusion", "compile"])
        assert args.fusion == "compile", parser.__name__


def test_a_resume_may_switch_fusion_and_old_records_resume(tmp_path):
    """run.json files written before `fusion` existed resume with either value; the check still
    refuses a changed model setting."""
    import json

    from mmadapt.run import check_same_run, recorded_defaults

    assert recorded_defaults()["model.fusion"] == "auto"
    model, train = to_dict(TWO_HEADS), to_dict(TrainConfig())
    old = {"model": {k: v for k, v in model.items() if k != "fusion"}, "train": train}
    (tmp_path / "run.json").write_text(json.dumps(old))
    for fusion in ("auto", "none", "compile"):
        check_same_run(tmp_path / "run.json", {"model": {**model, "fusion": fusion}, "train": train})
    (tmp_path / "run.json").write_text(json.dumps({"model": {**model, "fusion": "compile"}, "train": train}))
    check_same_run(tmp_path / "run.json", {"model": {**model, "fusion": "none"}, "train": train})
    with pytest.raises(ValueError, match="model.attention_impl is math here but sdpa"):
        check_same_run(tmp_path / "run.json", {"model": {**model, "attention_impl": "math"}, "train": train})


def test_compile_marks_layers_and_heads_in_place():
    eager = RobertaMLM(TWO_HEADS, seed=1)
    assert apply_fusion(eager, TWO_HEADS, ROBERTA.compiled_kinds) is eager and not is_fused(eager)  # "none": untouched
    fused = apply_fusion(RobertaMLM(TWO_HEADS, seed=1), _compiled(TWO_HEADS), ROBERTA.compiled_kinds)
    compiled = {type(m) for m in fused.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {TransformerLayer, MLMHeads}
    assert sum(getattr(m, "_compiled_call_impl", None) is not None for m in fused.modules()) == 2 + 1
    # Same parameter names and values: checkpoints and starting weights load as they are.
    assert list(fused.state_dict()) == list(eager.state_dict())
    for (name, a), b in zip(eager.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), name
    task = apply_fusion(RobertaForTask(_compiled(TWO_HEADS), "classify", 3, seed=1), _compiled(TWO_HEADS), ROBERTA.compiled_kinds)
    assert {type(m) for m in task.modules() if getattr(m, "_compiled_call_impl", None) is not None} == \
        {TransformerLayer}


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_a_layer_at_tp1_compiles_whole_and_eager_attention_draws_from_the_forked_stream(family):
    """layers.attention_rng: traced by dynamo (what `compile` compiles), a TP-1 layer with
    attention dropout is one graph, no break (the model-parallel fork swaps generator states,
    which dynamo cannot trace: it split each layer into three graphs around an eager attention
    core). Eager, the attention core still draws its dropout masks from the model-parallel
    stream: the default generator's state is left as it was, the forked stream's moves."""
    from mmadapt.models.llama.model import LlamaLM, config_rotary_table
    from mmadapt.parallel import MODEL_PARALLEL_RNG, seed_everything

    seed_everything(0)
    if family == "roberta":
        cfg = dataclasses.replace(TWO_HEADS, attention_dropout=0.1, hidden_dropout=0.1)
        layer = RobertaMLM(cfg, seed=1).layers[0]
        x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
        extra = ()
        attend = lambda: layer.attention(x, None)
    else:
        cfg = dataclasses.replace(PRESETS["llama-tiny"][0], num_layers=1, attention_dropout=0.1, hidden_dropout=0.1)
        layer = LlamaLM(cfg, seed=1).layers[0]
        x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
        extra = (config_rotary_table(cfg, 16, x),)
        attend = lambda: layer.attention(x, *extra)
    layer.train()
    explained = torch._dynamo.explain(layer)(x, *extra)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    default, forked = torch.get_rng_state(), MODEL_PARALLEL_RNG.state_dict()["cpu"].clone()
    attend()
    assert torch.equal(torch.get_rng_state(), default)
    assert not torch.equal(MODEL_PARALLEL_RNG.state_dict()["cpu"], forked)


# --- compiled against eager, in process -------------------------------------------------------------

def _padded(ids: torch.Tensor, labels: torch.Tensor, pad: int = 5):
    """The batch with its last `pad` positions turned into padding (attention masks them)."""
    ids, labels = ids.clone(), labels.clone()
    ids[:, -pad:], labels[:, -pad:] = PAD_ID, IGNORE_INDEX
    return ids, labels


def _batches(vocab: int, n: int = 5) -> list:
    """Micro-batches with a different number of masked positions each; every third padded."""
    out = [masked_batch(vocab, b=4, s=32, seed=k) for k in range(n)]
    return [_padded(*b) if k % 3 == 2 else b for k, b in enumerate(out)]


def _freeze(model: torch.nn.Module, trainable) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _compare(eager, fused, batches, trainable_names: set[str]) -> list[int]:
    """Loss and every gradient of each batch, fused against eager. Returns the number of
    compiled graphs after each batch."""
    graphs = []
    for ids, labels in batches:
        for m in (eager, fused):
            m.zero_grad(set_to_none=True)
        loss_e, loss_f = eager(ids, labels)[0], fused(ids, labels)[0]
        loss_e.backward()
        loss_f.backward()
        torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
        with_grad = set()
        for (name, p_e), p_f in zip(eager.named_parameters(), fused.parameters()):
            assert (p_e.grad is None) == (p_f.grad is None), name
            if p_e.grad is not None:
                with_grad.add(name)
                torch.testing.assert_close(p_f.grad, p_e.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert with_grad == trainable_names  # the freezing is real in both
        graphs.append(_graphs())
    return graphs


def _check_pair(build, cfg: ModelConfig, trainable, batches) -> list[int]:
    eager, fused = build(cfg), apply_fusion(build(_compiled(cfg)), _compiled(cfg), ROBERTA.compiled_kinds)
    assert is_fused(fused)
    for m in (eager, fused):
        _freeze(m, trainable)
    names = {n for n, p in eager.named_parameters() if p.requires_grad}
    # Past dynamo's recompile limit a function would silently run eagerly: make it an error here.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return _compare(eager, fused, batches, names)


@pytest.mark.slow
def test_minijoint_compiled_equals_eager_and_does_not_recompile_per_batch():
    """Step 1: two heads, everything trained; then evaluation (no_grad, eval mode)."""
    batches = _batches(TWO_HEADS.vocab_size, 6)
    assert len({int(labels.ge(0).sum()) for _, labels in batches}) == 6  # m differs in every batch
    graphs = _check_pair(lambda c: RobertaMLM(c, seed=1), TWO_HEADS, trainable_by_names(None), batches)
    # The heads see [m, h]: the second batch recompiles them with m symbolic, the first padded
    # one (the third) adds the masked-attention graphs; later batches, padded or not, reuse them.
    assert graphs[2] == graphs[3] == graphs[4] == graphs[5], graphs
    eager, fused = RobertaMLM(TWO_HEADS, seed=1).eval(), apply_fusion(
        RobertaMLM(TWO_HEADS, seed=1), _compiled(TWO_HEADS), ROBERTA.compiled_kinds).eval()
    with torch.no_grad(), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for ids, labels in _batches(TWO_HEADS.vocab_size, 3):
            le, he = eager(ids, labels)
            lf, hf = fused(ids, labels)
            torch.testing.assert_close(lf, le, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(hf, he, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_minipost_freezing_compiled_equals_eager():
    """Step 1b: N = 1 copied layer, embeddings and head frozen, K = 2 new layers trained (the
    lowest trainable layer skips megatron's input gradient: a path of its own)."""
    from mmadapt.models.roberta import ROBERTA

    cfg = dataclasses.replace(TWO_HEADS, num_layers=3, head_layers=())
    _check_pair(lambda c: RobertaMLM(c, seed=1), cfg, trainable_by_names(ROBERTA.minipost_trainable(1, 2)),
                _batches(cfg.vocab_size, 4))


@pytest.mark.slow
def test_step2_embeddings_only_compiled_equals_eager():
    """Step 2: only the word embeddings (tied to the output projection) and the output bias."""
    from mmadapt.family import WORD
    from mmadapt.models.roberta.model import BIAS

    cfg = dataclasses.replace(TWO_HEADS, head_layers=())
    _check_pair(lambda c: RobertaMLM(c, seed=1), cfg, trainable_by_names((WORD, BIAS)),
                _batches(cfg.vocab_size, 4))


@pytest.mark.slow
def test_step2_replayed_layers_equal_eager_in_training_and_evaluation():
    """fusion.replay, what 'cudagraphs' applies to each frozen layer, run for real on this CPU
    (where Inductor skips the CUDA graphs and compiles the rest): Step 2's losses and gradients
    equal eager's to rounding, padded batches included, and so do the losses in evaluation (its
    calls compiled apart, with shapes that may vary)."""
    import mmadapt.fusion as fusion
    from mmadapt.family import WORD
    from mmadapt.models.roberta.model import BIAS

    cfg = dataclasses.replace(TWO_HEADS, head_layers=())
    eager, fused = RobertaMLM(cfg, seed=1), RobertaMLM(cfg, seed=1)
    trainable = trainable_by_names((WORD, BIAS))
    for m in (eager, fused):
        _freeze(m, trainable)
    for layer in fused.layers:
        fusion.replay(layer)
    assert is_fused(fused)
    batches = _batches(cfg.vocab_size, 4)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        _compare(eager, fused, batches, {n for n, p in eager.named_parameters() if p.requires_grad})
        with torch.no_grad():
            for ids, labels in batches + [masked_batch(cfg.vocab_size, b=3, s=24, seed=9)]:
                torch.testing.assert_close(fused(ids, labels)[0], eager(ids, labels)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_task_model_compiled_equals_eager():
    """Step 3: a classifier on the primary model, word embeddings frozen, padded examples."""
    from mmadapt.models.roberta import ROBERTA

    cfg = dataclasses.replace(TWO_HEADS, head_layers=())
    g = torch.Generator().manual_seed(0)
    batches = []
    for pad in (3, 7, 1):  # padding differs per batch (fine-tuning pads each example to seq_length)
        ids = torch.randint(5, cfg.vocab_size, (4, 32), generator=g)
        ids[:, -pad:] = PAD_ID
        batches.append((ids, torch.randint(0, 3, (4,), generator=g)))
    _check_pair(lambda c: RobertaForTask(c, "classify", 3, seed=1), cfg, trainable_by_names(ROBERTA.finetune_trainable(cfg)),
                batches)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "varlen"])
def test_pipeline_stage_modules_compiled_equal_eager_without_recompiling(impl):
    """A last pipeline stage's modules (two layers, the first carrying its output to the second
    head), fed what set_host_batches hands them: same losses and gradients compiled as eager,
    and no recompilation per micro-batch for their host-side bookkeeping."""
    from mmadapt.models.roberta.model import Padding, masked_positions
    from mmadapt.models.roberta.pipeline import PipeMLMHeads, PipeTransformerLayer

    cfg = dataclasses.replace(TWO_HEADS, attention_impl=impl)

    def stage(c: ModelConfig) -> torch.nn.ModuleList:
        return torch.nn.ModuleList([PipeTransformerLayer(c, 1, 1), PipeTransformerLayer(c, 2, 1), PipeMLMHeads(c, 1)])

    eager, fused = stage(cfg), apply_fusion(stage(_compiled(cfg)), _compiled(cfg), ROBERTA.compiled_kinds)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 32, cfg.hidden_size, generator=g)
    word = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
    graphs = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for k, pad in enumerate((0, 0, 3, 4, 0, 5, 6)):
            ids, labels = masked_batch(cfg.vocab_size, b=4, s=32, seed=k)
            if pad:
                ids, labels = _padded(ids, labels, pad)
            losses, grads = [], []
            for model in (eager, fused):
                model.zero_grad(set_to_none=True)
                *layers, heads = model
                for layer in layers:
                    layer.pending.append(Padding.of(ids))
                heads.pending.append((*masked_positions(labels), None, None))
                x, w = hidden.clone().requires_grad_(), word.clone().requires_grad_()
                out = (x, ids, labels)
                for layer in layers:
                    out = layer(out)
                loss = heads((*out, w))
                loss.backward()
                losses.append(loss)
                grads.append([x.grad, w.grad, *(p.grad for p in model.parameters())])
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            for got, want in zip(grads[1], grads[0]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            graphs.append(_graphs())
    assert len(eager[-1].head_losses) == len(fused[-1].head_losses) == 7
    assert not any(m.pending for model in (eager, fused) for m in model)
    # m changes in every micro-batch and the padding in most: after the first two padded ones
    # ("varlen": the longest length, an int, made symbolic) nothing is compiled again.
    assert graphs[3:] == [graphs[3]] * 4, graphs


@pytest.mark.slow
def test_compiled_dropout_trains_and_is_deterministic_per_seed():
    from mmadapt.parallel import seed_everything

    cfg = _compiled(dataclasses.replace(TWO_HEADS, hidden_dropout=0.1, attention_dropout=0.1))
    ids, labels = masked_batch(cfg.vocab_size, b=4, s=32, seed=0)

    def train(seed: int) -> list[float]:
        seed_everything(seed)
        model = apply_fusion(RobertaMLM(cfg, seed=1), cfg, ROBERTA.compiled_kinds)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(4):
            loss, _ = model(ids, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    first, again, other = train(0), train(0), train(1)
    assert all(math.isfinite(x) for x in first + other)
    assert first == again  # bit for bit
    assert first != other  # the seed reaches the dropout masks: dropout is on in the compiled graphs
    assert first[-1] < first[0]  # it learns the batch


# --- launched two-rank runs: --fusion compile against --fusion none -------------------------------------

STEPS = 3
# Four layers (heads after 2 and 4): the pipeline's second head sits on its first stage.
SHAPE = ["--recipe", "minijoint", "--num_layers", "4", "--mini_layers", "2"]
LAYOUTS = {"tp2": ["--tensor_model_parallel_size", "2"], "pp2": ["--pipeline_model_parallel_size", "2"]}


def _args(corpus, tokenizer, out, *extra):
    return base_args(corpus, tokenizer, out, *SHAPE, "--train_iters", str(STEPS), "--log_interval", "1",
                     "--train_micro_batch_size_per_gpu", "8", "--gradient_accumulation_steps", "2", *NO_DROPOUT,
                     *extra)


@pytest.fixture(scope="module")
def eager_tp2(corpus, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("eager_tp2")
    run_pretrain(2, *_args(corpus, tokenizer, out / "run", *LAYOUTS["tp2"], "--fusion", "none"),
                 env={"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")})
    return out


def _losses(rows) -> np.ndarray:
    return np.array([[r["loss"], r["head_losses"]["2"], r["head_losses"]["4"]] for r in rows])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_launched_compiled_run_matches_eager(layout, eager_tp2, corpus, tokenizer, tmp_path):
    import json

    from mmadapt.checkpoint import load_full_state_dict

    # A cache of the run's own: its generated kernels show that Inductor compiled (the eager run
    # wrote none).
    cache = tmp_path / "inductor"
    run_pretrain(2, *_args(corpus, tokenizer, tmp_path / "run", *LAYOUTS[layout], "--fusion", "compile"),
                 env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert any(cache.rglob("*.py")) and not any((eager_tp2 / "inductor").rglob("*.py"))
    eager_tp2 = eager_tp2 / "run"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["model"]["fusion"] == "compile"
    got, ref = metrics(tmp_path / "run"), metrics(eager_tp2)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(_losses(got), _losses(ref), rtol=1e-5)
    mine, theirs = load_full_state_dict(tmp_path / "run" / "checkpoints"), load_full_state_dict(eager_tp2 / "checkpoints")
    assert sorted(mine) == sorted(theirs)
    for name, w in theirs.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name} differs")
