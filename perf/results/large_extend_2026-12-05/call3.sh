# Device call 3: served side by side, new (extend graphs every 16 tokens up to 256, carve-out up to 112 tokens)
# against base (.baseline = 4cc050f: every 16 up to 128 then 64, carve-out up to 128). The deployment for the GPU
# that came (80 GB: the _h100 config's memory split).
set -uo pipefail
VARIANTS=${VARIANTS:-new=. base=.baseline}
out=$1
cfg=config/random/qwen3-0.6b_qwen3-32b.yaml
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && cfg=config/random/qwen3-0.6b_qwen3-32b_h100.yaml
echo "config $cfg"
BUNDLE=.gpu-slim BUDGET_S=${BUDGET_S:-330} POINTS="${POINTS:-16:3 8:3}" bash perf/gpu_served_ab.sh $out $cfg \
  $VARIANTS 2>&1 | grep -vE "^\s*$" | tail -60
for f in /tmp/gpu-*/results/serve_*.log; do echo "$f: $(grep -c 'did not quit' $f) MPS warnings"; done
