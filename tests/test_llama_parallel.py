"""The decoder family under every parallel layout against one process: tensor parallel 2,
pipeline parallel 2 and ZeRO-2 on 2 gloo ranks, and TP 2 x PP 2 on 4, for MINIJOINT pretraining
(tied and untied output projection) and for Step 2 over its mini-model, every position scored
(TP 2 x PP 2, ZeRO-2) or a quarter of them (TP 2, PP 2).

As tests/test_parallel.py does for the encoder: the same seed and global batch of 16 blocks (one
process: 2 micro-batches of 8 with gradient accumulation; ZeRO-2: 2 data-parallel ranks of 8),
dropout off (the llama-tiny preset's), so only floating-point reduction orders differ.
"""

import json

import numpy as np
import pytest
import torch

from conftest import ADAPT, LAYOUTS, REPO, VOCAB, adapt_args, metrics, run_pretrain
from mmadapt.artifact import read_artifact
from mmadapt.checkpoint import load_full_state_dict
from mmadapt.family import WORD

pytestmark = pytest.mark.slow

STEPS = 3
SINGLE = ["--ds_config", "ds_configs/zero0.json", "--gradient_accumulation_steps", "2"]


def _pretrain_args(corpus, tokenizer, out, tied, *extra):
    # 4 decoder layers, heads after 2 and 4; 2 query groups of the 4 heads (GQA) divide TP 2.
    return ["--preset", "llama-tiny", "--corpus", str(corpus), "--tokenizer", str(tokenizer), "--vocab_size",
            str(VOCAB), "--output_dir", str(out), "--recipe", "minijoint", "--num_layers", "4", "--mini_layers", "2",
            "--train_iters", str(STEPS), "--log_interval", "1", "--seq_length", "32", "--save_interval", str(STEPS),
            "--train_micro_batch_size_per_gpu", "8", "--share_embeddings_and_output_weights", str(tied).lower(),
            *extra]


@pytest.fixture(scope="module")
def reference(request, corpus, tokenizer, tmp_path_factory):
    """The single-process decoder MINIJOINT run, tied (request.param True) or untied."""
    out = tmp_path_factory.mktemp(f"llama_single_{request.param}")
    run_pretrain(1, *_pretrain_args(corpus, tokenizer, out, request.param, *SINGLE))
    return request.param, out


def _heads(rows):
    return np.array([[r["head_losses"]["2"], r["head_losses"]["4"]] for r in rows])


def _cases(untied: tuple[str, ...]) -> list:
    """Every layout tied; untied only `untied` (the layouts where the second matrix matters)."""
    return [pytest.param(True, layout, id=f"tied-{layout}") for layout in sorted(LAYOUTS)] + \
        [pytest.param(False, layout, id=f"untied-{layout}") for layout in untied]


# untied: the layouts that split the output projection (TP) or move it (PP)
@pytest.mark.parametrize("reference, layout", _cases(("pp2", "tp2")), indirect=["reference"])
def test_decoder_pretraining_layout_matches_single_process(layout, reference, corpus, tokenizer, tmp_path):
    tied, ref_run = reference
    nproc, extra = LAYOUTS[layout]
    run_pretrain(nproc, *_pretrain_args(corpus, tokenizer, tmp_path, tied, *extra))
    ref, got = metrics(ref_run), metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], _heads(got).mean(1), rtol=1e-6)
    want, mine = load_full_state_dict(ref_run / "checkpoints"), load_full_state_dict(tmp_path / "checkpoints")
    assert sorted(mine) == sorted(want)
    assert ("output_layer.weight" in mine) is not tied
    for name, w in want.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name} differs")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_decoder_with_a_padded_vocabulary_at_tensor_parallel_2(tied, corpus, odd_tokenizer, tmp_path):
    """A 999-piece vocabulary padded to 1,000 rows at tensor parallel 2 (the embedding and the
    output projection, untied or the embedding's own rows: ModelConfig.padded_vocab_size) against
    one process at 999: the same losses and full weights, the padding row in neither."""
    single, tp2 = tmp_path / "single", tmp_path / "tp2"
    run_pretrain(1, *_pretrain_args(corpus, odd_tokenizer, single, tied, "--vocab_size", "999", *SINGLE))
    run_pretrain(2, *_pretrain_args(corpus, odd_tokenizer, tp2, tied, "--vocab_size", "999", *LAYOUTS["tp2"][1]))
    ref, got = metrics(single), metrics(tp2)
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    want, mine = load_full_state_dict(single / "checkpoints"), load_full_state_dict(tp2 / "checkpoints")
    assert sorted(mine) == sorted(want) and ("output_layer.weight" in mine) is not tied
    assert mine[WORD].shape[0] == 999 and (tied or mine["output_layer.weight"].shape[0] == 999)
    for name, w in want.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


