#!/usr/bin/env bash
# Two models sharing one GPU (issue 11): perf/bench_corun.py in one process (streams, priority, cuBLAS SM
# carve-out) and in two processes under CUDA MPS (the served layout; the large model's process limited to a
# share of the SMs), as one device call.
# Usage (repository root, on the GPU machine, its image's Python as it is): bash perf/gpu_corun.sh OUT_DIR
# Results: OUT_DIR/results_corun.tgz (corun.json, corun_mps.json, corun.log).
set -uo pipefail
out=${1:?output directory}
archive=results_corun.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
step "in one process"
timeout ${INPROC_S:-300} python3 perf/bench_corun.py --variants ${VARIANTS:-plain,small_high,small_cublas,carveout8,carveout16,carveout32} \
  --out $res/corun.json 2>&1 | tee $res/corun.log | grep -v "^\[\|Warning"
step "two processes under MPS"
timeout ${MPS_S:-200} python3 perf/bench_corun.py --mps ${MPS:-100,90,80,70,50} --out $res/corun_mps.json 2>&1 \
  | tee -a $res/corun.log | grep -v "^\[\|Warning"
echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
step "done"
