#!/usr/bin/env bash
# R2R's router through the skinny kernel on one GPU (issue 12: the router's in-graph cost), as one device call:
# the kernel and router tests compiled, the tuning of the router's float32 shapes (perf/bench_gemm.py --routers:
# writes them into this checkout's table, and a copy into the results), the 0.6B decode step's kernel profile
# without the router, with it on the skinny kernel and with it on cuBLAS (perf/profile_step.py), and the step
# times of the same three in CUDA graphs (perf/bench_runner.py), then routed R2R in process with the router on
# the kernel and on cuBLAS (perf/bench_engine.py; ENGINE= skips it). TUNE=0 skips the tuning (the table has it).
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   bash perf/gpu_router.sh OUT_DIR
# Results: OUT_DIR/results_router.tgz (gpu_tests.log, bench_gemm.log, router_gemm_h200.md, skinny_gemm_tuned.json,
# profile.log, runner_router.json/.md, engine_r2r_{auto,torch}.json/.md).
set -uo pipefail
out=${1:?output directory}
archive=results_router.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
table=backends/tokenrouter/runner/skinny_gemm_tuned.json

step "kernel and router tests, compiled"
# (the router's, and the kernel cases its layers use; the whole of test_skinny_gemm.py compiles for minutes)
timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/test_router_skinny.py tests/test_skinny_gemm.py \
  -k "${TESTS_K:-router or bias or rejects or hopper or deterministic or policy or table or far_from or matches_torch or only_where}" \
  > $res/gpu_tests.log 2>&1
tail -3 $res/gpu_tests.log

if [ "${TUNE:-1}" = 1 ]; then
  step "tune the router's matmuls"
  timeout 240 python3 perf/bench_gemm.py --models '' --routers r2r:qwen3-0.6b --tiles ${TILES:-16,32} --table $table \
    --report $res/router_gemm_h200.md 2>&1 | tee $res/bench_gemm.log | grep -v "^  skip" | tail -16
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ]; then cp $table $res/; else echo "bench_gemm failed (rc $rc): the table is not copied"; fi
fi

step "step profiles"
for batch in ${PROFILE_BATCHES:-8 1}; do
  for args in "" "--router" "--router --router-cublas"; do
    timeout 90 python3 perf/profile_step.py --model qwen3-0.6b --batch $batch $args >> $res/profile.log 2>&1
  done
done
grep -A5 "kernels," $res/profile.log | grep -v "^  *[0-9.]* us"

step "step times in graphs"
timeout 200 python3 perf/bench_runner.py --models qwen3-0.6b --quick --colocate '' --out $res/runner_router.json \
  2>&1 | grep -E "r2r|router" | tail -12

if [ -n "${ENGINE-1}" ]; then
  # Routed R2R in process (Qwen3-0.6B + Qwen3-32B), the router on the kernel and on cuBLAS, side by side; the
  # threshold is the one perf/evaluate.py calibrated to a ~10 % large share on its prompts (2026-12-02).
  python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null 2>&1
  for kernel in auto torch; do
    step "in-process R2R, router_kernel $kernel"
    timeout 240 python3 perf/bench_engine.py --config config/r2r/qwen3-0.6b_qwen3-32b.yaml --variants routed \
      --policy "{name: r2r, threshold: ${THRESHOLD:-0.5341}, router_kernel: $kernel}" --concurrency ${CONC:-8,16} \
      --prompt-len 100 --output-len 256 --isolate on --out-dir $res --name engine_r2r_$kernel 2>&1 \
      | grep -E "^\| routed|tok/s|share" | tail -4
  done
fi
step "done"
