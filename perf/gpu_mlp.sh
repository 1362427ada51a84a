#!/usr/bin/env bash
# The one-kernel MLP (runner/fused_mlp.py) on one GPU, one device call: its tests compiled (the grid barrier runs
# only there), the kernel against the skinny path's two launches over a grid of configs (perf/bench_mlp.py, whose
# best config per model goes into this checkout's table, copied into the results: commit it), then the 0.6B's
# decode step with the one-kernel MLP off and as the table decides (perf/bench_runner.py, each in its own process).
# A GPU the table has no skinny entries for (an H100) first tunes the 0.6B's matmuls (perf/bench_gemm.py, tile 16):
# without them the model runs on cuBLAS and neither path is taken.
# Usage (repository root, on the GPU machine, its image's Python as it is; MODES="" skips the decode steps):
#   bash perf/gpu_mlp.sh OUT_DIR
# Results: OUT_DIR/results_mlp.tgz (gpu_tests.log, mlp.json/.md, runner_mlp_{off,auto}.json/.md/.log,
# skinny_gemm_tuned.json).
set -uo pipefail
out=${1:?output directory}
archive=results_mlp.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
table=backends/tokenrouter/runner/skinny_gemm_tuned.json
python3 -c 'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'

if ! python3 -c "import json, sys, torch; sys.exit(torch.cuda.get_device_name(0) not in json.load(open('$table')))"; then
  step "this GPU is not in the table: tune the 0.6B's skinny matmuls (tile 16)"
  timeout ${TUNE_S:-200} python3 perf/bench_gemm.py --models qwen3-0.6b --tiles 16 --table $table \
    --report $res/gemm_tuned.md > $res/gemm_tuned.log 2>&1
  echo "bench_gemm exit code $?"; tail -8 $res/gemm_tuned.log
fi

step "the one-kernel MLP's tests, compiled"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_fused_mlp.py > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log
tail -3 $res/gpu_tests.log

step "the kernel against two skinny launches"
timeout ${MLP_S:-200} python3 perf/bench_mlp.py --models qwen3-0.6b --rows ${ROWS:-1,4,8,16} ${PHASES:+--phases} --table $table \
  --out $res/mlp.json 2>&1 | tail -12
cp $table $res/

for mode in ${MODES-off auto}; do
  step "the 0.6B's decode step, one-kernel MLP $mode"
  setting=$([ $mode = off ] && echo 0 || echo auto)
  TOKENROUTER_FUSED_MLP=$setting timeout ${RUNNER_S:-110} python3 perf/bench_runner.py --models qwen3-0.6b --quick \
    --decode-only --no-router --colocate '' ${PROFILE:+--profile} --out $res/runner_mlp_$mode.json 2>&1 \
    | grep -E "decode b=|loaded|Kernels" | tee $res/runner_mlp_$mode.log | grep -v "ctx= 8192"
done
step "done"
