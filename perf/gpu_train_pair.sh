#!/usr/bin/env bash
# Trains the small/large pair (tokenrouter.tools.train_pair) on a GPU machine as it is (the image's Python
# with torch and transformers; nothing to install) and packs it into OUT_DIR in 15 MB pieces, the size a
# device call brings back (16 MiB a file). Within LIMIT seconds (default 500, inside a 10-minute call).
#
# Usage (repository root, on the GPU machine):
#   bash perf/gpu_train_pair.sh OUT_DIR [train_pair arguments...]
# The GPU image's standard library is stripped (574 files, 3M tokens: the large model memorises it), so the
# text travels from here: SOURCES (default .trainsrc) holds stdlib.txz (this Python's standard library .py
# files) and extra.txz (installed packages' .py files, training only), made with
#   bash perf/make_train_sources.sh
# Then here: cat OUT_DIR/pair.tar.part-* | tar -C models -xf -   (models/pair/{small,large,tokenizer,...})
set -uo pipefail
out=${1:?output directory}
shift
limit=${LIMIT:-500}
mkdir -p "$out"
export PYTHONPATH=$PWD/backends PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"transformers", transformers.__version__)'
src=${SOURCES:-.trainsrc}
mkdir -p /tmp/src/stdlib /tmp/src/extra
tar -C /tmp/src/stdlib -xJf "$src/stdlib.txz" && tar -C /tmp/src/extra -xJf "$src/extra.txz" || exit 1
pyver=$(cat "$src/python-version")
timeout -s INT "$limit" python3 -m tokenrouter.tools.train_pair --out /tmp/pair --device cuda \
  --sources /tmp/src/stdlib --sources-python "$pyver" --extra /tmp/src/extra "$@" 2>&1 \
  | grep -v "Token indices sequence length" | tee "$out/train_pair.log"
echo "exit ${PIPESTATUS[0]}"
tar -C /tmp -cf - pair | split -b 15M - "$out/pair.tar.part-"
ls -l "$out"
