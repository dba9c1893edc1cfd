"""Vocabulary expansion (Step 2 --vocab_mode expand), in one process: the merged tokenizer keeps
every source id, the source rows are a frozen parameter apart from the new rows (so no optimizer,
weight decay included, can move one), the optimizer holds exactly the new rows, the FLOP count
is what the model executes, and the artifact plugs into the primary model. The parallel layouts
are in tests/test_expand_parallel.py (slow)."""

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

from conftest import REPO, VOCAB, scored_rows, sigterm_before
from mmadapt import steps
from mmadapt.adapt import check_output_start, source_split
from mmadapt.artifact import artifact_state, read_artifact
from mmadapt.config import ModelConfig, TrainConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.corpora import write_bible_corpus
from mmadapt.family import WORD
from mmadapt.models import get_family
from mmadapt.flops import counted_flops
from mmadapt.models.layers import SplitVocabEmbedding, new_rows_name, normal_init, vocab_linear
from mmadapt.models.roberta.model import BIAS
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights
from mmadapt.tokenizer import pieces
from mmadapt.expand import EXPAND_MULTIPLE, Replay, check_expansion, expand
from evaluation import step2_start

ZERO0 = REPO / "ds_configs" / "zero0.json"
ZERO2 = REPO / "ds_configs" / "zero2.json"


# --- the merged tokenizer -------------------------------------------------------------------------------

def test_merged_tokenizer_keeps_every_source_id(tokenizer, de_tokenizer, tmp_path):
    """The source's pieces keep their ids; the German pieces it lacks follow, in the target's
    order, as many as keep the size a multiple of EXPAND_MULTIPLE; an English sentence that the
    merged tokenizer encodes with no new piece gets exactly the source's ids (checked on every
    verse of the held-out English books the demo tests on), and German takes fewer pieces."""
    e = expand(tokenizer, de_tokenizer)
    merged = e.write(tmp_path / "merged.model")
    src, trg, got = pieces(tokenizer), pieces(de_tokenizer), pieces(merged)
    assert got[:VOCAB] == src and e.source_size == VOCAB == check_expansion(tokenizer, merged)
    assert got[VOCAB:] == list(e.new) and not set(e.new) & set(src)
    assert e.size % EXPAND_MULTIPLE == 0 and e.size == len(got)
    missing = [p for p in trg[5:] if p not in set(src)]  # every ordinary German piece the source lacks
    assert list(e.new) == missing[:len(e.new)] and len(missing) - len(e.new) < EXPAND_MULTIPLE

    sp_src, sp_merged = (spm.SentencePieceProcessor(model_file=str(p)) for p in (tokenizer, merged))
    english = write_bible_corpus("en", tmp_path / "en.txt", books=range(40, 44)).read_text().splitlines()
    english = [line for line in english if line.strip()]
    unchanged = 0
    for line in english:
        ids = sp_merged.encode(line)
        if max(ids) < VOCAB:
            assert ids == sp_src.encode(line), line
            unchanged += 1
    assert unchanged > len(english) // 2  # new pieces are scored below every source piece
    german = write_bible_corpus("de", tmp_path / "de.txt", books=range(40, 41)).read_text().splitlines()
    assert sum(map(len, sp_merged.encode(german))) < 0.8 * sum(map(len, sp_src.encode(german)))


def test_a_target_that_adds_no_piece_is_refused(tokenizer):
    with pytest.raises(ValueError, match="adds no piece") as e:
        expand(tokenizer, tokenizer)
    assert "\n" not in str(e.value)


def test_a_tokenizer_that_is_not_an_expansion_is_refused(tokenizer, de_tokenizer):
    with pytest.raises(ValueError, match="not an expansion of the source"):
        check_expansion(tokenizer, de_tokenizer)


# --- the split rows against the whole matrix -----------------------------------------------------------

def test_split_rows_compute_what_the_whole_matrix_does():
    """Embedding lookup (exactly) and projection (to rounding: a product per block) with the rows
    held as two parameters equal the one matrix's, and the backward reaches only the new rows'
    parameter."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=24, hidden_size=8, num_attention_heads=2, frozen_vocab_size=16)
    emb = SplitVocabEmbedding(cfg, normal_init(1.0))
    full = torch.cat([emb.weight, emb.new_weight]).detach().requires_grad_(True)
    emb.weight.requires_grad_(False)
    ids = torch.tensor([[0, 15, 16, 23, 5], [20, 3, 17, 16, 1]])
    x = torch.randn(10, 8)
    bias = torch.randn(24)
    assert torch.equal(emb(ids), F.embedding(ids, full))
    got = vocab_linear(x, emb.rows, (bias[:16], bias[16:])) + emb(ids).sum()
    want = F.linear(x, full, bias) + F.embedding(ids, full).sum()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    assert emb.weight.grad is None
    torch.testing.assert_close(emb.new_weight.grad, full.grad[16:], rtol=1e-5, atol=1e-5)


# --- Step 2 --vocab_mode expand, one process --------------------------------------------------------------

# The sources' updates: a decoder of 6 had not yet gathered its head's outputs (no row near the
# mean scored low on its text); by 60 it has, as a trained model has (the demo's: 0.055 nats at the
# mean row, 0.005 moved off the source text, measured on held-out verses).
ITERS = 60


def _train(family: str, iters: int, **changes) -> TrainConfig:
    preset = "tiny" if family == "roberta" else "llama-tiny"
    return dataclasses.replace(PRESETS[preset][1], train_iters=iters, save_interval=iters, log_interval=10,
                               seq_length=32, train_micro_batch_size_per_gpu=4, **changes)


@pytest.fixture(scope="module")
def sources(corpus, tokenizer, tmp_path_factory):
    """A 4-layer MINIJOINT of each family (secondary head after layer 2), ITERS updates: the
    decoder untied, so that both vocabulary-indexed matrices are expanded."""
    init_parallel(1, 1)
    root, out = tmp_path_factory.mktemp("expand_sources"), {}
    for family, preset, extra in (("roberta", "tiny", {}),
                                  ("llama", "llama-tiny", {"share_embeddings_and_output_weights": False})):
        model = apply_recipe(dataclasses.replace(PRESETS[preset][0], vocab_size=VOCAB, num_layers=4,
                                                 hidden_dropout=0.0, attention_dropout=0.0, **extra), "minijoint", 2)
        steps.pretrain(run=RunSpec(output_dir=root / family, ds_config=ZERO0, corpus=corpus, tokenizer=tokenizer),
                       step=steps.Pretrain(model=model, train=_train(family, ITERS), recipe="minijoint"))
        out[family] = root / family
    return out


@pytest.fixture(scope="module")
def expanded(sources, de_corpus, de_tokenizer, tmp_path_factory):
    """Each family's final artifact of a 2-update expand Step 2 over its MINIJOINT mini-model."""
    out = {}
    for family, source in sources.items():
        run = tmp_path_factory.mktemp(f"expand2_{family}")
        steps.adapt_embeddings(run=RunSpec(output_dir=run, ds_config=ZERO0, corpus=de_corpus, tokenizer=de_tokenizer),
                               step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                          train=_train(family, 2, vocab_mode="expand")))
        out[family] = run / "embeddings" / "step00000002"
    return out


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_step2_reads_its_source_checkpoint_once(family, sources, expanded_data, tmp_path, monkeypatch):
    """One expand Step 2 with every reader of the source's weights at work (the start, its
    calibration on the source run's text, the plug-in probe at every checkpoint, the primary's
    fingerprint, the expand report) reads the source checkpoint once (adapt.Step2Start builds
    the start once and hands it on)."""
    from mmadapt import checkpoint

    source, data = sources[family], expanded_data[family]
    reads, load = [], checkpoint.load_full_state_dict
    monkeypatch.setattr(checkpoint, "load_full_state_dict",
                        lambda ckpt_dir, *a, **k: reads.append(Path(ckpt_dir).resolve()) or load(ckpt_dir, *a, **k))
    out = tmp_path / "adapt"
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=data),
                           step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de", train=_train(
                               family, 2, extra_save_steps=(1,), vocab_mode="expand", plugin_eval_blocks=8)))
    record = json.loads((out / "run.json").read_text())
    assert "new_mass_calibrated" in record and "plugin_gain" in record["expand_report"]
    assert all("plugin_gain" in read_artifact(a)[2] for a in sorted((out / "embeddings").iterdir()))
    assert reads.count((source / "checkpoints").resolve()) == 1, reads


