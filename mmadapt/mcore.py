"""megatron-core, imported here once for every module of mmadapt that uses it (parallel.py,
models/layers.py, data.py's indexed datasets, inside its functions): `from mmadapt.mcore import ...`.

Why not `import megatron.core` where it is used: the package's import wraps its fused element-wise
functions (bias-GELU, bias-SwiGLU, ...) in `torch.compile` as it defines them (megatron/core/jit.py:
`jit_fuser = torch.compile`). Wrapping a function compiles nothing (that waits for its first call)
but imports TorchDynamo's frame conversion and TorchInductor's compiler, and with them sympy,
networkx and the distributed-tensor ops: 4-5 s of every process's start on 2 CPU cores
(benchmarks/results/test_suite_cpu2_20261128.md), paid by every rank of every launch, and by
commands that never build a model. mmadapt calls none of those functions (fusion.py says why), so
the wrap is deferred to each function's first call, when torch.compile wraps and compiles it
exactly as megatron-core asked; everything else megatron-core defines is untouched.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def compile_on_first_call():
    """Within: `torch.compile(fn, **options)` of a plain function returns `fn` wrapped so that the
    real torch.compile(fn, **options) is made on its first call (and used from then on); a module,
    or anything but a function, goes to torch.compile at once, as outside."""
    compile_now = torch.compile

    def deferred(fn=None, **options):
        if fn is None:  # @torch.compile(**options)
            return lambda f: deferred(f, **options)
        if not hasattr(fn, "__code__"):  # a module, or anything but a function or method
            return compile_now(fn, **options)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(fn, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile_now


with compile_on_first_call():
    import megatron.core  # noqa: F401  (the package: everything its __init__ imports, jit.py included)

from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.datasets import indexed_dataset  # noqa: E402  (milliseconds once the package is in)

__all__ = ["ModelParallelConfig", "compile_on_first_call", "indexed_dataset", "parallel_state", "tensor_parallel"]
