"""Multi-depth MINIJOINT (issue 19): one pretraining with secondary heads after several layers,
Step 2 over any of its mini-models, the FLOP counts for any number of heads, the depth sweep,
and the paper-exact switches (frozen output bias in Step 2, weight decay on every parameter).

Real numbers throughout: the 3-head loss against each head computed by hand, in one process and
under pipeline (two intermediate heads on stage 0) and tensor parallelism; each extracted
mini-model against its head of the full model, bit for bit; FLOPs against torch's counter."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (NO_DROPOUT, REPO, VOCAB, adapt_args, base_args, heads_by_hand, masked_batch, metrics,
                      mlm_batches, pretrain_here, run_pretrain)
from mmadapt import adapt as A
from evaluation import step2_start
from mmadapt.artifact import read_artifact, system_label
from mmadapt.config import MiniModelConfig, ModelConfig, TrainConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.models.roberta.model import RobertaMLM
from mmadapt.parallel import init_parallel
from mmadapt.family import WORD
from mmadapt.models.roberta import ROBERTA
from mmadapt.models.roberta.model import BIAS
from mmadapt.run import load_weights

SWEEP = str(REPO / "launch" / "sweep.py")
DEPTHS = (2, 4)  # secondary heads; with the primary head after 12: a 3-head MINIJOINT model
HEADS = (*DEPTHS, 12)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_parallel(1, 1)


def tiny(**kw) -> ModelConfig:
    base = {**vars(PRESETS["tiny"][0]), "vocab_size": 300, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    return ModelConfig(**{**base, **kw})


def three_heads(**kw) -> ModelConfig:
    return apply_recipe(tiny(**kw), "minijoint", DEPTHS)


def _batch(seed=0):
    return masked_batch(300, 3, 24, seed)


# --- Step 1: the recipe, the flags, the loss ------------------------------------------------------------

def test_recipe_takes_several_depths_and_one_stays_the_papers():
    base = PRESETS["roberta-base"][0]
    assert apply_recipe(base, "minijoint", (2, 4, 6)).head_layers == (2, 4, 6, 12)
    assert apply_recipe(base, "minijoint", 4).head_layers == (4, 12)
    assert apply_recipe(base, "minijoint", (4,)).head_layers == (4, 12)
    # Depths are always a tuple; one int (as run.json files of one-depth runs hold it) is one depth.
    assert MiniModelConfig().mini_layers == (4,) and MiniModelConfig([6]).mini_layers == (6,)
    assert MiniModelConfig([2, 4]).mini_layers == (2, 4) and MiniModelConfig(4).mini_layers == (4,)
    with pytest.raises(ValueError, match="bl_small builds one mini-model: pass one --mini_layers, not 2 4"):
        apply_recipe(base, "bl_small", (2, 4))
    with pytest.raises(ValueError, match="must be ascending without repeats"):
        apply_recipe(base, "minijoint", (4, 2))
    with pytest.raises(ValueError, match="mini_layers 12 must be in 1..11"):
        apply_recipe(base, "minijoint", (4, 12))


def test_cli_flags_for_depths_weights_and_switches():
    from mmadapt.cli import adapt_parser, configs_from_args, pretrain_parser
    from mmadapt.config import TrainConfig, override

    def parse(*argv):
        return pretrain_parser().parse_args(["--corpus", "x", "--output_dir", "y", "--recipe", "minijoint", *argv])

    model, train = configs_from_args(parse("--mini_layers", "2", "4", "6", "--head_weights", "1", "1", "1", "3",
                                           "--decay_all", "true"))
    assert model.head_layers == (2, 4, 6, 12) and model.loss_weights == (1 / 6, 1 / 6, 1 / 6, 0.5)
    assert train.decay_all is True and TrainConfig().decay_all is False
    assert configs_from_args(parse("--mini_layers", "4"))[0].head_layers == (4, 12)
    with pytest.raises(ValueError, match=r"head_weights \(1.0, 2.0\) has 2 entries for 4 heads"):
        configs_from_args(parse("--mini_layers", "2", "4", "6", "--head_weights", "1", "2"))[0].validate()
    args = adapt_parser().parse_args(["--system", "minijoint", "--source", "s", "--lang", "de", "--output_dir", "o",
                                      "--mini_layers", "2", "--train_output_bias", "false"])
    assert args.mini_layers == [2] and override(TrainConfig(), args).train_output_bias is False


def test_three_head_loss_is_the_mean_of_the_heads_computed_separately():
    model = RobertaMLM(three_heads(), seed=7)
    ids, labels = _batch()
    loss, per_head = model(ids, labels)
    by_hand = heads_by_hand(model, ids, labels)
    assert len(by_hand) == 3 and len({round(x.item(), 4) for x in torch.stack(by_hand).detach()}) == 3  # three different losses
    torch.testing.assert_close(per_head, torch.stack(by_hand).detach())
    torch.testing.assert_close(loss, (by_hand[0] + by_hand[1] + by_hand[2]) / 3)
    # The gradient of the mean reaches every head and every layer.
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_head_weights_give_the_weighted_mean_and_equal_weights_the_papers_mean():
    ids, labels = _batch(seed=1)
    weighted = RobertaMLM(three_heads(head_weights=(1, 1, 2)), seed=7)
    loss, per_head = weighted(ids, labels)
    a, b, c = heads_by_hand(weighted, ids, labels)
    torch.testing.assert_close(loss, (a + b + 2 * c) / 4)
    # The paper's MINIJOINT: two heads, equally weighted = the plain mean.
    paper = apply_recipe(tiny(), "minijoint", 4)
    plain = RobertaMLM(paper, seed=3)(ids, labels)
    equal = RobertaMLM(dataclasses.replace(paper, head_weights=(1, 1)), seed=3)(ids, labels)
    torch.testing.assert_close(equal[0], plain[0])
    torch.testing.assert_close(plain[0], plain[1].mean())


def test_logged_loss_uses_the_same_weights():
    from mmadapt.engine import _loss_row

    per_head = torch.tensor([3.0, 2.0, 1.0])
    assert _loss_row(5, per_head, ("2", "4", "12"))[0]["loss"] == pytest.approx(2.0)
    row, scalars = _loss_row(5, per_head, ("2", "4", "12"), loss_weights=(0.25, 0.25, 0.5))
    assert row["loss"] == pytest.approx(1.75) and row["head_losses"] == {"2": 3.0, "4": 2.0, "12": 1.0}
    assert scalars["loss/head_layer4"] == 2.0


# --- Step 2: the mini-model of each depth --------------------------------------------------------------------

def test_extraction_at_each_depth_gives_exactly_that_heads_loss():
    cfg = three_heads()
    full = RobertaMLM(cfg, seed=11).eval()
    state = full.state_dict()
    with torch.no_grad():
        for seed in range(3):
            ids, labels = _batch(seed=seed)
            _, per_head = full(ids, labels)
            for i, n in enumerate(DEPTHS):
                mini_cfg, mini_state = ROBERTA.extract_minijoint(cfg, state, n)
                assert (mini_cfg.num_layers, mini_cfg.head_layers, mini_cfg.head_weights) == (n, (n,), ())
                assert not any(k.startswith((f"layers.{n}.", "heads.heads.1.")) for k in mini_state)
                mini = RobertaMLM(mini_cfg).eval()
                mini.load_state_dict(mini_state)
                assert mini(ids, labels)[0].item() == per_head[i].item()  # the same computation, bit for bit
            primary_cfg, primary_state = ROBERTA.primary_model(cfg, state)
            primary = RobertaMLM(primary_cfg).eval()
            primary.load_state_dict(primary_state)
            assert primary(ids, labels)[0].item() == per_head[2].item()


def test_the_depth_is_checked_against_the_source_heads():
    cfg = three_heads()
    assert ROBERTA.minijoint_depth(cfg, 4) == 4 and ROBERTA.minijoint_depth(apply_recipe(tiny(), "minijoint", 4)) == 4
    with pytest.raises(ValueError, match="mini-models after layers 2, 4: choose one with --mini_layers"):
        ROBERTA.minijoint_depth(cfg)
    with pytest.raises(ValueError, match="no secondary head after layer 6; its mini-models sit after layers 2, 4"):
        ROBERTA.minijoint_depth(cfg, 6)
    with pytest.raises(ValueError, match="--mini_layers picks one of a MINIJOINT run's mini-models"):
        A.body_config(ROBERTA, "bl_base", cfg, 4)
    with pytest.raises(ValueError, match="has a secondary head before its last layer"):
        ROBERTA.minijoint_depth(apply_recipe(tiny(), "bl_base"))


def test_records_name_the_depth_only_when_the_source_has_several():
    meta = {"system": "minijoint", "mini_layers": 4, "mini_depths": [2, 4]}
    assert system_label(meta) == "minijoint@4"
    assert system_label({**meta, "mini_depths": [4]}) == "minijoint"
    assert system_label({"system": "minijoint", "mini_layers": 4}) == "minijoint"  # artifacts written before
    assert system_label({"system": "bl_base", "mini_layers": 12}) == "bl_base"


def test_full_model_step2_over_another_recipe_is_named_as_that_recipes_ceiling(tmp_path):
    """bl_base over a MINIJOINT source is MINIJOINT's ceiling, `minijoint:full`, in every Step-4
    record (plug-in, task, retrieval); over a BL_BASE run or an imported model (no recipe) it
    is bl_base."""
    for recipe, label in (("minijoint", "minijoint:full"), ("bl_small", "bl_small:full"), ("bl_base", "bl_base"),
                          (None, "bl_base")):
        src = tmp_path / str(recipe)
        src.mkdir()
        (src / "run.json").write_text(json.dumps({} if recipe is None else {"recipe": recipe}))
        assert system_label({"system": "bl_base", "mini_layers": 12, "source": str(src)}) == label
    assert system_label({"system": "minijoint", "mini_layers": 4, "source": str(tmp_path / "minijoint")}) \
        == "minijoint"


def test_bad_depth_is_one_error_line(primary_run, tmp_path, capsys):
    from mmadapt.cli import main

    base = ["adapt", "--system", "minijoint", "--source", str(primary_run), "--lang", "de",
            "--output_dir", str(tmp_path / "run")]
    for extra, message in [(["--mini_layers", "6"], "--mini_layers 6: the MINIJOINT source has no secondary "
                                                    "head after layer 6; its mini-models sit after layer 4"),
                           (["--mini_layers", "2", "4"], "adapt builds one mini-model"),
                           (["--system", "bl_base", "--mini_layers", "4"], "picks one of a MINIJOINT run's")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
        assert not (tmp_path / "run").exists()
    assert main(["sweep", "--source", str(primary_run), "--lang", "de", "--data_path", str(primary_run / "data"),
                 "--output_dir", str(tmp_path / "sweep"), "--mini_layers", "3"]) == 2
    assert "no secondary head after layer 3" in capsys.readouterr().err
    # The primary run's own dataset has no validation split: refused before any training.
    assert main(["sweep", "--source", str(primary_run), "--lang", "de", "--data_path", str(primary_run / "data"),
                 "--output_dir", str(tmp_path / "sweep")]) == 2
    assert "has no validation split for the plug-in metric" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


# --- FLOPs for any number of heads, against the counter ------------------------------------------------

def test_pretrain_flops_of_three_heads_match_the_counter():
    from mmadapt.flops import counted_flops
    from mmadapt.models.roberta.flops import forward_flops, head_flops, layer_flops, pretrain_flops

    cfg = three_heads(attention_impl="math")
    model = RobertaMLM(cfg, seed=1)
    ids, labels = masked_batch(300, 3, 32)
    p = float(labels.ge(0).float().mean())

    def update():
        model(ids, labels)[0].backward()

    counted = counted_flops(update)
    b, s = ids.shape
    assert counted == pytest.approx(b * pretrain_flops(cfg, s, p), rel=1e-9)
    # The paper's A1 with one more head per secondary head: 3 x (l layers + 3 heads).
    assert pretrain_flops(cfg, s, p, paper=True) == pytest.approx(
        3 * (12 * layer_flops(cfg, s) + 3 * head_flops(cfg, s, p)))
    assert forward_flops(cfg, s, p) - forward_flops(apply_recipe(cfg, "minijoint", 4), s, p) == pytest.approx(
        head_flops(cfg, s, p))


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("train_output_bias", [True, False])
def test_step2_flops_at_each_depth_match_the_counter(depth, train_output_bias):
    """Step 2 over the extracted mini-model of each depth; a frozen output bias changes no matmul."""
    from mmadapt.flops import counted_flops
    from mmadapt.models.roberta.flops import adapt_flops
    from mmadapt.engine import trainable_by_names

    source = RobertaMLM(three_heads(), seed=2).state_dict()
    cfg, state = ROBERTA.extract_minijoint(three_heads(attention_impl="math"), source, depth)
    model = RobertaMLM(cfg)
    model.load_state_dict(state)
    is_trainable = trainable_by_names(ROBERTA.vocab_params(None, train_output_bias))
    for n, p in model.named_parameters():
        p.requires_grad_(is_trainable(n))
    assert model.heads.heads[0].bias.requires_grad is train_output_bias
    ids, labels = masked_batch(300, 3, 32)
    p = float(labels.ge(0).float().mean())
    counted = counted_flops(lambda: model(ids, labels)[0].backward())
    assert counted == pytest.approx(3 * adapt_flops(cfg, 32, p), rel=1e-9)


def test_flops_rows_per_depth():
    from mmadapt.flops import total_flops
    from mmadapt.models.roberta.flops import adapt_flops, pretrain_flops
    from mmadapt.report import flops_rows, paper_rows

    base = PRESETS["roberta-base"][0]
    train = TrainConfig(train_iters=125_000, seq_length=512, mask_prob=0.15)
    rows = {(r["system"], r["step"]): r for r in flops_rows(ROBERTA, base, train, 2048, MiniModelConfig((2, 4, 6)))}
    per_depth = {f"{s}@{n}" for s in ("minijoint", "minipost", "bl_small") for n in (2, 4, 6)}
    assert {s for s, step in rows if step == "adapt"} == {"bl_base", *per_depth}
    for n in (2, 4, 6):
        assert rows[(f"minijoint@{n}", "adapt")]["eflops_exact"] == pytest.approx(
            total_flops(adapt_flops(ROBERTA.one_head(base, n), 512, 0.15), 2048, 125_000) / 1e18)
    # The paper's N = 4 row is the same number in the multi-depth table (21.1 EFLOPs, A3).
    assert round(rows[("minijoint@4", "adapt")]["eflops_paper"], 1) == 21.1
    assert rows[("minijoint", "pretrain")]["eflops_exact"] == pytest.approx(
        total_flops(pretrain_flops(apply_recipe(base, "minijoint", (2, 4, 6)), 512, 0.15), 2048, 125_000) / 1e18)
    assert [r["system"] for r in paper_rows()] == ["bl_base", "minijoint", "bl_small", "minipost", "bl_base",
                                                   "minipost", "minijoint", "bl_small"]


# --- the paper-exact switches ---------------------------------------------------------------------------------

def test_weight_decay_on_every_parameter_or_matrices_only():
    from mmadapt.engine import param_groups

    model = RobertaMLM(tiny(num_layers=2, head_layers=(2,)))
    matrices, rest = param_groups(model, 0.01)
    assert (matrices["weight_decay"], rest["weight_decay"]) == (0.01, 0.0)
    assert all(p.ndim >= 2 for p in matrices["params"]) and all(p.ndim < 2 for p in rest["params"])
    matrices, rest = param_groups(model, 0.01, decay_all=True)
    assert (matrices["weight_decay"], rest["weight_decay"]) == (0.01, 0.01)
    assert len(matrices["params"]) + len(rest["params"]) == len(list(model.parameters()))


def test_step2_with_the_papers_frozen_output_bias(primary_run, de_corpus, de_tokenizer, tmp_path):
    """train_output_bias false: only the embedding trains and is checkpointed; the artifact's
    bias is exactly the start's (adapt.Step2Start: fitted to the target text), its embedding is not."""
    from mmadapt import steps
    from mmadapt.run import RunSpec

    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=2, save_interval=2, log_interval=1,
                                train_micro_batch_size_per_gpu=4, train_output_bias=False)
    out = tmp_path / "frozen-bias"
    steps.adapt_embeddings(run=RunSpec(output_dir=out, corpus=de_corpus, tokenizer=de_tokenizer),
                           step=steps.AdaptEmbeddings(system="minijoint", source=primary_run, lang="de", train=train,
                                                      vocab_size=VOCAB))
    tensors, _, meta = read_artifact(out / "embeddings" / "step00000002")
    init = step2_start("minijoint", primary_run, out / "data", seed=train.seed, seq_length=train.seq_length,
                       train_output_bias=False).init
    assert torch.equal(tensors["output_bias"], init[BIAS])
    assert not torch.equal(tensors["word_embeddings"], init[WORD])
    module = torch.load(out / "checkpoints" / "step00000002" / "mp_rank_00_model_states.pt",
                        weights_only=False)["module"]
    # (The empty bias group's placeholder scalar, engine.build_engine, is not a model weight.)
    assert {k for k, v in module.items() if v is not None and not k.startswith("empty_group")} == {WORD}
    run = json.loads((out / "run.json").read_text())
    assert run["trainable"] == [WORD] and run["train"]["train_output_bias"] is False
    assert meta["train_output_bias"] is False and meta["mini_layers"] == 4 and meta["mini_depths"] == [4]


