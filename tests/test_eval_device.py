"""Step 4 on the device (finetune.py): each run's model built once with every artifact swapped
into it in place, each evaluation set encoded once per tokenizer, token-sized batches trimmed to
their longest row. Checked against the straightforward path Step 4 took before (a model rebuilt
from the swapped state dict for every artifact and seed, full-length rows in batches of a fixed
number of examples): the same logits for every task kind, the same records. CPU, fp32."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO, VOCAB, count_calls
from mmadapt.artifact import read_artifact, write_artifact
from mmadapt import evaluate as F
from mmadapt.devices import swapped
from mmadapt import tasks as T
from mmadapt.models.roberta import ROBERTA
from mmadapt.tokenizer import load as load_sp
from mmadapt.config import FinetuneConfig
from mmadapt.models import PRESETS
from mmadapt.corpora import bible_verses, parallel_verses
from mmadapt.readers import QAExample, TaggedSentence
from mmadapt.tokens import PAD_ID
from mmadapt.family import WORD
from mmadapt.run import load_weights
from evaluation import evaluate_scores, swap_embeddings

# The tiny preset at the test tokenizers' vocabulary, its weights drawn 10x wider than the init:
# logits spread over several units, so that 1e-5 is a tight tolerance.
MODEL = dataclasses.replace(PRESETS["tiny"][0], vocab_size=VOCAB, init_method_std=0.2)
# Small enough for several batches of several lengths from a hundred rows of at most 64 pieces.
CFG = FinetuneConfig(seq_length=64, doc_stride=16, max_query_length=16, eval_batch_tokens=300)
GENRES = list(T.get_task("bible-genre").labels)


def old_logits(ft: F.Finetuned, artifact: dict | None, input_ids: torch.Tensor, batch_size: int = 16):
    """The straightforward path: a model rebuilt from the swapped state dict, fp32 on the CPU,
    full-length rows in batches of `batch_size` examples, SDPA with a padding mask whatever
    attention_impl `ft` evaluates with."""
    state = ft.state if artifact is None else swap_embeddings(ft.state, artifact)
    cfg = dataclasses.replace(ft.cfg, hidden_dropout=0.0, attention_dropout=0.0, vocab_size=state[WORD].shape[0],
                              attention_impl="sdpa")
    model = ROBERTA.build_task_model(cfg, ft.task.kind, len(ft.labels), ft.run["finetune"]["seed"])
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return torch.cat([model(input_ids[i:i + batch_size])[1] for i in range(0, len(input_ids), batch_size)])


def synthetic(task: str, labels: list[str], seed: int, tokenizer, attention_impl: str = "sdpa") -> F.Finetuned:
    """A Finetuned with seeded, untrained weights: all the comparison of paths needs."""
    t, cfg = T.get_task(task), dataclasses.replace(MODEL, attention_impl=attention_impl)
    return F.Finetuned(ROBERTA, cfg, t, labels, ROBERTA.build_task_model(cfg, t.kind, len(labels), seed).state_dict(), tokenizer,
                       {"finetune": {"seed": seed}})


def verses(n: int, lang: str = "de") -> list[str]:
    out = []
    for _, _, _, text in bible_verses(lang, range(1, 2)):
        out.append(text)
        if len(out) == n:
            return out
    return out


def wide_artifact(vocab: int, seed: int) -> dict:
    return {"word_embeddings": torch.randn(vocab, MODEL.hidden_size, generator=torch.Generator().manual_seed(seed))
            * MODEL.init_method_std}


def classify_case():
    return "bible-genre", GENRES, [(t, i % len(GENRES)) for i, t in enumerate(verses(100))]


def tag_case():
    """Capitalised words tagged as names (German capitalises every noun: plenty of B- tags)."""
    sentences = [t.split() for t in verses(100)]
    return "tag", ["B-NAME", "I-NAME", "O"], [TaggedSentence(w, ["B-NAME" if x[0].isupper() else "O" for x in w])
                                              for w in sentences]


def span_case():
    """Contexts of five verses (several windows of 64 pieces each) with a question and answer."""
    texts = verses(160)
    out = []
    for i in range(0, 150, 5):
        context = " ".join(texts[i:i + 5])
        word = context.split()[7]
        out.append(QAExample(str(i), context, texts[i + 5][:60], [(word, context.index(word))]))
    return "xquad", [], out


CASES = {"classify": classify_case, "tag": tag_case, "span": span_case}


@pytest.mark.parametrize("impl", ["sdpa", "varlen"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_token_batches_give_the_straightforward_paths_logits(kind, impl, de_tokenizer):
    """Also with attention_impl varlen, which needs each batch's Padding exact (counted on the host)."""
    task, labels, examples = CASES[kind]()
    ft = synthetic(task, labels, 1, de_tokenizer, impl)
    assert ft.task.kind == kind
    data = F.eval_set(ft.task, load_sp(de_tokenizer), examples, labels, CFG, torch.device("cpu"))
    ids = data.enc.input_ids  # [n, 64]
    # Sorted by length, longest first; each batch within the budget (or one row) and trimmed:
    # its last column holds a piece of some row, so no all-padding column is computed.
    shapes = [tuple(b.shape) for b in data.batches.ids]
    assert sum(b for b, _ in shapes) == len(ids) > 25 and len(shapes) > 3
    assert all(b * s <= CFG.eval_batch_tokens or b == 1 for b, s in shapes)
    assert [s for _, s in shapes] == sorted((s for _, s in shapes), reverse=True) and shapes[-1][1] < 64
    assert all(bool(b[:, -1].ne(PAD_ID).any()) for b in data.batches.ids)
    real = ids.ne(PAD_ID)
    outs = {}
    # A target vocabulary larger than the model's (1200 rows against 1000), then none (the
    # model's own embeddings, which must be back in place).
    for name, artifact in (("swapped", wide_artifact(1200, 0)), ("own", None)):
        new, old = F.set_logits(ft, data, artifact), old_logits(ft, artifact, ids)
        assert new.shape == old.shape == ((len(ids), len(labels)) if kind == "classify" else (len(ids), 64, 2 if
                                          kind == "span" else len(labels)))
        if kind == "classify":
            torch.testing.assert_close(new, old, rtol=0, atol=1e-5)
        else:  # per position: the same at every piece; at padding -inf for spans, as the model gives
            torch.testing.assert_close(new[real], old[real], rtol=0, atol=1e-5)
            if kind == "span":
                assert torch.isinf(old[~real]).all() and torch.equal(new[~real], old[~real])
        assert float(old[real].std() if kind != "classify" else old.std()) > 0.3  # logits that say something
        outs[name] = new
    changed = outs["swapped"] - outs["own"]
    assert (changed if kind == "classify" else changed[real]).abs().max() > 0.1  # the swap took effect


