#!/usr/bin/env bash
# One device call: the branch's compiled graph tests (TESTS_FIRST=1: first, at most 150 s), then served A/B of
# main (new), short-context-graphs (scg) and 301ac63 (base), then (TESTS_FIRST unset) the tests with the time left.
t0=$(date +%s)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
cfg=config/random/qwen3-0.6b_qwen3-32b.yaml
[ "$mem" -lt 100000 ] && cfg=config/random/qwen3-0.6b_qwen3-32b_h100.yaml
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; echo "config $cfg"
# the branch tree serves from this checkout's config folder (the H100 config is new on main)
cp -n config/random/*.yaml .scg/config/random/
gpu_tests() {
  echo "== compiled graph tests of the branch, $1 s"
  (cd .scg && PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 timeout $1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_graph_runner.py tests/test_triton_attention.py 2>&1 | tail -15)
}
[ "${TESTS_FIRST:-0}" = 1 ] && gpu_tests ${TESTS_S:-150}
left=$(( ${TOTAL_S:-585} - ($(date +%s) - t0) - ${TESTS_AFTER_S:-0} ))
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-330} FIRST=1 POINTS="${POINTS:-8:3 16:1 1:1}" timeout $left \
  bash perf/gpu_served_ab.sh $OUT $cfg ${VARIANTS:-new=. scg=.scg base=.baseline} 2>&1 | grep -v "^\s*$" | tail -70
left=$(( ${TOTAL_S:-585} - ($(date +%s) - t0) ))
[ "${TESTS_FIRST:-0}" != 1 ] && [ $left -gt 30 ] && gpu_tests $left
echo "== done after $(( $(date +%s) - t0 )) s"
