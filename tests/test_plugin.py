"""The plug-in MLM metric (plugin.py): the primary head of the primary model, the unigram
reference counted by hand, and the records against hand-computed values."""

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import PRIMARY_ITERS, VOCAB, count_calls
from mmadapt.artifact import write_artifact
from mmadapt import heldout as H
from mmadapt import plugin as P
from mmadapt.adapt import progress_line
from mmadapt.checkpoint import tag_for
from mmadapt.config import PreprocessConfig
from mmadapt.data import DataError, prepare
from mmadapt.family import WORD
from mmadapt.models.roberta.model import BIAS
from mmadapt.run import load_weights
from evaluation import plugin_loss
from mmadapt.models.roberta import ROBERTA


def test_primary_head_loss_is_the_models_own(primary_run, english):
    """With the primary's own embeddings and bias 'swapped in', the metric is the 12-layer
    MINIJOINT model's primary-head loss (its second head, after layer 12), token-weighted."""
    from mmadapt.models.roberta.model import RobertaMLM

    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    assert len(batches) == 4
    cfg, state = load_weights(primary_run)
    assert cfg.heads_after == (4, 12)
    model = RobertaMLM(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        per_batch = [(float(model(ids, lab)[1][1]), int(lab.ge(0).sum())) for ids, lab in batches]
    expected = sum(l * n for l, n in per_batch) / sum(n for _, n in per_batch)
    one_head, head_state = H.primary_head_state(primary_run)
    assert one_head.heads_after == (12,)
    assert torch.equal(head_state[BIAS], state["heads.heads.1.bias"])
    assert plugin_loss(ROBERTA, one_head, head_state, batches) == pytest.approx(expected, abs=1e-5)


def test_unigram_reference_by_hand(english):
    """The reference's distribution is over the pieces the metric can score: a masked position is
    never a special piece (</s>, one a sentence, took 3-4% of the mass when every piece was
    counted, and every contextual gain read about 0.035 nats high)."""
    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    tokens = np.fromfile(english / "text.bin", dtype=json.loads((english / "manifest.json").read_text())["dtype"])
    counts = np.bincount(tokens.astype(np.int64), minlength=VOCAB) + 1.0
    labels = torch.cat([l[l.ge(0)] for _, l in batches]).numpy()
    every = -np.mean(np.log(counts[labels] / counts.sum()))
    assert H.unigram_loss(H.unigram_logprobs(english, VOCAB), batches) == pytest.approx(every, rel=1e-6)
    scorable = counts.copy()
    scorable[:5] = 0.0
    expected = -np.mean(np.log(scorable[labels] / scorable.sum()))
    assert H.unigram_loss(H.reference_logprobs(english, VOCAB), batches) == pytest.approx(expected, rel=1e-6)
    assert every - expected == pytest.approx(-np.log1p(-counts[:5].sum() / counts.sum()), rel=1e-6)
    assert every - expected > 0.02  # the share of the special pieces, </s> above all
    assert torch.isinf(H.reference_logprobs(english, VOCAB)[:5]).all()
    # Causal: mmadapt's packed stream scores its </s>; an imported decoder's sentence rows do not.
    from mmadapt.objectives import CAUSAL

    packed, rows = H.reference_logprobs(english, VOCAB, CAUSAL), H.reference_logprobs(english, VOCAB, CAUSAL, [])
    assert torch.allclose(packed.exp(), torch.from_numpy(counts / counts.sum()).float())
    assert torch.isinf(rows[3]) and torch.isfinite(rows[:3]).all() and float(rows.exp().sum()) == pytest.approx(1.0)
    # The same masked positions every time (a fixed seed), none of them special pieces.
    again = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert int(torch.cat([l[l.ge(0)] for _, l in batches]).min()) >= 5


def test_the_fitted_bias_target_by_hand(english):
    """target_logprobs, what an output bias is fitted to (Step 2's fitted start, its calibration,
    fit-head's start): the reference's counts (no special piece where a masked position is scored;
    no </s> in an imported decoder's sentence rows) add-one smoothed over every piece, so finite
    everywhere, a piece no position is at one count; on the held-out positions its loss is within
    1e-3 nats of the reference's, where every piece's frequencies (the fit before 2026-12-02) are
    the special pieces' share (over 0.02 nats) above it."""
    from mmadapt.objectives import CAUSAL

    tokens = np.fromfile(english / "text.bin", dtype=json.loads((english / "manifest.json").read_text())["dtype"])
    raw = np.bincount(tokens.astype(np.int64), minlength=VOCAB).astype(np.float64)
    masked = raw.copy()
    masked[:5] = 0.0
    masked += 1.0
    target = H.target_logprobs(english, VOCAB)
    assert torch.allclose(target, torch.from_numpy(np.log(masked / masked.sum())).float())
    assert torch.isfinite(target).all() and torch.allclose(target[:5], target[:5].min().expand(5))
    rows = raw.copy()
    rows[3] = 0.0
    rows += 1.0
    assert torch.allclose(H.target_logprobs(english, VOCAB, CAUSAL, []), torch.from_numpy(np.log(rows / rows.sum()))
                          .float())
    assert torch.allclose(H.target_logprobs(english, VOCAB, CAUSAL), H.unigram_logprobs(english, VOCAB))  # packed
    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    reference = H.unigram_loss(H.reference_logprobs(english, VOCAB), batches)
    assert abs(H.unigram_loss(target, batches) - reference) < 1e-3
    assert H.unigram_loss(H.unigram_logprobs(english, VOCAB), batches) - reference > 0.02


def _copying_loss(batches: list, logp: torch.Tensor, keep: float = 0.2) -> float:
    """Loss per scored piece of a model that predicts its input piece: probability `keep` on the
    piece at that position of the input, the rest spread by the unigram distribution."""
    total, count = 0.0, 0
    for ids, labels in batches:
        scored = labels.ge(0)
        target, seen = labels[scored], ids[scored]
        p = (1 - keep) * logp[target].exp() + keep * seen.eq(target).float()
        total += float(-p.log().sum())
        count += len(target)
    return total / count


def test_every_scored_piece_is_hidden(english):
    """Each position the metric scores has <mask> as its input, at the positions pretraining's
    masking selects; so a model that copies its input piece gains nothing over the unigram
    reference. Scored under BERT's 80/10/10 (the pieces left visible), the same copying model
    would beat the reference: the test can tell the two apart."""
    from mmadapt.config import TrainConfig
    from mmadapt.data import VALID
    from mmadapt.objectives import MLM
    from mmadapt.tokens import MASK_ID

    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    logp = H.unigram_logprobs(english, VOCAB)
    assert all(bool(ids[labels.ge(0)].eq(MASK_ID).all()) for ids, labels in batches)
    train_rule = MLM.batches(english, TrainConfig(seq_length=32, seed=0, train_micro_batch_size_per_gpu=16),
                                   VOCAB, split=VALID)
    visible = [train_rule.micro_batch(k, 0) for k in range(len(batches))]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, visible))  # the same positions, the same targets
    unigram = H.unigram_loss(logp, batches)
    assert _copying_loss(batches, logp) > unigram
    assert _copying_loss(visible, logp) < unigram - 0.1


