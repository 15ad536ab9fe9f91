#!/usr/bin/env bash
# The GPU executor's acceptance on one GPU, in one device call (about 6 minutes): ranks as processes
# sharing it under MPS, `blink perf --device cuda` per allocation (float32 and bfloat16, 8 B .. 1 GB,
# -c 1), the yardsticks (benchmarks/gpu_reference.py), the small-message probe, the GPU tests, and one
# small summary ($OUT/summary.md) by benchmarks/gpu_summary.py.
#
#   OUT=/tmp/out bash benchmarks/gpu_acceptance.sh
#   STEPS="n2 ops bcast" SIZES="-b 8 -e 64M -f 8" bash benchmarks/gpu_acceptance.sh   # a subset
#
# PACK=1: everything but the summaries and steps.txt goes into one $OUT/logs.tgz (the device tool brings
# back at most 8 files).
#
# BASE=DIR: first, the perf steps BASE_STEPS (default "n2 n8 d8", at BASE_SIZES, default 256 MB and
# 1 GB) run from a copy of the tree whose runtime/gpu/ files are replaced by DIR's (an earlier kernel's
# trees.cu and kernels.py), so that two kernels are compared in one call: $OUT/summary_base.md beside
# $OUT/summary.md.  BASE_ENV: variables for that run (e.g. BLINK_GPU_SM_SHARE=0.5).
#
# BUDGET=S: every step is skipped once fewer than 60 s of S are left, and the GPU tests' limit shrinks
# to fit, so that the summary and the archive are written within S seconds.
set -u
OUT=${OUT:-build/gpu-acceptance}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
if [ -n "${BASE:-}" ]; then
    BASE=$(cd "$BASE" && pwd)
    tree=$(mktemp -d /tmp/blink-base-XXXXXX)
    cp -r blink_horovod benchmarks scripts "$tree/" && cp "$BASE"/* "$tree/blink_horovod/runtime/gpu/"
    # (before this run's MPS daemon: the copy starts and stops its own)
    (cd "$tree" && env ${BASE_ENV:-} OUT="$OUT/base" STEPS="${BASE_STEPS:-n2 n8 d8}" \
        SIZES="${BASE_SIZES:--b 256M -e 1G -f 4}" BASE= PACK= BUDGET= bash benchmarks/gpu_acceptance.sh >/dev/null 2>&1)
    cp "$OUT/base/summary.md" "$OUT/summary_base.md" 2>/dev/null
    rm -rf "$tree"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BLINK_TIMEOUT_SECONDS=${BLINK_TIMEOUT_SECONDS:-60}
export BLINK_PLAN_CACHE=${BLINK_PLAN_CACHE:-/tmp/blink-plans}
BUDGET=${BUDGET:-0}
STEPS=${STEPS:-"ref n2 n4 n8 d4 d8 lat2 lat8 probe2 probe8 tests"}
SIZES=${SIZES:-"-b 8 -e 1G -f 2"}
ITERS=${ITERS:-"-n 5 -w 1"}
START=$(date +%s)
. scripts/mps.sh
mps_start
trap mps_stop EXIT
MPI=(mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x BLINK_TIMEOUT_SECONDS
     -x BLINK_PLAN_CACHE -x BLINK_TOPOLOGY -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY
     -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS)
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/steps.txt"; }
perf() {  # perf NAME RANKS TOPOLOGY LIMIT ARGS...
    local name=$1 n=$2 topo=$3 limit=$4
    shift 4
    [ "$BUDGET" -gt 0 ] && [ "$(left)" -lt "$limit" ] && limit=$(left)
    log "start $name: $n ranks, $topo"
    BLINK_TOPOLOGY=$topo timeout -k 5 "$limit" "${MPI[@]}" -np "$n" python3 -m blink_horovod perf --device cuda \
        --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
    log "rc=$? $name"
}
left() { echo $((BUDGET - 60 - ($(date +%s) - START))); }
want() {  # want STEP: STEPS names it, and the budget (if any) is not nearly spent
    [[ " $STEPS " == *" $1 "* ]] || return 1
    if [ "$BUDGET" -gt 0 ] && [ "$(left)" -lt 10 ]; then log "$1 skipped: the budget of $BUDGET s is nearly spent"; return 1; fi
}
want env && { nvidia-smi; python3 -c "import torch, cupy; print(torch.__version__, cupy.__version__)"; } >"$OUT/env.txt" 2>&1
want ref && { log "start ref"; timeout 120 python3 benchmarks/gpu_reference.py --json "$OUT/ref.json" >"$OUT/ref.log" 2>&1; log "rc=$? ref"; }
want n2 && perf n2 2 hgx-h200:0,1 150 -d float,bfloat16 $SIZES $ITERS -c 1
want n4 && perf n4 4 hgx-h200:0,1,2,3 150 -d float,bfloat16 $SIZES $ITERS -c 1
want n8 && perf n8 8 hgx-h200 180 -d float,bfloat16 $SIZES $ITERS -c 1
want d4 && perf d4 4 dgx1v:0,1,2,3 150 -d float,bfloat16 $SIZES $ITERS -c 1
want d8 && perf d8 8 dgx1v 180 -d float,bfloat16 $SIZES $ITERS -c 1
# The small-message table (8 B .. 1 MB) with as many iterations a size as nccl-tests' latency runs take:
# -n 5 above leaves one host synchronize per five collectives in each row's time.
want lat2 && perf lat2 2 hgx-h200:0,1 90 -d float -b 8 -e 1M -f 2 -n ${LAT_ITERS:-200} -w 20 -c 1
want lat8 && perf lat8 8 hgx-h200 120 -d float -b 8 -e 1M -f 2 -n ${LAT_ITERS:-200} -w 20 -c 1
probe() {  # probe NAME RANKS TOPOLOGY
    log "start $1"
    BLINK_TOPOLOGY=$3 timeout -k 5 90 "${MPI[@]}" -np "$2" python3 benchmarks/gpu_latency_probe.py >"$OUT/$1.log" 2>&1
    log "rc=$? $1"
}
want probe2 && probe probe2 2 hgx-h200:0,1
want probe8 && probe probe8 8 hgx-h200
if want tests; then
    log "start tests"
    limit=${TESTS_LIMIT:-420}
    [ "$BUDGET" -gt 0 ] && [ "$(left)" -lt "$limit" ] && limit=$(left)
    timeout -k 5 "$limit" python3 -m pytest tests/parallel/test_gpu_collectives.py -q -rA -p no:cacheprovider \
        --timeout=400 -o addopts="" ${TESTS_K:+-k "$TESTS_K"} >"$OUT/tests.log" 2>&1
    log "rc=$? tests"
fi
want ops && perf ops 4 hgx-h200:0,1,2,3 120 -d all -o all -b 4 -e 4M -f 32 -n 2 -w 1 -c 1
want bcast && perf bcast 4 hgx-h200:0,1,2,3 120 --collective broadcast -r 1 -d float,bfloat16 $SIZES $ITERS -c 1
python3 benchmarks/gpu_summary.py "$OUT" >"$OUT/summary.md" 2>&1
log "done"
# At most 8 files come back from the device: the summary, the step log and one archive of the rest.
if [ -n "${PACK:-}" ]; then
    (cd "$OUT" && tar czf /tmp/gpu-acceptance-logs.tgz --exclude ./summary.md --exclude ./summary_base.md \
        --exclude ./steps.txt --exclude ./logs.tgz . \
        && find . -type f ! -path ./summary.md ! -path ./summary_base.md ! -path ./steps.txt -delete \
        && find . -mindepth 1 -type d -empty -delete && mv /tmp/gpu-acceptance-logs.tgz logs.tgz)
fi
