"""The decoder family through every step, in one process: next-token blocks, MINIJOINT
pretraining, MINIPOST, Step 2 over both mini-models (only the embedding trains), fine-tuning
with the last-token classifier, zero-shot evaluation and the plug-in next-token metric."""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import REPO, VOCAB, metrics
from mmadapt import faults, microbatch, steps
from mmadapt import train as train_module
from mmadapt.artifact import read_artifact
from mmadapt.config import FinetuneConfig, Layout, MiniModelConfig, PreprocessConfig, TrainConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.data import CausalBatches, read_manifest
from evaluation import evaluate_scores
from mmadapt.evaluate import load_finetuned, recorded_config
from mmadapt.family import WORD
from mmadapt.models.llama import LLAMA
from mmadapt.parallel import init_parallel
from mmadapt.models.llama.flops import adapt_flops
from mmadapt.run import RunSpec, load_weights, read_run, run_model
from mmadapt.tasks import read_examples
from mmadapt.tokens import IGNORE_INDEX

ZERO0 = REPO / "ds_configs" / "zero0.json"


def _train(iters, **changes):
    return dataclasses.replace(PRESETS["llama-tiny"][1], train_iters=iters, save_interval=iters, log_interval=1,
                               seq_length=32, train_micro_batch_size_per_gpu=4, **changes)


