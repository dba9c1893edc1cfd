"""Configuration: one dataclass field per hyperparameter, named presets, system recipes.

Field names follow megatron-core and DeepSpeed (`num_layers`, `hidden_size`,
`tensor_model_parallel_size`, `train_micro_batch_size_per_gpu`, ...). Every field
carries its help text in `metadata["help"]`; `add_dataclass_args` turns the fields
into CLI flags, so a flag overrides a field by its own name.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints


def _f(default, help: str, flag: bool = True, **kw):
    """A config field with its help text; flag=False: set by the steps, never a command-line flag."""
    return field(default=default, metadata={"help": help, "flag": flag}, **kw)


# ModelConfig.fusion's values (mmadapt/fusion.py applies them).
FUSIONS = ("none", "compile")
# ModelConfig.output_bias_init's values (steps.pretrain applies them).
OUTPUT_BIAS_INITS = ("zeros", "unigram")
# Step 2's start of the new vocabulary's rows (adapt.init_rows): the paper's overlap copy, FVT's
# subword mean, or every row drawn.
EMBEDDING_INITS = ("overlap", "subword_mean", "normal")
# Step 2's vocabulary (adapt.py): the target's own (the paper), or the source's with the target's
# missing pieces appended (vocab.py), only those trained.
VOCAB_MODES = ("replace", "expand")
# How an expanded vocabulary's new rows start on the output side (adapt.bounded_start): bounded
# (their share of the probability mass capped at update 0) or as --embedding_init starts them.
EXPAND_OUTPUT_STARTS = ("bounded", "embedding_init")


@dataclass
class ModelConfig:
    family: str = _f("roberta", "model family (mmadapt/models/): roberta (post-LayerNorm encoder, masked LM) or "
                     "llama (pre-norm decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention; causal LM)")
    num_layers: int = _f(12, "number of transformer layers")
    hidden_size: int = _f(768, "hidden size h")
    num_attention_heads: int = _f(12, "attention heads per layer")
    ffn_hidden_size: int = _f(3072, "feed-forward inner size")
    vocab_size: int = _f(50_000, "SentencePiece vocabulary size V (special tokens included)")
    max_position_embeddings: int = _f(512, "learned positions; upper bound on seq_length")
    hidden_dropout: float = _f(0.1, "dropout on embeddings and on each residual branch")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities")
    layernorm_epsilon: float = _f(1e-5, "LayerNorm epsilon")
    init_method_std: float = _f(0.02, "std of the normal init of every weight matrix and embedding")
    output_bias_init: str = _f("zeros", "Step 1: how every MLM head's output bias [V] starts: zeros, or unigram "
                               "(the log-frequency of each piece in the training text, add-one smoothed: what a "
                               "model that ignores its input predicts, so its layers need not learn to; the "
                               "encoder only, a decoder's head has no bias)")
    head_layers: tuple = _f(
        (), "layers after which an MLM head sits, ascending; must end with num_layers "
        "(the primary head). Empty: one head, after the last layer")
    head_weights: tuple[float, ...] = _f(
        (), "one weight per MLM head, in head_layers order: the loss is sum(w_i * loss_i) / sum(w_i). Empty: "
        "the mean of the heads' losses (the paper's MINIJOINT: its two heads weighted equally)")
    attention_impl: str = _f(
        "sdpa", "'sdpa' (fused scaled_dot_product_attention; a padded batch passes a mask, so on a GPU "
        "it gets the memory-efficient kernel, not flash), 'varlen' (padded batches as jagged tensors "
        "of their real tokens: flash's variable-length kernel on a GPU, nothing spent on padding) or "
        "'math' (explicit matmuls, which torch's FLOP counter sees)")
    fusion: str = _f(
        "none", "'none' (eager: the CPU default and the reference in tests) or 'compile' (torch.compile of "
        "each transformer layer and of the MLM heads, in place: parameter names and checkpoints unchanged)")
    num_query_groups: Optional[int] = _f(None, "decoder: key/value head groups of grouped-query attention, dividing "
                                         "num_attention_heads and tensor_model_parallel_size (default: one per "
                                         "attention head, i.e. multi-head attention)")
    add_qkv_bias: bool = _f(False, "decoder: a bias on the query, key and value projections (Qwen2 has one; Llama "
                            "and Mistral do not)")
    rotary_base: float = _f(10000.0, "decoder: base of the rotary position embedding's frequencies (Llama-2 10000, "
                            "Llama-3 500000, Qwen2 1000000)")
    seq_len_interpolation_factor: Optional[float] = _f(
        None, "decoder: linear rotary scaling (position interpolation, Chen et al. 2023): positions are divided by "
        "this factor, as transformers' rope_type 'linear' does (default: none)")
    share_embeddings_and_output_weights: bool = _f(True, "decoder: the output projection is the input embedding "
                                                   "(tied); false: an output projection of its own [V, h]. The "
                                                   "encoder's is always tied")
    tensor_model_parallel_size: int = _f(1, "tensor-parallel ranks (megatron-core layers)")
    pipeline_model_parallel_size: int = _f(1, "pipeline stages (DeepSpeed PipelineModule)")
    frozen_vocab_size: int = _f(0, "Step 2 with an expanded vocabulary (--vocab_mode expand; set by adapt, not by "
                                "hand): the first frozen_vocab_size rows of every vocabulary-indexed weight are the "
                                "source's, a frozen parameter apart from the new rows after them, which alone train "
                                "(0: each such weight is one parameter)", flag=False)

    def __post_init__(self):
        self.head_layers = tuple(int(x) for x in self.head_layers or ())
        self.head_weights = tuple(float(x) for x in self.head_weights or ())

    @property
    def heads_after(self) -> tuple[int, ...]:
        """The layers whose outputs feed an MLM head (head_layers, or the last layer alone)."""
        return self.head_layers or (self.num_layers,)

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first invalid combination."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if min(self.num_layers, self.hidden_size, self.num_attention_heads, self.ffn_hidden_size,
               self.vocab_size, tp, pp) < 1:
            raise ValueError("num_layers, hidden_size, num_attention_heads, ffn_hidden_size, "
                             "vocab_size and the parallel sizes must all be >= 1")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads "
                             f"{self.num_attention_heads}: each key/value group serves a whole number of heads")
        if groups is not None and groups % tp:
            raise ValueError(f"num_query_groups {groups} is not divisible by tensor_model_parallel_size {tp}: each "
                             "tensor-parallel rank holds whole key/value groups; pick a tensor-parallel size that "
                             "divides it")
        if self.output_bias_init not in OUTPUT_BIAS_INITS:
            raise ValueError(f"output_bias_init must be one of {', '.join(OUTPUT_BIAS_INITS)}, got "
                             f"{self.output_bias_init!r}")
        if not self.rotary_base > 0:
            raise ValueError(f"rotary_base must be > 0, got {self.rotary_base}")
        factor = self.seq_len_interpolation_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"seq_len_interpolation_factor must be > 0 (or unset: no rotary scaling), got {factor}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"tensor_model_parallel_size {tp}: pick a tensor-parallel size that divides it")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                             f"tensor_model_parallel_size {tp}")
        if self.vocab_size % tp:
            raise ValueError(f"vocab_size {self.vocab_size} is not divisible by "
                             f"tensor_model_parallel_size {tp}: choose a vocab size that is a multiple of it")
        if not 0 <= self.frozen_vocab_size < self.vocab_size:
            raise ValueError(f"frozen_vocab_size {self.frozen_vocab_size} must be in 0..vocab_size - 1 "
                             f"({self.vocab_size - 1}): the source's rows, with at least one new row after them")
        bad = [l for l in self.heads_after if not 1 <= l <= self.num_layers]
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
        if self.head_weights and (min(self.head_weights) < 0 or sum(self.head_weights) <= 0):
            raise ValueError(f"head_weights {self.head_weights} must be >= 0 with a positive sum")
        if pp > self.num_layers:
            raise ValueError(f"pipeline_model_parallel_size {pp} exceeds num_layers {self.num_layers}: "
                             "a stage must own at least one layer")
        if self.attention_impl not in ("sdpa", "varlen", "math"):
            raise ValueError(f"attention_impl must be 'sdpa', 'varlen' or 'math', got {self.attention_impl!r}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(map(repr, FUSIONS))}, got {self.fusion!r}")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
class MiniModelConfig:
    """The mini-model's shape (paper section 2): its depth N, and MINIPOST's new layers K."""
    mini_layers: tuple = _f((4,), "N: depth of the mini-model (BL_SMALL has N layers; MINIJOINT's second head "
                            "sits after layer N; MINIPOST copies the bottom N layers). MINIJOINT takes several "
                            "(2 4 6: a secondary head after each, mini-models of each depth from one "
                            "pretraining); Step 2 picks one of its source run's")
    new_layers: int = _f(2, "K: MINIPOST's new layers, trained on top of the copied N (Step 1b)")

    def __post_init__(self):
        # Always a tuple; one int is read as one depth (run.json files of one-depth runs hold an int).
        depths = self.mini_layers
        self.mini_layers = tuple(int(x) for x in depths) if isinstance(depths, (tuple, list)) else (int(depths),)
        if not self.mini_layers:
            raise ValueError("mini_layers needs at least one depth")

    def one_depth(self, what: str) -> int:
        """The one depth N of a step that builds one mini-model (ValueError naming `what` otherwise)."""
        if len(self.mini_layers) != 1:
            raise ValueError(f"{what} builds one mini-model: pass one --mini_layers, not "
                             f"{' '.join(map(str, self.mini_layers))}")
        return self.mini_layers[0]


@dataclass
class PreprocessConfig:
    """`mmadapt preprocess`: how a corpus is prepared once for every run that trains on it."""
    workers: Optional[int] = _f(None, "encoding processes, each over its own byte range of the corpus "
                                "(default: the CPU count); the result is the same for any number")
    tokenizer_sample_lines: int = _f(2_000_000, "lines sampled (seeded reservoir) to train the SentencePiece "
                                     "model: bounds its memory whatever the corpus size")
    tokenizer_seed: int = _f(1234, "seed of that sample and of SentencePiece's training (and of the "
                             "validation split)")
    valid_fraction: float = _f(0.0, "fraction of the documents held out as validation data (chosen by a seeded "
                               "hash of each document, so the same for any number of workers)")


@dataclass
class LoopConfig:
    """What every step that trains shares (Steps 1, 1b, 2 and 3): the seed, the batch, AdamW and
    its schedule's peak, clipping, and the loop's intervals and fault settings. engine.train_loop
    and engine.build_engine take it whole. TrainConfig and FinetuneConfig add their own fields
    and change some defaults (`_default`)."""
    seed: int = _f(1234, "seed of initialisation, data order, masking and dropout")
    train_micro_batch_size_per_gpu: int = _f(8, "blocks (fine-tuning: examples) per micro-batch per "
                                             "data-parallel rank")
    gradient_accumulation_steps: int = _f(1, "micro-batches per update")
    lr: Optional[float] = _f(7e-4, "peak learning rate")
    weight_decay: float = _f(0.01, "AdamW weight decay (on weight matrices only, unless decay_all)")
    decay_all: bool = _f(False, "weight decay on every trained parameter, biases and LayerNorm included, as "
                         "fairseq does (so the paper: true); false: on weight matrices only, as BERT and Megatron")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.98, "Adam beta2")
    adam_eps: float = _f(1e-6, "Adam epsilon")
    gradient_clipping: float = _f(0.0, "global gradient-norm clip (0 = off, as in RoBERTa)")
    log_interval: int = _f(10, "updates between TensorBoard/console logs")
    save_interval: int = _f(1000, "updates between checkpoints (and one at the end)")
    extra_save_steps: tuple = _f((), "more update counts to checkpoint at (Step 2: the paper adds "
                                 "1000 2000 3000 4000 to every 5000 for fast-adapting languages)")
    exit_interval: int = _f(0, "save and exit once the update count is a multiple of this (0 = off); "
                            "for jobs that must end before a scheduler's time limit")
    keep_last: int = _f(0, "keep only the newest keep_last complete checkpoints (0 = keep all); Step-2 "
                        "embedding artifacts are never deleted")
    max_skipped_steps: int = _f(50, "stop as diverged after this many optimizer steps in a row are skipped "
                                "(fp16 gradient overflow)")

    def global_batch(self, data_parallel_size: int) -> int:
        """Blocks (or examples) per update over every data-parallel rank."""
        return self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * data_parallel_size

    def warmup_iters(self, total: int) -> int:
        """Updates of linear warm-up before the linear decay to 0 at `total`."""
        raise NotImplementedError

    def _validate_loop(self) -> None:
        if min(self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, self.log_interval,
               self.save_interval) < 1 or self.exit_interval < 0:
            raise ValueError("batch sizes, log_interval and save_interval must be >= 1 and exit_interval >= 0")
        if self.keep_last < 0 or self.max_skipped_steps < 0:
            raise ValueError("keep_last and max_skipped_steps must be >= 0")


def _redefault(name: str, value):
    """A LoopConfig field declared again in a subclass with another default; its help stays LoopConfig's."""
    return field(default=value, metadata=LoopConfig.__dataclass_fields__[name].metadata)


