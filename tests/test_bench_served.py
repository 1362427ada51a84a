"""perf/bench_served.py's summary: TTFT kept apart by the model that made the first token (issue 11, point 4), and
the requests in flight on average (a run that drained behind its longest requests is not C's steady state)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from bench_served import markdown, summarize  # noqa: E402


def _row(start: float, ttft: float, first: str | None) -> dict:
    routing = {"tokens_per_model": {"small": 9, "large": 1}, "handoffs": 2, "large_token_share": 0.1}
    if first is not None:
        routing["first_token_model"] = first
    return {"start": start, "ttft": ttft, "e2e": ttft + 1.0, "end": start + ttft + 1.0, "tokens": 10,
            "routing": routing, "text": "x"}


def test_ttft_split_by_first_token_model() -> None:
    rows = [_row(0.0, 0.010, "small"), _row(0.1, 0.012, "small"), _row(0.2, 0.050, "large"), _row(0.3, 0.011, None),
            {"error": "boom"}]
    out = summarize(8, rows)
    split = out["ttft_by_first_token_model"]
    assert set(split) == {"small", "large", "unknown"}  # (a server without the field: "unknown")
    assert split["small"]["requests"] == 2 and split["small"]["p50"] == 11.0
    assert split["large"] == {"requests": 1, "p50": 50.0, "p99": 50.0}
    assert out["errors"] == 1 and out["requests"] == 5
    report = {"title": "t", "command": "c", "date": "d", "machine_line": "m", "workload": {}, "results": [out]}
    text = markdown(report)
    assert "| 8 | 0 | large | 1 | 50.0 | 50.0 |" in text


def test_mean_in_flight() -> None:
    """Two requests over one run: one of 1 s from t=0, one of 3 s from t=1. The run spans 4 s with 4 s of requests:
    one in flight on average, though C was 2."""
    rows = [_row(0.0, 0.0, "small"), _row(1.0, 2.0, "small")]
    out = summarize(2, rows)
    assert out["duration_s"] == 4.0 and out["mean_in_flight"] == 1.0
    report = {"title": "t", "command": "c", "date": "d", "machine_line": "m", "workload": {}, "results": [out]}
    (line,) = [x for x in markdown(report).splitlines() if x.startswith("| 2 | 2 | 0 |")]
    assert line.endswith("| 1.00 |")