@pytest.fixture(scope="module")
def german(de_corpus, de_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_de") / "de"
    steps.preprocess(de_corpus, output_dir=out, vocab_size=VOCAB, tokenizer=de_tokenizer,
                     cfg=PreprocessConfig(workers=1, valid_fraction=0.1))
    return out


@pytest.fixture(scope="module")
def decoder_runs(corpus, tokenizer, german, tmp_path_factory):
    """A 4-layer decoder MINIJOINT (heads after 2 and 4), its MINIPOST (1 + 1) and German
    embeddings over both mini-models."""
    init_parallel(1, 1)
    root = tmp_path_factory.mktemp("llama_runs")
    model = apply_recipe(dataclasses.replace(PRESETS["llama-tiny"][0], vocab_size=VOCAB, num_layers=4), "minijoint", 2)
    steps.pretrain(run=RunSpec(output_dir=root / "mj", ds_config=ZERO0, corpus=corpus, tokenizer=tokenizer),
                   step=steps.Pretrain(model=model, train=_train(6), recipe="minijoint"))
    steps.build_minipost(run=RunSpec(output_dir=root / "post", ds_config=ZERO0),
                         step=steps.BuildMinipost(primary=root / "mj", train=_train(2), mini=MiniModelConfig(1, 1)))
    for system, source in (("minijoint", root / "mj"), ("minipost", root / "post")):
        steps.adapt_embeddings(run=RunSpec(output_dir=root / f"{system}-de", ds_config=ZERO0, data_path=german),
                               step=steps.AdaptEmbeddings(system=system, source=source, lang="de", train=_train(4)))
    return root


def test_next_token_blocks_are_the_stream_shifted_by_one(german):
    data = CausalBatches(german, TrainConfig(seq_length=32, seed=3, train_micro_batch_size_per_gpu=4), VOCAB)
    stream = np.memmap(german / "text.bin", dtype=read_manifest(german)["dtype"], mode="r")
    assert len(data) == (len(stream) - 1) // 32
    ids, labels = data.micro_batch(0, 0)
    for row, g in enumerate(range(4)):
        start = data.order(g) * 32
        assert ids[row].tolist() == stream[start:start + 32].tolist()
        assert labels[row].tolist() == stream[start + 1:start + 33].tolist()  # every position scored
    assert not (labels == IGNORE_INDEX).any()


def test_decoder_step2_trains_only_the_embedding(decoder_runs):
    for system, depth in (("minijoint", 2), ("minipost", 2)):
        run = read_run(decoder_runs / f"{system}-de")
        assert run["model"]["family"] == "llama" and run["trainable"] == [WORD]
        tensors, _, meta = read_artifact(decoder_runs / f"{system}-de" / "embeddings" / "step00000004")
        assert sorted(tensors) == ["word_embeddings"] and meta["body_layers"] == depth
    # MINIPOST: its bottom layer is the primary's, frozen; its new one trained from its seeded start
    # (Step 1b's: the primary's layer 1 is no start of it, it differs untrained).
    (mj_cfg, mj), (cfg, post) = load_weights(decoder_runs / "mj"), load_weights(decoder_runs / "post")
    assert cfg.family == "llama" and cfg.num_layers == 2
    assert torch.equal(post["layers.0.fc1.weight"], mj["layers.0.fc1.weight"])
    built, init = LLAMA.minipost_start(mj_cfg, mj, 1, 1)
    start = {**LLAMA.build_lm(built, seed=read_run(decoder_runs / "post")["train"]["seed"]).state_dict(), **init}
    new = [n for n in post if n.startswith("layers.1.") and "norm" not in n]
    assert new and all(not torch.equal(post[n], start[n]) for n in new), "a new layer's weight did not train"


def test_decoder_plugin_metric_scores_next_pieces(decoder_runs, german):
    records = steps.evaluate_plugin(decoder_runs / "mj", embeddings=[decoder_runs / "minijoint-de",
                                                                      decoder_runs / "minipost-de"],
                                    data=str(german), seq_length=32, blocks=32)
    # Each run's start (update 0, the loss every record's start_loss is) and its last checkpoint.
    assert [(r["system"], r["step"]) for r in records] == [("minijoint", 0), ("minijoint", 4), ("minipost", 0),
                                                            ("minipost", 4)]
    assert records[1]["start_loss"] == records[0]["loss"] and records[3]["start_loss"] == records[2]["loss"]
    for r in records:
        assert r["task"] == "plugin-lm" and r["score"] == pytest.approx(r["unigram_loss"] - r["loss"])
        assert r["masked_pieces"] == 32 * 32  # every position of 32 blocks of 32


def _every_position(self, g):
    """CausalBatches.sample as it was before TrainConfig.score_fraction (b6a0d5d): every position."""
    start = self.order(g) * self.seq_length
    chunk = self.tokens[start:start + self.seq_length + 1].astype(np.int64)
    return chunk[:-1], chunk[1:]


def _step2(decoder_runs, german, out, **changes):
    """decoder_runs' minijoint-de (p = 1) again into `out`, with `changes` -> (losses, artifact)."""
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=german),
                           step=steps.AdaptEmbeddings(system="minijoint", source=decoder_runs / "mj", lang="de",
                                                      train=_train(4, **changes)))
    return _result(out)


def _result(out):
    return [(r["step"], r["loss"]) for r in metrics(out)], read_artifact(out / "embeddings" / "step00000004")


def test_step2_at_score_fraction_1_is_the_code_before_it(decoder_runs, german, tmp_path, monkeypatch):
    """p = 1, the default, trains bit for bit as scoring every position did: the same Step 2 run
    on the batches of the sampler before score_fraction existed gives the same losses and embeddings."""
    new = _result(decoder_runs / "minijoint-de")
    monkeypatch.setattr(CausalBatches, "sample", _every_position)
    old = _step2(decoder_runs, german, tmp_path / "before")
    assert [s for s, _ in new[0]] == [1, 2, 3, 4] and new[0] == old[0]
    assert torch.equal(new[1][0]["word_embeddings"], old[1][0]["word_embeddings"])
    assert new[1][2]["flops"] == old[1][2]["flops"] and "score_fraction" not in new[1][2]


