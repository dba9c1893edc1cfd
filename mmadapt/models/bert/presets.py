"""The BERT family's presets (ModelFamily.presets): a BERT-base shape and a tiny one, its small
preset (the default schedule of Steps 1b and 2 over a BERT run)."""

import dataclasses

from mmadapt.config import ModelConfig
from mmadapt.models.roberta.presets import PRESETS as ROBERTA

PRESETS = {
    # bert-base-uncased's shape (Devlin et al. 2019): 12 x 768, 12 heads, 30,522 WordPiece pieces,
    # 512 positions, 2 token types, LayerNorm eps 1e-12; RoBERTa-base's schedule (set the batch
    # fields for your cluster). mBERT differs only by its 119,547 pieces (--vocab_size).
    "bert-base": (ModelConfig(family="bert", vocab_size=30_522, layernorm_epsilon=1e-12),
                  ROBERTA["roberta-base"][1]),
    # The encoder's tiny preset as a BERT (token types, eps 1e-12): trains in minutes on 2 CPU
    # cores; the tests' and the results files' model.
    "bert-tiny": (dataclasses.replace(ROBERTA["tiny"][0], family="bert", layernorm_epsilon=1e-12),
                  ROBERTA["tiny"][1]),
}
SMALL = "bert-tiny"
