# shellcheck shell=bash
# Sourced by gpu_quick.sh and gpu_compare.sh from the repository root: on a GPU machine without a
# package registry, install the wheels carried in ./.whl into /tmp/site, and put the cut Bible
# database of ./.devcache/site on the path (gpu_quick.sh says how to make both); then name the GPU.
# SMOKE=1 (a CPU check of the scripts) uses this machine's own packages and asks for no GPU.
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .devcache/site ] && export PYTHONPATH=$PWD/.devcache/site${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${SMOKE:-}" ]; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv || exit 2
fi