@pytest.fixture(scope="module")
def expanded_data(sources, de_corpus, de_tokenizer, tmp_path_factory):
    """Each family's German data prepared in its merged vocabulary (the source's tokenizer + the
    German pieces it lacks), 10% held out."""
    from mmadapt.config import PreprocessConfig

    out = {}
    for family, source in sources.items():
        out[family] = tmp_path_factory.mktemp(f"de_expanded_{family}")
        steps.preprocess(de_corpus, output_dir=out[family], vocab_size=None, tokenizer=de_tokenizer,
                         expand_from=source, cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_expand_trains_only_the_new_rows(family, sources, de_corpus, de_tokenizer, tmp_path):
    """50 updates with weight decay 0.1 under ZeRO-2: every source row of every expanded matrix is
    bit-identical to the source's in the live model (the run records each block's SHA-256), the
    optimizer state holds exactly the new rows (x h, + the new bias entries), the new rows moved,
    and the artifact holds the source rows then the new ones."""
    source = sources[family]
    out = tmp_path / "adapt"
    run = RunSpec(output_dir=out, ds_config=ZERO2, corpus=de_corpus, tokenizer=de_tokenizer)
    steps.adapt_embeddings(run=run, step=steps.AdaptEmbeddings(
        system="minijoint", source=source, lang="de",
        train=_train(family, 50, weight_decay=0.1, decay_all=True, vocab_mode="expand")))
    record = json.loads((out / "run.json").read_text())
    merged = expand(source / "tokenizer" / "spm.model", de_tokenizer)
    assert record["vocab_mode"] == "expand" and record["source_vocab_size"] == VOCAB
    assert record["model"]["vocab_size"] == merged.size and record["model"]["frozen_vocab_size"] == VOCAB
    assert (out / "tokenizer" / "spm.model").read_bytes() == merged.model

    _, src = load_weights(source)
    mini = get_family(record["model"]["family"]).extract_minijoint(*load_weights(source), 2)[1]
    expanded = (WORD, BIAS) if family == "roberta" else (WORD, "output_layer.weight")
    assert record["trainable"] == [new_rows_name(n) for n in expanded]
    recorded = {r["name"]: r for r in record["source_rows"]}
    assert sorted(recorded) == sorted(expanded)
    for name in expanded:
        assert recorded[name]["rows"] == [0, VOCAB]
        assert recorded[name]["sha256"] == _sha(mini[name].float()), f"{name}: a source row moved"

    tag = "step00000050"
    # One replica trains without ZeRO (engine.for_replicas): torch's AdamW state, one entry per
    # trained tensor, in the model states file.
    opt = torch.load(out / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
    state = opt["state"]
    new = merged.size - VOCAB
    h = record["model"]["hidden_size"]
    sizes = sorted(s["exp_avg"].numel() for s in state.values())
    if family == "roberta":  # the embedding's new rows, the new bias entries
        assert sizes == [new, new * h]
    else:  # both new row blocks; the vector group holds engine.build_engine's placeholder only
        assert sizes == [1, new * h, new * h]

    art, tok, meta = read_artifact(out / "embeddings" / tag)
    assert meta["vocab_mode"] == "expand" and meta["source_vocab_size"] == VOCAB and tok.read_bytes() == merged.model
    keys = {"word_embeddings": WORD, "output_bias" if family == "roberta" else "output_layer": expanded[1]}
    start = read_artifact(out / "embeddings" / "step00000000")[0]  # the run's own start, as it wrote it
    for key, name in keys.items():
        assert art[key].shape[0] == start[key].shape[0] == merged.size
        assert torch.equal(art[key][:VOCAB], mini[name].float()) and torch.equal(start[key][:VOCAB], art[key][:VOCAB])
        assert not torch.equal(art[key][VOCAB:], start[key][VOCAB:]), f"{key}: the new rows did not train"


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_an_expand_run_paused_and_resumed_matches_the_uninterrupted_one(family, sources, expanded_data, tmp_path):
    """Step 2 --vocab_mode expand paused after update 2 (--exit_interval) and resumed: its
    checkpoints hold the new rows alone, and the frozen source rows are rebuilt from the source
    run at the resume. The same losses as the run that was not paused, the same final artifact
    bit for bit, its source rows still the source's."""
    from conftest import metrics
    from mmadapt.faults import Paused

    source, data = sources[family], expanded_data[family]
    train = dataclasses.replace(_train(family, 4, vocab_mode="expand"), log_interval=1, save_interval=2)

    def go(out: Path, resume: bool = False, **changes) -> None:
        steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO2, data_path=data, resume=resume),
                               step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                          train=dataclasses.replace(train, **changes)))

    go(tmp_path / "whole")
    with pytest.raises(Paused):
        go(tmp_path / "paused", exit_interval=2)
    assert [r["step"] for r in metrics(tmp_path / "paused") if "loss" in r] == [1, 2]
    go(tmp_path / "paused", resume=True)
    losses = {run: [(r["step"], r["loss"]) for r in metrics(tmp_path / run) if "loss" in r]
              for run in ("whole", "paused")}
    assert losses["paused"] == losses["whole"] and len(losses["whole"]) == 4
    whole, paused = (read_artifact(tmp_path / run / "embeddings" / "step00000004")[0] for run in ("whole", "paused"))
    assert sorted(whole) == sorted(paused) and all(torch.equal(whole[k], paused[k]) for k in whole)
    cfg, state = load_weights(source)
    mini = get_family(cfg.family).extract_minijoint(cfg, state, 2)[1]
    assert torch.equal(paused["word_embeddings"][:VOCAB], mini[WORD].float())


def test_the_primary_model_keeps_its_own_source_rows(sources, expanded):
    """Swapped into the primary model (Step 4, export), an expanded artifact keeps the primary
    head's own source rows of the output bias (a MINIJOINT's secondary head has its own) and
    appends the new rows; a model of another vocabulary is refused."""
    source = sources["roberta"]
    art, _, meta = read_artifact(expanded["roberta"])
    cfg, state = load_weights(source)
    cfg, primary = get_family(cfg).primary_model(cfg, state)
    got = artifact_state(get_family(cfg), art, meta, primary)
    assert torch.equal(got[BIAS][:VOCAB], primary[BIAS]) and torch.equal(got[BIAS][VOCAB:], art["output_bias"][VOCAB:])
    assert not torch.equal(art["output_bias"][:VOCAB], primary[BIAS])  # the secondary head's
    assert torch.equal(got[WORD], art["word_embeddings"])
    with pytest.raises(ValueError, match="expands a 1000-piece vocabulary"):
        artifact_state(get_family(cfg), art, meta, {WORD: primary[WORD][:500], BIAS: primary[BIAS][:500]})


def test_subword_mean_starts_each_new_row_at_its_split(sources, expanded_data):
    """--embedding_init subword_mean with --vocab_mode expand: each new piece's row (embedding
    and output projection alike) is the mean of the source rows of its split under the source
    tokenizer (adapt.source_split, tested in tests/test_adapt.py), computed here row by row."""
    source, data = sources["llama"], expanded_data["llama"]
    merged = data / "tokenizer.model"
    start = step2_start("minijoint", source, data, 2, seed=7, embedding_init="subword_mean", vocab_mode="expand",
                        expand_output_start="embedding_init")
    init, counts = start.init, start.rows
    _, src = load_weights(source)
    split = source_split(source / "tokenizer" / "spm.model")
    new = pieces(merged)[VOCAB:]
    composed = 0
    for i, piece in enumerate(new):
        ids = split(piece)
        for name in (WORD, "output_layer.weight"):
            if ids:
                torch.testing.assert_close(init[new_rows_name(name)][i], src[name][ids].mean(0))
        composed += bool(ids)
    assert composed > len(new) // 2  # the loop above checked most rows, not none
    assert counts.pop("new_mass_bound") > 0 and counts.pop("start_rule") == {"row_std": "source", "bias": "fitted",
                                                                              "bias_target": "scored"}
    assert counts.pop("row_std") == pytest.approx(src[WORD].std().item())
    # The new pieces the target text (as the merged tokenizer read it) never holds, counted apart
    text = np.fromfile(data / "text.bin", dtype=json.loads((data / "manifest.json").read_text())["dtype"])
    assert counts.pop("new_pieces_unused") == len(set(range(VOCAB, VOCAB + len(new))) - set(text.tolist())) > 0
    assert counts == {"shared_pieces": 0, "subword_mean_pieces": composed, "random_pieces": len(new) - composed}


