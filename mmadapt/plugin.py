"""Step 4 without a task: do the new embeddings plug into the primary model?

The plug-in metric is the loss of held-out target-language text, scored by the model family's
objective (objectives.py: masked pieces for the encoder, next pieces for the decoder), through the
**primary** model's primary head (its last layer) with a Step-2 artifact swapped in: word
embeddings (tied to the output projection) and output bias. For MINIJOINT and MINIPOST the
embeddings were trained over the mini-model and are scored through a full model they never saw;
that they work there is the paper's claim.

For the encoder every scored position's input is <mask> (heldout_batches: the positions
pretraining's masking selects, none left visible, Objective.heldout), so the loss is what the
model predicts from the context alone.
A loss alone does not say whether the model uses context: the output bias alone can learn the
target pieces' frequencies. So every artifact is scored beside references on the same masked
positions:
    unigram     the loss of the unigram distribution of the target pieces (counted on the Step-2
                training text, add-one smoothed): what the output bias alone can reach
    start       the embeddings Step 2 started from (its artifact of update 0, as initialised by
                TrainConfig.embedding_init), which is also scored as a point of its own
and the headline is the **contextual gain**, unigram - loss (nats per masked piece). The
ceiling is an artifact trained over the full primary model of the same source run (for
MINIJOINT: `adapt --system bl_base --source <minijoint run>`), recorded as system
`<recipe>:full` (adapt.system_label).

Masking is deterministic (the dataset's validation split, selected with a fixed seed), so the
curves of one language are comparable across systems. The model is built once, on the
device in Step 4's precision (evaluate.eval_dtype), and each artifact is swapped into it in
place; the held-out batches go to the device once per language. Needs no process group.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from mmadapt.adapt import (ARTIFACT_FILE, artifact_state, bias_shift, bounded_over, output_shift, read_artifact,
                           step2_start_with_primary)
from mmadapt.checkpoint import tag_for
from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.data import TEXT, TOKENIZER, VALID, file_sha256, read_manifest
from mmadapt.evaluate import (PrimaryRef, artifact_dirs, artifact_embeddings, artifact_primary, artifact_primary_ref,
                              device_of, host_to_device, on_eval_device, record_base, swapped)
from mmadapt.family import ModelFamily
from mmadapt.models.layers import Padding, derive_seed, masked_positions, new_rows_name
from mmadapt.objectives import MLM, Objective
from mmadapt.parallel import device, is_rank0
from mmadapt.run import Source, read_source, require_head, weights_fingerprint

METRIC = "contextual_gain"
UNIGRAM_MAX_TOKENS = 50_000_000  # counted from the start of the training text: plenty for frequencies


def primary_head_state(primary_run: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The primary model with only its primary head (after its last layer), as a one-head
    config (dropout off) and state dict (that head renamed head 0)."""
    source = read_source(primary_run)
    require_head(source, "the plug-in metric")
    return primary_head(source.family, source.cfg, source.weights())


def primary_head(family: ModelFamily, cfg: ModelConfig, state: dict[str, torch.Tensor]
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`primary_head_state` of a run's full weights."""
    cfg, state = family.primary_model(cfg, state)
    return dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0), state


