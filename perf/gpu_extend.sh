#!/usr/bin/env bash
# Extend attention (issue 12): a baseline tree and this checkout side by side on one GPU, two device calls:
#   runner: attention alone per layer in graphs (perf/bench_attention.py, the default configuration only) and
#           the models' steps (perf/bench_runner.py: decode, extends of 1 x 2..64 and 8 x 2..10 tokens, prefill),
#           baseline first; then the runner, attention, graph and PDL tests compiled (as far as TEST_S allows).
#   engine: routed in process (perf/bench_engine.py, C=1, 8, 16), baseline first, each in its own process.
# BASE: the baseline tree, e.g. `git archive 4ba2aa8 backends perf config | tar -x -C .baseline` (carried).
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   bash perf/gpu_extend.sh OUT_DIR runner|engine [BASE] [CONFIG]
# Results: OUT_DIR/results_extend_MODE.tgz (gpu_tests.log; attention_{base,new}.json/.log; runner_{base,new}.json
# /.log; engine_{base,new}.json/.md/.log).
set -uo pipefail
out=${1:?output directory}
mode=${2:?runner or engine}
base=${3:-.baseline}
cfg=${4:-config/random/qwen3-0.6b_qwen3-32b.yaml}
case $mode in runner|engine) ;; *) echo "MODE must be runner or engine, got '$mode'"; exit 2;; esac
[ -d "$base/backends" ] || { echo "no baseline tree at $base"; exit 2; }
archive=results_extend_$mode.tgz
source perf/gpu_results.sh
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c 'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__)'

tree() {  # tree NAME: the tree's root (each tree runs its own backends and perf scripts)
  if [ "$1" = base ]; then echo "$base"; else echo "$PWD"; fi
}

if [ "$mode" = engine ]; then
  PYTHONPATH=$PWD/backends python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null
  for name in base new; do
    root=$(tree $name)
    step "in-process engine, $name"
    # This checkout's config (model shapes, tokenizer) for both; each tree's own engine.
    PYTHONPATH=$root/backends timeout 270 python3 $root/perf/bench_engine.py --config $cfg --variants routed \
      --concurrency ${CONC:-1,8,16} --prompt-len 100 --output-len 256 --isolate on --out-dir $res \
      --name engine_$name > $res/engine_$name.log 2>&1
    grep "^| routed" $res/engine_$name.md 2> /dev/null || tail -5 $res/engine_$name.log
  done
  step "done"
  exit 0
fi

for name in base new; do
  root=$(tree $name)
  step "attention per layer, $name"
  # The baseline tree may predate the script: this checkout's copy runs against that tree's backends.
  cp perf/bench_attention.py "$root/perf/bench_attention_run.py"
  (cd "$root" && timeout 60 python3 perf/bench_attention_run.py --tiles '' --out $res/attention_$name.json) \
    > $res/attention_$name.log 2>&1
  rm -f "$root/perf/bench_attention_run.py"
  grep "on 1024" $res/attention_$name.log | cut -c1-110
done

for name in base new; do
  root=$(tree $name)
  step "steps, $name"
  # This checkout's copy of the benchmark in both trees (the same cases), each tree's own runner.
  cp perf/bench_runner.py "$root/perf/bench_runner_run.py"
  (cd "$root" && timeout 150 python3 perf/bench_runner_run.py --models ${MODELS:-qwen3-32b,qwen3-0.6b} --quick \
    --no-router --colocate '' --out $res/runner_$name.json) > $res/runner_$name.log 2>&1
  rm -f "$root/perf/bench_runner_run.py"
  grep -E "captured|decode b=  8 ctx= 1024|extend 8x10|extend 1x8 |prefill" $res/runner_$name.log
done
step "attention, PDL, graph and runner tests, compiled"
PYTHONPATH=$PWD/backends timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runner.py \
  tests/test_triton_attention.py tests/test_cuda_graph_runner.py tests/test_pdl.py > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log
tail -3 $res/gpu_tests.log

step "done"