@pytest.mark.parametrize("family, tied", [("roberta", True), ("llama", True), ("llama", False)])
def test_expand_flops_are_what_the_model_executes(family, tied):
    """The exact Step-2 count of an expanded vocabulary (the projection's weight gradient over
    the new rows only) equals FlopCounterMode on the real model, attention as explicit matmuls;
    it is the count of the unexpanded vocabulary less 2 m h F (m scored positions)."""
    preset = PRESETS["tiny" if family == "roberta" else "llama-tiny"][0]
    cfg = dataclasses.replace(preset, num_layers=2, vocab_size=96, frozen_vocab_size=80, attention_impl="math",
                              hidden_dropout=0.0, attention_dropout=0.0, share_embeddings_and_output_weights=tied)
    fam = get_family(cfg)
    model = fam.build_lm(cfg)
    trained = set(map(new_rows_name, fam.vocab_params(cfg)))
    for n, p in model.named_parameters():
        p.requires_grad_(n in trained)
    g = torch.Generator().manual_seed(0)
    b, s = 2, 16
    ids = torch.randint(5, 96, (b, s), generator=g)
    if family == "roberta":  # 8 of the 32 positions masked
        labels = torch.full_like(ids, -100)
        flat = torch.randperm(b * s, generator=g)[:8]
        labels.view(-1)[flat] = ids.view(-1)[flat]
        p = 8 / (b * s)
    else:  # every position scored
        labels, p = torch.randint(5, 96, (b, s), generator=g), 1.0

    def update():
        loss, _ = model(ids, labels)
        loss.backward()

    counted = counted_flops(update)
    assert counted == pytest.approx(b * fam.step_flops("adapt", cfg, s, p), rel=1e-9)
    whole = fam.step_flops("adapt", dataclasses.replace(cfg, frozen_vocab_size=0), s, p)
    assert counted == pytest.approx(b * whole - 2 * (b * s * p) * cfg.hidden_size * 80, rel=1e-9)


def test_every_expand_run_reports_the_source_language_and_the_plug_in_metric(sources, de_corpus, de_tokenizer,
                                                                                english, tmp_path):
    """At its end an expand run scores the primary model on source text with its own vocabulary,
    and with its new pieces in the softmax at update 0 and at the end: the loss (it can only rise:
    they take probability mass from the source pieces; at update 0 by at most the start's
    worst-case bound, and for this untied decoder, whose new output rows moved off its source
    text (the text it is scored on here: the source has no validation split), by what the move
    left there, half of expand_source_nats) and the KL from the source model's distribution (the rise, to
    rounding); and, on target data with a validation split, the plug-in metric of its artifact
    at both. In bits per byte of held-out English (plugin.source_bits), read by the source's own
    tokenizer through the expanded model, the text moves only by the new rows' share of the
    softmax: at update 0 up, and by no more per piece than the start's bound."""
    CALIBRATED_NATS = TrainConfig.expand_source_nats / 2
    from mmadapt.config import PreprocessConfig
    from mmadapt.plugin import plugin_records

    source = sources["llama"]
    data = tmp_path / "de"
    steps.preprocess(de_corpus, output_dir=data, vocab_size=VOCAB, tokenizer=de_tokenizer,
                     cfg=PreprocessConfig(workers=1, valid_fraction=0.1), expand_from=source)
    assert (data / "tokenizer.model").read_bytes() == expand(source / "tokenizer" / "spm.model", de_tokenizer).model
    out = tmp_path / "a"
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=data),
                           step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                      train=_train("llama", 4, vocab_mode="expand")))
    record = json.loads((out / "run.json").read_text())
    report, size = record["expand_report"], record["model"]["vocab_size"]
    assert record["output_shift"] > 0 and record["new_mass_calibrated"] <= CALIBRATED_NATS + 1e-9
    start = report["source_loss_start"] - report["source_loss_before"]
    assert start == pytest.approx(record["new_mass_calibrated"], abs=1e-3) and record["new_mass_bound"] > start
    assert record["new_mass_bound"] > math.log(size / VOCAB)  # worst case of a moved row: looser than the mean's
    # the calibration's cost: one forward pass of the primary over the source run's text (its
    # held-out blocks as heldout_batches cuts them): the last layer's QKV and attention for every
    # position, its output projection and MLP, and the output layer, over the scored positions only
    from mmadapt.heldout import Text, heldout_batches
    from mmadapt.models.llama.flops import layer_attn_flops, layer_flops

    primary = json.loads((source / "run.json").read_text())
    cfg = ModelConfig(**primary["model"])
    held = heldout_batches(Text(Path(primary["data_path"]), 32, split="text"), VOCAB, get_family("llama").objective)
    blocks, rows = sum(len(ids) for ids, _ in held), sum(int(labels.ge(0).sum()) for _, labels in held)
    h, hd, f, nh, ng = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.query_groups
    last = 2 * 32 * h * (nh + 2 * ng) * hd + layer_attn_flops(cfg, 32)
    assert record["calibration_flops"] == pytest.approx(
        blocks * ((cfg.num_layers - 1) * layer_flops(cfg, 32) + last)
        + rows * (2 * nh * hd * h + 6 * h * f + 2 * h * VOCAB), rel=1e-12)
    for when in ("start", "after"):
        rise = report[f"source_loss_{when}"] - report["source_loss_before"]
        assert 0 < rise and report[f"source_kl_{when}"] == pytest.approx(rise, abs=1e-4)
    assert report["source_loss_start"] - report["source_loss_before"] <= record["new_mass_bound"]
    assert report["scored_pieces"] > 1000
    # that text is the source run's training text: said so (heldout.pretrained_on), no held-out score
    assert report["source_text_split"] == "text" and report["source_text_pretrained_on"] is True
    want = plugin_records(source, [out / "embeddings" / "step00000004"], {"de": data}, 32)[0]
    assert report["plugin_gain"] == pytest.approx(want["score"])
    assert report["plugin_gain_start"] == pytest.approx(want["start_gain"])
    assert report["plugin_loss"] == pytest.approx(want["loss"])

    from mmadapt.bpb import ByteScorer
    from mmadapt.heldout import Primary, Scorer
    from mmadapt.plugin import source_bits

    per_byte = ByteScorer(Scorer(Primary.read(source)), 32, 2048)
    raw = per_byte.text(english)
    emb, tok, meta = read_artifact(out / "embeddings" / "step00000000")
    bits = source_bits(per_byte, english, tok, emb, meta)
    own = per_byte.score(raw, per_byte.own_tokenizer)  # the source model as it is: no artifact
    assert bits["source_none_bpb"] == pytest.approx(own["bpb"], rel=1e-9)
    rise = (bits["source_own_tokenizer_bpb"] - own["bpb"]) * raw.bytes * math.log(2) / own["pieces"]  # nats per piece
    assert 0 < rise <= record["new_mass_bound"]
    merged = per_byte.score(raw, tok, emb, meta)
    assert bits["source_bpb"] == merged["bpb"]


def test_decoder_expand_scores_a_fraction_of_the_positions(sources, de_corpus, de_tokenizer, tmp_path):
    """--vocab_mode expand with score_fraction 0.25 (issue 40's both vocabulary modes): the
    artifact counts the scored rows' FLOPs at the expanded vocabulary, and the source rows of both
    expanded matrices stay bit-identical to the source's."""
    from mmadapt.models.llama.flops import adapt_flops
    from mmadapt.run import read_run, run_model

    source, out = sources["llama"], tmp_path / "p025"
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus, tokenizer=de_tokenizer),
                           step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                      train=_train("llama", 2, vocab_mode="expand",
                                                                   score_fraction=0.25)))
    record = read_run(out)
    mini_cfg = run_model(record)
    assert record["vocab_mode"] == "expand" and mini_cfg.vocab_size > VOCAB
    art, _, meta = read_artifact(out / "embeddings" / "step00000002")
    assert meta["score_fraction"] == 0.25 and meta["vocab_mode"] == "expand"
    assert meta["flops"] == 2 * 4 * adapt_flops(mini_cfg, 32, p=0.25)  # 2 updates of 4 blocks of 32
    assert {r["name"] for r in record["source_rows"]} == {WORD, "output_layer.weight"}
    mini = get_family("llama").extract_minijoint(*load_weights(source), 2)[1]
    for r in record["source_rows"]:
        assert r["rows"] == [0, VOCAB] and r["sha256"] == _sha(mini[r["name"]].float()), r["name"]
    assert torch.equal(art["word_embeddings"][:VOCAB], mini[WORD])