def unigram_logprobs(data_path: Path, vocab_size: int) -> torch.Tensor:
    """log p(piece) [V] of the pieces of the dataset's training text, add-one smoothed."""
    manifest = read_manifest(data_path)
    tokens = np.memmap(Path(data_path) / f"{TEXT}.bin", dtype=manifest["dtype"], mode="r")[:UNIGRAM_MAX_TOKENS]
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size] + 1.0
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def heldout_batches(data_path: Path, seq_length: int, vocab_size: int, blocks: int, batch_size: int,
                    seed: int = 0, objective: Objective = MLM, split: str = VALID
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `blocks` blocks of the dataset's validation split (or `split`) in a seeded order,
    scored by the family's objective: the same positions for every artifact of this tokenizer.

    MLM: the positions pretraining's masking selects (a fixed seed), every one of them replaced by
    <mask> (Objective.heldout says why: tests/test_plugin.py shows a model that predicts its
    input piece beating the unigram reference under BERT's 80/10/10, and unable to here)."""
    # Causal: every position (score_fraction 1), whatever Step 2 scored: the metric measures the artifact.
    held_out = TrainConfig(seq_length=seq_length, seed=seed, train_micro_batch_size_per_gpu=batch_size,
                           score_fraction=1.0)
    data = objective.batches(data_path, held_out, vocab_size, split=split)
    n = min(blocks, len(data)) // batch_size
    if n == 0:
        raise ValueError(f"{data_path}'s {'validation split' if split == VALID else 'text'} holds {len(data)} blocks of {seq_length}, fewer than one "
                         f"batch of {batch_size}: prepare it with a larger --valid_fraction")
    return [objective.heldout(*data.micro_batch(k, 0)) for k in range(n)]


def plugin_model(family: ModelFamily, cfg: ModelConfig, state: dict) -> torch.nn.Module:
    """The family's one-head LM with `state` (vocab from its rows), on the device for evaluation."""
    cfg = dataclasses.replace(cfg, vocab_size=state[family.word].shape[0])
    model = family.build_lm(cfg)
    model.load_state_dict(state)
    return on_eval_device(model, device())


def on_device(batches: list, device: torch.device) -> list:
    """Held-out (ids [b, s], labels [b, s]) batches as (ids, Padding, masked_index [m],
    targets [m]) on `device`: the padding and masked positions counted on the host, where that
    costs no wait for the device."""
    return [(host_to_device(ids, device), Padding.of(ids),
             *(host_to_device(t, device) for t in masked_positions(labels))) for ids, labels in batches]


@torch.no_grad()
def masked_loss(model: torch.nn.Module, batches: list) -> float:
    """Mean loss per masked piece of a one-head LM over `on_device` batches (the model's
    own forward: its loss is the batch's mean over its m masked pieces). Summed on the device and
    read once at the end: no host-device synchronisation per batch."""
    total, count = 0.0, 0
    for ids, padding, masked_index, targets in batches:
        if not len(targets):  # a short block with no position selected: its mean loss is NaN (0 / 0)
            continue
        loss, _ = model(ids, masked_index=masked_index, targets=targets, padding=padding)
        total = total + loss * len(targets)
        count += len(targets)
    return float(total) / count


def unigram_loss(logp: torch.Tensor, batches: list) -> float:
    labels = torch.cat([l[l.ge(0)] for _, l in batches])
    return float(-logp[labels].mean())


def _swap(family: ModelFamily, model: torch.nn.Module, emb: dict, meta: dict) -> dict:
    """Step 4's swap (embeddings, checked for the model's width) plus the head's other
    vocabulary-indexed parameters (the encoder's output bias), as `evaluate.swapped` takes them:
    in the model's dtype, on its device. An expanded vocabulary's keep the model's own source
    rows (adapt.artifact_state)."""
    out = {family.word: artifact_embeddings(emb, model.get_parameter(family.word))}
    names = family.artifact_keys().values()
    own = {name: model.get_parameter(name) for name in names if name in dict(model.named_parameters())}
    for name, t in artifact_state(family, emb, meta, own).items():
        out[name] = t.to(own[name].device, own[name].dtype)
    return out


def _start_embeddings(adapt_run: Path, tokenizer: Path) -> dict:
    """The embeddings and bias the adapt run started from: its artifact of update 0 where Step 2
    saved one (steps.ArtifactWriter.save_start); for a run recorded before that, recomputed (the
    same seeded draw, TrainConfig.embedding_init and expand_output_start as adapt_embeddings';
    runs recorded before those fields: overlap, and the output side as the input side)."""
    start = adapt_run / "embeddings" / tag_for(0)
    if (start / ARTIFACT_FILE).is_file():
        return read_artifact(start)[0]
    run = json.loads((adapt_run / "run.json").read_text())
    src = run["frozen_from"]
    train = run["train"]
    source = read_source(src["run_dir"], src["tag"])
    nats = train.get("expand_source_nats", TrainConfig.expand_source_nats)
    body, init, _, primary = step2_start_with_primary(run["system"], source, None, tokenizer,
                                derive_seed(train["seed"], f"embeddings.{run['lang']}"), run.get("mini_layers"),
                                train.get("embedding_init", "overlap"), train.get("vocab_mode", "replace"),
                                train.get("expand_output_start", "embedding_init"), nats)
    if "output_shift" in run or "bias_shift" in run:  # a bounded start calibrated on source text
        init, _ = off_source_start(source, run.get("replay_data"), train["seq_length"], body, init, primary, nats)
    expanded = run["model"].get("frozen_vocab_size", 0)
    return {key: torch.cat([init[name], init[new_rows_name(name)]]) if expanded else init[name]
            for key, name in source.family.artifact_keys().items() if name in init}


def plugin_records(primary_run: Path, adapt_runs: list[Path], data_paths: dict[str, Path], seq_length: int,
                   blocks: int = 256, batch_size: int = 32, seed: int = 0) -> list[dict]:
    """Plug-in records of every artifact of `adapt_runs` (whose embeddings belong to the primary
    model of `primary_run`), scored on the validation split of `data_paths[lang]` (a prepared
    dataset whose tokenizer is the artifacts')."""
    source = read_source(primary_run)
    family, full = source.family, source.weights()
    # Artifacts name their primary model by its weights' fingerprint (older ones by path).
    primary = PrimaryRef(Path(primary_run), weights_fingerprint(full))
    cfg, state = primary_head(family, source.cfg, full)
    del full
    model = plugin_model(family, cfg, state)  # once: every artifact (and start) is swapped into it
    refs: dict[str, dict] = {}  # per language: batches (on the host and the device) and the unigram loss
    starts: dict[Path, float] = {}
    records = []
    for path in artifact_dirs(adapt_runs):
        emb, tok, meta = read_artifact(path)
        if not artifact_primary_ref(meta).same(primary):
            raise ValueError(f"{path} holds embeddings for the primary model {artifact_primary(meta)}, not "
                             f"{primary_run}" + (" (their weights differ)" if meta.get("primary_fingerprint") else ""))
        lang = meta["lang"]
        if lang not in data_paths:
            raise ValueError(f"no held-out {lang} text: pass a prepared {lang} dataset with a validation split")
        data = Path(data_paths[lang])
        if file_sha256(data / TOKENIZER) != file_sha256(tok):
            raise ValueError(f"{path} uses another tokenizer than {data}: score it on the dataset Step 2 trained on")
        v = emb["word_embeddings"].shape[0]
        if lang not in refs:
            batches = heldout_batches(data, seq_length, v, blocks, batch_size, seed, family.objective)
            refs[lang] = {"batches": batches, "unigram": unigram_loss(unigram_logprobs(data, v), batches),
                          "on_device": on_device(batches, device_of(model))}
        batches, unigram = refs[lang]["batches"], refs[lang]["unigram"]
        run = path.parent.parent
        if run not in starts:
            with swapped(model, _swap(family, model, _start_embeddings(run, tok), meta)):
                starts[run] = masked_loss(model, refs[lang]["on_device"])
        with swapped(model, _swap(family, model, emb, meta)):
            loss = masked_loss(model, refs[lang]["on_device"])
        records.append({**record_base(meta, family.objective.plugin_task), "metric": METRIC, "score": unigram - loss,
                        "chance": 0.0, "loss": loss,
                        "unigram_loss": unigram, "start_loss": starts[run], "start_gain": unigram - starts[run],
                        "masked_pieces": int(sum(int(l.ge(0).sum()) for _, l in batches)),
                        "artifact": str(path)})
    return records


def source_text(primary_run: Path, data: Path | None = None) -> tuple[Path, str] | None:
    """The source-language text an expanded vocabulary is scored on: `data` (a prepared dataset in
    the primary run's ids, e.g. Step 2's replay data) or else the primary run's own data, each
    its validation split when it has one, else its training text -> (dataset, split); None for a
    run with no data (an import) and no `data`."""
    data = data or read_source(primary_run).record.get("data_path")
    if not data:
        return None
    return Path(data), VALID if read_manifest(data).get("valid") else TEXT


class SourceProbe:
    """What an expanded vocabulary (Step 2 --vocab_mode expand) does to the source language, on
    held-out source text (`source_text`) through the primary model, by its own objective (as the
    plug-in metric scores the target): its loss per scored piece with its own vocabulary
    (`before`), and, with an artifact's tensors swapped in (its source rows kept, the new rows
    appended: the softmax now spans the new pieces, so the loss moves with every source row
    frozen), the loss and the KL from the primary model's own distribution to the expanded one,
    averaged over the scored positions. The input is source ids only and the source rows are the
    model's own, so the expanded logits' first V_source columns are the source model's logits:
    its distribution is their softmax. The KL at a position is then -log(1 - the new pieces'
    share), which is also by how much the loss rises there: the two agree to rounding."""

    def __init__(self, primary_run: Path, text: tuple[Path, str], seq_length: int = 64, blocks: int = 256,
                 batch_size: int = 32, tag: str | None = None):
        """tag: the primary run's checkpoint (None: its newest)."""
        source = read_source(primary_run, tag)
        require_head(source, "the expand report")
        self.family = source.family
        cfg, state = primary_head(self.family, source.cfg, source.weights())
        self.model, self.data = plugin_model(self.family, cfg, state), f"{text[0]} ({text[1]})"
        batches = heldout_batches(text[0], seq_length, cfg.vocab_size, blocks, batch_size,
                                  objective=self.family.objective, split=text[1])
        self.scored = int(sum(int(l.ge(0).sum()) for _, l in batches))
        self.batches = on_device(batches, device_of(self.model))
        self.before = masked_loss(self.model, self.batches)
        self.source_size, self.cfg = cfg.vocab_size, cfg

    @torch.no_grad()
    def head_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The primary head's normed output y [m, h] at the scored positions (what its vocabulary
        projection reads: a forward hook on the norm the family's OutputPath names) and the source
        logits' logsumexp [m] there."""
        norm = self.model.get_submodule(self.family.output_path(self.cfg).norm_weight.rsplit(".", 1)[0])
        seen: list[torch.Tensor] = []
        hook = norm.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            logits = self._logits()
        finally:
            hook.remove()
        ys = [y.reshape(-1, y.shape[-1]).index_select(0, masked_index)
              for y, (_, _, masked_index, _) in zip(seen, self.batches, strict=True)]
        return torch.cat(ys).float(), torch.cat([torch.logsumexp(l.float(), -1) for l in logits])

    @torch.no_grad()
    def _logits(self) -> list[torch.Tensor]:
        """The primary head's logits [m, V] at each batch's scored positions."""
        out = []
        for ids, padding, masked_index, _ in self.batches:
            logits = self.model.logits(ids, padding)[0]  # [b, s, V]
            out.append(logits.reshape(-1, logits.shape[-1]).index_select(0, masked_index))
        return out

    def score(self, tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, float]:
        """tensors: an expanded artifact's ({"word_embeddings": [V', h], ...}), meta: its meta.json
        -> {"source_loss", "source_kl"} (nats per scored piece)."""
        loss = kl = 0.0
        with swapped(self.model, _swap(self.family, self.model, tensors, meta)):
            for logits, (*_, targets) in zip(self._logits(), self.batches):
                lq = torch.log_softmax(logits.float(), -1)[:, :self.source_size]  # [m, V_source]
                lp = torch.log_softmax(logits[:, :self.source_size].float(), -1)
                loss += float(-lq.gather(1, targets[:, None]).sum())
                kl += float((lp.exp() * (lp - lq)).sum())
        return {"source_loss": loss / self.scored, "source_kl": kl / self.scored}


def off_source_start(source: Source, replay_data: str | Path | None, seq_length: int, body: ModelConfig,
                     init: dict, primary: dict, nats: float, every_rank: bool = False) -> tuple[dict, dict]:
    """A bounded start (`init`: Step 2's over `body`, and `primary` the primary model's one-head
    state: adapt.step2_start_with_primary's) calibrated on the
    source text, measured through the primary model on the training split of `replay_data` (Step
    2's --replay_data) or else the source run's data: a decoder's new row moved off it
    (adapt.output_shift), an encoder's new output-bias entries raised toward it (adapt.bias_shift),
    until the new pieces take nats / 2 of it (TrainConfig.expand_source_nats) -> (the start, what
    run.json records: `output_shift` how far the row moved (its norm) or `bias_shift` by how much
    the entries rose, `new_mass_calibrated` the rise left on that text, `new_mass_bound` the worst
    case again). Without text (an import and no --replay_data) the start
    stays the worst-case one (the encoder's bound, the decoder's mean row), said in one line.

    The primary model is the one `init` was built from (source's checkpoint; MINIPOST: the run and
    checkpoint its mini-model came from). Where every rank of a launched job calls this
    (`every_rank`: Step 2's start), every rank runs the probe (its layers are the tensor-parallel
    ones: a tensor-parallel group runs them together) and global rank 0's result is every rank's,
    so that every rank starts from the same rows; the fit itself runs on the CPU in float64."""
    data = replay_data or source.record.get("data_path")
    path = source.family.output_path(body)
    if data is None:
        if is_rank0():
            kept = "the worst-case bound" if path.bias is not None else "the source rows' mean"
            print(f"the new pieces' output start stays at {kept}: the source run holds no text to calibrate it on "
                  "(pass --replay_data, source text in its ids)")
        return init, {}
    ref = source.record["frozen_from"] if source.record.get("step") == "minipost" else \
        {"run_dir": str(source.path), "tag": source.tag}
    probe = SourceProbe(Path(ref["run_dir"]), (Path(data), TEXT), seq_length, tag=ref["tag"])
    y, lse = (t.cpu() for t in probe.head_outputs())
    matrix = new_rows_name(path.matrix)
    if path.bias is None:
        mean = init[matrix][0].float().cpu()
        row, rise = output_shift(y, lse, mean, init[matrix].shape[0], nats / 2)
        if every_rank:
            *row, rise = _from_rank0([*row.tolist(), rise])
            row = torch.tensor(row)
        init = {**init, matrix: row.to(init[matrix].device, init[matrix].dtype).expand_as(init[matrix]).clone()}
        shift = {"output_shift": float((row - mean).norm())}
    else:
        bias = new_rows_name(path.bias)
        c, rise = bias_shift(y, lse, init[matrix].float().cpu(), init[bias].float().cpu(), nats / 2)
        if every_rank:
            c, rise = _from_rank0([c, rise])
        init = {**init, bias: init[bias] + c}
        shift = {"bias_shift": c}
    return init, {**shift, "new_mass_calibrated": rise, "new_mass_bound": bounded_over(path, [init, primary], init)}


def _from_rank0(values: list[float]) -> list[float]:
    """Global rank 0's `values` on every rank of a launched job (as they are without one)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return values
    both = torch.tensor(values, dtype=torch.float64).to(device())
    torch.distributed.broadcast(both, src=0)
    return both.cpu().tolist()


class PluginProbe:
    """The plug-in metric of one artifact at a time, for Step 2's checkpoints
    (TrainConfig.plugin_eval_blocks): the primary model and the held-out batches are made on the
    first call and kept; each call swaps the artifact's tensors in and scores them, as
    plugin_records does (the same blocks, masked positions and unigram reference)."""

    def __init__(self, primary_run: Path, data_path: Path, seq_length: int, blocks: int, batch_size: int = 32):
        self.primary_run, self.data_path, self.seq_length = Path(primary_run), Path(data_path), seq_length
        self.blocks, self.batch_size = blocks, min(batch_size, blocks)
        self.model = self.batches = self.unigram = None

    def score(self, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> dict[str, float]:
        """tensors: an artifact's ({"word_embeddings": [V, h], ...}), meta: its meta.json (an
        expanded vocabulary's says so) -> {"plugin_loss", "unigram_loss", "plugin_gain"} (nats per
        scored piece; the gain is the metric)."""
        if self.model is None:
            source = read_source(self.primary_run)
            self.family = source.family
            cfg, state = primary_head(self.family, source.cfg, source.weights())
            self.model = plugin_model(self.family, cfg, state)
            v = tensors["word_embeddings"].shape[0]
            batches = heldout_batches(self.data_path, self.seq_length, v, self.blocks, self.batch_size,
                                      objective=self.family.objective)
            self.unigram = unigram_loss(unigram_logprobs(self.data_path, v), batches)
            self.batches = on_device(batches, device_of(self.model))
        with swapped(self.model, _swap(self.family, self.model, tensors, meta)):
            loss = masked_loss(self.model, self.batches)
        return {"plugin_loss": loss, "unigram_loss": self.unigram, "plugin_gain": self.unigram - loss}


def progress_line(update: int, scored: dict[str, float]) -> str:
    """What Step 2's log says of a checkpoint's plug-in score: whether the embeddings have passed
    the unigram reference, the first sign that they use the model's context."""
    gain = scored["plugin_gain"]
    verdict = ("past the unigram reference: the embeddings use the model's context" if gain > 0 else
               "not past the unigram reference yet: piece frequencies alone still predict better")
    return (f"plug-in metric at update {update}: contextual gain {gain:+.3f} nats (loss {scored['plugin_loss']:.3f}, "
            f"unigram reference {scored['unigram_loss']:.3f}); {verdict}")
