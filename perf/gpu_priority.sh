#!/usr/bin/env bash
# Does the small model's CUDA stream priority help? The routed deployment with its entry (small) model's stream
# at normal and at high priority (models.*.stream_priority), side by side in one device call:
#   inprocess: perf/bench_engine.py (routed, C=8 and 16), normal then high;
#   served:    tokenrouter serve + perf/bench_served.py (C=8 three runs, C=16 two), normal then high.
# Usage (repository root, on the GPU machine): bash perf/gpu_priority.sh OUT_DIR CONFIG [inprocess|served] [BUNDLE]
#   TAGS=normal bash perf/gpu_priority.sh OUT_DIR CONFIG served   # serve at normal priority only
# Results: OUT_DIR/results_priority_MODE.tgz.
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
mode=${3:-inprocess}
bundle=${4:-.gpu}
archive=results_priority_$mode.tgz
high=$(dirname "$cfg")/_priority_high.yaml  # beside the original, so that its relative paths hold
python3 - "$cfg" "$high" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
cfg["models"][cfg["entry"]]["stream_priority"] = "high"
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
PY
[ $? = 0 ] || { echo "could not write $high"; exit 1; }
if [ "$mode" = inprocess ]; then
  source perf/gpu_results.sh
  export PYTHONPATH=$PWD/backends TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  for tag in normal high; do
    c=$cfg; [ $tag = high ] && c=$high
    step "in-process engine, small model's stream $tag"
    timeout 220 python3 perf/bench_engine.py --config "$c" --variants routed --concurrency 8,16 --prompt-len 100 \
      --output-len 256 --isolate on --out-dir $res --name engine_$tag > $res/engine_$tag.log 2>&1
    grep "^| routed" $res/engine_$tag.md 2> /dev/null || tail -5 $res/engine_$tag.log
  done
  step "done"; exit 0
fi

source perf/gpu_env.sh  # (also: work, res, step)
for tag in ${TAGS:-normal high}; do
  c=$cfg; [ $tag = high ] && c=$high
  step "serve, small model's stream $tag"
  if serve "$c" $work/repo_$tag $res/serve_$tag.log; then
    step "$tag ready"
    for point in "8 3" "16 2"; do
      set -- $point
      timeout 150 python3 perf/bench_served.py --url 127.0.0.1:8001 --config "$c" --prompt-len 100 --output-len 256 \
        --concurrency $1 --repeat $2 --out $res/served_${tag}_c$1 2>&1 | grep "^C="
    done
  else
    step "$tag: server not ready"; tail -30 $res/serve_$tag.log
  fi
  stop_server
done
step "done"
