"""Vocabulary expansion (Step 2 --vocab_mode expand) under every parallel layout, for both model
families, against one process: tensor parallel 2 (the vocabulary split across the ranks: here
one rank holds only source rows, the other the rest of them and every new row), ZeRO-2 on 2
data-parallel ranks and pipeline parallel 2 (the tied embedding on the first and last stage).

Each layout runs with a quarter of every batch from English text (--replay_fraction 0.25, 20
updates with weight decay on every parameter): every source row of every expanded matrix is
bit-identical to the source's in the live model of every rank (the run records the SHA-256 of
each rank's block), the optimizer state holds exactly the new rows (x h, + the new bias entries)
split over the data-parallel ranks, and the losses (the total, the source language's and the
target's, logged apart) are the single process's (rtol 1e-5). The single process also runs
without replay, 50 updates. (A layout without replay holds its rows and splits its optimizer state
by the same code as with it: replay changes which blocks fill a batch, the same on every layout
(tests/test_expand.py's replay tests), so each launch of two ranks here, ~20 s, is spent once per layout.)"""

import hashlib
import json

import numpy as np
import pytest
import torch

from conftest import ADAPT, LAYOUTS, NO_DROPOUT, VOCAB, metrics, run_pretrain
from mmadapt.family import WORD
from mmadapt.models import get_family
from mmadapt.run import load_weights

pytestmark = pytest.mark.slow

STEPS = 50
REPLAY_STEPS = 20  # the replay runs check the same things in fewer updates: the suite stays short
SINGLE = ["--ds_config", "ds_configs/zero0.json", "--gradient_accumulation_steps", "2"]
FAMILIES = {"roberta": ("tiny", "heads.heads.0.bias", []),
            "llama": ("llama-tiny", "output_layer.weight", ["--share_embeddings_and_output_weights", "false"])}


@pytest.fixture(scope="module")
def sources(corpus, tokenizer, tmp_path_factory):
    """A 4-layer MINIJOINT of each family (secondary head after layer 2; the decoder's output
    projection untied, so that two matrices are expanded), 6 updates."""
    out = {}
    for family, (preset, _, extra) in FAMILIES.items():
        run = tmp_path_factory.mktemp(f"expand_src_{family}")
        run_pretrain(1, "--preset", preset, "--corpus", str(corpus), "--tokenizer", str(tokenizer), "--vocab_size",
                     str(VOCAB), "--output_dir", str(run), "--recipe", "minijoint", "--num_layers", "4",
                     "--mini_layers", "2", "--train_iters", "6", "--save_interval", "6", *NO_DROPOUT, *extra)
        out[family] = run
    return out


@pytest.fixture(scope="module")
def replay_text(corpus, tokenizer, tmp_path_factory):
    """The English corpus in the sources' ids: the replay text."""
    from mmadapt import steps
    from mmadapt.config import PreprocessConfig

    out = tmp_path_factory.mktemp("replay") / "en"
    steps.preprocess(corpus, output_dir=out, vocab_size=VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=1))
    return out


def _replay(replay_text, replay: bool) -> list[str]:
    return ["--replay_fraction", "0.25", "--replay_data", str(replay_text)] if replay else []


def _steps(replay: bool) -> int:
    return REPLAY_STEPS if replay else STEPS


def _expand(source, de_corpus, de_tokenizer, out, nproc, *extra, steps=STEPS):
    run_pretrain(nproc, "--system", "minijoint", "--source", str(source), "--lang", "de", "--corpus", str(de_corpus),
                 "--tokenizer", str(de_tokenizer), "--vocab_mode", "expand", "--output_dir", str(out),
                 "--train_iters", str(steps), "--log_interval", "10", "--save_interval", str(steps),
                 "--seq_length", "32",
                 "--train_micro_batch_size_per_gpu", "8", "--weight_decay", "0.1", "--decay_all", "true", *NO_DROPOUT,
                 *extra, script=ADAPT)
    return out


@pytest.fixture(scope="module")
def singles(sources, de_corpus, de_tokenizer, replay_text, tmp_path_factory):
    """Each family's single-process run, without and with replay (built when first asked for)."""
    made = {}

    def single(family: str, replay: bool):
        if (family, replay) not in made:
            made[family, replay] = _expand(sources[family], de_corpus, de_tokenizer,
                                           tmp_path_factory.mktemp(f"expand_single_{family}"), 1, *SINGLE,
                                           *_replay(replay_text, replay), steps=_steps(replay))
        return made[family, replay]
    return single


