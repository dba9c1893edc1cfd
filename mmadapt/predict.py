"""Inference from Python: load any run and look at what its model predicts.

    from mmadapt import predict
    lm = predict.load("runs/minijoint")  # a pretrain (any system), build_minipost or import-hf run
    lm.logits(["In the beginning God created the heaven."])      # {head layer: [1, s, V]}
    lm.fill_mask(["In the beginning God created the <mask>."])   # top pieces per <mask>
    de = predict.load("runs/bl_base", embeddings="runs/adapt/bl_base-de/embeddings/step00001000")
    clf = predict.load("runs/ft/bl_base-xnli-1", embeddings="runs/adapt/bl_base-de/embeddings/step00001000")
    clf.predict([("Er schläft.", "Niemand schläft.")])          # [{"label": ..., "probs": {...}}]

What is loaded, by the code the steps use (nothing here is a second copy of it):
  - a language model (`LanguageModel`): the run's weights (`run.load_weights`: a Step-1b run's
    frozen part rebuilt from its source run) with every head of the run. With a Step-2 artifact
    (`embeddings`), the run's primary model (its last layer and primary head,
    `ModelFamily.primary_model`) with the artifact's vocabulary-indexed tensors and tokenizer: the
    model the plug-in metric scores (plugin.py).
  - a fine-tuned model (`TaskModel`): Step 4's rebuild (`evaluate.load_finetuned`) and Step 4's
    forward (`evaluate.set_logits`: the artifact's word embeddings swapped into the model,
    token-sized batches), so its predictions are the ones `mmadapt evaluate` scores.
TP = 1 and no process group; on `parallel.device()` (or `device`) in Step 4's precision
(`devices.eval_dtype`: bf16 on a GPU, fp32 on the CPU). Results come back in fp32 on the CPU.

Texts are laid out as the model saw them in training (its family's objective, Objective.lm_row):
the encoder's `<s> text </s>` (a literal `<mask>` in the text is the mask piece), the decoder's
`</s> text` (a sentence as it follows the previous one in its packed training stream), or an
imported decoder's as its own tokenizer lays a text out (run.text_prefix: Llama's and
Mistral's `<s> text`, Qwen2's bare text; Qwen2 in a Step-2 vocabulary `</s> text`, as Step 2
trained it and its exported tokenizer reads), so its next-piece logits are transformers' on the
same raw text; task inputs as features.py encodes them in the family's framing.

Shapes: n texts (or QA windows), s their longest row in pieces, V vocab_size, C task labels,
k top_k.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mmadapt.artifact import (artifact_dir, artifact_embeddings, artifact_primary, artifact_state,
                              check_primary_unchanged, read_artifact, same_primary, trained_for)
from mmadapt.checkpoint import read_json
from mmadapt.config import FinetuneConfig, ModelConfig, bool_arg, path_arg
from mmadapt.devices import device_of, on_eval_device
from mmadapt.evaluate import (PAD_LOGIT, EvalBatches, EvalSet, Finetuned, load_finetuned, recorded_config, row_lengths,
                              set_logits)
from mmadapt.family import ModelFamily
from mmadapt.features import Encoded, best_span_offsets, encode_classify, encode_span, encode_tag
from mmadapt.graft import check_siblings, not_a_graft, nothing_to_graft, read_base
from mmadapt.objectives import OBJECTIVES, Objective
from mmadapt.parallel import device as default_device
from mmadapt.parallel import named_device
from mmadapt.heldout import scoring_model
from mmadapt.hf import SENTENCE_TRANSFORMERS
from mmadapt.readers import PairExample, QAExample, TaggedSentence, TwiceNamed, one_key_each
from mmadapt.run import RUN_FILE, Source, read_source, require_head, run_family, text_prefix
from mmadapt.tasks import Task, get_task, sentence_tags
from mmadapt.tokenizer import surface_text
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID, PAD_ID

MASK = "<mask>"  # how a text marks a masked position for fill_mask
BATCH_TOKENS = FinetuneConfig.eval_batch_tokens  # piece ids per forward pass of a language model


def _run_file(run: Path) -> dict:
    if not (run / RUN_FILE).is_file():
        raise ValueError(f"{run} is not an mmadapt run directory (no run.json): pass the --output_dir of a pretrain, "
                         "build_minipost, import-hf or finetune run")
    return read_json(run / RUN_FILE, "run file")


TOP_K = 5  # pieces listed per position where the caller names no number


def kind_of(run: str | os.PathLike) -> str:
    """What `load(run)` gives and `predict` reads, from run.json alone (no weights loaded): "mlm"
    or "causal" (a language model of that objective), or a fine-tuned run's task: "classify",
    "pair" (a classifier of text pairs), "tag" or "span"."""
    run = Path(run)
    info = _run_file(run)
    if info.get("step") == "adapt":
        raise ValueError(f"{run} is a Step-2 run: load its source run with its artifact as the embeddings "
                         f"(e.g. {run / 'embeddings' / '<tag>'})")
    if info.get("step") == "finetune":
        task = get_task(info["task"])
        return "pair" if task.pairs else task.kind
    return run_family(info, run).objective.name


def load(run: str | os.PathLike, embeddings: str | os.PathLike | None = None, *, tag: str | None = None,
         device: str | torch.device | None = None, graft: bool = False) -> "LanguageModel | TaskModel":
    """A run's model for inference: a `TaskModel` for a fine-tuning run, a `LanguageModel` for
    any other (pretrain, build_minipost, import-hf), optionally with the Step-2 artifact
    `embeddings` (<adapt run>/embeddings/<tag>) swapped in. tag: a language model's checkpoint
    (default: the one the embeddings were trained over or for, where the run holds it, else the
    newest complete one; a fine-tuned model is its final one). graft: the
    embeddings were trained over a base of which the run (a fine-tuning run: its primary model)
    is a fine-tuned sibling (graft.py, as export-hf --graft: checked, the distances printed to
    stderr; an expanded vocabulary keeps the sibling's own source rows)."""
    run = path_arg(run, "run")  # one run: a list of them was read as its first
    embeddings = None if embeddings is None else path_arg(embeddings, "embeddings")
    graft = bool_arg(graft, "graft")  # graft="no" grafted
    if tag is not None and (not isinstance(tag, str) or not tag.strip()):
        raise ValueError(f"tag takes a checkpoint's tag (a directory name under <run>/checkpoints/, e.g. "
                         f"'step00000100'), got {tag!r}")
    kind = kind_of(run)
    dev = named_device(device) if device is not None else default_device()
    if graft and embeddings is None:
        raise nothing_to_graft()
    if kind in OBJECTIVES:  # a language model
        return LanguageModel.load(run, embeddings, tag, dev, graft)
    if tag is not None:
        raise ValueError(f"{run} is a fine-tuning run: its model is its final checkpoint (drop --tag)")
    return TaskModel.load(run, embeddings, dev, graft)


def _artifact(path: Path, owners: tuple[Path, ...], *, weights: dict[str, torch.Tensor] | None = None,
              recorded: str | None = None, graft: Callable[[dict], None] | None = None,
              graftable: bool = True) -> tuple[dict, Path, dict]:
    """An artifact's tensors, tokenizer and meta.json, refused unless it belongs to one of
    `owners` (the model Step 2 trained it over, or the primary model Step 4 swaps it into), and,
    swapped into its primary model, unless that model's weights changed since (its `weights` as
    read now, or a fine-tuning run's `recorded` fingerprint of them;
    artifact.check_primary_unchanged). graft: the artifact
    belongs to a base of which the owner is a sibling instead, checked by graft(meta) (one
    that belongs to the owner itself is refused: drop --graft); graftable: whether the refusal of
    another model's artifact may suggest a graft (not for a sentence encoder)."""
    emb, tokenizer, meta = read_artifact(path)
    if "source" not in meta:
        raise ValueError(f"{path}/meta.json does not name the run its embeddings were trained over: it is not an "
                         "artifact adapt wrote")
    if not (Path(meta["source"]) / RUN_FILE).is_file():
        raise ValueError(f"{path} holds embeddings trained over {meta['source']}, which is no longer an mmadapt run "
                         "(no run.json)")
    mine = {Path(meta["source"]).resolve(), artifact_primary(meta).resolve()}
    # an owner's by path, or by its weights (read now, or a fine-tuning run's `recorded` fingerprint
    # of its primary), as evaluate's PrimaryRef.same matches them: a byte-identical copy of the run
    # at another path is the model (export-hf and the plug-in metric decide so too)
    owned = bool(mine & {o.resolve() for o in owners}) or same_primary(meta, weights=weights, recorded=recorded)
    if graft is not None:
        if owned:
            raise not_a_graft(path, " or ".join(map(str, owners)))
        graft(meta)
        return emb, tokenizer, meta
    if not owned:
        raise ValueError(f"{path} holds embeddings for the model of {meta['source']}, not of "
                         f"{' or '.join(map(str, owners))}: load that run with it" + (
                             " (or, into a model fine-tuned from that one, pass --graft)" if graftable else ""))
    if meta.get("primary_fingerprint") and artifact_primary(meta).resolve() in {o.resolve() for o in owners}:
        check_primary_unchanged(path, meta, recorded=recorded, weights=weights)
    return emb, tokenizer, meta


def _trained_for(run: Path, embeddings: Path) -> str | None:
    """The checkpoint of `run` the artifact `embeddings` was trained over or for (artifact.trained_for):
    the one to swap it into by default. None where its meta.json or source run cannot be read (the
    load then refuses the artifact, saying why) or names no checkpoint the run holds."""
    try:
        return trained_for(run, [read_json(artifact_dir(embeddings) / "meta.json", "Step-2 artifact file")])
    except (ValueError, OSError, KeyError, TypeError):
        return None


def _sibling_check(sibling: Source, weights: dict | None = None, body_only: bool = False) -> Callable[[dict], None]:
    """predict --graft's check of an artifact's base against `sibling` (graft.check_siblings), its
    lines on stderr (stdout holds the predictions)."""
    def check(meta: dict) -> None:
        lines = check_siblings(read_base(artifact_primary(meta), meta), sibling, meta, weights,
                               body_only=body_only).lines()
        print("\n".join(lines), file=sys.stderr, flush=True)
    return check


def _surface(tokenizer, i: int) -> dict:
    """A vocabulary entry as fill_mask and next_piece report it: id, piece, and its text (the
    word-boundary marker as a space, stripped; byte pieces as the text they stand for, U+FFFD
    for bytes that are not a whole character, as transformers' pipelines write them: a byte-level
    piece of a character's first bytes, '<0x20><0xE0><0xA4>', is ' \ufffd')."""
    piece = tokenizer.id_to_piece(i)
    return {"id": i, "piece": piece, "text": surface_text(piece).strip()}


# How messages name the inputs: `mmadapt predict` sets its inputs' file lines ("in.txt:5": blank
# lines are skipped, so "text 2" named another line); from Python, "text 2" / "input 2".
_INPUT_NAMES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("input_names", default=None)


def _named(i: int, what: str = "text") -> str:
    """The `i`-th input (from 1) as a message names it (_INPUT_NAMES)."""
    names = _INPUT_NAMES.get()
    return f"{what} {i}" if names is None or i > len(names) else names[i - 1]


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of `text` as '\\udXXX', or None. JSON's escape "\\ud800" (and a
    file name read with surrogateescape) makes a str that is no text: the tokenizer failed on it
    with a C++ cast error and a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"\\u{ord(text[e.start]):04x}"
    return None


