# Session 2026-12-06b, call 3: issue 11's other deployments at this tree: R2R (untrained router, threshold 0.5341:
# ~10 % large share) and, on an H200, the three-model mixture (0.6B / 8B / 32B).
set -uo pipefail
out=$1; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
sed 's/^  threshold: 0.5$/  threshold: 0.5341/' config/r2r/qwen3-0.6b_qwen3-32b$sfx.yaml > config/r2r/_cal.yaml
timeout 300 env BUNDLE=.gpu-slim BUDGET_S=10 POINTS="8:3 16:1 1:1" bash perf/gpu_served_ab.sh $out/r2r config/r2r/_cal.yaml \
  r2r=. > $out/r2r.log 2>&1
echo "r2r rc $?"; grep -vE "^\s*$" $out/r2r.log | grep -E "^C=|^==|timeline|^\| (small|large) " | cut -c1-200 | tail -20
if [ -z "$sfx" ]; then
  timeout 240 env BUNDLE=.gpu-slim BUDGET_S=10 POINTS="8:2" bash perf/gpu_served_ab.sh $out/mixture \
    config/mixture/qwen3-0.6b_qwen3-8b_qwen3-32b.yaml mixture=. > $out/mixture.log 2>&1
  echo "mixture rc $?"; grep -vE "^\s*$" $out/mixture.log | grep -E "^C=|^==|timeline|^\| (small|medium|large) " \
    | cut -c1-200 | tail -14
fi
echo "== $(date -u +%T) done"
