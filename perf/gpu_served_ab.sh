#!/usr/bin/env bash
# A serving change side by side with a baseline tree, served on one GPU in one device call (issue 11): each variant
# is a tree (this checkout `.`, or a baseline made with
# `git archive REV backends perf config ':!perf/results' | tar -x -C .baseline`) and optional environment
# settings; each is served in turn with the timeline on (one Triton kernel cache for all: the first server
# compiles), then perf/bench_served.py measures C=8 five times, C=1 and C=16 (POINTS); each point's window of the
# timeline is summarized (perf/timeline.py served: busy fractions, step phases, handoff transit and its legs, the
# router's responder).
# FIRST=1: the first variant's fresh server first takes 32 requests at C=8 without a warm-up round (issue 11,
# point 4: the first requests' TTFT), and the Triton kernels compiled after ready are listed.
# SOAK=N: the first variant's server then takes a served soak (perf/soak.py: N requests at C=16, 20 % cancelled at
# random points; every other request ends with one final response, the server's accounting agrees, nothing is
# held once idle).
# Usage (repository root, on the GPU machine, .gpu from perf/make_gpu_bundle.sh):
#   bash perf/gpu_served_ab.sh OUT_DIR CONFIG NAME=TREE[,VAR=VALUE...] ...
#   bash perf/gpu_served_ab.sh $OUT config/random/qwen3-0.6b_qwen3-32b.yaml new=. base=.baseline \
#     nopdl=.,TOKENROUTER_PDL=0 green=.,CONFIG=config/random/other.yaml
# PROMPT_LEN: prompt tokens per request (default 100); OUTPUT_LEN: output tokens (default 256); NUM_REQUESTS: per
# measured run (default: bench_served's max(16, 4 x C)); POINT_TIMEOUT: seconds a point may take (default 150).
# Results: OUT_DIR/results_served_ab.tgz (served_NAME_c{8,1,16}.{json,md}, timeline_NAME_c8/, serve_NAME.log,
# metrics_NAME.txt: the server's Prometheus metrics after its points).
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
shift 2
archive=results_served_ab.tgz
bundle=${BUNDLE:-.gpu}
source perf/gpu_env.sh  # (also: work, res, step, envflag, serve, stop_server)
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
t_start=$(date +%s)
first=${FIRST:-0}

for variant in "$@"; do
  name=${variant%%=*}
  spec=${variant#*=}
  tree=$(cd "${spec%%,*}" && pwd)
  settings=(); [ "$spec" != "${spec#*,}" ] && IFS=, read -ra settings <<< "${spec#*,}"
  [ -d "$tree/backends/tokenrouter" ] || { echo "$name: no tree at $tree"; continue; }
  vcfg=$cfg  # a CONFIG=FILE setting serves this variant from another deployment YAML (not an environment setting)
  env_settings=()
  for s in "${settings[@]}"; do if [[ $s == CONFIG=* ]]; then vcfg=${s#CONFIG=}; else env_settings+=("$s"); fi; done
  settings=("${env_settings[@]}")
  load=(--config "$vcfg" --prompt-len ${PROMPT_LEN:-100} --output-len ${OUTPUT_LEN:-256})
  if [ $(( $(date +%s) - t_start )) -gt ${BUDGET_S:-400} ]; then step "$name skipped: past ${BUDGET_S:-400} s"; continue; fi
  # The stubs import tokenrouter through the interpreter's path: this variant's tree, for every process.
  echo "$tree/backends" > "$sp/tokenrouter-checkout.pth"
  step "serve $name ($tree ${settings[*]:-})"
  t0=$(date +%s)
  # gpu_env.sh's serve and stop_server, with this variant's settings in the environment while it is served
  export "${settings[@]}" PYTHONPATH=$tree/backends TRITON_CACHE_DIR=$work/triton-cache \
    TOKENROUTER_TIMELINE_DIR=$work/tl_$name
  if ! serve "$vcfg" $work/repo_$name $res/serve_$name.log; then
    step "$name: server not ready"; tail -30 $res/serve_$name.log; stop_server
    unset "${settings[@]%%=*}" PYTHONPATH TOKENROUTER_TIMELINE_DIR; continue
  fi
  touch $work/ready_$name
  step "$name ready after $(( $(date +%s) - t0 )) s"
  if [ "$first" = 1 ]; then
    timeout 100 python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" --concurrency 8 --warmup 0 \
      --out $res/served_${name}_first 2>&1 | grep "^C="
    echo "Triton kernels compiled after ready: $(find $work/triton-cache -name '__grp__*.json' -newer \
      $work/ready_$name | wc -l), before: $(find $work/triton-cache -name '__grp__*.json' ! -newer $work/ready_$name | wc -l)"
    first=0
  fi
  for point in ${POINTS:-8:5 1:1 16:1}; do
    timeout ${POINT_TIMEOUT:-150} python3 perf/bench_served.py --url 127.0.0.1:8001 "${load[@]}" \
      --concurrency ${point%:*} --num-requests ${NUM_REQUESTS:-0} --repeat ${point#*:} \
      --out $res/served_${name}_c${point%:*} 2>&1 | grep "^C="
    echo "C=${point%:*} exit ${PIPESTATUS[0]}"
  done
  if [ "${SOAK:-0}" -gt 0 ] && [ "$name" = "${1%%=*}" ]; then
    timeout 200 python3 perf/soak.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
      --requests $SOAK --concurrency 16 --cancel-fraction 0.2 --max-tokens 64 --out $res/soak_$name.json \
      > $res/soak_$name.log 2>&1
    echo "soak $name: exit $?"; tail -12 $res/soak_$name.log
  fi
  curl -s 127.0.0.1:8002/metrics > $res/metrics_$name.txt  # (the server's counters after its points)
  stop_server
  unset "${settings[@]%%=*}" PYTHONPATH TOKENROUTER_TIMELINE_DIR
  for run in first c8 c1 c16; do
    window=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; \
print(min(x['monotonic_since'] for x in r), max(x['monotonic_until'] for x in r))" $res/served_${name}_$run.json 2> /dev/null)
    [ -n "$window" ] || continue
    read -r since until <<< "$window"
    python3 perf/timeline.py served $work/tl_$name --since $since --until $until --out $res/timeline_${name}_$run \
      > /dev/null 2>&1
    echo "timeline $name $run:"
    grep -E "^\| (small|large|[a-z]+ -> [a-z]+) |^Router" $res/timeline_${name}_$run/summary.md 2> /dev/null | cut -c1-250
    # (one archive of at most 16 MiB comes back: the C=8 traces, and the first variant's raw events)
    if [ $run = c8 ]; then gzip -f $res/timeline_${name}_$run/trace.json; else rm -f $res/timeline_${name}_$run/trace.json; fi
  done
  [ "$name" = "${1%%=*}" ] && tar -C $work -czf $res/timeline_raw_$name.tgz tl_$name
  step "$name measured"
done
echo "$PWD/backends" > "$sp/tokenrouter-checkout.pth"
step "done"