def _refuse_lone_surrogate(where: str, strings) -> None:
    bad = next((c for c in map(_lone_surrogate, strings) if c is not None), None)
    if bad is not None:
        raise ValueError(f"{where} holds {bad}, half of a UTF-16 surrogate pair, which is no character: write the "
                         "character itself (or both halves of its pair)")


def _texts(texts) -> list[str]:
    """A list of texts as the Python API takes them, refused in one line otherwise."""
    if isinstance(texts, str):
        raise ValueError("pass a list of texts, not one string")
    if not isinstance(texts, (list, tuple)) or not texts:
        raise ValueError(f"pass a non-empty list of texts, not {texts!r}")
    bad = next((i for i, t in enumerate(texts, 1) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"{_named(bad)} is a {type(texts[bad - 1]).__name__}, not a string")
    for i, t in enumerate(texts, 1):
        _refuse_lone_surrogate(_named(i), [t])
    return list(texts)


def refuse_non_finite(run: Path, out: torch.Tensor, what: str, padding: float = 0.0,
                      example: np.ndarray | None = None) -> None:
    """Refuse a model's outputs [n, ...] that hold NaN or inf (padding positions, filled with
    `padding`, aside), naming the run and the first input, before anything is written. example:
    [n] the input each row is of (a tagger's long sentence in rows, QA's context in windows;
    None: a row per input)."""
    bad = ~torch.isfinite(out) & (out != padding)
    if bad.any():
        row = int(bad.reshape(len(out), -1).any(1).nonzero()[0])
        name = _named((row if example is None else int(example[row])) + 1, what)
        raise ValueError(f"the model of {run} gives NaN or infinite outputs for {name}: its weights are "
                         "damaged or diverged (nothing is written)")


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows), default=1)), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


