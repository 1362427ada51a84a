#!/usr/bin/env bash
# One GPU-machine session for the runner: correctness tests compiled on the GPU, then the runner benchmark.
# Usage (repository root, on the GPU machine): bash perf/gpu_session.sh OUT_DIR [tests|bench|all] [bench args...]
# Results: OUT_DIR/gpu_tests.log (pytest), OUT_DIR/runner.json + runner.md (bench_runner).
set -uo pipefail
out=${1:?output directory}
what=${2:-all}
shift 2 || shift $#
mkdir -p "$out"
export PYTHONPATH=$PWD/backends TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(0))
PY
if [[ $what == tests || $what == all ]]; then
  {
    echo "# Command: TRITON_INTERPRET=0 PYTHONPATH=backends python3 -m pytest -q -rsP tests/test_gpu_runner.py" \
         "tests/test_cuda_graph_runner.py tests/test_fused_ops.py tests/test_triton_attention.py"
    echo "# Machine: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F)"
    timeout 420 python3 -m pytest -q -rsP -p no:cacheprovider tests/test_gpu_runner.py tests/test_cuda_graph_runner.py \
      tests/test_fused_ops.py tests/test_triton_attention.py 2>&1
  } | tee "$out/gpu_tests.log" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  python3 perf/bench_runner.py --out "$out/runner.json" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^|" | tail -80
fi
