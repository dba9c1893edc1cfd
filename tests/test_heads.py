"""The task heads (sequence classification, token tagging, extractive QA): losses against
hand-computed cross-entropies, the task metrics from hand-built logits, and Step 3 + Step 4 for a
tagging task (a CoNLL-U fixture) and a QA task (a slice of the real XQuAD)."""

import json
import math

import pytest
import torch

from conftest import REPO
from mmadapt import features as F
from mmadapt.config import FinetuneConfig, ModelConfig
from mmadapt.models import PRESETS
from mmadapt import steps
from mmadapt.config import Layout
from evaluation import evaluate_score, predict
from mmadapt.evaluate import load_finetuned
from mmadapt.family import WORD
from mmadapt.run import RunSpec
from mmadapt.tasks import encode, get_task, score
from mmadapt.tokenizer import load as load_sp
from mmadapt.heldout import scored_logits
from mmadapt.models.layers import Padding
from mmadapt.models.roberta.model import RobertaForTask, RobertaMLM, TransformerLayer
from mmadapt.parallel import init_parallel
from mmadapt.readers import QAExample, read_conllu, read_squad
from mmadapt.tokens import PAD_ID

XQUAD = REPO.parent / "shared" / "data" / "xquad"


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_parallel(1, 1)


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**vars(PRESETS["tiny"][0]), "vocab_size": 300, "num_layers": 2, "hidden_dropout": 0.0,
                          "attention_dropout": 0.0, "head_layers": None, **kw})


def nll(logits_row: torch.Tensor, target: int) -> float:
    """-log softmax(logits_row)[target], from its definition."""
    row = logits_row.detach().double()
    return float(torch.log(torch.exp(row - row.max()).sum()) + row.max() - row[target])


