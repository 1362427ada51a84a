#!/usr/bin/env bash
# Where the time goes on a GPU machine as it is (issue 11), in one device call:
#   1. the in-process engine, recorded (perf/timeline.py record), C=8, five runs;
#   2. the served deployment (tokenrouter serve, timeline on), its first requests measured without a
#      warm-up round (does any request pay for a kernel compile? the Triton kernel cache is listed for
#      kernels compiled after ready), then five runs at C=8, then C=1 and C=16;
#
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_timeline.sh OUT_DIR CONFIG NAME [BUNDLE_DIR]
#   FIRST_ONLY=1 bash perf/gpu_timeline.sh ...   # only a fresh server's first requests at C=8, then C=16
# Results: OUT_DIR/results_NAME.tgz: timeline_engine_c8/, served_*.{json,md}, timeline_served_c8/ (the five C=8
# runs' window of the served timeline), timeline_raw.tgz (every served subserver's events), the logs.
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
name=${3:?results name}
bundle=${4:-.gpu}
archive=results_$name.tgz
source perf/gpu_env.sh  # (also: work, res, step)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
load=(--config "$cfg" --prompt-len 100 --output-len 256)

if [ -z "${FIRST_ONLY:-}" ]; then
step "in-process engine, recorded (before any server: no MPS)"
timeout 200 python3 perf/timeline.py record --config "$cfg" --concurrency 8 --num-requests 32 --prompt-len 100 \
  --output-len 256 --repeat 5 --out $res/timeline_engine_c8 > $res/timeline_engine.log 2>&1
echo "exit $?"; grep -E "output_tok_s|^\| (small|large) " $res/timeline_engine_c8/summary.md 2> /dev/null \
  || tail -20 $res/timeline_engine.log
fi

# serve TAG CONFIG: start the server (timeline into $work/tl_TAG, a fresh Triton kernel cache), wait for ready.
serve() {
  local tag=$1 config=$2 t0
  t0=$(date +%s)
  TRITON_CACHE_DIR=$work/triton-cache-$tag TOKENROUTER_TIMELINE_DIR=$work/tl_$tag python3 -m tokenrouter.cli serve \
    --config "$config" --model-repository $work/repo_$tag "${envflag[@]}" > $res/serve_$tag.log 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 300); do
    if curl -sf localhost:8000/v2/health/ready > /dev/null; then
      touch $work/ready_$tag; step "$tag ready after $(( $(date +%s) - t0 )) s"
      grep -o "model '[a-z]*' on .*" $res/serve_$tag.log
      return 0
    fi
    kill -0 $serve_pid 2> /dev/null || break
    sleep 1
  done
  step "$tag: server not ready"; tail -30 $res/serve_$tag.log; return 1
}
stop_server() {
  kill -INT $serve_pid 2> /dev/null; wait $serve_pid
  live_mps && echo quit | timeout 30 nvidia-cuda-mps-control > /dev/null 2>&1
  for _ in $(seq 1 30); do live_mps || break; sleep 1; done  # (live_mps: gpu_env.sh)
}
# Kernels compiled on requests (there should be none): the cache folder of each variant compiled after
# ready (its __grp__*.json written last) is kept, with its metadata (name, specialization).
keep_compiled() {
  mkdir -p $res/compiled_after_ready
  for f in $(find $work/triton-cache-base -name '__grp__*.json' -newer $work/ready_base); do
    cp -r "$(dirname $f)" $res/compiled_after_ready/
  done
}
bench() {  # bench OUTNAME ARGS...: the served benchmark, its per-run lines
  local o=$1; shift
  timeout 200 python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" --out $res/$o "$@" 2>&1 | grep "^C="
}

if serve base "$cfg"; then
  bench served_first --concurrency 8 --warmup 0
  keep_compiled
  echo "Triton kernels compiled after ready: $(ls $res/compiled_after_ready | wc -l) ($(find \
    $res/compiled_after_ready -name '__grp__*.json' -exec basename {} .json \; | tr '\n' ' ')); before: $(find \
    $work/triton-cache-base -name '__grp__*.json' ! -newer $work/ready_base | wc -l)"
  step "first requests measured"
  if [ -n "${FIRST_ONLY:-}" ]; then  # only a fresh server's first requests, at C=8 and then at C=16
    bench served_first_c16 --concurrency 16 --warmup 0
    keep_compiled
    echo "after C=16: $(ls $res/compiled_after_ready | wc -l) compiled"
    tar -C $work -czf $res/timeline_raw.tgz tl_base  # every step of those requests, for perf/timeline.py served
    step "done: $out/results_$name.tgz"; kill -INT $serve_pid; exit 0  # (the machine is given back anyway)
  fi
  bench served_c8 --concurrency 8 --repeat 5; step "C=8 x 5"
  bench served_c1 --concurrency 1; step "C=1"
  bench served_c16 --concurrency 16 --repeat 3; step "C=16 x 3"
  curl -s localhost:8002/metrics | grep -E "^tokenrouter_(tuned|predicted|batching|kv_blocks_used|requests_held)" \
    > $res/metrics_base.txt
  stop_server
  window=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; \
print(min(x['monotonic_since'] for x in r), max(x['monotonic_until'] for x in r))" $res/served_c8.json 2> /dev/null)
  if [ -n "$window" ]; then
    set -- $window
    python3 perf/timeline.py served $work/tl_base --since $1 --until $2 --out $res/timeline_served_c8 2>&1 \
      | grep -E "^\| (small|large) "
  fi
  tar -C $work -czf $res/timeline_raw.tgz tl_base
  step "served timeline"
fi

step "done: $out/results_$name.tgz"
