"""The thresholds each model stepped under, window by window, in a served timeline trace, with the rows its steps
served (an analysis of this folder's calls, not a product tool). Rows: the 0.6B's batch x 0.9 (random p = 0.1: its
routed token is redone by the 32B) plus the 32B's batch. Run from the repository root:

    python3 perf/results/tuner_h200_2026-12-04/thresholds_by_window.py TRACE.json[.gz] [WINDOW_S]
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def main(path: str, window: float = 4.0) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by: dict[int, dict[int, list[tuple[int, int]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("cat") == "step" and e.get("name", "").startswith("step b"):
            by[int(e["ts"] / 1e6 // window)][e["tid"]].append((e["args"]["threshold"], e["args"]["batch"]))
    for k in sorted(by):
        small, large = by[k][1], by[k][2]  # perf/timeline.py's thread ids
        rows = 0.9 * sum(b for _, b in small) + sum(b for _, b in large)
        common = [collections.Counter(t for t, _ in steps).most_common(3) for steps in (small, large)]
        print(f"{k * window:5.1f} s  ~{rows / window:6.0f} rows/s  0.6B thresholds {common[0]}  32B {common[1]}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 4.0)
