# Device call 1: the router's pieces compiled and profiled, this tree against .baseline (4fa8795, session start).
set -uo pipefail
out=$1
mkdir -p $out
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
echo "== compiled tests"
PYTHONPATH=$PWD/backends timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_top_k.py \
  tests/test_router_skinny.py "tests/test_fused_ops.py::test_layer_norm_dot_matches_torch" 2>&1 | tail -12
for b in 8 1 16; do
  for tree in . .baseline; do
    echo "== profile_step --router b=$b tree=$tree"
    (cd $tree && PYTHONPATH=$PWD/backends timeout 150 python3 perf/profile_step.py --model qwen3-0.6b --batch $b \
      --router 2>&1 | grep -vE "Warning|warn_once" | head -16) | tee -a $out/profile_router.log
  done
done
echo "== profile_step without router b=8"
PYTHONPATH=$PWD/backends timeout 150 python3 perf/profile_step.py --model qwen3-0.6b --batch 8 2>&1 \
  | grep -vE "Warning|warn_once" | head -4 | tee -a $out/profile_router.log
