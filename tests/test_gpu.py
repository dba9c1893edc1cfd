"""What needs a GPU, as tests that the first machine with one runs in one command:

    python -m pytest -m gpu

Every test here but the last is marked `gpu` and skipped where torch sees no CUDA device
(conftest.py), never the other way round: each family's bf16 forward on CUDA against its fp32
forward on the CPU from the same weights, and each step of benchmarks/gpu_suite.sh at smoke scale
(a few updates, results into a temporary directory). The last test, which runs everywhere, keeps
that list of steps and the suite's in step."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, benchmark_module, child_env, masked_batch
from mmadapt.models import find_preset
from mmadapt.tokens import IGNORE_INDEX

# Each `run NAME CMD...` of benchmarks/gpu_suite.sh, with the suite's arguments at smoke scale.
SMOKE = ("--repeats", "2", "--warmup", "1")
CASES = ("--only", "bl_base:pretrain", "minijoint:adapt")
SUITE = {
    "throughput-eager": ["benchmarks/throughput.py", "--real", "--dropout", *CASES, *SMOKE],
    "throughput-varlen": ["benchmarks/throughput.py", "--real", "--dropout", "--attention_impl", "varlen", *CASES,
                          *SMOKE],
    "throughput-compile": ["benchmarks/throughput.py", "--real", "--dropout", "--attention_impl", "varlen",
                           "--fusion", "compile", *CASES, *SMOKE],
    "throughput-cudagraphs": ["benchmarks/throughput.py", "--real", "--dropout", "--fusion", "cudagraphs", *CASES,
                              *SMOKE],
    "layer": ["benchmarks/layer_speed.py", "--dropout", *SMOKE],
    "micro-batch-fill": ["benchmarks/micro_batch_fill.py", "--real", "--dropout", "--accumulation", "2", *SMOKE],
    "eval": ["benchmarks/eval_overhead.py", "--examples", "200"],
    "vs-hf": ["benchmarks/vs_hf.py", *SMOKE],
    "vs-hf-decoder": ["benchmarks/vs_hf_decoder.py", *SMOKE],
}


def _labels(family, ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """The scored positions of the family's objective: the masked ones, or every next piece."""
    if family.objective.masked:
        return masked
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return labels


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_bf16_on_cuda_matches_fp32_on_the_cpu(preset):
    """The same seeded weights, two heads (MINIJOINT's shape): every head's loss within 2% and
    every logit within 3% of the largest, bf16 on the GPU against fp32 on the CPU (bf16 keeps 8
    bits of mantissa: each of the few layers adds about 0.4% relative error)."""
    family, model, _ = find_preset(preset)
    cfg = dataclasses.replace(model, num_layers=4, head_layers=(2, 4), hidden_dropout=0.0, attention_dropout=0.0)
    cpu = family.build_lm(cfg, seed=1).eval()
    gpu = family.build_lm(cfg, seed=1).to("cuda", torch.bfloat16).eval()
    ids, masked = masked_batch(cfg.vocab_size, b=4, s=64)
    labels = _labels(family, ids, masked)
    with torch.no_grad():
        _, want = cpu(ids, labels)
        _, got = gpu(ids.cuda(), labels.cuda())
        torch.testing.assert_close(got.float().cpu(), want, rtol=0.02, atol=0.0)
        for w, g in zip(cpu.logits(ids), gpu.logits(ids.cuda())):
            err = (g.float().cpu() - w).abs().max() / w.abs().max()
            assert err < 0.03, f"{preset}: bf16 logits differ by {err:.3f} of the largest"


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_bf16_updates_on_cuda_never_synchronize(clip):
    """One replica under bf16, as a run trains it (engine.for_replicas, pinned host batches,
    --fusion auto): three updates, optimizer step included, run under CUDA's sync debug mode set
    to error, so any op that makes the host wait for the device (a read back, a synchronous
    copy, a synchronize) raises. tests/test_host_sync.py checks the read-backs on the CPU; this
    is the device's own word, synchronous copies and all."""
    from conftest import REPO as repo
    from mmadapt.engine import for_replicas, load_ds_config
    from mmadapt.models import PRESETS, get_family
    from mmadapt.parallel import init_parallel
    from mmadapt.train import host_batch, lm_engine, lm_step

    model, train = PRESETS["tiny"]
    train = dataclasses.replace(train, gradient_clipping=clip, train_micro_batch_size_per_gpu=4, seq_length=32)
    ds = for_replicas(load_ds_config(repo / "ds_configs" / "zero2_bf16.json", train), 1)
    init_parallel(1, 1)
    engine, _, _ = lm_engine(get_family(model), model, train, ds)
    assert engine.device.type == "cuda" and type(engine.optimizer).__name__ == "BF16_Optimizer"
    batches = []
    for seed in range(5):
        ids, masked = masked_batch(model.vocab_size, b=4, s=32, seed=seed)
        batches.append(host_batch(ids, masked, pin=True))
    for b in batches[:2]:  # the first step links the optimizer's state; the first calls compile
        lm_step(engine, [b], 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [lm_step(engine, [b], 1) for b in batches[2:]]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(torch.stack(losses)).all()


@pytest.mark.gpu
def test_micro_batch_fill_reads_cuda_memory_and_merges():
    """micro_batch_fill with CUDA's own counters (microbatch.device_memory) under bf16 ZeRO-2: the
    tiny model asked for as micro 4 x 4 fits its 16 blocks in one micro-batch many times over,
    so after update 1 it merges all four, and DeepSpeed accumulates one from update 3 on, its
    global batch still 16; the merged update peaks under the estimate. tests/test_llama_steps.py
    checks on the CPU, with the memory faked, that a re-split trains the same updates."""
    from conftest import REPO as repo
    from mmadapt.engine import for_replicas, load_ds_config
    from mmadapt.microbatch import MicroBatchFit, device_memory, merged
    from mmadapt.models import PRESETS, get_family
    from mmadapt.parallel import init_parallel
    from mmadapt.train import host_batch, lm_engine, lm_step

    model, train = PRESETS["tiny"]
    train = dataclasses.replace(train, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4, seq_length=32)
    ds = for_replicas(load_ds_config(repo / "ds_configs" / "zero2_bf16.json", train), 1)
    init_parallel(1, 1)
    engine, _, _ = lm_engine(get_family(model), model, train, ds)
    lines, seen, records = [], [], []
    fit = MicroBatchFit(engine, 4, 4, 0.8, device_memory(engine.device), 1, None, records.append, lines.append)
    micro = [masked_batch(model.vocab_size, b=4, s=32, seed=j) for j in range(4)]
    for position in range(4):
        fit.before(position)
        batches = [host_batch(ids, labels, pin=True) for ids, labels in merged(micro, fit.factor(position))]
        losses = lm_step(engine, batches, 1)
        fit.after(position)
        seen.append((len(batches), engine.gradient_accumulation_steps(), engine.train_batch_size()))
    assert seen == [(4, 4, 16)] * 2 + [(1, 1, 16)] * 2 and torch.isfinite(losses).all()
    assert "re-split to 16 x 1 from update 3" in lines[0] and len(lines) == 2, lines
    # The estimate charges update 1's gradient buffers and optimizer states to its blocks: the
    # merged update's measured peak stays under it.
    last = records[-1]
    assert (last["merged"], last["tried"], last["confirmed"]) == (4, True, True)
    assert 0 < last["peak_bytes"] <= last["estimate_bytes"], last


def _step2_updates(preset: str, fusion: str, updates: int, device: str):
    """A one-head, four-layer model of `preset` trained as Step 2 trains it (word embeddings and
    output bias; one replica under zero1.json, fp32, dropout off) with `fusion`, `updates` times
    on fixed batches. -> (engine, losses, one more update as a function, its family)."""
    from conftest import REPO as repo
    from mmadapt.engine import for_replicas, load_ds_config
    from mmadapt.models import PRESETS, get_family
    from mmadapt.parallel import init_parallel
    from mmadapt.train import LMJob, host_batch, lm_engine, lm_step

    model, train = PRESETS[preset]
    family = get_family(model)
    model = dataclasses.replace(family.one_head(model, 4), hidden_dropout=0.0, attention_dropout=0.0, fusion=fusion)
    train = dataclasses.replace(train, train_micro_batch_size_per_gpu=4, seq_length=32)
    ds = for_replicas(load_ds_config(repo / "ds_configs" / "zero1.json", train), 1)
    init_parallel(1, 1)
    engine, _, _ = lm_engine(family, model, train, ds, LMJob(step="adapt", trainable=family.vocab_params(model)))
    assert engine.device.type == device
    batches = []
    for seed in range(3):
        ids, masked = masked_batch(model.vocab_size, b=4, s=32, seed=seed)
        batches.append(host_batch(ids, _labels(family, ids, masked), pin=device == "cuda"))
    k = iter(range(10**6))
    update = lambda: lm_step(engine, [batches[next(k) % len(batches)]], 1)
    return engine, torch.stack([update() for _ in range(updates)]).cpu(), update, family


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_cudagraphs_replays_every_layer_and_trains_as_compile(preset):
    """--fusion cudagraphs against --fusion compile on Step 2's update (the one it is for): the
    same losses and trained embeddings to rounding over six updates (the same Inductor kernels,
    replayed), and in a profiled update after those, at least one CUDA graph launch per layer and
    direction (forward, backward) and fewer launches in all than compile's."""
    from torch.profiler import ProfilerActivity, profile

    launch = benchmark_module("host_cost").CUDA_LAUNCHES  # the CUDA runtime calls that put work on the device
    runs = {}
    for fusion in ("compile", "cudagraphs"):
        engine, losses, update, family = _step2_updates(preset, fusion, 6, "cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            update()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        runs[fusion] = (losses, engine.module.state_dict()[family.word].float().cpu(),
                        sum(n == "cudaGraphLaunch" for n in names), sum(bool(launch.match(n)) for n in names))
    (loss_c, word_c, graphs_c, launches_c), (loss_g, word_g, graphs_g, launches_g) = runs.values()
    torch.testing.assert_close(loss_g, loss_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(word_g, word_c, rtol=1e-5, atol=1e-6)
    assert graphs_c == 0 and graphs_g >= 2 * 4, (graphs_c, graphs_g)
    assert launches_g < launches_c, (launches_g, launches_c)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SUITE))
def test_gpu_suite_step_runs(name, tmp_path):
    proc = subprocess.run([sys.executable, *SUITE[name]], cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env=child_env(MMADAPT_BENCH_RESULTS=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert any(tmp_path.iterdir()), "the step wrote no results file"


def test_the_smoke_list_is_the_suites():
    """Every `run NAME` of benchmarks/gpu_suite.sh has its smoke test above, and no other."""
    suite = (REPO / "benchmarks" / "gpu_suite.sh").read_text()
    assert set(re.findall(r"^\s*run\s+([\w-]+)\s", suite, re.M)) == set(SUITE)
    assert all((REPO / args[0]).is_file() for args in SUITE.values())
    assert os.path.basename(SUITE["eval"][0]) in suite
