"""mcore.py: megatron-core's torch.compile wraps wait for their first call, so that a process that
imports mmadapt does not import TorchInductor's compiler (seconds of every start), and what is
deferred still compiles and computes as torch.compile would."""

import subprocess
import sys

import torch

from conftest import REPO, child_env
from mmadapt.mcore import compile_on_first_call


def test_a_deferred_function_compiles_on_its_first_call_and_computes_the_same():
    traced = []

    def backend(graph, example_inputs):  # counts dynamo's traces, runs the graph as traced
        traced.append(graph)
        return graph.forward

    def gelu_bias(x, b):
        return torch.nn.functional.gelu(x + b)

    def bias_gelu(x, b):  # another code object: dynamo caches its traces per code object
        return torch.nn.functional.gelu(b + x)

    with compile_on_first_call():
        deferred = torch.compile(gelu_bias, backend=backend)
        decorated = torch.compile(backend=backend)(bias_gelu)  # the decorator-factory form
        module = torch.compile(torch.nn.Linear(3, 3), backend=backend)
    assert torch.compile.__module__ == "torch"  # restored on leaving
    assert (deferred.__name__, decorated.__name__) == ("gelu_bias", "bias_gelu") and traced == []  # nothing traced yet
    assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule)  # a module goes to torch.compile at once
    x, b = torch.randn(4, 3), torch.randn(3)
    expected = torch.nn.functional.gelu(x + b)
    assert torch.equal(deferred(x, b), expected) and len(traced) == 1  # traced by dynamo on the first call
    assert torch.equal(deferred(x, b), expected) and len(traced) == 1  # then the compiled code runs
    assert torch.equal(decorated(x, b), expected) and len(traced) == 2


def test_importing_the_steps_leaves_torchinductor_out():
    """megatron-core's package import (jit.py's torch.compile wraps) would import TorchInductor's
    compile_fx and sympy with it; through mcore.py nothing of mmadapt's steps does."""
    code = ("import sys, mmadapt.steps, mmadapt.engine, mmadapt.data; import megatron.core.fusions.fused_bias_gelu as f; "
            "print('torch._inductor.compile_fx' in sys.modules, callable(f.bias_gelu))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"], proc.stdout