@pytest.mark.parametrize("kind", sorted(CASES))
def test_no_adaptation_is_the_runs_own_model_on_the_target_text(kind, tokenizer):
    """The no-adaptation record of every task kind: the scores of Step 4's path with no artifact
    (evaluate_scores, the run's own tokenizer), no Step-2 compute, the systems it stands beside."""
    task, labels, examples = CASES[kind]()
    ft = synthetic(task, labels, 1, tokenizer)
    ft.run["primary"] = {"run_dir": "runs/primary"}
    scoring = F.Scoring([ft], [CFG], {"de": examples})  # as read from the evaluation file
    record = F.no_adaptation_record(scoring, "de", ["bl_base", "minipost"])
    assert record["scores"] == evaluate_scores(ft, examples, CFG)
    assert record["score"] == record["scores"][T.headline(ft.task, labels, CFG)] and record["seed_scores"] == \
        [record["score"]]
    assert (record["system"], record["task"], record["lang"], record["flops"], record["of"], record["tokenizer"]) == (
        "no_adaptation", task, "de", 0.0, ["bl_base", "minipost"], str(tokenizer))
    assert "step" not in record and (record["chance"] is None) == (kind == "span")
    if kind == "classify":  # the English tokenizer on German verses, read up to seq_length: <unk> counted by hand
        sp = load_sp(tokenizer)
        pieces = [sp.encode(text)[:CFG.seq_length - 2] for text, _ in examples]
        unknown = sum(p.count(sp.unk_id()) for p in pieces)
        assert record["unknown_share"] == pytest.approx(unknown / sum(map(len, pieces))) and unknown > 0


