"""Mini-models and Step 2: what is copied, what is frozen, what the optimizer holds, and that
tensor/pipeline/data-parallel Step-2 runs equal a single process."""

import dataclasses
import json
import math
import shutil
import types

import pytest
import torch

from conftest import ADAPT, NO_DROPOUT, REPO, VOCAB, adapt_args, metrics, mlm_batches, run_pretrain
from mmadapt import adapt as A
from mmadapt.artifact import read_artifact
from mmadapt.config import ModelConfig, PreprocessConfig, TrainConfig
from mmadapt.models import PRESETS
from mmadapt.data import prepare
from mmadapt.models.roberta.model import RobertaMLM
from mmadapt.parallel import init_parallel
from mmadapt.plugin import start_embeddings
from evaluation import step2_start
from mmadapt.family import WORD
from mmadapt.models.roberta import ROBERTA
from mmadapt.models.roberta.model import BIAS
from mmadapt.run import load_weights

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_parallel(1, 1)


def no_dropout(cfg: ModelConfig) -> ModelConfig:
    return ModelConfig(**{**vars(cfg), "hidden_dropout": 0.0, "attention_dropout": 0.0})


@pytest.fixture(scope="module")
def de_data(de_corpus, de_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("de_data")
    prepare(de_corpus, out, VOCAB, tokenizer=de_tokenizer, quiet=True, cfg=PreprocessConfig(workers=1))
    return out


# --- pure functions ------------------------------------------------------------------------

def test_a_resumed_run_writes_a_stops_lost_artifact_off_the_schedule(tmp_path):
    """A stop's checkpoint whose artifact a kill prevented: the resumed run writes it (save_start),
    marked off_schedule as the stop would have (a sweep leaves it out of its curves); a
    scheduled checkpoint's stays unmarked."""
    from mmadapt import checkpoint

    calls = []

    class Writer(A.ArtifactWriter):
        def __call__(self, update, ckpt_tag, run=None, rows=None, sd=None, scheduled=True):
            calls.append((update, scheduled))

    for step in (4, 6):  # the schedule's 4; a stop's 6
        checkpoint.write_weights_only(tmp_path / "checkpoints", step, {"w": torch.zeros(1)}, {})
    (tmp_path / "embeddings" / checkpoint.tag_for(0)).mkdir(parents=True)
    (tmp_path / "embeddings" / checkpoint.tag_for(0) / A.ARTIFACT_FILE).write_text("")
    writer = object.__new__(Writer)
    writer.run_dir, writer.init = tmp_path, {}
    init_parallel(1, 1)
    writer.save_start(True, TrainConfig(train_iters=8, save_interval=4))
    assert calls == [(4, True), (6, False)]
    calls[:] = []  # a pause's (exit_interval 6) the same: off the schedule, whatever the flag of the resume
    writer.save_start(True, TrainConfig(train_iters=8, save_interval=4, exit_interval=6))
    assert calls == [(4, True), (6, False)]


def test_overlap_init_copies_exactly_the_shared_pieces():
    src = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "▁the", "▁and", "s", "▁of"]
    trg = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "▁und", "s", "▁the", "▁der", "en"]
    src_w = torch.arange(len(src) * 4, dtype=torch.float32).view(len(src), 4) + 1.0
    src_b = torch.arange(len(src), dtype=torch.float32) + 100.0
    new, shared = A.overlap_init(src, {WORD: src_w, BIAS: src_b}, trg, std=0.02, seed=7)
    w, b = new[WORD], new[BIAS]
    assert shared == 7  # 5 special tokens, "s", "▁the"
    copied = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 6: 7, 7: 5}  # target row -> source row
    for t, s in copied.items():
        assert torch.equal(w[t], src_w[s]) and b[t] == src_b[s]
    for t in (5, 8, 9):  # "▁und", "▁der", "en": new, small, bias 0
        assert b[t] == 0 and w[t].abs().max() < 0.2 and not any(torch.equal(w[t], r) for r in src_w)
    again, _ = A.overlap_init(src, {WORD: src_w, BIAS: src_b}, trg, std=0.02, seed=7)
    assert torch.equal(w, again[WORD]) and torch.equal(b, again[BIAS])
    other, _ = A.overlap_init(src, {WORD: src_w, BIAS: src_b}, trg, std=0.02, seed=8)
    assert not torch.equal(other[WORD][5], w[5])
    # Two source pieces of one surface (a byte-level token of the literal U+2581 reads '▁' as the
    # space token does; a text token '<s>' as the BOS role): the first is copied, the role's row or
    # the more frequent (lower-ranked) piece, not the last one seen.
    dup = [*src, "<s>", "▁the"]
    w2 = torch.cat([src_w, torch.full((2, 4), -1.0)])
    new2, _ = A.overlap_init(dup, {WORD: w2}, trg, std=0.02, seed=7)
    assert torch.equal(new2[WORD][2], src_w[2]) and torch.equal(new2[WORD][7], src_w[5])


