#!/usr/bin/env bash
# One section of the evaluation suite (perf/evaluate.py) on a GPU machine as it is: installs what the bundle
# carries (perf/gpu_env.sh), runs the section on the Qwen3 dummy-weight deployments within LIMIT seconds
# (default 520, inside one 10-minute device call), and packs its JSON / markdown and the log.
#
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_evaluate.sh OUT_DIR SECTION [perf/evaluate.py arguments...]
#   e.g. bash perf/gpu_evaluate.sh $OUT main --scale 0.0625 --algorithms r2r --workloads low-effort
# Results: OUT_DIR/results_SECTION.tgz (the section's files under eval/, evaluate.log). Plots need matplotlib,
# which the GPU image may lack: draw them afterwards with `python perf/evaluation/report.py eval/SECTION.json`.
set -uo pipefail
out=${1:?output directory}
section=${2:?section: main, ablation or sweep}
shift 2
bundle=${BUNDLE:-.gpu}
limit=${LIMIT:-520}
archive=results_$section.tgz
source perf/gpu_env.sh  # (also: work, res, step)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

step "evaluate $section (limit ${limit} s)"
# The results files are rewritten after every point: a section cut by the limit keeps its points.
timeout -s INT $limit python3 perf/evaluate.py $section --models qwen3 --out-dir $res/eval "${envflag[@]}" "$@" \
  > $res/evaluate.log 2>&1
echo "exit $?"
tr '\r' '\n' < $res/evaluate.log | grep -E "^(==|!!|wrote|Traceback|[A-Za-z]+Error)|tok/s" | grep -v "req/s" | tail -60
step "done: $out/results_$section.tgz"
