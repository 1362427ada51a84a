# Planned device call (not run: no device was lent in the session that wrote it). Served side by side on one GPU:
# new (a batch size's mean step time pooled with 8 steps on the trend line) against base (.baseline = c840342, raw
# means). Five C=16 runs each, alternating which variant is served first is up to the caller (VARIANTS). Prepare
# from the repository root: rm -rf .baseline; mkdir .baseline; git archive c840342 backends perf config
# ':!perf/results' | tar -x -C .baseline; carry [".gpu-slim", ".baseline"]. Later commits also changed KV admission
# (whole prompts, dbb0094), which cannot bind here: 100-token prompts in pools sized for the 32B.
set -uo pipefail
# The same served A/B as ../large_extend_2026-12-05/call3.sh (config by GPU, the slim bundle), with more C=16 runs.
BUDGET_S=${BUDGET_S:-340} POINTS="${POINTS:-16:5 8:2}" bash perf/results/large_extend_2026-12-05/call3.sh "$1"
# The 32B's threshold over each server's steps (the question this call answers: does the hold at C=16 still vary?)
for tl in /tmp/gpu-*/tl_*; do
  PYTHONPATH=perf python3 -c "import sys, collections; from pathlib import Path; from timeline import read_events
c = collections.Counter(e['threshold'] for e in read_events(Path(sys.argv[1])) if e['kind'] == 'step' and e['model'] == 'large')
print(sys.argv[1], 'large steps by threshold:', sorted(c.items()))" $tl
done