def test_subword_mean_init_is_the_mean_of_the_split_rows():
    """FVT by hand: a new piece's row (and bias) is the mean of its split's source rows; a shared
    piece keeps its copy; a piece the source cannot split keeps overlap_init's random row."""
    src = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "▁a", "b", "▁ab"]
    trg = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "▁ab", "▁abb", "zz"]
    src_w = torch.arange(len(src) * 3, dtype=torch.float32).view(len(src), 3) ** 1.5
    src_b = torch.arange(len(src), dtype=torch.float32) * 10.0
    splits = {"▁abb": [7, 6], "zz": []}
    new, shared, composed = A.subword_mean_init(splits.__getitem__, src, {WORD: src_w, BIAS: src_b}, trg, 0.02, 3)
    assert (shared, composed) == (6, 1)
    assert torch.equal(new[WORD][5], src_w[7]) and new[BIAS][5] == src_b[7]
    assert torch.allclose(new[WORD][6], torch.stack([src_w[7], src_w[6]]).mean(0)) and new[BIAS][6] == 65.0
    overlap, _ = A.overlap_init(src, {WORD: src_w, BIAS: src_b}, trg, 0.02, 3)
    assert torch.equal(new[WORD][7], overlap[WORD][7]) and new[BIAS][7] == 0
    # byte pieces (a byte-fallback vocabulary's): an ASCII byte splits as its character, a byte of
    # a longer character not at all (its literal text, '<0xE4>', is no text of the language)
    trg = [*trg, "<0x62>", "<0xE4>"]
    new, _, composed = A.subword_mean_init({**splits, "b": [6]}.__getitem__, src, {WORD: src_w}, trg, 0.02, 3)
    overlap, _ = A.overlap_init(src, {WORD: src_w}, trg, 0.02, 3)
    assert composed == 2 and torch.equal(new[WORD][8], src_w[6]) and torch.equal(new[WORD][9], overlap[WORD][9])


def test_source_split_reads_the_boundary_marker_as_a_space(tokenizer):
    """A word-initial piece splits as the word does inside a text ('▁' first), a word-internal
    one with no '▁' added: the source pieces join back to the piece itself."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    split = A.source_split(tokenizer)
    for piece in ("▁Gottesdienst", "▁Jerusalem", "schaft", "ungen", "tt"):
        ids = split(piece)
        assert ids and "".join(sp.id_to_piece(i) for i in ids) == piece, (piece, [sp.id_to_piece(i) for i in ids])
    assert split("▁Gottesdienst")[0] != split("Gottesdienst")[0]


def test_step2_start_by_embedding_init(primary_run, tokenizer, de_tokenizer, de_data):
    """The three starts of a real German vocabulary's rows over a real English model
    (adapt.new_vocabulary): subword_mean is overlap's copies plus, for the other pieces, the mean
    of their English split's rows; normal copies nothing; an unknown name is refused; a drawn row
    is at its matrix's own scale in the source (StartRule.row_std)."""
    from mmadapt.tokenizer import pieces

    src_cfg, full = load_weights(primary_run)
    src_state = A.body_weights(ROBERTA, "bl_base", src_cfg, full, A.body_config(ROBERTA, "bl_base", src_cfg))
    body = A.body_config(ROBERTA, "bl_base", src_cfg)
    starts = {how: A.new_vocabulary(ROBERTA, body, src_state, tokenizer, de_tokenizer, 5, TrainConfig(embedding_init=how))
              for how in ("overlap", "subword_mean", "normal")}
    (overlap, rows), (mean, mean_rows), (normal, normal_rows) = starts.values()
    assert [r.pop("row_std") for r in (rows, mean_rows, normal_rows)] == [pytest.approx(src_state[WORD].std().item())] * 3
    src_pieces, trg = pieces(tokenizer), pieces(de_tokenizer)
    shared = [i for i, p in enumerate(trg) if p in set(src_pieces)]
    assert torch.equal(mean[WORD][shared], overlap[WORD][shared])
    split = A.source_split(tokenizer)
    new = [i for i, p in enumerate(trg) if p not in set(src_pieces)]
    checked = 0
    for i in new:
        ids = split(trg[i])
        if ids:
            assert torch.allclose(mean[WORD][i], src_state[WORD][ids].mean(0)), trg[i]
            assert torch.allclose(mean[BIAS][i], src_state[BIAS][ids].mean(0))
            checked += 1
    assert checked > len(new) // 2 and mean_rows == {"shared_pieces": len(shared), "subword_mean_pieces": checked,
                                                     "random_pieces": len(new) - checked}
    assert rows == {"shared_pieces": len(shared), "subword_mean_pieces": 0, "random_pieces": len(new)}
    assert normal_rows == {"shared_pieces": 0, "subword_mean_pieces": 0, "random_pieces": len(trg)}
    same = src_pieces.index(trg[shared[-1]])
    assert not torch.equal(normal[WORD][shared[-1]], src_state[WORD][same])
    assert torch.equal(normal[WORD][new], overlap[WORD][new])  # the same seeded draw
    assert overlap[WORD][new].std().item() == pytest.approx(src_state[WORD].std().item(), rel=0.05)
    with pytest.raises(ValueError, match="--embedding_init must be one of overlap, subword_mean, normal, got 'fvt'"):
        step2_start("bl_base", primary_run, de_data, seed=5, embedding_init="fvt")
    with pytest.raises(ValueError, match="unknown embedding_init 'fvt'"):
        A.init_rows("fvt", tokenizer, {WORD: src_state[WORD]}, trg, 0.02, 5)