# What a --resume may change: when and how often to log, evaluate, save and stop. Everything
# else (data, tokenizer, model, batch sizes, seed, schedule) belongs to the run being resumed.
# And `fusion`: it changes which kernels compute the same model (equal in fp32 to rounding,
# tests/test_fusion.py; compiled dropout draws its masks differently), not what is trained.
CHANGEABLE_ON_RESUME = ("log_interval", "save_interval", "exit_interval", "eval_interval", "eval_iters",
                        "extra_save_steps", "keep_last", "max_skipped_steps", "eval_batch_tokens", "metric",
                        "fusion", "plugin_eval_blocks")


@dataclass
class TrainConfig(LoopConfig):
    """Steps 1, 1b and 2: language-model training on prepared blocks of text."""
    seq_length: int = _f(512, "tokens per block s (<= max_position_embeddings)")
    train_iters: int = _f(125_000, "number of updates U")
    lr_warmup_iters: int = _f(10_000, "linear warm-up updates, then linear decay to 0 at train_iters")
    mask_prob: float = _f(0.15, "fraction p of tokens selected for MLM")
    eval_interval: int = _f(0, "updates between validation losses of every head (0 = off; needs a dataset "
                            "prepared with --valid_fraction)")
    eval_iters: int = _f(20, "validation micro-batches per evaluation: the same masked blocks every time")
    train_output_bias: bool = _f(True, "Step 2: train the output bias with the embeddings (it is indexed by the "
                                 "target vocabulary's pieces); false: the paper's setting, embeddings only, the bias "
                                 "frozen at its overlap initialisation (source bias for shared pieces, 0 otherwise)")
    embedding_init: str = _f("overlap", "Step 2: how the new vocabulary's rows start: overlap (the paper: a piece "
                             "also in the source vocabulary gets its source row, the others N(0, init_method_std)), "
                             "subword_mean (FVT: shared pieces copied, every other piece the mean of the source rows "
                             "of its split under the source tokenizer) or normal (every row drawn, nothing copied)")
    vocab_mode: str = _f("replace", "Step 2: replace (the paper: the target vocabulary replaces the source's) or "
                         "expand (the source vocabulary keeps its ids and rows, frozen; the target's pieces that it "
                         "lacks are appended and only their rows train; the source language keeps working)")
    expand_output_start: str = _f(
        "bounded", "Step 2 with --vocab_mode expand: how the new pieces start on the output side. bounded: so that "
        "together they take a bounded share of the source model's probability mass at update 0 (the encoder's new "
        "output-bias entries set from a bound on each row's logit: the source-language loss and the KL rise by at "
        "most 0.01 nats; a decoder's new output rows at the mean of the source's, Hewitt's start: tied, its new "
        "embedding rows too); embedding_init: as --embedding_init starts the input side (bias 0 for a drawn row), "
        "which lets them take mass from the source language. adapt.py's comment derives the bounds")
    replay_data: Optional[str] = _f(None, "Step 2: a dataset prepared by mmadapt preprocess from source-language "
                                    "text in the run's vocabulary, mixed into every batch (--replay_fraction): with "
                                    "--vocab_mode expand, prepared with the source run's tokenizer (its ids are the "
                                    "merged vocabulary's first ones), e.g. the source run's own --data_path; with "
                                    "replace, with the target tokenizer (mmadapt preprocess --tokenizer)")
    replay_fraction: float = _f(0.0, "Step 2: the fraction of every update's blocks taken from --replay_data "
                                "(rounded to whole blocks of the global batch; 0 = no replay): the source language "
                                "keeps a say in the new rows, its loss and the target text's logged apart "
                                "(source_loss, target_loss)")
    plugin_eval_blocks: int = _f(0, "Step 2: at each checkpoint, score the new embeddings through the primary model "
                                 "with the plug-in metric on this many held-out blocks of the target dataset's "
                                 "validation split (--data_path prepared with --valid_fraction), and log whether "
                                 "they have passed the unigram reference yet: the first sign of transfer (0 = off; "
                                 "rank 0 holds the primary model meanwhile)")

    def warmup_iters(self, total: int) -> int:
        return self.lr_warmup_iters

    def validate(self, model: ModelConfig) -> "TrainConfig":
        if self.seq_length > model.max_position_embeddings:
            raise ValueError(f"seq_length {self.seq_length} exceeds max_position_embeddings "
                             f"{model.max_position_embeddings}")
        if self.seq_length < 8:
            raise ValueError(f"seq_length {self.seq_length} is too short (need >= 8)")
        if min(self.train_iters, self.eval_iters) < 1 or self.eval_interval < 0:
            raise ValueError("train_iters and eval_iters must be >= 1 (eval_interval >= 0)")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.plugin_eval_blocks < 0:
            raise ValueError(f"plugin_eval_blocks must be >= 0, got {self.plugin_eval_blocks}")
        if self.embedding_init not in EMBEDDING_INITS:
            raise ValueError(f"embedding_init must be one of {', '.join(EMBEDDING_INITS)}, got {self.embedding_init!r}")
        if self.vocab_mode not in VOCAB_MODES:
            raise ValueError(f"vocab_mode must be one of {', '.join(VOCAB_MODES)}, got {self.vocab_mode!r}")
        if self.expand_output_start not in EXPAND_OUTPUT_STARTS:
            raise ValueError(f"expand_output_start must be one of {', '.join(EXPAND_OUTPUT_STARTS)}, got "
                             f"{self.expand_output_start!r}")
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(f"replay_fraction must be in [0, 1) (some target text in every batch), got "
                             f"{self.replay_fraction}")
        if (self.replay_fraction > 0) != (self.replay_data is not None):
            raise ValueError("--replay_fraction and --replay_data go together: pass both (source-language text mixed "
                             "into Step 2) or neither")
        if self.lr is None:
            raise ValueError("lr must be set for pretraining, Step 1b and Step 2")
        self._validate_loop()
        return self