def test_resume_of_a_run_recorded_before_the_new_settings(tmp_path):
    """run.json files written before head_weights / decay_all / train_output_bias existed still
    resume with the defaults; a changed new setting is still refused."""
    from mmadapt.config import TrainConfig, to_dict
    from mmadapt.run import check_same_run

    model, train = to_dict(three_heads()), to_dict(TrainConfig())
    old = {"model": {k: v for k, v in model.items() if k != "head_weights"},
           "train": {k: v for k, v in train.items() if k not in ("decay_all", "train_output_bias")}}
    (tmp_path / "run.json").write_text(json.dumps(old))
    check_same_run(tmp_path / "run.json", {"model": model, "train": train})
    with pytest.raises(ValueError, match="train.decay_all is True here but None"):
        check_same_run(tmp_path / "run.json", {"model": model, "train": {**train, "decay_all": True}})


# --- the sweep's arithmetic -------------------------------------------------------------------------------

def _records(curves: dict) -> list[dict]:
    out = []
    for depth, (start, points) in curves.items():
        for step, (flops, gain) in enumerate(points, start=1):
            out.append({"system": f"minijoint@{depth}" if depth != "full" else "minijoint:full", "lang": "de",
                        "step": 10 * step, "flops": flops, "score": gain, "start_gain": start, "mini_layers": depth})
    return out


