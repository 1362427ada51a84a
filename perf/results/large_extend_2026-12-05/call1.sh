# Device call 1: the MPS stop probe, then the 32B's extend steps by token count, carved (48 SMs) and not, with
# extend graphs every 16 tokens up to 256 (the runner: up to 128, then every 64) and the carve-out on all of them.
set -uo pipefail
out=$1; archive=results_call1.tgz; bundle=.gpu-slim
source perf/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step "MPS probe"
source _call/mps_probe.sh
step "32B extends by token count"
python3 perf/bench_runner.py --models qwen3-32b --quick --no-router --colocate '' --cublas-sm-carveout 48,0 \
  --fine-tokens 256 --carve-max-tokens 256 --extend-context 256 \
  --extends 1x10,4x10,4x16,8x8,8x10,8x12,8x14,8x16,10x14,12x12,10x16,12x14,16x10,12x16,16x12,16x14,16x16 \
  --out $res/runner_32b_tokens.json 2>&1 | grep -vE "^\s*$" | grep -E "extend|loaded|decode b=  8|prefill|floor|Error|error" | tail -60
step done