def test_the_swap_leaves_the_runs_own_model_as_it_was(tokenizer, de_tokenizer):
    ft = synthetic("bible-genre", GENRES, 2, tokenizer)
    en = [(t, i % len(GENRES)) for i, t in enumerate(verses(60, "en"))]
    de = [(t, i % len(GENRES)) for i, t in enumerate(verses(60))]
    model = ft.model()
    own = model.get_parameter(WORD)
    en_set = F.eval_set(ft.task, load_sp(tokenizer), en, GENRES, CFG, torch.device("cpu"))
    before, scores_before = F.set_logits(ft, en_set), evaluate_scores(ft, en, CFG)
    artifact = wide_artifact(1200, 1)
    evaluate_scores(ft, de, CFG, artifact, de_tokenizer)
    assert not torch.equal(F.set_logits(ft, en_set, artifact), before)
    # Built once; its own embedding Parameter back in place, never written.
    assert ft.model() is model and model.get_parameter(WORD) is own
    assert torch.equal(own, ft.state[WORD]) and own.shape == (VOCAB, MODEL.hidden_size)
    assert torch.equal(F.set_logits(ft, en_set), before) and evaluate_scores(ft, en, CFG) == scores_before
    # Also after an error inside the swap, and embeddings of another width are refused by the
    # check swap_embeddings uses.
    with pytest.raises(RuntimeError, match="inside"):
        with swapped(model, {WORD: artifact["word_embeddings"]}):
            assert model.get_parameter(WORD).shape == (1200, MODEL.hidden_size)
            raise RuntimeError("inside")
    assert model.get_parameter(WORD) is own
    with pytest.raises(ValueError, match="hidden size 32"):
        F.set_logits(ft, en_set, {"word_embeddings": torch.zeros(VOCAB, 32)})
    assert model.get_parameter(WORD) is own


# --- evaluate_artifacts over Step-3 runs -------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def small_genre_test_split():
    """The bible-genre test split at 100 verses a class (the task's is 500): what these tests
    check (records against the straightforward path, encodings and model builds counted) does
    not depend on its size, as long as the two seeds' scores still differ (checked below), and
    Step 4 over 2,500 verses per artifact and seed took most of this file's time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "GENRE_TEST_PER_CLASS", 100)
        yield


@pytest.fixture(scope="module")
def seeds(primary_run, tmp_path_factory):
    """Two bible-genre Step-3 runs of the primary model (seeds 1 and 2), 3 updates each."""
    from mmadapt import steps
    from mmadapt.config import Layout
    from mmadapt.parallel import init_parallel
    from mmadapt.run import RunSpec

    init_parallel(1, 1)
    cfg = FinetuneConfig(seq_length=64, train_micro_batch_size_per_gpu=16, epochs=0.008, log_interval=1, lr=1e-3)
    runs = []
    for seed in (1, 2):
        out = tmp_path_factory.mktemp(f"ft_seed{seed}")
        steps.finetune(run=RunSpec(output_dir=out, ds_config=REPO / "ds_configs" / "zero0.json",
                                   layout=Layout(hidden_dropout=0.0, attention_dropout=0.0)),
                       step=steps.Finetune(task="bible-genre", primary=primary_run, cfg=dataclasses.replace(cfg, seed=seed)))
        runs.append(out)
    return runs


def _adapt_run(run, primary_run, tokenizer, vocab_sizes: dict[int, int]):
    """An adapt run directory holding one artifact per {step: vocabulary size}: the primary's
    trained embeddings (rows past its vocabulary: noise), perturbed differently at each step."""
    primary = load_weights(primary_run)[1][WORD]  # [1000, 64]
    for step, vocab in vocab_sizes.items():
        g = torch.Generator().manual_seed(step)
        rows = torch.cat([primary, torch.randn(vocab - len(primary), primary.shape[1], generator=g) * 0.02])
        meta = {"system": "bl_base", "lang": "de", "step": step, "flops": float(step), "flops_paper": float(step),
                "v100_days": 0.0, "tokens": step, "source": str(primary_run)}
        write_artifact(run / "embeddings" / f"step{step:08d}",
                         {"word_embeddings": rows + 0.05 * torch.randn(rows.shape, generator=g),
                          "output_bias": torch.zeros(vocab)}, tokenizer, meta)
    return run


@pytest.fixture(scope="module")
def adapt_run(primary_run, de_tokenizer, tmp_path_factory):
    """Two artifacts of one German tokenizer (each with its own copy), 1000 and 1200 rows."""
    return _adapt_run(tmp_path_factory.mktemp("adapt"), primary_run, de_tokenizer, {2: 1000, 4: 1200})


@pytest.mark.slow  # Step 4 over evaluation sets, several artifacts and seeds
def test_records_equal_the_straightforward_paths(seeds, adapt_run):
    records = F.evaluate_artifacts(seeds, [adapt_run], "bible", eval_batch_tokens=700)
    assert [(r.get("step"), r["metric"]) for r in records] == [(2, "accuracy"), (4, "accuracy"), (None, "accuracy")]
    runs = [F.load_finetuned(r) for r in seeds]
    examples = T.read_examples(runs[0].task, "bible", "de", "test")
    # The last record: no adaptation, each run's own English tokenizer and embeddings on the German file.
    # (bl_base's artifacts over a MINIJOINT primary are its ceiling, labelled minijoint:full: adapt.system_label)
    assert records[2]["system"] == "no_adaptation" and records[2]["of"] == [records[0]["system"]] == ["minijoint:full"]
    for rec, vocab in zip(records, (1000, 1200, None)):
        emb, tok = (None, runs[0].tokenizer) if vocab is None else read_artifact(rec["artifact"])[:2]
        assert vocab is None or emb["word_embeddings"].shape == (vocab, 64)
        per_seed = []
        for ft in runs:
            cfg = F.recorded_config(ft)
            enc = T.encode(ft.task, load_sp(tok), examples, ft.labels, cfg)
            per_seed.append(T.scores(ft.task, old_logits(ft, emb, enc.input_ids, 64), enc, examples, ft.labels, cfg))
        assert per_seed[0] != per_seed[1]  # two models: a mixed-up seed would show
        assert rec["seed_scores"] == pytest.approx([s["accuracy"] for s in per_seed], abs=1e-9)
        assert rec["scores"] == pytest.approx({k: (per_seed[0][k] + per_seed[1][k]) / 2 for k in per_seed[0]},
                                              abs=1e-9)


@pytest.mark.slow  # Step 4 over evaluation sets, several artifacts and seeds
def test_each_evaluation_set_is_encoded_once_per_tokenizer(seeds, adapt_run, primary_run, tokenizer, tmp_path,
                                                           monkeypatch):
    """2 seeds x 5 artifacts: 4 of the German tokenizer (copies of one file), 1 of the primary's
    own (English) tokenizer, then the no-adaptation record, which reads with that same English
    tokenizer -> two encodings of the evaluation set, and each seed's model built once."""
    import shutil

    other = _adapt_run(tmp_path / "other", primary_run, tokenizer, {6: 1000})
    again = shutil.copytree(adapt_run, tmp_path / "again")  # its artifacts elsewhere (one run twice is refused)
    calls = {}
    count_calls(monkeypatch, F, "encode", calls)
    count_calls(monkeypatch, ROBERTA, "build_task_model", calls)
    records = F.evaluate_artifacts(seeds, [adapt_run, other, again], "bible")
    assert [r.get("step") for r in records] == [2, 4, 6, 2, 4, None]
    # No adaptation reads with the runs' own tokenizer: the content `other` carries, encoded already.
    assert F.file_sha256(Path(records[-1]["tokenizer"])) == F.file_sha256(read_artifact(records[2]["artifact"])[1])
    assert calls == {"encode": 2, "build_task_model": 2}
    assert records[3]["scores"] == records[0]["scores"]  # the same artifact (by content), the same model state


