#!/usr/bin/env bash
# One device call: the in-kernel split merge (new) against d377bee (.baseline): compiled tests, attention per
# layer, an extend split sweep, and both models' steps.
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:?}
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
stamp "tests, compiled"
PYTHONPATH=$PWD/backends timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_pdl.py tests/test_cuda_graph_runner.py > $out/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $out/gpu_tests.log; tail -3 $out/gpu_tests.log
for name in base new new2 base2; do
  root=$PWD; [[ $name == base* ]] && root=$PWD/.baseline
  stamp "attention per layer, $name"
  (cd $root && timeout 60 python3 perf/bench_attention.py --tiles '' --out $out/attn_$name.json) > $out/attn_$name.log 2>&1
  grep -E "on (1024|8192)" $out/attn_$name.log | cut -c1-100
done
stamp "extend split sweep, new"
timeout 90 python3 perf/bench_attention.py --tiles 64x64x2x4 --splits 1,2,3,4,6,8,12,16 --out $out/attn_sweep.json \
  > $out/attn_sweep.log 2>&1; grep -A3 "geometric" $out/attn_sweep.log | cut -c1-300
for name in new base; do
  root=$PWD; [ $name = base ] && root=$PWD/.baseline
  stamp "steps, $name"
  (cd $root && timeout 170 python3 perf/bench_runner.py --models qwen3-0.6b,qwen3-32b --quick --no-router \
    --colocate '' --profile --out $out/runner_$name.json) > $out/runner_$name.log 2>&1
  grep -E "captured|decode b=  [18] ctx= 1024|extend 8x10|Kernels" $out/runner_$name.log | cut -c1-200
done
stamp done
