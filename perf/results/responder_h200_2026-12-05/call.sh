#!/usr/bin/env bash
# One device call: main (new, the merging responder) against f986d6e~1 (prev), served, C=16 x3, C=8 x3, C=1.
t0=$(date +%s)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
cfg=config/random/qwen3-0.6b_qwen3-32b.yaml
[ "$mem" -lt 100000 ] && cfg=config/random/qwen3-0.6b_qwen3-32b_h100.yaml
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; echo "config $cfg"
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-300} FIRST=1 POINTS="${POINTS:-16:3 8:3 1:1}" timeout ${TOTAL_S:-570} \
  bash perf/gpu_served_ab.sh $OUT $cfg ${VARIANTS:-new=. prev=.prev} 2>&1 | grep -v "^\s*$" | tail -90
echo "== done after $(( $(date +%s) - t0 )) s"