# --- language models ------------------------------------------------------------------------------------

@dataclass
class LanguageModel:
    """A run's language model, dropout off: every head of the run, or (with an artifact) its
    primary model with the artifact's vocabulary. `heads`: the layer after which each head sits."""
    run: Path
    family: ModelFamily
    cfg: ModelConfig
    model: torch.nn.Module
    tokenizer: object  # a SentencePieceProcessor or tokenizer.HFTokenizer
    embeddings: Path | None = None
    prefix: list[int] | None = None  # what the model reads before a text (run.text_prefix); None: its objective's

    @classmethod
    def load(cls, run: Path, embeddings: Path | None = None, tag: str | None = None,
             device: torch.device | None = None, graft: bool = False) -> "LanguageModel":
        if tag is None and embeddings is not None and not graft:
            tag = _trained_for(run, embeddings)
        source = read_source(run, tag)  # refuses a run without a complete checkpoint or tokenizer
        require_head(source, "a language model's predictions")
        family, cfg, state, tokenizer = source.family, source.cfg, source.weights(), source.tokenizer
        if embeddings is not None:
            weights = state
            emb, tokenizer, meta = _artifact(embeddings, (run,), weights=weights,
                                             graft=_sibling_check(source, weights) if graft else None)
            cfg, state = family.primary_model(cfg, state)
            artifact_embeddings(emb, state[family.word])  # refuses embeddings of another width
            # an expanded vocabulary keeps the model's own source rows (artifact_state), as the plug-in
            # metric and export-hf do: a MINIJOINT encoder's artifact holds its secondary head's bias
            swap = artifact_state(family, emb, meta, state)
            state = {**state, **{name: t.float() for name, t in swap.items()}}
        cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0,
                                  vocab_size=state[family.word].shape[0])
        model = scoring_model(family, cfg, state, device)
        prefix = text_prefix(source.record, source.tokenizer, tokenizer)
        return cls(run, family, cfg, model, load_tokenizer(tokenizer), embeddings, prefix)

    @property
    def heads(self) -> tuple[int, ...]:
        return self.cfg.heads_after

    @property
    def objective(self) -> Objective:
        """The family's objective: masked (the encoder: fill_mask) or not (the decoder: next_piece)."""
        return self.family.objective

    def pieces(self, text: str) -> list[int]:
        """The piece ids of `text`; for the encoder each literal <mask> becomes the mask piece, the
        text around it encoded in parts (its space then belongs to the masked word, as when a word
        is masked in training)."""
        if not self.objective.masked:
            return self.tokenizer.encode(text)
        parts, ids = text.split(MASK), []
        for i, part in enumerate(parts):
            if i:
                ids.append(MASK_ID)
            part = part.rstrip() if i < len(parts) - 1 else part
            if part.strip():
                ids += self.tokenizer.encode(part)
        return ids

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Texts -> input_ids [n, s] as the model saw text in training (module docstring), padded
        with PAD_ID. A text longer than the model's positions is refused: nothing is cut (a
        decoder's next pieces would be those of the text's start, an encoder's <mask> past the
        positions would get no prediction)."""
        n, rows = self.cfg.max_position_embeddings, []
        for i, text in enumerate(_texts(texts), 1):
            pieces = self.pieces(text)
            row = self.objective.lm_row(pieces, len(pieces) + n, self.prefix)  # uncut: the text and its layout's pieces
            if not row:  # a decoder whose tokenizer puts nothing before a text, on a text of no piece
                raise ValueError(f"{_named(i)} ({text[:40]!r}) has no piece in the tokenizer of {self.run}: there is "
                                 "nothing to predict from; give text it reads")
            if len(row) > n:
                raise ValueError(f"{_named(i)} is {len(pieces)} pieces long; the model of {self.run} reads at most "
                                 f"{n - (len(row) - len(pieces))} ({n} positions, {len(row) - len(pieces)} of them its "
                                 "layout's): shorten or split it (predict does not cut a text)")
            rows.append(row)
        return _pad(rows)

    def _per_position(self, texts: list[str], fn) -> tuple[torch.Tensor, torch.Tensor]:
        """fn(logits of every head [b, s_i, H, V]) -> [b, s_i, ...] over token-sized batches:
        (input_ids [n, s], the results [n, s, ...], fp32 on the CPU; refused if not finite)."""
        ids = self.encode(texts)
        batches = EvalBatches.plan(ids, BATCH_TOKENS, device_of(self.model))
        out = batches.run(lambda x, padding: fn(torch.stack(self.model.logits(x, padding), 2)), True)
        refuse_non_finite(self.run, out, "text")
        return ids, out

    def logits(self, texts: list[str]) -> dict[int, torch.Tensor]:
        """{head layer: logits [n, s, V]} of every position of `encode(texts)` (padding
        positions: zeros), fp32 on the CPU. The encoder's are masked-LM logits, the decoder's
        next-piece logits."""
        ids, out = self._per_position(texts, lambda logits: logits)
        # a row batched with longer ones has its model's outputs at its padding: not predictions
        out[torch.arange(ids.shape[1]) >= row_lengths(ids)[:, None]] = 0.0
        return {layer: out[:, :, k] for k, layer in enumerate(self.heads)}

    def _top(self, texts: list[str], top_k: int, head: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [n, s], probabilities [n, s, k], ids [n, s, k]) of `head`'s top pieces at
        every position: only the top k per position leave the device."""
        k = self.heads.index(self.heads[-1] if head is None else self._head(head))
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a whole number >= 1, got {top_k!r}")

        def top(logits: torch.Tensor) -> torch.Tensor:  # [b, s_i, H, V] -> [b, s_i, 2k]
            p, i = logits[:, :, k].float().softmax(-1).topk(min(top_k, logits.shape[-1]), -1)
            return torch.cat([p, i.float()], -1)  # ids are exact in fp32 below 2**24

        ids, out = self._per_position(texts, top)
        return ids, out[..., :out.shape[-1] // 2], out[..., out.shape[-1] // 2:].long()

    def _head(self, head: int) -> int:
        if isinstance(head, bool) or head not in self.heads:  # "12" is no head (nor True, equal to 1)
            raise ValueError(f"the model has heads after layers {', '.join(map(str, self.heads))}, not {head!r}")
        return head

    def fill_mask(self, texts: list[str], top_k: int = TOP_K, head: int | None = None) -> list[list[list[dict]]]:
        """The encoder's `top_k` pieces at each <mask> of each text: per text, per <mask> in
        order, [{"id", "piece", "text", "prob"}], most probable first. head: the layer of the
        head to read (default: the primary head, after the last layer)."""
        if not self.objective.masked:
            raise ValueError(f"fill_mask is for masked-LM encoders; {self.run} is a {self.cfg.family} decoder: use "
                             "next_piece")
        missing = next((i for i, t in enumerate(_texts(texts)) if MASK not in t), None)
        if missing is not None:
            raise ValueError(f"{_named(missing + 1)} has no {MASK}: fill_mask predicts the pieces at {MASK}")
        ids, probs, top = self._top(texts, top_k, head)
        return [[[{**_surface(self.tokenizer, int(i)), "prob": float(p)} for p, i in zip(probs[r, s], top[r, s])]
                 for s in ids[r].eq(MASK_ID).nonzero().squeeze(1).tolist()] for r in range(len(texts))]

    def next_piece(self, texts: list[str], top_k: int = TOP_K, head: int | None = None) -> list[list[dict]]:
        """The decoder's `top_k` next pieces after each text: [{"id", "piece", "text", "prob"}],
        most probable first. head: as in fill_mask."""
        if self.objective.masked:
            raise ValueError(f"next_piece is for decoders; {self.run} is a masked-LM encoder: use fill_mask")
        ids, probs, top = self._top(texts, top_k, head)
        last = ids.ne(PAD_ID).sum(1) - 1  # [n]: each row's last piece
        return [[{**_surface(self.tokenizer, int(i)), "prob": float(p)} for p, i in zip(probs[r, last[r]], top[r, last[r]])]
                for r in range(len(texts))]


# --- sentence encoders ----------------------------------------------------------------------------------

ST_POOLING = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens")  # sentence-transformers' order
ST6_POOLING = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens"}  # sentence-transformers 6's names


@dataclass
class SentenceEncoder:
    """The sentence vectors of a run imported from a sentence-transformers directory (or a head fit
    over one): its body's last layer (heads are not read), pooled as its Pooling module says and
    normalised where it lists a Normalize module, texts read as sentence-transformers reads them
    (lower-cased where its do_lower_case says so, `<s> text </s>` cut to its max_seq_length
    pieces, after its default prompt where its config_sentence_transformers.json names one); with
    a Step-2 artifact, the artifact's word embeddings and tokenizer: what the exported
    sentence-transformers directory encodes (hf.write_sentence_transformers)."""
    run: Path
    family: ModelFamily
    cfg: ModelConfig
    body: torch.nn.Module
    tokenizer: object
    pooling: tuple[str, ...]
    normalize: bool
    lower_case: bool
    max_length: int
    prompt: str = ""  # what sentence-transformers puts before every text (its default prompt)

    @classmethod
    def load(cls, run: str | os.PathLike, embeddings: str | os.PathLike | None = None,
             device: torch.device | None = None) -> "SentenceEncoder":
        run = path_arg(run, "run")
        embeddings = None if embeddings is None else path_arg(embeddings, "embeddings")
        dev = named_device(device) if device is not None else default_device()  # as load(): one line
        source = read_source(run)
        settings = (source.record.get("imported_from") or {}).get("sentence_transformers")
        modules = source.path / SENTENCE_TRANSFORMERS
        if settings is None or not (modules / "modules.json").is_file():
            raise ValueError(f"{run} was not imported from a sentence-transformers directory: its sentence vectors "
                             "are not defined (import-hf a directory with modules.json)")
        entries = json.loads((modules / "modules.json").read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries]
        if "Dense" in kinds:
            raise ValueError(f"{run}: its sentence-transformers model has a Dense module, which mmadapt carries into "
                             "exports but does not compute: encode with the exported directory")
        pooling = _pooling(modules, entries, kinds)
        family, cfg, state, tokenizer = source.family, source.cfg, source.weights(), source.tokenizer
        if embeddings is not None:
            weights = state
            emb, tokenizer, _ = _artifact(Path(embeddings), (run,), weights=weights, graftable=False)
            state = {**state, family.word: artifact_embeddings(emb, state[family.word]).float()}
        cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0,
                                  vocab_size=state[family.word].shape[0])
        body = family.build_body(cfg)
        body.load_state_dict({k: v for k, v in state.items() if k in body.state_dict()})
        body = on_eval_device(body, dev)
        length = min(settings.get("max_seq_length") or cfg.max_position_embeddings, cfg.max_position_embeddings)
        return cls(run, family, cfg, body, load_tokenizer(tokenizer), pooling, "Normalize" in kinds,
                   bool(settings.get("do_lower_case")), length, _default_prompt(run, modules, entries, kinds))

    def rows(self, texts: list[str]) -> torch.Tensor:
        """Texts -> input_ids [n, s]: <s> prompt text </s>, cut to max_length - 2 pieces, padded."""
        texts = [self.prompt + t for t in texts]
        texts = [t.lower() for t in texts] if self.lower_case else texts
        return _pad([[BOS_ID, *self.tokenizer.encode(t)[:self.max_length - 2], EOS_ID] for t in texts])

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """[n, d] sentence vectors, fp32 on the CPU (d: hidden size times the pooling modes)."""
        ids = self.rows(_texts(texts))
        batches = EvalBatches.plan(ids, BATCH_TOKENS, device_of(self.body))
        out = batches.run(lambda x, padding: self.body.encode(x, (self.cfg.num_layers,), padding)[0], True)
        keep = ids.ne(PAD_ID)[..., None].float()  # [n, s, 1]
        x = out.float() * keep
        parts = {"cls_token": x[:, 0], "max_tokens": out.float().masked_fill(keep == 0, -1e9).amax(1),
                 "mean_tokens": x.sum(1) / keep.sum(1), "mean_sqrt_len_tokens": x.sum(1) / keep.sum(1).sqrt()}
        vectors = torch.cat([parts[m] for m in self.pooling], -1)
        return torch.nn.functional.normalize(vectors, dim=-1) if self.normalize else vectors


