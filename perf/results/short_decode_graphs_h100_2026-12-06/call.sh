# Decode graphs captured a second time for contexts of at most 384 keys on one KV split (this tree) against HEAD
# 06ea834 (.baseline): the 0.6B's decode steps side by side (this checkout's bench_runner against each tree's
# runner, base first, then new, then base and new again), then the changed tests compiled.
set -uo pipefail
out=$1; mkdir -p $out
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for f in bench_runner; do cp perf/$f.py .baseline/perf/${f}_run.py; cp perf/$f.py perf/${f}_run.py; done
run() {  # name tree
  echo "== $(date -u +%T) $1"
  (cd $2 && PYTHONPATH=$PWD/backends timeout ${RUN_S:-55} python3 perf/bench_runner_run.py --models qwen3-0.6b --no-router \
    --colocate '' --contexts 256,1024 --decode-only --kv-tokens 200000 ${PROFILE:-} --out $out/runner_$1.json) \
    > $out/runner_$1.log 2>&1
  echo "rc $?"; grep -E "captured" $out/runner_$1.log | cut -c1-160
}
run base .baseline; run new .; run base2 .baseline; run new2 .
python3 - $out <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for name in ("base", "new", "base2", "new2"):
    try:
        rows[name] = json.load(open(f"{out}/runner_{name}.json"))["models"][0]["decode"]
    except Exception as e:
        print(name, e)
first = next(iter(rows.values()))
print("replay alone ms " + " ".join(f"b{d['batch']}/{d['context']:<5}" for d in first))
for name, ds in rows.items():
    print(f"{name:<15} " + " ".join(f"{d.get('replay_ms') or float('nan'):>8.3f}" for d in ds))
for d in rows.get("new2", []):
    p = d.get("profile")
    if p:
        print(f"new2 b{d['batch']}/{d['context']}: {p['kernels']:.0f} kernels, {p['kernel_ms']:.2f} ms")
PY
echo "== $(date -u +%T) tests, compiled"
PYTHONPATH=$PWD/backends timeout ${TEST_S:-40} python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_cuda_graph_runner.py > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; tail -3 $out/gpu_tests.log
echo "== $(date -u +%T) done"
