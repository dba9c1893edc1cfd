"""Step 3 (fine-tune the primary model on a source-language task, word embeddings frozen) and
Step 4 (swap in a target language's embeddings and tokenizer, evaluate zero-shot).

Step 3 (steps.finetune) starts from the primary model of a Step-1 run (its last layer; MLM heads
dropped) with a new task head, trains everything but the word embeddings through the shared
engine (engine.py: data parallel, ZeRO, megatron tensor parallel; no pipeline: fine-tuning fits
one device per model replica), and saves DeepSpeed checkpoints without the frozen word
embeddings: they are the primary run's, which run.json points to. This module holds the tasks
(the paper's, and your own: classify, pair and tag over CSV, TSV or JSON Lines), their encodings
and metrics, and the rebuilt model.

Step 4 builds that model once per fine-tuning run (seed), on the device, replaces its
`word_embeddings.word_embeddings.weight` with a Step-2 artifact's in place (and puts its own back
afterwards) and the tokenizer with the artifact's, and scores a target-language evaluation set.
Nothing else changes: the source-language model is exactly Step 3's. An evaluation set is encoded
once per tokenizer and run in token-sized batches of rows of similar length (`TokenBatches`),
each trimmed to its longest row: the padding a fixed-length batch would carry is never computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mmadapt import checkpoint
from mmadapt.config import OWN_TASK_COLUMNS, FinetuneConfig, ModelConfig
from mmadapt.features import (Encoded, best_spans, chunk_f1, encode_classify, encode_span, encode_tag, is_bio,
                              macro_f1, special_mask)
from mmadapt.tasks import (NLI_LABELS, PairExample, read_nli, read_pawsx, read_squad, read_conll2003, read_conllu,
                           read_tagged, read_texts, squad_scores)
from mmadapt.tokens import PAD_ID

WORD = "word_embeddings.word_embeddings.weight"
# Everything but the word embeddings: the body (positions and embedding LayerNorm included,
# they are language-independent) and the task head.
FINETUNE_TRAINABLE = ("embeddings.", "layers.", "dense.", "out.")


# --- tasks ---------------------------------------------------------------------------------------

def _read_genre(spec: str, lang: str, split: str, cfg: FinetuneConfig):
    from mmadapt.corpora import GENRE_TEST_PER_CLASS, GENRE_TRAIN_PER_CLASS, genre_examples

    if spec != "bible":
        raise ValueError(f"the bible-genre task reads the packaged Bible: pass 'bible', not {spec!r}")
    return genre_examples(lang, split, GENRE_TRAIN_PER_CLASS if split == "train" else GENRE_TEST_PER_CLASS)


def _read_testament(spec: str, lang: str, split: str, cfg: FinetuneConfig):
    from mmadapt.corpora import TESTAMENT_TEST_PER_CLASS, TESTAMENT_TRAIN_PER_CLASS, testament_examples

    if spec != "bible":
        raise ValueError(f"the bible-testament task reads the packaged Bible: pass 'bible', not {spec!r}")
    return testament_examples(lang, split, TESTAMENT_TRAIN_PER_CLASS if split == "train" else TESTAMENT_TEST_PER_CLASS)


def _read_own(name: str) -> Callable:
    """Your own task's reader: the columns FinetuneConfig names, else OWN_TASK_COLUMNS[name]."""
    defaults = OWN_TASK_COLUMNS[name]

    def read(path: str, lang: str, split: str, cfg: FinetuneConfig):
        if cfg.text_pair_column is not None and defaults[1] is None:
            raise ValueError(f"--text_pair_column is for --task pair, not {name}")
        text, pair, label = (given or default for given, default in
                             zip((cfg.text_column, cfg.text_pair_column, cfg.label_column), defaults))
        return read_tagged(path, text, label) if name == "tag" else read_texts(path, text, label, pair)
    return read


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # model.TASK_KINDS: classify | tag | span
    metric: str  # the default headline (see `metric_names`), in percent
    lr: float  # the paper's peak fine-tuning learning rate
    read: Callable  # (path or spec, lang, split, FinetuneConfig) -> examples
    labels: tuple[str, ...] | None = None  # None: the labels seen in the training data; QA: none
    # Your own data: an evaluation label the training file did not have is an error (the head
    # has no output for it); the paper's tag sets instead score an unseen tag as wrong.
    own: bool = False


