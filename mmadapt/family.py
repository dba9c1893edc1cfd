"""The model-family seam: everything architecture-specific, in one object per architecture.

As torchtitan's `TrainSpec`, a family bundles what the steps need to know about one
architecture, and is registered by name (mmadapt/models/__init__.py; a family defined outside
mmadapt registers itself when its module is imported: MMADAPT_IMPORT names such modules):
  - its model and parallel forms (`build_lm`, `build_task_model`, `build_body`, `build_pipeline`)
    and its parameter names (`word`, `layers_prefix`, `heads_prefix`), on which the mini-model
    surgery below works;
  - its objective (objectives.py: the batches, the plug-in metric's held-out text, how a text is
    laid out for the language model, how records name it);
  - its presets (named ModelConfig + TrainConfig pairs, in its own folder) and its small preset,
    the schedule later steps run over its runs by default and the demo's;
  - its text framing for tasks (`framing`: features.Framing, the pair layout and token types);
  - the tokenizer kinds it accepts (`tokenizer_kinds`);
  - the ModelConfig fields it uses beyond those every family uses (each field's metadata names
    its families; `check_fields` refuses a field set for a family that does not use it);
  - its FLOP counts and its Hugging Face mapping (`hf`, an `HFMapping`).
A run records its family as `ModelConfig.family` (a run.json without the field is a RoBERTa
run); `run.start_run` and `run.read_source` look it up once, and everything after takes it from
there. Adding an architecture means writing one folder under mmadapt/models/<name>/.

What a family's modules promise (the steps rely on these, not on classes):
  - `build_lm(cfg, seed)`: the plain model with a head after each layer of `cfg.heads_after`;
    `forward(input_ids, labels=None, *, masked_index=None, targets=None, padding=None)` ->
    (loss, per-head losses) over the scored positions (`models.layers.masked_positions`), and,
    for Step 2's source-language replay (--replay_fraction, passed only then), `split=` the
    number of scored positions of the replay rows (two texts' losses logged after the heads':
    `models.layers.head_losses`); and
    `encode(input_ids, layers, padding=None)` -> each listed layer's output [b, s, h]; and
    `logits(input_ids, padding=None)` -> every head's logits [b, s, V] at every position (TP = 1;
    mmadapt/predict.py), and where it also takes `rows=` [m] (flat indices into b * s), [m, V] at
    those positions alone (heldout.scored_logits gathers them from the whole logits otherwise);
    `config`, the ModelConfig it was built from.
  - `build_task_model(cfg, kind, num_labels, seed)`: the body with a task head (Step 3);
    `forward(input_ids, labels=None, padding=None[, token_types=None])` -> (loss or None,
    logits), token_types [b, s] passed only by a family whose framing has them; `kind`; its
    body's parameter names are `build_lm`'s.
  - `build_pipeline(cfg, seed, data_parallel_size)`: this rank's DeepSpeed PipelineModule
    stage, whose layers are listed by `pipeline_layer_prefixes`; host-side bookkeeping as
    models/pipe.py describes.

Mini-models are state-dict surgery on full (single-device) weights in the family's names: the
configs come from the config alone (`primary_config`, `minijoint_config`, `minipost_config`),
and the weight functions apply them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

import torch

from mmadapt.config import LoopConfig, ModelConfig, TrainConfig
from mmadapt.features import Framing
from mmadapt.flops import flops_by_rows
from mmadapt.objectives import Objective
from mmadapt.tokens import BOS_ID

WORD = "word_embeddings.word_embeddings.weight"  # the shipped families' input embedding [V, h]


class Implied(NamedTuple):
    """A tensor config.json implies (HFMapping.implied): each dimension as (size, the config.json
    field(s) that set it, with their values), and what makes the tensor present at all."""
    dims: tuple[tuple[int, str], ...]
    by: str = ""


def inverse_permutation(hf_ids: list[int]) -> torch.Tensor:
    """hf_ids (mmadapt id -> the Hugging Face tokenizer's id, a permutation) -> its inverse [V]:
    the Hugging Face id -> mmadapt's."""
    inverse = torch.empty(len(hf_ids), dtype=torch.long)
    inverse[torch.tensor(hf_ids)] = torch.arange(len(hf_ids))
    return inverse


def inverse_rows(hf_ids: list[int] | None, t: torch.Tensor) -> torch.Tensor:
    """A vocabulary-indexed tensor in mmadapt's ids -> in the exported tokenizer's (`hf_ids`:
    mmadapt id -> its id; None: the same)."""
    return t if hf_ids is None else t[inverse_permutation(hf_ids)]


def transformers_config(cfg: dict, model_dir):
    """config.json as transformers reads it (its defaults; a decoder's both rope formats:
    transformers 5's `rope_parameters` and the older `rope_theta` / `rope_scaling`), validated as
    transformers validates it. A field it rejects is refused here in one line naming config.json:
    the encoders' tokenizer load also validates the config, and was blamed for it."""
    import transformers  # the hf extra

    from mmadapt import quiet

    verbosity = transformers.logging.get_verbosity()
    if not quiet.verbose():  # its warnings would break the one-line error; --verbose shows them
        transformers.logging.set_verbosity_error()
    try:
        return transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    except Exception as e:  # strict dataclass validation raises several kinds; the user needs one line
        raise ValueError(f"{model_dir}: transformers rejects its config.json ({type(e).__name__}: "
                         f"{' '.join(line.strip() for line in str(e).splitlines())[:300]}): correct that field, or "
                         "drop it for transformers' default") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


class HFMapping:
    """A family's correspondence with Hugging Face checkpoints (as torchtitan's
    `StateDictAdapter`): mmadapt/hf.py reads and writes the directories, the mapping translates
    configs, special ids and weights. `architectures`: HF architecture -> its model_type, the
    classes `import-hf` accepts for this family. Every method refuses what the family cannot
    express exactly with a ValueError of one line."""

    architectures: dict[str, str] = {}
    # Those of `architectures` that are bodies without an LM head (BertModel, XLMRobertaModel, ...):
    # imported headless (run.json `imported_from.headless`) until `mmadapt fit-head` gives them one.
    headless: tuple[str, ...] = ()

    # Where the LM head's tensors are (name prefixes): a checkpoint without them is a body's.
    head_prefixes: tuple[str, ...] = ()
    # config.json fields the mapping reads that transformers' config class gives a default where a
    # file leaves them out (hf.read_hf_config fills them from that class, as transformers does).
    defaulted: tuple[str, ...] = ()

    def is_headless(self, cfg: dict) -> bool:
        """Whether config.json `cfg` is of a body class (`headless`)."""
        return (cfg.get("architectures") or [None])[0] in self.headless

    def architecture(self, model_type: str, names: list[str]) -> str | None:
        """The class of a config.json of `model_type` that names none (transformers' Auto classes
        go by model_type), from its weights' tensor names: a body (`headless`) where they hold no
        LM head (`head_prefixes`), else the class with the head."""
        archs = [a for a, t in self.architectures.items() if t == model_type]
        bodies = [a for a in archs if a in self.headless]
        if bodies and not any(n.startswith(self.head_prefixes) for n in names):
            return bodies[0]
        return next((a for a in archs if a not in self.headless), None)

    def model_kwargs(self, cfg: ModelConfig, kind: str | None) -> dict:
        """What the exported class's constructor takes beside its config (a body without a pooler)."""
        return {}

    def check_config(self, cfg: dict, model_dir: Path) -> None:
        """Refuse a config.json the family cannot compute exactly."""
        raise NotImplementedError

    def model_config(self, cfg: dict) -> ModelConfig:
        """config.json -> the ModelConfig that holds it."""
        raise NotImplementedError

    def special_ids(self, tok, cfg: dict, vocab_size: int, model_dir: Path) -> tuple[list[int], dict]:
        """The source ids of mmadapt's special roles (tokens.py's order: pad, unk, <s>, </s>, <mask>),
        and what run.json records of them (role -> source id)."""
        raise NotImplementedError

    def from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_ids: list[int], hf_cfg: dict) -> dict:
        """A Hugging Face state dict -> the family's `build_lm` state dict (TP 1), rows of every
        vocabulary-indexed tensor in mmadapt's ids (`hf_ids`: mmadapt id -> source id)."""
        raise NotImplementedError

    def to_hf(self, cfg: ModelConfig, state: dict, kind: str | None, hf_ids: list[int] | None, ids: dict,
              model_type: str) -> dict:
        """The family's LM (kind None), its body alone (kind "body", an encoder's headless class,
        for sentence-transformers) or task model state dict -> the Hugging Face class's;
        hf_ids: mmadapt id -> the exported tokenizer's id (None: the same ids); ids: its pad, bos
        and eos ids."""
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, kind: str | None, labels: list[str] | None, ids: dict[str, int],
                  model_type: str):
        """The transformers config of `model_type`'s class for `kind` that holds `cfg`."""
        raise NotImplementedError

    def task_head_names(self, kind: str) -> dict[str, str]:
        """{the task model's head tensor: the Hugging Face task class's name for it} (kind
        "classify": the sequence classifier's), for every tensor the task model holds beyond
        the body; what to_hf writes them as and an imported task model reads them from. {}:
        the family has no task class to import."""
        return {}

    def tokenizer_layout(self, kind: str | None, imported: bool, cfg: ModelConfig,
                         text_layout: dict | None = None, task_start: tuple[int, ...] = (BOS_ID,)) -> dict | None:
        """How an exported tokenizer lays out a text of `kind` for the model `cfg` (a `tokenizers`
        template over mmadapt's special roles, mmadapt/hf.py); None: an imported tokenizer goes out
        as it is. text_layout: an imported source's (run.run_text_layout), which its Step-2
        vocabularies trained with; task_start: what a task model's rows start with (its Step-3
        record's, features.Framing.start)."""
        raise NotImplementedError

    def export_model_type(self, model_type: str | None, cfg: ModelConfig, own_tokenizer: bool) -> str:
        """The model type to export as (`model_type`: the imported source's, None for a model
        mmadapt pretrained)."""
        raise NotImplementedError

    def import_note(self, hf_cfg: dict, model_dir: Path) -> str | None:
        """What `import-hf` says it changed or capped (None: nothing)."""
        return None

    # --- what the import checks (mmadapt/hf.py: import_hf's checkpoint validator) ---------------------
    # config.json fields that must be whole numbers >= 1 where present (checked before check_config).
    positive_fields: tuple[str, ...] = ()
    # Tensors a checkpoint may hold that transformers ignores when it loads the architecture
    # (regular expressions, re.search): the import ignores them too. Every other tensor of the
    # files that from_hf does not read is refused.
    ignored: tuple[str, ...] = ()

    def as_loaded(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_cfg: dict) -> tuple[ModelConfig, str | None]:
        """The config of the model transformers builds from these files, where the files decide
        what config.json alone does not (a tie flag beside an output projection of its own), and
        what import-hf says of the difference (None: none)."""
        return cfg, None

    def implied(self, cfg: ModelConfig, hf: dict[str, torch.Tensor], hf_cfg: dict) -> dict[str, "Implied"]:
        """Every tensor config.json implies (`cfg`: as_loaded's; `hf`: the files' tensors, for
        their names' prefix): HF name -> its shape and the fields that set it, so that a missing
        tensor or a shape that disagrees is refused naming the field. {}: undeclared (from_hf's
        reads and the shapes of its result are still checked)."""
        return {}

    # The layer index in a checkpoint's tensor names (a regular expression, its group 1), for unused_note.
    layer_name: str | None = None

    def unused_note(self, name: str, cfg: ModelConfig, hf_cfg: dict) -> str | None:
        """Why the files hold tensor `name` that the config does not describe, naming the config
        field that disagrees (a layer past num_hidden_layers); None: nothing to add."""
        layer = re.search(self.layer_name, name) if self.layer_name else None
        if layer and int(layer.group(1)) >= cfg.num_layers:
            return (f"config.json's num_hidden_layers is {cfg.num_layers}, but the weights hold layer {layer.group(1)} "
                    "(0-based): set num_hidden_layers to the number of layers the weights hold")
        return None


