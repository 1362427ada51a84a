# The 0.6B's decode step with weight prefetch and early release (PDL) against PDL as before, one device call.
# bash _call/runner.sh OUT   (repository root, the GPU image's Python as it is)
set -uo pipefail
out=$1; mkdir -p $out
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/backends
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "== $(date -u +%T) runner: 0.6B decode, PDL modes side by side"
timeout ${RUNNER_S:-300} python3 perf/bench_runner.py --models qwen3-0.6b --no-router --colocate "" --contexts 256,1024 \
  --decode-only --profile --pdl ${MODES:-wait,on,prefetch,release,wait,on} --out $out/runner_modes.json \
  > $out/runner_modes.log 2>&1
echo "rc $?"
grep -E "PDL|Kernels of one" $out/runner_modes.log | cut -c1-220
python3 - $out/runner_modes.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("mode      " + " ".join(f"b{d['batch']}/{d['context']:<5}" for d in r["models"][0]["decode"]))
for m in r["models"]:
    print(f"{m['pdl']:<9} " + " ".join(f"{d.get('replay_ms', float('nan')):>8.3f}" for d in m["decode"]))
PY
echo "== $(date -u +%T) tests, compiled"
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_skinny_gemm.py \
  tests/test_gpu_runner.py -k "pdl or prefetched or deterministic or batch or model_skinny or qk_rope_epilogue or greedy or routed_generation" \
  > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; tail -3 $out/gpu_tests.log
echo "== $(date -u +%T) done"
