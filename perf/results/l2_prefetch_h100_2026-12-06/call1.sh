# The weights' L2 prefetch (runner/l2_prefetch.py) in one device call: compiled tests; the 0.6B's decode and short
# extends with the prefetch off / last side by side in one process; then served, random p = 0.1 on the GPU's
# deployment, with it off (TOKENROUTER_L2_PREFETCH=off) and on (this tree as it is), one server after the other.
# bash _call/call3.sh OUT
set -uo pipefail
out=$1; mkdir -p $out
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "== $(date -u +%T) tests, compiled"
TRITON_INTERPRET=0 PYTHONPATH=$PWD/backends timeout ${TEST_S:-70} python3 -m pytest -q -p no:cacheprovider \
  tests/test_l2_prefetch.py tests/test_skinny_gemm.py -k "prefetch or l2 or model_skinny" > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; tail -3 $out/gpu_tests.log
echo "== $(date -u +%T) runner: 0.6B, prefetch off / last side by side"
TRITON_INTERPRET=0 PYTHONPATH=$PWD/backends timeout ${RUNNER_S:-130} python3 perf/bench_runner.py --models qwen3-0.6b \
  --no-router --colocate "" --contexts 256,1024 --extends 1x2,8x2,8x10 --extend-context 256 \
  --l2-prefetch ${MODES:-off,last,off,last} --kv-tokens 200000 ${PROFILE:-} --out $out/runner_modes.json > $out/runner_modes.log 2>&1
echo "rc $?"
python3 - $out/runner_modes.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ms = r["models"]
print(r["device"], "replay alone ms (decode b/context) | extend graph ms (BxS over 256)")
print("mode      " + " ".join(f"b{d['batch']}/{d['context']:<5}" for d in ms[0]["decode"])
      + " | " + " ".join(f"{e['batch']}x{e['suffix']:<5}" for e in ms[0]["extend"]))
for m in ms:
    print(f"{m['l2_prefetch']:<9} " + " ".join(f"{d.get('replay_ms') or float('nan'):>8.3f}" for d in m["decode"])
          + " | " + " ".join(f"{e.get('graph_ms') or float('nan'):>7.3f}" for e in m["extend"]))
PY
echo "== $(date -u +%T) served"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
left=$(( 560 - SECONDS ))
timeout $left env BUNDLE=.gpu BUDGET_S=$(( left - 150 )) POINTS="${POINTS:-8:3 16:1 1:1}" bash perf/gpu_served_ab.sh $out/ab \
  config/random/qwen3-0.6b_qwen3-32b$sfx.yaml ${VARIANTS:-off=.,TOKENROUTER_L2_PREFETCH=off last=.,TOKENROUTER_L2_PREFETCH=last} > $out/ab.log 2>&1
echo "ab rc $?"; grep -vE "^\s*$" $out/ab.log | grep -E "^C=|^==|^\| (small|large) " | cut -c1-200 | tail -40
echo "== $(date -u +%T) done"
