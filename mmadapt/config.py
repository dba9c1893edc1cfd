"""Configuration: one dataclass field per hyperparameter, named presets, system recipes.

Field names follow megatron-core and DeepSpeed (`num_layers`, `hidden_size`,
`tensor_model_parallel_size`, `train_micro_batch_size_per_gpu`, ...). Every field
carries its help text in `metadata["help"]`; `add_dataclass_args` turns the fields
into CLI flags, so a flag overrides a field by its own name.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import functools
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, NamedTuple, Optional, Union, get_args, get_origin, get_type_hints


def _f(default, help: str, flag: bool = True, *, ge=None, gt=None, le=None, lt=None,
       choices: tuple[str, ...] | None = None, **kw):
    """A config field with its help text and, for a number, its valid range (ge/gt/le/lt: >=, >,
    <=, <; each item of a tuple field) or, for a string, its `choices`: checked once, when the
    config is made (`check_declared`). flag=False: set by the steps, never a command-line flag."""
    return field(default=default, metadata={"help": help, "flag": flag, **_limits(ge, gt, le, lt, choices)}, **kw)


def _owned_by(owner: "Owner", default, help: str, **limits):
    """`_f` for a field of a config several steps share that only `owner`'s steps use: the others
    neither offer it as a flag (add_dataclass_args) nor accept it (LoopConfig.check_step)."""
    declared = _f(default, help, **limits)
    return field(default=default, metadata={**declared.metadata, "owner": owner})


class Owner(NamedTuple):
    """The steps that alone use a field (`_f`'s owner): `name` as a refusal says it, `steps` the
    names of the steps (StepSpec.name: their commands)."""
    name: str
    steps: tuple[str, ...]


# Step 2's own settings in TrainConfig, the schedule Steps 1, 1b, 2 and fit-head share: Step 2 and
# the depth sweep (which runs Step 2) take them; pretrain, build_minipost and fit-head neither
# offer them as flags nor accept them (LoopConfig.check_step).
STEP2 = Owner("Step-2", ("adapt", "sweep"))


@dataclass(frozen=True)
class Bounds:
    """A number's valid range: lo/hi, each inclusive or not (None: unbounded on that side)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, value) -> bool:
        lo = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        hi = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return lo and hi

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def _limits(ge, gt, le, lt, choices) -> dict:
    """A field's declared limits as metadata: "bounds" (Bounds), "choices"."""
    out = {}
    if (ge, gt, le, lt) != (None,) * 4:
        out["bounds"] = Bounds(ge if gt is None else gt, le if lt is None else lt, gt is not None, lt is not None)
    if choices is not None:
        out["choices"] = tuple(choices)
    return out


def field_name(cls, name: str) -> str:
    """How a refusal names field `name` of `cls`: the flag the user typed (--name) for a config
    field that is a flag, else Class.name (a step's argument, a field the steps set)."""
    f = cls.__dataclass_fields__[name]
    return f"--{name}" if f.metadata.get("flag", False) else f"{cls.__name__}.{name}"


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return get_type_hints(cls)


def check_declared(obj) -> None:
    """Refuse, in one line naming the field (`field_name`) and what it takes, the first field of
    the dataclass instance `obj` whose value is not of its declared type (a Path field takes a
    str or path and becomes a Path; a tuple field a tuple or list), not a finite number where a
    number is declared, outside its declared range (`_f`'s ge/gt/le/lt, each item of a tuple),
    not one of its choices, or an empty list where one is needed (a tuple field with a non-empty
    default). Every config and step dataclass runs it when made (__post_init__): the command
    line, the Python API, `mmadapt demo` and `mmadapt flops` check the same way, before any work."""
    cls = type(obj)
    for f in dataclasses.fields(obj):
        value = _checked_value(obj, f, _hints(cls)[f.name], field_name(cls, f.name))
        if value is not getattr(obj, f.name):
            object.__setattr__(obj, f.name, value)  # frozen dataclasses too


def _checked_value(obj, f, kind, name: str):
    """The value of field f of obj, checked (check_declared); a path-like one as a Path."""
    value = getattr(obj, f.name)
    args = get_args(kind)
    if get_origin(kind) in (Union, UnionType) and type(None) in args:
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None)) if len(args) == 2 else kind
    if set(get_args(kind)) - {type(None)} == {str, Path}:  # a path, or a name that is not one (corpus: bible:de)
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise ValueError(f"{name} takes a path, got {value!r}")
        return value
    item = _tuple_item(kind)
    if item is not None:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{name} takes a list of values, got {value!r}")
        if not value and (f.default is None or isinstance(f.default, tuple) and f.default):
            raise ValueError(f"{name} needs at least one value")
        checked = [_check_one(v, item, f, name) for v in value]
        return value if all(c is v for c, v in zip(checked, value)) else type(value)(checked)
    return _check_one(value, kind, f, name)