def test_every_block_asked_for_is_scored_the_last_batch_smaller(english):
    """--plugin_blocks 40 in batches of 16: 16, 16 and 8 blocks, those of 48 blocks' batches cut
    at 40 (the last 8 were dropped: which blocks a metric scores hung on the batch size)."""
    got = H.heldout_batches(H.Text(english, 32, 40, 16), VOCAB)
    whole = H.heldout_batches(H.Text(english, 32, 48, 16), VOCAB)
    assert [ids.shape[0] for ids, _ in got] == [16, 16, 8]
    assert all(torch.equal(a, b[:len(a)]) for x, y in zip(got, whole) for a, b in zip(x, y))


def test_a_source_text_the_primary_trained_on_is_told_apart_from_held_out_text(tokenizer, tmp_path):
    """heldout.pretrained_on, by hand on prepared datasets of two corpora: the primary pretrained
    on `whole` (English prepared with no split, as the demo prepares it) or on `own` (a split
    of its own). Another preparation's validation split of its corpus is text it trained on;
    its own validation split and another corpus are held out; training text always is seen; an
    imported model cannot tell, a head fit answers for the body it was fitted over."""
    from mmadapt.config import PreprocessConfig
    from mmadapt.data import TEXT, prepare

    lines = [f"Verse {i} of the first book, and it goes on." for i in range(200)]
    one, other = tmp_path / "one.txt", tmp_path / "other.txt"
    one.write_text("\n\n".join(lines) + "\n")
    other.write_text("\n\n".join(f"{l} Again." for l in lines) + "\n")

    def prep(corpus, name, fraction):
        prepare(corpus, tmp_path / name, VOCAB, tokenizer=tokenizer, quiet=True,
                cfg=PreprocessConfig(workers=1, valid_fraction=fraction))
        return tmp_path / name

    whole, own, split, elsewhere = prep(one, "whole", 0.0), prep(one, "own", 0.2), prep(one, "split", 0.3), \
        prep(other, "other", 0.2)
    text = {name: H.Text(path, 32) for name, path in (("own", own), ("split", split), ("other", elsewhere))}
    for pretrained, seen in ((whole, {"own": True, "split": True, "other": False}),
                             (own, {"own": False, "split": True, "other": False})):
        record = {"data_path": str(pretrained)}
        assert {k: H.pretrained_on(t, record) for k, t in text.items()} == seen
        assert H.pretrained_on(H.Text(elsewhere, 32, split=TEXT), record)  # training text
    # a manifest from before the seed was recorded: the seed it ran with, prepare's default
    old = tmp_path / "own-old"
    shutil.copytree(own, old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest.pop("valid_seed") == PreprocessConfig.tokenizer_seed
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert H.pretrained_on(H.Text(old, 32), {"data_path": str(own)}) is False
    assert H.pretrained_on(text["other"], {"imported_from": {"model": "x"}}) is None
    assert H.pretrained_on(text["own"], {}) is None
    body = tmp_path / "body"
    body.mkdir()
    (body / "run.json").write_text(json.dumps({"data_path": str(whole)}))
    head_fit = {"data_path": str(elsewhere), "frozen_from": {"run_dir": str(body)}}
    assert H.pretrained_on(text["own"], head_fit) and not H.pretrained_on(text["other"], head_fit)


def test_records_of_a_source_language_artifact(primary_run, english, tokenizer, tmp_path):
    """An 'artifact' holding the primary's own English embeddings: its gain is unigram - the
    model's loss, its start is the overlap init (every piece shared: the same embeddings)."""
    cfg, state = load_weights(primary_run)
    run = tmp_path / "adapt"
    meta = {"system": "minijoint", "lang": "en", "step": 5, "flops": 1.0, "flops_paper": 1.0, "v100_days": 0.0,
            "tokens": 1, "source": str(primary_run), "source_tag": tag_for(PRIMARY_ITERS)}
    art = write_artifact(run / "embeddings" / "step00000005",
                           {"word_embeddings": state[WORD], "output_bias": state["heads.heads.0.bias"]}, tokenizer, meta)
    (run / "run.json").write_text(json.dumps({"system": "minijoint", "lang": "en", "model": {"init_method_std": 0.02},
                                              "train": {"seed": 1}, "frozen_from": {"run_dir": str(primary_run),
                                                                                    "tag": tag_for(PRIMARY_ITERS)}}))
    [rec] = P.plugin_records(primary_run, [run], {"en": english}, 32, blocks=64, batch_size=16)
    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    one, head = H.primary_head_state(primary_run)
    own = plugin_loss(ROBERTA, one, {**head, BIAS: state["heads.heads.0.bias"]}, batches)
    assert rec["loss"] == pytest.approx(own, abs=1e-6)
    assert rec["score"] == pytest.approx(rec["unigram_loss"] - own)
    assert rec["unigram_loss"] == pytest.approx(H.unigram_loss(H.reference_logprobs(english, VOCAB), batches))
    # The overlap init copies every shared piece's row and bias: all pieces are shared here.
    assert rec["start_loss"] == pytest.approx(own, abs=1e-6)
    assert rec["system"] == "minijoint" and rec["artifact"] == str(art) and math.isfinite(rec["score"])
    # In bits per byte: near no adaptation (the model's own tokenizer and embeddings; only the
    # bias is head 0's here: test_bpb.py has the exact identity); on English text the primary
    # predicts better than a uniform model of its bytes (8 bits).
    assert abs(rec["bpb"] - rec["none_bpb"]) < 0.01 and rec["start_bpb"] == pytest.approx(rec["bpb"])
    assert 0 < rec["bpb"] < 8 and rec["bpb_bytes"] > 0.9 * 8192 and "source_bpb" not in rec
    # Two runs of one system and language stay two (evaluate.apart_runs, as task records): they
    # were one row of the report, its start and last from either run.
    shutil.copytree(run, tmp_path / "adapt-2")
    two = P.plugin_records(primary_run, [run, tmp_path / "adapt-2"], {"en": english}, 32, blocks=64, batch_size=16)
    assert sorted(r["system"] for r in two) == ["minijoint [adapt-2]", "minijoint [adapt]"]
    # Refused in one line, before the primary's weights are read (a 7B model's take minutes): no
    # held-out text of the artifact's language, and an artifact whose tokenizer is not the
    # dataset's (its ids would be scored as another vocabulary's).
    with pytest.MonkeyPatch.context() as m:
        m.setattr(H.Primary, "read", lambda *a, **k: pytest.fail("the primary's weights read before the refusal"))
        with pytest.raises(ValueError, match="^no held-out en text: pass a prepared en dataset with a validation "
                                             "split$"):
            P.plugin_records(primary_run, [run], {"de": english}, 32, blocks=64, batch_size=16)
        (art / "spm.model").write_bytes(b"another tokenizer")
        with pytest.raises(ValueError, match=f"^{art} uses another tokenizer than {english}: score it on the dataset"):
            P.plugin_records(primary_run, [run], {"en": english}, 32, blocks=64, batch_size=16)
    # A corpus gone since its dataset was prepared is refused before anything is scored (the
    # bits-per-byte text was read after the language's held-out blocks, and after every language before it).
    (art / "spm.model").write_bytes((english / "tokenizer.model").read_bytes())
    gone = tmp_path / "gone"
    shutil.copytree(english, gone)
    manifest = json.loads((gone / "manifest.json").read_text())
    (gone / "manifest.json").write_text(json.dumps({**manifest, "corpus": str(tmp_path / "no-such-corpus.txt")}))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(H.Scorer, "heldout", lambda *a, **k: pytest.fail("scored before the refusal"))
        with pytest.raises(DataError, match="no-such-corpus.txt is gone"):
            P.plugin_records(primary_run, [run], {"en": gone}, 32, blocks=64, batch_size=16)


def test_artifacts_are_scored_through_the_primary_checkpoint_they_were_trained_for(primary_run, english, tokenizer,
                                                                                    tmp_path):
    """A primary run that trained on after Step 2 read it (or `adapt --source_tag` an older
    checkpoint): plugin_records reads the checkpoint the artifacts name (meta source_tag), not
    the newest, whose weights differ: they were refused (every `sweep --source_tag` trained all its
    depths, then scored none). predict.load and export-hf swap such an artifact into that
    checkpoint by default. Artifacts trained for two checkpoints of one run are refused in one line."""
    from mmadapt import predict
    from mmadapt.artifact import SAMPLED_KEY
    from mmadapt.checkpoint import write_weights_only
    from mmadapt.hf import export_hf

    source, old = tmp_path / "source", tag_for(PRIMARY_ITERS)
    shutil.copytree(primary_run, source)
    primary = H.Primary.read(source)
    cfg, state = load_weights(source)
    newer = write_weights_only(source / "checkpoints", PRIMARY_ITERS + 10, {k: v + 0.01 for k, v in state.items()},
                               json.loads((source / "run.json").read_text())["model"])
    run = tmp_path / "adapt"
    meta = {"system": "minijoint", "lang": "en", "step": 5, "flops": 1.0, "flops_paper": 1.0, "v100_days": 0.0,
            "tokens": 1, "source": str(source), "source_tag": old, "primary_fingerprint": primary.fingerprint,
            SAMPLED_KEY: primary.sampled}
    art = write_artifact(run / "embeddings" / "step00000005",
                         {"word_embeddings": state[WORD], "output_bias": state["heads.heads.0.bias"]}, tokenizer, meta)
    (run / "run.json").write_text(json.dumps({"system": "minijoint", "lang": "en", "model": {"init_method_std": 0.02},
                                              "train": {"seed": 1}, "frozen_from": {"run_dir": str(source),
                                                                                    "tag": old}}))
    [rec] = P.plugin_records(source, [run], {"en": english}, 32, blocks=64, batch_size=16)
    batches = H.heldout_batches(H.Text(english, 32, 64, 16), VOCAB)
    one, head = H.primary_head_state(primary_run)
    assert rec["loss"] == pytest.approx(plugin_loss(ROBERTA, one, {**head, BIAS: state["heads.heads.0.bias"]},
                                                    batches), abs=1e-6)
    model = predict.load(source, art, device="cpu")
    body = {k: v for k, v in model.model.state_dict().items() if k in state and not k.startswith("heads.")}
    assert len(body) > 10 and all(torch.equal(v, state[k]) for k, v in body.items())
    # named by its adapt run (its last artifact, as every reader takes it), predict and export-hf
    # read that checkpoint too (they read the newest, and refused it as the primary's changed weights)
    by_run = predict.load(source, run, device="cpu").model.state_dict()
    assert all(torch.equal(by_run[k], v) for k, v in body.items())
    export_hf(tmp_path / "export", primary=source, embeddings=run)
    # an explicit tag is kept: the newer checkpoint is refused as the primary's changed weights
    with pytest.raises(ValueError, match="its checkpoint " + old):
        predict.load(source, art, tag=newer, device="cpu")
    # two artifacts for two checkpoints of the run
    other = tmp_path / "adapt-newer"
    shutil.copytree(run, other)
    meta_file = next((other / "embeddings").iterdir()) / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "source_tag": newer}))
    with pytest.raises(ValueError, match=f"^the embeddings were trained for checkpoints {old}, {newer} of "):
        P.plugin_records(source, [run, other], {"en": english}, 32, blocks=64, batch_size=16)
    # the checkpoint gone (pruned): the newest is read, and its weights are refused as changed
    shutil.rmtree(source / "checkpoints" / old)
    with pytest.raises(ValueError, match=f"as its weights were when Step 2 ran \\(its checkpoint {old}\\), and they "
                                         "have changed since"):
        P.plugin_records(source, [run], {"en": english}, 32, blocks=64, batch_size=16)