def test_sweep_picks_the_cheapest_depth_to_95_percent_of_the_best():
    from mmadapt.sweep import summarize, sweep_markdown

    # Shallow: cheap but plateaus at 0.6; middle: reaches 0.95 of the best (1.0 -> 0.95) first; deep: best, costly.
    curves = {2: (0.0, [(1.0, 0.5), (2.0, 0.6)]), 4: (0.0, [(2.0, 0.9), (4.0, 0.98)]),
              6: (0.0, [(3.0, 0.8), (6.0, 1.0)])}
    s = summarize(_records(curves))
    assert s["reference"] == 1.0 and s["target"] == pytest.approx(0.95) and s["meaningful"]
    rows = {r["mini_layers"]: r for r in s["rows"]}
    assert rows[2]["to_target"] is None
    assert rows[4]["to_target"] == pytest.approx(2.0 + (0.95 - 0.9) / (0.98 - 0.9) * 2.0)  # 3.25
    assert rows[6]["to_target"] == pytest.approx(3.0 + (0.95 - 0.8) / 0.2 * 3.0)  # 5.25
    assert rows[4]["flops_per_update"] == pytest.approx(0.2) and rows[2]["share"] == pytest.approx(0.6)
    assert s["cheapest"] == 4
    # A run that saved its start (update 0, compute 0) has a record of it: the same summary.
    starts = [{**r, "step": 0, "flops": 0.0, "score": r["start_gain"]} for r in _records(curves) if r["step"] == 10]
    assert summarize(starts + _records(curves)) == s
    md = sweep_markdown(s)
    assert "| 2 | 1e-19 | 20 | 2e-18 | +0.000 | +0.600 | 60% | never |" in md
    assert "**Cheapest depth reaching 95% of the reference: N = 4**" in md
    # A ceiling (the full model) becomes the reference; the start point (compute 0) interpolates.
    s = summarize(_records({**curves, "full": (0.1, [(10.0, 1.2)])}))
    assert s["reference"] == 1.2 and s["cheapest"] is None  # 1.14 is out of every depth's reach
    rows = {r["mini_layers"]: r for r in s["rows"]}
    assert rows["full"]["to_target"] == pytest.approx((1.14 - 0.1) / (1.2 - 0.1) * 10.0)
    # Near the unigram reference no target means anything.
    flat = summarize(_records({2: (0.0, [(1.0, 0.01)]), 4: (0.0, [(2.0, 0.02)])}))
    assert not flat["meaningful"] and flat["cheapest"] is None
    assert "within noise" in sweep_markdown(flat)