def _check_one(value, kind, f, name: str):
    if kind is Path:  # '' (or blanks) would be '.': the directory the process stands in
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise ValueError(f"{name} takes a path, got {value!r}")
        return Path(value)
    # NumPy's scalars (a sweep over np.arange) as Python's: the value recorded in run.json is JSON
    if kind in (int, float) and not isinstance(value, (bool, int, float)) and \
            isinstance(value, numbers.Integral if kind is int else numbers.Real):
        value = kind(value)
    if kind in (int, float, bool, str) and (isinstance(value, bool) != (kind is bool)
                                            or not isinstance(value, (int, float) if kind is float else kind)):
        what = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}[kind]
        raise ValueError(f"{name} takes {what}, got {value!r}")
    if kind is str and not value.strip():  # a file or name left out by mistake (eval_file='' scored nothing)
        raise ValueError(f"{name} takes a non-empty string, got {value!r}")
    if isinstance(kind, type) and dataclasses.is_dataclass(kind) and not isinstance(value, kind):
        raise ValueError(f"{name} takes a {kind.__name__}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    bounds, choices = f.metadata.get("bounds"), f.metadata.get("choices")
    if bounds is not None and not bounds.holds(value):
        raise ValueError(f"{name} must be {bounds}, got {value}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def path_args(value, name: str) -> list[Path]:
    """A Python API argument of one or more paths (a list, or one path), checked as check_declared
    checks a field: refused in one line naming the argument unless each is a non-empty path."""
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{name} takes a non-empty list of paths, got {value!r}")
    bad = next((v for v in items if not isinstance(v, (str, os.PathLike)) or not str(v).strip()), None)
    if bad is not None:
        raise ValueError(f"{name} takes paths, got {bad!r}")
    return [Path(v) for v in items]


def path_arg(value, name: str) -> Path:
    """A Python API argument of one path (a str or os.PathLike), checked as path_args checks each."""
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} takes one path, got {value!r}")
    return path_args(value, name)[0]


def bool_arg(value, name: str) -> bool:
    """A Python API argument that is True or False: a string such as 'false' would switch it on."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} takes True or False, got {value!r}")
    return value


def spec_arg(value, name: str) -> str:
    """A Python API argument naming a file per language: a path (str or os.PathLike) in which
    `{lang}` stands for each language, as a str (a Path has no str.replace)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{name} takes a path (a str or Path; {{lang}} in it stands for each language), got {value!r}")
    return os.fspath(value)


def whole_arg(value, name: str, lo: int, optional: bool = False) -> int | None:
    """A Python API argument that is a whole number >= lo (or None where `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name} must be a whole number >= {lo}, got {value!r}")
    return int(value)  # NumPy's (a sweep over np.arange) as Python's, as check_declared takes them


class Checked:
    """A dataclass whose fields are checked when it is made (check_declared)."""

    def __post_init__(self):
        check_declared(self)


class StepSpec(Checked):
    """A step's typed interface (steps.Pretrain, adapt.AdaptEmbeddings, ...; `name`: the command
    that runs it): its fields checked when it is made, and every loop config it holds checked to
    set no field that another step owns (LoopConfig.check_step)."""
    name: ClassVar[str] = ""
    # The RunSpec text fields the step reads (run.check_run refuses the others: they were dropped
    # without a word), and where its text comes from otherwise.
    run_text: ClassVar[tuple[str, ...]] = ("data_path", "corpus", "tokenizer")
    text_from: ClassVar[str] = ""

    def __post_init__(self):
        super().__post_init__()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LoopConfig):
                value.check_step(self.name)


@functools.lru_cache(maxsize=None)
def _defaults(cls):
    """An instance of the config class `cls` with every field at its default."""
    return cls()


DECODER = (("llama",), ("is a decoder setting", " does not use it"))


def _owned(default, help: str, owners: tuple[tuple[str, ...], tuple[str, str]], *, ge=None, gt=None,
           choices: tuple[str, ...] | None = None):
    """A ModelConfig field that only some model families use: (their names, (what the field is,
    what the refusal says of a family that does not use it)). ModelFamily.check_fields refuses the
    field set to anything but its default for any other family (or a family that claims it,
    ModelFamily.config_fields)."""
    families, unused = owners
    return field(default=default, metadata={"help": help, "flag": True, "families": families, "unused": unused,
                                            **_limits(ge, gt, None, None, choices)})


# ModelConfig.attention_impl's values (mmadapt/models/layers.py).
ATTENTION_IMPLS = ("sdpa", "varlen", "math")
# ModelConfig.fusion's values (mmadapt/fusion.py applies them).
FUSIONS = ("auto", "none", "compile", "cudagraphs")
# ModelConfig.output_bias_init's values (steps.pretrain applies them).
OUTPUT_BIAS_INITS = ("zeros", "unigram")
# Step 2's start of the new vocabulary's rows (adapt.init_rows): the paper's overlap copy, FVT's
# subword mean, or every row drawn.
EMBEDDING_INITS = ("overlap", "subword_mean", "normal")
PRIMARY_CALIBRATIONS = ("none", "bias", "scale")  # TrainConfig.primary_calibration
# Step 2's vocabulary (adapt.py): the target's own (the paper), or the source's with the target's
# missing pieces appended (expand.py), only those trained.
VOCAB_MODES = ("replace", "expand")
# Step 2's share of source-language replay where --replay_data is given (TrainConfig.replay_fraction):
# the least of 0.1, 0.25, 0.5 that kept the demo's English within 0.03 nats of the source model's
# after 1000 expand updates for both families and systems (benchmarks/results/expand_replay_cpu2_20261126).
REPLAY_FRACTION = 0.5
# How an expanded vocabulary's new rows start on the output side (expand.bounded_start): bounded
# (their share of the source text's probability mass calibrated at update 0: expand.calibrate),
# worst_case (capped at every position) or as --embedding_init starts them.
EXPAND_OUTPUT_STARTS = ("bounded", "worst_case", "embedding_init")
# The least size of a target vocabulary a step trains (Step 2's, a sweep's, extend's --vocab_size):
# SentencePiece's four special pieces and room for a few of the text's own.
MIN_VOCAB_SIZE = 8


@dataclass
class ModelConfig(Checked):
    family: str = _f("roberta", "model family (mmadapt/models/): roberta (post-LayerNorm encoder, masked LM) or "
                     "llama (pre-norm decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention; causal LM); "
                     "set by the preset (each preset belongs to one family), not a flag", flag=False)
    num_layers: int = _f(12, "number of transformer layers", ge=1)
    hidden_size: int = _f(768, "hidden size h", ge=1)
    num_attention_heads: int = _f(12, "attention heads per layer", ge=1)
    ffn_hidden_size: int = _f(3072, "feed-forward inner size", ge=1)
    vocab_size: int = _f(50_000, "SentencePiece vocabulary size V (special tokens included)", ge=1)
    max_position_embeddings: int = _f(512, "learned positions; upper bound on seq_length", ge=1)
    hidden_dropout: float = _f(0.1, "dropout on embeddings and on each residual branch", ge=0, lt=1)
    attention_dropout: float = _f(0.1, "dropout on attention probabilities", ge=0, lt=1)
    layernorm_epsilon: float = _f(1e-5, "LayerNorm epsilon", ge=0)
    init_method_std: float = _f(0.02, "std of the normal init of every weight matrix and embedding", ge=0)
    output_bias_init: str = _owned("zeros", "Step 1: how every MLM head's output bias [V] starts: zeros, or unigram "
                                   "(the log-frequency of each piece in the training text, add-one smoothed: what a "
                                   "model that ignores its input predicts, so its layers need not learn to; the "
                                   "encoder only, a decoder's head has no bias)",
                                   (("roberta",), ("starts an MLM head's output bias", "'s LM head has none")),
                                   choices=OUTPUT_BIAS_INITS)
    head_layers: tuple = _f(
        (), "layers after which an MLM head sits, ascending; must end with num_layers "
        "(the primary head). Empty: one head, after the last layer", ge=1)
    head_weights: tuple[float, ...] = _f(
        (), "one weight per MLM head, in head_layers order: the loss is sum(w_i * loss_i) / sum(w_i). Empty: "
        "the mean of the heads' losses (the paper's MINIJOINT: its two heads weighted equally)", ge=0)
    attention_impl: str = _f(
        "sdpa", "'sdpa' (fused scaled_dot_product_attention; a padded batch passes a mask, so on a GPU "
        "it gets the memory-efficient kernel, not flash), 'varlen' (padded batches as jagged tensors "
        "of their real tokens: flash's variable-length kernel on a GPU, nothing spent on padding) or "
        "'math' (explicit matmuls, which torch's FLOP counter sees)", choices=ATTENTION_IMPLS)
    fusion: str = _f(
        "auto", "'auto' ('compile' where the model trains on a CUDA device, 'none' elsewhere), 'none' (eager: the "
        "reference in tests) or 'compile' (torch.compile of each transformer layer and of the MLM heads, in place: "
        "parameter names and checkpoints unchanged; its first update compiles, tens of seconds) or 'cudagraphs' ("
        "'compile', and Step 2's frozen layers replayed as CUDA graphs: a CUDA device, attention 'sdpa' or 'math', "
        "tensor and pipeline parallel size 1)", choices=FUSIONS)
    num_query_groups: Optional[int] = _owned(None, "decoder: key/value head groups of grouped-query attention, "
                                             "dividing num_attention_heads and tensor_model_parallel_size (default: "
                                             "one per attention head, i.e. multi-head attention)", DECODER, ge=1)
    kv_channels: Optional[int] = _owned(None, "decoder: channels per attention head, megatron's kv_channels (Gemma-7B: "
                                        "256 at hidden_size 3072 and 16 heads) (default: hidden_size // "
                                        "num_attention_heads)", DECODER, ge=1)
    add_qkv_bias: bool = _owned(False, "decoder: a bias on the query, key and value projections (Qwen2 has one; Llama "
                                "and Mistral do not)", DECODER)
    rotary_base: float = _owned(10000.0, "decoder: base of the rotary position embedding's frequencies (Llama-2 "
                                "10000, Llama-3 500000, Qwen2 1000000)", DECODER, gt=0)
    seq_len_interpolation_factor: Optional[float] = _owned(
        None, "decoder: linear rotary scaling (position interpolation, Chen et al. 2023): positions are divided by "
        "this factor, as transformers' rope_type 'linear' does (default: none)", DECODER, gt=0)
    share_embeddings_and_output_weights: bool = _owned(True, "decoder: the output projection is the input embedding "
                                                       "(tied); false: an output projection of its own [V, h]. The "
                                                       "encoder's is always tied", DECODER)
    type_vocab_size: int = _owned(2, "BERT: token types (segment embeddings): 2, the second segment of a pair marked 1 "
                                  "(features.Framing), or 1 (every position type 0); blocks of Steps 1, 1b and 2 are "
                                  "all type 0", (("bert",), ("sets BERT's token types", " has none")), ge=1)
    add_pooling_layer: bool = _owned(False, "encoder: the language model carries a pooler (dense + tanh on the first "
                                     "position) as transformers' BertModel and RobertaModel do; an imported body keeps "
                                     "its trained pooler, which BERT's sequence classifier starts from (no LM loss "
                                     "trains it)", (("roberta",), ("is an encoder's pooler", " has none")))
    tensor_model_parallel_size: int = _f(1, "tensor-parallel ranks (megatron-core layers)", ge=1)
    pipeline_model_parallel_size: int = _f(1, "pipeline stages (DeepSpeed PipelineModule)", ge=1)
    frozen_vocab_size: int = _f(0, "Step 2 with an expanded vocabulary (--vocab_mode expand; set by adapt, not by "
                                "hand): the first frozen_vocab_size rows of every vocabulary-indexed weight are the "
                                "source's, a frozen parameter apart from the new rows after them, which alone train "
                                "(0: each such weight is one parameter)", flag=False, ge=0)

    def __post_init__(self):
        # None is "none given" (the Python API's spelling of the CLI's absent flag), as (); another
        # value is check_declared's to refuse (head_layers=12: a list of values), not tuple()'s TypeError
        self.head_layers = () if self.head_layers is None else self.head_layers
        self.head_weights = () if self.head_weights is None else self.head_weights
        check_declared(self)
        self.head_layers = tuple(int(x) for x in self.head_layers)
        self.head_weights = tuple(float(x) for x in self.head_weights)

    @property
    def heads_after(self) -> tuple[int, ...]:
        """The layers whose outputs feed an MLM head (head_layers, or the last layer alone)."""
        return self.head_layers or (self.num_layers,)

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first invalid combination."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        groups = self.num_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads "
                             f"{self.num_attention_heads}: each key/value group serves a whole number of heads")
        if groups is not None and groups % tp:
            raise ValueError(f"num_query_groups {groups} is not divisible by tensor_model_parallel_size {tp}: each "
                             "tensor-parallel rank holds whole key/value groups; pick a tensor-parallel size that "
                             "divides it")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        self._validate_tensor_parallel()
        if self.frozen_vocab_size >= self.vocab_size:
            raise ValueError(f"frozen_vocab_size {self.frozen_vocab_size} must be in 0..vocab_size - 1 "
                             f"({self.vocab_size - 1}): the source's rows, with at least one new row after them")
        bad = [l for l in self.heads_after if l > self.num_layers]
        if bad:
            raise ValueError(f"head layer {bad[0]} is outside 1..num_layers={self.num_layers}")
        if list(self.heads_after) != sorted(set(self.heads_after)):
            raise ValueError(f"head_layers {self.head_layers} must be ascending without repeats")
        if self.heads_after[-1] != self.num_layers:
            raise ValueError(f"head_layers {self.head_layers} must end with num_layers={self.num_layers} "
                             "(the primary head)")
        if self.head_weights and len(self.head_weights) != len(self.heads_after):
            raise ValueError(f"head_weights {self.head_weights} has {len(self.head_weights)} entries for "
                             f"{len(self.heads_after)} heads (after layers {self.heads_after}): give one per head")
        if self.head_weights and sum(self.head_weights) <= 0:
            raise ValueError(f"head_weights {self.head_weights} must have a positive sum")
        if pp > self.num_layers:
            raise ValueError(f"pipeline_model_parallel_size {pp} exceeds num_layers {self.num_layers}: "
                             "a stage must own at least one layer")
        if self.fusion == "cudagraphs" and (tp > 1 or pp > 1):
            raise ValueError(f"--fusion cudagraphs captures whole layers, at tensor and pipeline parallel size 1 "
                             f"(here {tp} and {pp}): use --fusion compile")
        if self.fusion == "cudagraphs" and self.attention_impl == "varlen":
            raise ValueError("--fusion cudagraphs replays fixed shapes, and --attention_impl varlen changes them with "
                             "every batch's lengths: use --attention_impl sdpa, or --fusion compile")
        return self

    def _validate_tensor_parallel(self) -> None:
        """Every tensor-parallel rank holds whole heads, an equal share of the FFN and of the (padded)
        vocabulary."""
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"tensor_model_parallel_size {tp}: pick a tensor-parallel size that divides it")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                             f"tensor_model_parallel_size {tp}")
        if self.frozen_vocab_size and self.vocab_size % tp:
            # An expanded vocabulary's size is a multiple of expand.EXPAND_MULTIPLE (8): padding
            # is not built for its split rows (layers.split_vocab).
            raise ValueError(f"vocab_size {self.vocab_size} of an expanded vocabulary is not divisible by "
                             f"tensor_model_parallel_size {tp}: expand with a tensor-parallel size that divides it, "
                             "or with data parallelism (--tensor_model_parallel_size 1)")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of tensor_model_parallel_size: the rows a
        vocabulary-indexed weight holds over its ranks, megatron's even split (Megatron-LM pads to
        a multiple of 128 x TP and trains the padding). The at most TP - 1 padding rows are no
        piece: zeros, never looked up, their logits -inf (layers.real_rows, vocab_linear), cut
        from every full state dict (checkpoint.load_full_state_dict) and added back for a rank's
        slice (engine._shard)."""
        tp = self.tensor_model_parallel_size
        return -(-self.vocab_size // tp) * tp

    @property
    def head_dim(self) -> int:
        """Channels per attention head: kv_channels, or its default hidden_size // num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value head groups: num_query_groups, or one per head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def loss_weights(self) -> tuple[float, ...] | None:
        """head_weights normalised to sum to 1 (None: every head weighted equally, the plain mean)."""
        if not self.head_weights:
            return None
        return tuple(w / sum(self.head_weights) for w in self.head_weights)


@dataclass
class MiniModelConfig(Checked):
    """The mini-model's shape (paper section 2): its depth N, and MINIPOST's new layers K."""
    mini_layers: tuple = _f((4,), "N: depth of the mini-model (BL_SMALL has N layers; MINIJOINT's second head "
                            "sits after layer N; MINIPOST copies the bottom N layers). MINIJOINT takes several "
                            "(2 4 6: a secondary head after each, mini-models of each depth from one "
                            "pretraining); Step 2 picks one of its source run's", ge=1)
    new_layers: int = _f(2, "K: MINIPOST's new layers, trained on top of the copied N (Step 1b)", ge=1)

    def __post_init__(self):
        # Always a tuple; one int is read as one depth (run.json files of one-depth runs hold an int).
        depths = self.mini_layers
        self.mini_layers = tuple(depths) if isinstance(depths, (tuple, list)) else (depths,)
        check_declared(self)

    def one_depth(self, what: str) -> int:
        """The one depth N of a step that builds one mini-model (ValueError naming `what` otherwise)."""
        if len(self.mini_layers) != 1:
            raise ValueError(f"{what} builds one mini-model: pass one --mini_layers, not "
                             f"{' '.join(map(str, self.mini_layers))}")
        return self.mini_layers[0]


@dataclass
class PreprocessConfig(Checked):
    """`mmadapt preprocess`: how a corpus is prepared once for every run that trains on it."""
    workers: Optional[int] = _f(None, "encoding processes, each over its own byte range of the corpus "
                                "(default: the CPU count); the result is the same for any number", ge=1)
    tokenizer_sample_lines: int = _f(2_000_000, "lines sampled (seeded: the same sample each time) to train the "
                                     "SentencePiece model: bounds its memory whatever the corpus size", ge=1)
    tokenizer_seed: int = _f(1234, "seed of that sample and of SentencePiece's training (and of the "
                             "validation split)", ge=0)
    tokenizer_threads: Optional[int] = _f(None, "threads SentencePiece trains with (default: the CPU count). The "
                                          "vocabulary depends on their number (each thread's share of the text is "
                                          "summed apart), which the manifest records: give that number to train the "
                                          "same vocabulary on another machine", ge=1)
    valid_fraction: float = _f(0.0, "fraction of the documents held out as validation data (chosen by a seeded "
                               "hash of each document, so the same for any number of workers)", ge=0, lt=1)
    byte_fallback: bool = _f(False, "train the vocabulary with SentencePiece's byte fallback, as Llama-2's and "
                             "Mistral's: 256 of its pieces are the bytes, so any text encodes without <unk>. Step 2 "
                             "over a source whose tokenizer has it (and extend) trains the target's so")


@dataclass
class LoopConfig(Checked):
    """What every step that trains shares (Steps 1, 1b, 2 and 3): the seed, the batch, AdamW and
    its schedule's peak, clipping, and the loop's intervals and fault settings. engine.train_loop
    and engine.build_engine take it whole. TrainConfig and FinetuneConfig add their own fields
    and change some defaults (`_default`)."""
    seed: int = _f(1234, "seed of initialisation, data order, masking and dropout", ge=0)
    train_micro_batch_size_per_gpu: int = _f(8, "blocks (fine-tuning: examples) per micro-batch per "
                                             "data-parallel rank", ge=1)
    gradient_accumulation_steps: int = _f(1, "micro-batches per update", ge=1)
    lr: Optional[float] = _f(7e-4, "peak learning rate", gt=0)
    weight_decay: float = _f(0.01, "AdamW weight decay (on weight matrices only, unless decay_all)", ge=0)
    decay_all: bool = _f(False, "weight decay on every trained parameter, biases and LayerNorm included, as "
                         "fairseq does (so the paper: true); false: on weight matrices only, as BERT and Megatron")
    adam_beta1: float = _f(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = _f(0.98, "Adam beta2", ge=0, lt=1)
    adam_eps: float = _f(1e-6, "Adam epsilon", gt=0)
    gradient_clipping: float = _f(0.0, "global gradient-norm clip (0 = off, as in RoBERTa)", ge=0)
    log_interval: int = _f(10, "updates between TensorBoard/console logs", ge=1)
    save_interval: int = _f(1000, "updates between checkpoints (and one at the end)", ge=1)
    extra_save_steps: tuple = _f((), "more update counts to checkpoint at (Step 2: the paper adds "
                                 "1000 2000 3000 4000 to every 5000 for fast-adapting languages)", ge=1)
    exit_interval: int = _f(0, "save and exit once the update count is a multiple of this (0 = off); "
                            "for jobs that must end before a scheduler's time limit", ge=0)
    keep_last: int = _f(0, "keep only the newest keep_last complete checkpoints (0 = keep all); Step-2 "
                        "embedding artifacts are never deleted", ge=0)
    max_skipped_steps: int = _f(50, "stop as diverged after this many optimizer steps in a row are skipped "
                                "(fp16 gradient overflow)", ge=0)
    calculate_per_token_loss: bool = _f(
        True, "the update's loss, and its gradient, is the mean over every scored position of the update (Step 3: "
        "every tagged word of a tag task), on every data-parallel rank (fairseq's RoBERTa; megatron-core's option "
        "of this name), so that how an update is split into micro-batches and ranks (Steps 1 and 2: the "
        "micro-batch fit's re-split too) changes only rounding; false: the mean of the micro-batches' means "
        "(Megatron-LM's BERT), where a position of a micro-batch that scores fewer weighs more. The same either "
        "way with one micro-batch on one rank, a decoder (every block scores as many) and a classify or span task "
        "(one score per row)")

    def check_step(self, step: str) -> None:
        """Refuse, in one line, a field another step owns (`_f`'s owner: a Step-2 setting, say)
        set to anything but its default in a config of the step `step` (its command does not
        offer the flag; this is the Python API's check)."""
        defaults = _defaults(type(self))
        for f in dataclasses.fields(self):
            owner = f.metadata.get("owner")
            if owner is not None and step not in owner.steps and getattr(self, f.name) != getattr(defaults, f.name):
                raise ValueError(f"{f.name} is a {owner.name} setting, which {step} does not use: drop it")

    def global_batch(self, data_parallel_size: int) -> int:
        """Blocks (or examples) per update over every data-parallel rank."""
        return self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * data_parallel_size

    def on_schedule(self, done: int, total: int) -> bool:
        """Whether update `done` is on the save schedule of a run of `total` updates (update 0,
        every save_interval, extra_save_steps, the last): what every run of the schedule saves,
        however its jobs were cut. A stop's checkpoint (SIGTERM, the STOP file) and an
        exit_interval pause (a flag a resume may change) are off it: their Step-2 artifacts are
        marked off_schedule, points no other run of the schedule has (a curve leaves them out)."""
        return done % self.save_interval == 0 or done in self.extra_save_steps or done == total

    def saves_at(self, done: int, total: int) -> bool:
        """Whether a run of `total` updates checkpoints after update `done`: on its schedule, or
        at exit_interval's pauses."""
        return self.on_schedule(done, total) or (self.exit_interval > 0 and done % self.exit_interval == 0)

    def warmup_iters(self, total: int) -> int:
        """Updates of linear warm-up before the linear decay to 0 at `total`."""
        raise NotImplementedError


def _redefault(name: str, value):
    """A LoopConfig field declared again in a subclass with another default; its help stays LoopConfig's."""
    return field(default=value, metadata=LoopConfig.__dataclass_fields__[name].metadata)


# What a --resume may change: when and how often to log, evaluate, save and stop. Everything
# else (data, tokenizer, model, batch sizes, seed, schedule) belongs to the run being resumed.
# And `fusion`: it changes which kernels compute the same model (equal in fp32 to rounding,
# tests/test_fusion.py; compiled dropout draws its masks differently), not what is trained.
# `micro_batch_fill` likewise: it changes how an update's blocks are split, not which. And the
# DeepSpeed JSON's bucket sizes: how gradients are grouped to be reduced (or, at one replica,
# added: engine.bucketed_bf16_grads), not what is trained; ds_configs/ tunes them between releases
# (zero1_bf16.json gained reduce_bucket_size on 2026-12-01).
CHANGEABLE_ON_RESUME = ("log_interval", "save_interval", "exit_interval", "eval_interval", "eval_iters",
                        "extra_save_steps", "keep_last", "max_skipped_steps", "eval_batch_tokens", "metric",
                        "fusion", "plugin_eval_blocks", "micro_batch_fill", "reduce_bucket_size", "allgather_bucket_size")
EXPAND_ONLY = ("expand_output_start", "expand_source_nats")  # TrainConfig fields only --vocab_mode expand reads
# Values of a field that a --resume reads as the same: runs recorded before 2026-11-27 hold
# replay_fraction 0.0 where no replay text was given, runs since then leave it unset.
SAME_ON_RESUME = {"replay_fraction": (None, 0.0)}


@dataclass
class TrainConfig(LoopConfig):
    """Steps 1, 1b and 2: language-model training on prepared blocks of text."""
    seq_length: int = _f(512, "tokens per block s (<= max_position_embeddings)", ge=8)
    train_iters: int = _f(125_000, "number of updates U", ge=1)
    lr_warmup_iters: int = _f(10_000, "linear warm-up updates, then linear decay to 0 at train_iters", ge=0)
    mask_prob: float = _f(0.15, "fraction p of tokens selected for MLM", gt=0, lt=1)
    score_fraction: float = _f(1.0, "causal LM (the decoder): fraction p of each block's positions scored, drawn per "
                               "block on the host (exactly round(p * seq_length) of them, at least 1; the others get "
                               "no label), so the output projection runs on those rows only; 1: every position "
                               "(the encoder refuses it: its masked LM scores mask_prob)", gt=0, le=1)
    eval_interval: int = _f(0, "updates between validation losses of every head (0 = off; needs a dataset "
                            "prepared with --valid_fraction)", ge=0)
    eval_iters: int = _f(20, "validation global batches per evaluation (as megatron-core's; each rank reads its "
                         "micro-batches of each; at most the whole ones the split holds): the same masked blocks every "
                         "time, and in every split of the global batch into micro-batches and ranks", ge=1)
    micro_batch_fill: float = _f(0.8, "on a CUDA device without pipeline stages: from the third update, each update's "
                                 "blocks on a rank (train_micro_batch_size_per_gpu x gradient_accumulation_steps, "
                                 "unchanged) are re-split into the fewest micro-batches estimated from the first update "
                                 "to peak under this fraction of the memory the device leaves the process "
                                 "(mmadapt/microbatch.py); 0, or a CPU: the split as asked", ge=0, le=0.95)
    # --- Step 2's own (STEP2: adapt and sweep offer and take them, no other step does) ---
    train_output_bias: bool = _owned_by(
        STEP2, True, "Step 2: train the output bias with the embeddings (it is indexed by the target vocabulary's "
        "pieces); false: the paper's setting, embeddings only, the bias frozen at its start (fitted to the target "
        "text's unigram distribution: docs/mini-models.md, the start rules)")
    primary_calibration: str = _owned_by(
        STEP2, "bias", "Step 2 over a mini-model (minijoint, minipost), replace mode, the bias trained: what each "
        "artifact is fitted to through the primary model it plugs into, on the ~2,048 scored positions of target "
        "training text that fit the start (forward passes only): bias (its output bias refitted to the target "
        "text's unigram distribution, as the start's is: the bias trained over the mini-model is calibrated to the "
        "mini-model's logits), scale (also one scale of the new rows, input and tied output, the one with the "
        "least loss there: better through the primary's MLM head, not on a task, docs/mini-models.md) or none (as "
        "trained). Calibrated, every artifact is (update 0's too), and the start's bias is fitted through the "
        "mini-model Step 2 trains",
        choices=PRIMARY_CALIBRATIONS)
    embedding_init: str = _owned_by(
        STEP2, "overlap", "Step 2: how the new vocabulary's rows start: overlap (the paper: a piece also in the source "
        "vocabulary gets its source row, the others N(0, sigma), sigma the source matrix's own std: the start rules in "
        "docs/mini-models.md), subword_mean (FVT: shared pieces copied, "
        "every other piece the mean of the source rows of its split under the source tokenizer) or normal (every row "
        "drawn, nothing copied)", choices=EMBEDDING_INITS)
    vocab_mode: str = _owned_by(
        STEP2, "replace", "Step 2: replace (the paper: the target vocabulary replaces the source's) or expand (the "
        "source vocabulary keeps its ids and rows, frozen; the target's pieces that it lacks are appended and only "
        "their rows train; the source language keeps working)", choices=VOCAB_MODES)
    expand_output_start: str = _owned_by(
        STEP2, "bounded", "Step 2 with --vocab_mode expand: how the new pieces start on the output side. worst_case: "
        "so that together they take a bounded share of the source model's probability mass at every position at "
        "update 0 (the encoder's new output-bias entries set from a bound on each row's logit: the source-language "
        "loss and the KL rise by at most --expand_source_nats anywhere; a decoder's new output rows (tied: its new "
        "embedding rows too) at the source rows' mean, Hewitt's start: at most log(1 + new / source pieces)); bounded: "
        "worst_case calibrated on source text (--replay_data, else the source run's data) until the new pieces "
        "take half of --expand_source_nats (the encoder's new bias entries raised, the decoder's row moved off "
        "it), which leaves the target more room; embedding_init: as --embedding_init starts the input side (bias 0 "
        "for a drawn row), which lets them take mass from the source language. expand.py's comment derives the bounds",
        choices=EXPAND_OUTPUT_STARTS)
    expand_source_nats: float = _owned_by(
        STEP2, 0.01, "Step 2 with --vocab_mode expand: how much of the source language the new pieces may take at "
        "update 0, in nats of its loss (the KL from the source model's distribution is the same): "
        "--expand_output_start worst_case holds it at every position, bounded calibrates to half of it on source "
        "text (so that held-out text stays under it)", gt=0)
    replay_data: Optional[str] = _owned_by(
        STEP2, None, "Step 2: a dataset prepared by mmadapt preprocess from source-language text in the run's "
        "vocabulary, mixed into every batch (--replay_fraction): with --vocab_mode expand, prepared with the source "
        "run's tokenizer (its ids are the merged vocabulary's first ones), e.g. the source run's own --data_path; with "
        "replace, with the target tokenizer (mmadapt preprocess --tokenizer)")
    replay_fraction: Optional[float] = _owned_by(
        STEP2, None, "Step 2: the fraction of every update's blocks taken from --replay_data (rounded to whole blocks "
        f"of the global batch; below 1: some target text in every batch; default {REPLAY_FRACTION} with --replay_data, "
        "the least that kept the demo's English within 0.03 nats of the source model's after 1000 expand updates; "
        "0, and the default without --replay_data: no replay): the source language keeps a say in the new rows, its "
        "loss and the target text's logged apart (source_loss, target_loss)", ge=0, lt=1)
    plugin_eval_blocks: int = _owned_by(
        STEP2, 0, "Step 2: at each checkpoint, score the new embeddings through the primary model with the plug-in "
        "metric on this many held-out blocks of the target dataset's validation split (--data_path prepared with "
        "--valid_fraction), and log whether they have passed the unigram reference yet: the first sign of transfer "
        "(0 = off; rank 0 holds the primary model meanwhile)", ge=0)

    def __post_init__(self):
        # Unset: the measured default where there is text to replay, and unset (no replay) where there
        # is none, so that a config made without replay text (a preset) takes the default when
        # replay text is set on it later (dataclasses.replace, a flag over a preset).
        if self.replay_fraction is None and self.replay_data is not None:
            self.replay_fraction = REPLAY_FRACTION
        super().__post_init__()

    def warmup_iters(self, total: int) -> int:
        return self.lr_warmup_iters

    def validate(self, model: ModelConfig) -> "TrainConfig":
        if self.seq_length > model.max_position_embeddings:
            raise ValueError(f"seq_length {self.seq_length} exceeds max_position_embeddings "
                             f"{model.max_position_embeddings}")
        if ((self.replay_fraction or 0) > 0) != (self.replay_data is not None):
            raise ValueError("--replay_fraction needs --replay_data (source-language text mixed into Step 2), and "
                             "--replay_data a --replay_fraction above 0: pass --replay_data (its default fraction is "
                             f"{REPLAY_FRACTION}), or neither")
        if self.lr is None:
            raise ValueError("lr must be set for pretraining, Step 1b and Step 2")
        if self.vocab_mode != "expand":
            defaults = _defaults(type(self))
            for name in EXPAND_ONLY:
                if getattr(self, name) != getattr(defaults, name):
                    raise ValueError(f"--{name} sets how an expanded vocabulary starts, and this run replaces the "
                                     "vocabulary: drop it, or pass --vocab_mode expand")
        return self


def scored_positions(seq_length: int, score_fraction: float) -> int:
    """Positions of a block of seq_length that a causal LM scores at TrainConfig.score_fraction p:
    round(p * seq_length), at least 1. A fixed count per block, not a Bernoulli(p) draw per
    position: every micro-batch projects the same number of rows (static shapes), and the FLOP
    count is exact, not an expectation."""
    return min(seq_length, max(1, int(score_fraction * seq_length + 0.5)))


# Your own tasks (`--task classify|pair|tag`, CSV, TSV or JSON Lines): the columns read where
# FinetuneConfig's text_column, text_pair_column and label_column are unset.
OWN_TASK_COLUMNS = {"classify": ("text", None, "label"), "pair": ("sentence1", "sentence2", "label"),
                    "tag": ("tokens", None, "tags")}
COLUMN_FIELDS = ("text_column", "text_pair_column", "label_column")  # in OWN_TASK_COLUMNS' order


def _own_default(i: int) -> str:
    return ", ".join(f"{cols[i]} for {task}" for task, cols in OWN_TASK_COLUMNS.items() if cols[i])


@dataclass
class FinetuneConfig(LoopConfig):
    """Step 3 (fine-tuning the primary model on a source-language task, word embeddings frozen)
    and Step 4 (zero-shot evaluation). Defaults: the paper's section 3 (peak lr per task, warm-up
    ratio 0.06, linear decay, 3 epochs); the batch of 32 is not the paper's (it states none)."""
    seed: int = _redefault("seed", 1)  # the paper averages 5 fine-tuning seeds
    train_micro_batch_size_per_gpu: int = _redefault("train_micro_batch_size_per_gpu", 32)
    lr: Optional[float] = _f(None, "peak learning rate (default: the task's, paper: 1e-5 XNLI/PAWS-X, "
                             "3e-5 MLQA/XQuAD)", gt=0)
    seq_length: int = _f(128, "pieces per example (QA: per context window); at most the blocks the primary model "
                         "was pretrained on (its run.json train.seq_length), unless allow_untrained_positions", ge=8)
    allow_untrained_positions: bool = _f(False, "fine-tune (and evaluate) with a seq_length longer than the primary "
                                         "model's pretraining blocks, with a warning: the position embeddings "
                                         "past them were never trained")
    epochs: float = _f(3.0, "passes over the training examples (paper: 3)", gt=0)
    warmup_ratio: float = _f(0.06, "fraction of the updates with linear warm-up, then linear decay to 0", ge=0, lt=1)
    doc_stride: Optional[int] = _f(None, "QA: pieces shared by consecutive windows of a context longer than one "
                                   "window (default: 128, as in SQuAD practice at seq_length 384, or half the "
                                   "window where that is shorter)", ge=1)
    max_query_length: int = _f(64, "QA: question pieces kept", ge=1)
    max_answer_length: int = _f(30, "QA: longest answer predicted, in pieces", ge=1)
    # 16384: on a GPU, enough rows to fill it (128 rows of 128 pieces; roberta-base's bf16
    # activations for them take a few hundred MiB of an H100's 80 GiB, and larger batches gain
    # little once every SM is busy); on a CPU, batch size barely changes throughput.
    eval_batch_tokens: int = _f(16384, "evaluation: piece ids per forward pass, counted as rows x the batch's longest "
                                "row (rows are sorted by length, padding past the longest is never computed; at "
                                "least one row per pass)", ge=1)
    metric: Optional[str] = _f(None, "the headline score (run.json's source_score, Step 4's score): classify "
                               "tasks accuracy or macro_f1, tag tasks accuracy or chunk_f1 (B-/I-/O tags), QA "
                               "squad_f1 or exact_match; every one that applies is computed and recorded "
                               "(default: the task's own, accuracy for classify/pair/tag)")
    text_column: Optional[str] = _f(None, "classify/pair/tag: the column of the text, by name, or by 0-based number "
                                    "in a CSV/TSV file without a header line (then give every column by number); "
                                    "tag: its tokens, a JSON list or space-separated (default: " + _own_default(0) + ")")
    text_pair_column: Optional[str] = _f(None, "pair: the column of the second text, a name or a number (default: "
                                         + _own_default(1) + ")")
    label_column: Optional[str] = _f(None, "classify/pair/tag: the column of the label, a name or a number; tag: one "
                                     "tag per token (default: " + _own_default(2) + ")")

    def warmup_iters(self, total: int) -> int:
        return round(self.warmup_ratio * total)

    def validate(self, model: "ModelConfig") -> "FinetuneConfig":
        if self.seq_length > model.max_position_embeddings:
            raise ValueError(f"seq_length {self.seq_length} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings}")
        return self


@dataclass
class EvaluateConfig(Checked):
    """Step 4 (`mmadapt evaluate` with a task): what is scored beside the Step-2 artifacts."""
    no_adaptation_baseline: bool = _f(True, "also score the fine-tuned runs on each language's evaluation file with "
                                      "their own (source) tokenizer and embeddings, no adaptation: what every adapted "
                                      "score is measured against (one more evaluation pass per language and seed; "
                                      "recorded as system no_adaptation)")


# ModelConfig fields that Steps 1b, 2 and 3 may set; the architecture itself is the source run's.
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "hidden_dropout",
                 "attention_dropout", "attention_impl", "fusion")


def _layout_field(name: str):
    """A Layout field: None, or a value of ModelConfig's field `name`, checked against that
    field's declared range and choices (each declared once, there)."""
    return dataclasses.field(default=None, metadata=ModelConfig.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class Layout(Checked):
    """How a later step (1b, 2, 3) lays out and runs its source's model: the LAYOUT_FIELDS of
    ModelConfig (see their help there), each None to keep the source run's. Checked when made
    against ModelConfig's declarations, as the flags are (RunSpec's layout was refused only
    when a step applied it)."""
    tensor_model_parallel_size: Optional[int] = _layout_field("tensor_model_parallel_size")
    pipeline_model_parallel_size: Optional[int] = _layout_field("pipeline_model_parallel_size")
    hidden_dropout: Optional[float] = _layout_field("hidden_dropout")
    attention_dropout: Optional[float] = _layout_field("attention_dropout")
    attention_impl: Optional[str] = _layout_field("attention_impl")
    fusion: Optional[str] = _layout_field("fusion")

    def apply(self, model: ModelConfig) -> ModelConfig:
        return dataclasses.replace(model, **{k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Layout":
        """The layout flags a parser made with add_dataclass_args(ModelConfig, only=LAYOUT_FIELDS) read."""
        return cls(**{k: getattr(args, k, None) for k in LAYOUT_FIELDS})


# The DeepSpeed JSON a run uses unless told otherwise.
DEFAULT_DS_CONFIG = Path(__file__).resolve().parents[1] / "ds_configs" / "zero1.json"


# --- the paper's systems ------------------------------------------------------------------------

RECIPES = ("bl_base", "bl_small", "minijoint")  # Step 1 (MINIPOST is built in Step 1b)
SYSTEMS = ("bl_base", "bl_small", "minijoint", "minipost")  # Step 2
# Which Step-1 (or 1b) recipe each Step-2 system adapts.
SOURCE_RECIPES = {"bl_base": ("bl_base", "minijoint"), "bl_small": ("bl_small",),
                  "minijoint": ("minijoint",), "minipost": ("minipost",)}


def apply_recipe(model: ModelConfig, recipe: str, mini_layers: int | tuple[int, ...] = MiniModelConfig.mini_layers
                 ) -> ModelConfig:
    """Return `model` shaped as one of the paper's Step-1 systems.

    The preset fixes the depth of the primary model (12 for both shipped presets).
    bl_base: that depth, one head. bl_small: `mini_layers` (N, paper: 4) layers, one head, the
    standard model of the mini-model's size. minijoint: the preset's depth with a secondary
    head after layer N (`MiniModelConfig.mini_layers`), or after each of several depths
    (beyond the paper, its section 7: mini-models of several depths from one pretraining). The
    loss is the mean of the heads' losses unless model.head_weights says otherwise. MINIPOST is
    built from a pretrained bl_base model in Step 1b.
    """
    mini = MiniModelConfig(mini_layers)
    if recipe in ("bl_small", "minijoint"):
        bad = [n for n in mini.mini_layers if not 1 <= n < model.num_layers]
        if bad:
            raise ValueError(f"--mini_layers {bad[0]} must be in 1..{model.num_layers - 1} for a "
                             f"{model.num_layers}-layer primary model (--num_layers; {recipe} trains --mini_layers "
                             f"layers{'' if recipe == 'bl_small' else ' under a head'}): pass --mini_layers below "
                             f"{model.num_layers}, or a deeper --num_layers")
        if list(mini.mini_layers) != sorted(set(mini.mini_layers)):
            raise ValueError(f"mini_layers {' '.join(map(str, mini.mini_layers))} must be ascending without repeats")
    if recipe == "bl_base":
        return dataclasses.replace(model, head_layers=(model.num_layers,))
    if recipe == "bl_small":
        n = mini.one_depth("bl_small")
        return dataclasses.replace(model, num_layers=n, head_layers=(n,))
    if recipe == "minijoint":
        return dataclasses.replace(model, head_layers=(*mini.mini_layers, model.num_layers))
    raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")


# --- CLI glue: fields become flags ------------------------------------------------------------

def _tuple_item(kind):
    """The item type of a tuple-valued field (one or more values on the command line), else None.
    A bare `tuple` holds ints (head_layers, extra_save_steps); `tuple[str, ...]` says its type."""
    if get_origin(kind) in (Union, UnionType):  # Optional[tuple]: a tuple flag whose unset value means a default
        kind = next(a for a in get_args(kind) if a is not type(None))
    if kind is tuple:
        return int
    return get_args(kind)[0] if get_origin(kind) is tuple else None


def _default_help(f, defaults) -> str:
    """What an unset flag becomes: the field's default, each preset's value, or a sentence."""
    if isinstance(defaults, str):
        return f"default: {defaults}"
    if isinstance(defaults, dict):
        values = {name: getattr(cfg, f.name) for name, cfg in defaults.items()}
        if len(set(map(repr, values.values()))) > 1:
            return "default: " + ", ".join(f"{v} ({name})" for name, v in values.items())
        return f"default: {next(iter(values.values()))}"
    return f"default: {f.default}"


# How the user started the command whose flags a Parser reads, so that its usage and error lines
# name it as typed: "mmadapt" (the `mmadapt` command's dispatch, cli.main), "launch" (a launch/
# script, cli.run_process) or "" (called in-process: the parser's own name).
INVOKED_AS: contextvars.ContextVar[str] = contextvars.ContextVar("INVOKED_AS", default="")


def shown_prog(name: str) -> str:
    """A command's name as the user typed it (INVOKED_AS): `mmadapt adapt`, `launch/adapt.py`."""
    base = name.removeprefix("mmadapt ")
    how = INVOKED_AS.get()
    return f"mmadapt {base}" if how == "mmadapt" else f"launch/{base}.py" if how == "launch" else name


DIST_TIMEOUT_ENV = "MMADAPT_DIST_TIMEOUT_S"
# a year: beyond ~1e9 s timedelta overflows, or torch's store reads it in ms and times out at once
DIST_TIMEOUT_MAX_S = 365 * 24 * 3600


def dist_timeout_s(default: float = 1800.0) -> float:
    """The seconds a collective (and the rendezvous) may wait, MMADAPT_DIST_TIMEOUT_S (unset or
    empty: `default`); ValueError in one line for a value that is not a positive number (a
    traceback at import, or gloo's 'Invalid timeout' after the corpus was prepared)."""
    raw = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= DIST_TIMEOUT_MAX_S):
        raise ValueError(f"{DIST_TIMEOUT_ENV} is {raw!r}: set it to a positive number of seconds up to "
                         f"{DIST_TIMEOUT_MAX_S:,} (default {default:g}), or unset it")
    return value


# MMADAPT_TINY=1: every command's model and schedule at a size two CPU cores train in seconds, its
# flags otherwise as written, so that a documented command line runs as it stands in the docs
# (tests/test_documented_commands.py runs them so, on small files) and a user can try one before
# the real run. Once the flags are read (Parser.parse_args), a preset becomes its family's small
# one (roberta-base -> tiny, qwen2-0.5b -> llama-tiny) and the flags in TINY_FLAGS, given or by
# their parser's default, are capped (a vocabulary trained here at the small presets' 2000 pieces,
# so that a prepared dataset still fits its model; an existing tokenizer's, preprocess
# --tokenizer, is kept); `override` then caps the sizes in TINY_CAPS of every config it builds,
# whether a flag or the preset set them. Nothing else changes: paths, systems, recipes, data
# formats and their size (a corpus is read whole, fine-tuning runs one epoch of its file), and an
# imported model's own shape.
TINY_ENV = "MMADAPT_TINY"
TINY_CAPS = {"train_iters": 8, "lr_warmup_iters": 2, "log_interval": 4, "seq_length": 64,
             "train_micro_batch_size_per_gpu": 4, "epochs": 1.0, "eval_iters": 2, "plugin_eval_blocks": 8,  # steps
             "workers": 2, "tokenizer_sample_lines": 50_000, "plugin_blocks": 8,  # PreprocessConfig, SweepConfig
             "bpb_bytes": 1024,  # SweepConfig: its default, not a flag given (TINY_FLAGS caps those)
             "max_query_length": 24}  # FinetuneConfig: a QA question beside a context in 64 pieces
TINY_FLAGS = {"vocab_size": 2000, "plugin_blocks": 8, "seq_length": 64,  # preprocess, adapt, sweep; evaluate
              "head_iters": 8, "minipost_iters": 8, "adapt_iters": 8, "batch": 4, "bpb_bytes": 1024,  # extend
              "plugin_eval_blocks": 8}


def given(name: str, value, default, tiny: bool | None = None) -> bool:
    """Whether field `name`'s `value` was given: it is neither its `default` nor, where the sizes
    are MMADAPT_TINY=1's (`tiny`; None: where the environment sets it), what that makes of the
    default (its TINY_FLAGS cap on a command line, else its TINY_CAPS cap in the config built)."""
    cap = TINY_FLAGS.get(name, TINY_CAPS.get(name))
    tiny = os.environ.get(TINY_ENV) == "1" if tiny is None else tiny
    if tiny and cap is not None and default is not None:
        return value not in (default, min(default, type(default)(cap)))
    return value != default


def tiny_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """A command's parsed flags at MMADAPT_TINY=1's sizes (the comment above), in place; marked
    so that `override` caps the configs built from them."""
    from mmadapt.models import find_preset

    if getattr(args, "preset", None) is not None:
        args.preset = find_preset(args.preset)[0].small_preset
    for name, cap in TINY_FLAGS.items():
        if name == "vocab_size" and getattr(args, "tokenizer", None):
            continue  # an existing tokenizer's vocabulary (a model's embedding rows) is no size to shrink
        if getattr(args, name, None) is not None:
            setattr(args, name, min(getattr(args, name), cap))
    args._tiny_sizes = True
    return args


# The flags that name a directory a command reads (a model, a run, an artifact, a dataset): what
# it writes (--output_dir) never goes inside one, whose owner (a save_pretrained directory, a run
# that checks its own entries, an artifact) did not make room for it.
INPUT_DIRS = ("model", "into", "primary", "source", "finetuned", "embeddings", "data_path", "replay_data", "run",
              "expand_from", "roles_from")


def output_inside_an_input(out, inputs: dict) -> str | None:
    """The refusal of an output directory `out` strictly inside a directory a command reads
    (`inputs`: a name -> its value, one path or several; those named in INPUT_DIRS are read), or
    None. (The same directory is refused by each command as one that exists already.)"""
    if not isinstance(out, (str, os.PathLike)):
        return None
    out_path = Path(out).resolve()
    for name in INPUT_DIRS:
        values = inputs.get(name)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if isinstance(value, (str, os.PathLike)) and Path(value).is_dir() and \
                    Path(value).resolve() in out_path.parents:
                return (f"--output_dir {out} is inside --{name} {value}: write it elsewhere (what a command reads is "
                        "left as it is)")
    return None


def _blank(value) -> bool:
    """A flag's value that is empty or only blanks (a list: any of its values)."""
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, str) and not v.strip() for v in values)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported like every other user mistake: one line, exit 2; and
    every command's --verbose (mmadapt/quiet.py reads it from the process's arguments, before the
    libraries it quiets are imported). `prog` is shown as the user started the command."""

    def __init__(self, *args, tiny: bool = True, **kwargs):
        """tiny: whether MMADAPT_TINY=1 shrinks this command's sizes (`tiny_sizes`); False for a
        command that only computes from its flags (flops)."""
        if kwargs.get("prog"):
            kwargs["prog"] = shown_prog(kwargs["prog"])
        # a flag is its field's name, whole: argparse took any unique prefix (--lr_warm for
        # --lr_warmup_iters; another command's --source as finetune's --source_lang)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.tiny = tiny
        self.add_argument("--verbose", action="store_true", help="show all that the libraries under mmadapt print "
                          "(default: the known notices that say nothing about your run are filtered, "
                          "mmadapt/quiet.py; MMADAPT_VERBOSE=1 does the same)")

    def parse_args(self, args=None, namespace=None):
        self._refuse_repeated(sys.argv[1:] if args is None else list(args))
        parsed = super().parse_args(args, namespace)
        # `--output_dir "$OUT"` with $OUT unset: '' reads as '.', and the run would write where it stands
        blank = next((a for a in self._actions if a.nargs != argparse.REMAINDER
                      and _blank(getattr(parsed, a.dest, None)) and getattr(parsed, a.dest) != a.default), None)
        if blank is not None:
            self.error(f"{'/'.join(blank.option_strings) or blank.dest} is given an empty value: give it one "
                       "(an unset shell variable?)")
        inside = output_inside_an_input(getattr(parsed, "output_dir", None), vars(parsed))
        if inside:
            self.error(inside)
        try:
            dist_timeout_s()  # (read when a run starts its ranks; refused before anything is written)
        except ValueError as e:
            self.error(str(e))
        tiny = os.environ.get(TINY_ENV, "") if self.tiny else ""
        if tiny not in ("", "0", "1"):  # a value read as "off" would run the real sizes unannounced
            self.error(f"{TINY_ENV} is {tiny!r}: set it to 1 for the tiny sizes, or to 0 (or unset it) for the sizes "
                       "as given")
        return tiny_sizes(parsed) if tiny == "1" else parsed

    def _refuse_repeated(self, argv: list[str]) -> None:
        """A list flag given twice: argparse keeps the last list alone, silently (`--mini_layers 2 4
        ... --mini_layers 6` trained depth 6 alone). A single value given again replaces the one
        before (argparse's rule, a command line's way to override). Up to `--`; not for a command
        that passes arguments on (argparse.REMAINDER: slurm-env's script's own)."""
        if any(a.nargs == argparse.REMAINDER for a in self._actions):
            return
        lists = {o: a for a in self._actions if a.nargs in ("+", "*") for o in a.option_strings}
        seen = set()
        for token in argv:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if flag in lists and lists[flag] in seen:
                self.error(f"{flag} is given twice: give all its values at once ({flag} 2 4; the second list would "
                           "replace the first)")
            seen.add(lists.get(flag))

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def add_dataclass_args(parser: argparse.ArgumentParser, cls, only: tuple[str, ...] | None = None,
                       defaults: dict[str, Any] | str | None = None, step: str | None = None) -> None:
    """Add one `--name` flag per field of `cls` (or per field named in `only`; with `step`, not
    the fields another step owns, `_f`'s owner); unset flags stay None (the preset, or the run
    being adapted, decides). `defaults` says in --help what an unset flag becomes: {preset name:
    instance} (each preset's value), a sentence, or None (the field's default)."""
    group = parser.add_argument_group(cls.__name__)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or not f.metadata.get("flag", True):
            continue
        owner = f.metadata.get("owner")
        if step is not None and owner is not None and step not in owner.steps:
            continue
        kind = hints[f.name]
        text = f.metadata["help"]  # a help that says its own default (a None field's) keeps it
        text = (text if "(default:" in text else f"{text} ({_default_help(f, defaults)})") + _limits_help(f)
        kw: dict[str, Any] = dict(default=None, help=text.replace("%", "%%"))  # argparse %-formats help
        if _tuple_item(kind) is not None:
            kw.update(type=_tuple_item(kind), nargs="+")
        else:
            base = next((a for a in get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
            kw.update(type=_bool if base is bool else base if base in (int, float) else str)
        group.add_argument(f"--{f.name}", **kw)


LANG_CODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


def check_lang(lang: str) -> str:
    """A target language's code: what Step 2 records with its embeddings, and what `{lang}` in
    evaluate's --eval_file and --plugin_data becomes in a path (so no '/', no blank)."""
    if not isinstance(lang, str) or not LANG_CODE.fullmatch(lang):
        raise ValueError(f"--lang {lang!r} is no language code: letters, digits, '-' and '_' (de, pt-BR, zh_Hant)")
    return lang


def lang_code(text: str) -> str:
    """check_lang as an argparse type (refused in one line naming the flag)."""
    try:
        return check_lang(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--lang ")) from None


def check_output_file(path: Path, flag: str) -> None:
    """A file a command is to write: not a directory, and its directory one that exists or can be
    created (no file on the way). Here, with the flags, for `python -m mmadapt.slurm` too, which
    imports no torch."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: name a file")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path} cannot be written: {existing} is a file, not a directory")
    # before the work whose result it holds (evaluate scored everything, then failed to make it)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be written: {existing} is not writable by you; choose another path")


def whole_number(lo: int):
    """An argparse type for a flag that is not a config field: a whole number >= lo, its range
    declared where the flag is (argparse refuses another in one line naming the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    return parse


def _limits_help(f) -> str:
    """A field's declared range or choices, as --help shows them."""
    bounds, choices = f.metadata.get("bounds"), f.metadata.get("choices")
    return f" [{bounds}]" if bounds else f" [one of {', '.join(choices)}]" if choices else ""


def _bool(text: str) -> bool:
    """A bool flag's value: --decay_all true (or false; also 1/0, yes/no)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def override(cfg, args: argparse.Namespace):
    """Copy of `cfg` with every field that `args` sets (not None) replaced (and, where the
    arguments were read under MMADAPT_TINY=1, its TINY_CAPS sizes capped)."""
    hints = get_type_hints(type(cfg))
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cfg)
               if getattr(args, f.name, None) is not None}
    for name in changes:
        if _tuple_item(hints[name]) is not None:
            changes[name] = tuple(changes[name])
    if getattr(args, "_tiny_sizes", False):  # MMADAPT_TINY=1 (tiny_sizes)
        for name, cap in TINY_CAPS.items():
            value = changes.get(name, getattr(cfg, name, None))
            if value is not None and hasattr(cfg, name):
                changes[name] = min(value, type(value)(cap))
    return dataclasses.replace(cfg, **changes)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
