# bench_runner's report per model and shape on one GPU (issue 12, point 3): the 0.6B with skinny matmuls and on
# cuBLAS side by side, R2R's router in the graph, and the 32B (cuBLAS, 48 SMs carved out as deployed), each decode
# case with its kernel breakdown (--profile), against the weight-read floor.
set -uo pipefail
out=$1; mkdir -p $out
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/backends
nvidia-smi --query-gpu=name --format=csv,noheader; echo "== $(date -u +%T) 0.6B"
timeout ${S06:-230} python3 perf/bench_runner.py --models qwen3-0.6b --skinny-gemm both --profile --colocate '' \
  --contexts 256,1024 --extends 1x2,8x2,8x10 --extend-context 256 --kv-tokens 200000 --out $out/runner_0.6b.json \
  > $out/runner_0.6b.log 2>&1
echo "rc $?"; grep -E "^\| (1|8|16) \| 1024 \| [0-9]+ \||^## " $out/runner_0.6b.log | cut -c1-230
echo "== $(date -u +%T) 32B"
timeout ${S32:-300} python3 perf/bench_runner.py --models qwen3-32b --profile --colocate '' --contexts 1024 \
  --extends 1x2,8x2,8x10 --kv-tokens 24000 --cublas-sm-carveout 48 --out $out/runner_32b.json > $out/runner_32b.log 2>&1
echo "rc $?"; grep -E "^\| [0-9]+ \| 1024 \||^## " $out/runner_32b.log | cut -c1-230
echo "== $(date -u +%T) done"
