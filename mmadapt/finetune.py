"""Step 3 (fine-tune the primary model on a source-language task, word embeddings frozen) and
Step 4 (swap in a target language's embeddings and tokenizer, evaluate zero-shot).

Step 3 starts from the primary model of a Step-1 run (its last layer; MLM heads dropped) with a
new task head, trains everything but the word embeddings through DeepSpeed's engine (data
parallel, ZeRO, megatron tensor parallel; no pipeline: fine-tuning fits one device per model
replica), and saves a DeepSpeed checkpoint without the frozen word embeddings: they are the
primary run's, which run.json points to.

Step 4 rebuilds that model, replaces `word_embeddings.word_embeddings.weight` with a Step-2
artifact's and the tokenizer with the artifact's, and scores a target-language evaluation set.
Nothing else changes: the source-language model is exactly Step 3's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mmadapt import checkpoint, parallel
from mmadapt.config import FinetuneConfig, ModelConfig, to_dict
from mmadapt.features import Encoded, best_spans, chunk_f1, encode_classify, encode_span, encode_tag, special_mask
from mmadapt.tasks import NLI_LABELS, read_nli, read_pawsx, read_squad, read_conll2003, read_conllu, squad_scores

WORD = "word_embeddings.word_embeddings.weight"
# Everything but the word embeddings: the body (positions and embedding LayerNorm included,
# they are language-independent) and the task head.
FINETUNE_TRAINABLE = ("embeddings.", "layers.", "dense.", "out.")


# --- tasks ---------------------------------------------------------------------------------------

def _read_genre(spec: str, lang: str, split: str):
    from mmadapt.corpora import GENRE_TEST_PER_CLASS, GENRE_TRAIN_PER_CLASS, genre_examples

    if spec != "bible":
        raise ValueError(f"the bible-genre task reads the packaged Bible: pass 'bible', not {spec!r}")
    return genre_examples(lang, split, GENRE_TRAIN_PER_CLASS if split == "train" else GENRE_TEST_PER_CLASS)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # model.TASK_KINDS: classify | tag | span
    metric: str  # accuracy | squad_f1 | chunk_f1, in percent
    lr: float  # the paper's peak fine-tuning learning rate
    read: Callable  # (path or spec, lang, split) -> examples
    labels: tuple[str, ...] | None = None  # None: the tags seen in the training data; QA: none


TASKS = {
    # XNLI: MultiNLI train.tsv for English training; xnli.test.tsv (every language, filtered by lang).
    "xnli": Task("xnli", "classify", "accuracy", 1e-5, lambda p, lang, split: read_nli(p, lang), NLI_LABELS),
    "pawsx": Task("pawsx", "classify", "accuracy", 1e-5, lambda p, lang, split: read_pawsx(p, lang),
                  ("different", "paraphrase")),
    "mlqa": Task("mlqa", "span", "squad_f1", 3e-5, lambda p, lang, split: read_squad(p), ()),
    "xquad": Task("xquad", "span", "squad_f1", 3e-5, lambda p, lang, split: read_squad(p), ()),
    "pos": Task("pos", "tag", "accuracy", 3e-5, lambda p, lang, split: read_conllu(p)),
    "ner": Task("ner", "tag", "chunk_f1", 3e-5, lambda p, lang, split: read_conll2003(p)),
    # The demo's task on the packaged Bible (mmadapt/corpora.py): a verse's book genre.
    "bible-genre": Task("bible-genre", "classify", "accuracy", 3e-5, _read_genre,
                        ("law_history", "poetry_wisdom", "prophets", "gospels_acts", "letters")),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def read_examples(task: Task, spec: str, lang: str, split: str) -> list:
    """A task's examples from a file (or 'bible' for bible-genre); `{lang}` in the path is
    replaced by the language."""
    spec = spec.replace("{lang}", lang)
    examples = task.read(spec, lang, split)
    if not examples:
        raise ValueError(f"{spec} holds no {task.name} examples for language {lang!r}")
    return examples


def label_names(task: Task, examples: list) -> list[str]:
    return list(task.labels) if task.labels is not None else sorted({t for ex in examples for t in ex.tags})


def encode(task: Task, sp, examples: list, labels: list[str], cfg: FinetuneConfig) -> Encoded:
    if task.kind == "classify":
        return encode_classify(sp, examples, cfg.seq_length)
    if task.kind == "tag":
        return encode_tag(sp, examples, labels, cfg.seq_length)
    return encode_span(sp, examples, cfg.seq_length, cfg.doc_stride, cfg.max_query_length)


def score(task: Task, logits: torch.Tensor, enc: Encoded, examples: list, labels: list[str],
          cfg: FinetuneConfig) -> float:
    """The task's metric, in percent, from the logits of `encode`'s rows."""
    if task.kind == "classify":
        return 100 * float((logits.argmax(-1) == enc.labels).float().mean())
    if task.kind == "span":
        return squad_scores(best_spans(logits, enc, examples, cfg.max_answer_length), examples)["f1"]
    scored = enc.labels.ne(-100)
    pred = logits.argmax(-1)
    if task.metric == "accuracy":
        return 100 * float((pred[scored] == enc.labels[scored]).float().mean())
    names = [*labels, "<unseen>"]
    gold = [[names[i] for i in enc.labels[r][scored[r]].tolist()] for r in range(len(enc))]
    pred_tags = [[names[i] for i in pred[r][scored[r]].tolist()] for r in range(len(enc))]
    return chunk_f1(gold, pred_tags)


# --- the task model from runs ------------------------------------------------------------------------

def task_model(model_cfg: ModelConfig, task: Task, num_labels: int, seed: int):
    from mmadapt.model import RobertaForTask

    return RobertaForTask(model_cfg, task.kind, num_labels, seed=seed)


def primary_state(run_dir: Path, tag: str | None) -> tuple[ModelConfig, dict]:
    """The primary model of a Step-1 run: its full depth, without MLM heads."""
    from mmadapt.adapt import load_model, read_run

    run = read_run(run_dir)
    if run.get("step") != "pretrain":
        raise ValueError(f"{run_dir} is a {run.get('step')} run: fine-tune the primary model of a pretrain run")
    cfg, state = load_model(run_dir, tag)
    cfg = dataclasses.replace(cfg, head_layers=(cfg.num_layers,))
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

    def model(self) -> torch.nn.Module:
        """The evaluation model (dropout off) with these weights."""
        parallel.init_parallel(1, 1)  # megatron's layers need their (here trivial) process groups
        model = task_model(dataclasses.replace(self.cfg, hidden_dropout=0.0, attention_dropout=0.0),
                           self.task, len(self.labels), self.run["finetune"]["seed"])
        model.load_state_dict(self.state, strict=True)
        return model.eval()


def load_finetuned(run_dir: str | os.PathLike) -> Finetuned:
    """Step 3's model: the checkpoint's trained weights + the primary run's word embeddings."""
    run_dir = Path(run_dir)
    run_file = run_dir / "run.json"
    if not run_file.is_file() or checkpoint.latest_tag(run_dir / "checkpoints") is None:
        raise ValueError(f"{run_dir} is not a finished fine-tuning run (no run.json or no complete "
                         "checkpoint): pass the --output_dir of launch/finetune.py")
    run = json.loads(run_file.read_text())
    if run.get("step") != "finetune":
        raise ValueError(f"{run_dir} is a {run.get('step')} run, not a fine-tuning run")
    cfg, primary = primary_state(Path(run["primary"]["run_dir"]), run["primary"]["tag"])
    own = {k: v for k, v in checkpoint.load_full_state_dict(run_dir / "checkpoints").items()
           if not k.endswith("_extra_state") and not k.startswith("empty_group_placeholder")}
    cfg = ModelConfig(**{**run["model"], "head_layers": tuple(run["model"]["head_layers"]),
                         "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
    return Finetuned(cfg, get_task(run["task"]), run["labels"], {WORD: primary[WORD], **own},
                     Path(run["primary"]["run_dir"]) / "tokenizer" / "spm.model", run)


def swap_embeddings(state: dict, artifact: dict) -> dict:
    """Step 4: the same weights with the target language's word embeddings [V_trg, h]."""
    new = artifact["word_embeddings"]
    if new.shape[1] != state[WORD].shape[1]:
        raise ValueError(f"the embeddings have hidden size {new.shape[1]}, the model {state[WORD].shape[1]}: "
                         "they were trained for another model")
    return {**state, WORD: new.to(state[WORD].dtype)}


@torch.no_grad()
def predict(model: torch.nn.Module, input_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([model(input_ids[i:i + batch_size])[1] for i in range(0, len(input_ids), batch_size)])


def load_sp(path: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def evaluate(ft: Finetuned, examples: list, cfg: FinetuneConfig, artifact: dict | None = None,
             tokenizer: Path | None = None) -> float:
    """Score `examples` with Step 3's model, or with it after swapping in `artifact`'s word
    embeddings and `tokenizer` (Step 4)."""
    state = ft.state if artifact is None else swap_embeddings(ft.state, artifact)
    model = dataclasses.replace(ft, state=state).model()
    sp = load_sp(tokenizer or ft.tokenizer)
    enc = encode(ft.task, sp, examples, ft.labels, cfg)
    return score(ft.task, predict(model, enc.input_ids, cfg.eval_batch_size), enc, examples, ft.labels, cfg)


# --- parallel-sentence retrieval (no fine-tuning) --------------------------------------------------

@torch.no_grad()
def sentence_vectors(model, sp, texts: list[str], seq_length: int, layer: int, batch_size: int = 64) -> torch.Tensor:
    """Mean of layer `layer`'s outputs over each text's ordinary pieces -> [n, h], unit length."""
    enc = encode_classify(sp, [(t, 0) for t in texts], seq_length)
    out = []
    for i in range(0, len(enc), batch_size):
        ids = enc.input_ids[i:i + batch_size]
        h = model.encode(ids, (layer,))[0]  # [b, s, h]
        keep = special_mask(ids)[..., None].float()
        out.append((h * keep).sum(1) / keep.sum(1).clamp(min=1))
    return torch.nn.functional.normalize(torch.cat(out), dim=-1)


def retrieval_accuracy(src_vectors: torch.Tensor, trg_vectors: torch.Tensor) -> float:
    """Percent of target sentences whose nearest source sentence (cosine, after centring each
    side, which removes each language's common direction) is their translation."""
    s = torch.nn.functional.normalize(src_vectors - src_vectors.mean(0), dim=-1)
    t = torch.nn.functional.normalize(trg_vectors - trg_vectors.mean(0), dim=-1)
    return 100 * float(((t @ s.T).argmax(1) == torch.arange(len(t))).float().mean())


# --- Step 3 -----------------------------------------------------------------------------------------

def finetune(task: Task, primary: Path, primary_tag: str | None, train_spec: str, source_lang: str,
             cfg: FinetuneConfig, layout: dict, ds_config_path: Path, output_dir: Path,
             eval_spec: str | None = None) -> tuple[dict, torch.nn.Module]:
    """Run Step 3. `layout`: ModelConfig fields a user may set (parallel sizes, dropout).
    Returns the run summary (as in run.json) and the trained module (this rank's TP shard)."""
    import deepspeed

    from mmadapt.adapt import read_run
    from mmadapt.data import micro_batch_range, EpochOrder
    from mmadapt.train import Job, _load_full_weights, adamw, load_ds_config, param_groups, warmup_linear_decay

    # --- checks before any side effect
    src = read_run(primary)
    if src.get("step") != "pretrain":
        raise ValueError(f"{primary} is a {src.get('step')} run: fine-tune the primary model of a pretrain run")
    tag = primary_tag or checkpoint.latest_tag(primary / "checkpoints")
    if tag not in checkpoint.complete_tags(primary / "checkpoints"):
        raise ValueError(f"{primary} has no complete checkpoint {tag}")
    model_cfg = dataclasses.replace(ModelConfig(**{**src["model"], "head_layers": None}), **layout).validate()
    if model_cfg.pipeline_model_parallel_size > 1:
        raise ValueError("fine-tuning does not use pipeline parallelism (a model replica fits one device): "
                         "use --pipeline_model_parallel_size 1 with data or tensor parallelism")
    cfg.validate(model_cfg)
    ds_config = load_ds_config(ds_config_path, cfg)
    parallel.check_world_size(int(os.environ.get("WORLD_SIZE", 1)), model_cfg.tensor_model_parallel_size, 1)
    if (output_dir / "run.json").is_file():
        raise ValueError(f"{output_dir} already holds a finished run: choose a new --output_dir")
    tokenizer = primary / "tokenizer" / "spm.model"
    sp = load_sp(tokenizer)
    examples = read_examples(task, train_spec, source_lang, "train")
    labels = label_names(task, examples)
    enc = encode(task, sp, examples, labels, cfg)
    eval_examples = read_examples(task, eval_spec, source_lang, "test") if eval_spec else None
    lr = cfg.lr or task.lr

    parallel.init_parallel(model_cfg.tensor_model_parallel_size, 1)
    rank = dist.get_rank()
    global_batch = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * parallel.dp_world()
    updates = max(1, math.ceil(cfg.epochs * len(enc) / global_batch))
    warmup = round(cfg.warmup_ratio * updates)
    run_info = {"step": "finetune", "task": task.name, "labels": labels, "source_lang": source_lang,
                "train": train_spec, "train_examples": len(examples), "train_rows": len(enc), "updates": updates,
                "global_batch": global_batch, "lr": lr, "primary": {"run_dir": str(primary), "tag": tag},
                "model": to_dict(model_cfg), "finetune": to_dict(cfg), "ds_config": ds_config}
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").write_text("")  # a crashed earlier attempt saved nothing
    dist.barrier()

    # --- model: primary weights, a seeded task head, word embeddings frozen
    parallel.seed_everything(cfg.seed)
    _, state = primary_state(primary, tag)
    module = task_model(model_cfg, task, len(labels), cfg.seed)
    job = Job(step="finetune", trainable=FINETUNE_TRAINABLE)
    names = {n: n for n, _ in module.named_parameters()}
    _load_full_weights(module, names, state, job)
    del state
    for n, p in module.named_parameters():
        p.requires_grad_(job.is_trainable(n))
    optimizer = adamw(param_groups(module, cfg.weight_decay), cfg, lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(warmup, updates))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, mpu=parallel.DeepSpeedMPU())
    dims = {n: p.partition_dim for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}

    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(output_dir / "tensorboard"))
    from tqdm import tqdm

    order = EpochOrder(len(enc), cfg.seed)
    dev = engine.device
    bar = tqdm(total=updates, disable=rank != 0, desc=f"finetune {task.name}", unit="upd", mininterval=2.0)
    metrics_file = output_dir / "metrics.jsonl"
    rows, t0 = [], time.perf_counter()
    for step in range(updates):
        loss_sum = torch.zeros((), device=dev)
        for j in range(cfg.gradient_accumulation_steps):
            idx = [order(g) for g in micro_batch_range(step, j, cfg.train_micro_batch_size_per_gpu,
                                                       cfg.gradient_accumulation_steps, parallel.dp_rank(),
                                                       parallel.dp_world())]
            loss, _ = engine(enc.input_ids[idx].to(dev), enc.labels[idx].to(dev))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach() / cfg.gradient_accumulation_steps
        dist.all_reduce(loss_sum, group=parallel.parallel_state.get_data_parallel_group())
        done = step + 1
        if done % cfg.log_interval == 0 or done == updates:
            row = {"step": done, "loss": loss_sum.item() / parallel.dp_world(), "lr": engine.get_lr()[0],
                   "examples_per_s": global_batch * done / (time.perf_counter() - t0)}
            if rank == 0:
                rows.append(row)
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
                writer.add_scalar("finetune/loss", row["loss"], done)
                writer.add_scalar("finetune/lr", row["lr"], done)
                bar.set_postfix(loss=f"{row['loss']:.3f}")
        bar.update(1)
    bar.close()
    checkpoint.save(engine, output_dir / "checkpoints", updates, {"tp_partition_dims": _all_dims(dims),
                                                                   "model_config": to_dict(model_cfg)},
                    exclude_frozen=True)
    summary = {**run_info, "final_loss": rows[-1]["loss"] if rows else None}
    if rank == 0:
        writer.close()
        # run.json goes last: a directory with it holds a finished model (load_finetuned).
        (output_dir / "run.json").write_text(json.dumps(summary, indent=2))
        if eval_examples is not None:  # the source-language score of exactly the saved model
            summary["source_score"] = evaluate(load_finetuned(output_dir), eval_examples, cfg)
            (output_dir / "run.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    return summary, engine.module


def _all_dims(dims: dict) -> dict:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dims)
    return {k: v for d in every for k, v in d.items()}


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


def evaluate_artifacts(finetuned: list[Path], artifacts: list[Path], eval_spec: str, eval_batch_size: int,
                       cfg_override: dict | None = None) -> list[dict]:
    """Zero-shot scores of every artifact, averaged over the fine-tuned runs (seeds). All runs must
    fine-tune the primary model the embeddings were trained for."""
    from mmadapt.adapt import read_artifact

    runs = [load_finetuned(r) for r in finetuned]
    primaries = {str(Path(r.run["primary"]["run_dir"]).resolve()) for r in runs}
    tasks = {r.task.name for r in runs}
    if len(primaries) > 1 or len(tasks) > 1:
        raise ValueError("--finetuned runs must share one primary model and task (one per seed)")
    primary = primaries.pop()
    records, cache = [], {}
    for path in artifact_dirs(artifacts):
        emb, tok, meta = read_artifact(path)
        if str(artifact_primary(meta).resolve()) != primary:
            raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)}, but the "
                             f"fine-tuned runs start from {primary}: evaluate them with that model's runs")
        lang = meta["lang"]
        if lang not in cache:
            cache[lang] = read_examples(runs[0].task, eval_spec, lang, "test")
        seeds = []
        for ft in runs:
            cfg = FinetuneConfig(**{**ft.run["finetune"], "eval_batch_size": eval_batch_size, **(cfg_override or {})})
            seeds.append(evaluate(ft, cache[lang], cfg, emb, tok))
        records.append({"system": meta["system"], "task": runs[0].task.name, "lang": lang, "step": meta["step"],
                        "flops": meta["flops"], "flops_paper": meta["flops_paper"], "v100_days": meta["v100_days"],
                        "tokens": meta["tokens"], "metric": runs[0].task.metric, "score": sum(seeds) / len(seeds),
                        "seed_scores": seeds, "artifact": str(path)})
    return records