def test_step2_logs_the_plugin_metric_at_each_checkpoint(primary_run, de_corpus, de_tokenizer, tmp_path, capsys,
                                                         monkeypatch):
    """TrainConfig.plugin_eval_blocks: every artifact carries its plug-in score, the same as
    plugin_records gives it afterwards on the same held-out blocks, and the log says whether it
    has passed the unigram reference. plugin_records scores the run's start once: it is the
    update-0 artifact."""
    from conftest import REPO
    from mmadapt import steps
    from mmadapt.models import PRESETS
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    german = tmp_path / "de"
    prepare(de_corpus, german, VOCAB, tokenizer=de_tokenizer, quiet=True,
            cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    train = dataclasses.replace(PRESETS["tiny"][1], train_iters=4, save_interval=2, log_interval=2, seq_length=32,
                                plugin_eval_blocks=32)
    run = tmp_path / "adapt"
    steps.adapt_embeddings(run=RunSpec(output_dir=run, ds_config=REPO / "ds_configs" / "zero0.json", data_path=german),
                           step=steps.AdaptEmbeddings(system="minijoint", source=primary_run, lang="de", train=train))
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plug-in metric at update")]
    calls = {}
    count_calls(monkeypatch, H.Scorer, "loss", calls)
    count_calls(monkeypatch, P.ByteScorer, "score", calls)
    records = P.plugin_records(primary_run, [run], {"de": german}, seq_length=32, blocks=32)
    # Three artifacts, the first the start: three losses, three bits per byte and no adaptation's.
    assert calls == {"loss": 3, "score": 4}
    # The start (update 0) too, logged before the first update: every record's start is its loss.
    assert [r["step"] for r in records] == [0, 2, 4] and len(logged) == 3
    assert records[0]["flops"] == 0.0 and all(r["start_loss"] == records[0]["loss"] for r in records)
    for r, line in zip(records, logged):
        meta = json.loads((run / "embeddings" / f"step{r['step']:08d}" / "meta.json").read_text())
        assert meta["plugin_gain"] == pytest.approx(r["score"], abs=1e-6)
        assert meta["unigram_loss"] == pytest.approx(r["unigram_loss"], abs=1e-9)
        assert line == progress_line(r["step"], {k: meta[k] for k in ("plugin_gain", "plugin_loss", "unigram_loss")})
        # Up to four updates from the overlap start: still below the unigram reference, and it says so.
        assert r["score"] < 0 and line.endswith("not past the unigram reference yet: piece frequencies alone still "
                                                "predict better")
    assert progress_line(9, {"plugin_gain": 0.1, "plugin_loss": 5.9, "unigram_loss": 6.0}).endswith(
        "past the unigram reference: the embeddings use the model's context")