# Your own tasks (`--task classify|pair|tag`, CSV, TSV or JSON Lines): the columns read where
# FinetuneConfig's text_column, text_pair_column and label_column are unset.
OWN_TASK_COLUMNS = {"classify": ("text", None, "label"), "pair": ("sentence1", "sentence2", "label"),
                    "tag": ("tokens", None, "tags")}


def _own_default(i: int) -> str:
    return ", ".join(f"{cols[i]} for {task}" for task, cols in OWN_TASK_COLUMNS.items() if cols[i])


@dataclass
class FinetuneConfig(LoopConfig):
    """Step 3 (fine-tuning the primary model on a source-language task, word embeddings frozen)
    and Step 4 (zero-shot evaluation). Defaults: the paper's section 3."""
    seed: int = _redefault("seed", 1)  # the paper averages 5 fine-tuning seeds
    train_micro_batch_size_per_gpu: int = _redefault("train_micro_batch_size_per_gpu", 32)
    lr: Optional[float] = _f(None, "peak learning rate (default: the task's, paper: 1e-5 XNLI/PAWS-X, "
                             "3e-5 MLQA/XQuAD)")
    seq_length: int = _f(128, "pieces per example (QA: per context window); at most the blocks the primary model "
                         "was pretrained on (its run.json train.seq_length), unless allow_untrained_positions")
    allow_untrained_positions: bool = _f(False, "fine-tune (and evaluate) with a seq_length longer than the primary "
                                         "model's pretraining blocks, with a warning: the position embeddings "
                                         "past them were never trained")
    epochs: float = _f(3.0, "passes over the training examples (paper: 3)")
    warmup_ratio: float = _f(0.06, "fraction of the updates with linear warm-up, then linear decay to 0")
    doc_stride: Optional[int] = _f(None, "QA: pieces shared by consecutive windows of a context longer than one "
                                   "window (default: 128, as in SQuAD practice at seq_length 384, or half the "
                                   "window where that is shorter)")
    max_query_length: int = _f(64, "QA: question pieces kept")
    max_answer_length: int = _f(30, "QA: longest answer predicted, in pieces")
    # 16384: on a GPU, enough rows to fill it (128 rows of 128 pieces; roberta-base's bf16
    # activations for them take a few hundred MiB of an H100's 80 GiB, and larger batches gain
    # little once every SM is busy); on a CPU, batch size barely changes throughput.
    eval_batch_tokens: int = _f(16384, "evaluation: piece ids per forward pass, counted as rows x the batch's longest "
                                "row (rows are sorted by length, padding past the longest is never computed; at "
                                "least one row per pass)")
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
        if self.eval_batch_tokens < 1 or self.epochs <= 0:
            raise ValueError("eval_batch_tokens must be >= 1 and epochs > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self._validate_loop()
        return self


# --- presets --------------------------------------------------------------------------------
# A preset names a model size and the schedule that goes with it.

# Decoder (family llama) shapes.
# LLAMA_TINY, 682,560 parameters: 12 x 46,208 per layer (QKV 64 x (4 + 2 x 2) x 16, out 64 x 64,
# gate/up 2 x 176 x 64, down 176 x 64, two norms) + the tied embedding 2000 x 64 + the final norm.
# ffn 176 = 8h/3 rounded up to a multiple of 16, Llama's ratio.
# init_method_std 0.05, not the 0.02 of h >= 768 models: at h = 64, 0.02 scales each projection's
# output to 0.02 * sqrt(64) = 0.16 of its normed input, and SwiGLU multiplies two such factors, so
# the feed-forward starts near zero and each factor's gradient is scaled by the other's smallness.
# Measured (2026-11-23, TINY's 200-update schedule on Genesis + Exodus, two seeds), validation loss:
# 4.63 with 0.02, 4.40 with 0.05, 4.42-4.45 with 0.08 (small_init's sqrt(2 / 5h)), 4.55 with 1/sqrt(h).
LLAMA_TINY = ModelConfig(family="llama", num_layers=12, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=176, vocab_size=2000, max_position_embeddings=128, hidden_dropout=0.0,
                   attention_dropout=0.0, init_method_std=0.05, share_embeddings_and_output_weights=True,
                   rotary_base=10000.0)

# Shaped as Qwen2-0.5B (its config.json): 494,032,768 parameters, as transformers'
# Qwen2ForCausalLM of that config counts them: 24 x 14,912,384 per layer (QKV 896 x (14 + 2 x 2)
# x 64 with its bias, out 896^2, gate/up 2 x 4864 x 896, down 4864 x 896, two norms) + the tied
# embedding 151,936 x 896 + the final norm.
QWEN2_0_5B = ModelConfig(family="llama", num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                         ffn_hidden_size=4864, vocab_size=151_936, max_position_embeddings=32_768,
                         hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6, init_method_std=0.02,
                         add_qkv_bias=True, rotary_base=1_000_000.0, share_embeddings_and_output_weights=True)

PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # RoBERTa-base with a 50k SentencePiece vocabulary and the paper's schedule (§3):
    # 125k updates of 2048 x 512 tokens, lr 7e-4, 10k warm-up. Global batch 2048 =
    # micro 32 x 64 data-parallel GPUs (x accumulation 2 on 32); set the two batch fields for your
    # cluster. 32 sequences of 512 keep a GPU's matmuls large and cut the host work per update
    # to a quarter of micro 8 x accumulation 4.
    "roberta-base": (ModelConfig(), TrainConfig(train_micro_batch_size_per_gpu=32,
                                                gradient_accumulation_steps=1)),
    # Trains visibly in minutes on 2 CPU cores; drives the tests, CI and the demo.
    # output_bias_init unigram: a 12 x 64 post-LayerNorm MLM sits on the unigram plateau for its
    # first hundreds of updates at batch 16, and reaches it by mapping every input to one vector
    # that predicts piece frequencies (its bias, moving lr per update, cannot get there in time):
    # In 9 of 10 runs (std 0.02-0.1, lr 2e-3) 60 updates left the top layer's output at the
    # classifier's position almost the same for every verse (std across verses 2e-5-1.3e-3,
    # against 0.14 at init) and bible-testament fine-tuned at 50.0-50.2%; clipping changed
    # nothing, a lower lr or longer warm-up gave 50-69% by seed (at 2.5e-4 the loss barely
    # moves). Starting the bias at the training text's log-frequencies leaves the layers nothing
    # to flatten: 60 updates reach loss 5.44-5.56 (5.98-6.03 on the plateau), spread 0.045-0.20,
    # fine-tuned 61-65% (3 seeds x std 0.02 and 0.07); at 200 updates the spread is 0.17 (zeros:
    # 1.8e-3). init_method_std 0.07, RoBERTa's 0.02 at h = 768 scaled by sqrt(768/64), the demo's
    # since 2026-11-23: at init the classifier's position varies 13x more than at 0.02.
    # Measured 2026-11-24: benchmarks/results/tiny_preset_cpu2_20261124.md.
    "tiny": (ModelConfig(num_layers=12, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                         vocab_size=2000, max_position_embeddings=128, init_method_std=0.07,
                         output_bias_init="unigram"),
             TrainConfig(seq_length=64, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=1,
                         train_iters=200, lr=2e-3, lr_warmup_iters=20, log_interval=10,
                         save_interval=100)),
    # The decoder at the tiny preset's size and schedule: tests, CI and the decoder demo.
    "llama-tiny": (LLAMA_TINY, TrainConfig(seq_length=64, train_micro_batch_size_per_gpu=16,
                                           gradient_accumulation_steps=1, train_iters=200, lr=2e-3,
                                           lr_warmup_iters=20, log_interval=10, save_interval=100)),
    # A real decoder size: Qwen2-0.5B's shape, 2048-token blocks, a 1M-token global batch (micro 8
    # x 64 data-parallel GPUs), lr 3e-4 with 2,000 warm-up updates (set the batch fields for your
    # cluster; a Hugging Face Qwen2 checkpoint comes in through import-hf instead).
    "qwen2-0.5b": (QWEN2_0_5B, TrainConfig(seq_length=2048, train_micro_batch_size_per_gpu=8,
                                           gradient_accumulation_steps=1, train_iters=100_000, lr=3e-4,
                                           lr_warmup_iters=2000, weight_decay=0.1, adam_beta2=0.95,
                                           adam_eps=1e-8, gradient_clipping=1.0)),
}