def ids_with_padding() -> torch.Tensor:
    ids = torch.randint(5, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    ids[1, 6:] = PAD_ID
    ids[2, 8:] = PAD_ID
    return ids


def test_classify_head_is_robertas_sentence_head_on_the_first_position():
    model = RobertaForTask(tiny(), "classify", 3, seed=5).eval()
    ids, labels = ids_with_padding(), torch.tensor([2, 0, 1])
    loss, logits = model(ids, labels)
    x = model.encode(ids, (2,))[0][:, 0]  # [b, h]: the <s> position's last-layer output
    expect = model.out(torch.tanh(model.dense(x)))
    torch.testing.assert_close(logits, expect)
    assert logits.shape == (3, 3)
    assert float(loss.detach()) == pytest.approx(sum(nll(logits[i], int(labels[i])) for i in range(3)) / 3, rel=1e-5)


def fc1_rows(model) -> dict[int, list[int]]:
    """Per layer (1-based), the rows (positions) its FFN reads in each call, recorded by hooks."""
    seen = {}
    for layer in model.layers:
        seen[layer.layer_number] = []
        layer.fc1.register_forward_hook(
            lambda mod, args, out, n=layer.layer_number: seen[n].append(args[0][..., 0].numel()))
    return seen


def test_evaluation_runs_the_last_layer_only_where_the_head_reads_it():
    """In evaluation a classifier's last layer runs at each row's <s> alone, an MLM's at the scored
    positions alone (the attention still over every key): the same logits and loss as the whole
    layer gives (training, here without dropout: the same math), padding or not; the layers above
    the last one wanted are not run at all. A layer class whose forward takes no rows (a family's
    own) runs whole, and its rows are gathered after it."""
    ids = ids_with_padding()  # [3, 10]
    model = RobertaForTask(tiny(num_layers=3), "classify", 3, seed=5)
    seen = fc1_rows(model)
    whole = model.train()(ids)[1]
    assert seen == {1: [30], 2: [30], 3: [30]}
    with torch.no_grad():
        at_cls = model.eval()(ids)[1]
    assert seen[3][1:] == [3] and seen[1][1:] == [30]  # one row per sequence in the last layer
    torch.testing.assert_close(at_cls, whole.detach(), rtol=0, atol=1e-6)

    lm = RobertaMLM(tiny(num_layers=3, head_layers=(2, 3)))  # two heads, as MINIJOINT's
    seen = fc1_rows(lm)
    labels = torch.full_like(ids, -100)
    scored = [(0, 0), (0, 4), (1, 5), (2, 1), (2, 7)]  # [b, s] positions, none at padding
    for b, s in scored:
        labels[b, s] = ids[b, s]
    loss, per_head = lm.train()(ids, labels)
    with torch.no_grad():
        loss_eval, per_head_eval = lm.eval()(ids, labels)
    assert seen == {1: [30, 30], 2: [30, 30], 3: [30, len(scored)]}
    torch.testing.assert_close(per_head_eval, per_head, rtol=0, atol=1e-6)
    assert float(loss_eval) == pytest.approx(float(loss.detach()), abs=1e-6)
    with torch.no_grad():
        middle = lm.encode(ids, (2,))[0]
    assert middle.shape == (3, 10, lm.config.hidden_size) and seen[3] == [30, len(scored)]  # layer 3 not run

    class OwnLayer(TransformerLayer):  # a family's own layer class, whose forward takes no rows
        def forward(self, x, mask=None):
            return super().forward(x, mask)

    lm.layers[-1].__class__ = OwnLayer  # run whole, then its scored rows gathered: the same losses
    with torch.no_grad():
        torch.testing.assert_close(lm(ids, labels)[1], per_head.detach(), rtol=0, atol=1e-6)
    assert seen[3][-1] == 30


def test_logits_at_rows_are_the_whole_logits_at_those_rows():
    """An MLM's logits at given flat positions (heldout.Scorer's scored positions): every head's
    [m, V] equals its whole [b, s, V] logits gathered there, the last layer's FFN runs at those m
    rows alone, and no [b * s, V] block is made (the heads project m rows each)."""
    ids = ids_with_padding()  # [3, 10]
    lm = RobertaMLM(tiny(num_layers=3, head_layers=(2, 3))).eval()  # two heads, as MINIJOINT's
    rows = torch.tensor([0, 4, 15, 21, 27])
    seen = fc1_rows(lm)
    projected = []
    for head in lm.heads.heads:
        head.dense.register_forward_hook(lambda mod, args, out: projected.append(args[0].shape[0]))
    with torch.no_grad():
        whole = lm.logits(ids)
        at_rows = lm.logits(ids, rows=rows)
    assert seen[3] == [30, len(rows)] and seen[2] == [30, 30]
    assert projected == [30, 30, len(rows), len(rows)]
    assert [t.shape for t in at_rows] == [(len(rows), 300)] * 2
    for w, r in zip(whole, at_rows):
        torch.testing.assert_close(r, w.reshape(-1, 300)[rows], rtol=0, atol=1e-5)

    # heldout.scored_logits (the plug-in scorer's): the primary head at each batch's scored rows,
    # through `rows` where the model's logits takes it, else gathered from its whole logits.
    class WholeLogits(RobertaMLM):  # a family's own model, whose logits takes no rows
        def logits(self, input_ids, padding=None):
            return super().logits(input_ids, padding)

    batches = [(ids, Padding.of(ids), rows, None), (ids[:2], Padding.of(ids[:2]), rows[:3], None)]
    projected.clear()
    got = scored_logits(lm, batches)
    assert projected == [5, 5, 3, 3]
    lm.__class__ = WholeLogits
    torch.testing.assert_close(scored_logits(lm, batches), got, rtol=0, atol=1e-5)
    assert projected[4:] == [30, 30, 20, 20]
    torch.testing.assert_close(got[0], whole[0].reshape(-1, 300)[rows], rtol=0, atol=1e-5)


def test_tag_head_averages_only_over_labelled_positions():
    model = RobertaForTask(tiny(), "tag", 4, seed=5).eval()
    ids = ids_with_padding()
    labels = torch.full((3, 10), -100)
    labelled = [(0, 1, 3), (0, 2, 0), (1, 1, 1), (2, 4, 2), (2, 7, 3)]
    for b, s, t in labelled:
        labels[b, s] = t
    loss, logits = model(ids, labels)
    assert logits.shape == (3, 10, 4)
    expect = sum(nll(logits[b, s], t) for b, s, t in labelled) / len(labelled)
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-5)


