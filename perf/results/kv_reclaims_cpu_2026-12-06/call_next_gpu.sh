# Planned device call (not run: the device tool could not start a machine for the rest of the 2026-12-06 session).
# Prepare from the repository root: rm -rf .baseline; mkdir .baseline; git archive 15c7937 backends perf config
# ':!perf/results' | tar -x -C .baseline; carry [".gpu-slim", ".baseline"]; run as bash THIS_FILE $OUT.
# Long prompts served on one GPU beyond the KV pools: base (.baseline = 15c7937, before the KV changes) against new
# (this checkout: new requests never take parked KV, and the deployment's KV budget). C=16 (H200: C=32) closed loop.
set -uo pipefail
out=$1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
cfg=config/random/qwen3-0.6b_qwen3-32b.yaml; len=4000; points="32:1"
echo "$gpu" | grep -q H100 && { cfg=config/random/qwen3-0.6b_qwen3-32b_h100.yaml; len=2000; points="16:1"; }
echo "config $cfg; $gpu; prompts of $len tokens; points $points"
PROMPT_LEN=$len BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-230} POINTS="$points" bash perf/gpu_served_ab.sh $out $cfg \
  ${VARIANTS:-base=.baseline new=.} 2>&1 | grep -vE "^\s*$|^\|" | tail -40
for f in /tmp/gpu-*/results/metrics_*.txt; do
  echo "$f:"; grep -E "^tokenrouter_(preemptions_total|kv_reclaims_total|kv_budget_tokens|kv_blocks_total|requests_finished_total)" $f
done