def test_the_sweeps_summary_for_a_decoder_a_start_at_the_target_and_a_reference_below_zero():
    import json

    from mmadapt.sweep import summarize, sweep_markdown

    curves = {2: (0.0, [(1.0, 0.5), (2.0, 0.6)]), 4: (0.0, [(2.0, 0.9), (4.0, 1.0)])}
    # A decoder's records (plugin-lm): next pieces, not masked ones.
    lm = summarize([{**r, "task": "plugin-lm"} for r in _records(curves)])
    assert (lm["label"], lm["scored"]) == ("LM", "next pieces")
    assert "held-out LM loss through the primary model (nats per next piece)" in sweep_markdown(lm)
    assert "masked-LM loss" in sweep_markdown(summarize([{**r, "task": "plugin-mlm"} for r in _records(curves)]))
    with pytest.raises(ValueError, match="one objective's plug-in metric; these records hold plugin-lm and plugin-mlm"):
        summarize([{**r, "task": "plugin-lm" if r["mini_layers"] == 2 else "plugin-mlm"} for r in _records(curves)])
    # The cheapest depth at the target from its start (0 FLOPs to it), a ceiling that needs some:
    # a ZeroDivisionError before, after sweep.json was written (so every rerun raised it again).
    early = summarize(_records({2: (0.5, [(1.0, 0.51)]), "full": (0.1, [(10.0, 0.52)])}))
    assert early["cheapest"] == 2 and early["rows"][0]["to_target"] == 0.0
    assert "N = 2**, at 0 EFLOPs of Step 2 (its start is at the target already)." in sweep_markdown(early)
    # A reference at or below 0: no share (None, not NaN, which sweep.json could not hold as JSON).
    below = summarize(_records({2: (-0.5, [(1.0, -0.4)]), 4: (-0.5, [(2.0, -0.3)])}))
    assert [r["share"] for r in below["rows"]] == [None, None]
    json.dumps(below, allow_nan=False)
    assert "| 2 | 1e-19 | 10 | 1e-18 | -0.500 | -0.400 | - | - |" in sweep_markdown(below)
    # said as below the unigram reference, not 'within noise' of it (-0.3 is 0.3 away)
    assert "No cheapest depth: the reference gain -0.300 is below the unigram reference" in sweep_markdown(below)
    # gains on a few held-out pieces: no target however large they are, the count said
    few = summarize([{**r, "masked_pieces": 3} for r in _records(curves)])
    assert not few["meaningful"] and few["cheapest"] is None and few["pieces"] == 3
    md = sweep_markdown(few)
    assert "(nats per masked piece, on 3 held-out masked pieces)" in md
    assert "No cheapest depth: the gains are scored on 3 held-out pieces, too few to judge (at least 200)" in md
    assert summarize([{**r, "masked_pieces": 500} for r in _records(curves)])["cheapest"] == 4
    # A depth with update 0 alone has no curve.
    with pytest.raises(ValueError, match="the records of depth 4 hold no trained checkpoint"):
        summarize(_records({2: (0.0, [(1.0, 0.5)])}) + [{**_records({4: (0.0, [(0.0, 0.0)])})[0], "step": 0}])