def test_step2_scoring_a_fraction_of_the_positions(decoder_runs, german, tmp_path):
    """p = 0.25: a quarter of the FLOPs of the output layer (the record and the artifact count
    the scored rows), other losses and embeddings, and the plug-in metric still over every
    position, its records named apart (`minijoint p=0.25`)."""
    full, (emb, _, meta) = _result(decoder_runs / "minijoint-de")
    part, (emb_p, _, meta_p) = _step2(decoder_runs, german, tmp_path / "p025", score_fraction=0.25)
    mini = run_model(read_run(tmp_path / "p025"))
    assert meta_p["score_fraction"] == 0.25 and meta_p["flops"] == 4 * 4 * adapt_flops(mini, 32, p=0.25)
    assert meta["flops"] == 4 * 4 * adapt_flops(mini, 32)
    head = 3 * 2 * 4 * 4 * 24 * mini.hidden_size * mini.vocab_size  # the 24 unscored rows of each block
    assert meta["flops"] - meta_p["flops"] == head
    assert [l for _, l in part] != [l for _, l in full] and not torch.equal(emb_p["word_embeddings"],
                                                                         emb["word_embeddings"])
    runs = [tmp_path / "p025", decoder_runs / "minijoint-de"]
    records = steps.evaluate_plugin(decoder_runs / "mj", embeddings=runs, data=str(german), seq_length=32, blocks=32)
    # Each run's artifacts: its start (update 0) and its last checkpoint.
    assert [(r["system"], r["step"]) for r in records] == [("minijoint p=0.25", 0), ("minijoint p=0.25", 4),
                                                           ("minijoint", 0), ("minijoint", 4)]
    assert [r["masked_pieces"] for r in records] == [32 * 32] * 4 and \
        len({r["unigram_loss"] for r in records}) == 1


# A device with room for 4 blocks and not 8 under the default fill 0.8: 10 GiB resident, a peak
# of 12 for a micro-batch of 2 blocks (1 GiB a block), 18 GiB available (10 + 4 <= 14.4 < 10 + 8).
ROOM = microbatch.Memory(allocated=lambda: 10 * microbatch.GIB, peak=lambda: 12 * microbatch.GIB,
                         reset_peak=lambda: None, available=lambda: 18 * microbatch.GIB)
ASKED = dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)


TIGHT = dataclasses.replace(ROOM, available=lambda: 15 * microbatch.GIB)  # 0.8 of it holds no 2 x 2 blocks


def _fitted(monkeypatch, fail_at: int | None = None, memory=ROOM) -> list:
    """Fake `memory` for every device and spy on each update: -> its micro-batches' sizes,
    DeepSpeed's accumulation and global batch, one entry per update (appended as they run).
    fail_at: raise at that update (1-based, counted across the test), as running out of memory would."""
    monkeypatch.setattr(train_module, "device_memory", lambda device: memory)
    seen, lm_step = [], train_module.lm_step

    def spy(engine, batches, num_heads, *rest):
        seen.append(([len(b[0]) for b in batches], engine.gradient_accumulation_steps(), engine.train_batch_size()))
        if len(seen) == fail_at:
            raise RuntimeError("CUDA out of memory (the test's)")
        return lm_step(engine, batches, num_heads, *rest)
    monkeypatch.setattr(train_module, "lm_step", spy)
    return seen


def test_micro_batch_fit_trains_the_same_updates(decoder_runs, german, tmp_path, monkeypatch):
    """micro_batch_fill on a device with room (ROOM, faked): Step 2 asked for as micro 2 x 4 runs
    its first two updates so, then micro 4 x 2 from update 3 on, the global batch and the blocks
    the same. Every block of the decoder scores all its positions, so the mean of the
    micro-batches' means is the update's mean either way: the losses and embeddings equal those
    of the run as asked (on this CPU, where nothing is fitted) to rounding. run.json holds the
    re-split, its estimate (10 + 4 GiB) and the first merged update's peak, confirmed."""
    train = dataclasses.replace(_train(4), **ASKED)
    given = _step2_with(decoder_runs, german, tmp_path / "given", train)
    seen = _fitted(monkeypatch)
    fitted = _step2_with(decoder_runs, german, tmp_path / "fitted", train)

    assert seen == [([2] * 4, 4, 8)] * 2 + [([4] * 2, 2, 8)] * 2
    assert read_run(tmp_path / "fitted")["micro_batch_fit"] == {
        "asked": [2, 4], "merged": 2, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "from_update": 3, "estimate_bytes": 14 * microbatch.GIB, "tried": True, "confirmed": True,
        "peak_bytes": 12 * microbatch.GIB}
    assert "micro_batch_fit" not in read_run(tmp_path / "given")
    assert fitted[0][:2] == given[0][:2]  # bit for bit before the re-split
    torch.testing.assert_close([l for _, l in fitted[0]], [l for _, l in given[0]], rtol=1e-6, atol=0)
    torch.testing.assert_close(fitted[1][0]["word_embeddings"], given[1][0]["word_embeddings"], rtol=1e-5, atol=1e-7)


