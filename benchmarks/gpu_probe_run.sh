#!/usr/bin/env bash
# The GPU session's one device call: probes, GPU tests and benchmarks at 2, 4 and 8 ranks sharing the GPU.
#
#   run(command="bash benchmarks/gpu_probe_run.sh", timeout_s=600)
#
# Everything lands in $OUT (summary.txt first: one line per step with its exit
# status and the elapsed time). Steps run most important first, each under its
# own time limit, so that the whole stays inside one 600 s call; a step that
# fails does not stop the others. Nothing here needs the network, horovod or cvxpy
# (plans come precomputed from benchmarks/gpu_plans).
set -u
OUT=${OUT:-/tmp/blink-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The GPU machines' rules (shared/reference/gpu-machine-facts.md): never multicast/NVLS.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BLINK_TIMEOUT_SECONDS=${BLINK_TIMEOUT_SECONDS:-60}
START=$(date +%s)
BUDGET=${BUDGET:-575}
PY=${PY:-python3}
MPI=(mpirun --oversubscribe --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS -x BLINK_TIMEOUT_SECONDS)

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 l rc
    shift 2
    l=$(left)
    if [ "$l" -lt 15 ]; then echo "skip  $name (budget spent)" >>"$OUT/summary.txt"; return; fi
    [ "$limit" -gt "$l" ] && limit=$l
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "rc=$rc $name (limit ${limit}s) at $(($(date +%s) - START))s" >>"$OUT/summary.txt"
}

{
    date -u; nvidia-smi; nvidia-smi topo -m
    $PY -c "import cupy, cuda.bindings, numpy, mpi4py; print('cupy', cupy.__version__, 'numpy', numpy.__version__); print(cupy.cuda.runtime.getDeviceProperties(0)['name'])"
    $PY -m pip list 2>/dev/null | grep -i -E "cupy|cuda|numpy|mpi4py|nvrtc"
} >"$OUT/env.txt" 2>&1

# 1. The primitives the design rests on: cross-process waits/writes on one GPU, in and out of graphs.
step pingpong 45 $PY benchmarks/gpu_pingpong.py --json "$OUT/pingpong.json"
# 2. Correctness and speed, every dtype, 4 B .. 1 GB, -c 1, at 2, 4 and 8 ranks (DGX-1V plans: many trees/lanes).
step perf-n2-allreduce 80 "${MPI[@]}" -np 2 $PY benchmarks/gpu_perf.py -b 4 -e 1G -f 4 -c 1 --dtype all -n 5 -w 2 \
    --topology dgx1v --json "$OUT/perf-n2-allreduce.json" --time-limit 65
step perf-n4-allreduce 90 "${MPI[@]}" -np 4 $PY benchmarks/gpu_perf.py -b 4 -e 1G -f 4 -c 1 --dtype all -n 5 -w 2 \
    --topology dgx1v --json "$OUT/perf-n4-allreduce.json" --time-limit 75
step perf-n8-allreduce 110 "${MPI[@]}" -np 8 $PY benchmarks/gpu_perf.py -b 4 -e 1G -f 4 -c 1 --dtype all -n 5 -w 2 \
    --topology dgx1v --json "$OUT/perf-n8-allreduce.json" --time-limit 95
# 3. The GPU tests (exact results per dtype/op/collective, back-to-back, host time vs chunks, killed rank).
step gputests 130 $PY -m pytest -q -p no:cacheprovider -rs -s tests/parallel/test_gpu_collectives.py
# 4. Broadcast, the HGX H200 plans, and whether `blink perf --device cuda` is wired yet.
step perf-n8-broadcast 40 "${MPI[@]}" -np 8 $PY benchmarks/gpu_perf.py -b 4 -e 1G -f 16 -c 1 --collective broadcast \
    --dtype float32 -n 5 -w 2 --topology dgx1v --json "$OUT/perf-n8-broadcast.json" --time-limit 30
step perf-n8-hgx 40 "${MPI[@]}" -np 8 $PY benchmarks/gpu_perf.py -b 4 -e 1G -f 16 -c 1 --dtype float32 -n 5 -w 2 \
    --topology hgx-h200 --json "$OUT/perf-n8-hgx.json" --time-limit 30
step blinkperf 25 "${MPI[@]}" -np 2 $PY -m blink_horovod perf --device cuda -b 4 -e 1M -f 4 -c 1
# 5. The pure tests on this machine's Python (3.12, numpy 2.5) if time is left.
step unit 40 $PY -m pytest -q -p no:cacheprovider -x tests/unit/test_gpu_lowering.py tests/unit/test_gpu_kernels.py -k "not sm90"
echo "done at $(($(date +%s) - START))s" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
