"""Language-model training (Steps 1, 1b and 2) and Step 3's update, on the shared engine and
loop of engine.py.

Step 1 (pretrain: BL_BASE, BL_SMALL, MINIJOINT) trains every parameter from a seeded init.
Step 1b (MINIPOST) and Step 2 (new-language embeddings) start from given full weights and train
only some parameters (`LMJob.trainable`): the others are frozen and left out of checkpoints
(run.json says where they come from). Step 3 (fine-tuning) trains a task model (`task_step`).

This module holds the LM steps' data (`TextData`: the checks a user can get wrong, then the
tokenizer and the encoded blocks), the model of the run's family or its pipeline form, one update
over micro-batches (`lm_step`: each position scored by the family's objective, masked pieces or
next pieces), and `train_lm`, which steps.py calls with the starting weights it computed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from mmadapt import checkpoint, parallel
from mmadapt.config import LoopConfig, ModelConfig, TrainConfig, to_dict
from mmadapt.data import (MANIFEST, RAW_CORPUS_LIMIT_BYTES, TEXT, TOKENIZER, VALID, DataError, EpochOrder,
                          LayoutBatches, ReplayBatches, block_index, check_corpus, check_prepared,
                          corpus_fingerprint, file_sha256, layout_stream, layout_stream_path, line_join,
                          load_checked_tokenizer, micro_batch_range, prepare, read_manifest, replay_blocks, wait_for)
from mmadapt.engine import (LoopJob, backward, build_engine, is_pipeline, mean_over_ranks, set_trainable, train_loop,
                            trainable_by_names, with_placeholders)
from mmadapt.features import Encoded
from mmadapt.family import ModelFamily
from mmadapt.flops import flops_by_rows
from mmadapt.fusion import apply_fusion
from mmadapt.microbatch import MicroBatchFit, device_memory, merged
from mmadapt.models.layers import Padding, derive_seed, masked_positions
from mmadapt.models.pipe import scaled_losses, set_host_batches, take_head_losses
from mmadapt.run import RUN_TOKENIZER, RunSpec, Started, tensor_bytes
from mmadapt.tokenizer import kind as tokenizer_kind
from mmadapt.tokenizer import load
from mmadapt.tokens import IGNORE_INDEX
from mmadapt.expand import MERGED_TOKENIZER, Expansion, Replay


@dataclasses.dataclass(frozen=True)
class LMJob:
    """What an LM run trains. Defaults: Step 1, every parameter, from the model's seeded init."""
    step: str = "pretrain"  # one of flops.STEPS: the FLOP count logged, the progress-bar label
    # The family's parameter names, or name prefixes ending in ".", that are trained (None: all).
    trainable: tuple[str, ...] | None = None
    trainable_layers: int = 0  # Step 1b: l_t, for its FLOP count
    replay: Replay | None = None  # Step 2: source text in every batch, its loss logged apart
    # An imported decoder's text layout (run.run_text_layout): its packed blocks laid out as its
    # own tokenizer lays out text (data.LayoutBatches). None or {}: mmadapt's stream.
    text_layout: dict | None = None


# --- data ----------------------------------------------------------------------------------------------

def check_tokenizer_kind(family: ModelFamily, tokenizer: Path) -> None:
    """A run's tokenizer of a kind its family takes (ModelFamily.tokenizer_kinds), or one line."""
    found = tokenizer_kind(tokenizer)
    if found not in family.tokenizer_kinds:
        raise ValueError(f"{tokenizer} is a {found} tokenizer; the {family.name} family takes "
                         f"{', '.join(family.tokenizer_kinds)} tokenizers")


def dataset_digest(manifest: dict) -> str:
    """What a prepared dataset holds, from its manifest: its corpus's fingerprint and its
    tokenizer's. run.json records it, so that a --resume refuses a dataset prepared again at the
    same path from another text or with another tokenizer (same size or not)."""
    held = {k: manifest.get(k) for k in ("corpus_fingerprint", "tokenizer_sha256")}
    return hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:32]


def split_digest(manifest: dict) -> str:
    """How a prepared dataset's text is split (the validation fraction and seed, and what each
    part holds): the same corpus and tokenizer prepared again with another --valid_fraction
    trains on other documents in another order, which a --resume refuses too (recorded apart
    from dataset_digest, which runs recorded before this one hold)."""
    held = {k: manifest.get(k) for k in ("valid_fraction", "valid_seed", "tokens", "valid")}
    return hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:32]


