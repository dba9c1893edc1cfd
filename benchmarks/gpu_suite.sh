#!/usr/bin/env bash
# The GPU benchmark suite: one command, one GPU, about 10 minutes; dated results files land in
# benchmarks/results/ (<name>_<gpu>_<yyyymmdd>.{json,md}).
#
#   bash benchmarks/gpu_suite.sh                 # on a machine with one GPU
#   SMOKE=1 bash benchmarks/gpu_suite.sh         # the same scripts at CPU scale, a few repeats
#                                                # (checks the suite runs; its numbers mean nothing,
#                                                # so they go to a temporary directory)
#
# What it measures (roberta-base, bf16, s=512, micro-batch 32 on a GPU):
#   1. Step 1 (BL_BASE, BL_SMALL, MINIJOINT), Step 1b (MINIPOST) and Step 2 (BL_BASE, MINIJOINT,
#      MINIPOST) on real packed Bible blocks with their padding and dropout on, under zero2_bf16.json
#      as a run of one replica applies it (engine.for_replicas: DeepSpeed's BF16_Optimizer, no ZeRO):
#      time per update, tokens/s, achieved TFLOP/s (exact FLOP count) against the measured matmul
#      peak and the vendor's bf16 peak; eager with a padding mask (all seven cases), eager with
#      --attention_impl varlen, then varlen with --fusion compile (the five cases above), and
#      --fusion cudagraphs (frozen layers replayed as CUDA graphs; padding-mask attention).
#   2. One transformer layer, forward + backward, eager against torch.compile, padded and not.
#   3. Step-4 evaluation: wall time per (artifact, seed) on a 5,010-example set, and the time
#      spent outside the forward passes.
#   4. The same Step-2 work in Hugging Face transformers' RobertaForMaskedLM, and the decoder's in
#      LlamaForCausalLM (if installed).
# The same steps at smoke scale, and each family's bf16 forward against fp32 on the CPU, are the
# `gpu` tests: python -m pytest -m gpu (tests/test_gpu.py).
# Each script prints its table and the paths it wrote; a failing one does not stop the others,
# and the suite exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

if [ -n "${SMOKE:-}" ]; then
    export MMADAPT_BENCH_RESULTS=${MMADAPT_BENCH_RESULTS:-$(mktemp -d)}
    echo "SMOKE: results go to $MMADAPT_BENCH_RESULTS"
    QUICK=(--repeats 2 --warmup 1)
    EVAL_ARGS=(--examples 200)
    GRAPHS=compile  # --fusion cudagraphs needs CUDA: at CPU scale the same command line runs compiled
else
    if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "error: no CUDA device visible to torch: run on a GPU machine (or SMOKE=1 for a CPU check)" >&2
        exit 2
    fi
    # Names the GPU; where ./.whl holds carried wheels (a GPU machine without a package registry,
    # gpu_quick.sh's header) it installs them and puts them on the path
    source benchmarks/gpu_env.sh
    QUICK=()
    EVAL_ARGS=(--examples 5010 --shape roberta-base)
    GRAPHS=cudagraphs
fi
python3 -c "import torch, deepspeed, megatron.core; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"

failed=()
run() {  # run NAME CMD...: time it, keep going on failure
    echo; echo "=== $1: ${*:2}"
    local t0=$SECONDS
    if "${@:2}"; then echo "=== $1: done in $((SECONDS - t0)) s"; else echo "=== $1: FAILED"; failed+=("$1"); fi
}

CASES=(--only bl_base:pretrain minijoint:pretrain bl_base:adapt minijoint:adapt minipost:adapt)
run throughput-eager   python3 benchmarks/throughput.py --real --dropout "${QUICK[@]}"
run throughput-varlen  python3 benchmarks/throughput.py --real --dropout --attention_impl varlen "${CASES[@]}" "${QUICK[@]}"
run throughput-compile python3 benchmarks/throughput.py --real --dropout --attention_impl varlen --fusion compile \
                           "${CASES[@]}" "${QUICK[@]}"
run throughput-cudagraphs python3 benchmarks/throughput.py --real --dropout --fusion "$GRAPHS" "${CASES[@]}" \
                           "${QUICK[@]}"
run layer              python3 benchmarks/layer_speed.py --dropout "${QUICK[@]}"
run micro-batch-fill   python3 benchmarks/micro_batch_fill.py --real --dropout "${QUICK[@]}"
run eval               python3 benchmarks/eval_overhead.py "${EVAL_ARGS[@]}"
if python3 -c "import transformers" 2>/dev/null; then
    run vs-hf          python3 benchmarks/vs_hf.py "${QUICK[@]}"
    run vs-hf-decoder  python3 benchmarks/vs_hf_decoder.py "${QUICK[@]}"
else
    echo "transformers is not installed: skipping vs_hf.py and vs_hf_decoder.py (pip install -e '.[hf]')"
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all benchmarks written to ${MMADAPT_BENCH_RESULTS:-benchmarks/results}/"