# --- slow: parallel layouts and the sweep end to end -------------------------------------------------------

STEPS = 3
LAYOUTS = {
    "pp2": ["--pipeline_model_parallel_size", "2", "--gradient_accumulation_steps", "2"],
    "tp2": ["--tensor_model_parallel_size", "2", "--gradient_accumulation_steps", "2"],
}


def _three_head_args(corpus, tokenizer, out, *extra):
    return base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--mini_layers", *map(str, DEPTHS),
                     "--train_iters", str(STEPS), "--log_interval", "1", "--train_micro_batch_size_per_gpu", "8",
                     *NO_DROPOUT, *extra)


@pytest.fixture(scope="module")
def three_head_single(corpus, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("three_heads_single")
    run_pretrain(1, *_three_head_args(corpus, tokenizer, out, "--ds_config", "ds_configs/zero0.json",
                                      "--gradient_accumulation_steps", "2"))
    return out


def _heads(rows):
    return np.array([[r["head_losses"][str(l)] for l in HEADS] for r in rows])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_three_head_loss_under_parallelism_matches_one_process(layout, three_head_single, corpus, tokenizer,
                                                               tmp_path):
    run_pretrain(2, *_three_head_args(corpus, tokenizer, tmp_path, *LAYOUTS[layout]))
    ref, got = metrics(three_head_single), metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    # The loss is the mean of the three heads' losses, in every layout.
    np.testing.assert_allclose([r["loss"] for r in got], _heads(got).mean(1), rtol=1e-6)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    assert len({round(x, 3) for x in _heads(got)[-1]}) == 3
    if layout == "pp2":
        # Both intermediate heads' layers (2, 4) on stage 0, carried to the heads on stage 1.
        run = json.loads((tmp_path / "run.json").read_text())
        parts, layers = run["pipeline_parts"], ROBERTA.pipeline_layer_prefixes(ModelConfig(**run["model"]))
        assert parts[0] <= layers.index("layers.1.") and layers.index("layers.3.") < parts[1]
        assert parts[1] <= layers.index("heads.") < parts[2]


@pytest.fixture(scope="module")
def three_head_run(corpus, tokenizer, tmp_path_factory):
    """A 3-head MINIJOINT model (heads after 2, 4, 12) pretrained long enough to predict."""
    out = tmp_path_factory.mktemp("three_heads")
    pretrain_here(*base_args(corpus, tokenizer, out, "--recipe", "minijoint", "--mini_layers", *map(str, DEPTHS),
                             "--train_iters", "150", "--save_interval", "150", "--log_interval", "50"))
    return out


@pytest.mark.slow
def test_extracted_mini_models_of_a_trained_run_give_their_heads_losses(three_head_run):

    cfg, state = load_weights(three_head_run)
    assert cfg.head_layers == HEADS
    full = RobertaMLM(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    full.load_state_dict(state)
    batches = mlm_batches(three_head_run / "data", 64, VOCAB, 5, 8, 1)
    with torch.no_grad():
        for step in range(2):
            ids, labels = batches.micro_batch(step, 0)
            _, per_head = full(ids, labels)
            for i, n in enumerate(DEPTHS):
                mini_cfg, mini_state = ROBERTA.extract_minijoint(cfg, state, n)
                mini = RobertaMLM(dataclasses.replace(mini_cfg, hidden_dropout=0.0, attention_dropout=0.0)).eval()
                mini.load_state_dict(mini_state)
                assert mini(ids, labels)[0].item() == per_head[i].item()


@pytest.mark.slow
def test_sweep_end_to_end(three_head_run, de_corpus, tmp_path, capsys):
    """launch/sweep.py as a user launches it; then, in this process (cli.main: no fresh
    interpreter's imports), the same sweep again and on other sizes."""
    from mmadapt.cli import main

    out = tmp_path / "sweep"
    args = ["--source", str(three_head_run), "--lang", "de", "--corpus", str(de_corpus), "--valid_fraction", "0.1",
            "--output_dir", str(out), "--train_iters", "6", "--save_interval", "3", "--log_interval", "3",
            "--train_micro_batch_size_per_gpu", "8", "--plugin_blocks", "64", "--ceiling", "true",
            # not the default: the ceiling trains with the default, and the rerun below checked it
            # against this (every rerun of such a sweep was refused as a changed run)
            "--train_output_bias", "true", "--primary_calibration", "none", "--bpb_bytes", "256"]
    proc = run_pretrain(1, *args, script=SWEEP)
    assert "cheapest depth reaching 95% of" in proc.stdout
    result = json.loads((out / "sweep.json").read_text())
    records, summary = result["records"], result["summary"]
    assert {r["system"] for r in records} == {"minijoint@2", "minijoint@4", "minijoint:full"}
    by = {(str(r["mini_layers"]), r["step"]): r for r in records}
    assert set(by) == {(d, s) for d in ("2", "4", "full") for s in (0, 3, 6)}
    # Each run's start (update 0) is scored too: the start of its curve.
    assert all(by[(d, 0)]["score"] == pytest.approx(by[(d, 6)]["start_gain"]) for d in ("2", "4", "full"))
    # Step-2 compute grows with depth; each run over its own depth's mini-model.
    assert by[("2", 6)]["flops"] < by[("4", 6)]["flops"] < by[("full", 6)]["flops"]
    for n in DEPTHS:
        run = json.loads((out / str(n) / "run.json").read_text())
        assert run["mini_layers"] == n and run["mini_depths"] == list(DEPTHS) and run["model"]["num_layers"] == n
        meta = json.loads((out / str(n) / "embeddings" / "step00000006" / "meta.json").read_text())
        assert meta["mini_layers"] == n
    assert [r["mini_layers"] for r in summary["rows"]] == [2, 4, "full"]
    assert summary["reference_from"] == "the full model"
    md = (out / "sweep.md").read_text()
    assert "## Depth sweep, de" in md and "| 2 |" in md and "| 4 |" in md and "| full model |" in md
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["bpb_bytes"] for r in records} == {records[0]["bpb_bytes"]} and 256 <= records[0]["bpb_bytes"] < 512
    # Run again: every depth is finished, nothing is retrained or scored again, the same records come back.
    before = (out / "2" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["sweep", *args]) == 0
    said = capsys.readouterr()
    assert "cheapest depth reaching 95% of" in said.out
    assert "plug-in metric" not in said.out + said.err  # its progress line: nothing was scored
    assert (out / "2" / "metrics.jsonl").read_text() == before
    again = json.loads((out / "sweep.json").read_text())["records"]
    assert again == records
    # A finished depth's checkpoints are not read: all of them damaged (a full disk), the sweep
    # still takes its artifacts (it was refused as a --resume over damaged checkpoints)
    models = sorted((out / "2" / "checkpoints").glob("step*/mp_rank_00_model_states.pt"))
    whole = [m.read_bytes() for m in models]
    for m in models:
        m.write_bytes(m.read_bytes()[:1000])
    assert models and main(["sweep", *args]) == 0, capsys.readouterr().err
    for m, b in zip(models, whole):
        m.write_bytes(b)
    assert json.loads((out / "sweep.json").read_text())["records"] == records
    # An interrupted depth (its final artifact not written) whose every checkpoint is damaged: refused
    # before any depth trains (depth 2 trained in full first), in the sweep's words (no --resume; a
    # new --output_dir threw away every finished depth)
    aside = tmp_path / "aside"
    aside.mkdir()
    shutil.move(out / "2", aside / "2")
    shutil.move(out / "4" / "embeddings" / "step00000006", aside / "final4")
    models = sorted((out / "4" / "checkpoints").glob("step*/mp_rank_00_model_states.pt"))
    whole = [m.read_bytes() for m in models]
    for m in models:
        m.write_bytes(m.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["sweep", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: every complete checkpoint in {out / '4' / 'checkpoints'} is damaged (the newest, "
                          "step00000006: ") and err.endswith(
        f"restore its files and run the sweep again, or remove {out / '4'} to train that depth anew"), err
    assert not (out / "2").exists() and len(err.splitlines()) == 1
    for m, b in zip(models, whole):
        m.write_bytes(b)
    shutil.move(aside / "2", out / "2")
    shutil.move(aside / "final4", out / "4" / "embeddings" / "step00000006")
    # A rank whose own view of the depths lags (another node's cached listing: each "new") takes
    # rank 0's (parallel.rank0_decides): it trains none of them either
    from mmadapt import parallel, steps

    listed, rank0_view = steps.run_progress, [False]

    def decides(decide):
        rank0_view[0] = True
        try:
            return decide()
        finally:
            rank0_view[0] = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps, "run_progress", lambda d, iters: listed(d, iters) if rank0_view[0] else "new")
        mp.setattr(parallel, "rank0_decides", decides)
        mp.setattr(steps, "adapt_embeddings", lambda *a, **k: pytest.fail("a finished depth trained again"))
        assert main(["sweep", *args]) == 0
    capsys.readouterr()
    # Another schedule into the same directory: its finished depths are not this sweep's, refused
    # in one line before anything trains or is scored
    assert main(["sweep", *args, "--lr", "0.01"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {out / '2'} holds a Step-2 run of a sweep with other settings: train.lr is 0.01 "
                          "here but") and err.endswith("run the sweep as it first ran, or choose a new --output_dir")
    assert "--resume" not in err and len(err.splitlines()) == 1, err  # no --resume was given
    assert (out / "2" / "metrics.jsonl").read_text() == before
    assert json.loads((out / "sweep.json").read_text())["records"] == records
    # A stop between depth 2's last checkpoint and its artifact: the next sweep writes the artifact
    final = out / "2" / "embeddings" / "step00000006"
    shutil.rmtree(final)
    assert main(["sweep", *args]) == 0
    assert (final / "embeddings.pt").is_file() and (out / "2" / "metrics.jsonl").read_text() == before
    capsys.readouterr()
    # Other sizes score the same checkpoints again, still training nothing; a stopped depth's
    # artifact of the update it stopped at (4, off the schedule) is no point of its curve: it
    # gave that depth a point the others lack, and moved its compute to the target
    stopped = out / "2" / "embeddings" / "step00000004"
    shutil.copytree(out / "2" / "embeddings" / "step00000003", stopped)
    meta = json.loads((stopped / "meta.json").read_text())
    (stopped / "meta.json").write_text(json.dumps({**meta, "step": 4, "off_schedule": True}))  # as a stop writes it
    # a SIGTERM while it scores (scancel, preemption): stopped as a depth's loop stops (75, one
    # line), where it died with 143 and no word; sweep.json kept as it was
    from conftest import sigterm_before
    from mmadapt import steps
    scores, kept = steps.plugin_records, (out / "sweep.json").read_text()
    steps.plugin_records = sigterm_before(scores)
    try:
        assert main(["sweep", *args[:-1], "512"]) == 75
    finally:
        steps.plugin_records = scores
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("stopped by SIGTERM at update 6: checkpoint "
                                                                "step00000006 is complete; run the same command "
                                                                "again to continue")
    assert (out / "sweep.json").read_text() == kept
    assert main(["sweep", *args[:-1], "512"]) == 0
    said = capsys.readouterr()
    assert "plug-in metric" in said.out + said.err and (out / "2" / "metrics.jsonl").read_text() == before
    rescored = json.loads((out / "sweep.json").read_text())["records"]
    assert [(r["mini_layers"], r["step"]) for r in rescored] == [(r["mini_layers"], r["step"]) for r in records]
    # and while it writes its results (its plot): the same, where the default action exited 143 with
    # no word (the next run reads sweep.json's records back and writes the rest)
    plot = steps.plot_sweep
    steps.plot_sweep = sigterm_before(plot)
    try:
        assert main(["sweep", *args[:-1], "512"]) == 75
    finally:
        steps.plot_sweep = plot
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("stopped by SIGTERM at update 6")
    # run again with another --save_interval (changeable): the depths' checkpoints are the same points
    capsys.readouterr()
    assert main(["sweep", *args[:-1], "512", "--save_interval", "2"]) == 0
    said = capsys.readouterr()
    assert "plug-in metric" not in said.out + said.err
    assert json.loads((out / "sweep.json").read_text())["records"] == rescored
    assert [r["score"] for r in rescored] == [r["score"] for r in records]  # the plug-in metric: the same blocks
    assert all(r["bpb_bytes"] > records[0]["bpb_bytes"] for r in rescored)
    # Another source (the run copied elsewhere) with a depth of its own into this directory: refused
    # in one line, sweep.json and every depth kept (it trained that depth, replaced sweep.json with
    # its records alone and left two sources' depths side by side)
    # (depth 4 and the ceiling left out of the directory: a depth both train is refused as a changed
    # run already)
    other, partial = tmp_path / "other_source", tmp_path / "partial"
    shutil.copytree(three_head_run, other)
    shutil.copytree(out, partial)
    shutil.rmtree(partial / "4")
    shutil.rmtree(partial / "full")
    kept, listing = (partial / "sweep.json").read_text(), sorted(p.name for p in partial.iterdir())
    capsys.readouterr()
    given = {str(three_head_run): str(other), str(out): str(partial)}
    no_ceiling = args[:args.index("--ceiling")] + args[args.index("--ceiling") + 2:]
    assert main(["sweep", *[given.get(a, a) for a in no_ceiling], "--mini_layers", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --output_dir {partial} holds a sweep over {three_head_run.resolve()} (its sweep.json), not"
                   f" over --source {other}: choose a new --output_dir, or pass --source {three_head_run.resolve()} "
                   "(nothing is overwritten)"), err
    assert (partial / "sweep.json").read_text() == kept and sorted(p.name for p in partial.iterdir()) == listing


def test_sweep_on_a_corpus_with_an_expanded_vocabulary(three_head_run, de_corpus, tmp_path, capsys):
    """sweep --vocab_mode expand --corpus prepares the source's vocabulary with the target's new
    pieces appended, as adapt does on the same corpus (it had prepared a replace vocabulary, which
    the first depth then refused as no expansion of the source's, and so did every rerun)."""
    from mmadapt.cli import main
    from mmadapt.data import read_manifest
    from mmadapt.expand import check_expansion
    from mmadapt.tokenizer import pieces

    out = tmp_path / "sweep"
    assert main(["sweep", "--source", str(three_head_run), "--lang", "de", "--corpus", str(de_corpus),
                 "--valid_fraction", "0.1", "--vocab_mode", "expand", "--mini_layers", "2", "--vocab_size", "300",
                 "--output_dir", str(out), "--train_iters", "2", "--save_interval", "2", "--log_interval", "2",
                 "--train_micro_batch_size_per_gpu", "8", "--plugin_blocks", "16"]) == 0, capsys.readouterr().err
    source = three_head_run / "tokenizer" / "spm.model"
    assert check_expansion(source, out / "data" / "tokenizer.model") == VOCAB
    merged = pieces(out / "data" / "tokenizer.model")
    assert merged[:VOCAB] == pieces(source) and len(merged) > VOCAB
    assert read_manifest(out / "data")["vocab_size"] == len(merged)
    records = json.loads((out / "sweep.json").read_text())["records"]
    assert {(r["mini_layers"], r["step"]) for r in records} == {(2, 0), (2, 2)}


@pytest.mark.slow
def test_step2_cli_over_a_chosen_depth(three_head_run, de_corpus, de_tokenizer, tmp_path, capsys):
    """adapt --mini_layers N over a multi-depth run; without it, the one-line choice error."""
    from mmadapt.cli import main

    assert main(["adapt", *adapt_args("minijoint", three_head_run, de_corpus, de_tokenizer, tmp_path / "none")]) == 2
    assert "mini-models after layers 2, 4: choose one with --mini_layers" in capsys.readouterr().err
    run = tmp_path / "at2"
    assert main(["adapt", *adapt_args("minijoint", three_head_run, de_corpus, de_tokenizer, run, "--mini_layers", "2",
                                      "--train_iters", "2", "--save_interval", "2", "--log_interval", "1")]) == 0
    tensors, _, meta = read_artifact(run / "embeddings" / "step00000002")
    assert meta["mini_layers"] == 2 and system_label(meta) == "minijoint@2"
    assert tensors["word_embeddings"].shape == (VOCAB, 64)