def test_micro_batch_fit_resumes_exactly(decoder_runs, german, tmp_path, monkeypatch):
    """Paused by --exit_interval after update 3, the first at the re-split (its checkpoint written
    as micro 4 x 2), and resumed: the resumed run takes the recorded split from its first update
    (no new measurement) and trains the uninterrupted run's updates bit for bit."""
    train = dataclasses.replace(_train(4), **ASKED)
    seen = _fitted(monkeypatch)
    whole = _step2_with(decoder_runs, german, tmp_path / "whole", train)
    with pytest.raises(faults.Paused):
        _step2_with(decoder_runs, german, tmp_path / "paused", dataclasses.replace(train, exit_interval=3))
    resumed = _step2_with(decoder_runs, german, tmp_path / "paused", train, resume=True)
    assert [b for b, _, _ in seen] == [[2] * 4] * 2 + [[4] * 2] * 2 + [[2] * 4] * 2 + [[4] * 2] * 2
    assert resumed[0] == whole[0] and torch.equal(resumed[1][0]["word_embeddings"], whole[1][0]["word_embeddings"])


def test_a_split_kept_as_asked_is_kept_on_resume(decoder_runs, german, tmp_path, monkeypatch):
    """A device with no room for a larger micro-batch (TIGHT): the split is kept as asked, and that
    choice recorded; resumed where there is room (another device, or the optimizer's state now in
    the base), the run keeps it, as the uninterrupted run did, and measures nothing again."""
    train = dataclasses.replace(_train(6), **ASKED)  # (measured again at update 4, it would re-split from 6)
    seen = _fitted(monkeypatch, memory=TIGHT)

    def step2(train, resume=False):
        steps.adapt_embeddings(run=RunSpec(output_dir=tmp_path / "paused", ds_config=ZERO0, data_path=german,
                                           resume=resume),
                               step=steps.AdaptEmbeddings(system="minijoint", source=decoder_runs / "mj", lang="de",
                                                          train=train))
    with pytest.raises(faults.Paused):
        step2(dataclasses.replace(train, exit_interval=3))
    record = read_run(tmp_path / "paused")["micro_batch_fit"]
    assert (record["merged"], record["from_update"], record["confirmed"]) == (1, 3, True)
    monkeypatch.setattr(train_module, "device_memory", lambda device: ROOM)
    step2(train, resume=True)
    assert [b for b, _, _ in seen] == [[2] * 4] * 6


def test_micro_batch_fit_that_never_finished_is_dropped_on_resume(decoder_runs, german, tmp_path, monkeypatch):
    """The first update at the re-split fails (as out of memory would) after the checkpoint of
    update 2: the record says it was tried and never confirmed, and the resumed run trains the
    split as asked from update 3 on, as the run as asked does, bit for bit."""
    train = dataclasses.replace(_train(4), save_interval=2, **ASKED)
    given = _step2_with(decoder_runs, german, tmp_path / "given", train)
    seen = _fitted(monkeypatch, fail_at=3)
    with pytest.raises(RuntimeError, match="out of memory"):
        _step2_with(decoder_runs, german, tmp_path / "failed", train)
    record = read_run(tmp_path / "failed")["micro_batch_fit"]
    assert record["tried"] and not record["confirmed"]
    resumed = _step2_with(decoder_runs, german, tmp_path / "failed", train, resume=True)
    assert [b for b, _, _ in seen] == [[2] * 4] * 2 + [[4] * 2] + [[2] * 4] * 2
    assert resumed[0] == given[0] and torch.equal(resumed[1][0]["word_embeddings"], given[1][0]["word_embeddings"])


