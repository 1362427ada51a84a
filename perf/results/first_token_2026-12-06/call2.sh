# Session 2026-12-06b, call 2: a first token is never held by delayed batching (new = this tree) against HEAD 757962a
# (base = .baseline), served side by side on one GPU, random p=0.1; then the top-k tests compiled, verbose.
set -uo pipefail
out=$1; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
timeout 420 env BUNDLE=.gpu-slim BUDGET_S=200 POINTS="${POINTS:-8:4 16:2}" bash perf/gpu_served_ab.sh $out/ab \
  config/random/qwen3-0.6b_qwen3-32b$sfx.yaml ${VARIANTS:-base=.baseline new=.} > $out/ab.log 2>&1
echo "ab rc $?"; grep -vE "^\s*$" $out/ab.log | grep -E "^C=|^==|timeline|^\| (small|large) " | cut -c1-200 | tail -40
echo "== $(date -u +%T) compiled top-k tests"
TRITON_INTERPRET=0 PYTHONPATH=$PWD/backends timeout 90 python3 -m pytest -q -p no:cacheprovider -rA tests/test_top_k.py \
  > $out/top_k_tests.log 2>&1
echo "pytest rc $?"; grep -E "^PASSED|^FAILED|^ERROR|passed|failed" $out/top_k_tests.log | tail -14
echo "== $(date -u +%T) done"
