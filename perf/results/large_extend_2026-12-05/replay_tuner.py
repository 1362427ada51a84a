"""What `thresholds: auto` chooses at moments of a served run, replayed from its raw timeline (the server's
TOKENROUTER_TIMELINE_DIR), with step_stats.MIN_SIZE_STEPS at 1 (every batch size's mean counts: the rule before)
and at its value now. An analysis of this folder's calls, not a product tool.

Each model's steps that ended by moment T (the machine's time.monotonic(), as in the timeline) feed a fresh StepStats
with their end times, as the subservers record them for the server's life; the routing rows are counted from the
handoffs. Then engine/autotune.system_model (both models on one device) and tuning.choose_thresholds answer for N
with the deployment's 50 ms bounded wait. From the repository root:

    PYTHONPATH=backends:perf python3 perf/results/large_extend_2026-12-05/replay_tuner.py TIMELINE_DIR N T1 T2 ...
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from timeline import read_events

from tokenrouter.engine import step_stats
from tokenrouter.engine.autotune import system_model
from tokenrouter.tuning.choose import choose_thresholds


def main(folder: str, n: int, moments: list[float]) -> None:
    events = read_events(Path(folder))
    steps = [e for e in events if e["kind"] == "step"]
    models = list(dict.fromkeys(e["model"] for e in steps))
    models.sort(key=lambda m: m != "small")
    now = step_stats.MIN_SIZE_STEPS
    for moment in moments:
        for min_steps in (1, now):
            step_stats.MIN_SIZE_STEPS = min_steps
            stats = {m: step_stats.StepStats(since=min(e["start"] for e in steps)) for m in models}
            rows: Counter = Counter()
            for e in steps:
                if e["end"] <= moment:
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
            print(f"T={moment:7.1f} MIN_SIZE_STEPS={min_steps}: thresholds {choice.thresholds} "
                  f"({choice.throughput:,.0f} tok/s expected); {models[-1]} ms by batch [{large}]")
    step_stats.MIN_SIZE_STEPS = now


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]])