def _step2_with(decoder_runs, german, out, train, resume=False):
    steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=german, resume=resume),
                           step=steps.AdaptEmbeddings(system="minijoint", source=decoder_runs / "mj", lang="de",
                                                      train=train))
    return _result(out)


@pytest.mark.slow  # end to end: Step 3, then Step 4 on the whole German test split
def test_decoder_finetune_and_zero_shot(decoder_runs, tmp_path):
    cfg = FinetuneConfig(seq_length=32, train_micro_batch_size_per_gpu=16, epochs=0.02, log_interval=1, lr=1e-3)
    summary, module = steps.finetune(
        run=RunSpec(output_dir=tmp_path / "ft", ds_config=ZERO0, layout=Layout(hidden_dropout=0.0)),
        step=steps.Finetune(task="bible-genre", primary=decoder_runs / "mj", cfg=cfg, eval_file="bible"))
    trained = dict(module.named_parameters())
    assert type(module).__name__ == "LlamaForTask" and not trained[WORD].requires_grad
    cfg_mj, primary = load_weights(decoder_runs / "mj")
    assert torch.equal(trained[WORD].detach(), primary[WORD])
    # The classifier starts from the primary head's final norm (the last of the two heads).
    start = LLAMA.task_state(cfg_mj, primary)
    assert torch.equal(start["norm.weight"], primary["heads.heads.1.norm.weight"])
    assert not any(k.startswith("heads.") for k in start)
    assert summary["updates"] == 7 and 0 <= summary["source_score"] <= 100
    records = steps.evaluate([tmp_path / "ft"], embeddings=[decoder_runs / "minijoint-de"], eval_file="bible")
    assert records[0]["task"] == "bible-genre" and records[0]["lang"] == "de" and 0 <= records[0]["score"] <= 100
    # The curve starts at the update-0 artifact; the decoder with its own tokenizer and embeddings
    # on the German file (no adaptation) is Step 4's path with no artifact.
    assert [r.get("step") for r in records] == [0, 4, None] and records[0]["flops"] == 0.0
    ft = load_finetuned(tmp_path / "ft")
    assert records[-1]["system"] == "no_adaptation" and records[-1]["scores"] == evaluate_scores(
        ft, read_examples(ft.task, "bible", "de", "test"), recorded_config(ft))
    # Its rows start with </s>, as the decoder read text in Step 1 (and Step 2: no <s> row trained),
    # recorded, and read back by Step 4; a run recorded before there was a record started with <s>.
    from mmadapt.features import encode_classify
    from mmadapt.tokenizer import load
    from mmadapt.tokens import BOS_ID, EOS_ID

    assert ft.run["task_start"] == [EOS_ID] and ft.framing.start == (EOS_ID,)
    assert encode_classify(load(ft.tokenizer), [("Am Anfang", 0)], 32, ft.framing).input_ids[0, 0] == EOS_ID
    old = {k: v for k, v in ft.run.items() if k != "task_start"}
    assert LLAMA.recorded_framing(old).start == (BOS_ID,)


def test_decoder_options_the_encoder_refuses(decoder_runs, tmp_path):
    with pytest.raises(ValueError, match="mask_prob 0.3 is a masked-LM setting"):
        steps.adapt_embeddings(run=RunSpec(output_dir=tmp_path / "x"),
                               step=steps.AdaptEmbeddings(system="minijoint", source=decoder_runs / "mj", lang="de",
                                                          train=_train(2, mask_prob=0.3)))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("system,source", [("minijoint", "mj"), ("minipost", "post")])
