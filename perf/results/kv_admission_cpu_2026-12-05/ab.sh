#!/usr/bin/env bash
# Whole-prompt admission (this tree) against the tree before it (BASE: a revision), served on the
# CPU: served_pressure.py for each tree in turn, alternating. The venv's editable path (.pth) is pointed at each
# tree in turn, since the Python-backend stubs import tokenrouter from it. From the repository root:
#   BASE=REV [N=12] [KV=32768] [REPS=1] bash perf/results/kv_admission_cpu_2026-12-05/ab.sh
set -euo pipefail
root=$(pwd)
base=/tmp/kv-admission-base
rm -rf "$base" && mkdir -p "$base" && git archive "${BASE:?base revision}" backends | tar -x -C "$base"
pth=$(ls .venv/lib/python3*/site-packages/__editable__.tokenrouter-*.pth)
restore() { echo "$root/backends" > "$pth"; }
trap restore EXIT
for rep in $(seq ${REPS:-1}); do
  for variant in base new; do
    [ "$variant" = base ] && echo "$base/backends" > "$pth" || restore
    echo "$variant, run $rep:"
    .venv/bin/python perf/results/kv_admission_cpu_2026-12-05/served_pressure.py ${N:-12} ${KV:-32768} 2>&1 | tail -1
  done
done