def _optimizer_groups(run, steps: int = STEPS) -> list[list[int]]:
    """The size of each flat parameter group of each rank's optimizer file (ZeRO's fp32 state), or
    of each parameter's state without ZeRO, leaving out engine.build_engine's one-element
    placeholders of a group with nothing to train (with ZeRO's alignment padding)."""
    ckpt = run / "checkpoints" / f"step{steps:08d}"
    out = []
    for f in sorted(ckpt.glob("*optim_states.pt")):
        state = torch.load(f, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"]
        out.append(sorted(s["exp_avg"].numel() for s in state.values() if s["exp_avg"].numel() > 16))
    if not out:  # no ZeRO (one data-parallel replica, engine.for_replicas): torch's optimizer, one
        # state per parameter, in each model-parallel rank's model states file
        for f in sorted(ckpt.glob("mp_rank_*_model_states.pt")):
            state = torch.load(f, weights_only=False)["optimizer"]["state"]
            out.append(sorted(s["exp_avg"].numel() for s in state.values() if s["exp_avg"].numel() > 16))
    return out


@pytest.mark.parametrize("layout, replay", [("single", False), ("single", True),
                                            *((k, True) for k in sorted(LAYOUTS) if k != "tp2_pp2")],
                         ids=lambda x: x if isinstance(x, str) else "replay" if x else "")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expand_keeps_every_source_row_in_every_layout(family, layout, replay, sources, singles, replay_text,
                                                       de_corpus, de_tokenizer, tmp_path):
    source, (_, second, _) = sources[family], FAMILIES[family]
    if layout == "single":
        run = singles(family, replay)
    else:
        nproc, extra = LAYOUTS[layout]
        run = _expand(source, de_corpus, de_tokenizer, tmp_path / layout, nproc, *extra,
                      *_replay(replay_text, replay), steps=_steps(replay))
        for key in ("loss", "source_loss", "target_loss") if replay else ("loss",):
            np.testing.assert_allclose([r[key] for r in metrics(run)],
                                       [r[key] for r in metrics(singles(family, replay))], rtol=1e-5)
    record = json.loads((run / "run.json").read_text())
    size, new = record["model"]["vocab_size"], record["model"]["vocab_size"] - VOCAB
    h = record["model"]["hidden_size"]

    # Every rank's source block, as its live model held it after the last update.
    mini = get_family(record["model"]["family"]).extract_minijoint(*load_weights(source), 2)[1]
    blocks = record["source_rows"]
    assert {b["name"] for b in blocks} == {WORD, second}
    for name in (WORD, second):
        mine = sorted((b["rows"], b["sha256"]) for b in blocks if b["name"] == name)
        # each block once (data-parallel replicas and a pipeline's tied copies agree), together the F rows
        assert [r for r, _ in mine] == ([[0, size // 2], [size // 2, VOCAB]] if layout == "tp2" else [[0, VOCAB]])
        for (lo, hi), sha in mine:
            want = hashlib.sha256(mini[name][lo:hi].float().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            assert sha == want.hexdigest(), f"{layout}: a source row of {name} moved"

    # The optimizer holds the new rows and nothing else, split over the data-parallel ranks.
    groups = _optimizer_groups(run, _steps(replay))
    bias = [new] if family == "roberta" else []
    if layout == "zero2_dp2":
        halves = [new * h // 2] * (1 if family == "roberta" else 2)
        assert groups == [sorted([new // 2] + [sum(halves)] if bias else [sum(halves)])] * 2, groups
    elif layout == "tp2":  # rank 0's vocabulary slice holds only source rows: nothing to train there
        # (one replica: no ZeRO, a state per parameter)
        assert sorted(map(sorted, groups)) == [[], sorted(bias + [new * h] * (1 if family == "roberta" else 2))]
    elif layout == "pp2":  # the tied embedding's copy on each stage; the bias / output layer on the last
        first, last = ([new * h], sorted(bias + [new * h])) if family == "roberta" else ([new * h], [new * h])
        assert sorted(groups) == sorted([first, last]), groups
    else:  # one process, ZeRO 0: torch's AdamW state per parameter
        assert groups == [sorted(bias + [new * h] * (1 if family == "roberta" else 2))]


def test_expand_under_bf16_at_tensor_parallel_4(sources, de_corpus, de_tokenizer, tmp_path):
    """Under zero1_bf16.json (one replica: DeepSpeed's BF16_Optimizer) at tensor parallel 4, the
    ranks after rank 0 whose vocabulary slice holds only source rows train only placeholders,
    which DeepSpeed's gradient norm skips off tensor-parallel rank 0 (engine.norm_of_no_gradient:
    the run stopped at its first step). Against one process under bf16, to bf16's rounding."""
    bf16 = ["--ds_config", "ds_configs/zero1_bf16.json", "--gradient_accumulation_steps", "2", "--gradient_clipping",
            "0.05", "--log_interval", "1"]
    runs = {n: _expand(sources["roberta"], de_corpus, de_tokenizer, tmp_path / str(n), n, *bf16, steps=3,
                       *(["--tensor_model_parallel_size", "4"] if n == 4 else [])) for n in (1, 4)}
    size = json.loads((runs[4] / "run.json").read_text())["model"]["vocab_size"]
    assert 2 * size // 4 <= VOCAB  # ranks 0 and 1 hold source rows only
    assert [r["step"] for r in metrics(runs[4])] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in metrics(runs[4])], [r["loss"] for r in metrics(runs[1])], rtol=1e-3)


def test_two_ranks_merge_the_target_tokenizer_rank_0_trained(sources, de_corpus, tmp_path):
    """--vocab_mode expand from a raw --corpus with no --tokenizer, on 2 data-parallel ranks: global
    rank 0 trains the target tokenizer and both ranks take the vocabulary it merges
    (expand.merged_vocabulary, before the job's process groups exist: parallel.rank0_prepares
    joins the job; before 48c479d every other rank kept the None it sent and failed), the one a
    single process merges."""
    from mmadapt.expand import MERGED_TOKENIZER

    merged = {}
    for nproc, ds in ((1, "zero0"), (2, "zero2")):
        out = tmp_path / str(nproc)
        run_pretrain(nproc, "--system", "minijoint", "--source", str(sources["roberta"]), "--lang", "de", "--corpus",
                     str(de_corpus), "--vocab_mode", "expand", "--output_dir", str(out), "--train_iters", "2",
                     "--seq_length", "32", "--train_micro_batch_size_per_gpu", "4", "--ds_config",
                     f"ds_configs/{ds}.json", *NO_DROPOUT, script=ADAPT)
        merged[nproc] = ((out / MERGED_TOKENIZER).read_bytes(),
                         json.loads((out / "run.json").read_text())["model"]["vocab_size"])
    assert merged[2] == merged[1] and merged[1][1] > VOCAB
