# Does L2 residency pay for the 0.6B's matmuls at 8 rows, and does the side-stream prefetch get the weights there?
set -uo pipefail
out=$1; mkdir -p $out
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/backends
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 _call/l2_probe.py 2>&1 | tee $out/l2_probe.log | grep -v Warning
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py > $out/gpu_tests.log 2>&1
echo "pytest rc $?"; tail -2 $out/gpu_tests.log
