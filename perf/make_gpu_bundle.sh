#!/usr/bin/env bash
# Packs what perf/gpu_served.sh needs on a GPU machine that has no package index, from this machine's
# set-up venv (bash scripts/setup.sh) and PyPI, into BUNDLE_DIR (default .gpu; keep it git-ignored, e.g.
# `echo /.gpu/ >> .git/info/exclude`). About 50 MB: it fits one device call's 64 MiB beside the checkout.
#   triton.txz               the Triton 2.51 server: pytriton/tritonserver (stub for Python 3.12 only)
#                            and nvidia_pytriton.libs from the nvidia-pytriton 0.7.0 wheel
#   tritonclient.tgz         the tritonclient package (pure Python)
#   perf_analyzer.gz         tritonclient 2.51's perf_analyzer binary
#   numpy-1.26.4 (its wheel's files as .whl.txz) and python-rapidjson wheels for CPython 3.12 (the stubs'
#                            numpy<2; the client's one dependency the GPU image lacks)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu}
sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$out"
stubs=$sp/pytriton/tritonserver/python_backend_stubs
tar -C "$sp" -cf - --exclude='libpython3-*' --exclude='__pycache__' \
    --exclude='pytriton/tritonserver/backends/tokenrouter' \
    --exclude='pytriton/tritonserver/backends/python/triton_python_backend_stub' \
    $(cd "$sp" && ls -d pytriton/tritonserver/python_backend_stubs/* | grep -v '/3.12$' | sed 's/^/--exclude=/') \
    pytriton/tritonserver nvidia_pytriton.libs | xz -9 -T2 > "$out/triton.txz"
tar -C "$sp" --exclude='__pycache__' -czf "$out/tritonclient.tgz" tritonclient
gzip -c .venv/bin/perf_analyzer > "$out/perf_analyzer.gz"
for pkg in numpy==1.26.4 python-rapidjson; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$out" "$pkg"
done
# numpy's wheel is 18 MB of deflated zip; its files under xz are 9 MB, which leaves the checkout room in the
# 64 MiB a device call carries. perf/gpu_env.sh zips them back into the wheel (pip checks the files' hashes
# in RECORD, not the archive's bytes).
for whl in "$out"/numpy-*.whl; do
  [ -e "$whl" ] || continue
  rm -rf "$out/unpacked" && python3 -m zipfile -e "$whl" "$out/unpacked"
  tar -C "$out/unpacked" -cf - . | xz -9 -T2 > "$whl.txz" && rm -rf "$out/unpacked" "$whl"
done
test -d "$stubs/3.12"
du -sh "$out"
