#!/usr/bin/env bash
# Quick start: set everything up (venv, Triton server from PyPI, tiny test models) and serve the default
# deployment (the trained small+large pair in models/pair, R2R routing, CPU) on HTTP 8000 / gRPC 8001 /
# metrics 8002.
# Extra arguments go to `tokenrouter serve` (e.g. --config config/random/tiny-small_tiny-large.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tokenrouter serve "$@"
