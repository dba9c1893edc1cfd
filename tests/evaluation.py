"""Shortcuts that only the tests use: a task model's logits of whole rows, one set's scores with an
artifact swapped in, a state dict with an artifact's embeddings, the plug-in loss of a state dict,
and Step 2's start over a run. Each is a composition of the library's own functions (evaluate.py,
heldout.py, adapt.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmadapt.adapt import AdaptEmbeddings, Step2Start, body_config
from mmadapt.artifact import artifact_embeddings
from mmadapt.config import FinetuneConfig, ModelConfig, TrainConfig
from mmadapt.devices import device_of
from mmadapt.evaluate import EvalBatches, Finetuned, eval_set, score_set
from mmadapt.family import WORD, ModelFamily
from mmadapt.heldout import masked_loss, on_device, scoring_model
from mmadapt.run import read_source
from mmadapt.tasks import headline
from mmadapt.tokenizer import load as load_tokenizer


def predict(model: torch.nn.Module, input_ids: torch.Tensor, batch_tokens: int) -> torch.Tensor:
    """A task model's logits of the rows of input_ids [n, s], in Step 4's token-sized batches:
    [n, C], or [n, s, C] for tag and span; fp32, on the CPU."""
    return EvalBatches.plan(input_ids, batch_tokens, device_of(model)).logits(model)


def evaluate_scores(ft: Finetuned, examples: list, cfg: FinetuneConfig, artifact: dict | None = None,
                    tokenizer: Path | None = None) -> dict[str, float]:
    """Every metric of `examples` with Step 3's model, or with `artifact`'s word embeddings and
    `tokenizer` swapped in (Step 4)."""
    data = eval_set(ft.task, load_tokenizer(tokenizer or ft.tokenizer), examples, ft.labels, cfg,
                    device_of(ft.model()), ft.framing)
    return score_set(ft, data, cfg, artifact)


def evaluate_score(ft: Finetuned, examples: list, cfg: FinetuneConfig, artifact: dict | None = None,
                   tokenizer: Path | None = None) -> float:
    """`evaluate_scores`' headline metric."""
    return evaluate_scores(ft, examples, cfg, artifact, tokenizer)[headline(ft.task, ft.labels, cfg)]


def swap_embeddings(state: dict, artifact: dict, word: str = WORD) -> dict:
    """Step 4 on a state dict: the same weights with the target language's word embeddings."""
    return {**state, word: artifact_embeddings(artifact, state[word])}


def plugin_loss(family: ModelFamily, cfg: ModelConfig, state: dict, batches: list) -> float:
    """Mean loss per scored piece of a one-head LM with `state` (vocab from its rows) on held-out
    (ids, labels) batches, as the plug-in metric scores them."""
    model = scoring_model(family, cfg, state)
    return masked_loss(model, on_device(batches, device_of(model)))


def step2_start(system: str, source: Path, data: Path, mini_layers: int | None = None, lang: str = "de",
                **train) -> Step2Start:
    """Step 2's start (adapt.Step2Start.build) of `system` over the run `source` for the prepared
    target dataset `data` (its tokenizer the new vocabulary), with the TrainConfig fields `train`
    (its rows drawn from their seed)."""
    src = read_source(source)
    step = AdaptEmbeddings(system=system, source=Path(source), lang=lang, train=TrainConfig(**train),
                           mini_layers=mini_layers)
    return Step2Start.build(src, body_config(src.family, system, src.cfg, mini_layers), step,
                            Path(data) / "tokenizer.model", Path(data))
