#!/usr/bin/env bash
# One deployment in a few variants, side by side in one device call: each variant is the config with a JSON object
# merged into it (objects merge key by key, any other value replaces; written beside the original, so that its
# relative paths hold, and removed at the end), then
#   inprocess: perf/bench_engine.py (routed, C=8 and 16) per variant;
#   served:    tokenrouter serve + perf/bench_served.py (C=8 three runs, C=16 one; POINTS overrides) per variant;
#              FIRST=1 first measures the fresh server's first 32 requests at C=8 without a warm-up round.
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_variants.sh OUT_DIR CONFIG MODE NAME=PATCH [NAME=PATCH ...] [-- BUNDLE]
#   bash perf/gpu_variants.sh $OUT config/r2r/qwen3-0.6b_qwen3-32b.yaml served \
#     kernel='{"policy": {"threshold": 0.5341, "router_kernel": "auto"}}' \
#     cublas='{"policy": {"threshold": 0.5341, "router_kernel": "torch"}}'
# Results: OUT_DIR/results_variants_MODE.tgz (each variant's patched config, logs, JSON and markdown).
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
mode=${3:?inprocess or served}
shift 3
variants=()
written=()
bundle=.gpu
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then bundle=${2:?bundle}; break; fi
  variants+=("$1"); shift
done
case $mode in inprocess|served) ;; *) echo "MODE must be inprocess or served, got '$mode'"; exit 2;; esac
archive=results_variants_$mode.tgz
if [ "$mode" = served ]; then source perf/gpu_env.sh; else source perf/gpu_results.sh; fi  # (work, res, step)
export PYTHONPATH=$PWD/backends TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[ "$mode" = served ] || python3 -m tokenrouter.cli make-bench-tokenizer > /dev/null 2>&1

for variant in "${variants[@]}"; do
  name=${variant%%=*}
  c=$(dirname "$cfg")/_variant_$name.yaml
  written+=("$c")
  python3 - "$cfg" "$c" "${variant#*=}" <<'PY' || { echo "could not write $c"; exit 1; }
import json, sys, yaml
def merge(base, patch):
    for k, v in patch.items():
        base[k] = merge(base[k] if isinstance(base.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return base
cfg = merge(yaml.safe_load(open(sys.argv[1])), json.loads(sys.argv[3]))
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
PY
  cp "$c" $res/config_$name.yaml
  if [ "$mode" = inprocess ]; then
    step "in-process engine, $name"
    timeout 240 python3 perf/bench_engine.py --config "$c" --variants routed --concurrency ${CONC:-8,16} \
      --prompt-len 100 --output-len 256 --isolate on --out-dir $res --name engine_$name > $res/engine_$name.log 2>&1
    grep "^| routed" $res/engine_$name.md 2> /dev/null || tail -5 $res/engine_$name.log
    continue
  fi
  step "serve $name"
  if serve "$c" $work/repo_$name $res/serve_$name.log; then
    step "$name ready"
    if [ "${FIRST:-0}" = 1 ]; then  # the fresh server's first requests at C=8, no warm-up round (issue 11, point 4)
      timeout 100 python3 perf/bench_served.py --url 127.0.0.1:8001 --config "$c" --prompt-len 100 --output-len 256 \
        --concurrency 8 --warmup 0 --out $res/served_${name}_first 2>&1 | grep "^C="
    fi
    for point in ${POINTS:-8:3 16:1}; do
      timeout 150 python3 perf/bench_served.py --url 127.0.0.1:8001 --config "$c" --prompt-len 100 --output-len 256 \
        --concurrency ${point%:*} --repeat ${point#*:} --out $res/served_${name}_c${point%:*} 2>&1 | grep "^C="
    done
  else
    step "$name: server not ready"; tail -30 $res/serve_$name.log
  fi
  stop_server
done
rm -f "${written[@]}"
step "done"
