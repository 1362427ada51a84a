"""The 32B's mean step time by the extend graph its batch replays (sequence bucket x token bucket), and the share of
those steps' time during which the 0.6B stepped too, from a served timeline trace: an analysis of this folder's
calls, not a product tool. Steps holding a first visit's prefill (more than 128 tokens, or ~60 tokens more than 14 a
request) are left out. Run from the repository root:

    python3 perf/results/first_solve_h200_2026-12-04/steps_by_graph.py TRACE.json.gz [SEQ_BUCKETS]

SEQ_BUCKETS: the graphs' sequence counts, comma-separated (default 4,16,64: the runner's `_EXTEND_SEQS`).
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys

SMALL_TID, LARGE_TID = 1, 2  # perf/timeline.py's thread ids of the first (0.6B) and second (32B) model


def main(path: str, buckets: list[int]) -> None:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = [e for e in events if e.get("cat") == "step" and e.get("name", "").startswith("step b")]
    small = sorted((e["ts"], e["ts"] + e["dur"]) for e in steps if e["tid"] == SMALL_TID)
    starts = [a for a, _ in small]
    by: dict[tuple[int, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for e in steps:
        if e["tid"] != LARGE_TID:
            continue
        batch, tokens = e["args"]["batch"], e["args"]["tokens"]
        if tokens > 128 or tokens - 14 * batch >= 60:
            continue
        a, z = e["ts"], e["ts"] + e["dur"]
        k = max(0, bisect.bisect_left(starts, a) - 1)
        beside = sum(max(0.0, min(s1, z) - max(s0, a)) for s0, s1 in small[k:bisect.bisect_right(starts, z)])
        seqs = next((b for b in buckets if batch <= b), buckets[-1])
        by[(seqs, -(-tokens // 16) * 16)].append((e["dur"] / 1e3, beside / e["dur"]))
    print("| sequences (graph) | tokens (graph) | steps | mean ms | 0.6B stepping, share of the time |\n"
          "|---:|---:|---:|---:|---:|")
    for (seqs, tokens), rows in sorted(by.items()):
        n = len(rows)
        print(f"| {seqs} | {tokens} | {n} | {sum(r[0] for r in rows) / n:.2f} | {sum(r[1] for r in rows) / n:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4,16,64").split(",")])
