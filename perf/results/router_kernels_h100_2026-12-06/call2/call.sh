# Device call 2: the top-k kernels at 1,024 keys a program (compiled tests, the b8 profile), then R2R served side by
# side: base (.baseline = 4fa8795, session start) first, then this tree; threshold 0.5341 (~10 % large share with
# the untrained router, perf/results/served_h200_2026-12-04).
set -uo pipefail
out=$1
mkdir -p $out
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
cfg=config/r2r/qwen3-0.6b_qwen3-32b.yaml
echo "$gpu" | grep -q H100 && cfg=config/r2r/qwen3-0.6b_qwen3-32b_h100.yaml
sed 's/^  threshold: 0.5$/  threshold: 0.5341/' $cfg > config/r2r/_cal.yaml
grep -A3 "^policy" config/r2r/_cal.yaml
(TRITON_INTERPRET=0 PYTHONPATH=$PWD/backends timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_top_k.py 2>&1 | tail -2)
PYTHONPATH=$PWD/backends timeout 100 python3 perf/profile_step.py --model qwen3-0.6b --batch 8 --router 2>&1 \
  | grep -vE "Warning|warn_once|checkpoint" | head -14 | tee $out/profile_router_b8.log
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-300} POINTS="${POINTS:-8:3}" bash perf/gpu_served_ab.sh $out config/r2r/_cal.yaml \
  ${VARIANTS:-base=.baseline new=.} 2>&1 | grep -vE "^\s*$" | tail -60