def test_the_start_bias_is_fitted_to_the_target_text(primary_run, de_corpus, de_tokenizer, tmp_path):
    """StartRule: the new vocabulary's output bias is fitted on the target text's training split
    so that the start predicts there the unigram distribution of the pieces a masked position can
    be. On held-out German through the primary model, the start's loss is within 0.035 nats of the
    unigram reference (fitted to every piece's frequencies, </s> included, it read its share
    higher, checked), and below the old rule's (shared pieces' bias copied from English, the
    rest 0), which is further from it."""
    from mmadapt.adapt import StartRule, Step2Start
    from mmadapt.heldout import Primary, Scorer, Text

    data = tmp_path / "de"
    prepare(de_corpus, data, VOCAB, tokenizer=de_tokenizer, quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    step = A.AdaptEmbeddings(system="bl_base", source=primary_run, lang="de", train=dataclasses.replace(
        PRESETS["tiny"][1], seq_length=32))
    src = A.read_source(primary_run)
    body = A.body_config(src.family, "bl_base", src.cfg)
    fitted = Step2Start.build(src, body, step, data / "tokenizer.model", data)
    old = Step2Start.build(src, body, step, data / "tokenizer.model", None, StartRule(row_std="config", bias="copied"))
    every = Step2Start.build(src, body, step, data / "tokenizer.model", data, StartRule(bias_target="every"))
    assert fitted.rows["start_rule"] == {"row_std": "source", "bias": "fitted", "bias_target": "scored"}
    assert fitted.rows["bias_fitted_positions"] >= 1000
    scorer = Scorer(Primary.read(primary_run))
    held = scorer.heldout(Text(data, 32), VOCAB)
    start, before = scorer.loss(held, fitted.tensors()), scorer.loss(held, old.tensors())
    all_pieces = scorer.loss(held, every.tensors())
    print(f"German start loss: fitted bias {start:.3f} (to every piece's frequencies {all_pieces:.3f}), the old rule "
          f"{before:.3f}, unigram {held.unigram:.3f}")
    assert abs(start - held.unigram) <= 0.035 and before - held.unigram > 0.1 and all_pieces - start > 0.01
    # Step 2's progress probe scores so too, and says on how many blocks (a --resume may change them)
    from mmadapt.heldout import PluginProbe

    scored = PluginProbe(lambda: scorer, Text(data, 32, blocks=4)).score(fitted.tensors())
    assert scored["plugin_eval_blocks"] == 4 and scored["plugin_loss"] == pytest.approx(
        scorer.loss(scorer.heldout(Text(data, 32, blocks=4), VOCAB), fitted.tensors()))


def test_minijoint_mini_model_gives_the_secondary_head_loss(primary_run, de_data):
    cfg, state = load_weights(primary_run)
    assert cfg.head_layers == (4, 12)
    full = RobertaMLM(no_dropout(cfg)).eval()
    full.load_state_dict(state, strict=False)
    mini_cfg, mini_state = ROBERTA.extract_minijoint(cfg, state)
    assert mini_cfg.num_layers == 4 and mini_cfg.head_layers == (4,)
    assert not any(k.startswith(("layers.4.", "heads.heads.1.")) for k in mini_state)
    mini = RobertaMLM(no_dropout(mini_cfg)).eval()
    mini.load_state_dict(mini_state, strict=False)
    batches = mlm_batches(primary_run / "data", 64, VOCAB, 5, 8, 1)
    with torch.no_grad():
        for step in range(3):
            ids, labels = batches.micro_batch(step, 0)
            _, per_head = full(ids, labels)
            loss, _ = mini(ids, labels)
            assert loss.item() == per_head[0].item()  # the same computation, bit for bit
            assert per_head[1].item() != per_head[0].item()


# --- Step 2 in one process: frozen body, optimizer state --------------------------------------

def _step2_engine(primary_run, de_tokenizer, system, ds_config):
    from mmadapt.engine import load_ds_config
    from mmadapt.train import LMJob, lm_engine

    train = dataclasses.replace(PRESETS["tiny"][1], train_micro_batch_size_per_gpu=8)
    src_cfg, full = load_weights(primary_run)
    body_cfg = A.body_config(ROBERTA, system, src_cfg)
    init, _ = A.new_vocabulary(ROBERTA, body_cfg, A.body_weights(ROBERTA, system, src_cfg, full, body_cfg),
                               primary_run / "tokenizer" / "spm.model", de_tokenizer, 1)
    body_cfg = no_dropout(ModelConfig(**{**vars(body_cfg), "vocab_size": VOCAB}))
    ds = load_ds_config(REPO / "ds_configs" / ds_config, train)
    engine, _, _ = lm_engine(ROBERTA, body_cfg, train, ds, LMJob(step="adapt", trainable=(WORD, BIAS)), init)
    return engine, body_cfg, train, init


@pytest.mark.parametrize("system, ds_config", [("minijoint", "zero2.json"), ("bl_base", "zero1.json")])
def test_step2_trains_only_the_embeddings(primary_run, de_tokenizer, de_data, system, ds_config):
    from mmadapt.train import train_step

    engine, cfg, train, init = _step2_engine(primary_run, de_tokenizer, system, ds_config)
    assert cfg.num_layers == (4 if system == "minijoint" else 12)
    batches = mlm_batches(de_data, 64, VOCAB, 1, 8, 1)
    losses = [train_step(engine, batches.step_batches(s), 1).item() for s in range(STEPS)]
    assert all(math.isfinite(x) for x in losses)
    trained = dict(engine.module.named_parameters())
    assert {n for n, p in trained.items() if p.requires_grad} == set((WORD, BIAS))
    for name, p in trained.items():
        if name in (WORD, BIAS):
            assert not torch.equal(p.detach(), init[name]), f"{name} did not change"
        else:
            assert torch.equal(p.detach(), init[name]), f"frozen {name} changed"
            assert p.grad is None
    # ZeRO keeps AdamW state for exactly the embedding [V, h] and the bias [V].
    states = [s for s in engine.optimizer.optimizer.state.values()]
    for key in ("exp_avg", "exp_avg_sq"):
        assert sum(s[key].numel() for s in states) == VOCAB * cfg.hidden_size + VOCAB


# --- Step 2 across ranks and layouts, against one process ---------------------------------------

LAYOUTS = {
    "zero2_dp2": ["--ds_config", "ds_configs/zero2.json", "--gradient_accumulation_steps", "1"],
    "tp2": ["--tensor_model_parallel_size", "2", "--gradient_accumulation_steps", "2"],
    "pp2": ["--pipeline_model_parallel_size", "2", "--gradient_accumulation_steps", "2"],
}


def _step2(primary_run, de_corpus, de_tokenizer, out, nproc, *extra):
    run_pretrain(nproc, *adapt_args("minijoint", primary_run, de_corpus, de_tokenizer, out, "--train_iters",
                                    str(STEPS), "--log_interval", "1", "--save_interval", str(STEPS),
                                    "--train_micro_batch_size_per_gpu", "8", *NO_DROPOUT, *extra), script=ADAPT)
    return out


@pytest.fixture(scope="module")
def step2_single(primary_run, de_corpus, de_tokenizer, tmp_path_factory):
    return _step2(primary_run, de_corpus, de_tokenizer, tmp_path_factory.mktemp("step2_single"), 1,
                  "--ds_config", "ds_configs/zero0.json", "--gradient_accumulation_steps", "2")


def _artifact(run):
    tensors, tok, meta = read_artifact(run / "embeddings" / f"step{STEPS:08d}")
    return tensors, tok, meta


def test_a_mini_models_artifact_has_its_bias_refitted_through_the_primary(step2_single, primary_run):
    """Step 2 over MINIJOINT's mini-model: the artifact's output bias is the trained one (the
    checkpoint's) refitted through the primary model, so that there, on the target training text
    that fitted the start, the mean predicted distribution is the unigram one (the trained bias
    is off by more), with the trained bias's mean; the artifact's embeddings are the trained ones."""
    from mmadapt.adapt import bias_fit_text
    from mmadapt.heldout import Primary, Scorer, target_logprobs
    from mmadapt.run import load_checkpoint

    tensors, _, meta = _artifact(step2_single)
    trained = load_checkpoint(step2_single, f"step{STEPS:08d}")
    assert torch.equal(tensors["word_embeddings"], trained[WORD].float())
    data = step2_single / "data"
    train = A.AdaptEmbeddings.recorded(json.loads((step2_single / "run.json").read_text())).train
    logp = target_logprobs(data, VOCAB)  # the pieces a masked position can be (StartRule.bias_target "scored")
    scorer = Scorer(Primary.read(primary_run))
    held = scorer.heldout(bias_fit_text(data, train, ROBERTA), VOCAB, unigram=False)
    assert meta["primary_calibration"]["positions"] == held.scored >= 1000
    assert "scale" not in meta["primary_calibration"]  # the default calibrates the bias only
    # one forward pass of the primary over the fit text, its cost apart from the training's
    primary = dataclasses.replace(scorer.primary.cfg, vocab_size=VOCAB)
    blocks = sum(len(ids) for ids, *_ in held.on_device)
    assert meta["primary_calibration"]["passes"] == 1 and meta["primary_calibration"]["flops"] == pytest.approx(
        blocks * ROBERTA.step_flops("score", primary, train.seq_length, held.scored / (blocks * train.seq_length)),
        rel=1e-12)

    def gap(bias, rows=tensors["word_embeddings"]):  # nats: the largest |log mean softmax - log unigram| over pieces
        logits = torch.cat(scorer.logits(held.on_device, {"word_embeddings": rows, "output_bias": bias}))
        return float((torch.softmax(logits.float(), -1).mean(0).log() - logp).abs().max())

    own = trained[BIAS].float()
    refit_gap, own_gap = gap(tensors["output_bias"]), gap(own)
    print(f"the mean predicted distribution through the primary, off the unigram one by at most {refit_gap:.2g} "
          f"nats (the trained bias: {own_gap:.2g})")
    assert refit_gap < 1e-4 and own_gap > 10 * refit_gap  # seen after 3 updates: the trained bias 0.0076 off
    assert float(tensors["output_bias"].mean()) == pytest.approx(float(own.mean()), abs=1e-5)
    # The start: training's bias was fitted through the model it trains (the 4-layer mini-model),
    # and the artifact of update 0, like every other, is that start calibrated to the primary.
    start, _, start_meta = read_artifact(step2_single / "embeddings" / "step00000000")
    assert start_meta["bias_fitted_through"] == "trained" and start_meta["primary_calibration"]["positions"]
    assert gap(start["output_bias"], start["word_embeddings"]) < 1e-4
    built = step2_start("minijoint", primary_run, data, **dataclasses.asdict(train))
    assert torch.equal(built.init[WORD].float(), start["word_embeddings"])
    over_mini = built.trained_scorer()
    mini_held = over_mini.heldout(bias_fit_text(data, train, ROBERTA), VOCAB, unigram=False)

    def mini_gap(bias):
        logits = torch.cat(over_mini.logits(mini_held.on_device, {"word_embeddings": start["word_embeddings"],
                                                        "output_bias": bias}))
        return float((torch.softmax(logits.float(), -1).mean(0).log() - logp).abs().max())
    bias = built.init[BIAS].float()
    print(f"the start's bias through the mini-model {mini_gap(bias):.2g} nats off the unigram distribution, through "
          f"the primary {gap(bias, start['word_embeddings']):.2g}; the update-0 artifact's through the primary "
          f"{gap(start['output_bias'], start['word_embeddings']):.2g}")
    assert mini_gap(bias) < 1e-3 < gap(bias, start["word_embeddings"])


def test_the_scale_calibration_finds_the_least_loss_factor(monkeypatch):
    """primary_calibration "scale": the artifact's rows times the factor in SCALES with the least
    fit-text loss (here a loss with its minimum at 1.7, as a function of the rows' scale), found
    to within 1% by the search, and the bias the fit gives at that factor."""
    from mmadapt.adapt import PrimaryCalibration

    rows = torch.randn(12, 4)
    seen = []

    def fit(self, scorer, tensors, targets):
        a = float(tensors["word_embeddings"][0, 0] / rows[0, 0])
        seen.append(a)
        return torch.full((12,), a), (math.log(a) - math.log(1.7)) ** 2 + 3.0

    monkeypatch.setattr(PrimaryCalibration, "_fit", fit)
    # a 2-layer primary (h 4, FFN 16) of a 50-piece vocabulary; the artifact's has 12
    cfg = dataclasses.replace(PRESETS["tiny"][0], num_layers=2, hidden_size=4, ffn_hidden_size=16, vocab_size=50,
                              num_attention_heads=1, head_layers=(2,))
    scorer = types.SimpleNamespace(primary=types.SimpleNamespace(cfg=cfg), family=ROBERTA)
    calibrate = PrimaryCalibration(lambda: scorer, None, torch.zeros(12), scale=True)
    ids, targets = torch.zeros(2, 8), torch.zeros(3, dtype=torch.long)
    calibrate._held = types.SimpleNamespace(on_device=[(ids, None, None, targets)], scored=3)
    calibrate.text = types.SimpleNamespace(blocks=2, seq_length=8)
    out, record = calibrate({"word_embeddings": rows, "output_bias": torch.zeros(12)})
    factor = record["primary_calibration"]["scale"]
    assert factor == pytest.approx(1.7, rel=0.01) and len(seen) == PrimaryCalibration.STEPS + 3
    # its cost, by hand: each pass 2 blocks of 8 through the first layer (8sh^2 + 4shf + 4s^2h) and
    # the last one's QKV and attention (6sh^2 + 4s^2h); at the 3 scored positions alone, the last
    # layer's output projection and FFN (2h^2 + 4hf), the head's dense (2h^2) and its projection
    # onto the artifact's 12 pieces (2h x 12)
    layers = 2 * (8 * 8 * 4 * 4 + 4 * 8 * 4 * 16 + 4 * 8 * 8 * 4) + 2 * (6 * 8 * 4 * 4 + 4 * 8 * 8 * 4)
    scored = 3 * (2 * 4 * 4 + 4 * 4 * 16 + 2 * 4 * 4 + 2 * 4 * 12)
    assert record["primary_calibration"]["passes"] == len(seen)
    assert record["primary_calibration"]["flops"] == pytest.approx(len(seen) * (layers + scored))
    assert all(0.5 <= a <= 3.0 for a in seen)
    assert torch.allclose(out["word_embeddings"], rows * factor) and torch.allclose(out["output_bias"],
                                                                                   torch.full((12,), factor))
    assert record["primary_calibration"]["fit_loss"] == pytest.approx(3.0, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step2_layout_matches_single_process(layout, step2_single, primary_run, de_corpus, de_tokenizer, tmp_path):
    run = _step2(primary_run, de_corpus, de_tokenizer, tmp_path / layout, 2, *LAYOUTS[layout])
    ref, got = metrics(step2_single), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    (ref_t, _, ref_meta), (got_t, tok, meta) = _artifact(step2_single), _artifact(run)
    for k in ("word_embeddings", "output_bias"):
        torch.testing.assert_close(got_t[k], ref_t[k], rtol=1e-5, atol=1e-6)
    assert got_t["word_embeddings"].shape == (VOCAB, 64)
    assert tok.read_bytes() == de_tokenizer.read_bytes()
    assert meta["flops"] == ref_meta["flops"] and meta["global_batch"] == 16 and meta["mini_layers"] == 4
    assert meta["scored_rows"] == ref_meta["scored_rows"]  # counted once per replica, whatever the layout
    # The start (update 0), written by global rank 0 from the full initial state: the same in every layout.
    start, ref_start = (read_artifact(r / "embeddings" / "step00000000") for r in (run, step2_single))
    assert all(torch.equal(start[0][k], ref_start[0][k]) for k in ("word_embeddings", "output_bias"))
    assert (start[2]["step"], start[2]["flops"], start[2]["tokens"]) == (0, 0.0, 0)
    ckpt = run / "checkpoints" / f"step{STEPS:08d}"
    if layout == "zero2_dp2":
        # Checkpoints hold only what Step 2 trains; the optimizer state is split across the 2 ranks.
        module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        assert {k for k, v in module.items() if v is not None} == set((WORD, BIAS))
        for rank in (0, 1):
            opt = torch.load(ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
            state = opt["optimizer_state_dict"]["base_optimizer_state"]["state"]
            for key in ("exp_avg", "exp_avg_sq"):
                assert sorted(s[key].numel() for s in state.values()) == [VOCAB // 2, VOCAB * 64 // 2]
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["frozen_from"]["run_dir"] == str(primary_run.resolve())
    assert run_json["shared_pieces"] > 5


@pytest.mark.slow
def test_step2_with_a_padded_target_vocabulary_at_tensor_parallel_2(primary_run, de_corpus, tmp_path):
    """A 999-piece German vocabulary, padded to 1,000 rows at tensor parallel 2
    (ModelConfig.padded_vocab_size: its full start sliced and padded per rank, engine._shard),
    against one process: the same losses, and the same 999-row artifacts at update 0 and after."""
    from mmadapt.data import train_tokenizer

    (tmp_path / "tok").mkdir()
    tokenizer = train_tokenizer(de_corpus, tmp_path / "tok" / "spm", 999)
    runs = {}
    for name, nproc, extra in (("single", 1, ["--ds_config", "ds_configs/zero0.json", "--gradient_accumulation_steps",
                                              "2"]), ("tp2", 2, LAYOUTS["tp2"])):
        runs[name] = _step2(primary_run, de_corpus, tokenizer, tmp_path / name, nproc, "--vocab_size", "999", *extra)
    for a, b in zip(metrics(runs["single"]), metrics(runs["tp2"]), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for tag in ("step00000000", f"step{STEPS:08d}"):
        ref, got = (read_artifact(runs[r] / "embeddings" / tag)[0] for r in ("single", "tp2"))
        assert got["word_embeddings"].shape == (999, 64) and got["output_bias"].shape == (999,)
        for k in ("word_embeddings", "output_bias"):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_step2_with_a_stage_that_trains_nothing(primary_run, de_corpus, de_tokenizer, step2_single, tmp_path):
    """Pipeline 4 over the 4-layer mini-model: the two middle stages hold only frozen layers."""
    run = _step2(primary_run, de_corpus, de_tokenizer, tmp_path / "pp4", 4, "--pipeline_model_parallel_size", "4",
                 "--gradient_accumulation_steps", "2")
    ref, got = metrics(step2_single), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]  # (rank 0 holds no loss stage's)
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    torch.testing.assert_close(_artifact(run)[0]["word_embeddings"], _artifact(step2_single)[0]["word_embeddings"],
                               rtol=1e-5, atol=1e-6)


# --- MINIPOST Step 1b ------------------------------------------------------------------------------

def _eval_loss(cfg, state, data_dir, vocab):
    model = RobertaMLM(no_dropout(cfg)).eval()
    model.load_state_dict(state, strict=False)
    batches = mlm_batches(data_dir, 64, vocab, 99, 16, 1)
    with torch.no_grad():  # the same 10 held-back masked batches every time
        return sum(model(*batches.micro_batch(1000 + i, 0))[0].item() for i in range(10)) / 10


N, K = 4, 2  # the paper's MINIPOST: bottom 4 layers + 2 new ones


@pytest.fixture(scope="module")
def minipost_run(primary_run, tmp_path_factory):
    from mmadapt.cli import main

    out = tmp_path_factory.mktemp("minipost")  # in this process: a fresh interpreter's imports cost seconds
    assert main(["build_minipost", "--primary", str(primary_run), "--output_dir", str(out), "--train_iters", "20",
                 "--save_interval", "20", "--log_interval", "10"]) == 0
    return out


@pytest.mark.slow
def test_minipost_copies_and_freezes(primary_run, minipost_run):
    src_cfg, src = load_weights(primary_run)
    cfg, state = load_weights(minipost_run)
    assert cfg.num_layers == N + K and cfg.head_layers == (N + K,)
    new = ROBERTA.minipost_trainable(N, K)
    # The checkpoint holds only the new layers; the rest is the primary's, bit for bit.
    own = torch.load(minipost_run / "checkpoints" / "step00000020" / "mp_rank_00_model_states.pt",
                     weights_only=False)["module"]
    assert {k for k, v in own.items() if v is not None} == {k for k in state if k.startswith(new)}
    for name, value in state.items():
        if not name.startswith(new):
            source = name.replace("heads.heads.0.", "heads.heads.1.")  # the primary (layer-12) head
            assert torch.equal(value, src[source]), name
    _, init = ROBERTA.minipost_start(src_cfg, src, N, K)
    start = {**RobertaMLM(cfg, seed=1234).state_dict(), **init}  # Step 1b's seeded new layers
    for name in state:
        if name.startswith(new) and name.endswith("weight") and "layernorm" not in name:
            assert not torch.equal(state[name], start[name]), f"{name} did not train"


def test_minipost_new_layers_learn(primary_run, de_data):
    """Step 1b's engine fits a fixed set of batches: the loss falls at every update. (The tiny
    primary is too weak for a drop on held-out text to be a reliable signal: its bottom 4 layers
    feed its head about as well as all 12 do.)"""
    from mmadapt.engine import load_ds_config
    from mmadapt.train import LMJob, lm_engine, train_step

    src_cfg, src = load_weights(primary_run)
    cfg, init = ROBERTA.minipost_start(src_cfg, src, N, K)
    cfg = no_dropout(cfg)
    train = dataclasses.replace(PRESETS["tiny"][1], train_micro_batch_size_per_gpu=8, lr=1e-3, lr_warmup_iters=1)
    ds = load_ds_config(REPO / "ds_configs" / "zero1.json", train)
    job = LMJob(step="minipost", trainable=ROBERTA.minipost_trainable(N, K), trainable_layers=K)
    engine, _, _ = lm_engine(ROBERTA, cfg, train, ds, job, init)
    batches = mlm_batches(primary_run / "data", 64, VOCAB, 3, 8, 1).step_batches(0)
    losses = [train_step(engine, batches, 1).item() for _ in range(40)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    for name, p in engine.module.named_parameters():
        if not name.startswith(job.trainable):
            assert torch.equal(p.detach(), init[name]), f"frozen {name} changed"


@pytest.mark.slow
def test_step2_over_the_minipost_mini_model(minipost_run, de_corpus, de_tokenizer, tmp_path):
    from mmadapt.cli import main

    run = tmp_path / "adapt"
    assert main(["adapt", *adapt_args("minipost", minipost_run, de_corpus, de_tokenizer, run, "--train_iters", "2",
                                      "--save_interval", "1", "--log_interval", "1")]) == 0
    tensors, _, meta = read_artifact(run / "embeddings" / "step00000002")
    # The depth it was trained over, and the mini-model's N and K.
    assert (meta["body_layers"], meta["mini_layers"], meta["new_layers"]) == (N + K, N, K)
    assert tensors["word_embeddings"].shape == (VOCAB, 64)
    assert (run / "embeddings" / "step00000001" / "embeddings.pt").is_file()


@pytest.mark.slow
def test_step2_stop_and_resume_matches_uninterrupted(primary_run, de_corpus, de_tokenizer, tmp_path):
    """Checkpoints without the frozen body still resume exactly (dropout on): the body comes back
    from the source run, the embeddings, optimizer, schedule and RNG from the checkpoint."""
    def go(out, *extra, code=0):
        run_pretrain(1, *adapt_args("minijoint", primary_run, de_corpus, de_tokenizer, out, "--train_iters", "4",
                                    "--log_interval", "1", "--save_interval", "2", *extra), script=ADAPT, code=code)

    go(tmp_path / "full")
    # launch/slurm/adapt.sbatch passes --resume from the first launch: a directory with no record
    # starts anew; so does one with a record of an earlier mmadapt's (no start rule) and no
    # checkpoint, and its record then names the rule it started by (else a resume after its first
    # checkpoint would take the rule of then, StartRule.recorded)
    go(tmp_path / "fresh", "--resume", "--exit_interval", "2", code=76)
    full_record = json.loads((tmp_path / "full" / "run.json").read_text())
    stale = tmp_path / "stale"
    stale.mkdir()
    legacy = {k: v for k, v in full_record.items() if k != "start_rule"}
    (stale / "run.json").write_text(json.dumps(legacy).replace(str(tmp_path / "full"), str(stale)))
    go(stale, "--resume", "--exit_interval", "2", code=76)
    assert json.loads((stale / "run.json").read_text())["start_rule"] == full_record["start_rule"]
    for run in ("fresh", "stale"):
        assert [r["loss"] for r in metrics(tmp_path / run)] == [r["loss"] for r in metrics(tmp_path / "full")][:2]
    go(tmp_path / "part", "--exit_interval", "2", code=76)
    assert [r["step"] for r in metrics(tmp_path / "part")] == [1, 2]
    start = tmp_path / "part" / "embeddings" / "step00000000"
    written = {f: (start / f).stat() for f in ("embeddings.pt", "meta.json")}
    # a stop between checkpoint 2's COMPLETE and its artifact: the resume writes the artifact
    shutil.rmtree(tmp_path / "part" / "embeddings" / "step00000002")
    # a run recorded with another start rule (an earlier mmadapt's) resumes by it, not today's:
    # its artifacts say so (here nothing frozen comes from the start, so the losses stay equal)
    record = json.loads((tmp_path / "part" / "run.json").read_text())
    old_rule = {"row_std": "config", "bias": "copied"}
    assert record["start_rule"] != old_rule
    (tmp_path / "part" / "run.json").write_text(json.dumps({**record, "start_rule": old_rule}))
    go(tmp_path / "part", "--resume")
    # (a rule recorded before bias_target: the fit of then, every piece's frequencies)
    assert read_artifact(tmp_path / "part" / "embeddings" / "step00000004")[2]["start_rule"] == {
        **old_rule, "bias_target": "every"}
    after = json.loads((tmp_path / "part" / "run.json").read_text())  # its own rule back, for the recompute below
    (tmp_path / "part" / "run.json").write_text(json.dumps({**after, "start_rule": record["start_rule"]}))
    assert [r["loss"] for r in metrics(tmp_path / "part")] == [r["loss"] for r in metrics(tmp_path / "full")]
    for tag in ("step00000002", "step00000004"):
        (a, _, a_meta), (b, _, b_meta) = (read_artifact(tmp_path / d / "embeddings" / tag) for d in ("full", "part"))
        assert torch.equal(a["word_embeddings"], b["word_embeddings"]), tag
        # the recovered artifact's compute, from its checkpoint's updates run
        # and the rows its head projected (checkpoint.work_run; a resumed run's count goes on from its checkpoint's)
        keys = ("step", "flops", "tokens", "scored_rows")
        assert [b_meta[k] for k in keys] == [a_meta[k] for k in keys] and a_meta["scored_rows"] > 0
    # A fresh run (no --resume) over an earlier attempt's start artifact (one that stopped before
    # its first checkpoint, here with another language recorded) writes its own
    again = tmp_path / "again" / "embeddings" / "step00000000"
    shutil.copytree(start, again)
    (again / "meta.json").write_text(json.dumps({**json.loads((again / "meta.json").read_text()), "lang": "xx"}))
    go(tmp_path / "again", "--exit_interval", "2", code=76)
    assert read_artifact(again)[2]["lang"] == "de"
    # and so does a --resume into a directory with no record yet (the SLURM template's first
    # launch passes --resume: an attempt stopped before run.json was written, then resubmitted,
    # perhaps with another source or data), which it kept
    unrecorded = tmp_path / "unrecorded" / "embeddings" / "step00000000"
    shutil.copytree(again, unrecorded)
    (unrecorded / "meta.json").write_text(json.dumps({**json.loads((again / "meta.json").read_text()), "lang": "xx"}))
    go(tmp_path / "unrecorded", "--resume", "--exit_interval", "2", code=76)
    assert read_artifact(unrecorded)[2]["lang"] == "de"
    # The start artifact (update 0) is Step 2's initial rows, as the plug-in metric recomputes them
    # for runs recorded without it; the resume kept the one the first invocation wrote.
    assert all((start / f).stat().st_ino == st.st_ino and (start / f).stat().st_mtime_ns == st.st_mtime_ns
               for f, st in written.items())
    saved = read_artifact(start)[0]
    shutil.rmtree(start)
    recomputed = start_embeddings(tmp_path / "part", tmp_path / "part" / "embeddings" / "step00000004" / "spm.model")
    assert sorted(saved) == sorted(recomputed) == ["output_bias", "word_embeddings"]
    assert all(torch.equal(saved[k], recomputed[k]) for k in saved)
    assert not torch.equal(saved["word_embeddings"], b["word_embeddings"])


def test_a_later_step_over_a_wider_model_than_its_default_schedules_says_so(primary_run, tmp_path, capsys):
    """Without --preset a later step takes its family's small preset's schedule (sized for a CPU):
    over a run wider than that preset's model it says so in one note naming the preset of that
    width; with --preset, or over a run of the small preset's width, it says nothing."""
    from mmadapt import cli

    wide = tmp_path / "wide"
    shutil.copytree(primary_run, wide)
    record = json.loads((wide / "run.json").read_text())
    record["model"]["hidden_size"] = 768  # read_source reads the record; no weight is loaded here
    (wide / "run.json").write_text(json.dumps(record))

    def schedule(source, *flags):
        args = cli.adapt_parser().parse_args(["--system", "bl_base", "--source", str(source), "--lang", "de",
                                              "--output_dir", str(tmp_path / "out"), *flags])
        train = cli._schedule(args, args.source)
        return train, capsys.readouterr().out

    train, said = schedule(wide)
    assert train == PRESETS["tiny"][1]
    assert said.startswith(f"note: {wide} is 768 wide and the schedule is the tiny preset's, sized for a CPU "
                           f"({train.train_iters} updates of") and "pass --preset roberta-base" in said
    assert len(said.splitlines()) == 1
    train, said = schedule(wide, "--train_iters", "5")  # the schedule the run trains, flags over the preset
    assert train.train_iters == 5 and "(5 updates of" in said
    assert schedule(wide, "--preset", "tiny")[1] == ""
    assert schedule(primary_run)[1] == ""


def test_a_source_whose_tokenizer_outgrew_its_model_is_refused(primary_run, corpus, de_corpus, de_tokenizer, tmp_path,
                                                               capsys):
    """A source run whose tokenizer was replaced by a larger one: refused in one line before Step 2
    writes anything (its shared pieces' rows were copied past the model's: an IndexError)."""
    from mmadapt.cli import main

    source = tmp_path / "source"
    shutil.copytree(primary_run, source)
    from mmadapt.data import train_tokenizer

    shutil.copyfile(train_tokenizer(corpus, tmp_path / "tok" / "big", VOCAB + 200), source / "tokenizer" / "spm.model")
    assert main(["adapt", *adapt_args("minijoint", source, de_corpus, de_tokenizer, tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer (tokenizer/spm.model) has {VOCAB + 200} pieces, more than its model's {VOCAB} rows" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_bias_fit_reaches_a_piece_far_below_the_others():
    """fit_bias takes the mean of the softmax over positions in log space: a piece 110-120 nats
    below the other at every position has a softmax of 0 in fp32, whose log made the fitted bias
    inf, then NaN (which the whole Step 2 would have trained from)."""
    from mmadapt.adapt import fit_bias

    logits = [torch.tensor([[0.0, -120.0], [0.0, -110.0]]), torch.tensor([[0.0, -115.0]])]
    target = torch.tensor([0.25, 0.75])
    b = fit_bias(logits, torch.zeros(2), target.log(), tol=1e-5)
    assert torch.isfinite(b).all()
    reached = torch.softmax(torch.cat(logits) + b, -1).mean(0)
    torch.testing.assert_close(reached, target, atol=1e-4, rtol=0)