# The small preset of each model family: the schedule later steps run by default over a source
# run of that family, and the demo's model.
FAMILY_PRESETS = {"roberta": "tiny", "llama": "llama-tiny"}


# ModelConfig fields that Steps 1b, 2 and 3 may set; the architecture itself is the source run's.
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "hidden_dropout",
                 "attention_dropout", "attention_impl", "fusion")


@dataclass(frozen=True)
class Layout:
    """How a later step (1b, 2, 3) lays out and runs its source's model: the LAYOUT_FIELDS of
    ModelConfig (see their help there), each None to keep the source run's."""
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    hidden_dropout: Optional[float] = None
    attention_dropout: Optional[float] = None
    attention_impl: Optional[str] = None
    fusion: Optional[str] = None

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
            raise ValueError(f"mini_layers {bad[0]} must be in 1..{model.num_layers - 1} "
                             f"for a {model.num_layers}-layer primary model")
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


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported like every other user mistake: one line, exit 2; and
    every command's --verbose (mmadapt/quiet.py reads it from the process's arguments, before the
    libraries it quiets are imported)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--verbose", action="store_true", help="show all that the libraries under mmadapt print "
                          "(default: the known notices that say nothing about your run are filtered, "
                          "mmadapt/quiet.py; MMADAPT_VERBOSE=1 does the same)")

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def add_dataclass_args(parser: argparse.ArgumentParser, cls, only: tuple[str, ...] | None = None,
                       defaults: dict[str, Any] | str | None = None) -> None:
    """Add one `--name` flag per field of `cls` (or per field named in `only`); unset flags stay
    None (the preset, or the run being adapted, decides). `defaults` says in --help what an unset
    flag becomes: {preset name: instance} (each preset's value), a sentence, or None (the field's
    default)."""
    group = parser.add_argument_group(cls.__name__)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or not f.metadata.get("flag", True):
            continue
        kind = hints[f.name]
        text = f.metadata["help"]  # a help that says its own default (a None field's) keeps it
        text = text if "(default:" in text else f"{text} ({_default_help(f, defaults)})"
        kw: dict[str, Any] = dict(default=None, help=text.replace("%", "%%"))  # argparse %-formats help
        if _tuple_item(kind) is not None:
            kw.update(type=_tuple_item(kind), nargs="+")
        else:
            base = next((a for a in get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
            kw.update(type=_bool if base is bool else base if base in (int, float) else str)
        group.add_argument(f"--{f.name}", **kw)


def _bool(text: str) -> bool:
    """A bool flag's value: --decay_all true (or false; also 1/0, yes/no)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def override(cfg, args: argparse.Namespace):
    """Copy of `cfg` with every field that `args` sets (not None) replaced."""
    hints = get_type_hints(type(cfg))
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cfg)
               if getattr(args, f.name, None) is not None}
    for name in changes:
        if _tuple_item(hints[name]) is not None:
            changes[name] = tuple(changes[name])
    return dataclasses.replace(cfg, **changes)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
