# device call: the one-kernel MLP's kernel bench, then served with it forced on against off (H100 deployment)
set -uo pipefail
out=$1
MODES="" TEST_S=${TEST_S:-100} bash perf/gpu_mlp.sh $out 2>&1 | grep -v OutOfResources | tail -14
cfg=${CFG:-config/random/qwen3-0.6b_qwen3-32b_h100.yaml}
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-300} POINTS="${POINTS:-8:3 16:1}" bash perf/gpu_served_ab.sh $out $cfg \
  fused=.,TOKENROUTER_FUSED_MLP=1 two=.,TOKENROUTER_FUSED_MLP=0 2>&1 | grep -vE "^\s*$" | tail -60