def _default_prompt(run: Path, modules: Path, entries: list[dict], kinds: list[str]) -> str:
    """The text sentence-transformers puts before every text it encodes with no prompt of its own:
    config_sentence_transformers.json's prompts[default_prompt_name] ("query: " for an E5-style
    model); "" where it names none. A Pooling module that leaves the prompt's positions out
    (include_prompt false) is refused: mmadapt pools every position."""
    config = modules / "config_sentence_transformers.json"
    cfg = read_json(config, "sentence-transformers config") if config.is_file() else {}
    name = cfg.get("default_prompt_name")
    if not name:
        return ""
    prompts = cfg.get("prompts") or {}
    if name not in prompts:
        raise ValueError(f"{config}: default_prompt_name {name!r} is none of its prompts ({sorted(prompts)})")
    if "Pooling" in kinds and read_json(modules / entries[kinds.index("Pooling")]["path"] / "config.json",
                                        "Pooling module config").get("include_prompt", True) is False:
        raise ValueError(f"{run}: its Pooling module leaves the default prompt's positions out (include_prompt "
                         "false), which mmadapt does not compute: encode with the exported directory")
    return str(prompts[name] or "")


def _pooling(modules: Path, entries: list[dict], kinds: list[str]) -> tuple[str, ...]:
    """The pooling modes of a sentence-transformers model's Pooling module (its config.json), in
    sentence-transformers' order; the CLS token where it has none."""
    if "Pooling" not in kinds:
        return ("cls_token",)
    entry = entries[kinds.index("Pooling")]
    cfg = read_json(modules / entry["path"] / "config.json", "Pooling module config")
    if "pooling_mode" in cfg:  # sentence-transformers 6: a mode, or modes concatenated in the order listed
        given = [cfg["pooling_mode"]] if isinstance(cfg["pooling_mode"], str) else list(cfg["pooling_mode"])
        modes = [ST6_POOLING.get(m, m) for m in given]
    else:  # before: a flag per mode, concatenated in sentence-transformers' order
        on = {k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v}
        modes = [m for m in ST_POOLING if m in on] + sorted(on - set(ST_POOLING))
    unknown = [m for m in modes if m not in ST_POOLING]
    if unknown or not modes:
        raise ValueError(f"{modules / entry['path']}: pooling mode {unknown[0] if unknown else 'none'} is not one "
                         f"mmadapt computes ({', '.join(ST_POOLING)}): encode with the exported directory")
    return tuple(modes)


