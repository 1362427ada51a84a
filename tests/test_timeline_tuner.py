"""perf/timeline.py tuner: the tuner's inputs rebuilt from a served timeline as they stood at a moment, and what it
solves from them.

On test_timeline_predict's synthetic timeline (one request; the small model steps 1 ms and escalates every fourth
step, dropping its token; the large model steps 10 ms and hands back; each handoff takes 0.7 ms to reach the other
process), with the large model's steps after the first second made batches of two that take 12 ms, and 1 ms more
before each handoff's target takes it on."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from timeline_tuner import RAN_WINDOW_S, replay, replay_stats  # noqa: E402

from test_timeline_predict import synthetic, timeline_folder  # noqa: E402
from tokenrouter.tuning.system import is_feasible  # noqa: E402


def events_and_end() -> tuple[list[dict], float]:
    events, runs = synthetic()
    for e in events:
        if e["kind"] == "step" and e["model"] == "large" and e["start"] > 1.0:
            e["batch"], e["end"], e["threshold"] = 2, e["start"] + 0.012, 2
        if e["kind"] == "arrive" and e["source"] is not None:
            e["t"] += 0.001  # waited for the target's loop: queueing, not transit
    return events, runs[0]["monotonic_until"]


def test_the_record_stands_as_at_the_moment() -> None:
    events, end = events_and_end()
    moment = 1.0 + RAN_WINDOW_S + 0.5  # every step in the window before it ran batches of two
    r = replay_stats(events, moment)
    assert r.models == ["small", "large"]  # the entry model first
    large = [e for e in events if e["kind"] == "step" and e["model"] == "large" and e["end"] <= moment]
    assert r.stats["large"].latency_count == {1: sum(e["batch"] == 1 for e in large),
                                              2: sum(e["batch"] == 2 for e in large)}
    assert r.stats["large"].latency_sum[2] / r.stats["large"].latency_count[2] == pytest.approx(0.012)
    probs, tokens = r.stats["small"].route_row(r.models, "small")
    assert probs == pytest.approx([0.75, 0.25], abs=0.01) and tokens == [1.0, 0.0]  # the escalated token dropped
    assert r.stats["large"].route_row(r.models, "large")[0][0] > 0.45  # rows of 2 counted, one handed back per step
    assert r.stats["large"].mean_transit("small") == pytest.approx(0.0007)  # to the target's process
    assert r.stats["small"].mean_transit("large") == pytest.approx(0.0007)
    assert r.ran == {"small": 1, "large": 2}
    later = replay_stats(events, end)
    assert sum(later.stats["small"].latency_count.values()) > sum(r.stats["small"].latency_count.values())
    assert replay_stats(events, 0.9).ran == {"small": 1, "large": 1}  # before the batches of two
    with pytest.raises(ValueError):
        replay_stats(events, -1.0)


def test_the_solve_answers_feasible_thresholds() -> None:
    events, _ = events_and_end()
    text = replay(events, 4, 3.5, max_wait=0.05)
    assert text.startswith("T=3.5 N=4: thresholds {'small': ")
    assert "the steps ran at small 1, large 2" in text
    assert "large ms [10.0, 12.0, " in text  # the table the tuner saw: as measured at batch 1 and 2
    chosen = ast.literal_eval(re.search(r"thresholds (\{[^}]*\})", text).group(1))
    assert is_feasible([chosen["small"], chosen["large"]], 4)


def test_the_cli(tmp_path: Path) -> None:
    events, _ = events_and_end()
    folder = timeline_folder(events, tmp_path / "tl")
    cmd = [sys.executable, str(REPO / "perf" / "timeline.py"), "tuner", str(folder), "--concurrency", "4",
           "--at", "1.5", "3.0", "--max-wait-ms", "50"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [x.split(":")[0] for x in proc.stdout.splitlines()] == ["T=1.5 N=4", "T=3.0 N=4"]
    bad = subprocess.run(cmd[:5] + ["0", "--at", "1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--concurrency must be >= 1" in bad.stderr
