"""perf/timeline.py predict: the tuning model rebuilt from a recorded window predicts what that window measured.

A synthetic served timeline whose every number is known: one request; the small model steps 1 ms at a time and
escalates every fourth step (dropping its token, as R2R and random do); the large model steps 10 ms and hands
back; each handoff spends 0.5 ms reaching the router and 0.2 ms reaching the other process. So 4 tokens per
15.4 ms (259.7 tok/s), or per 14 ms for a model that does not see the transit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from timeline_predict import predict  # noqa: E402

CYCLES = 300
CYCLE_S = 0.0154


def _step(model: str, start: float, seconds: float) -> dict:
    return {"kind": "step", "model": model, "start": start, "launched": start, "forward_end": start + seconds,
            "end": start + seconds, "batch": 1, "tokens": 1, "extends": 0, "threshold": 1}


def _handoff(rid: str, src: str, dst: str, t: float) -> tuple[list[dict], float]:
    """The handoff's events and when the target takes the request on."""
    return [{"kind": "handoff", "request_id": rid, "source": src, "target": dst, "t": t},
            {"kind": "relay", "request_id": rid, "source": src, "target": dst, "t": t + 0.0005},
            {"kind": "receive", "request_id": rid, "model": dst, "t": t + 0.0007},
            {"kind": "arrive", "request_id": rid, "model": dst, "source": src, "t": t + 0.0007}], t + 0.0007


def synthetic() -> tuple[list[dict], list[dict]]:
    rid, t = "r0", 0.0
    events = [{"kind": "arrive", "request_id": rid, "model": "small", "source": None, "t": t}]
    for _ in range(CYCLES):
        for _ in range(4):
            events.append(_step("small", t, 0.001))
            t += 0.001
        hop, t = _handoff(rid, "small", "large", t)
        events += hop
        events.append(_step("large", t, 0.010))
        t += 0.010
        hop, t = _handoff(rid, "large", "small", t)
        events += hop
    runs = [{"concurrency": 1, "output_tokens": 4 * CYCLES, "duration_s": t, "monotonic_since": 0.0,
             "monotonic_until": t}]
    return events, runs


def test_the_model_of_a_window_predicts_it() -> None:
    events, runs = synthetic()
    out = predict(events, runs)
    assert out["measured_tok_s"] == pytest.approx(4 / CYCLE_S)
    inputs = out["transit"]["inputs"]
    assert inputs["route_probs"][0] == pytest.approx([0.75, 0.25]) and inputs["commit_on_move"] == 0.0
    assert inputs["transit_s"][0][1] == pytest.approx(0.0007) and inputs["transit_s"][1][0] == pytest.approx(0.0007)
    assert out["transit"]["ratio"] == pytest.approx(1.0, abs=0.03)
    assert out["no_transit"]["predicted_tok_s"] == pytest.approx(4 / 0.014, rel=0.03)


def timeline_folder(events: list[dict], folder: Path) -> Path:
    """`events` as a served deployment writes them: one file per process (each model's, the router's)."""
    folder.mkdir()
    for model in ("small", "large", "router"):
        mine = [e for e in events if e.get("model", "router") == model]
        (folder / f"{model}.1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in mine))
    return folder


def test_the_cli_reads_a_timeline_folder(tmp_path: Path) -> None:
    events, runs = synthetic()
    folder = timeline_folder(events, tmp_path / "tl")
    (tmp_path / "bench.json").write_text(json.dumps({"results": runs}))
    proc = subprocess.run([sys.executable, str(REPO / "perf" / "timeline.py"), "predict", str(folder),
                           "--bench", str(tmp_path / "bench.json"), "--out", str(tmp_path / "p")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "measured / predicted" in proc.stdout
    assert json.loads((tmp_path / "p.json").read_text())["transit"]["ratio"] == pytest.approx(1.0, abs=0.03)