# --- fine-tuned models -----------------------------------------------------------------------------------

@dataclass
class TaskModel:
    """A Step-3 model (its final checkpoint), optionally with a Step-2 artifact's word embeddings
    and tokenizer swapped in (Step 4). cfg: the run's recorded FinetuneConfig (sequence length, QA
    windows, batch tokens), as `mmadapt evaluate` reads it."""
    run: Path
    finetuned: Finetuned
    cfg: FinetuneConfig
    tokenizer: object
    artifact: dict | None = None  # the artifact's tensors, swapped in for each forward (evaluate.set_logits)
    embeddings: Path | None = None

    @classmethod
    def load(cls, run: Path, embeddings: Path | None = None, device: torch.device | None = None,
             graft: bool = False) -> "TaskModel":
        ft = load_finetuned(run)
        tokenizer, artifact, primary = ft.tokenizer, None, Path(ft.run["primary"]["run_dir"])
        if embeddings is not None:
            check = _sibling_check(read_source(primary), body_only=True) if graft else None
            artifact, tokenizer, meta = _artifact(embeddings, (primary,), recorded=ft.run["primary"].get("fingerprint"),
                                                  graft=check)
            artifact_embeddings(artifact, ft.state[ft.family.word])  # refuses embeddings of another width
            if graft:  # only the word embeddings go into a task model; expand keeps its own source rows
                word = artifact_state(ft.family, {"word_embeddings": artifact["word_embeddings"]}, meta, ft.state)
                artifact = {"word_embeddings": word[ft.family.word]}
        ft.model(device)  # built once, on `device` (ft keeps it)
        return cls(run, ft, recorded_config(ft), load_tokenizer(tokenizer), artifact, embeddings)

    @property
    def task(self) -> Task:
        return self.finetuned.task

    @property
    def labels(self) -> list[str]:
        return self.finetuned.labels

    def examples(self, inputs: list) -> list:
        """`inputs` as the task's examples, with placeholder gold labels: a text (str) or, for a
        pair task, (text, text_pair); tag: a text (split at whitespace) or its list of words;
        span: (question, context)."""
        if isinstance(inputs, str):
            raise ValueError("pass a list of inputs, not one string")
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise ValueError(f"pass a non-empty list of inputs, not {inputs!r}")
        kind, out = self.task.kind, []
        for n, x in enumerate(inputs, 1):
            if kind == "classify" and self.task.pairs:
                if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, str) for t in x)):
                    raise ValueError(f"{_named(n, 'input')}: the {self.task.name} model classifies pairs of texts: "
                                     "pass (text, text_pair)")
                out.append(PairExample(x[0], x[1], 0))
            elif kind == "classify":
                if not isinstance(x, str):
                    raise ValueError(f"{_named(n, 'input')}: the {self.task.name} model classifies single texts: "
                                     "pass a string")
                out.append((x, 0))
            elif kind == "tag":
                # a list or tuple of words (a dict's keys, a number, None: refused as not one)
                words = x.split() if isinstance(x, str) else list(x) if isinstance(x, (list, tuple)) else None
                if not words or not all(isinstance(w, str) and w.strip() for w in words):
                    raise ValueError(f"{_named(n, 'input')}: a tagger takes a text or a list of words, not {x!r}")
                out.append(TaggedSentence(words, [self.labels[0]] * len(words)))
            else:
                if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, str) for t in x)):
                    raise ValueError(f"{_named(n, 'input')}: a QA model takes (question, context)")
                out.append(QAExample(str(n - 1), x[1], x[0]))
            _refuse_lone_surrogate(_named(n, "input"), [x] if isinstance(x, str) else x)
            if kind != "tag":  # (a tagger's blank words are refused above) as Steps 3 and 4 refuse an empty text
                keys = input_keys("pair" if self.task.pairs else kind)
                texts = [x] if isinstance(x, str) else x
                # (QA: the context; a question may be empty, as SQuAD's files are read)
                empty = next((k for k, t in zip(keys, texts) if not t.strip() and k != "question"), None)
                if empty is not None:
                    raise ValueError(f"{_named(n, 'input')}: {empty!r} is empty: every input needs its "
                                     f"{' and '.join(keys)} (a model fine-tuned on texts has nothing to read)")
        return out

    def encode(self, examples: list) -> Encoded:
        """The examples' rows as features.py encodes them for this task (the run's settings)."""
        cfg, kind, framing = self.cfg, self.task.kind, self.finetuned.framing
        if kind == "classify":
            self._say_cut(examples)
            return encode_classify(self.tokenizer, examples, cfg.seq_length, framing)
        if kind == "tag":
            return encode_tag(self.tokenizer, examples, self.labels, cfg.seq_length, framing)
        self._say_cut_questions(examples)
        return encode_span(self.tokenizer, examples, cfg.seq_length, cfg.doc_stride, cfg.max_query_length, framing)

    def _say_cut(self, examples: list) -> None:
        """A classifier reads the first seq_length pieces of an input (of a pair, the longer text
        cut first), as fine-tuning and `mmadapt evaluate` read it: said on stderr for each input
        that is cut (a tagger reads a long sentence in rows, QA a long context in windows)."""
        n, encode, framing = self.cfg.seq_length, self.tokenizer.encode, self.finetuned.framing
        for i, ex in enumerate(examples, 1):
            pieces = (len(encode(ex.sentence1)) + len(encode(ex.sentence2)) + framing.pair_specials
                      if isinstance(ex, PairExample) else len(encode(ex[0])) + len(framing.start) + 1)
            if pieces > n:  # a pair is cut longest-first, so "its first n" would say the wrong pieces
                read = f"{n} of them, the longer text cut first" if isinstance(ex, PairExample) else f"its first {n}"
                print(f"note: {_named(i, 'input')} is {pieces} pieces long with its layout; the {self.task.name} "
                      f"model reads {read} (the run's seq_length, as fine-tuning and evaluate read it)",
                      file=sys.stderr)

    def _say_cut_questions(self, examples: list) -> None:
        """QA reads a question's first max_query_length pieces, as fine-tuning and `mmadapt
        evaluate` read it (features.encode_span): said on stderr for each question that is cut."""
        n = self.cfg.max_query_length
        for i, ex in enumerate(examples, 1):
            pieces = len(self.tokenizer.encode(ex.question))
            if pieces > n:
                print(f"note: {_named(i, 'input')}'s question is {pieces} pieces long; the {self.task.name} model "
                      f"reads its first {n} (the run's max_query_length, as fine-tuning and evaluate read it)",
                      file=sys.stderr)

    def logits(self, inputs: list) -> tuple[list, Encoded, torch.Tensor]:
        """(examples, their rows, logits: classify [n, C], tag [n, s, C], span [windows, s, 2]),
        by Step 4's forward (evaluate.set_logits), fp32 on the CPU."""
        examples = self.examples(inputs)
        enc = self.encode(examples)
        rows = EvalBatches.plan(enc.input_ids, self.cfg.eval_batch_tokens, device_of(self.finetuned.model()),
                                enc.token_types)
        logits = set_logits(self.finetuned, EvalSet(examples, enc, rows), self.artifact)
        refuse_non_finite(self.run, logits, "input", PAD_LOGIT.get(self.task.kind, 0.0), enc.example)
        return examples, enc, logits

    def predict(self, inputs: list) -> list[dict]:
        """One result per input: classify {"label", "probs": {label: probability}}; tag {"words",
        "tags"} (a tag per word: a long sentence is read in rows of seq_length, encode_tag); span
        {"answer", "start", "end"} (the context's best span and its character offsets, end
        exclusive, the fields transformers' question-answering pipeline names so; "", None, None
        when no span fits: a word can occur more than once in a context, and the offsets say
        which). The span is Step 4's (features.best_span_offsets: raw start + end logits across
        windows, the run's max_answer_length, piece boundaries), not widened to whole words."""
        examples, enc, logits = self.logits(inputs)
        kind = self.task.kind
        if kind == "classify":
            probs = logits.softmax(-1)
            return [{"label": self.labels[int(p.argmax())], "probs": dict(zip(self.labels, map(float, p)))}
                    for p in probs]
        if kind == "tag":  # each word's tag, a sentence's rows joined (encode_tag)
            tags = sentence_tags(enc, logits.argmax(-1), self.labels)
            return [{"words": ex.words, "tags": t} for ex, t in zip(examples, tags)]
        spans = best_span_offsets(logits, enc, examples, self.cfg.max_answer_length)
        out = []
        for ex in examples:
            start, end = spans[ex.id] or (None, None)
            out.append({"answer": "" if start is None else ex.context[start:end], "start": start, "end": end})
        return out