@pytest.mark.slow  # Step 4 over evaluation sets, several artifacts and seeds
def test_a_run_recorded_with_eval_batch_size_still_evaluates(seeds, adapt_run, tmp_path):
    """run.json written before eval_batch_tokens replaced eval_batch_size: the field it lacks
    takes its default, the one that no longer exists is dropped."""
    import json
    import shutil

    old = shutil.copytree(seeds[0], tmp_path / "old")
    run = json.loads((old / "run.json").read_text())
    run["finetune"]["eval_batch_size"] = 64
    del run["finetune"]["eval_batch_tokens"]
    (old / "run.json").write_text(json.dumps(run))
    assert F.recorded_config(F.load_finetuned(old)) == F.recorded_config(F.load_finetuned(seeds[0]))
    first = sorted((adapt_run / "embeddings").iterdir())[0]  # one artifact: the config is what is compared
    [a], [b] = (F.evaluate_artifacts([r], [first], "bible", no_adaptation=False) for r in (old, seeds[0]))
    assert a["scores"] == b["scores"] and a["artifact"] == str(first)


def _twin(run, source: Path, step: int, change) -> Path:
    """An adapt run of one artifact: `source`'s, its tensors passed through `change`."""
    art, tok, meta = read_artifact(source)
    return write_artifact(run / "embeddings" / f"step{step:08d}", change(dict(art)), tok, {**meta, "step": step})


