#!/usr/bin/env bash
# A GPU session's device call, second form: the same steps as gpu_probe_run.sh plus ranks as threads of one
# process (no time-slicing between contexts), an MPS attempt, rank-0 profiles, and everything packed into
# $OUT/results.tar.gz (the device tool returns at most 8 files).
#
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
#
# STEPS (default: all) picks steps by name, e.g. STEPS="env threads-n2 procs-n2".
set -u
OUT=${OUT:-/tmp/blink-gpu-out}
R="$OUT/r"
mkdir -p "$R"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BLINK_TIMEOUT_SECONDS=${BLINK_TIMEOUT_SECONDS:-60}
START=$(date +%s)
BUDGET=${BUDGET:-520}
STEPS=${STEPS:-all}
PY=${PY:-python3}
MPI=(mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE
     -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x BLINK_TIMEOUT_SECONDS)
PERF=(benchmarks/gpu_perf.py -c 1 -w 2)

# MPS=1: run every step as a client of one MPS server (started here, stopped at exit): processes
# sharing the GPU then run concurrently instead of time-sliced.
if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/blink-mps CUDA_MPS_LOG_DIRECTORY=/tmp/blink-mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && sleep 1
    MPI+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
    MPS_ON=1
fi
[ -n "${BLINK_GPU_FLAGS:-}" ] && MPI+=(-x BLINK_GPU_FLAGS)
[ -n "${BLINK_GPU_LAUNCH:-}" ] && MPI+=(-x BLINK_GPU_LAUNCH)
left() { echo $((BUDGET - ($(date +%s) - START))); }
want() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 l rc
    shift 2
    want "$name" || return 0
    l=$(left)
    if [ "$l" -lt 15 ]; then echo "skip  $name (budget spent)" >>"$R/summary.txt"; return; fi
    [ "$limit" -gt "$l" ] && limit=$l
    if declare -F "$1" >/dev/null; then  # a shell function: timeout runs programs only
        export -f "$1"
        timeout -k 5 "$limit" bash -c "$(printf '%q ' "$@")" >"$R/$name.log" 2>&1
    else
        timeout -k 5 "$limit" "$@" >"$R/$name.log" 2>&1
    fi
    rc=$?
    echo "rc=$rc $name (limit ${limit}s) at $(($(date +%s) - START))s" >>"$R/summary.txt"
}
pack() {
    if [ "${MPS_ON:-0}" = 1 ]; then
        echo quit | nvidia-cuda-mps-control; sleep 1
        tail -30 "$CUDA_MPS_LOG_DIRECTORY"/*.log >"$R/mps-logs.txt" 2>&1
    fi
    tar -czf "$OUT/results.tar.gz" -C "$OUT" r; cp "$R/summary.txt" "$OUT/summary.txt"
}
trap pack EXIT

envinfo() {
    date -u; uname -a; nvidia-smi; nvidia-smi -q | grep -i -E "compute mode|mig mode|virtualization|persistence" -A1
    ls -l "$(command -v nvidia-cuda-mps-control 2>/dev/null || echo /nonexistent)" 2>&1
    python3 -c "import cupy, cuda.bindings, numpy, mpi4py; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
}
step env 20 envinfo
# Cross-process signalling on one GPU: stream memory operations vs one-thread kernels.
step pingpong-memop 30 $PY benchmarks/gpu_pingpong.py --flag-ops memop --json "$R/pingpong-memop.json"
step pingpong-kernel 40 $PY benchmarks/gpu_pingpong.py --flag-ops kernel --json "$R/pingpong-kernel.json"
# Ranks as threads of one process: one CUDA context, no time-slicing: what the executor itself costs.
step threads-n2 50 $PY "${PERF[@]}" --threads 2 -b 4 -e 1G -f 4 -n 10 --dtype float32 --topology dgx1v \
    --json "$R/threads-n2.json" --time-limit 40
step threads-n8 90 $PY "${PERF[@]}" --threads 8 -b 4 -e 1G -f 4 -n 5 --dtype all --topology dgx1v \
    --json "$R/threads-n8.json" --time-limit 75
step threads-n4 45 $PY "${PERF[@]}" --threads 4 -b 4 -e 1G -f 4 -n 5 --dtype all --topology dgx1v \
    --json "$R/threads-n4.json" --time-limit 35
# Processes (the issue's form): contexts time-sliced by the driver; memop vs kernel flags.
step procs-n2-memop 40 "${MPI[@]}" -np 2 $PY "${PERF[@]}" -b 4 -e 1G -f 4 -n 10 --dtype float32 --topology dgx1v \
    --flag-ops memop --json "$R/procs-n2-memop.json" --time-limit 30
step procs-n2-kernel 40 "${MPI[@]}" -np 2 $PY "${PERF[@]}" -b 4 -e 1G -f 4 -n 10 --dtype float32 --topology dgx1v \
    --flag-ops kernel --json "$R/procs-n2-kernel.json" --time-limit 30
# MPS (if the machine has it): processes as clients of one server context.
mps() {
    command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control"; return 3; }
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/blink-mps CUDA_MPS_LOG_DIRECTORY=/tmp/blink-mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d || return 4
    sleep 1
    mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x CUDA_MPS_PIPE_DIRECTORY \
        -x CUDA_MPS_LOG_DIRECTORY -np 2 python3 benchmarks/gpu_perf.py -c 1 -w 2 -b 4 -e 64M -f 4 -n 10 \
        --dtype float32 --topology dgx1v --flag-ops kernel --json /tmp/mps-n2.json --time-limit 25
    local rc=$?
    echo quit | nvidia-cuda-mps-control
    sleep 1
    tail -20 $CUDA_MPS_LOG_DIRECTORY/*.log 2>/dev/null
    return $rc
}
step mps 45 mps
cp /tmp/mps-n2.json "$R/" 2>/dev/null
step gputests 100 $PY -m pytest -v -p no:cacheprovider -rs -s tests/parallel/test_gpu_collectives.py \
    -k "killed or host_time"
step threads-bcast 25 $PY "${PERF[@]}" --threads 8 -b 4 -e 1G -f 16 -n 5 --collective broadcast --dtype float32 \
    --topology dgx1v --json "$R/threads-bcast.json" --time-limit 20
step threads-hgx 25 $PY "${PERF[@]}" --threads 8 -b 4 -e 1G -f 16 -n 5 --dtype float32 --topology hgx-h200 \
    --json "$R/threads-hgx.json" --time-limit 20
# The whole program as one kernel (BLINK_GPU_FLAGS=fused; meant for MPS=1).
FUSED=(--flag-ops fused --topology dgx1v)
step fused-smoke 60 "${MPI[@]}" -np 2 $PY "${PERF[@]}" "${FUSED[@]}" -b 4 -e 4M -f 8 -n 50 --dtype float32 --profile 4,4194304 \
    --json "$R/fused-smoke.json" --time-limit 40
step fused-n2 110 "${MPI[@]}" -np 2 $PY "${PERF[@]}" "${FUSED[@]}" -b 4 -e 1G -f 4 -n 10 --dtype "${DTYPES:-all}" \
    --json "$R/fused-n2.json" --time-limit 95
step kernel-n2 60 "${MPI[@]}" -np 2 $PY "${PERF[@]}" --flag-ops kernel --topology dgx1v -b 4 -e 1G -f 4 -n 10 \
    --dtype float32 --json "$R/kernel-n2.json" --time-limit 45
step fused-n4 130 "${MPI[@]}" -np 4 $PY "${PERF[@]}" "${FUSED[@]}" -b 4 -e 1G -f 4 -n 10 --dtype "${DTYPES:-all}" \
    --json "$R/fused-n4.json" --time-limit 110
step fused-n8 160 "${MPI[@]}" -np 8 $PY "${PERF[@]}" "${FUSED[@]}" -b 4 -e 1G -f 4 -n 5 --dtype "${DTYPES:-all}" \
    --json "$R/fused-n8.json" --time-limit 140
step fused-bcast-n8 60 "${MPI[@]}" -np 8 $PY "${PERF[@]}" "${FUSED[@]}" --collective broadcast -b 4 -e 1G -f 16 \
    -n 5 --dtype float32 --json "$R/fused-bcast-n8.json" --time-limit 45
# Host time vs chunk count (acceptance: <= 20 us at 1..256 chunks), fused programs launched as a graph and by
# cuLaunchKernel, at 2, 4 and 8 ranks (64 MB, so the device is not the bottleneck of a 5-call window).
for nr in 2 4 8; do
    for how in graph kernel; do
        step host-n$nr-$how 60 "${MPI[@]}" -np $nr $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch $how -e 64M -n 40 \
            --chunk-counts 1,2,4,8,16,32,64,128,256 --dtype float32 --json "$R/host-n$nr-$how.json" --time-limit 45
    done
done
step fused-tests 300 env BLINK_GPU_FLAGS=fused $PY -m pytest -v -p no:cacheprovider -rs -s \
    tests/parallel/test_gpu_collectives.py ${TESTS_K:+-k "$TESTS_K"}
# Persistent launches (BLINK_GPU_LAUNCH=persistent): host time, bandwidth and #wrong, and the GPU tests.
step persist-smoke 60 "${MPI[@]}" -np 2 $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch persistent -b 4 -e 64M -f 8 -n 20 \
    --dtype float32 --json "$R/persist-smoke.json" --time-limit 40
for nr in 2 4 8; do
    step host-n$nr-persistent 60 "${MPI[@]}" -np $nr $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch persistent -e 64M \
        -n 40 --chunk-counts 1,2,4,8,16,32,64,128,256 --dtype float32 --json "$R/host-n$nr-persistent.json" --time-limit 45
    step persist-n$nr 130 "${MPI[@]}" -np $nr $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch persistent -b 4 -e 1G -f 4 \
        -n 10 --dtype "${DTYPES:-all}" --json "$R/persist-n$nr.json" --time-limit 110
done
# Small-message latency, the one-node graph launch against the persistent kernel, same sizes.
# lat-n2-*-sleep: the same with the executor's waits sleeping instead of spinning.
for how in graph persistent; do
    step lat-n2-$how 40 "${MPI[@]}" -np 2 $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch $how -b 4 -e 1M -f 16 -n 100 \
        --dtype float32 --json "$R/lat-n2-$how.json" --time-limit 30
    step lat-n2-$how-sleep 40 "${MPI[@]}" -np 2 $PY "${PERF[@]}" "${FUSED[@]}" --fused-launch $how -b 4 -e 1M -f 16 \
        -n 100 --spin-s 0 --dtype float32 --json "$R/lat-n2-$how-sleep.json" --time-limit 30
done
# what one GPU read of mapped host memory costs (the small-message suspect, docs/gpu-runtime.md)
step mapped-probe 40 $PY benchmarks/gpu_mapped_probe.py --json "$R/mapped-probe.json"
step persist-tests 300 env BLINK_GPU_FLAGS=fused BLINK_GPU_LAUNCH=persistent $PY -m pytest -v -p no:cacheprovider -rs -s \
    tests/parallel/test_gpu_collectives.py ${TESTS_K:+-k "$TESTS_K"}
step threads-fused 45 $PY "${PERF[@]}" --threads 2 --flag-ops fused --topology dgx1v -b 4 -e 64M -f 8 -n 10 \
    --dtype float32 --json "$R/threads-fused.json" --time-limit 30
echo "done at $(($(date +%s) - START))s" >>"$R/summary.txt"
cat "$R/summary.txt"