def test_decoder_refuses_a_calibration_it_has_no_bias_for(decoder_runs, german, tmp_path, system, source):
    """A decoder has no output bias: --primary_calibration has nothing to fit over its mini-model
    (it ran and recorded "scale" in run.json, and no artifact was calibrated)."""
    for value in ("scale", "none"):
        with pytest.raises(ValueError, match=f"--primary_calibration {value} fits a mini-model's artifacts .* the "
                                             "llama family's model has no output bias; drop the flag"):
            steps.adapt_embeddings(run=RunSpec(output_dir=tmp_path / "x", ds_config=ZERO0, data_path=german),
                                   step=steps.AdaptEmbeddings(system=system, source=decoder_runs / source, lang="de",
                                                              train=_train(2, primary_calibration=value)))
        assert not (tmp_path / "x").exists()


def test_a_decoder_run_begun_with_a_calibration_resumes_with_it_or_without(decoder_runs, german, tmp_path,
                                                                          monkeypatch):
    """A decoder's Step 2 begun with --primary_calibration scale before the flag was refused there
    recorded 'scale' and calibrated nothing: a --resume with the flag was refused by the check,
    one without it as a changed run; it resumes either way, the record's value kept."""
    import json

    from mmadapt import adapt

    def step(**changes):
        return steps.AdaptEmbeddings(system="minijoint", source=decoder_runs / "mj", lang="de",
                                     train=dataclasses.replace(_train(4), save_interval=2, **changes))
    for resumed_with in ({"primary_calibration": "scale"}, {}):
        out = tmp_path / str(len(resumed_with))
        with monkeypatch.context() as m:  # the run as it began then
            m.setattr(adapt, "check_calibration", lambda *a: None)
            with pytest.raises(faults.Paused):
                steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=german),
                                       step=step(primary_calibration="scale", exit_interval=2))
        steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=german, resume=True),
                               step=step(**resumed_with))
        assert json.loads((out / "run.json").read_text())["train"]["primary_calibration"] == "scale"
        assert (out / "embeddings" / "step00000004").is_dir()
    # a run that recorded the default: another value is refused on --resume as in a new run (not taken
    # for the record's and dropped silently)
    with pytest.raises(ValueError, match="--primary_calibration scale fits a mini-model's artifacts .* drop the flag"):
        steps.adapt_embeddings(run=RunSpec(output_dir=decoder_runs / "minijoint-de", ds_config=ZERO0,
                                           data_path=german, resume=True), step=step(primary_calibration="scale"))
    # a damaged record ("train" no object): refused as the resume's checks refuse it, not an AttributeError
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, "train": None}))
    with pytest.raises(ValueError, match="--resume of a changed run: train"):
        steps.adapt_embeddings(run=RunSpec(output_dir=out, ds_config=ZERO0, data_path=german, resume=True),
                               step=step())


def test_decoder_retrieval_rows_start_as_the_decoder_read_text(decoder_runs, monkeypatch):
    """Parallel-verse retrieval through a decoder (no fine-tuning) lays each row out as Step 3's
    task rows: </s> first, not the <s> whose row no decoder trains."""
    from mmadapt import evaluate as ev
    from mmadapt.tokens import EOS_ID

    firsts, encode = [], ev.encode_classify

    def spy(sp, examples, seq_length, framing=ev.Framing()):
        enc = encode(sp, examples, seq_length, framing)
        firsts.extend(enc.input_ids[:, 0].tolist())
        return enc

    monkeypatch.setattr(ev, "encode_classify", spy)
    pairs = {"de": [("In the beginning", "Am Anfang"), ("And God said", "Und Gott sprach")]}
    records = ev.retrieval_records(decoder_runs / "mj", [decoder_runs / "minijoint-de"], pairs, seq_length=16)
    assert records and all(0 <= r["score"] <= 100 for r in records)
    assert firsts and set(firsts) == {EOS_ID}