@pytest.mark.slow  # Step 4 over evaluation sets, several artifacts and seeds
def test_an_artifact_that_swaps_in_what_an_earlier_one_did_is_scored_once(seeds, adapt_run, primary_run, tmp_path,
                                                                           monkeypatch):
    """Zero-shot and retrieval swap in the word embeddings alone: an artifact whose embeddings
    and tokenizer are an earlier one's (another output bias, as MINIPOST's update 0 beside
    BL_BASE's) takes its scores without a forward pass; one element changed is scored anew."""
    first = sorted((adapt_run / "embeddings").iterdir())[0]

    def other_bias(t):
        return {**t, "output_bias": t["output_bias"] + 1.0}

    def one_element(t):
        w = t["word_embeddings"].clone()
        w[7, 3] += 1.0
        return {**t, "word_embeddings": w}

    twin = _twin(tmp_path / "twin", first, 2, other_bias).parent.parent
    near = _twin(tmp_path / "near", first, 2, one_element).parent.parent
    calls = {}
    count_calls(monkeypatch, F, "score_set", calls)
    records = F.evaluate_artifacts(seeds, [adapt_run, twin, near], "bible")
    assert [(r.get("step"), r["artifact"] if r.get("step") else None) for r in records][2:4] == [
        (2, str(twin / "embeddings" / "step00000002")), (2, str(near / "embeddings" / "step00000002"))]
    # 2 seeds x (adapt_run's two artifacts, `near`, no adaptation): `twin` took the first's scores.
    assert calls["score_set"] == 8
    assert records[2]["scores"] == records[0]["scores"] and records[2]["seed_scores"] == records[0]["seed_scores"]
    [direct] = F.evaluate_artifacts(seeds, [twin], "bible", no_adaptation=False)  # scored alone, the same
    assert direct["scores"] == records[2]["scores"]
    assert calls["score_set"] == 10
    records[2]["scores"]["accuracy"] = -1.0  # a record's fields are its own, not the shared result
    assert records[0]["scores"]["accuracy"] != -1.0
    # Retrieval: adapt_run's two, then `near`; `twin` takes the first's accuracy.
    count_calls(monkeypatch, F, "sentence_vectors", calls)
    pairs = {"de": parallel_verses("en", "de", 40)}
    got = F.retrieval_records(primary_run, [adapt_run, twin, near], pairs)
    assert calls["sentence_vectors"] == 1 + 3  # the source side once, then three artifacts
    assert got[2]["score"] == got[0]["score"] and got[2]["artifact"] == records[2]["artifact"]


def test_every_input_is_refused_before_any_weights_are_read(seeds, adapt_run, monkeypatch):
    """Step 4 reads no fine-tuned run's weights (each seed's model, and the primary's embeddings:
    a 7B decoder's take minutes) before its evaluation files and its artifacts are checked: a
    missing or empty file was refused only after every seed had been read."""
    def weights_read(*args, **kwargs):
        raise AssertionError("weights read before the inputs were checked")

    first = sorted((adapt_run / "embeddings").iterdir())[0]
    monkeypatch.setattr(F, "load_finetuned", weights_read)
    for spec, lang, refusal in (("/nonexistent/{lang}.tsv", None, "reads the packaged Bible: pass 'bible'"),
                                ("bible", "xx", "'xx'")):
        with pytest.raises(ValueError, match=re.escape(refusal)):
            F.evaluate_artifacts(seeds, [first], spec, no_adaptation=False, lang=lang)
    with pytest.raises(AssertionError, match="weights read"):  # the inputs pass: the weights are read next
        F.evaluate_artifacts(seeds, [first], "bible", no_adaptation=False)


def test_seeds_of_another_primary_model_or_task_are_refused(seeds, adapt_run, tmp_path):
    """Step 4 averages its --finetuned runs as seeds of one system: a run fine-tuned from another
    primary model (its weights' fingerprint), or on another task, is refused before any scoring."""
    import json
    import shutil

    first = sorted((adapt_run / "embeddings").iterdir())[0]
    for name, change in (("other-primary", lambda r: r["primary"].update(fingerprint="0" * 64)),
                         ("other-task", lambda r: r.update(task="bible-testament"))):
        other = shutil.copytree(seeds[1], tmp_path / name)
        run = json.loads((other / "run.json").read_text())
        assert run["primary"].get("fingerprint") and run.get("task") == "bible-genre"
        change(run)
        (other / "run.json").write_text(json.dumps(run))
        with pytest.raises(ValueError, match=r"^--finetuned runs must share one primary model and task"):
            F.evaluate_artifacts([seeds[0], other], [first], "bible", no_adaptation=False)
