"""What `thresholds: auto` chooses at moments of a served run, replayed from its raw timeline (the server's
TOKENROUTER_TIMELINE_DIR), with each batch size's mean step time pooled with TREND_STEPS steps on the trend line
(engine/step_stats.py) at several settings; 0 is the table without pooling (but with the count-weighted slope).
An analysis of recorded runs, not a product tool.

Each model's steps that ended by moment T (the machine's time.monotonic(), as in the timeline) feed a fresh StepStats
with their end times, as the subservers record them over the server's life; the routing rows are counted from the
handoffs. Then engine/autotune.system_model (both models on one device) and tuning.choose_thresholds answer for N
with the deployment's 50 ms bounded wait. From the repository root:

    tar -C /tmp -xzf perf/results/large_extend_2026-12-05/served_h200/timeline_raw_base.tgz   # -> /tmp/tl_base
    PYTHONPATH=backends:perf python3 perf/results/tuner_trend_2026-12-05/replay_trend.py /tmp/tl_base 16 145 152 160
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from timeline import read_events

from tokenrouter.engine import step_stats
from tokenrouter.engine.autotune import system_model
from tokenrouter.tuning.choose import choose_thresholds

SETTINGS = (0, 4, 8, 16)


def replay(events: list[dict], models: list[str], n: int, moment: float) -> str:
    steps = [e for e in events if e["kind"] == "step" and e["end"] <= moment]
    stats = {m: step_stats.StepStats(since=min(e["start"] for e in steps)) for m in models}
    rows: Counter = Counter()
    for e in steps:
        stats[e["model"]].record_step(e["batch"] + e.get("void", 0), e["end"] - e["start"], e["end"])
        rows[e["model"]] += e["batch"]
    moves = Counter((e["source"], e["target"]) for e in events if e["kind"] == "handoff" and e["t"] <= moment)
    for m in models:
        stats[m].as_of = moment
        for target in models:
            for _ in range(moves[(m, target)]):
                stats[m].record_route(target, m != models[0])  # the 0.6B's escalated token is dropped
        for _ in range(rows[m] - sum(moves[(m, t)] for t in models)):
            stats[m].record_route(None, True)
    model = system_model(models, stats, n, one_device=True)
    choice = choose_thresholds(model, max_wait=0.05)
    large = ", ".join(f"{x * 1e3:.1f}" for x in model.step_latency[-1])
    return f"thresholds {choice.thresholds} ({choice.throughput:,.0f} tok/s expected); {models[-1]} ms [{large}]"


def main(folder: str, n: int, moments: list[float]) -> None:
    events = read_events(Path(folder))
    models = sorted({e["model"] for e in events if e["kind"] == "step"}, key=lambda m: m != "small")
    for moment in moments:
        for k in SETTINGS:
            step_stats.TREND_STEPS = k
            print(f"T={moment:7.1f} N={n} trend steps {k:2d}: {replay(events, models, n, moment)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]])
