# Sourced by perf/gpu_*.sh on a GPU machine as it is (its image's Python, no package index): installs what
# BUNDLE (perf/make_gpu_bundle.sh) carries, puts this checkout on the image Python's path, builds the
# benchmark tokenizer, and, when the image has numpy 2, a stub environment with numpy<2 for the Triton stubs
# (Triton 2.51's Python backend corrupts string tensors with numpy 2). Sets: tr (the unpacked bundle),
# TRITONSERVER_ROOT, envflag (the --execution-env arguments for the stubs, empty when not needed), and the
# functions serve / stop_server (below).
# Needs: out (the results folder), archive (the results archive's file name there) and bundle; sets up work,
# res and step for the caller too (perf/gpu_results.sh).
source perf/gpu_results.sh

step "install the carried Triton server and client"
tr=/tmp/triton-bundle
mkdir -p $tr
[ -x $tr/pytriton/tritonserver/bin/tritonserver ] || tar -C $tr -xJf "$bundle/triton.txz" && tar -C $tr -xzf "$bundle/tritonclient.tgz" || exit 1
python3 -m pip install -q --no-index --no-deps --target $tr "$bundle"/python_rapidjson-*.whl || exit 1
gunzip -c "$bundle/perf_analyzer.gz" > $tr/perf_analyzer && chmod +x $tr/perf_analyzer
export TRITONSERVER_ROOT=$tr/pytriton/tritonserver
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/backends" > "$sp/tokenrouter-checkout.pth"
echo "$tr" > "$sp/tritonclient-bundle.pth"
python3 -c 'import numpy, torch, tokenrouter, tritonclient.grpc; print("numpy", numpy.__version__, "torch", torch.__version__)' || exit 1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

step "benchmark tokenizer (dummy-weight deployments)"
python3 -m tokenrouter.cli make-bench-tokenizer || exit 1

envflag=()
if [ "$(python3 -c 'import numpy; print(numpy.__version__.split(".")[0])')" -ge 2 ]; then
  step "stub environment with numpy<2 (Triton 2.51's Python backend corrupts string tensors with numpy 2)"
  wheels=$work/wheels  # wheels the bundle carries unpacked (perf/make_gpu_bundle.sh), zipped back
  mkdir -p $wheels
  for packed in "$bundle"/*.whl.txz; do
    [ -e "$packed" ] || continue
    rm -rf $wheels/unpacked && mkdir $wheels/unpacked && tar -C $wheels/unpacked -xJf "$packed" || exit 1
    (cd $wheels/unpacked && python3 -m zipfile -c "$wheels/$(basename "${packed%.txz}")" *) || exit 1
  done
  rm -rf $wheels/unpacked
  cp "$bundle"/numpy-*.whl $wheels/ 2> /dev/null  # a bundle made before the wheels were packed
  python3 -m tokenrouter.cli stub-env --out $work/stub-env --find-links $wheels || exit 1
  envflag=(--execution-env $work/stub-env)
fi

# serve CONFIG REPOSITORY LOG: `tokenrouter serve` in the background (its pid in server_pid); returns 0 once
# ready, 1 when it exited or was not ready within 300 s. stop_server (after serve): stop that server (it quits
# the MPS daemon it started), then quit any MPS daemon still running, so that the next serve starts a fresh one.
# A daemon that quit stays a zombie on the GPU machine (its parent is init, which does not reap there): live_mps
# leaves those out (until 2026-12-05 the wait below took all its 40 s after every server for that reason).
live_mps() { ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 ~ /^nvidia-cuda-mps/ {n++} END {exit n == 0}'; }
serve() {
  python3 -m tokenrouter.cli serve --config "$1" --model-repository "$2" "${envflag[@]}" > "$3" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    curl -sf localhost:8000/v2/health/ready > /dev/null && return 0
    kill -0 $server_pid 2> /dev/null || return 1
    sleep 1
  done
  return 1
}
stop_server() {
  kill -INT $server_pid 2> /dev/null; wait $server_pid
  live_mps && echo quit | timeout 30 nvidia-cuda-mps-control > /dev/null 2>&1
  for _ in $(seq 1 40); do live_mps || break; sleep 1; done
}