def test_an_expanded_encoder_exports_with_its_merged_tokenizer(sources, expanded, tmp_path):
    """export-hf of the primary model with an expanded artifact: transformers' tokenizer gives
    mmadapt's merged ids on every English and German verse of a held-out book, its logits are
    mmadapt's, and its first 1000 rows are the primary model's own."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from mmadapt.hf import export_hf
    from mmadapt.models.roberta.model import RobertaMLM
    from mmadapt.tokens import BOS_ID, EOS_ID, PAD_ID

    source, artifact = sources["roberta"], expanded["roberta"]
    export_hf(tmp_path / "hf", primary=source, embeddings=artifact)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    art, merged, meta = read_artifact(artifact)
    sp = spm.SentencePieceProcessor(model_file=str(merged))
    assert len(tok) == sp.get_piece_size() == meta["vocab_size"]
    verses = [v for lang in ("en", "de") for v in write_bible_corpus(lang, tmp_path / f"{lang}.txt",
                                                                    books=range(41, 42)).read_text().splitlines()
              if v.strip()]
    got = tok(verses)["input_ids"]
    assert [i for i, (v, ids) in enumerate(zip(verses, got)) if ids != [BOS_ID, *sp.encode(v), EOS_ID]] == []

    cfg, state = load_weights(source)
    cfg, primary = get_family(cfg).primary_model(cfg, state)
    swapped = {**primary, **artifact_state(get_family(cfg), art, meta, primary)}
    cfg = dataclasses.replace(cfg, vocab_size=meta["vocab_size"], hidden_dropout=0.0, attention_dropout=0.0)
    model = RobertaMLM(cfg).eval()
    model.load_state_dict(swapped)
    enc = tok(verses[:4] + verses[-4:], padding=True, return_tensors="pt")
    hf = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        mine = model.heads.heads[0](model.hidden_states(enc.input_ids)[-1], model.word_embeddings.rows)
        theirs = hf(**enc).logits
    keep = enc.input_ids.ne(PAD_ID)
    assert (mine[keep] - theirs[keep]).abs().max().item() <= 1e-5
    assert torch.equal(hf.roberta.embeddings.word_embeddings.weight[:VOCAB].detach(), primary[WORD])
    # predict with the artifact is the same model (it took the artifact's source rows of the bias,
    # the secondary head's, before)
    from mmadapt import predict

    lm = predict.load(source, embeddings=artifact, device="cpu")
    ids = lm.encode(verses[:4])
    with torch.no_grad():
        mine = model.heads.heads[0](model.hidden_states(ids)[-1], model.word_embeddings.rows)
    real = ids.ne(PAD_ID)
    assert (lm.logits(verses[:4])[lm.heads[0]][real] - mine[real]).abs().max().item() <= 1e-5


def test_an_expanded_decoder_exports_with_its_merged_tokenizer(sources, expanded, tmp_path):
    """export-hf of the untied decoder with an expanded artifact: LlamaForCausalLM whose tokenizer
    gives </s> and mmadapt's merged ids, whose logits are mmadapt's, and which generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmadapt.hf import export_hf
    from mmadapt.models.llama.model import LlamaLM
    from mmadapt.tokens import EOS_ID

    source, artifact = sources["llama"], expanded["llama"]
    export_hf(tmp_path / "hf", primary=source, embeddings=artifact)
    art, merged, meta = read_artifact(artifact)
    sp = spm.SentencePieceProcessor(model_file=str(merged))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = write_bible_corpus("de", tmp_path / "de.txt", books=range(41, 42)).read_text().splitlines()[:8]
    assert [tok(t)["input_ids"] for t in texts] == [[EOS_ID, *sp.encode(t)] for t in texts]
    cfg, state = load_weights(source)
    cfg, primary = get_family(cfg).primary_model(cfg, state)
    model = LlamaLM(dataclasses.replace(cfg, vocab_size=meta["vocab_size"], hidden_dropout=0.0,
                                        attention_dropout=0.0)).eval()
    model.load_state_dict({**primary, **artifact_state(get_family(cfg), art, meta, primary)})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    ids = torch.tensor([[EOS_ID, *sp.encode(texts[0])]])
    with torch.no_grad():
        mine = model.heads.heads[0](model.hidden_states(ids)[-1][0], model.output_weight)
        assert (mine - hf(input_ids=ids).logits[0]).abs().max().item() <= 1e-5
        assert hf.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == \
            ids.shape[1] + 3


@pytest.mark.slow
def test_the_demos_merged_tokenizer_keeps_the_english_ids_of_the_whole_bible(tmp_path):
    """The demo's tokenizers: its shipped English one (the source models') merged with a
    2000-piece German one trained as the demo trains it. On every verse of the English Bible
    whose merged encoding uses no new piece, the ids are the source tokenizer's."""
    from mmadapt.data import train_tokenizer
    from mmadapt.demo import source_models

    english = source_models("roberta") / "spm.model"
    german = train_tokenizer(write_bible_corpus("de", tmp_path / "de.txt"), tmp_path / "de", 2000)
    merged = expand(english, german).write(tmp_path / "merged.model")
    src, got = (spm.SentencePieceProcessor(model_file=str(p)) for p in (english, merged))
    verses = [v for v in write_bible_corpus("en", tmp_path / "en.txt").read_text().splitlines() if v.strip()]
    size = src.get_piece_size()
    kept = [(a, b) for a, b in zip(src.encode(verses), got.encode(verses)) if max(b) < size]
    assert len(verses) > 30_000 and len(kept) > len(verses) // 2
    assert [a for a, b in kept if a != b] == []


# --- the bounded start (TrainConfig.expand_output_start, adapt.bounded_start) ------------------------

def test_the_bounded_start_caps_the_new_pieces_share_wherever_the_model_looks():
    """An encoder's output path (tied rows, a bias, a LayerNorm's affine): with the bounded start,
    the new pieces' share of the softmax stays under 1 - exp(-nats) (here 0.02) at every normed
    output y = w * x_hat + beta with ||x_hat|| = sqrt(h): random ones, and for each new row the
    one that maximises its own logit (where the bound is tight for that row). A decoder's untied
    projection gets the mean source row, and its stated bound is log(1 + k / n)."""
    from mmadapt.expand import bounded_start, logit_excess, mass_bound

    NEW_MASS_NATS = 0.02
    from mmadapt.family import OutputPath

    g = torch.Generator().manual_seed(0)
    n, k, h = 50, 30, 16
    src = {WORD: torch.randn(n, h, generator=g), "b": torch.randn(n, generator=g),
           "w": 1 + torch.rand(h, generator=g), "beta": 0.3 * torch.randn(h, generator=g)}
    other = {**src, "b": src["b"] - 1.0, "w": src["w"] * 0.5}  # a second head (MINIJOINT: body and primary)
    path = OutputPath(WORD, "b", "w", "beta")
    new, bound = bounded_start(path, [src, other], {WORD: torch.randn(k, h, generator=g), "b": torch.zeros(k)},
                               NEW_MASS_NATS)
    assert bound == pytest.approx(NEW_MASS_NATS, rel=1e-6)
    d = new[WORD] - src[WORD].mean(0)
    for head in (src, other):
        x = torch.randn(2000, h, generator=g)
        worst = d * head["w"] / (d * head["w"]).norm(dim=1, keepdim=True)  # x_hat aligned with each row's d * w
        x = torch.cat([x, worst])
        x = h ** 0.5 * x / x.norm(dim=1, keepdim=True)
        y = head["w"] * x + head["beta"]
        logits = torch.cat([y @ src[WORD].T + head["b"], y @ new[WORD].T + new["b"]], 1)
        share = torch.softmax(logits.double(), 1)[:, n:].sum(1)
        assert share.max() <= -math.expm1(-NEW_MASS_NATS) + 1e-9
    # Without beta, the excess is what x_hat = sqrt(h) (d * w) / ||d * w|| reaches: the bound is tight.
    reached = (h ** 0.5 * (d * src["w"]) / (d * src["w"]).norm(dim=1, keepdim=True) * src["w"] * d).sum(1)
    torch.testing.assert_close(logit_excess(d, src["w"]), reached)
    assert mass_bound(torch.zeros(k), n) == pytest.approx(math.log(1 + k / n))

    untied = OutputPath("out", None, "w", None)
    heads = [{"out": src[WORD], "w": src["w"]}]
    new, bound = bounded_start(untied, heads, {WORD: torch.randn(k, h, generator=g), "out": torch.randn(k, h, generator=g)},
                               NEW_MASS_NATS)
    assert torch.equal(new["out"], src[WORD].mean(0).expand(k, -1)) and bound == pytest.approx(math.log(1 + k / n))


