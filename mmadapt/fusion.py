"""Fused execution of a plain model, chosen at construction (ModelConfig.fusion).

Like torchtitan's `apply_compile`, fusion is applied *to* a built model (a family's LM or task
model, or this rank's pipeline stage; what it compiles is the family's `compiled_kinds`) and
changes no module, parameter name or state-dict key: `module.compile()` compiles a module's call
in place. The default, 'auto', compiles on a CUDA device and runs eagerly elsewhere (`resolved`);
the eager model is the reference that tests compare against (tests/test_fusion.py: equal losses
and gradients in fp32 to rounding).

fusion "compile" of the encoder family (models/roberta): torch.compile (TorchInductor) of
  - each TransformerLayer: bias + GELU, dropout + residual add + LayerNorm, and the FFN between
    them become a few generated kernels instead of one kernel per op. Every layer runs the same
    code, so the layers share their compiled graphs (parameters are graph inputs).
  - the MLM heads (MLMHeads): gathering the masked rows by index, and for every head dense ->
    GELU -> LayerNorm -> tied projection + bias -> cross-entropy, then the (weighted) mean: one
    graph for all heads (the masked indices and targets are its inputs, so no shape in it
    depends on the data).
  - not the task head of RobertaForTask: it is a few small ops on [b, h] (or [b, s, C]) written
    inline in RobertaForTask.logits, not a module of its own; compiling it would mean compiling
    the whole model, layers and all, as one graph. Its layers are compiled as above.

fusion "cudagraphs": as "compile", and each frozen instance of the family's `graphed_kinds` (its
  layers: Step 2's whole body) replayed as CUDA graphs where its input needs a gradient in
  training (`replay`: the cudagraph trees of torch.compile's mode 'reduce-overhead', at static
  shapes): a layer's forward and backward are one graph launch each, not one launch per kernel.
  Trained layers are compiled without graphs: their weight gradients would be outputs in the
  graphs' memory, which the next replay overwrites (torch refuses to accumulate into them). A
  CUDA device, fixed shapes (not attention_impl 'varlen', whose jagged batches change shape every
  update), tensor and pipeline parallel size 1 (ModelConfig.validate: megatron-core's linears
  would cut a TP layer into many graphs; DeepSpeed's pipeline reruns a stage's backward).

Choices, and why:
  - Graph breaks are allowed (fullgraph=False). At tensor-parallel size 1 a layer is one graph:
    its attention core draws dropout from the default generator there (layers.attention_rng).
    With tensor parallelism the core runs eagerly inside the model-parallel RNG fork (it swaps
    the CPU/CUDA generator state, which dynamo cannot trace), so each rank's heads draw from
    their own stream exactly as in eager mode, between two graphs: the rest of `attention` (the
    output projection) and the rest of `forward` (dropout, residual, LayerNorm, FFN). And every
    megatron-core linear is a graph break as well (its autograd function all-reduces
    asynchronously in backward, which dynamo does not trace): the linears run eagerly, the
    elementwise work between them is still compiled. Pipeline stages keep their host-side
    bookkeeping (each micro-batch's padding and masked positions, the logged losses) out of the
    graphs with torch.compiler.disable (pipeline.py): traced, it would be guarded on and
    recompiled for every micro-batch. Launched TP 2 and PP 2 runs match their eager losses and
    weights (tests/test_fusion.py).
  - Shapes are dynamic only where they vary ("automatic dynamic", torch's default): the layers
    see a fixed [b, s, h] in training, while the heads see [m, h] with m the number of masked
    positions, different in every micro-batch. The first call compiles for its m, the second
    recompiles with m symbolic, and no later batch recompiles (a test counts the compilations).
    attention_impl "varlen" passes each padded batch's longest length, an int: the same again.
    TrainConfig.micro_batch_fill's re-split (a CUDA run, from its third update) changes b once:
    the layers compile once more, with b symbolic.
    Padding m to a fixed size would waste head FLOPs; marking every dimension dynamic from the
    start would make the hidden size symbolic as well.
  - Dropout in compiled graphs draws its masks from Inductor's own generator (seeded from torch's,
    so a run is deterministic for a given seed), and the attention core's (at TP 1) from the
    default generator, not the eager masks: with dropout on, compiled and eager runs are equally
    valid but not equal.
  - megatron-core's fused bias-GELU (`bias_gelu_impl`) is not used: it is the tanh approximation of
    GELU, and RoBERTa's is the exact (erf) GELU, so it would change the model (by up to 4.7e-4
    per activation). Inductor fuses the exact GELU with the bias add instead.
  - Transformer Engine is not offered: it is not installed where this was written and tested.
"""

from __future__ import annotations

import torch
from torch import nn

from mmadapt import parallel
from mmadapt.config import ModelConfig

# Each compiled function keeps one graph per combination of what its guards check: grad mode
# (training or no_grad evaluation), padding or none (no attention mask), which of its inputs and
# parameters need gradients (frozen layers, the lowest trainable one, trainable ones: Step 1b),
# static then dynamic shapes. A process can meet more than torch's default of 8, and past the
# limit dynamo silently runs the function eagerly.
RECOMPILE_LIMIT = 64
# fusion "cudagraphs": Inductor's options for a graphed module's training calls, CUDA graphs as
# torch.compile's mode 'reduce-overhead' sets them (cudagraph trees).
GRAPHED = {"triton.cudagraphs": True}


