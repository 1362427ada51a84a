#!/usr/bin/env bash
# A runner change side by side with a baseline tree on one GPU, one device call: each model's steps
# (perf/bench_runner.py --profile: steps and the b8 decode kernel breakdown; this checkout's copy of the benchmark
# against each tree's runner), the small model stepping beside the large one (perf/bench_corun.py plain and
# small_high, likewise), then this checkout's tests compiled.
# BASE: the baseline tree, e.g. `git archive 135da94 backends perf config ':!perf/results' | tar -x -C .baseline`.
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   MODELS=qwen3-0.6b bash perf/gpu_ab.sh OUT_DIR [BASE]
# Results: OUT_DIR/results_ab.tgz (runner_{base,new}.json/.log, corun_{base,new}.json/.log, gpu_tests.log).
set -uo pipefail
out=${1:?output directory}
base=${2:-.baseline}
[ -d "$base/backends" ] || { echo "no baseline tree at $base"; exit 2; }
archive=results_ab.tgz
source perf/gpu_results.sh
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

for name in base new; do
  root=$base; [ $name = new ] && root=$PWD
  step "steps, $name"
  # The baseline tree may predate the scripts: this checkout's copies run against that tree's backends.
  for f in bench_runner bench_corun; do cp perf/$f.py "$root/perf/${f}_run.py"; done
  (cd "$root" && timeout 150 python3 perf/bench_runner_run.py --models ${MODELS:-qwen3-0.6b} --quick --no-router \
    --colocate '' --profile --out $res/runner_$name.json) > $res/runner_$name.log 2>&1
  grep -E "captured|decode b=  [18] ctx= 1024|extend 8x10|kernels" $res/runner_$name.log | cut -c1-150
  step "the small model beside the large one, $name"
  (cd "$root" && timeout 120 python3 perf/bench_corun_run.py --variants plain,small_high \
    --out $res/corun_$name.json) > $res/corun_$name.log 2>&1
  grep -E "^(plain|small_high):" $res/corun_$name.log
  rm -f "$root"/perf/bench_{runner,corun}_run.py
done

step "tests, compiled"
PYTHONPATH=$PWD/backends timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider \
  ${TESTS:-tests/test_gpu_runner.py tests/test_skinny_gemm.py -k "gpu_runner or greedy or qk_rope or model_skinny or deterministic or batch"} \
  > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log
tail -3 $res/gpu_tests.log
step "done"