def test_the_bias_shift_is_the_largest_that_leaves_the_target_rise():
    """expand.bias_shift: the common offset c of the new bias entries whose mean rise
    log(1 + sum_j exp(y_i . r_j + b_j + c - lse_i)), computed here term by term, is the target,
    and a slightly larger c overshoots it; a start already over the target is left (c = 0)."""
    from mmadapt.expand import bias_shift

    g = torch.Generator().manual_seed(3)
    m, k, h = 40, 7, 5
    y, rows = torch.randn(m, h, generator=g), torch.randn(k, h, generator=g)
    lse, bias = 3 + torch.rand(m, generator=g), torch.full((k,), -12.0)

    def rise(c: float) -> float:
        return sum(math.log(1 + sum(math.exp(float(y[i] @ rows[j] + bias[j]) + c - float(lse[i])) for j in range(k)))
                   for i in range(m)) / m

    c, got = bias_shift(y, lse, rows, bias, target=0.005)
    assert c > 0 and got == pytest.approx(rise(c), rel=1e-5) and got == pytest.approx(0.005, rel=1e-4)
    assert rise(c + 1e-3) > 0.005
    assert bias_shift(y, lse, rows, bias + c + 1, target=0.005) == (0.0, pytest.approx(rise(c + 1)))


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_at_update_0_the_bounded_start_keeps_the_source_language(family, sources, expanded_data, corpus, tokenizer,
                                                                  tmp_path):
    """The primary model's source-language loss on held-out source text, and its KL from the
    source model's distribution, with the new pieces in its softmax at update 0: at most
    TrainConfig.expand_source_nats (0.01) for both families, with the bounded start calibrated on the source text's
    training split (expand.calibrate, here the replay text's) and scored on its valid split. The worst-case start
    it calibrates (the encoder's bias bound: a tiny rise; the decoder's mean row, Hewitt's: a
    larger one) stays under its bound, the encoder's calibrated start rises more than its worst
    case (its entries moved up toward the text) and the decoder's less than its mean row; every
    bounded start rises less than the old start. The KL equals the rise."""
    NEW_MASS_NATS = TrainConfig.expand_source_nats
    from mmadapt.config import PreprocessConfig
    from mmadapt.expand import SourceProbe
    from mmadapt.heldout import Primary, Scorer, Text

    source = sources[family]
    text = tmp_path / "en"
    steps.preprocess(corpus, output_dir=text, vocab_size=VOCAB, tokenizer=tokenizer,
                     cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    merged = expanded_data[family] / "tokenizer.model"
    probe = SourceProbe(Scorer(Primary.read(source)), Text(text, 32, split="valid"))
    meta = {"vocab_mode": "expand", "source_vocab_size": VOCAB}
    rise, bounds = {}, {}
    for start in ("worst_case", "bounded", "embedding_init"):
        built = step2_start("minijoint", source, expanded_data[family], 2, seed=7, vocab_mode="expand",
                            expand_output_start=start, replay_data=str(text), seq_length=32)
        counts = built.rows
        if start == "bounded":
            moved = counts["bias_shift" if family == "roberta" else "output_shift"]
            assert moved > 0 and counts["new_mass_calibrated"] <= NEW_MASS_NATS / 2 + 1e-9
            assert counts["new_mass_bound"] > bounds["worst_case"]  # the worst case is looser now
        bounds[start] = counts["new_mass_bound"]
        scored = probe.score(built.tensors(), meta)
        rise[start] = scored["source_loss"] - probe.before
        assert scored["source_kl"] == pytest.approx(rise[start], abs=1e-4)
        assert rise[start] <= counts["new_mass_bound"] + 1e-4
    rise["worst"] = rise["worst_case"]
    k = len(pieces(merged)) - VOCAB
    assert 0 <= rise["bounded"] <= NEW_MASS_NATS
    if family == "roberta":  # the worst case leaves nearly nothing on the text; calibrated, more
        assert rise["worst"] < rise["bounded"]
    else:  # Hewitt's mean row: its bound, and more than the moved row takes
        assert rise["bounded"] < rise["worst"] <= math.log(1 + k / VOCAB) + 1e-4
    assert rise["bounded"] < rise["embedding_init"]


def test_a_tied_decoder_cannot_start_its_rows_at_their_splits_under_the_bounded_start():
    """Its new rows are its output rows too: the bounded start puts them at the source mean, so
    --embedding_init subword_mean is refused with it (and runs with the output side as the input)."""
    body = dataclasses.replace(PRESETS["llama-tiny"][0], share_embeddings_and_output_weights=True)
    train = TrainConfig(vocab_mode="expand", embedding_init="subword_mean")
    llama = get_family("llama")
    with pytest.raises(ValueError, match="--expand_output_start embedding_init"):
        check_output_start(llama, train, body)
    check_output_start(llama, dataclasses.replace(train, expand_output_start="embedding_init"), body)
    check_output_start(llama, train, dataclasses.replace(body, share_embeddings_and_output_weights=False))


# --- source-language replay (TrainConfig.replay_data, replay_fraction) ------------------------------------

def test_split_losses_are_each_texts_loss_per_scored_piece():
    """layers.head_losses with a split: the loss is the unsplit one, and the logged (sum, count)
    pairs are the cross-entropy sums of the first `split` scored positions and of the rest."""
    from mmadapt.models.layers import head_losses

    class Head(torch.nn.Module):
        tp = 1

        def forward(self, x, rows):
            return vocab_linear(x, rows)

    g = torch.Generator().manual_seed(0)
    heads = torch.nn.ModuleList([Head(), Head()])
    hiddens = [torch.randn(2, 5, 4, generator=g) for _ in heads]
    rows = (torch.randn(11, 4, generator=g),)
    index, targets = torch.tensor([0, 3, 4, 6, 9]), torch.tensor([1, 2, 3, 4, 5])
    plain, per_head = head_losses(heads, hiddens, index, targets, rows, (0.25, 0.75))
    loss, logged = head_losses(heads, hiddens, index, targets, rows, (0.25, 0.75), split=2)
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(logged[:2], per_head)
    ce = torch.stack([F.cross_entropy(vocab_linear(h.reshape(-1, 4)[index], rows), targets, reduction="none")
                      for h in hiddens])  # [heads, m]
    mixed = 0.25 * ce[0] + 0.75 * ce[1]
    torch.testing.assert_close(logged[2:], torch.stack([mixed[:2].sum(), torch.tensor(2.0), mixed[2:].sum(),
                                                        torch.tensor(3.0)]))


def test_a_micro_batch_with_no_scored_position_has_a_zero_loss_not_nan():
    """MLM blocks of a lone </s> (a sentence exactly k blocks long) have nothing to mask: a
    micro-batch of them gave a mean over no piece, NaN, and the engine stopped the run as
    diverged. Its loss is 0 now, with zero gradients that reach the head's parameters."""
    from mmadapt.models.layers import head_losses

    class Head(torch.nn.Module):
        tp = 1

        def forward(self, x, rows):
            return vocab_linear(x, rows)

    rows = (torch.randn(11, 4, requires_grad=True),)
    hiddens = [torch.randn(2, 5, 4, requires_grad=True)]
    none = torch.zeros(0, dtype=torch.long)
    loss, per_head = head_losses(torch.nn.ModuleList([Head()]), hiddens, none, none, rows, None)
    assert float(loss.detach()) == 0.0 and per_head.tolist() == [0.0]
    loss.backward()
    assert rows[0].grad is not None and not rows[0].grad.any()
    loss, logged = head_losses(torch.nn.ModuleList([Head(), Head()]), hiddens * 2, none, none, rows, (0.5, 0.5),
                               split=0)
    assert float(loss.detach()) == 0.0 and torch.isfinite(logged).all()


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_replay_batches_are_a_pure_function_of_the_update(family, corpus, tokenizer, tmp_path):
    """R = round(f B) of every update's B blocks come from the replay text, spread over the
    micro-batches as their first rows: each text's blocks are its own global samples t R .. and
    t (B - R) .. in order, two data-parallel ranks see exactly the micro-batches of one process
    accumulating over both, and f = 0 gives the plain batches."""
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import ReplayBatches, replay_blocks
    from mmadapt.microbatch import merged

    data = tmp_path / "en"
    steps.preprocess(corpus, output_dir=data, vocab_size=VOCAB, tokenizer=tokenizer, cfg=PreprocessConfig(workers=1))
    batches = get_family(family).objective.batches

    def make(gas, rank, world, fraction, micro=5):
        train = TrainConfig(seq_length=32, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        target = batches(data, train, VOCAB, rank, world)
        replay = batches(data, dataclasses.replace(train, seed=99), VOCAB, rank, world)
        return ReplayBatches(target, replay, replay_blocks(fraction, target.global_batch)), target, replay

    one, target, replay = make(2, 0, 1, 0.25)
    assert one.replay_blocks == 2  # round(0.25 * 10) (banker's rounding of 2.5)
    for step in (0, 3):
        got = one.step_batches(step)
        assert [rows for *_, rows in got] == [1, 1]
        ids = torch.cat([b[0] for b in got])
        want = [replay.sample(step * 2 + i)[0] for i in range(2)]
        want_t = [target.sample(step * 8 + i)[0] for i in range(8)]
        assert torch.equal(ids[0, :len(want[0])], torch.as_tensor(want[0]))
        assert torch.equal(ids[5, :len(want[1])], torch.as_tensor(want[1]))
        assert torch.equal(ids[1, :len(want_t[0])], torch.as_tensor(want_t[0]))
        assert torch.equal(ids[9, :len(want_t[7])], torch.as_tensor(want_t[7]))
        ranks = [make(1, r, 2, 0.25)[0].step_batches(step)[0] for r in range(2)]
        for mine, theirs in zip(got, ranks):
            assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1]) and mine[2] == theirs[2]
        # micro_batch_fill's re-split of one process's update (microbatch.merged: the replay rows
        # first) is the micro-batch that a run asked for as micro 10 x 1 reads
        (ids10, labels10, rows10), = merged(got, 2)
        (want10, want_labels10, want_rows10), = make(1, 0, 1, 0.25, micro=10)[0].step_batches(step)
        assert rows10 == want_rows10 == 2 and torch.equal(ids10, want10) and torch.equal(labels10, want_labels10)
    none, target, _ = make(2, 0, 1, 0.0)
    for (ids, labels, rows), (ids0, labels0) in zip(none.step_batches(1), target.step_batches(1)):
        assert rows == 0 and torch.equal(ids, ids0) and torch.equal(labels, labels0)


