#!/usr/bin/env bash
# R2R's router through the skinny kernel on one GPU (issue 12: the router's in-graph cost), as one device call:
# the kernel and router tests compiled, the tuning of the router's float32 shapes (perf/bench_gemm.py --routers:
# writes them into this checkout's table, and a copy into the results), the 0.6B decode step's kernel profile
# without the router, with it on the skinny kernel and with it on cuBLAS (perf/profile_step.py), and the step
# times of the same three in CUDA graphs (perf/bench_runner.py).
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   bash perf/gpu_router.sh OUT_DIR
# Results: OUT_DIR/results_router.tgz (gpu_tests.log, bench_gemm.log, router_gemm_h200.md, skinny_gemm_tuned.json,
# profile.log, runner_router.json/.md).
set -uo pipefail
out=${1:?output directory}
archive=results_router.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
table=backends/tokenrouter/runner/skinny_gemm_tuned.json

step "kernel and router tests, compiled"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_skinny_gemm.py tests/test_router_skinny.py \
  > $res/gpu_tests.log 2>&1
tail -3 $res/gpu_tests.log

step "tune the router's matmuls"
timeout 240 python3 perf/bench_gemm.py --models '' --routers r2r:qwen3-0.6b --tiles ${TILES:-16,32} --table $table \
  --report $res/router_gemm_h200.md 2>&1 | tee $res/bench_gemm.log | grep -v "^  skip" | tail -16
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ]; then cp $table $res/; else echo "bench_gemm failed (rc $rc): the table is not copied"; fi

step "step profiles"
for batch in 8 1; do
  for args in "" "--router" "--router --router-cublas"; do
    timeout 90 python3 perf/profile_step.py --model qwen3-0.6b --batch $batch $args >> $res/profile.log 2>&1
  done
done
grep -A5 "kernels," $res/profile.log | grep -v "^  *[0-9.]* us"

step "step times in graphs"
timeout 200 python3 perf/bench_runner.py --models qwen3-0.6b --quick --colocate '' --out $res/runner_router.json \
  2>&1 | grep -E "r2r|router|decode b=(1|8|32) " | tail -12
step "done"
