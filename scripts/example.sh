#!/usr/bin/env bash
# In-process example on the CPU default (the tiny small model): set-up, then one greedy completion.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tokenrouter generate --config config/tiny/small.yaml --prompt "def fibonacci(n):" "$@"