def test_an_expand_run_with_replay_logs_both_languages(sources, de_corpus, de_tokenizer, corpus, tokenizer, tmp_path,
                                                       monkeypatch):
    """--replay_fraction 0.25 over source text in the source's ids: the log holds the source- and
    target-language losses apart (the total between them), the artifacts count the replay blocks in
    their tokens and FLOPs (blocks of the same length: the FLOPs per block stay), the report scores
    the source language on the replay text's held-out part at update 0 and at the end; a replay
    dataset of another tokenizer is refused before anything is written, or trained (a raw corpus's
    target tokenizer)."""
    from mmadapt.config import PreprocessConfig

    source, text = sources["roberta"], tmp_path / "en"
    steps.preprocess(corpus, output_dir=text, vocab_size=VOCAB, tokenizer=tokenizer,
                     cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    out = tmp_path / "a"
    train = dataclasses.replace(_train("roberta", 4, vocab_mode="expand", replay_data=str(text), replay_fraction=0.25),
                                log_interval=1)
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus, tokenizer=de_tokenizer),
                           step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de", train=train))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert min(r["source_loss"], r["target_loss"]) <= r["loss"] <= max(r["source_loss"], r["target_loss"])
    record = json.loads((out / "run.json").read_text())
    assert record["replay_data"] == str(text.resolve())
    meta = read_artifact(out / "embeddings" / "step00000004")[2]
    assert meta["replay_blocks"] == 1 and meta["replay_tokens"] == 4 * 32 and meta["tokens"] == 4 * 4 * 32
    fam = get_family("roberta")
    model = ModelConfig(**record["model"])
    # FLOPs of the positions the head projected, counted again from the data: the masking selects
    # among ordinary pieces only, so fewer than mask_prob of the 4 x 4 x 32 positions
    projected = scored_rows(fam, record["data_path"], model, train, 4, Replay(text, 0.25))
    base, per_row = fam.row_flops("adapt", model, 32)
    assert meta["scored_rows"] == projected < 0.15 * 4 * 4 * 32
    assert meta["flops"] == pytest.approx(base * 4 * 4 + per_row * projected, rel=1e-12)
    assert meta["flops"] < fam.step_flops("adapt", model, 32, fam.scored_fraction(train)) * 4 * 4
    # and so does the logged rate: FLOPs per token of each update (log_interval 1) times its tokens
    assert sum(r["flops_per_s"] / r["tokens_per_s"] * 4 * 32 for r in rows) == pytest.approx(meta["flops"], rel=1e-9)
    report = record["expand_report"]
    assert report["source_text"] == f"{text} (valid)"
    assert report["source_loss_start"] - report["source_loss_before"] <= 0.01
    assert report["source_kl_after"] == pytest.approx(report["source_loss_after"] - report["source_loss_before"],
                                                      abs=1e-4)

    other = tmp_path / "de-data"
    steps.preprocess(de_corpus, output_dir=other, vocab_size=VOCAB, tokenizer=de_tokenizer,
                     cfg=PreprocessConfig(workers=1))
    refused = tmp_path / "b"
    with pytest.raises(ValueError, match="was not encoded with") as e:
        steps.adapt_embeddings(run=RunSpec(output_dir=refused, ds_config=ZERO0, corpus=de_corpus,
                                           tokenizer=de_tokenizer),
                               step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                          train=dataclasses.replace(train, replay_data=str(other))))
    assert "\n" not in str(e.value) and not refused.exists()
    # From a raw corpus (no --tokenizer): refused before the target tokenizer is trained.
    monkeypatch.setattr(steps, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer first"))
    with pytest.raises(ValueError, match="was not encoded with"):
        steps.adapt_embeddings(run=RunSpec(output_dir=refused, ds_config=ZERO0, corpus=de_corpus),
                               step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de",
                                                          train=dataclasses.replace(train, replay_data=str(other))))
    assert not refused.exists()


def test_a_sigterm_while_the_source_language_is_scored_stops_the_run_for_resume(sources, de_corpus, de_tokenizer,
                                                                                  tmp_path, monkeypatch):
    """An expand run scores the source language after its last checkpoint (expand_report): a
    SIGTERM there killed it with 143 and no word (the SLURM templates requeue that only after their
    own warning), run.json left unfinished. It stops as in the training loop (Stopped, exit 75);
    --resume then scores it without training."""
    from mmadapt import adapt
    from mmadapt.faults import Stopped

    out, train = tmp_path / "a", _train("roberta", 2, vocab_mode="expand")
    run = RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus, tokenizer=de_tokenizer)
    step = steps.AdaptEmbeddings(system="minijoint", source=sources["roberta"], lang="de", train=train)
    report = adapt.Step2Start.report
    monkeypatch.setattr(adapt.Step2Start, "report", sigterm_before(report, wait=2))  # while the source is scored
    with pytest.raises(Stopped, match="stopped by SIGTERM at update 2: checkpoint step00000002 is complete"):
        steps.adapt_embeddings(run=run, step=step)
    record, logged = json.loads((out / "run.json").read_text()), (out / "metrics.jsonl").read_text()
    assert "expand_report" not in record and record.get("finished_at") is None
    monkeypatch.setattr(adapt.Step2Start, "report", report)
    steps.adapt_embeddings(run=dataclasses.replace(run, resume=True), step=step)
    record = json.loads((out / "run.json").read_text())
    assert record["expand_report"]["source_loss_after"] > 0 and record["finished_at"]
    assert (out / "metrics.jsonl").read_text() == logged  # nothing trained again


