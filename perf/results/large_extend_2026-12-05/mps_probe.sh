# Why does an MPS daemon that serve started take 30 s to quit? (1) Which CUDA call makes a process the daemon's
# client: each mode runs in a process that stays alive while it asks the daemon to quit. (2) A real serve of two
# 0.6B models on one GPU, stopped with SIGINT, the processes listed every 0.5 s until serve exits.
# Needs gpu_env.sh sourced (serve, envflag, res, work).
quit_daemon() { echo quit | timeout 20 nvidia-cuda-mps-control > /dev/null 2>&1; for _ in $(seq 1 20); do pgrep -f nvidia-cuda-mps > /dev/null || return 0; sleep 0.5; done; pkill -9 -f nvidia-cuda-mps; }
quit_daemon
for mode in nothing device_count is_available mem_get_info; do
  nvidia-cuda-mps-control -d
  python3 - $mode <<'PY' 2>&1 | tee -a $res/mps_probe.log
import subprocess, sys, time
mode = sys.argv[1]
import torch
if mode == "device_count": print("device_count", torch.cuda.device_count())
if mode == "is_available": print("is_available", torch.cuda.is_available())
if mode == "mem_get_info": print("mem_get_info", torch.cuda.mem_get_info())
t = time.monotonic()
try:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, capture_output=True, timeout=12)
    print(f"{mode}: quit returned after {time.monotonic() - t:.2f} s")
except subprocess.TimeoutExpired:
    print(f"{mode}: quit still waiting after 12 s (this process is the daemon's client)")
PY
  quit_daemon
done
cat > config/_mps_probe.yaml <<'YAML'
models:
  small: {path: ../perf/models/qwen3-0.6b, load_format: dummy, dtype: bfloat16, device: cuda:0, kv_memory_fraction: 0.05, max_model_len: 4096}
  large: {path: ../perf/models/qwen3-0.6b, load_format: dummy, dtype: bfloat16, device: cuda:0, kv_memory_fraction: 0.05, max_model_len: 4096}
entry: small
tokenizer: ../models/bench-tokenizer
policy: {name: random, p: 0.1, seed: 0}
YAML
if serve config/_mps_probe.yaml $work/repo_probe $res/mps_probe_serve.log; then
  python3 perf/bench_served.py --url 127.0.0.1:8001 --config config/_mps_probe.yaml --prompt-len 20 --output-len 16 \
    --concurrency 2 --warmup 0 --out $res/mps_probe_bench 2>&1 | grep "^C="
  kill -INT $server_pid
  t0=$(date +%s.%N)
  while kill -0 $server_pid 2> /dev/null; do
    echo "== +$(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
    ps -eo pid,ppid,stat,etimes,args --sort=pid | grep -E "tritonserver|triton_python|mps|tokenrouter.cli" | grep -v grep | cut -c1-160
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
    sleep 0.5
  done > $res/mps_probe_stop.log 2>&1
  echo "serve stopped after $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"; tail -5 $res/mps_probe_serve.log
else
  echo "probe server not ready"; tail -20 $res/mps_probe_serve.log
fi
quit_daemon
