#!/usr/bin/env bash
# A runner change side by side with a baseline on one GPU, one device call, in parts (PARTS, default "runner corun
# tests"):
#   runner: each model's steps (perf/bench_runner.py --profile: steps and each decode case's kernel breakdown; this
#           checkout's copy of the benchmark against each tree's runner);
#   corun:  the small model stepping beside the large one (perf/bench_corun.py plain and small_high, likewise);
#   engine: routed in process (perf/bench_engine.py, POINTS, default C=8 three times, C=16, C=1), base first;
#   tests:  this checkout's tests compiled (TESTS, TEST_S).
# BASE: the baseline tree, e.g. `git archive 135da94 backends perf config ':!perf/results' | tar -x -C .baseline`,
# or `.` (this checkout) with BASE_ENV, the environment that makes the baseline (e.g. TOKENROUTER_ATTN_MERGE=0).
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   MODELS=qwen3-0.6b bash perf/gpu_ab.sh OUT_DIR [BASE]
#   BASE_ENV=TOKENROUTER_ATTN_MERGE=0 PARTS="runner corun engine" bash perf/gpu_ab.sh OUT_DIR .
# Results: OUT_DIR/results_ab.tgz (runner_{base,new}.json/.log, corun_{base,new}.json/.log,
# engine_{base,new}.md/.json/.log, gpu_tests.log).
set -uo pipefail
out=${1:?output directory}
base=${2:-.baseline}
[ -d "$base/backends" ] || { echo "no baseline tree at $base"; exit 2; }
archive=results_ab.tgz
source perf/gpu_results.sh
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
part() { [[ " ${PARTS:-runner corun tests} " == *" $1 "* ]]; }
config=${CONFIG:-config/random/qwen3-0.6b_qwen3-32b.yaml}
echo "base: $base ${BASE_ENV:-}"

for name in base new; do
  root=$base; vars=${BASE_ENV:-}
  [ $name = new ] && root=$PWD vars=
  # The baseline tree may predate the scripts: this checkout's copies run against that tree's backends.
  for f in bench_runner bench_corun; do cp perf/$f.py "$root/perf/${f}_run.py"; done
  if part runner; then
    step "steps, $name"
    (cd "$root" && env $vars timeout 200 python3 perf/bench_runner_run.py --models ${MODELS:-qwen3-0.6b} --quick \
      --no-router --colocate '' --profile --out $res/runner_$name.json) > $res/runner_$name.log 2>&1
    grep -E "captured|decode b=  [18] ctx= 1024|extend 8x10|^\| [18] \| 1024 \| [0-9]+ \|" $res/runner_$name.log | cut -c1-150
  fi
  if part corun; then
    step "the small model beside the large one, $name"
    (cd "$root" && env $vars timeout 120 python3 perf/bench_corun_run.py --variants plain,small_high \
      --out $res/corun_$name.json) > $res/corun_$name.log 2>&1
    grep -E "^(plain|small_high):" $res/corun_$name.log
  fi
  rm -f "$root"/perf/bench_{runner,corun}_run.py
done

if part engine; then
  [ -d models/bench-tokenizer ] || PYTHONPATH=$PWD/backends python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null
  for name in base new; do
    root=$base; vars=${BASE_ENV:-}
    [ $name = new ] && root=$PWD vars=
    step "in-process engine, routed, $name"
    # This checkout's config (model shapes, tokenizer) for both; each tree's own engine.
    env $vars PYTHONPATH=$root/backends timeout ${ENGINE_S:-170} python3 $root/perf/bench_engine.py --config $config \
      --variants routed --concurrency ${POINTS:-8,8,8,16,1} --prompt-len 100 --output-len 256 --isolate off \
      --out-dir $res --name engine_$name > $res/engine_$name.log 2>&1
    grep -E "^\| *[0-9]" $res/engine_$name.md 2> /dev/null | sort -u || tail -5 $res/engine_$name.log
  done
fi

if part tests; then
  step "tests, compiled"
  PYTHONPATH=$PWD/backends timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider \
    ${TESTS:-tests/test_gpu_runner.py tests/test_skinny_gemm.py -k "gpu_runner or greedy or qk_rope or model_skinny or deterministic or batch"} \
    > $res/gpu_tests.log 2>&1
  echo "pytest exit code $?" >> $res/gpu_tests.log
  tail -3 $res/gpu_tests.log
fi
step "done"
