#!/usr/bin/env bash
# The served path on a GPU machine as it is (its image's Python, no package registry): a soak under load with
# cancellations, the served benchmark (closed-loop gRPC clients) and perf_analyzer against `tokenrouter serve`,
# with the in-process engine on the same workload first (before MPS starts), and the served / in-process table.
#
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_served.sh OUT_DIR CONFIG NAME [BUNDLE_DIR]
# BUNDLE_DIR (default .gpu) holds what the machine lacks; perf/make_gpu_bundle.sh makes it on a CPU machine:
#   triton.txz        site-packages' pytriton/tritonserver + nvidia_pytriton.libs (the Triton 2.51 server)
#   tritonclient.tgz  site-packages' tritonclient (the Python client; grpcio and protobuf are in the image)
#   python_rapidjson-*-cp312-*.whl  the one client dependency the image lacks
#   perf_analyzer.gz  the venv's bin/perf_analyzer (from tritonclient[all]==2.51.0)
#   numpy-1.26.4-cp312-*.whl  numpy<2 for the stubs when the image has numpy 2 (see serving/stub_env.py)
# The package is put on the image Python's path with a .pth file in its site-packages (the Python-backend
# stubs run that interpreter: `tokenrouter serve` gives them its venv as EXECUTION_ENV_PATH).
# Results: OUT_DIR/results_NAME.tgz (logs, JSON and markdown of every step).
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
name=${3:?results name}
bundle=${4:-.gpu}
archive=results_$name.tgz
source perf/gpu_env.sh  # (also: work, res, step)

step "in-process engine, same workload"
timeout 200 python3 perf/bench_engine.py --config "$cfg" --variants routed --concurrency 1,8,16 \
  --prompt-len 100 --output-len 256 --isolate on --out-dir $res --name engine 2>&1 | grep -v "^|" | tail -6

step "serve $cfg"
python3 -m tokenrouter.cli serve --config "$cfg" --model-repository $work/repo "${envflag[@]}" > $res/serve.log 2>&1 &
serve_pid=$!
ready=0
for _ in $(seq 1 240); do
  if curl -sf localhost:8000/v2/health/ready > /dev/null; then ready=1; break; fi
  kill -0 $serve_pid 2> /dev/null || break
  sleep 1
done
if [ $ready = 1 ]; then
  step "ready"
  step "soak"
  timeout 100 python3 perf/soak.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
    --requests 300 --concurrency 16 --cancel-fraction 0.2 --max-tokens 64 --out $res/soak.json 2>&1 | tail -4
  step "served benchmark"
  timeout 200 python3 perf/bench_served.py --url 127.0.0.1:8001 --config "$cfg" --concurrency 1,8,16 \
    --prompt-len 100 --output-len 256 --out $res/served 2>&1 | tail -12
  step "perf_analyzer"
  python3 perf/bench_served.py --config "$cfg" --num-requests 64 --prompt-len 100 --write-prompts $work/prompts.json
  timeout 130 python3 perf/perf_analyzer.py --url 127.0.0.1:8001 --concurrency 16 --max-tokens 256 \
    --prompt-file $work/prompts.json --perf-analyzer $tr/perf_analyzer --max-trials 3 \
    --out $res/perf_analyzer.csv 2>&1 | tail -8
  curl -s localhost:8002/metrics | grep -E "^tokenrouter_(tuned|predicted|batching|kv_blocks_used|requests_held|requests_finished)" \
    > $res/metrics_after.txt
else
  step "server not ready"; tail -40 $res/serve.log
fi
kill -INT $serve_pid 2> /dev/null
wait $serve_pid
step "server stopped ($?)"
tail -5 $res/serve.log

python3 perf/bench_served.py --compare $res/served.json $res/engine.json --out $res/compare 2>&1 | tail -8
step "done: $out/results_$name.tgz"