@pytest.mark.parametrize("reference", [True], indirect=True, ids=["tied"])
def test_micro_batch_fill_on_two_ranks_matches_single_process(reference, corpus, tokenizer, tmp_path):
    """ZeRO-2 on 2 ranks asked for as micro 2 x accumulation 4 (global 16), their device memory
    faked (tests/microbatch_worker.py) with room for 8 blocks on rank 0 and 4 on rank 1: after
    update 1 the ranks agree on the smaller (one all-reduce), and update 3 runs as micro 4 x 2.
    The same blocks make every update, so the losses and weights are the single process's to
    rounding."""
    _, ref_run = reference
    run_pretrain(2, *_pretrain_args(corpus, tokenizer, tmp_path, True, "--ds_config", "ds_configs/zero2.json",
                                    "--train_micro_batch_size_per_gpu", "2", "--gradient_accumulation_steps", "4"),
                 script=str(REPO / "tests" / "microbatch_worker.py"))
    fit = json.loads((tmp_path / "run.json").read_text())["micro_batch_fit"]
    assert {k: fit[k] for k in ("merged", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                "from_update", "confirmed")} == {"merged": 2, "train_micro_batch_size_per_gpu": 4,
                                                                 "gradient_accumulation_steps": 2, "from_update": 3,
                                                                 "confirmed": True}
    ref, got = metrics(ref_run), metrics(tmp_path)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    want, mine = load_full_state_dict(ref_run / "checkpoints"), load_full_state_dict(tmp_path / "checkpoints")
    for name, w in want.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


# --- Step 2 over the decoder's mini-model -------------------------------------------------------------


def _step2(source, de_corpus, de_tokenizer, out, nproc, *extra):
    run_pretrain(nproc, *adapt_args("minijoint", source, de_corpus, de_tokenizer, out, "--preset", "llama-tiny",
                                    "--train_iters", str(STEPS), "--log_interval", "1", "--save_interval", str(STEPS),
                                    "--seq_length", "32", "--train_micro_batch_size_per_gpu", "8", *extra),
                 script=ADAPT)
    return out


@pytest.fixture(scope="module")
def step2_single(reference, de_corpus, de_tokenizer, tmp_path_factory):
    tied, source = reference
    return _step2(source, de_corpus, de_tokenizer, tmp_path_factory.mktemp(f"llama_step2_{tied}"), 1, *SINGLE)


# Step 2 scoring a quarter of the positions (TrainConfig.score_fraction) on TP 2 (the scored rows
# through the vocabulary-parallel projection and cross-entropy) and PP 2 (the last stage's scored
# positions from the host's queue, models/pipe.py): each rank draws block g's scored positions from
# (seed, g) alone, so every layout scores the same positions as one process. Every position is
# scored on TP 2 x PP 2 (both paths at once) and ZeRO-2.
SCORED = ["--score_fraction", "0.25"]
SCORED_LAYOUTS = ("tp2", "pp2")


@pytest.fixture(scope="module")
def step2_scored_single(reference, de_corpus, de_tokenizer, tmp_path_factory):
    tied, source = reference
    out = tmp_path_factory.mktemp(f"llama_step2_scored_{tied}")
    return _step2(source, de_corpus, de_tokenizer, out, 1, *SINGLE, *SCORED)


