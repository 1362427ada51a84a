#!/usr/bin/env bash
# Packs the training text for perf/gpu_train_pair.sh into OUT (default .trainsrc; keep it git-ignored, e.g.
# `echo /.trainsrc/ >> .git/info/exclude`): this Python's standard library .py files (stdlib.txz; its held-out
# split is the one tools here read back) and the .py files of packages installed in .venv (extra.txz: torch,
# sympy, numpy, ..., transformers without its per-model folders, which repeat one another). About 20 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.trainsrc}
mkdir -p "$out"
py=.venv/bin/python
stdlib=$($py -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
sp=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$py -c 'import sys; print(sys.version.split()[0])' > "$out/python-version"
(cd "$stdlib" && find . -name '*.py' -not -path '*/site-packages/*' -print0) \
  | tar --null -C "$stdlib" -T - -cf - | xz -6 -T2 > "$out/stdlib.txz"
(cd "$sp" && find torch sympy numpy setuptools pip networkx matplotlib jinja2 _pytest yaml tritonclient \
   -name '*.py' -not -path '*/tests/*' -print0 && find transformers -name '*.py' -not -path 'transformers/models/*' -print0) \
  | tar --null -C "$sp" -T - -cf - | xz -6 -T2 > "$out/extra.txz"
du -sh "$out"/*
