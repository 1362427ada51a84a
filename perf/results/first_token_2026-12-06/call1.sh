# Session 2026-12-06b, call 1: HEAD (757962a) on the device as it is. Compiled tests of the kernels never run on a GPU
# in their final form (top-k's integer-key sort), then issue 11's served table at HEAD: random p=0.1 (C=8 x5, C=16 x3,
# C=1 x3, first 32 requests of a fresh server), R2R at threshold 0.5341 (C=8 x3), the mixture (C=8 x2, H200 only).
set -uo pipefail
out=$1; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
rcfg=config/random/qwen3-0.6b_qwen3-32b$sfx.yaml
sed 's/^  threshold: 0.5$/  threshold: 0.5341/' config/r2r/qwen3-0.6b_qwen3-32b$sfx.yaml > config/r2r/_cal.yaml
echo "== $(date -u +%T) compiled tests"
TRITON_INTERPRET=0 PYTHONPATH=$PWD/backends timeout ${TEST_S:-130} python3 -m pytest -q -p no:cacheprovider \
  tests/test_top_k.py tests/test_router_skinny.py tests/test_fused_ops.py tests/test_cuda_graph_runner.py \
  tests/test_gpu_runner.py -k "not slow" > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; grep -E "^FAILED|^ERROR|passed|failed" $out/gpu_tests.log | tail -12
echo "== $(date -u +%T) served random"
BUNDLE=.gpu-slim BUDGET_S=400 FIRST=1 POINTS="${POINTS:-8:5 16:3 1:3}" bash perf/gpu_served_ab.sh $out/random $rcfg \
  random=. 2>&1 | grep -vE "^\s*$" | tail -30
others="r2r=.,CONFIG=config/r2r/_cal.yaml"
[ -z "$sfx" ] && others="$others mixture=.,CONFIG=config/mixture/qwen3-0.6b_qwen3-8b_qwen3-32b.yaml"
echo "== $(date -u +%T) served r2r, mixture"
BUNDLE=.gpu-slim BUDGET_S=150 POINTS="8:3" bash perf/gpu_served_ab.sh $out/others $rcfg $others 2>&1 \
  | grep -vE "^\s*$" | tail -30
echo "== $(date -u +%T) done"
