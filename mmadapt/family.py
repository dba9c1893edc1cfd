"""The model-family seam: everything the steps need to know about an architecture, in one object.

As torchtitan's `TrainSpec`, a family bundles its model, its parallel forms, its objective, its
FLOP counts and its Hugging Face mapping, and is registered by name (mmadapt/models/__init__.py);
a run records it as `ModelConfig.family` (a run.json without the field is a RoBERTa run). The
steps, the engine, checkpoints and the CLI name no model class: they ask the family of the
run's config. Adding an architecture means writing one subclass under mmadapt/models/<name>/.

What every family's modules promise (the steps rely on these, not on classes):
  - `build_lm(cfg, seed)`: the plain model with a head after each layer of `cfg.heads_after`;
    `forward(input_ids, labels=None, *, masked_index=None, targets=None, padding=None)` ->
    (loss, per-head losses) over the scored positions (`models.layers.masked_positions`), and
    `encode(input_ids, layers, padding=None)` -> each listed layer's output [b, s, h]; and
    `logits(input_ids, padding=None)` -> every head's logits [b, s, V] at every position (TP = 1;
    mmadapt/predict.py).
  - parameter names: the word embedding is `word_embeddings.word_embeddings.weight`
    (`WORD`), layer i (0-based) is under `layers.{i}.`, head k under `heads.heads.{k}.`. The
    mini-model surgery below works on those names; a family whose names differ overrides it.
  - `build_task_model(cfg, kind, num_labels, seed)`: the body with a task head (Step 3);
    `forward(input_ids, labels=None, padding=None)` -> (loss or None, logits); its body's
    parameter names are `build_lm`'s.
  - `build_pipeline(cfg, seed, data_parallel_size)`: this rank's DeepSpeed PipelineModule
    stage, whose layers are listed by `pipeline_layer_prefixes`; host-side bookkeeping as
    models/pipe.py describes.

Mini-models are state-dict surgery on full (single-device) weights in the family's names: the
configs come from the config alone (`primary_config`, `minijoint_config`, `minipost_config`),
and the weight functions apply them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from mmadapt.config import LoopConfig, ModelConfig

WORD = "word_embeddings.word_embeddings.weight"  # every family's input embedding [V, h]


class OutputPath(NamedTuple):
    """How a one-head model (Step 2's body, a primary model) scores the vocabulary, in build_lm's
    parameter names: logits = y W^T (+ b) with y = w * x_hat (+ beta), the head's last norm
    (LayerNorm or RMSNorm: ||x_hat|| <= sqrt(h)). What adapt.bounded_start needs to bound the
    probability mass that new pieces take."""
    matrix: str  # W [V, h]: the word embedding when tied, else the output projection
    bias: str | None  # b [V]
    norm_weight: str  # w [h]
    norm_bias: str | None  # beta [h]


class ModelFamily:
    """One architecture. Subclasses set the class attributes and implement the builders."""

    name: str
    objective: str  # "mlm" (masked pieces are scored) or "causal" (every next piece is)
    task_kinds: tuple[str, ...]  # what build_task_model builds (model.TASK_KINDS for the encoder)
    compiled_kinds: tuple[type, ...] = ()  # module classes fusion "compile" compiles, each instance in place
    pipeline_ties: dict[str, str] = {}  # tied pipeline module key -> its build_lm name prefix
    hf = None  # the Hugging Face mapping (a module with ARCHITECTURES, ...), or None

    # --- configs -------------------------------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """Refuse, with one line, what this family cannot build (ModelConfig.validate has checked
        the rest)."""

    def check_loop(self, loop: LoopConfig) -> None:
        """Refuse, with one line, a training setting that means nothing for this family's objective."""

    # --- modules -------------------------------------------------------------------------------------
    def build_lm(self, cfg: ModelConfig, seed: int = 1234) -> torch.nn.Module:
        raise NotImplementedError

    def build_task_model(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234) -> torch.nn.Module:
        raise NotImplementedError

    def build_body(self, cfg: ModelConfig, seed: int = 1234) -> torch.nn.Module:
        """The model without heads, for `encode` (retrieval through a primary model)."""
        raise NotImplementedError

    def build_pipeline(self, cfg: ModelConfig, seed: int, data_parallel_size: int):
        raise NotImplementedError

    def pipeline_layer_prefixes(self, cfg: ModelConfig) -> list[str | None]:
        """For each layer of the pipeline (its index in the PipelineModule's list), the
        `build_lm` name prefix of its parameters (None: the last stage's copy of a tied weight)."""
        raise NotImplementedError

    def pipeline_param_name(self, name: str, cfg: ModelConfig) -> str | None:
        """A PipelineModule parameter name -> the `build_lm` name (None: a tied duplicate).
        PipelineModule names layer i's parameters "i.<rest>" and tied modules
        "tied_modules.<key>.<rest>"; a tied module's prefix is its first occurrence's."""
        prefixes = self.pipeline_layer_prefixes(cfg)
        if name.startswith("tied_modules."):
            key, rest = name[len("tied_modules."):].split(".", 1)
            return self.pipeline_ties[key] + rest
        idx, rest = name.split(".", 1)
        if int(idx) >= len(prefixes) or prefixes[int(idx)] is None:
            raise AssertionError(f"unexpected pipeline parameter {name}")
        return prefixes[int(idx)] + rest

    # --- what each step trains -------------------------------------------------------------------------
    def vocab_params(self, cfg: ModelConfig, train_output_bias: bool = True) -> tuple[str, ...]:
        """The parameters indexed by vocabulary piece that Step 2 trains (the word embedding
        first): what a new vocabulary replaces and an artifact holds."""
        return (WORD,)

    def artifact_keys(self) -> dict[str, str]:
        """Artifact file key -> parameter name, for every vocabulary-indexed parameter an
        artifact may hold (embeddings.pt)."""
        return {"word_embeddings": WORD}

    def output_path(self, cfg: ModelConfig) -> OutputPath:
        """The output path of a one-head model of `cfg` (OutputPath)."""
        raise NotImplementedError

    def output_biases(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The output bias [V] of every LM head of `cfg` (build_lm names): what Step 1 starts at
        the training text's log-frequencies with ModelConfig.output_bias_init unigram. None here."""
        return ()

    def finetune_trainable(self, cfg: ModelConfig) -> tuple[str, ...]:
        """build_task_model names (or prefixes ending in ".") that Step 3 trains: everything but
        the word embeddings."""
        raise NotImplementedError

    def task_state(self, cfg: ModelConfig, state: dict) -> dict:
        """The part of a `build_lm` state dict that `build_task_model` starts from, in its names
        (the task head itself is new): by default the body, every head dropped."""
        return {k: v for k, v in state.items() if not k.startswith("heads.")}

    # --- mini-models (paper section 2) -----------------------------------------------------------------
    def one_head(self, cfg: ModelConfig, num_layers: int) -> ModelConfig:
        """A `num_layers`-deep model with one head, otherwise like `cfg`, on one device."""
        return dataclasses.replace(cfg, num_layers=num_layers, head_layers=(num_layers,), head_weights=(),
                                   tensor_model_parallel_size=1, pipeline_model_parallel_size=1)

    def primary_config(self, cfg: ModelConfig) -> ModelConfig:
        return self.one_head(cfg, cfg.num_layers)

    def minijoint_depth(self, cfg: ModelConfig, mini_layers: int | None = None) -> int:
        """The depth N of the MINIJOINT mini-model that Step 2 uses: `mini_layers`, checked to be a
        layer with a secondary head in `cfg`; None: the run's only secondary head. A run with several
        has no default: each is a different cost-quality trade-off (mmadapt sweep compares them)."""
        depths = cfg.heads_after[:-1]
        if not depths:
            raise ValueError(f"a MINIJOINT model has a secondary head before its last layer; this one has head_layers "
                             f"{cfg.heads_after}")
        listed = ", ".join(map(str, depths))
        if mini_layers is None:
            if len(depths) > 1:
                raise ValueError(f"the MINIJOINT source has mini-models after layers {listed}: choose one with "
                                 "--mini_layers (mmadapt sweep trains and compares them all)")
            return depths[0]
        if mini_layers not in depths:
            raise ValueError(f"--mini_layers {mini_layers}: the MINIJOINT source has no secondary head after layer "
                             f"{mini_layers}; its mini-models sit after layer{'s' if len(depths) > 1 else ''} {listed}")
        return mini_layers

    def minijoint_config(self, cfg: ModelConfig, mini_layers: int | None = None) -> ModelConfig:
        return self.one_head(cfg, self.minijoint_depth(cfg, mini_layers))

    def minipost_config(self, cfg: ModelConfig, mini_layers: int, new_layers: int) -> ModelConfig:
        if not 1 <= mini_layers < cfg.num_layers:
            raise ValueError(f"mini_layers {mini_layers} must be in 1..{cfg.num_layers - 1} for a "
                             f"{cfg.num_layers}-layer primary model")
        if new_layers < 1:
            raise ValueError(f"new_layers must be >= 1, got {new_layers}")
        return self.one_head(cfg, mini_layers + new_layers)

    @staticmethod
    def keep_head(state: dict, head_index: int) -> dict:
        """Keep head `head_index` as head 0 and drop the other heads."""
        out = {k: v for k, v in state.items() if not k.startswith("heads.heads.")}
        prefix = f"heads.heads.{head_index}."
        out.update({"heads.heads.0." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return out

    @staticmethod
    def keep_layers(state: dict, n: int) -> dict:
        """Drop every layer from index n (0-based) up."""
        return {k: v for k, v in state.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n}

    def primary_model(self, cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
        """The full model with only its primary (last-layer) head."""
        return self.primary_config(cfg), self.keep_head(state, len(cfg.heads_after) - 1)

    def extract_minijoint(self, cfg: ModelConfig, state: dict, mini_layers: int | None = None
                          ) -> tuple[ModelConfig, dict]:
        """MINIJOINT's mini-model: embeddings, layers 1..N and the secondary head after layer N."""
        mini = self.minijoint_config(cfg, mini_layers)
        n = mini.num_layers
        return mini, self.keep_head(self.keep_layers(state, n), cfg.heads_after.index(n))

    def minipost_start(self, cfg: ModelConfig, state: dict, mini_layers: int, new_layers: int
                       ) -> tuple[ModelConfig, dict]:
        """Step 1b's starting point: the bottom N layers, embeddings and primary head of `state`;
        layers N+1..N+K are new (absent from the returned dict: the model's own seeded init)."""
        mini = self.minipost_config(cfg, mini_layers, new_layers)
        return mini, self.keep_layers(self.primary_model(cfg, state)[1], mini_layers)

    @staticmethod
    def minipost_trainable(mini_layers: int, new_layers: int) -> tuple[str, ...]:
        """Name prefixes of the parameters Step 1b trains (0-based layer indices N..N+K-1)."""
        return tuple(f"layers.{i}." for i in range(mini_layers, mini_layers + new_layers))

    # --- FLOPs ----------------------------------------------------------------------------------------
    def step_flops(self, step: str, cfg: ModelConfig, s: int, p: float, paper: bool = False,
                   trainable_layers: int = 0) -> float:
        """FLOPs per sequence of one update of `step` (one of flops.STEPS); trainable_layers: Step
        1b's new layers l_t; paper=True: the paper's formulas (Appendix A.1), where the family has
        them."""
        raise NotImplementedError

    def param_names(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every `build_lm` parameter's name and shape, built on the meta device (no memory)."""
        with torch.device("meta"):
            return {n: tuple(p.shape) for n, p in self.build_lm(cfg).named_parameters()}
