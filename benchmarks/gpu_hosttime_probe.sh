#!/usr/bin/env bash
# Diagnosis of the GPU host time (tests/parallel/gpu_rank.py hosttime) under MPS: spin policy x mode x binding.
#   run(command="bash benchmarks/gpu_hosttime_probe.sh")
# CFGS: SPIN_MODE_BIND items; MODE back (back to back), idle (device drained first) or spinMS (drained, then
# the host spins MS ms before each call); COUNTS: chunks per tree; BLINK_GPU_LAUNCH passes through.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/blink-mps CUDA_MPS_LOG_DIRECTORY=/tmp/blink-mps-log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; sleep 1
export PYTHONPATH=$PWD BLINK_GPU_FLAGS=fused
for cfg in ${CFGS:-0.05_back_0 0_back_0 0.05_idle_0 2.0_back_0}; do set -- ${cfg//_/ }; echo "== spin $1 $2 bind $3"; BLINK_TEST_BIND=$3 BLINK_TEST_SPIN_S=$1 timeout 150 python3 -c "
import sys,json; sys.path.insert(0,'tests/parallel')
from test_gpu_collectives import run_ranks
outs=run_ranks(4,'hosttime','100','${COUNTS:-16,64,256}','$2',timeout=140)
r=outs[0]
if 'hosttime' not in r: print(r); sys.exit()
for row in r['hosttime']: print({k:round(v,1) if isinstance(v,float) else v for k,v in row.items() if 'nogc' not in k})
"; done 2>&1 | tee $OUT/probe.txt
echo quit | nvidia-cuda-mps-control