def test_expand_from_a_raw_corpus_trains_the_target_tokenizer(sources, de_corpus, tmp_path):
    """`adapt --vocab_mode expand --corpus de.txt` without --tokenizer: a --vocab_size-piece German
    tokenizer trained on the corpus as replace mode trains one (data.train_tokenizer, the run's
    seed), merged into the source's."""
    from mmadapt.data import train_tokenizer

    source, out = sources["llama"], tmp_path / "a"
    train = _train("llama", 2, vocab_mode="expand")
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus),
                           step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de", train=train,
                                                      vocab_size=600))
    target = train_tokenizer(de_corpus, tmp_path / "t" / "de", 600, seed=train.seed)
    merged = expand(source / "tokenizer" / "spm.model", target)
    assert (out / "tokenizer" / "spm.model").read_bytes() == merged.model
    record = json.loads((out / "run.json").read_text())
    assert (record["model"]["vocab_size"], record["vocab_size"]) == (merged.size, 600)
    # A --resume reads the merged tokenizer it kept: another --vocab_size was ignored without a word
    # (the run went on with a vocabulary the user did not ask for); now refused, nothing changed
    with pytest.raises(ValueError, match=r"--resume of a changed run: vocab_size is 700 here but 600 in .*run.json"):
        steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus, resume=True),
                               step=steps.AdaptEmbeddings(system="minijoint", source=source, lang="de", train=train,
                                                          vocab_size=700))
    assert json.loads((out / "run.json").read_text()) == record


def test_rank_0_alone_trains_a_raw_corpus_target_tokenizer(sources, de_corpus, tmp_path, monkeypatch):
    """merged_vocabulary from a raw corpus: global rank 0 trains the target tokenizer and every rank
    takes its expansion (each rank trained one, every core of the host each); a training that fails
    on rank 0 is raised on every rank, none left waiting for it."""
    from conftest import store_ranks
    from mmadapt import expand as E
    from mmadapt.data import DataError
    from mmadapt.run import read_source

    source, run = read_source(sources["llama"]), RunSpec(output_dir=tmp_path / "a", corpus=de_corpus)
    trained = steps.train_tokenizer(de_corpus, tmp_path / "t" / "de", 600, seed=1)
    made, rank = expand(source.tokenizer, trained), store_ranks(monkeypatch)
    failed = DataError("de.txt holds no text")

    def fails(*a, **k):
        raise failed
    rank(0)
    monkeypatch.setattr(E, "train_tokenizer", lambda *a, **k: trained)
    made = dataclasses.replace(made, vocab_size=600)  # the size the target model was trained at, recorded
    assert E.merged_vocabulary(run, source, 600, 1, None) == (made.size, made.source_size, made)
    monkeypatch.setattr(E, "train_tokenizer", fails)
    with pytest.raises(DataError, match="de.txt holds no text"):
        E.merged_vocabulary(run, source, 600, 1, None)
    rank(1)
    monkeypatch.setattr(E, "train_tokenizer", lambda *a, **k: pytest.fail("a rank other than 0 trained a tokenizer"))
    assert E.merged_vocabulary(run, source, 600, 1, None) == (made.size, made.source_size, made)
    with pytest.raises(DataError, match="de.txt holds no text"):
        E.merged_vocabulary(run, source, 600, 1, None)


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_the_start_recomputed_for_an_older_run_is_the_saved_update_0(family, sources, expanded, tmp_path):
    """plugin.start_embeddings reads a run's artifact of update 0; for a run without one (recorded
    before ArtifactWriter.save_start) it recomputes the start with the run's recorded
    expand_output_start and start_rule, which gives the saved tensors bit for bit. A run recorded
    before that field started its output side as its input side (embedding_init): the encoder's
    new bias entries then differ from the bounded start's, the untied decoder's new output rows
    too; one recorded before the start rule drew its new rows at init_method_std."""
    from mmadapt.plugin import start_embeddings

    run = expanded[family].parent.parent
    saved = read_artifact(run / "embeddings" / "step00000000")[0]
    record = json.loads((run / "run.json").read_text())
    assert record["train"]["expand_output_start"] == "bounded" and record["expand_output_start"] == "bounded"
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text(json.dumps(record))  # no artifact of update 0: recomputed
    tokenizer = expanded[family] / "spm.model"
    again = start_embeddings(old, tokenizer)
    assert saved.keys() == again.keys()
    for key in saved:
        assert torch.equal(saved[key], again[key]), key
    del record["train"]["expand_output_start"]
    (old / "run.json").write_text(json.dumps(record))
    before = start_embeddings(old, tokenizer)
    moved = "output_bias" if family == "roberta" else "output_layer"
    assert torch.equal(before["word_embeddings"], saved["word_embeddings"])
    assert not torch.equal(before[moved][VOCAB:], saved[moved][VOCAB:])
    # recorded before the start rule (adapt.StartRule): new rows drawn at init_method_std, no prior
    del record["start_rule"]
    (old / "run.json").write_text(json.dumps(record))
    oldest = start_embeddings(old, tokenizer)["word_embeddings"][VOCAB:]
    std = json.loads((run / "run.json").read_text())["model"]["init_method_std"]
    assert oldest.std().item() == pytest.approx(std, rel=0.05)
    assert not torch.equal(oldest, saved["word_embeddings"][VOCAB:])


@pytest.mark.parametrize("family", ["roberta", "llama", "bert"])
def test_every_shipped_family_names_its_output_path(family):
    """ModelFamily.output_path names parameters of the family's one-head model (BERT's MLM head is
    RoBERTa's: it inherits roberta's path); a decoder's matrix follows its tie."""
    fam = get_family(family)
    for cfg, _ in fam.presets.values():
        ties = (True, False) if family == "llama" else (cfg.share_embeddings_and_output_weights,)
        for tie in ties:
            one = fam.primary_config(dataclasses.replace(cfg, share_embeddings_and_output_weights=tie))
            names = fam.param_names(one)
            path = fam.output_path(one)
            assert all(n in names for n in path if n is not None), path
            assert (path.matrix == fam.word) == (tie or path.bias is not None)


