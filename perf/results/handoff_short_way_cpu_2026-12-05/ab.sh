#!/usr/bin/env bash
# The handoff's short way (bc800ea) against its parent (301ac63), served on the CPU with the tiny random pair,
# alternating trees run for run. Run from the repository root with the venv of scripts/setup.sh; the venv's
# editable path (.pth) is pointed at each tree in turn, since the Python-backend stubs import tokenrouter from it.
# Usage: [CONFIG=YAML] [CONCS="1 4"] bash perf/results/handoff_short_way_cpu_2026-12-05/ab.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
cfg=${CONFIG:-config/random/tiny-small_tiny-large.yaml}
mkdir -p "$out"
root=$(pwd)
base=/tmp/handoff-ab-base
rm -rf "$base" && mkdir -p "$base" && git archive 301ac63 backends | tar -x -C "$base"
pth=$(ls .venv/lib/python3*/site-packages/__editable__.tokenrouter-*.pth)
restore() { echo "$root/backends" > "$pth"; }
trap restore EXIT
for rep in 1 2; do
  for variant in base new; do
    [ "$variant" = base ] && echo "$base/backends" > "$pth" || restore
    for c in ${CONCS:-1 4}; do
      tl=$(mktemp -d)
      TOKENROUTER_TIMELINE_DIR=$tl .venv/bin/python perf/soak.py --serve "$cfg" \
        --requests 100 --concurrency $c --cancel-fraction 0 --max-tokens 64 2>&1 | tail -1 \
        | tee "$out/soak_${variant}_c${c}_r${rep}.txt"
      .venv/bin/python perf/timeline.py served "$tl" --out "$out/timeline_${variant}_c${c}_r${rep}" > /dev/null
      rm -f "$out/timeline_${variant}_c${c}_r${rep}/trace.json"
      rm -rf "$tl"
    done
  done
done
