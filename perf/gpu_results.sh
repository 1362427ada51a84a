# Sourced by perf/gpu_*.sh: where a GPU script's results go. Needs: out (the results folder) and archive (the
# results archive's file name there). Sets: work (a scratch folder), res (its results folder) and `step`, which
# logs a step and first rewrites OUT/ARCHIVE from res: a run cut short still brings back what it measured.
work=$(mktemp -d /tmp/gpu-XXXX)
res=$work/results
mkdir -p "$out" "$res"
step() { tar -C $work -czf "$out/$archive" results 2> /dev/null; echo "== $(date -u +%T) $*"; }
