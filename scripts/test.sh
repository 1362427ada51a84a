#!/usr/bin/env bash
# The test command: sets everything up from scratch if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
