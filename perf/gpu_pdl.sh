#!/usr/bin/env bash
# Programmatic dependent launch (runner/pdl.py) on one GPU, two device calls (each under 10 minutes):
#   runner: the PDL tests and the kernel tests compiled (fused ops, attention, the runner against transformers;
#           test_skinny_gemm.py compiles for minutes: TESTS adds it); the decode step with and without skinny matmuls with
#           PDL on and off (perf/bench_runner.py --pdl, replay times side by side),
#           whose PDL-on runs write the step-level skinny row caps into this checkout's table (copied into the
#           results: commit it before the engine call). MODELS picks the models (default qwen3-0.6b).
#   engine: routed in process (perf/bench_engine.py, C=1, 8, 16), PDL off then on, each in its own process.
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   bash perf/gpu_pdl.sh OUT_DIR runner|engine [CONFIG]
# Results: OUT_DIR/results_pdl_MODE.tgz (gpu_tests.log, runner_pdl.json/.md/.log, skinny_gemm_tuned.json;
# engine_pdl_{off,on}.json/.md/.log).
set -uo pipefail
out=${1:?output directory}
mode=${2:?runner or engine}
cfg=${3:-config/random/qwen3-0.6b_qwen3-32b.yaml}
case $mode in runner|engine) ;; *) echo "MODE must be runner or engine, got '$mode'"; exit 2;; esac
archive=results_pdl_$mode.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
table=backends/tokenrouter/runner/skinny_gemm_tuned.json
python3 -c 'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__)'

engine() {  # engine NAME [ENV=VALUE]: routed in process
  step "in-process engine, $1"
  env ${2:+"$2"} timeout 280 python3 perf/bench_engine.py --config "$cfg" --variants routed --concurrency ${CONC:-1,8,16} \
    --prompt-len 100 --output-len 256 --isolate on --out-dir $res --name engine_pdl_$1 > $res/engine_pdl_$1.log 2>&1
  grep "^| routed" $res/engine_pdl_$1.md 2> /dev/null || tail -5 $res/engine_pdl_$1.log
}

if [ "$mode" = engine ]; then
  python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null 2>&1
  engine off TOKENROUTER_PDL=0
  engine on
  step "done"
  exit 0
fi

step "PDL and kernel tests, compiled"
# (about 180 s on an H200; the two timeouts together stay under a device call's 600 s)
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_fused_ops.py \
  tests/test_triton_attention.py tests/test_gpu_runner.py ${TESTS:-} > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log
tail -3 $res/gpu_tests.log

step "decode steps: skinny on / off x PDL on / off"
timeout 300 python3 perf/bench_runner.py --models ${MODELS:-qwen3-0.6b} --quick --decode-only --no-router --colocate '' \
  --skinny-gemm both --pdl on,off --layer-caps $table --out $res/runner_pdl.json 2>&1 \
  | grep -E "decode b=|skinny matmuls up to|loaded" | tee $res/runner_pdl.log | grep -v "ctx= 8192"
cp $table $res/
step "done"
