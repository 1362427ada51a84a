#!/usr/bin/env bash
# Device call 1 (2026-12-05): flat-extend-grid (this checkout) against main (.baseline): compiled attention tests,
# attention per layer (this checkout's benchmark against each tree), then both served side by side.
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
res=/tmp/call2; mkdir -p $res
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar -czf $OUT/call2.tgz -C /tmp call2; }
trap pack EXIT
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
stamp "tests, compiled"
PYTHONPATH=$PWD/backends timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_pdl.py > $res/gpu_tests.log 2>&1
echo "pytest exit code $?" >> $res/gpu_tests.log; tail -3 $res/gpu_tests.log
cp perf/bench_attention.py .baseline/perf/bench_attention_run.py
for name in new; do
  root=$PWD; script=perf/bench_attention.py; [ $name = base ] && root=$PWD/.baseline script=perf/bench_attention_run.py
  stamp "attention per layer, $name"
  (cd $root && timeout 70 python3 $script --tiles '' --batches 1,2,4,8,12 --contexts 256,1024,8192 \
    --out $res/attn_$name.json) > $res/attn_$name.log 2>&1
done
grep -E " on " $res/attn_new.log | cut -c1-95
stamp "served"
BUNDLE=.gpu-slim BUDGET_S=230 POINTS="8:5 16:1 1:1" bash perf/gpu_served_ab.sh $res \
  config/random/qwen3-0.6b_qwen3-32b.yaml new=. base=.baseline 2>&1 | tail -40
stamp done