class TextData:
    """The data of an LM step (run.DataPlan): a dataset prepared by `mmadapt preprocess`
    (RunSpec.data_path; `manifest`: its manifest where the step read it already), or a raw corpus
    prepared into <output_dir>/data by the run itself."""

    def __init__(self, manifest: dict | None = None):
        self.manifest = manifest

    def check(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> dict:
        if run.data_path is not None:
            manifest = check_prepared(run.data_path, model.vocab_size, run.tokenizer, self.manifest)
            if train.eval_interval and not manifest.get("valid"):
                raise ValueError(f"--eval_interval needs validation data: {run.data_path} was prepared without it "
                                 "(mmadapt preprocess --valid_fraction 0.01 ... into a new --output_dir)")
            return {"data_path": str(run.data_path.resolve()), "data_digest": dataset_digest(manifest),
                    "data_split": split_digest(manifest)}
        if run.corpus is None:
            raise ValueError("no training data: pass --data_path (a dataset made by mmadapt preprocess) or --corpus")
        corpus = Path(run.corpus)
        # the size first: check_corpus reads every byte (a 100 GB corpus for minutes), only to be sent away
        if corpus.is_file() and corpus.stat().st_size > RAW_CORPUS_LIMIT_BYTES:
            prepared = corpus.with_name(corpus.name + ".prepared")
            tok = f" --tokenizer {run.tokenizer}" if run.tokenizer else ""
            raise ValueError(f"corpus {corpus} is {corpus.stat().st_size / 2**30:.1f} GiB: prepare it once first with "
                             f"`mmadapt preprocess --corpus {corpus} --output_dir {prepared} --vocab_size "
                             f"{model.vocab_size}{tok}`, then pass --data_path {prepared}")
        corpus = check_corpus(corpus)
        if run.tokenizer is not None:
            load_checked_tokenizer(run.tokenizer, model.vocab_size)
            check_tokenizer_kind(family, run.tokenizer)
        if train.eval_interval:
            raise ValueError("--eval_interval needs validation data: prepare the corpus with mmadapt preprocess "
                             "--valid_fraction 0.01 and pass --data_path")
        return {"data_path": str((run.output_dir / "data").resolve()), "corpus": str(corpus.resolve())}

    def check_resume(self, run: RunSpec) -> None:
        manifest = run.output_dir / "data" / MANIFEST
        if (run.data_path is None and manifest.is_file()
                and corpus_fingerprint(run.corpus) != read_manifest(manifest.parent)["corpus_fingerprint"]):
            raise ValueError(f"--resume: corpus {run.corpus} changed since this run encoded it into "
                             f"{manifest.parent}; resume with the original text, or start a new --output_dir")
        own = run.output_dir / RUN_TOKENIZER
        if run.tokenizer is not None and own.is_file() and file_sha256(run.tokenizer) != file_sha256(own):
            raise ValueError(f"--resume with another tokenizer: {run.tokenizer} is not the run's {own}")

    def prepare(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> Path:
        """-> the prepared dataset, with the block index for train.seq_length, and the run's copy
        of its tokenizer (what later steps read). Global rank 0 prepares a raw corpus into
        <output_dir>/data (once; `mmadapt preprocess` does the same for large corpora, ahead of
        the job) and builds the block index, while the other ranks wait (parallel.rank0_prepares:
        what rank 0 raises, they raise). Like DeepSpeed's checkpoints, this assumes a file system
        that all nodes share."""
        data_path = run.data_path or run.output_dir / "data"
        if run.data_path is None:
            what = f"the corpus in {data_path}"
            parallel.rank0_prepares(lambda: prepare(run.corpus, data_path, model.vocab_size, tokenizer=run.tokenizer,
                                                    cfg=dataclasses.replace(run.prep, tokenizer_seed=train.seed)),
                                    what)
            wait_for(data_path / MANIFEST, what)
        indexed = family.objective.batches.indexed
        manifest = read_manifest(data_path)
        tokens, valid = manifest["tokens"], (manifest.get("valid") or {}).get("tokens")
        if not indexed and tokens <= train.seq_length:
            # packed next-token blocks read seq_length + 1 tokens: refused here, before the engine
            # is built and the record written, not by the first batch (an imported decoder's
            # laid-out stream differs by its layout's few ids per sentence and document: at the
            # margin the first batch, BlockBatches, still decides)
            raise DataError(f"{data_path} holds {tokens:,} tokens, fewer than one block of --seq_length "
                            f"{train.seq_length} reads ({train.seq_length + 1}): lower --seq_length, or give more text")
        if not indexed and train.eval_interval and valid is not None and valid <= train.seq_length:
            # the held-out split's own fix: more of the text held out, or no validation loss
            raise DataError(f"{data_path}'s validation split holds {valid:,} tokens, fewer than one block of "
                            f"--seq_length {train.seq_length} reads ({train.seq_length + 1}): prepare the text with a "
                            "larger --valid_fraction, or pass --eval_interval 0")

        def index_and_tokenizer() -> list[Path]:
            tok = run.output_dir / RUN_TOKENIZER
            tok.parent.mkdir(parents=True, exist_ok=True)  # every later step reads it: never half of it
            checkpoint.atomic_write(tok, (data_path / TOKENIZER).read_bytes())
            splits = (TEXT, VALID) if train.eval_interval else (TEXT,)
            return [block_index(data_path, train.seq_length, split) for split in splits] if indexed else []
        # None: a dataset rank 0 cannot write, whose readers pack the blocks in memory (read_blocks)
        for path in parallel.rank0_prepares(index_and_tokenizer, f"the block index of {data_path}"):
            if path is not None:
                wait_for(path, f"the block index {path}")
        return data_path


class ExpandedText(TextData):
    """Step 2 --vocab_mode expand on a raw corpus: RunSpec.tokenizer (the target's SentencePiece
    model) merged into the source's (`expansion`, vocab.expand) and the corpus encoded with the
    merged tokenizer, which the run keeps as <output_dir>/tokenizer/merged.model."""

    def __init__(self, expansion: Expansion):
        super().__init__()
        self.expansion = expansion

    def check(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> dict:
        # run.tokenizer is the target's, read by vocab.expand already; the data are checked as a raw corpus
        fields = super().check(dataclasses.replace(run, tokenizer=None), model, train, family)
        size = self.expansion.vocab_size  # the target model's, trained on the corpus (None: --tokenizer's)
        return fields if size is None else {**fields, "vocab_size": size}

    def check_resume(self, run: RunSpec) -> None:
        own = run.output_dir / RUN_TOKENIZER
        super().check_resume(dataclasses.replace(run, tokenizer=None))
        if own.is_file() and own.read_bytes() != self.expansion.model:
            raise ValueError(f"--resume with another target tokenizer: {run.tokenizer} merged into the source's is "
                             f"not the run's {own}")

    def prepare(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> Path:
        merged = run.output_dir / MERGED_TOKENIZER

        def write():
            merged.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.atomic_write(merged, self.expansion.model)
        parallel.rank0_prepares(write, f"the merged tokenizer {merged}")
        wait_for(merged, f"the merged tokenizer {merged}")
        return super().prepare(dataclasses.replace(run, tokenizer=merged), model, train, family)


class WithReplay:
    """A DataPlan (TextData, ExpandedText) and Step 2's replay text, already checked
    (expand.replay_text, before any work): the plan's checks and data, and the
    replay dataset's block index (global rank 0 builds it, the others wait), recorded as run.json's
    `replay_data`."""

    def __init__(self, plan, replay: Replay):
        self.plan, self.replay = plan, replay

    def check(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> dict:
        replay = read_manifest(self.replay.data)
        return {**self.plan.check(run, model, train, family), "replay_data": str(self.replay.data.resolve()),
                "replay_digest": dataset_digest(replay), "replay_split": split_digest(replay)}

    def check_resume(self, run: RunSpec) -> None:
        self.plan.check_resume(run)

    def prepare(self, run: RunSpec, model: ModelConfig, train: TrainConfig, family: ModelFamily) -> Path:
        data_path = self.plan.prepare(run, model, train, family)
        if family.objective.batches.indexed:
            path = parallel.rank0_prepares(lambda: block_index(self.replay.data, train.seq_length),
                                           f"the block index of {self.replay.data}")
            if path is not None:
                wait_for(path, f"the block index {path}")
        return data_path


def replay_batches(family: ModelFamily, target, replay: Replay, model: ModelConfig, train: TrainConfig,
                   layout: dict | None = None) -> ReplayBatches:
    """`target` (lm_batches') with `replay.fraction` of every update's blocks from the replay
    text, read in an order and masked with a seed of their own (and laid out as `layout`)."""
    other = lm_batches(family, replay.data, model, dataclasses.replace(train, seed=derive_seed(train.seed, "replay")),
                       layout=layout)
    return ReplayBatches(target, other, replay_blocks(replay.fraction, target.global_batch))


def lm_batches(family: ModelFamily, data_path: Path, model: ModelConfig, train: TrainConfig, split: str = TEXT,
               layout: dict | None = None):
    """This data-parallel rank's batches of the family's objective (objectives.py: masked
    blocks, or packed next-token blocks), a pure function of (seed, update). layout: an
    imported decoder's (LMJob.text_layout): its packed blocks as its tokenizer lays out text."""
    if layout and not family.objective.masked:
        # the laid-out stream is a file of the dataset: global rank 0 builds it, the others wait
        join = line_join(load(Path(data_path) / TOKENIZER))
        stream = layout_stream_path(data_path, split, layout, join)

        def shared_stream() -> bool:  # else: each rank lays out its own (LayoutBatches)
            shared = stream.with_suffix(".json").is_file() or os.access(data_path, os.W_OK)
            if shared:
                layout_stream(data_path, split, layout, join)
            return shared
        if parallel.rank0_prepares(shared_stream, f"the laid-out stream {stream}"):
            wait_for(stream.with_suffix(".json"), f"the laid-out stream {stream}")
        return LayoutBatches(data_path, train, model.vocab_size, parallel.dp_rank(), parallel.dp_world(), split,
                             layout, join)
    batches = family.objective.batches
    return batches(data_path, train, model.vocab_size, parallel.dp_rank(), parallel.dp_world(), split)


# --- the model and its engine -------------------------------------------------------------------------

def build_lm(family: ModelFamily, model_cfg: ModelConfig, seed: int) -> tuple[torch.nn.Module, dict[str, str | None]]:
    """This rank's model (or pipeline stage) and its parameter names -> the family's model names."""
    if model_cfg.pipeline_model_parallel_size > 1:
        module = family.build_pipeline(model_cfg, seed, parallel.dp_world())
        return module, {n: family.pipeline_param_name(n, model_cfg) for n, _ in module.named_parameters()}
    module = family.build_lm(model_cfg, seed)
    return module, {n: n for n, _ in module.named_parameters()}


def lm_engine(family: ModelFamily, model_cfg: ModelConfig, train: TrainConfig, ds_config: dict, job: LMJob = LMJob(),
              init_state: dict | None = None):
    """-> (engine, names, tensor-parallel layout: build_engine). parallel.init_parallel must have run."""
    module, names = build_lm(family, model_cfg, train.seed)
    trainable = trainable_by_names(job.trainable)
    set_trainable(module, names, trainable)  # before fusion: it replays frozen layers alone as CUDA graphs
    apply_fusion(module, model_cfg, family.compiled_kinds, family.graphed_kinds)
    engine, layout = build_engine(module, names, trainable, train, train.lr, train.train_iters, ds_config,
                                  init_state)
    return engine, names, layout


def client_state(family: ModelFamily, model_cfg: ModelConfig, layout: dict) -> dict:
    """What every checkpoint of this model holds besides weights: the tensor-parallel layout
    (build_engine: partition dims, a padded vocabulary's real rows) and, for a pipeline, each
    layer's name prefix (checkpoint.load_full_state_dict)."""
    state = {**layout, "model_config": to_dict(model_cfg)}
    if model_cfg.pipeline_model_parallel_size > 1:
        state["pipeline_layers"] = family.pipeline_layer_prefixes(model_cfg)
    return state


class HostBatch(NamedTuple):
    """One micro-batch as the host prepares it: everything a step needs to know about the
    batch is computed here, on CPU tensors, so that no layer has to ask the device (a boolean
    gather or `.any()` on a device tensor blocks the host until the device catches up)."""
    input_ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s], -100 where not scored (the pipeline carries them)
    masked_index: torch.Tensor  # [m] flat indices into b * s of the scored positions
    targets: torch.Tensor  # [m]
    padding: Padding
    split: int | None = None  # replay (data.ReplayBatches): the scored positions of its first rows, source text


def host_batch(input_ids: torch.Tensor, labels: torch.Tensor, pin: bool = False,
               replay_rows: int | None = None) -> HostBatch:
    """pin: page-locked copies, which the device reads asynchronously (non_blocking copies).
    replay_rows: how many of the first rows are source-language replay (their losses are
    logged apart, layers.head_losses)."""
    split = None if replay_rows is None else int(labels[:replay_rows].ge(0).sum())
    b = HostBatch(input_ids, labels, *masked_positions(labels), Padding.of(input_ids), split)
    return b._replace(**{k: getattr(b, k).pin_memory() for k in _TENSORS}) if pin else b


_TENSORS = ("input_ids", "labels", "masked_index", "targets")


def batch_to_device(batch: HostBatch, dev: torch.device) -> HostBatch:
    """Asynchronous when the host copy is pinned (`host_batch(..., pin=True)`): the step queues on."""
    return batch._replace(**{k: getattr(batch, k).to(dev, non_blocking=True) for k in _TENSORS})


class Prefetcher:
    """Builds the host batches of the next update (numpy indexing, masking, pinning) in a
    background thread while the device runs this one. `make(position)` must be a pure
    function of the position (lm_batches' are; with micro_batch_fill, of the position and a re-split
    that is fixed before the first position it changes is made: microbatch.py), so a resumed run
    sees the same batches."""

    def __init__(self, make: Callable[[int], list]):
        self.make, self.pool, self.ahead = make, ThreadPoolExecutor(1, thread_name_prefix="batches"), None

    def __call__(self, position: int) -> list:
        if self.ahead is not None and self.ahead[0] == position:
            out = self.ahead[1].result()
        else:
            out = self.make(position)
        self.ahead = (position + 1, self.pool.submit(self.make, position + 1))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _prepared(batches: list) -> list[HostBatch]:
    """(input_ids, labels) pairs become HostBatches; HostBatches stay as they are."""
    return [b if isinstance(b, HostBatch) else host_batch(*b) for b in batches]


def per_token_factors(counts: list[int], dev: torch.device,
                      per_token: bool = True) -> list[float | torch.Tensor | None]:
    """Each micro-batch's factor on its loss (a mean over its m = counts[i] scored positions: an
    MLM's masked or a decoder's scored positions, Step 3's tagged words) that makes the
    update's gradient a mean over every scored position of the update, on every data-parallel
    rank (LoopConfig.calculate_per_token_loss): m x n x dp / M, M the update's scored positions
    summed over the ranks, n its micro-batches per rank. DeepSpeed then divides by n (the
    gradient accumulation) and averages over dp as always. At DP 1, M is the host's count: host
    floats, None where the factor is 1 to the bit (one micro-batch, or every one scoring as many
    positions: the decoder's blocks), so nothing is launched. At DP > 1 M is summed on the device
    over the data-parallel group, never read by the host (no stream sync): device scalars, for
    the decoder too (a rank cannot tell that the others' counts equal its own): a fill, an
    all-reduce and a few scalar kernels per update. per_token false: every factor None."""
    n, dp = len(counts), parallel.dp_world()
    if not per_token:
        return [None] * n
    if dp == 1:
        total = max(sum(counts), 1)  # no scored position in the update: every factor 0, no 0/0
        return [None if c * n == total else c * n / total for c in counts]
    # a fill (one kernel, the count its argument), not a copy of a host tensor (a stream sync on a GPU)
    total = torch.full((), float(sum(counts)), dtype=torch.float64, device=dev)
    dist.all_reduce(total, group=parallel.parallel_state.get_data_parallel_group())
    per_batch = total.clamp(min=1) / (n * dp)  # the update's mean scored positions per micro-batch
    return [(c / per_batch).float() for c in counts]


def scored(batches: list[HostBatch]) -> list[int]:
    """Each micro-batch's scored positions (per_token_factors' counts)."""
    return [len(b.targets) for b in batches]


def _pipe_batches(engine, batches: list[HostBatch], dev, factors: list) -> iter:
    """Micro-batches as DeepSpeed's pipeline takes them, ((inputs...), labels), after handing
    this stage what the host knows about them (pipeline.set_host_batches), with each one's
    factor on its loss (`per_token_factors`; None: the loss as the heads compute it)."""
    on_dev = [batch_to_device(b, dev) for b in batches]
    set_host_batches(engine.module, [b.padding for b in batches],
                     [(b.masked_index, b.targets, b.split, f) for b, f in zip(on_dev, factors)])
    return iter([((b.input_ids, b.labels), b.labels) for b in on_dev])


def lm_step(engine, batches, num_heads: int, per_token: bool = True) -> torch.Tensor:
    """One update over this rank's micro-batches. Returns this rank's share of each head's loss
    (pipeline: zeros except on the last stage), not reduced over ranks: the mean over its
    micro-batches of their losses, each times its factor (per_token): the update's loss is their
    mean over the ranks (engine.mean_over_ranks; at DP > 1 a rank's share alone means nothing).
    num_heads: how many losses the model logs (+ 4 with replay: layers.head_losses).
    per_token (LoopConfig.calculate_per_token_loss): the update's loss, and its gradient, is
    the mean over every scored position of the update, on every rank (`per_token_factors`),
    so the split into micro-batches and ranks (the micro-batch fit's re-split too) changes
    nothing but rounding; False: the mean of the micro-batches' means (Megatron-LM's BERT), in
    which a position of a micro-batch with few scored positions weighs more."""
    dev = engine.device
    batches = _prepared(batches)
    factors = per_token_factors(scored(batches), dev, per_token)
    if is_pipeline(engine):
        engine.train_batch(_pipe_batches(engine, batches, dev, factors))
        return take_head_losses(engine.module, num_heads, engine.device)
    per_head, n = None, len(batches)
    for b, factor in zip(map(functools.partial(batch_to_device, dev=dev), batches), factors):
        split = {} if b.split is None else {"split": b.split}  # only with replay: a family's forward may not take it
        loss, heads_loss = engine(b.input_ids, masked_index=b.masked_index, targets=b.targets,
                                  padding=b.padding, **split)
        loss, heads_loss = scaled_losses(loss, heads_loss, factor, b.split)
        backward(engine, with_placeholders(loss, engine.module))
        engine.step()
        # The same sum as from zeros, to the bit (0 + x and x / 1 are x), without their launches
        part = heads_loss if n == 1 else heads_loss / n
        per_head = part if per_head is None else per_head.add_(part)
    return per_head if per_head is not None else torch.zeros(num_heads, device=dev)


@torch.no_grad()
def lm_eval(engine, batches, num_heads: int, per_token: bool = True) -> torch.Tensor:
    """Each head's loss over `batches` with dropout off, this rank's share as lm_step's (pipeline:
    the last stage's), not reduced over ranks; per_token: as lm_step's (with mean_over_ranks, a
    mean over every scored position of the batches on every rank). Consumes no random numbers:
    training resumes exactly."""
    dev = engine.device
    engine.eval()
    try:
        batches = _prepared(batches)
        factors = per_token_factors(scored(batches), dev, per_token)
        if is_pipeline(engine):
            engine.eval_batch(_pipe_batches(engine, batches, dev, factors), num_micro_batches=len(batches))
            return take_head_losses(engine.module, num_heads, engine.device)
        per_head = torch.zeros(num_heads, device=dev)
        for b, factor in zip(map(functools.partial(batch_to_device, dev=dev), batches), factors):
            losses = engine(b.input_ids, masked_index=b.masked_index, targets=b.targets, padding=b.padding)[1]
            per_head += (losses if factor is None else losses * factor) / len(batches)
        return per_head
    finally:
        engine.train()


def train_step(engine, batches, num_heads: int, per_token: bool = True) -> torch.Tensor:
    """lm_step, averaged over the data-parallel replicas (every rank gets the result)."""
    return mean_over_ranks(lm_step(engine, batches, num_heads, per_token), is_pipeline(engine))


def task_step(engine, enc: Encoded, order: EpochOrder, cfg: LoopConfig, position: int,
              per_token: bool = False) -> torch.Tensor:
    """Step 3's update: this rank's micro-batches of update `position` of a task model (rows of
    `enc` in `order`, the sample indices of data.micro_batch_range), one optimizer step each
    (DeepSpeed accumulates). Returns this rank's share of the update's loss [1], not reduced over
    ranks (as lm_step's). per_token (a tag task under calculate_per_token_loss): the update's loss,
    and its gradient, is the mean over every tagged word of the update on every rank, each
    micro-batch's mean weighted by its share (`per_token_factors`, its words counted on the host);
    else the mean of the micro-batches' means (a classify or span task: one score per row, the same)."""
    micro = [[order(g) for g in micro_batch_range(position, j, cfg, parallel.dp_rank(), parallel.dp_world())]
             for j in range(cfg.gradient_accumulation_steps)]
    factors = (per_token_factors([int(enc.labels[idx].ne(IGNORE_INDEX).sum()) for idx in micro], engine.device)
               if per_token else [None] * len(micro))
    loss_sum = torch.zeros(1, device=engine.device)
    for idx, factor in zip(micro, factors):
        ids = enc.input_ids[idx]  # padding counted here, on the host: no device sync per micro-batch
        extra = {k: t.to(engine.device, non_blocking=True) for k, t in enc.rows(idx).items()}  # token types, if any
        loss, _ = engine(ids.to(engine.device, non_blocking=True), enc.labels[idx].to(engine.device, non_blocking=True),
                         padding=Padding.of(ids), **extra)
        if factor is not None:
            loss = loss * factor
        backward(engine, loss)
        engine.step()
        loss_sum += loss.detach() / cfg.gradient_accumulation_steps
    return loss_sum


def source_rows(module: torch.nn.Module, names: dict[str, str | None]) -> list[dict]:
    """This rank's source rows of an expanded vocabulary (models.layers.split_vocab: the frozen
    block of each vocabulary-indexed weight), each {name, rows: [lo, hi], sha256 of its bytes as
    the module holds them}: what shows, in any layout, that no update moved one."""
    out = []
    for n, p in module.named_parameters():
        if getattr(p, "vocab_part", None) == "source" and names.get(n) and p.numel():
            out.append({"name": names[n], "rows": list(p.vocab_rows), "dtype": str(p.dtype).removeprefix("torch."),
                        "sha256": hashlib.sha256(tensor_bytes(p)).hexdigest()})
    return out


def _check_source_rows(engine, names: dict, before: list[dict]) -> list[dict]:
    """Every rank's source rows (`source_rows`), checked unchanged since `before` (this rank's
    at the start) and gathered: the record's `source_rows`, one entry per block (a data-parallel
    replica or a pipeline stage's tied copy that differed would add its own)."""
    after = source_rows(engine.module, names)
    if after != before:  # cannot happen: no optimizer holds them; a bug if it does
        raise AssertionError(f"an update moved frozen source rows of the expanded vocabulary: {before} -> {after}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, after)
    unique = {json.dumps(r, sort_keys=True) for rows in every for r in rows}
    return sorted((json.loads(r) for r in unique), key=lambda r: (r["name"], r["rows"]))


def eval_global_batches(eval_iters: int, blocks: int, global_batch: int) -> tuple[int, str | None]:
    """The validation global batches an evaluation scores: --eval_iters, at most those the split
    holds whole (each block once: past them the order wraps into another epoch, and the loss
    counted some blocks twice), at least one -> (batches, a warning where fewer than asked)."""
    whole = blocks // global_batch
    if eval_iters <= whole:
        return eval_iters, None
    iters = max(1, whole)
    again = "; fewer than one global batch: some blocks are scored more than once" if whole == 0 else ""
    return iters, (f"--eval_iters {eval_iters} global batches of {global_batch} ask {eval_iters * global_batch:,} "
                   f"validation blocks and the split holds {blocks:,}: the validation loss scores {iters} global "
                   f"batch{'es' if iters > 1 else ''}{again} (more: prepare the text with a larger --valid_fraction)")


def train_lm(started: Started, run: RunSpec, model_cfg: ModelConfig, train: TrainConfig, job: LMJob = LMJob(),
             init_state: dict | None = None, after_save: Callable[[int, str, int, int | None], None] | None = None,
             record: dict | None = None) -> list[dict]:
    """Train an LM job on the prepared data of `started` (start_run's), starting from
    `init_state` (full weights; None: the seeded init). Writes the run record, with `record`'s
    fields. Returns the metrics of this invocation (global rank 0; empty on other ranks)."""
    parallel.seed_everything(train.seed)
    family = started.family
    engine, names, layout = lm_engine(family, model_cfg, train, started.ds_config, job, init_state)
    data_dir = started.data
    extra = {"step": job.step, **(record or {}), "corpus": read_manifest(data_dir)["corpus"],
             "trainable": list(job.trainable) if job.trainable is not None else None}
    if model_cfg.pipeline_model_parallel_size > 1:  # which stage owns what (the family's pipeline.py)
        extra["pipeline_parts"] = [int(x) for x in engine.module.parts]
    if job.text_layout and not family.objective.masked:  # an imported decoder's layout of its packed blocks
        extra["text_layout"] = job.text_layout
    # A --resume with no complete checkpoint starts from update 0: its record is this start's (a
    # Step 2 recorded with another start rule, or none, would otherwise be resumed by that rule
    # once a checkpoint exists, adapt.StartRule.recorded)
    started.record.write(run.resume and checkpoint.latest_tag(run.output_dir / "checkpoints") is not None, **extra)
    batches = lm_batches(family, data_dir, model_cfg, train, layout=job.text_layout)
    if job.replay is not None:  # ordinary blocks of the same length: the FLOPs per block stay
        batches = replay_batches(family, batches, job.replay, model_cfg, train, job.text_layout)
    per_sequence = family.step_flops(job.step, model_cfg, train.seq_length, family.scored_fraction(train),
                                     trainable_layers=job.trainable_layers)
    # the same count with the positions the heads projected as counted (an encoder's masking
    # selects among ordinary pieces only: fewer than mask_prob of every position)
    by_rows = family.row_flops(job.step, model_cfg, train.seq_length, trainable_layers=job.trainable_layers)
    tokens = batches.global_batch * train.seq_length
    devices = parallel.launched_world_size()

    def perf(seconds: float, rows: float | None) -> dict:
        flops = flops_by_rows(per_sequence, by_rows, batches.global_batch, rows)
        return {"tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds,
                "flops_per_s_per_device": flops / seconds / devices}

    heads, pin = len(model_cfg.heads_after), engine.device.type == "cuda"
    logged = heads + (4 if job.replay is not None else 0)  # the replay's two texts: layers.split_sums
    evaluate = None
    if train.eval_interval:
        # every position of the held-out blocks (score_fraction 1): the loss measures the model, not a sample.
        # eval_iters global batches (each rank its micro-batches of each): the same blocks, and with
        # calculate_per_token_loss the same loss, however the global batch is split into micro-batches and ranks
        valid = lm_batches(family, data_dir, model_cfg, dataclasses.replace(train, score_fraction=1.0), VALID,
                           job.text_layout)
        iters, warning = eval_global_batches(train.eval_iters, len(valid), valid.global_batch)
        if warning and parallel.is_rank0():
            print(f"warning: {warning}", flush=True)
        valid_batches = [host_batch(*b, pin) for k in range(iters) for b in valid.step_batches(k)]  # the same each time
        evaluate = functools.partial(lm_eval, engine, valid_batches, heads, train.calculate_per_token_loss)
    fill = 0.0 if is_pipeline(engine) or engine.zero_cpu_offload() else train.micro_batch_fill
    memory, rank0, recorded = device_memory(engine.device), parallel.is_rank0(), [None]
    if run.resume and memory is not None and fill > 0:  # alike on every rank: all or none broadcast
        # the re-split as an earlier invocation chose it (microbatch.py), read by rank 0
        if rank0:
            recorded = [started.record.read().get("micro_batch_fit")]
        dist.broadcast_object_list(recorded, src=0)
    fit = MicroBatchFit(engine, train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps, fill,
                        memory, parallel.dp_world(), recorded[0],
                        lambda record: started.record.finish(micro_batch_fit=record) if rank0 else None,
                        print if rank0 else lambda line: None)
    prefetch = Prefetcher(lambda position: [host_batch(ids, lab, pin, *rows) for ids, lab, *rows
                                            in merged(batches.step_batches(position), fit.factor(position))])

    scored = [0]  # this rank's projected rows over the updates run (LoopJob.scored_rows): host counts

    def update(position: int) -> torch.Tensor:
        fit.before(position)
        host = prefetch(position)
        scored[0] += sum(len(b.targets) for b in host)
        losses = lm_step(engine, host, logged, train.calculate_per_token_loss)
        fit.after(position)
        return losses

    loop_job = LoopJob(step=job.step, names=names, client_state=client_state(family, model_cfg, layout),
                       exclude_frozen=job.trainable is not None, loss_names=tuple(str(l) for l in model_cfg.heads_after),
                       loss_weights=model_cfg.loss_weights, perf=perf, after_save=after_save, evaluate=evaluate,
                       eval_interval=train.eval_interval, scored_rows=lambda: scored[0],
                       split_losses=("source", "target") if job.replay is not None else None)
    before = source_rows(engine.module, names) if model_cfg.frozen_vocab_size else None
    try:
        rows = train_loop(engine, update, loop_job, train, train.train_iters, run.output_dir, run.resume)
    finally:
        prefetch.close()
    if before is not None:
        checked = _check_source_rows(engine, names, before)
        if parallel.is_rank0():
            started.record.finish(source_rows=checked)
    return rows