TASKS = {
    # XNLI: MultiNLI train.tsv for English training; xnli.test.tsv (every language, filtered by lang).
    "xnli": Task("xnli", "classify", "accuracy", 1e-5, lambda p, lang, split, cfg: read_nli(p, lang), NLI_LABELS),
    "pawsx": Task("pawsx", "classify", "accuracy", 1e-5, lambda p, lang, split, cfg: read_pawsx(p, lang),
                  ("different", "paraphrase")),
    "mlqa": Task("mlqa", "span", "squad_f1", 3e-5, lambda p, lang, split, cfg: read_squad(p), ()),
    "xquad": Task("xquad", "span", "squad_f1", 3e-5, lambda p, lang, split, cfg: read_squad(p), ()),
    "pos": Task("pos", "tag", "accuracy", 3e-5, lambda p, lang, split, cfg: read_conllu(p)),
    "ner": Task("ner", "tag", "chunk_f1", 3e-5, lambda p, lang, split, cfg: read_conll2003(p)),
    # The demo's task on the packaged Bible (mmadapt/corpora.py): a verse's book genre.
    "bible-genre": Task("bible-genre", "classify", "accuracy", 3e-5, _read_genre,
                        ("law_history", "poetry_wisdom", "prophets", "gospels_acts", "letters")),
    "bible-testament": Task("bible-testament", "classify", "accuracy", 3e-5, _read_testament, ("old", "new")),
    # Your own data (CSV, TSV, JSON Lines), labels from the training file. 3e-5: the paper's rate
    # for its smaller training sets (QA, tagging), as for bible-genre.
    "classify": Task("classify", "classify", "accuracy", 3e-5, _read_own("classify"), own=True),
    "pair": Task("pair", "classify", "accuracy", 3e-5, _read_own("pair"), own=True),
    "tag": Task("tag", "tag", "accuracy", 3e-5, _read_own("tag"), own=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def read_examples(task: Task, spec: str, lang: str, split: str, cfg: FinetuneConfig | None = None,
                  labels: list[str] | None = None) -> list:
    """A task's examples from a file (or 'bible' for bible-genre); `{lang}` in the path is
    replaced by the language. `cfg` names your own task's columns; `labels` (evaluation data):
    the run's labels, which your own task's file must not go beyond."""
    spec = spec.replace("{lang}", lang)
    examples = task.read(spec, lang, split, cfg or FinetuneConfig())
    if not examples:
        raise ValueError(f"{spec} holds no {task.name} examples for language {lang!r}")
    if labels is not None:
        check_labels(task, examples, labels, spec)
    return examples


def _gold(task: Task, ex) -> list:
    return ex.tags if task.kind == "tag" else [ex.label]


def label_names(task: Task, examples: list) -> list[str]:
    """The task's fixed labels, else those of the training examples, sorted (integers by value)
    and as strings: what run.json stores and evaluation maps labels by."""
    if task.labels is not None:
        return list(task.labels)
    return [str(label) for label in sorted({g for ex in examples for g in _gold(task, ex)})]


def check_labels(task: Task, examples: list, labels: list[str], where: str = "the data") -> None:
    """Your own task: every label of `examples` must be one of the run's."""
    if task.own:
        known = set(labels)
        unseen = next((g for ex in examples for g in _gold(task, ex) if str(g) not in known), None)
        if unseen is not None:
            raise ValueError(f"{where} has the label {unseen!r}, which the model was not trained on (its labels: "
                             f"{', '.join(labels)})")


def encode(task: Task, sp, examples: list, labels: list[str], cfg: FinetuneConfig) -> Encoded:
    if task.kind == "classify":
        if task.own:  # file labels -> class ids of the run's label list
            check_labels(task, examples, labels)
            index = {name: i for i, name in enumerate(labels)}
            examples = [(ex.text, index[str(ex.label)]) if ex.text_pair is None else
                        PairExample(ex.text, ex.text_pair, index[str(ex.label)]) for ex in examples]
        return encode_classify(sp, examples, cfg.seq_length)
    if task.kind == "tag":
        check_labels(task, examples, labels)
        return encode_tag(sp, examples, labels, cfg.seq_length)
    return encode_span(sp, examples, cfg.seq_length, cfg.doc_stride, cfg.max_query_length)


def metric_names(task: Task, labels: list[str]) -> tuple[str, ...]:
    """The metrics `scores` computes for a task: classify accuracy and macro-F1; span SQuAD F1
    and exact match; tag accuracy, and chunk F1 when the tags are B-/I-/O (NER, your own BIO tags)."""
    if task.kind == "classify":
        return ("accuracy", "macro_f1")
    if task.kind == "span":
        return ("squad_f1", "exact_match")
    return ("accuracy", "chunk_f1") if task.metric == "chunk_f1" or is_bio(labels) else ("accuracy",)


def headline(task: Task, labels: list[str], cfg: FinetuneConfig) -> str:
    """The metric a run is scored by: --metric, else the task's."""
    names = metric_names(task, labels)
    if cfg.metric is not None and cfg.metric not in names:
        raise ValueError(f"--metric {cfg.metric} does not apply to {task.name}"
                         + (" with these tags" if task.kind == "tag" else "") + f": choose {' or '.join(names)}")
    return cfg.metric or task.metric


def scores(task: Task, logits: torch.Tensor, enc: Encoded, examples: list, labels: list[str],
           cfg: FinetuneConfig) -> dict[str, float]:
    """Every metric of `metric_names`, in percent, from the logits of `encode`'s rows."""
    pred = logits.argmax(-1)
    if task.kind == "classify":
        return {"accuracy": 100 * float((pred == enc.labels).float().mean()), "macro_f1": macro_f1(pred, enc.labels)}
    if task.kind == "span":
        s = squad_scores(best_spans(logits, enc, examples, cfg.max_answer_length), examples)
        return {"squad_f1": s["f1"], "exact_match": s["exact_match"]}
    scored = enc.labels.ne(-100)
    out = {"accuracy": 100 * float((pred[scored] == enc.labels[scored]).float().mean())}
    if "chunk_f1" in metric_names(task, labels):
        names = [*labels, "<unseen>"]
        gold = [[names[i] for i in enc.labels[r][scored[r]].tolist()] for r in range(len(enc))]
        pred_tags = [[names[i] for i in pred[r][scored[r]].tolist()] for r in range(len(enc))]
        out["chunk_f1"] = chunk_f1(gold, pred_tags)
    return out


def score(task: Task, logits: torch.Tensor, enc: Encoded, examples: list, labels: list[str],
          cfg: FinetuneConfig) -> float:
    """The headline metric (`headline`), in percent."""
    return scores(task, logits, enc, examples, labels, cfg)[headline(task, labels, cfg)]


# --- the task model from runs ------------------------------------------------------------------------

def task_model(model_cfg: ModelConfig, task: Task, num_labels: int, seed: int):
    from mmadapt.models.roberta.model import RobertaForTask

    return RobertaForTask(model_cfg, task.kind, num_labels, seed=seed)


def primary_state(run_dir: Path, tag: str | None) -> tuple[ModelConfig, dict]:
    """The primary model of a Step-1 run: its full depth, without MLM heads."""
    from mmadapt.adapt import load_model, read_run

    run = read_run(run_dir)
    if run.get("step") != "pretrain":
        raise ValueError(f"{run_dir} is a {run.get('step')} run: fine-tune the primary model of a pretrain run")
    cfg, state = load_model(run_dir, tag)
    cfg = dataclasses.replace(cfg, head_layers=(), head_weights=())
    return cfg, {k: v for k, v in state.items() if not k.startswith("heads.")}


@dataclass
class Finetuned:
    """A Step-3 model, rebuilt: config, task, label names, full weights, tokenizer, run.json."""
    cfg: ModelConfig
    task: Task
    labels: list[str]
    state: dict
    tokenizer: Path
    run: dict
    # The evaluation model, built by the first `model()` call: once per run (seed), however many
    # artifacts are then swapped into it.
    _model: torch.nn.Module | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def model(self) -> torch.nn.Module:
        """The evaluation model (dropout off, TP=1: plain torch layers, no process group) with
        these weights, on `parallel.device()` in `eval_dtype`: built on the first call and kept.
        Step 4 swaps artifacts into it (`swapped`, which puts these weights back afterwards), so
        it is for evaluation only."""
        if self._model is None:
            from mmadapt.parallel import device

            # vocab_size: the embeddings' own (a swapped state may hold a vocabulary of another size)
            model = task_model(dataclasses.replace(self.cfg, hidden_dropout=0.0, attention_dropout=0.0,
                                                   vocab_size=self.state[WORD].shape[0]),
                               self.task, len(self.labels), self.run["finetune"]["seed"])
            model.load_state_dict(self.state, strict=True)
            self._model = on_eval_device(model, device())
        return self._model


def is_finished(run_dir: str | os.PathLike) -> bool:
    """A fine-tuning run whose last update is in a complete checkpoint."""
    run_file = Path(run_dir) / "run.json"
    if not run_file.is_file():
        return False
    run = json.loads(run_file.read_text())
    return (run.get("step") == "finetune" and
            checkpoint.latest_tag(Path(run_dir) / "checkpoints") == checkpoint.tag_for(run["updates"]))


def load_finetuned(run_dir: str | os.PathLike) -> Finetuned:
    """Step 3's model: the final checkpoint's trained weights (fp32) + the primary run's word
    embeddings."""
    run_dir = Path(run_dir)
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise ValueError(f"{run_dir} is not a fine-tuning run (no run.json): pass the --output_dir of "
                         "launch/finetune.py")
    run = json.loads(run_file.read_text())
    if run.get("step") != "finetune":
        raise ValueError(f"{run_dir} is a {run.get('step')} run, not a fine-tuning run")
    if not is_finished(run_dir):
        raise ValueError(f"{run_dir} has not finished its {run['updates']} updates: continue it with "
                         "finetune --resume")
    cfg, primary = primary_state(Path(run["primary"]["run_dir"]), run["primary"]["tag"])
    tag = checkpoint.tag_for(run["updates"])
    own = {k: v for k, v in checkpoint.load_full_state_dict(run_dir / "checkpoints", tag).items()
           if not k.startswith("empty_group_placeholder")}
    cfg = ModelConfig(**{**run["model"], "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
    return Finetuned(cfg, get_task(run["task"]), run["labels"], {WORD: primary[WORD], **own},
                     Path(run["primary"]["run_dir"]) / "tokenizer" / "spm.model", run)


# --- Step 4: the model on the device, artifacts swapped in place, token-sized batches ---------------

def eval_dtype(device: torch.device) -> torch.dtype:
    """Step 4's precision: bf16 on a GPU, the precision mmadapt's GPU configs
    (ds_configs/*_bf16.json) train in, so the forward passes the model learned from, at half the
    memory traffic of fp32; fp32 on the CPU, the reference that the tests compare against (and
    CPUs without bf16 units emulate it slowly)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def on_eval_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` moved to `device` in `eval_dtype`, in eval mode, with no parameter needing a gradient."""
    return model.to(device, eval_dtype(device)).eval().requires_grad_(False)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device: on a GPU from pinned memory without blocking the host (the copy is queued
    on the stream, before the forward passes that read it); on the CPU, `t` itself."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def artifact_embeddings(artifact: dict, like: torch.Tensor) -> torch.Tensor:
    """An artifact's word embeddings [V_trg, h] for a model whose own are `like` [V, h]: checked
    for the model's width (V_trg may differ from V), in `like`'s dtype, on its device."""
    new = artifact["word_embeddings"]
    if new.shape[1] != like.shape[1]:
        raise ValueError(f"the embeddings have hidden size {new.shape[1]}, the model {like.shape[1]}: "
                         "they were trained for another model")
    return new.to(like.device, like.dtype)


def swap_embeddings(state: dict, artifact: dict) -> dict:
    """Step 4 on a state dict (export, a model built from it): the same weights with the target
    language's word embeddings [V_trg, h]."""
    return {**state, WORD: artifact_embeddings(artifact, state[WORD])}


@contextlib.contextmanager
def swapped(model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """`model` with its named parameters replaced by `tensors`, its own put back on exit.

    The Parameter objects are replaced, not copied into: a first dimension of another size (the
    target vocabulary) needs no rebuilt model, and the model's own weights are never written.
    `tensors` are on the model's device in its dtype already (`artifact_embeddings`)."""
    own = []
    try:
        for name, t in tensors.items():
            module, _, attr = name.rpartition(".")
            owner = model.get_submodule(module)
            old = getattr(owner, attr)
            assert t.device == old.device and t.dtype == old.dtype, (name, t.device, t.dtype)
            own.append((owner, attr, old))
            setattr(owner, attr, torch.nn.Parameter(t, requires_grad=False))
        yield model
    finally:
        for owner, attr, old in own:
            setattr(owner, attr, old)


def row_lengths(input_ids: torch.Tensor) -> torch.Tensor:
    """[n, s] -> [n]: each row's length, up to and including its last piece that is not padding."""
    positions = torch.arange(1, input_ids.shape[1] + 1)
    return (input_ids.ne(PAD_ID) * positions).amax(1) if len(input_ids) else torch.zeros(0, dtype=torch.long)


# Per-position logits past a row's batch, once padded back to [n, s, C]: span logits at padding
# are -inf, as RobertaForTask gives them (never predicted); a tag at padding has no label and
# is never scored.
PAD_LOGIT = {"span": float("-inf"), "tag": 0.0}


@dataclass
class TokenBatches:
    """The rows of input_ids [n, s] grouped for evaluation: sorted by length, longest first, each
    batch trimmed to its longest row and holding at most `batch_tokens` ids (rows x that length;
    at least one row). The batches are views of one block copied to the device once, so an
    evaluation set pays one host-to-device copy for all the seeds and artifacts that score it.

    Trimming changes no result: padding is a masked key (RobertaEncoder.encode), so a row's
    outputs at its own positions do not depend on the padding after it. Each batch's Padding is
    counted here, on the host, so that no forward pass waits for the device to count it."""
    ids: list[torch.Tensor]  # per batch [b_i, s_i], on the device
    rows: list[torch.Tensor]  # per batch [b_i]: each row's index in input_ids, on the device
    padding: list  # per batch, its model.Padding
    n: int
    seq_length: int

    @classmethod
    def plan(cls, input_ids: torch.Tensor, batch_tokens: int, device: torch.device) -> "TokenBatches":
        from mmadapt.models.roberta.model import Padding

        lengths = row_lengths(input_ids)
        order = torch.sort(lengths, descending=True, stable=True).indices  # [n]
        groups, trimmed, start = [], [], 0  # groups: (rows, length) per batch
        while start < len(order):
            longest = max(int(lengths[order[start]]), 1)
            rows = order[start:start + max(1, batch_tokens // longest)]
            groups.append((len(rows), longest))
            trimmed.append(input_ids[rows, :longest].reshape(-1))
            start += len(rows)
        block = to_device(torch.cat([*trimmed, order]), device)  # one copy: the ids, then the order
        parts = block.split([b * s for b, s in groups] + [len(order)])
        ids = [p.view(b, s) for p, (b, s) in zip(parts, groups)]
        padding = [Padding.of(t.view(b, s)) for t, (b, s) in zip(trimmed, groups)]  # host tensors: no wait
        return cls(ids, list(parts[-1].split([b for b, _ in groups])), padding, len(input_ids), input_ids.shape[1])

    @torch.no_grad()
    def run(self, fn, per_position: bool, fill: float = 0.0) -> torch.Tensor:
        """fn(ids [b, s_i], its Padding) -> [b, ...], or per position [b, s_i, ...], over every
        batch -> fp32 on the CPU in input_ids' row order: [n, ...], or [n, s, ...] with `fill`
        past each row's batch."""
        out = None
        for ids, rows, padding in zip(self.ids, self.rows, self.padding):
            y = fn(ids, padding).float()
            if out is None:
                shape = (self.n, self.seq_length, *y.shape[2:]) if per_position else (self.n, *y.shape[1:])
                out = torch.full(shape, fill, dtype=torch.float32, device=y.device)
            if per_position:
                out[rows, :ids.shape[1]] = y
            else:
                out[rows] = y
        assert out is not None, "no rows to evaluate"
        return out.cpu()

    def logits(self, model: torch.nn.Module) -> torch.Tensor:
        """A RobertaForTask's logits, as for the full rows: [n, C] (classify) or [n, s, C]."""
        return self.run(lambda ids, padding: model(ids, padding=padding)[1], model.kind != "classify",
                        PAD_LOGIT.get(model.kind, 0.0))


def predict(model: torch.nn.Module, input_ids: torch.Tensor, batch_tokens: int) -> torch.Tensor:
    """A RobertaForTask's logits of the rows of input_ids [n, s], run on the model's device in
    token-sized batches (`TokenBatches`): [n, C], or [n, s, C] for tag and span; fp32, on the CPU."""
    return TokenBatches.plan(input_ids, batch_tokens, device_of(model)).logits(model)


def load_sp(path: Path):
    from mmadapt.tokenizer import load

    return load(path)


@dataclass
class EvalSet:
    """Evaluation examples encoded with one tokenizer and planned into token-sized batches on the
    device: made once per (tokenizer, language), scored by every seed and artifact that share them."""
    examples: list
    enc: Encoded
    batches: TokenBatches


def eval_set(task: Task, sp, examples: list, labels: list[str], cfg: FinetuneConfig,
             device: torch.device) -> EvalSet:
    enc = encode(task, sp, examples, labels, cfg)
    return EvalSet(examples, enc, TokenBatches.plan(enc.input_ids, cfg.eval_batch_tokens, device))


def set_logits(ft: Finetuned, data: EvalSet, artifact: dict | None = None) -> torch.Tensor:
    """The logits of `data`'s rows (`TokenBatches.logits`) with Step 3's model, or with
    `artifact`'s word embeddings swapped into it (Step 4); the model is left as it was."""
    model = ft.model()
    swap = {} if artifact is None else {WORD: artifact_embeddings(artifact, model.get_parameter(WORD))}
    with swapped(model, swap):
        return data.batches.logits(model)


def score_set(ft: Finetuned, data: EvalSet, cfg: FinetuneConfig, artifact: dict | None = None) -> dict[str, float]:
    """Every metric of `data` (`scores`) from `set_logits`."""
    return scores(ft.task, set_logits(ft, data, artifact), data.enc, data.examples, ft.labels, cfg)


def evaluate_scores(ft: Finetuned, examples: list, cfg: FinetuneConfig, artifact: dict | None = None,
                    tokenizer: Path | None = None) -> dict[str, float]:
    """Every metric of `examples` (`scores`) with Step 3's model, or with it after swapping in
    `artifact`'s word embeddings and `tokenizer` (Step 4)."""
    data = eval_set(ft.task, load_sp(tokenizer or ft.tokenizer), examples, ft.labels, cfg, device_of(ft.model()))
    return score_set(ft, data, cfg, artifact)


def evaluate(ft: Finetuned, examples: list, cfg: FinetuneConfig, artifact: dict | None = None,
             tokenizer: Path | None = None) -> float:
    """`evaluate_scores`' headline metric."""
    return evaluate_scores(ft, examples, cfg, artifact, tokenizer)[headline(ft.task, ft.labels, cfg)]


# --- parallel-sentence retrieval (no fine-tuning) --------------------------------------------------

def sentence_vectors(model, sp, texts: list[str], seq_length: int, layer: int,
                     batch_tokens: int = FinetuneConfig.eval_batch_tokens) -> torch.Tensor:
    """Mean of layer `layer`'s outputs over each text's ordinary pieces -> [n, h], unit length
    (fp32, on the CPU), in token-sized batches on the model's device."""
    enc = encode_classify(sp, [(t, 0) for t in texts], seq_length)

    def pool(ids: torch.Tensor, padding) -> torch.Tensor:  # [b, s_i] -> [b, h]
        h = model.encode(ids, (layer,), padding)[0].float()  # [b, s_i, h], summed in fp32
        keep = special_mask(ids)[..., None].float()
        return (h * keep).sum(1) / keep.sum(1).clamp(min=1)

    vectors = TokenBatches.plan(enc.input_ids, batch_tokens, device_of(model)).run(pool, per_position=False)
    return torch.nn.functional.normalize(vectors, dim=-1)


def retrieval_accuracy(src_vectors: torch.Tensor, trg_vectors: torch.Tensor) -> float:
    """Percent of target sentences whose nearest source sentence (cosine, after centring each
    side, which removes each language's common direction) is their translation."""
    s = torch.nn.functional.normalize(src_vectors - src_vectors.mean(0), dim=-1)
    t = torch.nn.functional.normalize(trg_vectors - trg_vectors.mean(0), dim=-1)
    return 100 * float(((t @ s.T).argmax(1) == torch.arange(len(t))).float().mean())


# --- Step 4 over series of Step-2 artifacts ------------------------------------------------------------

def artifact_dirs(paths: list[Path]) -> list[Path]:
    """Artifact directories, an adapt run's expanded to all its artifacts in step order."""
    out = []
    for p in paths:
        if (p / "embeddings.pt").is_file():
            out.append(p)
        elif (p / "embeddings").is_dir():
            found = sorted(d for d in (p / "embeddings").iterdir() if (d / "embeddings.pt").is_file())
            if not found:
                raise ValueError(f"{p} holds no Step-2 embeddings yet: let its adapt run save a checkpoint")
            out += found
        else:
            raise ValueError(f"{p} is neither a Step-2 artifact nor an adapt run directory")
    return out


def artifact_primary(meta: dict) -> Path:
    """The primary model that an artifact's embeddings belong to: the Step-2 source run, or for
    MINIPOST the run its mini-model was built from."""
    src = Path(meta["source"])
    run = json.loads((src / "run.json").read_text())
    return Path(run["frozen_from"]["run_dir"]) if run.get("step") == "minipost" else src


def recorded_config(ft: Finetuned, **changes) -> FinetuneConfig:
    """The FinetuneConfig of a run's run.json, with `changes`. A field that no longer exists is
    dropped (eval_batch_size: eval_batch_tokens replaced it); a field the record lacks (it
    predates the field) takes its default."""
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    return FinetuneConfig(**{**{k: v for k, v in ft.run["finetune"].items() if k in names}, **changes})


def evaluate_artifacts(finetuned: list[Path], artifacts: list[Path], eval_spec: str,
                       eval_batch_tokens: int | None = None, cfg_override: dict | None = None) -> list[dict]:
    """Zero-shot scores of every artifact, averaged over the fine-tuned runs (seeds). All runs must
    fine-tune the primary model the embeddings were trained for. eval_batch_tokens None: each
    run's own (run.json).

    Each run's model is built once (`Finetuned.model`) and every artifact swapped into it; each
    evaluation set is encoded and put on the device once per (tokenizer, language)."""
    from mmadapt.adapt import read_artifact, system_label
    from mmadapt.data import file_sha256

    paths = artifact_dirs(artifacts)  # the cheap check first
    runs = [load_finetuned(r) for r in finetuned]
    primaries = {str(Path(r.run["primary"]["run_dir"]).resolve()) for r in runs}
    tasks = {r.task.name for r in runs}
    if len(primaries) > 1 or len(tasks) > 1:
        raise ValueError("--finetuned runs must share one primary model and task (one per seed)")
    primary = primaries.pop()
    changes = {**({} if eval_batch_tokens is None else {"eval_batch_tokens": eval_batch_tokens}),
               **(cfg_override or {})}
    cfgs = [recorded_config(ft, **changes) for ft in runs]

    # The first run's settings read the evaluation files (your own task's columns) and name the
    # headline; every metric is recorded, averaged over the seeds.
    task, labels, metric = runs[0].task, runs[0].labels, headline(runs[0].task, runs[0].labels, cfgs[0])
    records, examples, sets = [], {}, {}
    for path in paths:
        emb, tok, meta = read_artifact(path)
        if str(artifact_primary(meta).resolve()) != primary:
            raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)}, but the "
                             f"fine-tuned runs start from {primary}: evaluate them with that model's runs")
        lang = meta["lang"]
        if lang not in examples:
            examples[lang] = read_examples(task, eval_spec, lang, "test", cfgs[0], labels)
        # Every artifact of an adapt run carries a copy of one tokenizer: known by its content.
        tokenizer = file_sha256(tok)
        seeds = []
        for ft, cfg in zip(runs, cfgs):
            model = ft.model()
            key = (tokenizer, lang, tuple(ft.labels), cfg.seq_length, cfg.doc_stride, cfg.max_query_length,
                   cfg.eval_batch_tokens)  # what the encoding and the batches depend on
            if key not in sets:
                sets[key] = eval_set(task, load_sp(tok), examples[lang], ft.labels, cfg, device_of(model))
            # On the device in the model's dtype after the first seed: one copy for all of them.
            emb = {"word_embeddings": artifact_embeddings(emb, model.get_parameter(WORD))}
            seeds.append(score_set(ft, sets[key], cfg, emb))
        chance = majority_share(examples[lang]) if task.kind == "classify" and metric == "accuracy" else None
        records.append({"system": system_label(meta), "task": task.name, "lang": lang, "step": meta["step"],
                        "flops": meta["flops"], "flops_paper": meta["flops_paper"], "v100_days": meta["v100_days"],
                        "tokens": meta["tokens"], "metric": metric,
                        "score": sum(s[metric] for s in seeds) / len(seeds),
                        "scores": {k: sum(s[k] for s in seeds) / len(seeds) for k in seeds[0]},
                        "seed_scores": [s[metric] for s in seeds], "chance": chance, "artifact": str(path)})
    return records


def majority_share(examples: list) -> float:
    """Accuracy (percent) of always predicting the most frequent gold label: the chance level."""
    import collections

    gold = [ex[1] if isinstance(ex, tuple) else ex.label for ex in examples]
    return 100 * max(collections.Counter(map(str, gold)).values()) / len(gold)


def retrieval_records(primary_run: Path, adapt_runs: list[Path], pairs: dict[str, list[tuple[str, str]]],
                      seq_length: int = 64, layer: int | None = None) -> list[dict]:
    """Parallel-sentence retrieval through the primary model (Step 1 weights, no fine-tuning):
    source sentences with the source embeddings against target sentences with each artifact's
    embeddings. `layer`: whose outputs are pooled (default: the middle layer, ceil(L / 2),
    whose representations are the least tied to the MLM objective)."""
    from mmadapt.adapt import read_artifact, system_label
    from mmadapt.models.roberta.model import RobertaEncoder
    from mmadapt.parallel import device

    cfg, state = primary_state(primary_run, None)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    layer = layer or math.ceil(cfg.num_layers / 2)
    model = RobertaEncoder(cfg)
    model.load_state_dict(state)
    model = on_eval_device(model, device())  # built once; each artifact is swapped into it
    src_sp, src_vectors, records = load_sp(primary_run / "tokenizer" / "spm.model"), {}, []
    for path in artifact_dirs(adapt_runs):
        emb, tok, meta = read_artifact(path)
        lang = meta["lang"]
        if lang not in src_vectors:
            src_vectors[lang] = sentence_vectors(model, src_sp, [a for a, _ in pairs[lang]], seq_length, layer)
        with swapped(model, {WORD: artifact_embeddings(emb, model.get_parameter(WORD))}):
            trg = sentence_vectors(model, load_sp(tok), [b for _, b in pairs[lang]], seq_length, layer)
        records.append({"system": system_label(meta), "task": "retrieval", "lang": lang, "step": meta["step"],
                        "flops": meta["flops"], "flops_paper": meta["flops_paper"], "v100_days": meta["v100_days"],
                        "tokens": meta["tokens"], "metric": "accuracy", "chance": 100 / len(pairs[lang]),
                        "score": retrieval_accuracy(src_vectors[lang], trg), "artifact": str(path)})
    return records
