#!/usr/bin/env bash
# (Kept with its results: it ran at commit 6e23f8e, whose models.*.sm_percent was removed after this run; see README.)
# Does limiting the large model's share of the SMs help the served deployment? Serves CONFIG with every model
# but the entry (small) one at each `models.*.sm_percent` of PERCENTS (100: no limit) and runs
# perf/bench_served.py at each point of POINTS (C:REPEATS, space-separated), side by side in one device call.
# Usage (repository root, on the GPU machine): bash perf/results/sm_share_h200_2026-12-02/gpu_sm_share.sh OUT_DIR CONFIG [BUNDLE]
#   PERCENTS="100 50" POINTS="8:5" bash perf/results/sm_share_h200_2026-12-02/gpu_sm_share.sh OUT_DIR CONFIG
# Results: OUT_DIR/results_sm_share.tgz (served_P_cC.json/.md, serve_P.log per percentage).
set -uo pipefail
out=${1:?output directory}
cfg=${2:?deployment YAML}
bundle=${3:-.gpu}
archive=results_sm_share.tgz
source perf/gpu_env.sh  # (also: work, res, step, serve, stop_server)
for pct in ${PERCENTS:-100 50 35}; do
  c=$(dirname "$cfg")/_sm_$pct.yaml  # beside the original, so that its relative paths hold
  python3 - "$cfg" "$c" "$pct" <<'PY' || { echo "could not write $c"; exit 1; }
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
for name, m in cfg["models"].items():
    if name != cfg["entry"]:
        m["sm_percent"] = None if sys.argv[3] == "100" else int(sys.argv[3])
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
PY
  step "serve, large model(s) at $pct % of the SMs"
  if serve "$c" $work/repo_$pct $res/serve_$pct.log; then
    step "$pct ready"; grep -h "of the GPU's SMs" $res/serve_$pct.log
    for point in ${POINTS:-8:3 16:1}; do
      conc=${point%%:*}
      timeout 200 python3 perf/bench_served.py --url 127.0.0.1:8001 --config "$c" --prompt-len 100 --output-len 256 \
        --concurrency $conc --repeat ${point##*:} --out $res/served_${pct}_c$conc 2>&1 | grep "^C="
    done
  else
    step "$pct: server not ready"; tail -30 $res/serve_$pct.log
  fi
  stop_server
done
step "done"
