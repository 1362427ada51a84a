# device call 3 (H100): R2R served on the H100 deployment, its router's matmuls through the skinny kernel (the H100
# table) against cuBLAS (router_kernel: torch); threshold 0.5341 for a ~10 % large share with the untrained router
# (../served_h200_2026-12-04); a served soak on the first variant's server.
set -uo pipefail
out=$1
mkdir -p $out
cfg=config/r2r/qwen3-0.6b_qwen3-32b_h100.yaml
sed 's/^  threshold: 0.5$/  threshold: 0.5341/' $cfg > config/r2r/_cal_h100.yaml
sed 's/^  threshold: 0.5$/  threshold: 0.5341\n  router_kernel: torch/' $cfg > config/r2r/_cal_h100_torch.yaml
grep -A4 "^policy" config/r2r/_cal_h100_torch.yaml
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-300} FIRST=1 SOAK=${SOAK:-300} POINTS="${POINTS:-8:3 1:2 16:1}" \
  bash perf/gpu_served_ab.sh $out config/r2r/_cal_h100.yaml \
  skinny=. torch=.,CONFIG=config/r2r/_cal_h100_torch.yaml 2>&1 | grep -vE "^\s*$" | tail -80
