#!/usr/bin/env bash
# Where the time goes on a GPU machine as it is (issue 11): the served deployment first, as the first process
# of a fresh machine (its first requests measured without a warm-up: does any request pay for a compile or
# a capture?), then five measured runs at C=8 (are the figures stable?) and C=1 / C=16, recorded with the
# subservers' timeline; then the in-process engine on the same workload, recorded, five runs.
#
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_timeline.sh OUT_DIR CONFIG NAME [BUNDLE_DIR]
# Results: OUT_DIR/results_NAME.tgz: served_first.*, served_c8.* (5 runs), served_c1_c16.*, timeline_served_c8/
# (the C=8 runs' window of the served timeline), timeline_engine_c8/ (trace.json, summary.md), the logs.
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
name=${3:?results name}
bundle=${4:-.gpu}
work=$(mktemp -d /tmp/timeline-XXXX)
res=$work/results
mkdir -p "$out" "$res"
# The archive is rewritten after every step: a run cut short still brings back what it measured.
step() { tar -C $work -czf "$out/results_$name.tgz" results 2> /dev/null; echo "== $(date -u +%T) $*"; }

source perf/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
load=(--config "$cfg" --prompt-len 100 --output-len 256)

step "serve $cfg (timeline on)"
t0=$(date +%s)
TOKENROUTER_TIMELINE_DIR=$work/tl python3 -m tokenrouter.cli serve --config "$cfg" --model-repository $work/repo \
  "${envflag[@]}" > $res/serve.log 2>&1 &
serve_pid=$!
ready=0
for _ in $(seq 1 300); do
  if curl -sf localhost:8000/v2/health/ready > /dev/null; then ready=1; break; fi
  kill -0 $serve_pid 2> /dev/null || break
  sleep 1
done
if [ $ready = 1 ]; then
  step "ready after $(( $(date +%s) - t0 )) s"
  timeout 120 python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" --concurrency 8 --warmup 0 \
    --out $res/served_first 2>&1 | grep "^C="
  step "first requests measured"
  timeout 200 python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" --concurrency 8 --repeat 5 \
    --out $res/served_c8 2>&1 | grep "^C="
  step "C=8 x 5"
  timeout 120 python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" --concurrency 1,16 \
    --out $res/served_c1_c16 2>&1 | grep "^C="
  step "C=1, C=16"
  curl -s localhost:8002/metrics | grep -E "^tokenrouter_(tuned|predicted|batching|kv_blocks_used|requests_held)" \
    > $res/metrics_after.txt
else
  step "server not ready"; tail -40 $res/serve.log
fi
kill -INT $serve_pid 2> /dev/null
wait $serve_pid
step "server stopped ($?)"
window=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; \
print(min(x['monotonic_since'] for x in r), max(x['monotonic_until'] for x in r))" $res/served_c8.json 2> /dev/null)
if [ -n "$window" ]; then
  set -- $window
  python3 perf/timeline.py served $work/tl --since $1 --until $2 --out $res/timeline_served_c8 2>&1 | head -30
fi
step "served timeline"

timeout 240 python3 perf/timeline.py record --config "$cfg" --concurrency 8 --num-requests 32 --prompt-len 100 \
  --output-len 256 --repeat 5 --out $res/timeline_engine_c8 > $res/timeline_engine.log 2>&1
echo "exit $?"; head -30 $res/timeline_engine_c8/summary.md 2> /dev/null || tail -20 $res/timeline_engine.log
step "done: $out/results_$name.tgz"