def _check_cpp_compiler() -> None:
    """Inductor builds its CPU kernels with a C++ compiler: say so before the first step fails."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:
        raise ValueError(f"fusion 'compile' on CPU needs a C++ compiler for TorchInductor ({e}): install g++ "
                         "(or set CXX), or use --fusion none") from None


def resolved(fusion: str) -> str:
    """ModelConfig.fusion as applied: 'auto' is 'compile' where models train on a CUDA device and
    'none' elsewhere. On an H200 (benchmarks/results/gpu_summary_h200_20261129.md) compiling cut
    the full-depth updates by 12-20% (roberta-base Steps 1 and 2, Qwen2-0.5B's Step 2) and the
    mini-models' by 7-14%. Off a GPU the eager model is kept: it is what the tests compare
    against, and on a CPU compiling was slower at the tiny size
    (benchmarks/results/benchmark_summary_cpu2_20261123.md)."""
    if fusion != "auto":
        return fusion
    return "compile" if parallel.device().type == "cuda" else "none"


def check_device(config: ModelConfig, family=None) -> None:
    """Refuse fusion 'cudagraphs' where this process trains off CUDA, and a fusion asked for by
    name that `family` (a ModelFamily) has no modules for (its compiled_kinds; its graphed_kinds
    that are compiled kinds too: a family of one's own that sets none trained eager and recorded
    the fusion), in one line (run.start_run calls it before a run writes anything)."""
    if config.fusion == "cudagraphs" and parallel.device().type != "cuda":
        raise ValueError(f"--fusion cudagraphs needs a CUDA device (this process trains on "
                         f"{parallel.device().type}): use --fusion compile")
    kinds = {"compile": "compiled_kinds", "cudagraphs": "graphed_kinds"}.get(config.fusion)
    if family is None or kinds is None:
        return
    compiled = tuple(family.compiled_kinds)
    # apply_fusion replays a module of a compiled kind and a graphed kind (docs/model-families.md:
    # "of those"): one class a subclass of the other, either way (a compiled subclass of a graphed one)
    named = compiled if kinds == "compiled_kinds" else [
        g for g in family.graphed_kinds if any(issubclass(g, c) or issubclass(c, g) for c in compiled)]
    if not named:
        raise ValueError(f"--fusion {config.fusion}: the {family.name} family names no modules to "
                         f"{'compile' if config.fusion == 'compile' else 'replay as CUDA graphs'} (ModelFamily."
                         f"{kinds}{'' if kinds == 'compiled_kinds' else ', among its compiled_kinds'}): use --fusion "
                         f"none, or set {kinds} (docs/model-families.md)")


def apply_fusion(model: nn.Module, config: ModelConfig, kinds: tuple[type, ...],
                 graphed: tuple[type, ...] = ()) -> nn.Module:
    """Apply `config.fusion` to `model` in place (a family's LM, task model or pipeline stage)
    and return it: each instance of `kinds` (the family's `compiled_kinds`) is compiled, and with
    fusion 'cudagraphs' each frozen one of `graphed` (its `graphed_kinds`; no parameter requires a
    gradient, so set them first: engine.set_trainable) replayed as CUDA graphs in training
    (`replay`). Call it before the model is wrapped by DeepSpeed: the engine then calls the
    compiled modules like any others."""
    fusion = resolved(config.fusion)
    if fusion == "none":
        return model
    if fusion not in ("compile", "cudagraphs"):
        raise ValueError(f"unknown fusion {config.fusion!r}")
    check_device(config)
    if not torch.cuda.is_available():
        _check_cpp_compiler()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if config.pipeline_model_parallel_size > 1:
        # DeepSpeed's pipeline runs one backward per floating-point tensor that a stage sends on
        # (two with MINIJOINT's carried activation), all but the last with retain_graph=True.
        # AOTAutograd's donated buffers (saved activations reused as gradient storage) allow a
        # compiled backward to run once only.
        torch._functorch.config.donated_buffer = False
    for module in model.modules():
        if not isinstance(module, kinds):
            continue
        frozen = not any(p.requires_grad for p in module.parameters())
        if fusion == "cudagraphs" and isinstance(module, graphed) and frozen:
            replay(module)
        else:
            module.compile()
    return model


def replay(module: nn.Module) -> None:
    """Compile `module`'s call in place (as nn.Module.compile does) twice: a training call whose
    input x (its first argument) needs a gradient, Step 2's (the trained embeddings feed the
    body), with CUDA graphs (GRAPHED) at static shapes, and any other as 'compile' compiles it.
    A training call meets one shape and mask kind (padded or not; two shapes where
    micro_batch_fill re-splits the update: one recompile), each recorded once as a CUDA graph.
    Evaluation's calls (no gradients, rows whose count varies by batch), kept apart, neither
    record one CUDA graph per size (each holding memory of its own) nor, under torch's automatic
    dynamic shapes, make the training graph symbolic. Nor are forward-only calls graphed (Step
    1b's copied layers, fit-head's body: nothing below them trains): separately compiled
    forward-only graphs each begin a new generation of torch's cudagraph trees, which frees the
    outputs of the layer before, the next layer's input (pytorch/pytorch#152887); a pending
    backward is what keeps one update's layers in one generation."""
    training = torch.compile(module._call_impl, dynamic=False, options=GRAPHED)
    other = torch.compile(module._call_impl)

    def call(*args, **kwargs):
        x = args[0] if args else kwargs["x"]
        return (training if torch.is_grad_enabled() and x.requires_grad else other)(*args, **kwargs)
    module._compiled_call_impl = call


def is_fused(model: nn.Module) -> bool:
    """True if `apply_fusion` compiled any module of `model`."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
