"""What `thresholds: auto` would choose at given moments of a served run, from its timeline trace (an analysis of
this folder's calls, not a product tool).

Each model's steps ending before a moment T (seconds after the first step) are fed to a fresh StepStats with their
end times, as the subservers record them, as a record of the time up to T; the routing rows are the random
policy's (p = 0.1 to the 32B, the 0.6B's token dropped; the 32B hands back after one token). Then
engine/autotune.system_model (both models on one device) and tuning.choose_thresholds answer for N = 8 with the
deployment's 50 ms bounded wait. Run from the repository root:

    PYTHONPATH=backends python3 perf/results/sharing_h200_2026-12-04/replay_tuner.py TRACE.json[.gz] 2 4 6 ...
"""

from __future__ import annotations

import gzip
import json
import sys

from tokenrouter.engine.autotune import system_model
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning.choose import choose_thresholds

MODELS = {1: "small", 2: "large"}  # the trace's thread ids (perf/timeline.py)


def main(path: str, moments: list[float], concurrency: int = 8, max_wait: float = 0.05) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODELS.values()}
    for e in events:
        if e.get("tid") in MODELS and e.get("name", "").startswith("step b"):
            steps[MODELS[e["tid"]]].append((e["ts"] / 1e6, e["dur"] / 1e6, e["args"]["batch"]))
    t0 = min(s[0][0] for s in steps.values())
    for moment in moments:
        stats = {m: StepStats(since=t0) for m in MODELS.values()}  # (records from the first step up to the moment)
        for m, seen in steps.items():
            for start, seconds, batch in sorted(seen):
                if start + seconds - t0 <= moment:
                    stats[m].record_step(batch, seconds, start + seconds)
            stats[m].as_of = t0 + moment
        for _ in range(9):
            stats["small"].record_route(None, True)
        stats["small"].record_route("large", False)
        stats["large"].record_route("small", True)
        model = system_model(list(stats), stats, concurrency, one_device=True)
        if model is None:
            print(f"T={moment:5.1f} s: not measured yet")
            continue
        choice = choose_thresholds(model, max_wait=max_wait)
        alone = ", ".join(f"{x * 1e3:.2f}" for x in model.step_latency[0])
        print(f"T={moment:5.1f} s: slowdown {model.slowdown}, 0.6B alone ms by batch [{alone}] -> thresholds "
              f"{choice.thresholds} ({choice.throughput:,.0f} tok/s expected)")


if __name__ == "__main__":
    main(sys.argv[1], [float(x) for x in sys.argv[2:]])
