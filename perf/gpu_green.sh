#!/usr/bin/env bash
# The large model on its own SMs (issue 11): CUDA green contexts (ModelConfig.num_sms) on one GPU, one device
# call. perf/probe_green.py (does the partition hold for cuBLAS, Triton kernels and CUDA graphs; also as an MPS
# client), perf/bench_corun.py in one process (the 32B on N SMs beside the 0.6B on all), then the in-process
# engine (perf/bench_engine.py, routed) with the config as it is and with the large model on the N of the best
# corun variant (or GREEN_N: one or more, e.g. "96 64").
# Usage (repository root, on the GPU machine, its image's Python as it is):
#   PARTS="probe tests corun engine" bash perf/gpu_green.sh OUT_DIR [CONFIG]
# (engine without corun needs GREEN_N.)
# Results: OUT_DIR/results_green.tgz.
set -uo pipefail
out=${1:?output directory}
config=${2:-config/random/qwen3-0.6b_qwen3-32b.yaml}
archive=results_green.tgz
source perf/gpu_results.sh
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

part() { [[ " ${PARTS:-probe tests corun engine} " == *" $1 "* ]]; }

if part probe; then
step "probe, one process"
timeout 120 python3 perf/probe_green.py --sms ${PROBE_SMS:-64,96,112,120} > $res/probe.log 2>&1
cat $res/probe.log | grep -v Warning
step "probe, an MPS client"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
timeout 90 python3 perf/probe_green.py --sms 64,112 > $res/probe_mps.log 2>&1
cat $res/probe_mps.log | grep -v Warning
echo quit | nvidia-cuda-mps-control; sleep 2
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if part tests; then
step "tests, compiled: green contexts, and the runner's graphs (captured on the model's stream)"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_green.py tests/test_gpu_runner.py \
  -k "green or triton-True or routed_generation" > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log
tail -4 $res/gpu_tests.log
fi

n=${GREEN_N:-}
if part corun; then

step "bench_corun: the 32B on N SMs beside the 0.6B"
timeout ${CORUN_S:-200} python3 perf/bench_corun.py --variants ${VARIANTS:-plain,green120,green112,green96,green64} \
  --out $res/corun_green.json > $res/corun_green.log 2>&1
grep -E "^(plain|small_high|green[0-9]+):" $res/corun_green.log
[ -n "$n" ] || n=$(python3 - $res/corun_green.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"]
ok = {k: v for k, v in r.items() if k.startswith("green") and "error" not in v and v.get("large_finite")}
print(max(ok, key=lambda k: ok[k]["work_together"]).removeprefix("green") if ok else "")
PY
)
fi
part engine || { step "done"; exit 0; }
[ -n "$n" ] || { step "no green variant worked: done"; exit 0; }
[ -d models/bench-tokenizer ] || python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null || exit 1
for k in $n; do
python3 - "$config" $k $res/green$k.yaml <<'PY'
import os, sys, yaml
src, n, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = yaml.safe_load(open(src))
cfg["models"]["large"]["num_sms"] = n
base = os.path.dirname(os.path.abspath(src))  # relative paths resolve against the file's folder
for m in cfg["models"].values():
    m["path"] = os.path.join(base, m["path"])
cfg["tokenizer"] = os.path.join(base, cfg["tokenizer"])
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)  # the models keep their order
PY
done
for name in plain $(for k in $n; do echo green$k; done); do
  cfgfile=$config; [ $name = plain ] || cfgfile=$res/$name.yaml
  step "in-process engine, routed, $name"
  timeout ${ENGINE_S:-170} python3 perf/bench_engine.py --config $cfgfile --variants routed \
    --concurrency ${POINTS:-8,8,8,16,1} --prompt-len 100 --output-len 256 --isolate off \
    --name engine_$name --out-dir $res > $res/engine_$name.log 2>&1
  grep -E "^\| *[0-9]" $res/engine_$name.md 2>/dev/null | sort -u || tail -5 $res/engine_$name.log
done
step "done"
