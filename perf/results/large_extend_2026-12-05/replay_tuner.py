"""What `thresholds: auto` chooses at moments of a served run, replayed from its raw timeline (the server's
TOKENROUTER_TIMELINE_DIR): as the tuner is, and with batch sizes of fewer than MIN_STEPS steps left out of the
latency table once some size has that many (`min_size_steps.patch`, not applied). An analysis of this folder's
calls, not a product tool.

Each model's steps that ended by moment T (the machine's time.monotonic(), as in the timeline) feed a fresh StepStats
with their end times, as the subservers record them for the server's life; the routing rows are counted from the
handoffs. Then engine/autotune.system_model (both models on one device) and tuning.choose_thresholds answer for N
with the deployment's 50 ms bounded wait. From the repository root:

    tar -C /tmp -xzf perf/results/large_extend_2026-12-05/served_h200/timeline_raw_base.tgz   # -> /tmp/tl_base
    PYTHONPATH=backends:perf python3 perf/results/large_extend_2026-12-05/replay_tuner.py /tmp/tl_base 16 145 152 160
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from timeline import read_events

from tokenrouter.engine import step_stats
from tokenrouter.engine.autotune import system_model
from tokenrouter.tuning.choose import choose_thresholds

MIN_STEPS = 5
_table = step_stats.StepStats.latency_table


def _filtered_table(self: step_stats.StepStats, max_batch: int, min_steps: int = 1) -> list[float] | None:
    """The tuner's table with the sizes of fewer than `min_steps` steps left out, once some size has that many."""
    if max(self.latency_count.values(), default=0) >= min_steps:
        for b in [b for b, c in self.latency_count.items() if c < min_steps]:
            self.latency_sum.pop(b)
            self.latency_count.pop(b)
    return _table(self, max_batch)


def main(folder: str, n: int, moments: list[float]) -> None:
    events = read_events(Path(folder))
    steps = [e for e in events if e["kind"] == "step"]
    models = list(dict.fromkeys(e["model"] for e in steps))
    models.sort(key=lambda m: m != "small")
    for moment in moments:
        for min_steps in (1, MIN_STEPS):
            step_stats.StepStats.latency_table = lambda self, n, k=min_steps: _filtered_table(self, n, k)
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
            print(f"T={moment:7.1f} min steps {min_steps}: thresholds {choice.thresholds} "
                  f"({choice.throughput:,.0f} tok/s expected); {models[-1]} ms by batch [{large}]")
    step_stats.StepStats.latency_table = _table


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]])
