#!/usr/bin/env bash
# In process (the engine's background mode): a model's loop forwarding its handoffs itself (6ae12d4, since reverted:
# it measured no shorter) against 301ac63, alternating, on the CPU with the tiny random pair. Run from the
# repository root with the venv of
# scripts/setup.sh; PYTHONPATH picks each tree (no stub processes in process).
# Usage: [CONCS="1 4"] bash perf/results/handoff_short_way_cpu_2026-12-05/ab_inprocess.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
base=/tmp/handoff-ab-base
rm -rf "$base" && mkdir -p "$base" && git archive 301ac63 backends | tar -x -C "$base"
for rep in 1 2; do
  for variant in base new; do
    tree=$([ "$variant" = base ] && echo "$base" || pwd)
    for c in ${CONCS:-1 4}; do
      PYTHONPATH=$tree/backends .venv/bin/python perf/timeline.py record \
        --config config/random/tiny-small_tiny-large.yaml --concurrency $c --num-requests 200 --prompt-len 16 \
        --output-len 64 --out "$out/inprocess_${variant}_c${c}_r${rep}" > "$out/inprocess_${variant}_c${c}_r${rep}.log" 2>&1
      rm -f "$out/inprocess_${variant}_c${c}_r${rep}/trace.json"
    done
  done
done