# --- `mmadapt predict`: inputs from a file or stdin, JSON Lines out ----------------------------------

# What one input of each task kind is: the JSON Lines keys, and (plain lines) its fields split at a tab.
TASK_INPUT_KEYS = {"classify": ("text",), "pair": ("text", "text_pair"), "tag": ("text",), "span": ("question", "context")}


def input_keys(kind: str) -> tuple[str, ...]:
    """The fields of one input for a model of `kind` (kind_of): a language model's is a text."""
    return ("text",) if kind in OBJECTIVES else TASK_INPUT_KEYS[kind]


class Inputs(list):
    """read_inputs' inputs, each named by its line (`names`: "in.txt:5"), as predict_rows' messages name them."""

    def __init__(self, rows: list[dict], names: list[str]):
        super().__init__(rows)
        self.names = tuple(names)


def read_inputs(path: str, kind: str, jsonl: bool | None = None) -> Inputs:
    """The inputs of `mmadapt predict` for a model of `kind` (kind_of): one per non-blank line of
    `path` ("-": stdin), each {key: value} of `input_keys(kind)`. Plain lines hold the fields
    separated by a tab (pair: text, text_pair; span: question, context); JSON Lines (a .jsonl or
    .json file, or jsonl=True) one object per line with those keys (tag: "words", a list, in
    place of "text")."""
    keys = input_keys(kind)
    jsonl = Path(path).suffix.lower() in (".jsonl", ".json") if jsonl is None else jsonl
    where = "stdin" if path == "-" else path
    try:
        # bytes, decoded here: stdin as a file is (not in the locale's encoding, its BOM dropped),
        # and cut at line ends alone: str.splitlines also cuts at \x0c, \x85 and U+2028, which a
        # line of text (or of predict's own JSON output) may hold
        data = (getattr(sys.stdin, "buffer", None) or sys.stdin).read() if path == "-" else Path(path).read_bytes()
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte offset {e.start})") from None
    except IsADirectoryError:
        raise ValueError(f"{where} is a directory: pass a text file (or - for stdin)") from None
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist") from None
    out, names = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        names.append(f"{where}:{n}")
        if jsonl:
            try:
                row = json.loads(line, object_pairs_hook=one_key_each)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{n}: not JSON ({e.msg}); JSON Lines hold one object per line") from None
            except TwiceNamed as e:  # json keeps the last silently
                raise ValueError(f"{where}:{n}: the object names {e.args[0]!r} twice: give each key once") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}:{n}: a JSON Lines input is an object with {', '.join(keys)}")
            if kind == "tag" and "words" in row:
                row = {**row, "text": row["words"]}
            missing = [k for k in keys if k not in row]
            if missing:
                raise ValueError(f"{where}:{n}: the object lacks {missing[0]!r} (a {kind} input has "
                                 f"{', '.join(map(repr, keys))})")
            for k in keys:  # texts (a tag input's words: a list of them), named by line, not by the model's refusal
                v = row[k]
                if kind == "tag":
                    if not (isinstance(v, str) or isinstance(v, list) and all(isinstance(w, str) for w in v)):
                        raise ValueError(f"{where}:{n}: {'words' if 'words' in row else k!r} is {json.dumps(v)[:40]}: "
                                         "a tag input is a text, or its words as a list of strings")
                elif not isinstance(v, str):
                    raise ValueError(f"{where}:{n}: {k!r} is a {type(v).__name__}, not a text: write it as a JSON "
                                     "string")
                named = "'words'" if kind == "tag" and "words" in row else repr(k)
                _refuse_lone_surrogate(f"{where}:{n}: {named}", [v] if isinstance(v, str) else v)
            out.append({k: row[k] for k in keys})
        else:
            fields = line.split("\t")
            if len(fields) != len(keys):
                tabs = (f"; a text holding tabs goes in JSON Lines (--jsonl, {{\"{keys[0]}\": ...}} per line)"
                        if len(fields) > len(keys) else "")
                raise ValueError(f"{where}:{n}: a {kind} input is {' TAB '.join(keys)} on one line; this line has "
                                 f"{len(fields)} tab-separated field{'s' if len(fields) > 1 else ''}{tabs}")
            out.append(dict(zip(keys, fields)))
    if not out:
        raise ValueError(f"{where} holds no inputs (one per line)")
    return Inputs(out, names)