class OutputPath(NamedTuple):
    """How a one-head model (Step 2's body, a primary model) scores the vocabulary, in build_lm's
    parameter names: logits = y W^T (+ b) with y = w * x_hat (+ beta), the head's last norm
    (LayerNorm or RMSNorm: ||x_hat|| <= sqrt(h)). What expand.bounded_start needs to bound the
    probability mass that new pieces take."""
    matrix: str  # W [V, h]: the word embedding when tied, else the output projection
    bias: str | None  # b [V]
    norm_weight: str  # w [h]
    norm_bias: str | None  # beta [h]


class ModelFamily:
    """One architecture. Subclasses set the class attributes and implement the builders."""

    name: str
    objective: Objective  # objectives.MLM or objectives.CAUSAL (or a family's own)
    task_kinds: tuple[str, ...]  # what build_task_model builds
    presets: dict[str, tuple[ModelConfig, TrainConfig]] = {}  # name -> (model, schedule), unique across families
    small_preset: str  # a key of `presets`: the default schedule of later steps over this family's runs
    framing: Framing = Framing()  # task inputs (Steps 3-4): features.py's layouts in this family's form
    # The run tokenizers this family's models take (tokenizer.kind): mmadapt's SentencePiece
    # unigram models, and the kinds of Hugging Face tokenizer its import maps.
    tokenizer_kinds: tuple[str, ...] = ("sentencepiece",)
    # ModelConfig fields this family uses although their metadata does not list it (a family
    # defined outside mmadapt that uses, say, output_bias_init); see check_fields.
    config_fields: tuple[str, ...] = ()
    compiled_kinds: tuple[type, ...] = ()  # module classes fusion "compile" compiles, each instance in place
    # Of compiled_kinds, those fusion "cudagraphs" replays as CUDA graphs where frozen below a trained
    # input (Step 2's body): modules whose shapes are fixed in training (the layers; not the heads,
    # whose masked rows vary by batch).
    graphed_kinds: tuple[type, ...] = ()
    pipeline_ties: dict[str, str] = {}  # tied pipeline module key -> its build_lm name prefix
    hf: HFMapping | None = None  # the Hugging Face mapping, or None
    # Parameter names of build_lm's modules: the input embedding [V, h], layer i's (0-based)
    # prefix `layers_prefix + "i."`, head k's `heads_prefix + "k."`.
    word: str = WORD
    layers_prefix: str = "layers."
    heads_prefix: str = "heads.heads."

    # --- configs -------------------------------------------------------------------------------------
    def validate(self, cfg: ModelConfig) -> ModelConfig:
        """Every check of a model config of this family, in one line each: ModelConfig's own,
        the fields this family does not use (`check_fields`), then the family's (`check`)."""
        cfg.validate()
        self.check_fields(cfg)
        self.check(cfg)
        return cfg

    def uses(self, field: dataclasses.Field) -> bool:
        """Whether this family reads the ModelConfig field: its metadata `families` (None: every one)
        names this family or one it derives from (a subclass builds on its base's modules), or the
        family claims it (`config_fields`)."""
        families = field.metadata.get("families")
        lineage = {getattr(c, "name", None) for c in type(self).__mro__}
        return families is None or bool(lineage & set(families)) or field.name in self.config_fields

    def check_fields(self, cfg: ModelConfig) -> None:
        """Refuse a field that this family does not use, set to anything but its default: it would
        be recorded in run.json and change nothing (or mislead a reader into thinking it did)."""
        for f in dataclasses.fields(ModelConfig):
            value = getattr(cfg, f.name)
            if not self.uses(f) and value != f.default:
                what, tail = f.metadata["unused"]
                raise ValueError(f"{f.name} {value} {what}; the {self.name} family{tail}: drop it")

    def check(self, cfg: ModelConfig) -> None:
        """Refuse, with one line, what this family cannot build beyond check_fields."""

    def check_loop(self, loop: LoopConfig) -> None:
        """Refuse, with one line, a training setting that means nothing for this family's objective."""

    def scored_fraction(self, train: TrainConfig) -> float:
        """The fraction p of a block's positions that reach an LM head under `train`: the p of
        `step_flops`: its objective's (Objective.scored_fraction)."""
        return self.objective.scored_fraction(train)

    # --- modules -------------------------------------------------------------------------------------
    def build_lm(self, cfg: ModelConfig, seed: int = 1234) -> torch.nn.Module:
        raise NotImplementedError

    def build_task_model(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234) -> torch.nn.Module:
        raise NotImplementedError

    def build_body(self, cfg: ModelConfig, seed: int = 1234) -> torch.nn.Module:
        """The model without heads, for `encode` (retrieval through a primary model)."""
        raise NotImplementedError

    def build_pipeline(self, cfg: ModelConfig, seed: int, data_parallel_size: int):
        raise ValueError(f"the {self.name} family has no pipeline form: use --pipeline_model_parallel_size 1 with data "
                         "or tensor parallelism")

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
        return (self.word,)

    def artifact_keys(self) -> dict[str, str]:
        """Artifact file key -> parameter name, for every vocabulary-indexed parameter an
        artifact may hold (embeddings.pt; "word_embeddings" is every family's input embedding)."""
        return {"word_embeddings": self.word}

    def task_framing(self, prefix: list[int] | None = None) -> Framing:
        """The framing of a new Step-3 run over a primary model whose text layout's prefix is
        `prefix` (run.run_text_layout; None: a model mmadapt pretrained): its rows start as the
        model read text in training (Objective.text_start)."""
        return dataclasses.replace(self.framing, start=tuple(self.objective.text_start(prefix)))

    def recorded_framing(self, run: dict) -> Framing:
        """The framing the Step-3 run recorded in `run` trained with (its task_start; a run
        recorded before there was one started its rows with <s>)."""
        return dataclasses.replace(self.framing, start=tuple(run.get("task_start", (BOS_ID,))))

    def output_path(self, cfg: ModelConfig) -> OutputPath:
        """The output path of a one-head model of `cfg` (OutputPath): what --vocab_mode expand
        starts the new pieces' outputs by (adapt.check_output_start asks for it before a run
        writes anything), and export-hf --graft. Not every family needs it: a ValueError here."""
        raise ValueError(f"the {self.name} family does not define output_path (ModelFamily.output_path: how its "
                         "one-head model scores the vocabulary), which --vocab_mode expand starts the new pieces' "
                         "outputs by and a graft reads: define it (docs/model-families.md), or use --vocab_mode "
                         "replace")

    def output_biases(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The output bias [V] of every LM head of `cfg` (build_lm names): what Step 1 starts at
        the training text's log-frequencies with ModelConfig.output_bias_init unigram. None here."""
        return ()

    def head_scales(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The last scale [h] of every LM head before its output projection (build_lm names): what
        mmadapt fit-head starts from the source's word embedding (steps.head_scale). None here."""
        return ()

    def finetune_trainable(self, cfg: ModelConfig) -> tuple[str, ...]:
        """build_task_model names (or prefixes ending in ".") that Step 3 trains: everything but
        the word embeddings."""
        raise NotImplementedError

    def task_state(self, cfg: ModelConfig, state: dict) -> dict:
        """The part of a `build_lm` state dict that `build_task_model` starts from, in its names
        (the task head itself is new): by default the body, every head dropped."""
        return {k: v for k, v in state.items() if not k.startswith(self.heads_prefix)}

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

    def keep_head(self, state: dict, head_index: int) -> dict:
        """Keep head `head_index` as head 0 and drop the other heads."""
        heads = self.heads_prefix
        out = {k: v for k, v in state.items() if not k.startswith(heads)}
        prefix = f"{heads}{head_index}."
        out.update({f"{heads}0." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return out

    def keep_layers(self, state: dict, n: int) -> dict:
        """Drop every layer from index n (0-based) up."""
        layers = self.layers_prefix
        return {k: v for k, v in state.items()
                if not k.startswith(layers) or int(k[len(layers):].split(".", 1)[0]) < n}

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

    def minipost_trainable(self, mini_layers: int, new_layers: int) -> tuple[str, ...]:
        """Name prefixes of the parameters Step 1b trains (0-based layer indices N..N+K-1)."""
        return tuple(f"{self.layers_prefix}{i}." for i in range(mini_layers, mini_layers + new_layers))

    # --- FLOPs ----------------------------------------------------------------------------------------
    def step_flops(self, step: str, cfg: ModelConfig, s: int, p: float, paper: bool = False,
                   trainable_layers: int = 0) -> float:
        """FLOPs per sequence of one update of `step` (one of flops.STEPS); trainable_layers: Step
        1b's new layers l_t; paper=True: the paper's formulas (Appendix A.1), where the family has
        them."""
        raise NotImplementedError

    def row_flops(self, step: str, cfg: ModelConfig, s: int, trainable_layers: int = 0) -> tuple[float, float] | None:
        """`step_flops` (exact) as (per sequence with no position projected, per projected
        position): every head term of a step is linear in the positions its heads project, the
        body's in none, so a count that knows how many were projected (Step 2's artifacts: the
        masking's draws, not mask_prob of every position) is exact. Read off step_flops at one
        and at s projected positions a sequence; None where s < 2 (the two coincide)."""
        if s < 2:
            return None
        one, every = (self.step_flops(step, cfg, s, p, trainable_layers=trainable_layers) for p in (1 / s, 1.0))
        per_row = (every - one) / (s - 1)
        return every - s * per_row, per_row

    def scoring_flops(self, cfg: ModelConfig, s: int, blocks: int, rows: int) -> float:
        """One scoring pass (step "score": a forward in evaluation) over `blocks` blocks of s
        positions, `rows` of them scored (the rows the last layer's post-attention work and the
        head run at), exact by `row_flops`."""
        return flops_by_rows(self.step_flops("score", cfg, s, rows / (blocks * s)), self.row_flops("score", cfg, s),
                             blocks, rows)

    def param_names(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every `build_lm` parameter's name and shape, built on the meta device (no memory)."""
        with torch.device("meta"):
            return {n: tuple(p.shape) for n, p in self.build_lm(cfg).named_parameters()}
