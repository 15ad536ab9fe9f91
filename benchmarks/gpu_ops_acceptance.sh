#!/usr/bin/env bash
# BLINK_ENABLE=1 with CUDA tensors under horovodrun, on a GPU machine without a package registry, in one
# device call.  Ranks are processes sharing the GPU under MPS.  Steps (STEPS, default all but hvdtest):
#
#   build    Horovod 0.28.1 for CUDA tensors from the carried sdist and wheels (scripts/gpu_carry.sh fills
#            .carry/ beforehand, where pip works): scripts/build_horovod.sh, BLINK_HOROVOD_GPU=cuda (NCCL
#            refuses two ranks on one GPU, so the stock side stages CUDA tensors through host memory);
#            then this project (not editable: an editable install asks a registry for setuptools).  The GPU runtime's tests run meanwhile.
#   runtime  tests/parallel/test_gpu_collectives.py -k "${RUNTIME_K:-stages}" (the hierarchical stages on CUDA)
#   exact    tests/parallel/test_ops_torch_cuda.py: 1x2 and 2x2 layouts, exact results, fallback 0
#   faults   tests/integration/test_reliability_servers.py -k cuda: a mismatch, a stall and a dead rank
#            across servers with CUDA tensors, every survivor naming them
#   train    examples/torch_train.py on CUDA, stock and Blink, -np 2 and -np 4 (two servers): weights
#            compared; BLINK_TOPOLOGY unset, so the plan comes from the GPU probe (its log line kept)
#   step     benchmarks/gpu_step_time.py (~100 M parameters), float32 and bfloat16, stock and Blink
#   hvdtest  Horovod's test/parallel/test_torch.py at -np 2, stock and Blink side by side (.carry/hvd-tests);
#            HVDTEST_SHARD=I/N runs the I-th of N shares of it (the suite takes longer than one call there),
#            HVDTEST_JOBS=N all N shares at once, HVDTEST_DONE=DIR (an earlier call's hvdtest*.json) only
#            the tests that have no verdict there; HVDTEST_TIMEOUT a test's limit (default 60 s) and
#            HVDTEST_KEEP=1 keeps every job's per-rank output; REFERENCE_SUITE_TRACE (default
#            test_global_barrier_op) names the tests whose collectives every rank traces; then the tests
#            whose verdicts differ run again alone, one job per test and side (HVDTEST_ALONE=0: not)
#
#   OUT=/tmp/out STEPS="build exact" bash benchmarks/gpu_ops_acceptance.sh
#
# Steps run in the order STEPS names them (build first: it starts in the background).  BUDGET=S: a step
# that would start later than S - 60 s after the start is skipped and said so, so that the logs are
# always packed before the caller's own limit.  FAULTS_K narrows the fault cases (pytest -k, default cuda).
#
# Writes $OUT/summary.md (benchmarks/gpu_ops_summary.py), one log per step, and each exact and fault
# job's whole output ($OUT/jobs), packed into $OUT/logs.tgz.
set -u
OUT=${OUT:-build/gpu-ops-acceptance}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
START=$(date +%s)
STEPS=${STEPS:-"build runtime exact faults train step"}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export BLINK_TIMEOUT_SECONDS=${BLINK_TIMEOUT_SECONDS:-60} BLINK_PLAN_CACHE=${BLINK_PLAN_CACHE:-/tmp/blink-plans}
export HOROVOD_GLOO_TIMEOUT_SECONDS=120
. scripts/mps.sh
mps_start
trap mps_stop EXIT
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/steps.txt"; }
BUDGET=${BUDGET:-0}
in_time() {  # in_time STEP: false (and logged) once the budget leaves under a minute
    if [ "$BUDGET" -gt 0 ] && [ $(($(date +%s) - START)) -gt $((BUDGET - 60)) ]; then
        log "$1 skipped: the budget of $BUDGET s is nearly spent"
        return 1
    fi
}
cap() {  # cap SECONDS: SECONDS, or less where the budget leaves less (a minute kept for the packing)
    local left=$((BUDGET - 60 - ($(date +%s) - START)))
    if [ "$BUDGET" -gt 0 ] && [ "$left" -lt "$1" ]; then echo $((left > 10 ? left : 10)); else echo "$1"; fi
}
# NCCL of the nvidia-nccl wheel at run time (Horovod links it where it was built with NCCL).
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step_build() {
    log "start build"
    # A Horovod packed by an earlier call (.carry/horovod-gpu-prebuilt.tgz, valid for this image's torch)
    # saves the build; otherwise build, and pack the result for the next call ($OUT/horovod-gpu-prebuilt.tgz).
    ( export BLINK_HOROVOD_GPU=${HOROVOD_GPU_MODE:-cuda} PY=python3
      if BLINK_CARRY=.carry bash scripts/horovod_prebuilt.sh unpack .carry/horovod-gpu-prebuilt.tgz >"$OUT/build.log" 2>&1; then
          echo "rc=0 (prebuilt)" >>"$OUT/build.log"
      else
          BLINK_CARRY=.carry BLINK_BUILD_JOBS=14 BLINK_HOROVOD_MPI=${BLINK_HOROVOD_MPI:-0} \
              BLINK_BUILD_DIR=/tmp/hvd-build bash scripts/build_horovod.sh >>"$OUT/build.log" 2>&1
          rc=$?
          echo "rc=$rc" >>"$OUT/build.log"
          [ $rc = 0 ] && bash scripts/horovod_prebuilt.sh pack "$OUT/horovod-gpu-prebuilt.tgz" >>"$OUT/build.log" 2>&1
      fi
      # not editable: setup.py's develop step runs pip with build isolation, which needs a registry
      python3 -m pip install -q --no-deps --no-build-isolation . >>"$OUT/build.log" 2>&1
      echo "blink install rc=$?" >>"$OUT/build.log" ) &
    BUILD_PID=$!
}
BUILD_PID=
wait_build() {  # the steps that need Horovod wait for its build
    [ -n "$BUILD_PID" ] || return 0
    wait "$BUILD_PID"
    BUILD_PID=
    log "build: $(grep -E '^rc=|^blink install' "$OUT/build.log" | tr '\n' ' '); $(python3 -c 'import horovod.torch as h; print("cuda_built", h.cuda_built(), "nccl_built", h.nccl_built())' 2>&1 | tail -1)"
}
step_runtime() {  # needs no Horovod: runs while it compiles
    log "start runtime"
    PYTHONPATH=$PWD timeout -k 5 300 python3 -m pytest tests/parallel/test_gpu_collectives.py -q -p no:cacheprovider \
        -o addopts="" --timeout=280 -k "${RUNTIME_K:-stages}" >"$OUT/runtime.log" 2>&1
    log "rc=$? runtime"
}
step_exact() {
    wait_build
    log "start exact"
    JOB_LOG_DIR="$OUT/jobs" timeout -k 5 $(cap 400) python3 -m pytest tests/parallel/test_ops_torch_cuda.py -q -p no:cacheprovider -o addopts="" \
        --timeout=380 -rA >"$OUT/exact.log" 2>&1
    log "rc=$? exact"
}
step_faults() {
    wait_build
    log "start faults"
    RELIABILITY_JSON="$OUT/faults.json" JOB_LOG_DIR="$OUT/jobs" timeout -k 5 $(cap 400) python3 -m pytest tests/integration/test_reliability_servers.py \
        -q -p no:cacheprovider -o addopts="" --timeout=200 -rA -k "${FAULTS_K:-cuda}" >"$OUT/faults.log" 2>&1
    log "rc=$? faults"
}
train() {  # train NAME BLINK ARGS...
    local name=$1 blink=$2
    shift 2
    in_time "train $name" || return
    log "start train $name"
    env -u BLINK_TOPOLOGY BLINK_ENABLE=$blink BLINK_LOG_LEVEL=info timeout -k 5 $(cap 180) horovodrun "$@" \
        python3 tests/parallel/ops_workers/with_stats.py examples/torch_train.py --device cuda --steps 15 \
        --save "$OUT/w_$name.npz" >"$OUT/train_$name.log" 2>&1
    log "rc=$? train $name"
}
step_train() {
    wait_build
    train np2_stock 0 -np 2 -H localhost:2 --gloo
    train np2_blink 1 -np 2 -H localhost:2 --gloo
    train np4_stock 0 -np 4 -H localhost:2,127.0.0.1:2 --gloo
    train np4_blink 1 -np 4 -H localhost:2,127.0.0.1:2 --gloo
}
step_step() {
    wait_build
    local k name
    for dt in float32 bfloat16; do
        # STEP_IMPLS: 0 stock, 1 Blink, share Blink with
        # BLINK_GPU_SM_SHARE=${STEP_SHARE:-1} (e.g. "1 share": stock measured before).  STEP_RUNS=K: each K
        # times (an intermittent stall is counted; the first run's log is step_DT_IMPL.log, then .2, .3, ...)
        for impl in ${STEP_IMPLS:-0 1}; do
            for k in $(seq 1 "${STEP_RUNS:-1}"); do
                name=step_${dt}_$impl$([ "$k" -gt 1 ] && echo ".$k")
                in_time "$name" || continue
                log "start $name"
                env BLINK_ENABLE=$([ "$impl" = 0 ] && echo 0 || echo 1) \
                    $([ "$impl" = share ] && echo "BLINK_GPU_SM_SHARE=${STEP_SHARE:-1}") \
                    timeout -k 5 $(cap 200) horovodrun -np 2 -H localhost:2 --gloo \
                    python3 benchmarks/gpu_step_time.py --dtype $dt ${STEP_DUMP:+--dump-after $STEP_DUMP} \
                    >"$OUT/$name.log" 2>&1
                log "rc=$? $name"
            done
        done
    done
}
HVDTEST_SHA256=2d59e8dbc4b8af50f4830312709bd305d1989b6f4c2519c5a2e447d64da4496a
step_hvdtest() {
    wait_build
    if [ ! -f .carry/hvd-tests/parallel/test_torch.py ]; then
        log "hvdtest skipped: no .carry/hvd-tests/parallel/test_torch.py (copy Horovod's test/parallel/test_torch.py and test/utils/common.py to .carry/hvd-tests/{parallel,utils} first)"
        return
    fi
    # the copy whose verdicts docs/integration.md reports (section 4): say whether this one is it
    local sum
    sum=$(sha256sum .carry/hvd-tests/parallel/test_torch.py | cut -c1-64)
    [ "$sum" = "$HVDTEST_SHA256" ] && log "hvdtest: test_torch.py is the documented copy" \
        || log "hvdtest: test_torch.py sha256 $sum is not the documented copy's $HVDTEST_SHA256"
    # Horovod's test/utils/common.py imports mock, which the GPU machine lacks: the carried wheel
    python3 -c "import mock" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .carry/mock-*.whl \
        >>"$OUT/steps.txt" 2>&1
    # Stock and Blink side by side (each suite takes several minutes there: every test is an hvd.init).
    # HVDTEST_JOBS=N runs N interleaved shares of each side at once (2N horovodrun jobs, 4N ranks on the
    # one GPU); HVDTEST_DONE=DIR takes the verdicts of an earlier call's hvdtest*.json there as they are,
    # so that only the tests without one run.
    in_time hvdtest || return
    # the one timing-sensitive test: when each rank left the allreduce and the barrier (per-rank logs)
    export REFERENCE_SUITE_TRACE=${REFERENCE_SUITE_TRACE-test_global_barrier_op}
    local limit jobs=${HVDTEST_JOBS:-1} pids=() done_args=() shares=("${HVDTEST_SHARD:-}") share name f i
    limit=$(cap ${HVDTEST_LIMIT:-480})
    if [ "$jobs" -gt 1 ]; then
        shares=()
        for ((i = 0; i < jobs; i++)); do shares+=("$i/$jobs"); done
    fi
    for blink in "" "--blink"; do
        # this side's files only (hvdtest.json, hvdtest_IofN.json or hvdtest_blink*.json): --done refuses the other's
        done_args=()
        if [ -n "${HVDTEST_DONE:-}" ]; then
            for f in "$HVDTEST_DONE/hvdtest${blink:+_blink}.json" "$HVDTEST_DONE"/hvdtest${blink:+_blink}_[0-9]*.json; do
                [ -f "$f" ] && done_args+=(--done "$f")
            done
        fi
        for share in "${shares[@]}"; do
            name="hvdtest${blink:+_blink}${share:+_${share/\//of}}"
            log "start $name"
            ( hvdref "$name" "$limit" $blink --deadline $((limit - 15)) ${share:+--shard "$share"} "${done_args[@]}"
              log "rc=$? $name" ) &
            pids+=($!)
        done
    done
    wait "${pids[@]}"
    # The tests whose verdicts differ run again, one job per test and side, stock then Blink, with nothing
    # else on the machine (HVDTEST_ALONE=0: not): a verdict that the shares' load decided shows as such.
    local names only=()
    names=$(python3 benchmarks/gpu_ops_summary.py --differing "$OUT")
    [ "${HVDTEST_ALONE:-1}" = 1 ] && [ -n "$names" ] && in_time hvdtest_alone || return 0
    for name in $names; do only+=(--only "$name"); done
    for blink in "" "--blink"; do
        name="alone${blink:+_blink}"
        log "start $name: $(echo $names)"
        hvdref "$name" "$(cap $((${#only[@]} / 2 * 40 + 30)))" $blink --per-test "${only[@]}"  # 40 s a test
        log "rc=$? $name"
    done
}
hvdref() {  # hvdref NAME LIMIT ARGS...: Horovod's test_torch.py at -np 2 (ops_reference_suite.py), $OUT/NAME.json
    local name=$1 limit=$2
    shift 2
    timeout -k 5 "$limit" python3 tests/parallel/ops_reference_suite.py \
        --suite .carry/hvd-tests/parallel/test_torch.py -np 2 -H localhost:2 --controller=--gloo \
        --horovodrun "$(command -v horovodrun)" --test-timeout ${HVDTEST_TIMEOUT:-60} --timeout-method thread \
        ${HVDTEST_KEEP:+--keep-logs "$OUT/ranks/$name"} --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
}
for s in $STEPS; do
    declare -F "step_$s" >/dev/null || { log "unknown step $s (build runtime exact faults train step hvdtest)"; continue; }
    in_time "$s" && "step_$s"
done
wait_build
python3 benchmarks/gpu_ops_summary.py "$OUT" >"$OUT/summary.md" 2>&1
log "done"
# At most 8 files come back from the device: the summary, the step log, one archive of the rest and
# the Horovod pack (copy it to .carry/ for the next call).
(cd "$OUT" && tar czf /tmp/gpu-ops-logs.tgz --exclude summary.md --exclude steps.txt --exclude horovod-gpu-prebuilt.tgz . \
    && find . -type f ! -name summary.md ! -name steps.txt ! -name horovod-gpu-prebuilt.tgz -delete \
    && mv /tmp/gpu-ops-logs.tgz logs.tgz)
# A pack over what comes back from the device (16 MB a file) would not: say so instead.
[ -f "$OUT/horovod-gpu-prebuilt.tgz" ] && [ "$(stat -c %s "$OUT/horovod-gpu-prebuilt.tgz")" -gt 16000000 ] \
    && { log "horovod-gpu-prebuilt.tgz is $(du -h "$OUT/horovod-gpu-prebuilt.tgz" | cut -f1): too large to come back"; \
         rm -f "$OUT/horovod-gpu-prebuilt.tgz"; }
