# Session 2026-12-06b, call 4: issue 11's "auto thresholds >= thresholds 1", served at this tree: the random
# deployment as committed (thresholds auto) against the same with thresholds 1 (no model ever held).
set -uo pipefail
out=$1; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
cfg=config/random/qwen3-0.6b_qwen3-32b$sfx.yaml
sed 's/^  thresholds: auto$/  thresholds: 1/' $cfg > config/random/_t1.yaml
grep -n "thresholds" config/random/_t1.yaml
timeout 250 env BUNDLE=.gpu-slim BUDGET_S=120 POINTS="8:2 16:1" bash perf/gpu_served_ab.sh $out/ab $cfg \
  auto=. t1=.,CONFIG=config/random/_t1.yaml > $out/ab.log 2>&1
echo "ab rc $?"; grep -vE "^\s*$" $out/ab.log | grep -E "^C=|^==|timeline|^\| (small|large) " | cut -c1-200 | tail -30
echo "== $(date -u +%T) done"
