# Session 2026-12-06d: KV age order (3a4dd47) against its parent (52bbe36, .baseline), served on one GPU with requests
# that together outgrow the 32B's KV pool (~24k tokens on the H100 deployment): 16 concurrent streams of 100-token
# prompts and OUTPUT_LEN output tokens (random p = 0.1, thresholds auto).
# Usage: bash _call/call.sh OUT [OUTPUT_LEN]
set -uo pipefail
out=$1; olen=${2:-3000}; mkdir -p $out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu $(date -u +%T)"
sfx=""; echo "$gpu" | grep -q H100 && sfx=_h100
# The pools of the H100 deployment on either GPU (the H200's hold ~10x more): 28,672 and 24,576 tokens.
cfg=config/random/_pressure.yaml
python3 - config/random/qwen3-0.6b_qwen3-32b$sfx.yaml $cfg <<'PY'
import sys, yaml
d = yaml.safe_load(open(sys.argv[1]))
d["models"]["small"]["kv_cache_tokens"], d["models"]["large"]["kv_cache_tokens"] = 28672, 24576
for m in d["models"].values():
    m["path"] = "../../perf/models/" + m["path"].rsplit("/", 1)[1]
d["tokenizer"] = "../../models/bench-tokenizer"
yaml.safe_dump(d, open(sys.argv[2], "w"), sort_keys=False)
PY
grep -n "kv_cache_tokens\|path\|tokenizer" $cfg
timeout 575 env BUNDLE=.gpu BUDGET_S=${BUDGET_S:-330} POINTS="${POINTS:-16:1}" OUTPUT_LEN=$olen NUM_REQUESTS=${NUM_REQUESTS:-16} \
  POINT_TIMEOUT=${POINT_TIMEOUT:-170} bash perf/gpu_served_ab.sh $out/ab $cfg ${VARIANTS:-new=. base=.baseline} \
  > $out/ab.log 2>&1
echo "ab rc $?"; grep -vE "^\s*$" $out/ab.log | grep -E "^C=|^==|ready|skipped|exit" | cut -c1-220 | tail -30
mkdir -p /tmp/m && tar -C /tmp/m -xzf $out/ab/results_served_ab.tgz --wildcards "results/metrics_*" 2> /dev/null
grep -H "^tokenrouter_kv_reclaims_total\|^tokenrouter_preemptions_total\|^tokenrouter_kv_blocks_total\|^tokenrouter_kv_budget" \
  /tmp/m/results/metrics_*.txt 2> /dev/null | cut -c1-160
echo "== $(date -u +%T) done"
