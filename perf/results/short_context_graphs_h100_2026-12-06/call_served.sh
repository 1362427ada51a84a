# Served side by side on one GPU: new (HEAD: a batch size's mean step time pooled with 8 steps on the trend line)
# against base (.baseline = c840342: raw means). perf/results/tuner_trend_2026-12-05/call_next.sh's call, from here.
set -uo pipefail
out=$1
cfg=config/random/qwen3-0.6b_qwen3-32b.yaml
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && cfg=config/random/qwen3-0.6b_qwen3-32b_h100.yaml
echo "config $cfg; $(nvidia-smi --query-gpu=name --format=csv,noheader)"
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-300} POINTS="${POINTS:-16:5 8:3 1:2}" bash perf/gpu_served_ab.sh $out $cfg \
  ${VARIANTS:-base=.baseline new=.} 2>&1 | grep -vE "^\s*$" | tail -70
# The 32B's hold (threshold) over its steps in each point's window, per server.
for tl in /tmp/gpu-*/tl_*; do
  name=${tl##*/tl_}
  for run in c16 c8 c1; do
    PYTHONPATH=perf python3 -c "import sys, json, collections; from pathlib import Path; from timeline import read_events, event_time
r = json.load(open(sys.argv[2]))['results']
for x in r:
    lo, hi = x['monotonic_since'], x['monotonic_until']
    c = collections.Counter(e.get('threshold') for e in read_events(Path(sys.argv[1]))
                            if e['kind'] == 'step' and e['model'] == 'large' and lo <= event_time(e) <= hi)
    print(sys.argv[3], 'C=%s' % x.get('concurrency'), '%.1f tok/s' % x['output_tok_s'], 'large steps by threshold:', sorted(c.items()))
" $tl /tmp/gpu-*/results/served_${name}_$run.json $name 2>&1 | tail -6
  done
done
