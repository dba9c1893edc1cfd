"""Steps 3 and 4: fine-tuning keeps the word embeddings frozen and saves only what it trains, the
model rebuilt from disk is exactly the trained one, the swap changes only the embeddings and the
tokenizer, data/tensor-parallel fine-tuning equals one process, and Step 4's records and errors."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import NO_DROPOUT, REPO, adapt_args, child_env, launch_cmd, metrics, run_pretrain
from mmadapt.artifact import SAMPLED_KEY, read_artifact, write_artifact
from mmadapt.checkpoint import tag_for
from mmadapt import faults
from mmadapt.config import FinetuneConfig
from mmadapt import steps
from mmadapt.config import Layout
from evaluation import evaluate_score, evaluate_scores, predict, swap_embeddings
from mmadapt.devices import device_of
from mmadapt.evaluate import eval_set, load_finetuned, recorded_config, retrieval_records, set_logits
from mmadapt.family import WORD
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights, run_fingerprint, sampled_fingerprint
from mmadapt.tasks import encode, read_examples, score
from mmadapt.tokenizer import load as load_sp

FINETUNE = str(REPO / "launch" / "finetune.py")
EVALUATE = str(REPO / "launch" / "evaluate.py")
# 0.04 epoch of the 5000 English bible-genre verses at batch 16: 13 updates.
SHORT = FinetuneConfig(seq_length=64, train_micro_batch_size_per_gpu=16, epochs=0.04, log_interval=1, lr=1e-3)


@pytest.fixture(scope="module")
def step3(primary_run, tmp_path_factory):
    """An in-process Step-3 run: (run dir, summary, the trained module, the primary's weights)."""
    init_parallel(1, 1)
    out = tmp_path_factory.mktemp("finetune")
    run = RunSpec(output_dir=out, ds_config=REPO / "ds_configs" / "zero0.json",
                  layout=Layout(hidden_dropout=0.0, attention_dropout=0.0))
    summary, module = steps.finetune(run=run, step=steps.Finetune(task="bible-genre", primary=primary_run, cfg=SHORT))
    return out, summary, module, load_weights(primary_run)[1]


def test_step3_trains_everything_but_the_word_embeddings(step3):
    out, summary, module, primary = step3
    assert summary["updates"] == 13 and summary["global_batch"] == 16
    trained = dict(module.named_parameters())
    assert torch.equal(trained[WORD].detach(), primary[WORD])
    assert not trained[WORD].requires_grad
    for name, p in trained.items():
        if name != WORD:
            assert p.requires_grad, name
            if name in primary:  # the body (the task head is new)
                assert not torch.equal(p.detach(), primary[name]), f"{name} did not change"
    # The checkpoint leaves the frozen embeddings out: they are the primary run's.
    module_file = out / "checkpoints" / "step00000013" / "mp_rank_00_model_states.pt"
    saved = torch.load(module_file, weights_only=False)["module"]
    assert WORD not in {k for k, v in saved.items() if v is not None}
    assert "layers.11.fc2.weight" in saved and "out.weight" in saved
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == 13 and all(0 < x < 3 for x in losses)


def test_the_model_rebuilt_from_disk_is_exactly_step3s(step3):
    out, _, module, _ = step3
    ft = load_finetuned(out)
    live = module.state_dict()
    assert set(ft.state) == {k for k in live if not k.endswith("_extra_state")}
    for k, v in ft.state.items():
        assert torch.equal(v, live[k]), k
    ids = encode(ft.task, load_sp(ft.tokenizer), read_examples(ft.task, "bible", "en", "test")[:40], ft.labels,
                 SHORT).input_ids
    module.eval()
    assert torch.equal(predict(ft.model(), ids, 1024), predict(module, ids, 1024))


def _artifact(tmp_path, de_tokenizer, hidden=64, vocab=1000, source="x", std=0.02):
    g = torch.Generator().manual_seed(0)
    return write_artifact(tmp_path / "artifact", {"word_embeddings": torch.randn(vocab, hidden, generator=g) * std,
                                                    "output_bias": torch.zeros(vocab)}, de_tokenizer,
                            {"lang": "de", "source": source})


def test_swap_changes_only_the_embeddings_and_the_tokenizer(step3, de_tokenizer, tmp_path):
    out, *_ = step3
    ft = load_finetuned(out)
    emb, tok, _ = read_artifact(_artifact(tmp_path, de_tokenizer, std=1.0))  # (at 0.02 every row reads one class)
    swapped = swap_embeddings(ft.state, emb)  # (by hand: the model's other weights as they are)
    assert torch.equal(swapped[WORD], emb["word_embeddings"])
    # Step 4 encodes with the artifact's tokenizer, the model's other weights untouched: the same
    # logits as the model built by hand (the tiny model reads every row as one class, so equal
    # scores alone would say little), and the model left with its own rows afterwards.
    de = read_examples(ft.task, "bible", "de", "test")[:60]
    cfg = FinetuneConfig(**{**ft.run["finetune"], "eval_batch_tokens": 2048})
    enc = encode(ft.task, load_sp(de_tokenizer), de, ft.labels, cfg)
    model = type(ft)(ft.family, ft.cfg, ft.task, ft.labels, swapped, ft.tokenizer, ft.run).model()
    logits = predict(model, enc.input_ids, 2048)
    data = eval_set(ft.task, load_sp(tok), de, ft.labels, cfg, device_of(ft.model()), ft.framing)
    torch.testing.assert_close(set_logits(ft, data, emb), logits, rtol=0, atol=0)
    assert not torch.allclose(set_logits(ft, data, {**emb, "word_embeddings": emb["word_embeddings"].flip(0)}),
                              logits)
    assert torch.equal(ft.model().get_parameter(ft.family.word).detach(), ft.state[WORD])
    assert evaluate_score(ft, de, cfg, emb, tok) == score(ft.task, logits, enc, de, ft.labels, cfg)
    # Embeddings of another model's width are refused.
    wrong, _, _ = read_artifact(_artifact(tmp_path / "w", de_tokenizer, hidden=32))
    with pytest.raises(ValueError, match="hidden size 32"):
        swap_embeddings(ft.state, wrong)


def test_step4_takes_the_artifacts_vocabulary_size(step3, primary_run, de_tokenizer, tmp_path):
    """adapt --vocab_size may differ from the source's: Step 4 (and retrieval) builds its model
    with the artifact's rows. Rows past the tokenizer's ids change nothing."""
    out, *_ = step3
    ft = load_finetuned(out)
    meta = {"system": "bl_base", "lang": "de", "step": 1, "flops": 1.0, "flops_paper": 1.0, "v100_days": 0.0,
            "tokens": 1, "source": str(primary_run)}
    same = write_artifact(tmp_path / "v1000", _rows(1000), de_tokenizer, meta)
    more = write_artifact(tmp_path / "v1200", _rows(1200), de_tokenizer, meta)
    de = read_examples(ft.task, "bible", "de", "test")[:40]
    cfg = FinetuneConfig(**{**ft.run["finetune"], "eval_batch_tokens": 1280})
    scores = [evaluate_score(ft, de, cfg, read_artifact(p)[0], de_tokenizer) for p in (same, more)]
    assert scores[0] == scores[1]
    pairs = {"de": [("In the beginning God created the heaven.", "Im Anfang schuf Gott Himmel und Erde."),
                    ("And God said, Let there be light.", "Und Gott sprach: Es werde Licht!"),
                    ("And the evening and the morning were the first day.", "Da ward aus Abend und Morgen der "
                     "erste Tag."),
                    ("And God called the dry land Earth.", "Und Gott nannte das Trockene Erde.")]}
    rec = [retrieval_records(primary_run, [p], pairs)[0]["score"] for p in (same, more)]
    assert rec[0] == rec[1]
    # pairs without the artifact's language (a KeyError), or with an empty text (every one pools to
    # one vector, a tie): one line each
    with pytest.raises(ValueError, match=r"v1000 is a de artifact and pairs holds no de sentences \(fr\): give "):
        retrieval_records(primary_run, [same], {"fr": pairs["de"]})
    with pytest.raises(ValueError, match=r"^pairs\['de'\]\[1\] is \('', 'x'\): each pair is two non-empty texts"):
        retrieval_records(primary_run, [same], {"de": [pairs["de"][0], ("", "x")]})
    for bad in (("a", "b", "c"), "ab"):  # (three texts failed to unpack; a string was a pair of its letters)
        with pytest.raises(ValueError, match=r"^pairs\['de'\]\[1\] is .*: each pair is two non-empty texts"):
            retrieval_records(primary_run, [same], {"de": [pairs["de"][0], bad]})
    # a verse spelt twice, composed (NFC) and decomposed (NFD): the tokenizer (NFKC) reads one text,
    # the two target vectors are equal, and both queries find the first source: a hit for both,
    # as a text given twice is (scored by its spelling, the second was a miss: 50)
    import unicodedata
    verse = "Und Gott segnete die Söhne Noahs."
    spelt = {"de": [("And God blessed the sons of Noah.", verse),
                    ("And God blessed Noah and his sons.", unicodedata.normalize("NFD", verse))]}
    assert spelt["de"][0][1] != spelt["de"][1][1]
    assert retrieval_records(primary_run, [same], spelt)[0]["score"] == 100.0


def _rows(vocab: int):
    """Embeddings whose first 1000 rows are the same for every vocab size."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1000, 64, generator=g) * 0.02, torch.randn(1000, generator=g)
    return {"word_embeddings": torch.cat([w, torch.ones(vocab - 1000, 64)]),
            "output_bias": torch.cat([b, torch.ones(vocab - 1000)])}


# --- across processes ---------------------------------------------------------------------------------

def _finetune(primary_run, out, nproc, *extra):
    run_pretrain(nproc, "--task", "bible-genre", "--primary", str(primary_run), "--output_dir", str(out),
                 "--seq_length", "64", "--epochs", "0.02", "--log_interval", "1", "--lr", "1e-3",
                 "--train_micro_batch_size_per_gpu", "8", *NO_DROPOUT, *extra, script=FINETUNE)
    return out


@pytest.fixture(scope="module")
def step3_single(primary_run, tmp_path_factory):
    return _finetune(primary_run, tmp_path_factory.mktemp("ft_single"), 1, "--gradient_accumulation_steps", "2",
                     "--ds_config", "ds_configs/zero0.json")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--ds_config", "ds_configs/zero2.json"],
                                    ["--tensor_model_parallel_size", "2", "--gradient_accumulation_steps", "2",
                                     "--eval_file", "bible"]],
                         ids=["zero2_dp2", "tp2_with_eval"])
def test_step3_layout_matches_single_process(layout, step3_single, primary_run, tmp_path):
    run = _finetune(primary_run, tmp_path / "run", 2, *layout)
    if "--eval_file" in layout:
        # Evaluation after tensor-parallel training runs on rank 0 with a TP=1 model and touches
        # no process group (it used to rebuild them on rank 0 alone and hang).
        score = json.loads((run / "run.json").read_text())["source_score"]
        assert 0 <= score <= 100
    ref, got = metrics(step3_single), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 8))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    ft_ref, ft_got = load_finetuned(step3_single), load_finetuned(run)
    # atol: Adam normalises each gradient, so an element whose gradient is near zero takes the
    # reduction order's rounding into its update at full size (seen: 1.6e-6 after 7 updates of lr
    # 1e-3, one element of 16,384); 1e-5 is 1% of one such update
    for k, v in ft_ref.state.items():
        torch.testing.assert_close(ft_got.state[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_tag_task_on_two_ranks_trains_as_one_micro_batch_of_all_their_rows(primary_run, tmp_path):
    """A tag task (verses of uneven length: each rank's micro-batch tags its own number of words)
    on two data-parallel ranks of 8 rows, and in one process as one micro-batch of 16: the same
    losses and weights, the per-word weights summed over the ranks on the device
    (calculate_per_token_loss). As the mean of the two ranks' means it was not."""
    from mmadapt.corpora import bible_verses

    words = [text.split()[:3 + i % 20] for i, (_, _, _, text) in enumerate(bible_verses("en", range(1, 2)))][:32]
    rows = [{"tokens": w, "tags": ["B-CAP" if x[0].isupper() else "O" for x in w]} for w in words]
    train = tmp_path / "tags.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {1: tmp_path / "one", 2: tmp_path / "two"}
    for ranks, micro in ((1, "16"), (2, "8")):
        run_pretrain(ranks, "--task", "tag", "--primary", str(primary_run), "--train_file", str(train),
                     "--output_dir", str(runs[ranks]), "--seq_length", "48", "--epochs", "1", "--log_interval", "1",
                     "--lr", "1e-3", "--ds_config", "ds_configs/zero0.json", "--train_micro_batch_size_per_gpu", micro,
                     *NO_DROPOUT, script=FINETUNE)
    ref, got = metrics(runs[1]), metrics(runs[2])
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    ft_ref, ft_got = load_finetuned(runs[1]), load_finetuned(runs[2])
    for k, v in ft_ref.state.items():
        torch.testing.assert_close(ft_got.state[k], v, rtol=1e-4, atol=1e-5)  # atol: as the layout test's


@pytest.mark.slow
def test_step4_records_and_report(step3, primary_run, de_corpus, de_tokenizer, tmp_path, capsys):
    """Step 4 as a user launches it (launch/evaluate.py, a process of its own) over two Step-2
    runs; the rest in this process (`mmadapt ...` through cli.main: each command's own process
    would spend its seconds importing)."""
    from mmadapt.cli import main

    out, *_ = step3
    adapt, baseline = tmp_path / "adapt", tmp_path / "adapt_bl_base"
    for system, run in (("minijoint", adapt), ("bl_base", baseline)):
        assert main(["adapt", *adapt_args(system, primary_run, de_corpus, de_tokenizer, run, "--train_iters", "4",
                                          "--save_interval", "2", "--log_interval", "2")]) == 0
    records_file = tmp_path / "records.json"
    args = ["--finetuned", str(out), "--embeddings", str(adapt), str(baseline), "--eval_file", "bible", "--output",
            str(records_file)]
    proc = subprocess.run([sys.executable, EVALUATE, *args], cwd=REPO, capture_output=True, text=True,
                          env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(records_file.read_text())
    # Full-model Step 2 over the MINIJOINT primary is its ceiling, named apart from a BL_BASE run.
    # Each adapt run's curve starts at its update-0 artifact (the embeddings as initialised), and
    # the fine-tuned run is scored once more with no adaptation.
    assert [(r["system"], r["lang"], r.get("step"), r["task"]) for r in records] == [
        ("minijoint", "de", 0, "bible-genre"), ("minijoint", "de", 2, "bible-genre"),
        ("minijoint", "de", 4, "bible-genre"), ("minijoint:full", "de", 0, "bible-genre"),
        ("minijoint:full", "de", 2, "bible-genre"), ("minijoint:full", "de", 4, "bible-genre"),
        ("no_adaptation", "de", None, "bible-genre")]
    assert records[0]["flops"] == records[3]["flops"] == 0.0
    # each record's compute is its artifact's (the positions its head projected: a data-dependent
    # count, tests/test_expand.py), the 2 updates after step 2 about as many as the 2 before
    for r, (run, tag) in zip(records[1:3], ((adapt, "step00000002"), (adapt, "step00000004"))):
        assert r["flops"] == read_artifact(run / "embeddings" / tag)[2]["flops"]
    assert records[1]["flops"] * 2 == pytest.approx(records[2]["flops"], rel=0.02)
    assert records[1]["flops"] < records[4]["flops"]  # 4 layers against 12
    assert all(0 <= r["score"] <= 100 and r["metric"] == "accuracy" for r in records)
    # No adaptation: exactly the fine-tuned run on the German file with its own English tokenizer
    # and embeddings, through Step 4's path with no artifact; no Step-2 compute.
    ft = load_finetuned(out)
    none = records[-1]
    assert none["scores"] == evaluate_scores(ft, read_examples(ft.task, "bible", "de", "test"), recorded_config(ft))
    assert (none["flops"], none["of"], none["tokenizer"]) == (0.0, ["minijoint", "minijoint:full"], str(ft.tokenizer))
    # Update 0: the same score as its artifact evaluated on its own (and no no-adaptation row then).
    start = tmp_path / "start.json"
    capsys.readouterr()
    assert main(["evaluate", "--finetuned", str(out), "--embeddings", str(adapt / "embeddings" / "step00000000"),
                 "--eval_file", "bible", "--no_adaptation_baseline", "false", "--output", str(start)]) == 0
    [explicit] = json.loads(start.read_text())
    assert explicit["scores"] == records[0]["scores"] and explicit["step"] == 0
    # Printed: every record, then no adaptation and update 0 beside the last checkpoint, per language.
    lines = proc.stdout.splitlines()
    assert sum(" bible-genre de step " in line for line in lines) == 6
    assert any(line.startswith("no_adaptation bible-genre de no adaptation") for line in lines)
    assert f"| de | minijoint | {none['score']:.1f} | {records[0]['score']:.1f} | {records[2]['score']:.1f}" \
        in proc.stdout
    assert "## bible-genre: what adaptation bought" in proc.stdout and "- de: adaptation " in proc.stdout
    # The same command again must not overwrite the records.
    before = records_file.read_bytes()
    capsys.readouterr()
    assert main(["evaluate", *args]) != 0
    assert "already exists" in capsys.readouterr().err and records_file.read_bytes() == before
    # No BL_BASE: the report measures against the system with the most Step-2 compute, and says so.
    assert main(["report", str(records_file)]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        "baseline: minijoint:full (no bl_base in the records: the system with the most Step-2 compute; --baseline "
        "chooses another)"]
    assert main(["report", str(records_file), "--baseline", "minijoint:full"]) == 0
    report = capsys.readouterr().out
    assert "| minijoint |" in report and "| minijoint:full |" in report
    assert "| 100.0% |" in report.split("| minijoint:full |")[1].splitlines()[0]  # the baseline's own row
    assert "share of minijoint:full's gain" in report

    # The primary model is known by its weights' fingerprint, recorded by Step 2 and Step 3: a
    # byte-identical copy of the primary run is the same model, wherever it lives.
    meta = json.loads((adapt / "embeddings" / "step00000004" / "meta.json").read_text())
    assert meta["primary_fingerprint"] == run_fingerprint(primary_run) == load_finetuned(out).run["primary"]["fingerprint"]
    assert (meta[SAMPLED_KEY] == sampled_fingerprint(load_weights(primary_run)[1])
            == load_finetuned(out).run["primary"]["sampled_fingerprint"])
    other = tmp_path / "other_primary"
    shutil.copytree(primary_run, other)
    artifact = tmp_path / "moved"
    shutil.copytree(adapt / "embeddings" / "step00000004", artifact)
    (artifact / "meta.json").write_text(json.dumps({**meta, "source": str(other)}))
    evaluate = ["evaluate", "--finetuned", str(out), "--eval_file", "bible", "--embeddings"]
    assert main([*evaluate, str(artifact), "--output", str(tmp_path / "r1.json")]) == 0
    assert json.loads((tmp_path / "r1.json").read_text())[0]["score"] == pytest.approx(records[2]["score"])
    from mmadapt import predict as api  # the Python API takes what evaluate takes (it compared paths alone)

    texts = ["Und Gott sprach: Es werde Licht.", "Selig sind, die da Leid tragen."]
    assert (api.load(out, embeddings=artifact).predict(texts)
            == api.load(out, embeddings=adapt / "embeddings" / "step00000004").predict(texts))
    # Embeddings trained for another primary model (another fingerprint; or, for an artifact
    # written before fingerprints, another path) are refused, naming both.
    for name, changed in (("foreign", {"primary_fingerprint": "0" * 64}), ("old", {"primary_fingerprint": None})):
        shutil.copytree(artifact, tmp_path / name)
        (tmp_path / name / "meta.json").write_text(json.dumps({**meta, "source": str(other), **changed}))
        capsys.readouterr()
        assert main([*evaluate, str(tmp_path / name), "--output", str(tmp_path / f"{name}.json")]) == 2
        err = capsys.readouterr().err
        assert f"holds embeddings for the primary model {other}" in err, err
        assert not (tmp_path / f"{name}.json").exists()
        with pytest.raises(ValueError, match=f"holds embeddings for the model of {other}"):
            api.load(out, embeddings=tmp_path / name)


@pytest.mark.slow  # end to end: three Step-3 runs, one stopped and resumed
def test_step3_stopped_and_resumed_equals_uninterrupted(primary_run, tmp_path):
    """Dropout on: the head init, data order, dropout and optimizer state all come back."""
    cfg = dataclasses.replace(SHORT, epochs=0.02, save_interval=2)  # 7 updates of 16 examples
    zero0 = REPO / "ds_configs" / "zero0.json"

    def finetune(out, cfg, resume=False):
        return steps.finetune(run=RunSpec(output_dir=out, ds_config=zero0, resume=resume),
                              step=steps.Finetune(task="bible-genre", primary=primary_run, cfg=cfg))

    full, _ = finetune(tmp_path / "full", cfg)
    assert full["updates"] == 7
    with pytest.raises(faults.Paused, match="paused at update 3 of 7"):
        finetune(tmp_path / "part", dataclasses.replace(cfg, exit_interval=3))
    assert [r["step"] for r in metrics(tmp_path / "part")] == [1, 2, 3]
    assert "final_loss" not in json.loads((tmp_path / "part" / "run.json").read_text())
    with pytest.raises(ValueError, match="has not finished its 7 updates"):
        load_finetuned(tmp_path / "part")
    with pytest.raises(ValueError, match="pass --resume"):
        finetune(tmp_path / "part", cfg)
    resumed, _ = finetune(tmp_path / "part", cfg, resume=True)
    def losses(run):
        return [(r["step"], r["loss"], r["lr"]) for r in metrics(run)]

    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert resumed["final_loss"] == full["final_loss"]
    a, b = load_finetuned(tmp_path / "full").state, load_finetuned(tmp_path / "part").state
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


TERM_WHILE_SCORING = """
import os, signal, sys, time
from mmadapt import steps
from mmadapt.cli import main, run_process

scores = steps._finetune_results
def scoring(*args, **kw):  # a SIGTERM (scancel, preemption) while the --eval_file is scored
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)
    return scores(*args, **kw)

steps._finetune_results = scoring
sys.exit(run_process(lambda: main(sys.argv[1:])))
"""


def test_a_sigterm_while_step3_scores_after_its_last_checkpoint_stops_it_for_resume(primary_run, tmp_path):
    """Step 3 scores its --eval_file after the last checkpoint (minutes on XNLI's dev set): a
    SIGTERM there killed it with 143 and no word, which the SLURM templates do not requeue. It
    stops as in the training loop (75, one line); --resume then scores without training."""
    from mmadapt.cli import main

    out = tmp_path / "run"
    argv = ["finetune", "--task", "bible-genre", "--primary", str(primary_run), "--output_dir", str(out),
            "--seq_length", "64", "--epochs", "0.01", "--train_micro_batch_size_per_gpu", "8", "--eval_file", "bible",
            "--ds_config", str(REPO / "ds_configs" / "zero0.json")]
    proc = subprocess.run([sys.executable, "-c", TERM_WHILE_SCORING, *argv], capture_output=True, text=True,
                          cwd=REPO, env=child_env(), timeout=600)
    updates = json.loads((out / "run.json").read_text())["updates"]
    assert proc.returncode == faults.EXIT_STOPPED, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"stopped by SIGTERM at update {updates}: checkpoint "
                                                    f"{tag_for(updates)} is complete; run the same command with "
                                                    "--resume to continue"), proc.stderr[-2000:]
    assert "source_scores" not in json.loads((out / "run.json").read_text())
    logged = metrics(out)
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "run.json").read_text())["source_scores"]
    assert metrics(out) == logged and logged[-1]["step"] == updates  # nothing trained again


LAGGING_RANK = """
import os, runpy, sys
from mmadapt import steps
if os.environ["RANK"] == "1":  # its view of the final checkpoint lags rank 0's (another node's cache)
    steps.is_finished = lambda run_dir: False
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_rank_whose_view_lags_still_meets_rank_0_at_the_end(primary_run, tmp_path):
    """Whether Step 3 finished (its results written, then a barrier) is rank 0's decision: a rank that
    did not see the final checkpoint yet returned without the barrier rank 0 waited in, and rank 0
    failed after writing the results (here when the peer left; under NCCL at the collective timeout)."""
    script = tmp_path / "finetune_lagging.py"
    script.write_text(LAGGING_RANK.format(script=FINETUNE))
    out = tmp_path / "run"
    cmd = launch_cmd(2, "--task", "bible-genre", "--primary", str(primary_run), "--output_dir", str(out),
                     "--seq_length", "64", "--epochs", "0.01", "--train_micro_batch_size_per_gpu", "8",
                     "--ds_config", "ds_configs/zero2.json", *NO_DROPOUT, script=str(script))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=child_env(MMADAPT_DIST_TIMEOUT_S="20"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "final_loss" in json.loads((out / "run.json").read_text())