# untied: the optimizer state of both matrices is the point
@pytest.mark.parametrize("reference, layout", _cases(("zero2_dp2",)), indirect=["reference"])
def test_decoder_step2_layout_matches_single_process(layout, reference, de_corpus, de_tokenizer, tmp_path, request):
    """Only the vocabulary-indexed matrices train (tied: the embedding; untied: and the output
    projection), the losses and embeddings are the single process's (TP 2 and PP 2 scoring a
    quarter of the positions, as it does), and the ZeRO-2 optimizer state holds exactly the
    matrices, split over the 2 ranks."""
    tied, source = reference
    nproc, extra = LAYOUTS[layout]
    scored = layout in SCORED_LAYOUTS
    single = request.getfixturevalue("step2_scored_single" if scored else "step2_single")
    run = _step2(source, de_corpus, de_tokenizer, tmp_path / layout, nproc, *extra, *(SCORED if scored else ()))
    ref, got = metrics(single), metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    tag = f"step{STEPS:08d}"
    want, _, want_meta = read_artifact(single / "embeddings" / tag)
    mine, _, meta = read_artifact(run / "embeddings" / tag)
    assert meta.get("score_fraction") == want_meta.get("score_fraction") == (0.25 if scored else None)
    assert meta["flops"] == want_meta["flops"]
    assert sorted(mine) == sorted(want) == (["word_embeddings"] if tied else ["output_layer", "word_embeddings"])
    for k in want:
        torch.testing.assert_close(mine[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert meta["body_layers"] == meta["mini_layers"] == 2
    trained = [WORD] if tied else [WORD, "output_layer.weight"]
    assert json.loads((run / "run.json").read_text())["trainable"] == trained
    if layout == "zero2_dp2":
        ckpt = run / "checkpoints" / tag
        module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        # (The empty vector group's placeholder scalar, engine.build_engine, is not a model weight.)
        assert sorted(k for k, v in module.items() if v is not None and "placeholder" not in k) == sorted(trained)
        for rank in (0, 1):
            opt = torch.load(ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
            state = opt["optimizer_state_dict"]["base_optimizer_state"]["state"]
            # The matrices' flat group, halved; the other group holds engine.build_engine's
            # one-element placeholder (no vector trains here).
            sizes = sorted(s["exp_avg"].numel() for s in state.values())
            assert sizes[-1] == VOCAB * 64 * len(trained) // 2 and sum(sizes[:-1]) <= 16, sizes


@pytest.mark.parametrize("reference, data_parallel", [pytest.param(True, 1, id="tied-pp2"),
                                                      pytest.param(True, 2, id="tied-pp2-dp2")],
                         indirect=["reference"])
def test_decoder_step2_under_bf16_on_two_pipeline_stages(reference, data_parallel, de_corpus, de_tokenizer, tmp_path):
    """A tied decoder's Step 2 under zero1_bf16.json on 2 pipeline stages: the last stage's only
    trained tensor is its copy of the word embedding, which DeepSpeed's bf16 gradient norm skips
    (engine.norm_of_no_gradient: the run stopped at its first step). With 2 data-parallel ranks
    per stage (4 ranks), ZeRO-1 also splits that copy's optimizer state over each stage's ranks.
    Against one process under bf16, to bf16's rounding: the same losses and embeddings."""
    _, source = reference
    # a clip that binds at every update: the norm summed over the stages reaches the update
    clip = ["--ds_config", "ds_configs/zero1_bf16.json", "--gradient_clipping", "0.05"]
    single = _step2(source, de_corpus, de_tokenizer, tmp_path / "single", 1, *clip, "--gradient_accumulation_steps",
                    "2")
    # a global batch of 16 either way: 2 micro-batches of 8 accumulated, or 1 on each data-parallel rank
    run = _step2(source, de_corpus, de_tokenizer, tmp_path / "pp2", 2 * data_parallel, *clip,
                 "--gradient_accumulation_steps", str(2 // data_parallel), "--pipeline_model_parallel_size", "2")
    np.testing.assert_allclose([r["loss"] for r in metrics(run)], [r["loss"] for r in metrics(single)], rtol=1e-4)
    tag = f"step{STEPS:08d}"
    mine, want = (read_artifact(r / "embeddings" / tag)[0]["word_embeddings"] for r in (run, single))
    moved = (want - read_artifact(single / "embeddings" / "step00000000")[0]["word_embeddings"]).abs().mean()
    # Adam's normalised step turns bf16's rounding of a near-zero gradient into a full-size
    # difference in a few elements (seen: 1.7e-4 at most, 2.7e-7 on average, where training moved
    # each element by 4.4e-4 on average)
    assert moved > 1e-4 and (mine - want).abs().mean() < 0.01 * moved


# --- Pipelines deeper than 2: stages that are neither first nor last ------------------------------

# 4 layers on 3 stages split unevenly; on 4, a layer each. MINIJOINT's head after layer 2 ends a
# middle stage, so its carried output crosses a stage that neither makes nor reads it, and the tied
# word embedding is shared by the first and last stages across the middle ones.
DEEP = {3: ["--pipeline_model_parallel_size", "3", "--gradient_accumulation_steps", "2"],
        4: ["--pipeline_model_parallel_size", "4", "--gradient_accumulation_steps", "2"]}


@pytest.mark.parametrize("reference, stages", [pytest.param(False, 3, id="untied-pp3"),
                                               pytest.param(True, 4, id="tied-pp4")], indirect=["reference"])
def test_decoder_pretraining_on_deeper_pipelines_matches_single_process(stages, reference, corpus, tokenizer,
                                                                        tmp_path):
    tied, ref_run = reference
    run_pretrain(stages, *_pretrain_args(corpus, tokenizer, tmp_path, tied, *DEEP[stages]))
    ref, got = metrics(ref_run), metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose(_heads(got), _heads(ref), rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    want, mine = load_full_state_dict(ref_run / "checkpoints"), load_full_state_dict(tmp_path / "checkpoints")
    assert sorted(mine) == sorted(want) and ("output_layer.weight" in mine) is not tied
    for name, w in want.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6, msg=f"pp{stages}: {name} differs")


@pytest.mark.parametrize("reference", [True], indirect=True, ids=["tied"])
def test_decoder_step2_with_stages_that_train_nothing(reference, de_corpus, de_tokenizer, tmp_path):
    """BL_BASE's Step 2 over all 4 layers on 4 stages: the two middle stages hold only frozen
    layers, and the tied embedding trains on the first and last. Against one process: the same
    losses and embeddings."""
    _, source = reference

    def step2(out, nproc, *extra):
        run_pretrain(nproc, *adapt_args("bl_base", source, de_corpus, de_tokenizer, out, "--preset", "llama-tiny",
                                        "--train_iters", str(STEPS), "--log_interval", "1", "--save_interval",
                                        str(STEPS), "--seq_length", "32", "--train_micro_batch_size_per_gpu", "8",
                                        *extra), script=ADAPT)
        return out

    single, run = step2(tmp_path / "single", 1, *SINGLE), step2(tmp_path / "pp4", 4, *DEEP[4])
    ref, got = metrics(single), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    tag = f"step{STEPS:08d}"
    (want, _, want_meta), (mine, _, meta) = (read_artifact(r / "embeddings" / tag) for r in (single, run))
    assert meta["body_layers"] == want_meta["body_layers"] == 4 and meta["flops"] == want_meta["flops"]
    torch.testing.assert_close(mine["word_embeddings"], want["word_embeddings"], rtol=1e-5, atol=1e-6)
    start = read_artifact(single / "embeddings" / "step00000000")[0]["word_embeddings"]
    assert (want["word_embeddings"] - start).abs().mean() > 1e-4  # it trained
