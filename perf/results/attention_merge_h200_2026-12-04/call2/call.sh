#!/usr/bin/env bash
# Device call 2: the single-pass in-kernel merge (new) against d377bee (.baseline): compiled tests, attention per
# layer at served contexts, an extend split sweep, both models' steps. Everything lands in $OUT/call2.tgz.
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
res=/tmp/call2; mkdir -p $res
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar -czf $OUT/call2.tgz -C /tmp call2; }
trap pack EXIT
stamp "tests, compiled"
PYTHONPATH=$PWD/backends timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_pdl.py tests/test_cuda_graph_runner.py > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log; tail -2 $res/gpu_tests.log
args="--tiles '' --batches 1,2,4,8,12 --contexts 256,1024,8192"
for name in new base new2 base2; do
  root=$PWD; [[ $name == base* ]] && root=$PWD/.baseline
  stamp "attention per layer, $name"
  (cd $root && timeout 60 python3 perf/bench_attention.py --tiles '' --batches 1,2,4,8,12 --contexts 256,1024,8192 \
    --out $res/attn_$name.json) > $res/attn_$name.log 2>&1
done
paste -d'|' <(grep -E " on " $res/attn_base.log | cut -c1-95) <(grep -E " on " $res/attn_new.log | sed 's/.*floor/floor/' | cut -c1-60)
stamp "extend split sweep, new"
timeout 120 python3 perf/bench_attention.py --tiles 64x64x2x4 --splits 1,2,3,4,6,8,16 --batches 1,2,4,8 \
  --contexts 256,1024 --out $res/attn_sweep.json > $res/attn_sweep.log 2>&1
grep -E "best" $res/attn_sweep.log | cut -c1-250
for name in new base; do
  root=$PWD; [ $name = base ] && root=$PWD/.baseline
  stamp "steps, $name"
  (cd $root && timeout 150 python3 perf/bench_runner.py --models qwen3-0.6b,qwen3-32b --quick --no-router \
    --colocate '' --profile --out $res/runner_$name.json) > $res/runner_$name.log 2>&1
  grep -E "decode b=  [18] ctx= 1024|extend [18]x10|Kernels" $res/runner_$name.log | cut -c1-160
done
stamp done
