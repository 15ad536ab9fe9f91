# Sourced by the GPU scripts (benchmarks/gpu_*acceptance.sh): ranks that share one GPU run under MPS, or the
# driver time-slices their kernels and every wait for a peer costs a slice.
#
#   mps_start   end what an earlier run left (below), then start the MPS control daemon
#   mps_stop    end this run's rank processes still alive, then the daemon
#
# A job killed at its time limit can leave its ranks attached to the MPS server (spinning kernels
# included): the daemon's "quit" then waits for them, and a daemon left from a killed run refuses the
# next run's clients ("MPS client failed to connect").  So both end such ranks first, and the quit has a
# deadline of its own.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/blink-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/blink-mps-log}
# Python processes of this project's jobs (anchored: a shell whose command line names them is not one)
MPS_RANKS='^([^ ]*/)?python3?(\.[0-9]+)? .*(tests/|benchmarks/|examples/|-m blink_horovod|horovodrun)'

mps_ranks() {  # the PIDs of those that hold the GPU open (a launcher or a harness does not)
    local p
    for p in $(pgrep -f "$MPS_RANKS"); do
        ls -l "/proc/$p/fd" 2>/dev/null | grep -q ' -> /dev/nvidia' && echo "$p"
    done
}

mps_stop() {
    local pids
    pids=$(mps_ranks)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    timeout 15 sh -c 'echo quit | nvidia-cuda-mps-control' >/dev/null 2>&1
    sleep 1
}

mps_start() {
    mps_stop
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && sleep 1
}
