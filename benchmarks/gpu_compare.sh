#!/usr/bin/env bash
# Before against after on one GPU in one call: the Step-1 and Step-2 throughput of another tree of
# this repository (BEFORE, e.g. `git archive <rev> mmadapt benchmarks ds_configs`) and of this
# one, each in a process of its own on the same machine minutes apart, then this tree's profile of
# a BL_BASE Step-1 update (the host side with it) and its host cost against BEFORE's.
#
#   bash benchmarks/gpu_compare.sh BEFORE RESULTS_DIR      # RESULTS_DIR/{before,after}/
#   SMOKE=1 bash benchmarks/gpu_compare.sh BEFORE /tmp/x   # the same steps on a CPU, an update or two each
#
# Wheels and the cut Bible database as benchmarks/gpu_quick.sh says (gpu_env.sh installs them).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
before=$(realpath "$1"); out=$(realpath -m "$2"); mkdir -p "$out/before" "$out/after"
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
R=10; [ -n "${SMOKE:-}" ] && R=1
failed=()
step() {  # step NAME SECONDS DIR CMD...: run CMD in DIR under a time limit, keep going on failure
    echo; echo "=== $1 (in $3): ${*:4}"
    local t0=$SECONDS
    if (cd "$3" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "$2" "${@:4}"); then
        echo "=== $1: done in $((SECONDS - t0)) s"
    else echo "=== $1: FAILED or cut at $2 s"; failed+=("$1"); fi
}
CASES=(--only bl_base:pretrain minijoint:pretrain bl_base:adapt minijoint:adapt --repeats "$R" --warmup 3)
for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$PWD
    MMADAPT_BENCH_RESULTS=$out/$side step "throughput-$side" 60 "$dir" python3 benchmarks/throughput.py --real --dropout "${CASES[@]}"
done
export MMADAPT_BENCH_RESULTS=$out/after
step profile 45 "$PWD" python3 benchmarks/profile_update.py --real --dropout --only bl_base:pretrain --repeats $((R / 2 + 1)) --warmup 2
HOST=(--shapes roberta-base --cases bl_base-pretrain bl_base-adapt minijoint-adapt --repeats $((R + 1)))
step host-cost-before 40 "$PWD" python3 benchmarks/host_cost.py --repo "$before" --tag "$(basename "$before")" "${HOST[@]}" \
                          --json_only /tmp/host_cost_before_$$.json
step host-cost 40 "$PWD" python3 benchmarks/host_cost.py "${HOST[@]}" --against /tmp/host_cost_before_$$.json
echo
[ ${#failed[@]} -gt 0 ] && { echo "failed: ${failed[*]}"; exit 1; }
echo "all written to $out/"