def tag_update(monkeypatch, enc: F.Encoded, position: int, micro: int, accumulation: int, per_token: bool):
    """(the gradient the optimizer step of update `position` of a fresh tagging model is given,
    the update's loss) over `enc`'s rows in order, micro-batches of `micro` rows accumulated."""
    from mmadapt.engine import build_engine, for_replicas, load_ds_config
    from mmadapt.train import task_step

    cfg = FinetuneConfig(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation, lr=1e-3)
    module = RobertaForTask(tiny(), "tag", 4, seed=5)
    names = {n: n for n, _ in module.named_parameters()}
    ds = for_replicas(load_ds_config(REPO / "ds_configs" / "zero1.json", cfg), 1)
    engine, _ = build_engine(module, names, lambda n: True, cfg, 1e-3, 10, ds)
    grads = []
    monkeypatch.setattr(engine.optimizer, "step", lambda *a, **kw: grads.append(
        {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}))
    loss = task_step(engine, enc, lambda g: g, cfg, position, per_token).item()
    assert len(grads) == 1
    return grads[0], loss


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_tag_tasks_update_is_the_same_however_it_is_split(monkeypatch):
    """Step 3 of a tag task under calculate_per_token_loss: an update of two micro-batches that tag
    m1 and m2 words has the gradient and loss of one micro-batch of all their rows, each weighted
    m_i / (m1 + m2) by hand; as the mean of the micro-batches' means (before, and false) it has not."""
    ids = torch.randint(5, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    tags = torch.randint(0, 4, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.full((4, 16), -100)
    labels[:2, 1:13], labels[2:, 1:3] = tags[:2, 1:13], tags[2:, 1:3]  # 24 tagged words, then 4
    enc = F.Encoded(input_ids=ids, labels=labels)
    m1, m2 = 24, 4
    one, loss1 = tag_update(monkeypatch, enc, 0, 2, 1, True)  # rows 0-1
    two, loss2 = tag_update(monkeypatch, enc, 1, 2, 1, True)  # rows 2-3
    both, loss_both = tag_update(monkeypatch, enc, 0, 2, 2, True)
    whole, loss_whole = tag_update(monkeypatch, enc, 0, 4, 1, True)
    assert both.keys() == whole.keys() and len(both) > 10
    for n in both:
        torch.testing.assert_close(both[n], (m1 * one[n] + m2 * two[n]) / (m1 + m2), rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(both[n], whole[n], rtol=1e-5, atol=1e-6, msg=n)
    assert loss_both == pytest.approx((m1 * loss1 + m2 * loss2) / (m1 + m2), rel=1e-6)
    assert loss_both == pytest.approx(loss_whole, rel=1e-6)
    means, loss_means = tag_update(monkeypatch, enc, 0, 2, 2, False)
    assert loss_means == pytest.approx((loss1 + loss2) / 2, rel=1e-6) and loss_means != pytest.approx(loss_whole)
    name = "out.weight"
    torch.testing.assert_close(means[name], (one[name] + two[name]) / 2, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(means[name], whole[name], rtol=1e-3)


def test_span_head_never_points_at_padding_and_averages_start_and_end_losses():
    model = RobertaForTask(tiny(), "span", 0, seed=5).eval()
    ids, labels = ids_with_padding(), torch.tensor([[3, 5], [0, 0], [2, 2]])
    loss, logits = model(ids, labels)
    assert logits.shape == (3, 10, 2)
    assert torch.isneginf(logits[ids.eq(PAD_ID)]).all() and torch.isfinite(logits[ids.ne(PAD_ID)]).all()
    start = sum(nll(logits[b, :, 0], int(labels[b, 0])) for b in range(3)) / 3
    end = sum(nll(logits[b, :, 1], int(labels[b, 1])) for b in range(3)) / 3
    assert float(loss.detach()) == pytest.approx((start + end) / 2, rel=1e-5)


def test_unknown_head_kind_is_refused():
    with pytest.raises(ValueError, match="task kind must be one of classify, tag, span"):
        RobertaForTask(tiny(), "regress", 1)


# --- metrics from hand-built logits ------------------------------------------------------------------

def one_hot_logits(pred: list[list[int]], classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(pred), classes).float()


def test_tag_accuracy_counts_only_labelled_positions():
    labels = torch.tensor([[-100, 0, 1, -100, -100], [-100, 2, 2, 0, -100]])
    enc = F.Encoded(torch.ones(2, 5, dtype=torch.long), labels)
    # Labelled positions: 5; right: (0,1), (1,1), (1,3) -> 60%. Unlabelled ones are all wrong.
    pred = [[1, 0, 0, 2, 2], [0, 2, 0, 0, 1]]
    got = score(get_task("pos"), one_hot_logits(pred, 3), enc, [], ["NOUN", "VERB", "DET"], FinetuneConfig())
    assert got == pytest.approx(60.0)


def test_ner_score_is_chunk_f1():
    names = ["B-PER", "I-PER", "O", "B-LOC"]
    labels = torch.tensor([[-100, 0, 1, 2, 3, -100]])
    enc = F.Encoded(torch.ones(1, 6, dtype=torch.long), labels)
    # Gold chunks PER(0-2), LOC(3); predicted PER(0-1), O, O, LOC(3): 1 of 2 right each way -> F1 50.
    pred = [[2, 0, 2, 2, 3, 2]]
    got = score(get_task("ner"), one_hot_logits(pred, 4), enc, [], names, FinetuneConfig())
    assert got == pytest.approx(50.0)


def test_qa_score_is_squad_f1_of_the_decoded_spans(tokenizer):
    sp = load_sp(tokenizer)
    context = "Moses led the people out of Egypt"
    exs = [QAExample("a", context, "Who led?", [("Moses", 0)]),
           QAExample("b", context, "From where?", [("out of Egypt", context.index("out"))])]
    enc = F.encode_span(sp, exs, seq_length=32, doc_stride=8, max_query_length=8)
    assert enc.example.tolist() == [0, 1]
    logits = torch.zeros(2, 32, 2)
    for w, (want_start, want_end) in enumerate([(0, 5), (context.index("Egypt"), len(context))]):
        pos = {int(b): i for i, (b, _) in enumerate(enc.offsets[w]) if b >= 0}
        end = {int(e): i for i, (_, e) in enumerate(enc.offsets[w]) if e >= 0}
        logits[w, pos[want_start], 0] = logits[w, end[want_end], 1] = 10.0
    # "Moses" exact (F1 100); "Egypt" for "out of Egypt": precision 1, recall 1/3 -> F1 50.
    cfg = FinetuneConfig(seq_length=32, doc_stride=8, max_query_length=8)
    assert score(get_task("xquad"), logits, enc, exs, [], cfg) == pytest.approx(75.0)


# --- Step 3 and Step 4 for tagging and QA --------------------------------------------------------------

CONLLU = """\
# sent_id = 1
1\tIn\tin\tADP\t_\t_\t2\tcase\t_\t_
2\tthe\tthe\tDET\t_\t_\t3\tdet\t_\t_
3\tbeginning\tbeginning\tNOUN\t_\t_\t5\tobl\t_\t_
4\tGod\tGod\tPROPN\t_\t_\t5\tnsubj\t_\t_
5\tcreated\tcreate\tVERB\t_\t_\t0\troot\t_\t_
6\tthe\tthe\tDET\t_\t_\t7\tdet\t_\t_
7\theaven\theaven\tNOUN\t_\t_\t5\tobj\t_\t_

# sent_id = 2
1\tAnd\tand\tCCONJ\t_\t_\t3\tcc\t_\t_
2\tGod\tGod\tPROPN\t_\t_\t3\tnsubj\t_\t_
3\tsaw\tsee\tVERB\t_\t_\t0\troot\t_\t_
4\tthe\tthe\tDET\t_\t_\t5\tdet\t_\t_
5\tlight\tlight\tNOUN\t_\t_\t3\tobj\t_\t_

"""


def run_step3(task: str, train: str, primary_run, out, **cfg):
    cfg = FinetuneConfig(**{"seq_length": 64, "train_micro_batch_size_per_gpu": 4, "log_interval": 1,
                            "lr": 1e-3, "eval_batch_tokens": 512, **cfg})
    run = RunSpec(output_dir=out, ds_config=REPO / "ds_configs" / "zero0.json",
                  layout=Layout(hidden_dropout=0.0, attention_dropout=0.0))
    summary, module = steps.finetune(run=run, step=steps.Finetune(task=task, primary=primary_run, cfg=cfg,
                                                                  train_file=train))
    return summary, module, cfg


def check_step3_and_swap(out, module, examples, cfg, de_tokenizer, num_outputs):
    """The saved model is the live one (same scores), its head has `num_outputs` outputs, and
    swapping in other embeddings and a tokenizer gives a score in range without touching the rest."""
    ft = load_finetuned(out)
    assert ft.state["out.weight"].shape[0] == num_outputs
    enc = encode(ft.task, load_sp(ft.tokenizer), examples, ft.labels, cfg)
    module.eval()
    live = score(ft.task, predict(module, enc.input_ids, 512), enc, examples, ft.labels, cfg)
    assert evaluate_score(ft, examples, cfg) == pytest.approx(live, abs=1e-9)
    fake = {"word_embeddings": torch.randn(1000, ft.state[WORD].shape[1],
                                           generator=torch.Generator().manual_seed(0)) * 0.02}
    swapped = evaluate_score(ft, examples, cfg, fake, de_tokenizer)
    assert 0.0 <= swapped <= 100.0 and math.isfinite(swapped)


def test_step3_and_step4_for_pos_tagging(primary_run, de_tokenizer, tmp_path):
    path = tmp_path / "en_ewt-ud-train.conllu"
    path.write_text(CONLLU * 4, encoding="utf-8")  # 8 sentences: 2 updates of 4
    summary, module, cfg = run_step3("pos", str(path), primary_run, tmp_path / "ft", epochs=1.0)
    assert summary["labels"] == ["ADP", "CCONJ", "DET", "NOUN", "PROPN", "VERB"]
    assert summary["updates"] == 2
    check_step3_and_swap(tmp_path / "ft", module, read_conllu(path), cfg, de_tokenizer, 6)


@pytest.mark.slow  # end to end on real data: Step 3 over its windows, then Step 4
@pytest.mark.skipif(not XQUAD.is_dir(), reason="../shared/data/xquad is not beside the repository")
def test_step3_and_step4_for_qa_on_real_xquad(primary_run, de_tokenizer, tmp_path):
    """The first article's first paragraph of the real English XQuAD (a long context, split into
    windows with a stride)."""
    data = json.loads((XQUAD / "xquad.en.json").read_text(encoding="utf-8"))
    article = {**data["data"][0], "paragraphs": data["data"][0]["paragraphs"][:1]}
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [article], "version": "1.1"}), encoding="utf-8")
    examples = read_squad(path)
    summary, module, cfg = run_step3("xquad", str(path), primary_run, tmp_path / "ft", epochs=0.5,
                                     doc_stride=16, max_query_length=16)
    assert summary["train_rows"] > summary["train_examples"] == len(examples)  # several windows per question
    check_step3_and_swap(tmp_path / "ft", module, examples, cfg, de_tokenizer, 2)
