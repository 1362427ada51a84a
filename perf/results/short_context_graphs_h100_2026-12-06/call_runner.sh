# Short-context extend graphs (HEAD) against HEAD~1 (.baseline): the 32B's and the 0.6B's extend steps over 256 keys
# (unsplit graph on new) and 1024 keys (split graph on both: the control), one device call; then compiled tests.
set -uo pipefail
out=$1; mkdir -p $out
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for name in base new; do
  root=.baseline; [ $name = new ] && root=$PWD
  cp perf/bench_runner.py $root/perf/bench_runner_run.py; cp perf/kernel_profile.py $root/perf/ 2>/dev/null
  for ctx in ${CTXS:-256}; do
    echo "== $(date -u +%T) $name, extends over $ctx keys"
    (cd $root && PYTHONPATH=$root/backends timeout 170 python3 perf/bench_runner_run.py --models qwen3-32b,qwen3-0.6b \
      --quick --no-router --colocate "" --contexts $ctx --cublas-sm-carveout 48 --kv-tokens ${KV:-20000} \
      --extends 1x10,4x10,6x11,8x10,12x10,16x10 --extend-context $ctx --out $out/ext_${name}_$ctx.json) \
      > $out/ext_${name}_$ctx.log 2>&1
    echo "rc $?"; grep -E "captured|extend" $out/ext_${name}_$ctx.log | grep -v "^#" | cut -c1-120
  done
  rm -f $root/perf/bench_runner_run.py
done
echo "== $(date -u +%T) tests, compiled"
PYTHONPATH=$PWD/backends timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph_runner.py \
  tests/test_gpu_runner.py tests/test_skinny_gemm.py -k "cuda_graph or greedy_matches or routed_generation or model_skinny_path" \
  > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; grep -E "^FAILED|passed|failed" $out/gpu_tests.log | tail -12
echo "== $(date -u +%T) done"
