"""`perf/timeline.py tuner` at several settings of TREND_STEPS (engine/step_stats.py: how many steps on the trend
line each batch size's mean step time is pooled with; 0 is the table without pooling, but with the count-weighted
slope). An analysis of recorded runs, not a product tool. From the repository root:

    tar -C /tmp -xzf perf/results/large_extend_2026-12-05/served_h200/timeline_raw_base.tgz   # -> /tmp/tl_base
    PYTHONPATH=backends:perf python3 perf/results/tuner_trend_2026-12-05/replay_trend.py /tmp/tl_base 16 145 152 160
"""

from __future__ import annotations

import sys
from pathlib import Path

from timeline import read_events
from timeline_tuner import replay

from tokenrouter.engine import step_stats

SETTINGS = (0, 4, 8, 16)
MAX_WAIT_S = 0.05  # the deployment's batching.max_wait_ms


def main(folder: str, n: int, moments: list[float]) -> None:
    events = read_events(Path(folder))
    for moment in moments:
        for k in SETTINGS:
            step_stats.TREND_STEPS = k
            print(f"trend steps {k:2d}: {replay(events, n, moment, MAX_WAIT_S, one_device=True)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]])