def test_a_sentencepiece_bpe_source_gets_only_pieces_its_merges_can_form(tmp_path):
    """A SentencePiece BPE source forms a piece only by merging two known ones: every appended
    piece must read as itself through the merged model (the check it was appended under), and
    German text uses nearly all of them (without the check 620 of 872 were rows no text reaches)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_model

    from mmadapt.corpora import bible_verses
    from mmadapt.expand import expand
    from mmadapt.tokens import BOS_ID, EOS_ID, PAD_ID

    texts = {}
    for lang, kind in (("en", "bpe"), ("de", "unigram")):
        texts[lang] = [t for *_, t in bible_verses(lang)][:3000]
        (tmp_path / f"{lang}.txt").write_text("\n".join(texts[lang]) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(tmp_path / f"{lang}.txt"), model_prefix=str(tmp_path / lang),
                                       vocab_size=800, model_type=kind, pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID,
                                       eos_id=EOS_ID, user_defined_symbols=["<mask>"], minloglevel=2, num_threads=1)
    e = expand(tmp_path / "en.model", tmp_path / "de.model")
    assert e.size % 8 == 0 and e.size > e.source_size
    proto = sp_model.ModelProto()
    proto.ParseFromString(e.model)
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    bare = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    for i in range(e.source_size, e.size):
        assert bare.encode(bare.id_to_piece(i).replace("▁", " ")) == [i], bare.id_to_piece(i)
    merged = spm.SentencePieceProcessor(model_proto=e.model)
    used = {i for t in texts["de"] for i in merged.encode(t)}
    assert len(used & set(range(e.source_size, e.size))) >= 0.9 * (e.size - e.source_size)
    # characters the English source lacks are appended (no merge forms a character: they were
    # dropped, and every piece built on them, so the merged model still read them as <unk>)
    source = spm.SentencePieceProcessor(model_file=str(tmp_path / "en.model"))
    for word in ("größer", "Brüder", "Männer"):
        assert source.unk_id() in source.encode(word) and merged.unk_id() not in merged.encode(word), word


def test_a_target_trained_without_the_sources_normaliser_gets_no_piece_it_rewrites(tokenizer, tmp_path):
    """The merged model keeps the source's normaliser (NFKC): a target trained without it (an
    identity normaliser, text with ligatures and full-width letters) had 'ﬁ', 'ｏ' and '▁Ｇｏｔｔ'
    appended, rows no text reaches (the normaliser reads them 'fi', 'o', '▁Gott')."""
    import unicodedata

    from mmadapt.corpora import bible_verses
    from mmadapt.tokens import BOS_ID, EOS_ID, PAD_ID

    text = [t.replace("fi", "\ufb01").replace("Gott", "Ｇｏｔｔ") for *_, t in bible_verses("de")][:3000]
    (tmp_path / "de.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "de.txt"), model_prefix=str(tmp_path / "de"), vocab_size=800,
                                   pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2, num_threads=1,
                                   user_defined_symbols=["<mask>"], normalization_rule_name="identity")
    assert {"ﬁ", "▁Ｇｏｔｔ"} <= set(pieces(tmp_path / "de.model"))
    e = expand(tokenizer, tmp_path / "de.model")
    assert e.new and all(unicodedata.normalize("NFKC", p) == p for p in e.new), [
        p for p in e.new if unicodedata.normalize("NFKC", p) != p]
    assert not {"ﬁ", "▁Ｇｏｔｔ"} & set(e.new)
    # a target trained on doubled spaces, kept: '▁▁die' is no text's piece where the source collapses them
    (tmp_path / "de2.txt").write_text("\n".join(t.replace(" ", "  ") for t in text) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "de2.txt"), model_prefix=str(tmp_path / "de2"),
                                   vocab_size=800, pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2,
                                   num_threads=1, user_defined_symbols=["<mask>"], remove_extra_whitespaces=False,
                                   allow_whitespace_only_pieces=True, split_by_whitespace=False)
    assert any("▁▁" in p for p in pieces(tmp_path / "de2.model"))
    e = expand(tokenizer, tmp_path / "de2.model")
    assert e.new and not [p for p in e.new if "▁▁" in p]


def test_a_resume_reads_the_source_checkpoint_it_started_from(sources, de_corpus, de_tokenizer, tmp_path):
    """A requeued Step 2 (--resume, no --source_tag) goes on over the source checkpoint its record
    names, though the source's pretraining has saved a newer one since (run.resumed_tag): the
    newest, the default, was refused as a changed run. A named --source_tag still must match."""
    from mmadapt import checkpoint
    from mmadapt.run import resumed_tag

    src = tmp_path / "src"
    shutil.copytree(sources["roberta"], src)
    ckpt, out = src / "checkpoints", tmp_path / "a"
    first = checkpoint.latest_tag(ckpt)
    run = RunSpec(output_dir=out, ds_config=ZERO0, corpus=de_corpus, tokenizer=de_tokenizer)
    step = steps.AdaptEmbeddings(system="minijoint", source=src, lang="de", train=_train("roberta", 2))
    steps.adapt_embeddings(run=run, step=step)
    newer = checkpoint.tag_for(ITERS + 1)  # the source's pretraining saved again
    shutil.copytree(ckpt / first, ckpt / newer)
    assert checkpoint.latest_tag(ckpt) == newer
    steps.adapt_embeddings(run=dataclasses.replace(run, resume=True), step=step)
    assert json.loads((out / "run.json").read_text())["frozen_from"]["tag"] == first
    with pytest.raises(ValueError, match="frozen_from.tag"):
        steps.adapt_embeddings(run=dataclasses.replace(run, resume=True), step=dataclasses.replace(step, source_tag=newer))
    # not a resume, a tag named, another source: as asked (None: the newest); Step 3 records "primary"
    assert resumed_tag(out, False, src, None) is None and resumed_tag(out, True, src, newer) == newer
    assert resumed_tag(out, True, sources["llama"], None) is None and resumed_tag(out, True, src, None) == first
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "run.json").write_text(json.dumps({"primary": {"run_dir": str(src.resolve()), "tag": first}}))
    assert resumed_tag(tmp_path / "ft", True, src, None, "primary") == first
    (tmp_path / "ft" / "run.json").write_text(json.dumps({"primary": "x"}))  # damaged: one line, no traceback
    with pytest.raises(ValueError, match=r"ft/run.json is damaged: its primary is 'x', not the record of the run"):
        resumed_tag(tmp_path / "ft", True, src, None, "primary")
    # the checkpoint it trained over, since pruned at the source (its --keep_last): said so
    shutil.rmtree(ckpt / first)
    with pytest.raises(ValueError, match=f"checkpoint {first}, which .* no longer holds"):
        steps.adapt_embeddings(run=dataclasses.replace(run, resume=True), step=step)


def test_the_replay_says_the_fraction_it_trains(capsys):
    """adapt.say_replay: whole blocks of each update, so the fraction trained is said where
    --replay_fraction rounds to another."""
    from mmadapt.adapt import say_replay

    say_replay(Replay(Path("en"), 0.3), 16)
    say_replay(Replay(Path("en"), 0.25), 16)
    say_replay(Replay(Path("en"), 0.57), 100)  # 0.57 x 100 is 56.99999999999999 in floating point
    assert capsys.readouterr().out.splitlines() == [
        "replay: 5 of every update's 16 blocks are source-language text from en, a fraction of 0.3125 "
        "(--replay_fraction 0.3 rounded)",
        "replay: 4 of every update's 16 blocks are source-language text from en, a fraction of 0.25",
        "replay: 57 of every update's 100 blocks are source-language text from en, a fraction of 0.57"]


def test_rank_0_chooses_the_source_checkpoint_for_every_rank(sources, de_corpus, de_tokenizer, tmp_path, monkeypatch):
    """A step of a launched job reads the source checkpoint global rank 0 chose (run.agreed_source):
    a rank whose own listing holds a newer one (the source's pretraining completed it a moment
    after rank 0 looked, or a node's cached view of a shared file system) reads rank 0's, where it
    took its own newest (replicas over different frozen weights); Step 2's plan takes it so
    (adapt._source); a refusal on rank 0 is raised on every rank."""
    from mmadapt import adapt, checkpoint, parallel
    from mmadapt.run import agreed_source

    src = tmp_path / "src"
    shutil.copytree(sources["roberta"], src)
    ckpt = src / "checkpoints"
    first, newer = checkpoint.latest_tag(ckpt), checkpoint.tag_for(ITERS + 1)
    shutil.copytree(ckpt / first, ckpt / newer)
    sent = []

    def rank(r: int, rank0_sends=None):  # rank0_sends: rank 0's (kind, value) (parallel.rank0_decides)
        monkeypatch.setattr(parallel, "_joined_with_others", lambda: True)
        monkeypatch.setattr(parallel, "is_rank0", lambda: r == 0)
        monkeypatch.setattr(parallel, "object_from_rank0", lambda value: sent.append(
            value and parallel.pickle.loads(value)) or (value if r == 0 else parallel._pickled(rank0_sends)))
    rank(0)
    assert agreed_source(src).tag == newer and sent == [("value", newer)]
    rank(1, rank0_sends=("value", first))  # rank 0 listed the checkpoints before `newer` was complete
    assert agreed_source(src).tag == first and sent[-1] is None
    run = RunSpec(output_dir=tmp_path / "a", ds_config=ZERO0, tokenizer=de_tokenizer, corpus=de_corpus)
    step = steps.AdaptEmbeddings(system="minijoint", source=src, lang="de", train=_train("roberta", 2))
    assert adapt._source(run, step)[0].tag == first
    refused = ValueError(f"{src} has no complete checkpoint yet: let its run save one first")
    rank(1, rank0_sends=("raised", refused))
    with pytest.raises(ValueError, match="no complete checkpoint yet"):
        agreed_source(src)
    rank(0)  # rank 0 sends its refusal and raises it
    with pytest.raises(ValueError, match="has no complete checkpoint step00999999"):
        agreed_source(src, lambda: "step00999999")
    assert sent[-1][0] == "raised" and isinstance(sent[-1][1], ValueError)
