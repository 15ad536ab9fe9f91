#!/usr/bin/env bash
# Diagnosis: fused-kernel bandwidth at large sizes vs the cap on blocks per group (fused.blocks_per_group).
# Edits the cap in this (device-side) copy of the tree between runs.  run(command="bash benchmarks/gpu_blocks_probe.sh")
export CUDA_MPS_PIPE_DIRECTORY=/tmp/blink-mps CUDA_MPS_LOG_DIRECTORY=/tmp/blink-mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; sleep 1
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 BLINK_TIMEOUT_SECONDS=60
MPI=(mpirun --oversubscribe --bind-to none -x PYTHONPATH -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x BLINK_TIMEOUT_SECONDS)
for cap in ${CAPS:-16 64 128}; do
  sed -i "s/^def blocks_per_group(ngroups: int, ranks_on_device: int, sms: int, cap: int = [0-9]*)/def blocks_per_group(ngroups: int, ranks_on_device: int, sms: int, cap: int = $cap)/" blink_horovod/runtime/gpu/fused.py
  [ -n "${FACTOR:-}" ] && sed -i "s/(2 \* sms) \/\/ max(1, ngroups/($FACTOR * sms) \/\/ max(1, ngroups/" blink_horovod/runtime/gpu/fused.py
  for np in ${NPS:-2 4}; do
    echo "== cap $cap np $np"
    timeout 120 "${MPI[@]}" -np $np python3 benchmarks/gpu_perf.py -c 1 -w 2 --flag-ops fused --topology dgx1v \
      -b ${B:-64M} -e ${E:-1G} -f 4 -n ${N:-5} --dtype float32 2>&1 | grep -E "^ +[0-9]|#wrong|rror" | tail -6
  done
done 2>&1 | tee $OUT/blocks.txt
echo quit | nvidia-cuda-mps-control
