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
  python -m pip install -q -e '.[test,serve]'
  touch "$stamp"
fi
tokenrouter make-tiny --out models/tiny
# The tokenizer the dummy-weight qwen3 deployments name (generated, about a second).
tokenrouter make-bench-tokenizer --out models/bench-tokenizer
