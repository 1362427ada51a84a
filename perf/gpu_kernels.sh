#!/usr/bin/env bash
# Kernel work on one GPU (issue 12), as one device call: the kernel tests compiled, the skinny-matmul tuning
# (perf/bench_gemm.py: writes the tuned table into this checkout, and a copy into the results), then the step
# profiles of the small and large model with skinny matmuls on and off (perf/profile_step.py).
# With RUNNER=1, last: bench_runner on MODELS with skinny matmuls on and off side by side, writing each model's
# step-level row cap into the table (perf/bench_runner.py --skinny-gemm both --layer-caps).
# ROUTERS=r2r:qwen3-0.6b also tunes those router networks' float32 matmuls (a bench_gemm run of their own, so a
# timeout there keeps the models' entries; row tiles ROUTER_TILES, default 16,32), and the runner then measures the
# 0.6B's decode with the router too (gemm_routers.md, runner.md).
# TESTS='' skips the tests, PROFILES=0 the step profiles; TEST_S, TUNE_S, RUNNER_S bound the steps (seconds).
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   bash perf/gpu_kernels.sh OUT_DIR [MODELS]
#   TESTS=tests/test_skinny_gemm.py TILES=16,32,64 RUNNER=1 bash perf/gpu_kernels.sh OUT_DIR qwen3-32b
# Results: OUT_DIR/results_kernels.tgz (gpu_tests.log, bench_gemm.log, gemm_tuned.md, skinny_gemm_tuned.json,
# profile.log).
set -uo pipefail
out=${1:?output directory}
models=${2:-qwen3-0.6b,qwen3-32b}
archive=results_kernels.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
table=backends/tokenrouter/runner/skinny_gemm_tuned.json

tests=${TESTS-tests/test_skinny_gemm.py tests/test_cuda_graph_runner.py}
if [ -n "$tests" ]; then
  step "kernel tests, compiled"
  timeout ${TEST_S:-150} python3 -m pytest -q -x -p no:cacheprovider $tests > $res/gpu_tests.log 2>&1
  tail -3 $res/gpu_tests.log
fi

step "tune the skinny matmuls"
timeout ${TUNE_S:-330} python3 perf/bench_gemm.py --models $models --tiles ${TILES:-16,32,64} --table $table \
  --report $res/gemm_tuned.md 2>&1 | tee $res/bench_gemm.log | grep -v "^  skip" | tail -30
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ]; then cp $table $res/; else echo "bench_gemm failed (rc $rc): the table is not copied"; fi
if [ -n "${ROUTERS:-}" ]; then
  step "tune the routers' matmuls ($ROUTERS)"
  timeout ${TUNE_S:-330} python3 perf/bench_gemm.py --models '' --routers $ROUTERS --tiles ${ROUTER_TILES:-16,32} \
    --table $table --report $res/gemm_routers.md 2>&1 | tee $res/bench_gemm_routers.log | tail -12
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ]; then cp $table $res/; else echo "bench_gemm (routers) failed (rc $rc): not copied"; fi
fi

if [ "${PROFILES:-1}" = 1 ]; then
  step "step profiles"
  for model in ${models//,/ }; do
    extra=(); [ $model = qwen3-0.6b ] && extra=("--router")
    for args in "" "--skinny-gemm off" "${extra[@]}"; do
      timeout 60 python3 perf/profile_step.py --model $model --batch 8 $args >> $res/profile.log 2>&1
    done
  done
  grep -A4 "kernels," $res/profile.log
fi

if [ "${RUNNER:-0}" = 1 ]; then
  step "runner steps, skinny on and off"
  router_case=--no-router; [ -n "${ROUTERS:-}" ] && router_case=""
  timeout ${RUNNER_S:-240} python3 perf/bench_runner.py --models $models --quick $router_case \
    --colocate '' --skinny-gemm both --layer-caps $table --out $res/runner.json > $res/runner.log 2>&1
  echo "bench_runner rc $?"; grep -E "skinny matmuls|decode b=|extend 8x|extend 4x|router" $res/runner.log
  cp $table $res/skinny_gemm_tuned_capped.json
fi
step "done"
