"""The training objectives a model family picks (`ModelFamily.objective`): everything that follows
from how a language model scores text, in one object per objective.

    MLM     masked pieces (the encoder): FULL-SENTENCES blocks that start with <s>, a fraction
            mask_prob of their pieces selected and masked (data.MLMBatches). The plug-in metric
            hides every scored piece behind <mask>; `mmadapt predict` fills a text's <mask>s.
    CAUSAL  next pieces (the decoder): packed blocks, every position scored on the piece after it
            (data.CausalBatches). `mmadapt predict` lists the pieces that may follow a text.

An objective says: its blocks (`batches`), what the plug-in metric feeds the model for held-out
text (`heldout`), how one text is laid out for a language model's forward as the blocks laid it out
in training (`lm_row`), and how records and products name it (`plugin_task`, `label`, `scored`).
A family picks one; a new family reuses one of these or defines its own, and nothing outside the
family compares objective names.
"""

from __future__ import annotations

import dataclasses

import torch

from mmadapt.config import TrainConfig
from mmadapt.data import BlockBatches, CausalBatches, MLMBatches
from mmadapt.tokens import BOS_ID, EOS_ID, MASK_ID


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str  # the run kind of a language model of this objective (predict.kind_of)
    batches: type[BlockBatches]  # training and held-out blocks of a prepared dataset
    masked: bool  # the scored pieces are hidden in the input: <mask> in training, the plug-in metric and predict
    plugin_task: str  # the plug-in metric's task name in Step-4 records
    label: str  # "MLM" / "LM": the plug-in metric's name in tables and titles ("plug-in MLM")
    scored: str  # what a loss is per: "masked pieces" / "next pieces"

    def heldout(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A held-out batch (input_ids [b, s], labels [b, s], -100 where not scored) as the plug-in
        metric scores it. Masked: every scored position's input is <mask>, not BERT's 80/10/10:
        where the training rule keeps the true piece in the input, the model can copy it from
        there, and scored that way about half of the "contextual gain" was copying
        (tests/test_plugin.py). Causal: as they are (a piece is scored from the pieces before it)."""
        return (input_ids.masked_fill(labels.ge(0), MASK_ID), labels) if self.masked else (input_ids, labels)

    def scored_fraction(self, train: TrainConfig) -> float:
        """The fraction p of a block's positions that reach an LM head under `train` (the p of
        ModelFamily.step_flops): masked, the pieces selected (mask_prob); causal, the positions
        scored (score_fraction, 1 by default)."""
        return train.mask_prob if self.masked else train.score_fraction

    def lm_row(self, pieces: list[int], positions: int, prefix: list[int] | None = None) -> list[int]:
        """One text's pieces as a language model of this objective reads them, at most `positions`
        long: masked, `<s> text </s>` (a block of the encoder's training starts with <s>, its
        sentences end with </s>); causal, `</s> text` (a sentence as it follows the previous one in
        the decoder's packed stream, where no <s> occurs), or `prefix` then the text where the model
        was trained by another (an imported decoder: what its tokenizer puts before a text,
        run.run_text_layout: Llama's `<s>`, nothing for Qwen2)."""
        if self.masked:
            return [BOS_ID, *pieces[:positions - 2], EOS_ID]
        prefix = self.text_start(prefix)
        return [*prefix, *pieces[:positions - len(prefix)]]

    def text_start(self, prefix: list[int] | None = None) -> list[int]:
        """What a text starts with as this objective's model read text in training (lm_row): masked,
        <s>; causal, </s> or an imported decoder's `prefix` (its tokenizer's, possibly nothing).
        A task row starts so too (features.Framing.start): a decoder never trained its <s> row."""
        if self.masked:
            return [BOS_ID]
        return [EOS_ID] if prefix is None else list(prefix)


MLM = Objective("mlm", MLMBatches, masked=True, plugin_task="plugin-mlm", label="MLM", scored="masked pieces")
CAUSAL = Objective("causal", CausalBatches, masked=False, plugin_task="plugin-lm", label="LM", scored="next pieces")

OBJECTIVES = {o.name: o for o in (MLM, CAUSAL)}


def plugin_objective(task: str) -> Objective | None:
    """The objective whose plug-in metric a Step-4 record of `task` holds (None: a task record)."""
    return next((o for o in OBJECTIVES.values() if o.plugin_task == task), None)
