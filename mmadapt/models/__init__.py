"""The model families (family.py's seam), registered by name: `ModelConfig.family` picks one.

    roberta   post-LayerNorm encoder, masked LM (the paper's models; mmadapt/models/roberta/)
    llama     pre-norm decoder (Llama, Qwen2, Mistral), causal LM (mmadapt/models/llama/)
"""

from __future__ import annotations

from mmadapt.config import ModelConfig
from mmadapt.family import ModelFamily
from mmadapt.models.llama import LLAMA
from mmadapt.models.roberta import ROBERTA

FAMILIES: dict[str, ModelFamily] = {ROBERTA.name: ROBERTA, LLAMA.name: LLAMA}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` buildable by name (a run.json whose model config names it)."""
    FAMILIES[family.name] = family
    return family


def get_family(name_or_config: str | ModelConfig) -> ModelFamily:
    """The family of a name or of a model config (ValueError naming the known ones)."""
    name = name_or_config.family if isinstance(name_or_config, ModelConfig) else name_or_config
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; mmadapt has {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
