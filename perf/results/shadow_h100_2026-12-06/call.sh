# Session 2026-12-06c: shadow decoding on against off, served side by side on one GPU (issue 11).
# Usage: bash _call/call.sh OUT POLICY [POINTS]   POLICY: r2r (threshold 0.5341, ~10 % large share) | random (p = 0.1)
set -uo pipefail
out=$1; policy=$2; points=${3:-"8:3 16:1 1:1"}; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
src=config/$policy/qwen3-0.6b_qwen3-32b$sfx.yaml
sed 's/^  threshold: 0.5$/  threshold: 0.5341/' $src > config/$policy/_on.yaml
sed 's/^    max_model_len: 16384$/&\n    shadow_decode: false/' config/$policy/_on.yaml > config/$policy/_off.yaml
grep -c "shadow_decode: false" config/$policy/_off.yaml; grep "threshold:" config/$policy/_on.yaml
timeout 560 env BUNDLE=.gpu BUDGET_S=${BUDGET_S:-240} POINTS="$points" FIRST=${FIRST:-0} bash perf/gpu_served_ab.sh $out/ab \
  config/$policy/_on.yaml ${VARIANTS:-on=.,CONFIG=config/$policy/_on.yaml off=.,CONFIG=config/$policy/_off.yaml} > $out/ab.log 2>&1
echo "ab rc $?"; grep -vE "^\s*$" $out/ab.log | grep -E "^C=|^==|ready|shadow|^\| (small|large) " | cut -c1-220 | tail -40
mkdir -p /tmp/m && tar -C /tmp/m -xzf $out/ab/results_served_ab.tgz --wildcards "results/metrics_*" 2> /dev/null
grep -H "^tokenrouter_shadow\|^tokenrouter_steps_total" /tmp/m/results/metrics_*.txt 2> /dev/null | cut -c1-160
echo "== $(date -u +%T) done"
