# device call 2 (H100): the skinny kernels' tests compiled, then served: this tree (the H100 table) against e12f636
set -uo pipefail
out=$1
mkdir -p $out
PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 timeout ${TEST_S:-90} python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_skinny_gemm.py > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; tail -3 $out/gpu_tests.log
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-330} POINTS="${POINTS:-8:3 1:3 16:1}" bash perf/gpu_served_ab.sh $out \
  config/random/qwen3-0.6b_qwen3-32b_h100.yaml table=. base=.baseline 2>&1 | grep -vE "^\s*$" | tail -70