def check_top_k(run: str | os.PathLike, kind: str, top_k: int | None) -> None:
    """A number of pieces to list (`top_k`, None: TOP_K) is a language model's option: refused in
    one line for a fine-tuned run (`kind`, kind_of's), whose rows give every label, tag or answer."""
    if top_k is not None and kind not in OBJECTIVES:
        raise ValueError(f"--top_k lists a language model's pieces; {run} is a fine-tuned {kind} model, whose rows give "
                         "every label (or tag, or the answer): drop --top_k")


def predict_rows(model: "LanguageModel | TaskModel", inputs: list[dict], top_k: int | None = None) -> list[dict]:
    """Each input with what `model` predicts for it (`mmadapt predict`'s output rows; `top_k`: a
    language model's pieces per position, None: TOP_K). Messages name read_inputs' inputs by line."""
    names = _INPUT_NAMES.set(getattr(inputs, "names", None))
    try:
        return _predict_rows(model, inputs, top_k)
    finally:
        _INPUT_NAMES.reset(names)


def _predict_rows(model: "LanguageModel | TaskModel", inputs: list[dict], top_k: int | None) -> list[dict]:
    if isinstance(model, LanguageModel):
        texts, top_k = [x["text"] for x in inputs], TOP_K if top_k is None else top_k
        if model.objective.masked:
            return [{**x, "masks": m} for x, m in zip(inputs, model.fill_mask(texts, top_k))]
        return [{**x, "next": m} for x, m in zip(inputs, model.next_piece(texts, top_k))]
    check_top_k(model.run, "pair" if model.task.pairs else model.task.kind, top_k)
    keys = input_keys("pair" if model.task.pairs else model.task.kind)
    values = [x[keys[0]] if len(keys) == 1 else tuple(x[k] for k in keys) for x in inputs]
    return [{**x, **y} for x, y in zip(inputs, model.predict(values))]