def retrieval_records(primary_run: Path, adapt_runs: list[Path], pairs: dict[str, list[tuple[str, str]]],
                      seq_length: int = 64, layer: int | None = None) -> list[dict]:
    """Parallel-sentence retrieval through the primary model (Step 1 weights, no fine-tuning):
    source sentences with the source embeddings against target sentences with each artifact's
    embeddings. `layer`: whose outputs are pooled (default: the middle layer, ceil(L / 2),
    whose representations are the least tied to the MLM objective)."""
    from mmadapt.adapt import read_artifact
    from mmadapt.model import RobertaEncoder

    cfg, state = primary_state(primary_run, None)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    parallel.init_parallel(1, 1)
    layer = layer or math.ceil(cfg.num_layers / 2)
    model = RobertaEncoder(cfg).eval()
    model.load_state_dict(state)
    src_sp, src_vectors, records = load_sp(primary_run / "tokenizer" / "spm.model"), {}, []
    for path in artifact_dirs(adapt_runs):
        emb, tok, meta = read_artifact(path)
        lang = meta["lang"]
        if lang not in src_vectors:
            model.load_state_dict(state)
            src_vectors[lang] = sentence_vectors(model, src_sp, [a for a, _ in pairs[lang]], seq_length, layer)
        model.load_state_dict(swap_embeddings(state, emb))
        trg = sentence_vectors(model, load_sp(tok), [b for _, b in pairs[lang]], seq_length, layer)
        records.append({"system": meta["system"], "task": "retrieval", "lang": lang, "step": meta["step"],
                        "flops": meta["flops"], "flops_paper": meta["flops_paper"], "v100_days": meta["v100_days"],
                        "tokens": meta["tokens"], "metric": "accuracy",
                        "score": retrieval_accuracy(src_vectors[lang], trg), "artifact": str(path)})
    return records
