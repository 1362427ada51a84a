"""The timeline recorder (engine/timeline.py) and perf/timeline.py's analysis: the summary's figures are
right on known events, and a recording of a real routed run (in process, and served by a real
tritonserver under load with cancellations) accounts for every step and every handoff."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tokenrouter import Engine, SamplingParams
from tokenrouter.engine.timeline import TIMELINE_DIR_ENV, Timeline, read_events

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from timeline_analysis import chrome_trace, markdown, request_life, summarize, transits  # noqa: E402


def step(model: str, start: float, end: float, batch: int, threshold: int = 1, first_ready: float | None = None,
         extends: int = 0, last_ready: float | None = None) -> dict:
    return {"kind": "step", "model": model, "start": start, "forward_end": (start + end) / 2, "end": end,
            "batch": batch, "tokens": batch, "extends": extends, "threshold": threshold, "first_ready": first_ready,
            "last_ready": first_ready if last_ready is None else last_ready,
            "queue_wait_max": 0.0 if first_ready is None else start - first_ready}


def test_summary_of_known_events() -> None:
    events = [
        step("small", 0.0, 1.0, 2, first_ready=0.0),
        {"kind": "handoff", "request_id": "a", "source": "small", "target": "large", "t": 0.9},
        {"kind": "arrive", "request_id": "a", "model": "large", "source": "small", "t": 1.1},
        step("large", 1.5, 2.5, 1, first_ready=1.1, extends=1),
        # small: idle 1.0 -> 3.0; its next row was ready at 2.0 and the step ran 1 row below a threshold of 2
        step("small", 3.0, 4.0, 1, threshold=2, first_ready=2.0),
        # small: 4.0 -> 4.5 idle with a row ready since 4.0 and a full batch: host work
        step("small", 4.5, 5.0, 1, first_ready=4.0),
        # small: 5.0 -> 6.0 idle; a row ready at 5.0, the fourth at 5.5 fills the threshold of 4: 0.5 waiting,
        # then 0.5 host work until the step
        step("small", 6.0, 6.5, 4, threshold=4, first_ready=5.0, last_ready=5.5),
        {"kind": "handoff", "request_id": "a", "source": "large", "target": "small", "t": 2.4},
        {"kind": "arrive", "request_id": "a", "model": "small", "source": "large", "t": 2.6},
        {"kind": "arrive", "request_id": "b", "model": "small", "source": None, "t": 0.0},
    ]
    s = summarize(sorted(events, key=lambda e: e.get("start", e.get("t"))))
    assert s["window_s"] == pytest.approx(6.5)
    small, large = s["models"]["small"], s["models"]["large"]
    assert small["steps"] == 4 and large["steps"] == 1
    assert small["busy_fraction"] == pytest.approx(3.0 / 6.5)
    assert large["busy_fraction"] == pytest.approx(1.0 / 6.5)
    assert small["forward_fraction_of_busy"] == pytest.approx(0.5)
    assert small["batch_histogram"] == {1: 2, 2: 1, 4: 1} and large["steps_with_extend"] == 1
    assert small["idle_s"] == pytest.approx({"no request ready": 1.0, "waiting below threshold": 1.5, "host work": 1.0})
    assert s["overlap_fraction"] == pytest.approx(0.0)  # small's and large's steps never overlap here
    assert {k: [round(x, 6) for x in v] for k, v in transits(events).items()} == {
        "small -> large": [0.2], "large -> small": [0.2]}
    assert s["handoffs"]["small -> large"]["count"] == 1
    assert "legs" not in s["handoffs"]["small -> large"]  # in process: no relay through a router

    # Served: the router's relay and the target process's receive split each transit into its legs.
    legs = [{"kind": "relay", "request_id": "a", "source": "small", "target": "large", "t": 0.95},
            {"kind": "receive", "request_id": "a", "model": "large", "source": "small", "t": 1.0},
            {"kind": "relay", "request_id": "a", "source": "large", "target": "small", "t": 2.45}]  # no receive
    served = summarize(sorted(events + legs, key=lambda e: e.get("start", e.get("t"))))
    got = served["handoffs"]["small -> large"]["legs"]
    assert {k: round(v["p50_ms"], 6) for k, v in got.items()} == {
        "to the router": 50.0, "to the process": 50.0, "to the loop": 100.0}
    assert "legs" not in served["handoffs"]["large -> small"]  # a leg missing: not split
    # A handoff that never arrived (cancelled) leaves its mark; a later handoff's legs are not taken from it.
    lost = [{"kind": "handoff", "request_id": "c", "source": "small", "target": "large", "t": 0.1},
            {"kind": "relay", "request_id": "c", "source": "small", "target": "large", "t": 0.2},
            {"kind": "relay", "request_id": "c", "source": "small", "target": "large", "t": 3.0},  # its handoff cut
            {"kind": "receive", "request_id": "c", "model": "large", "source": "small", "t": 3.1},
            {"kind": "arrive", "request_id": "c", "model": "large", "source": "small", "t": 3.2}]
    mixed = summarize(sorted(events + legs + lost, key=lambda e: e.get("start", e.get("t"))))
    assert mixed["handoffs"]["small -> large"]["legs"]["to the router"]["count"] == 1  # a's only
    assert served["models"].keys() == {"small", "large"}  # the router is no model
    batches = [{"kind": "router_batch", "start": 0.95, "end": 0.97, "events": 2},
               {"kind": "router_batch", "start": 2.45, "end": 2.5, "events": 1}]
    router = summarize(sorted(events + batches, key=lambda e: e.get("t", e.get("start"))))["router"]
    assert router["batches"] == 2 and router["busy_fraction"] == pytest.approx(0.07 / 6.5)
    assert router["mean_ms"] == pytest.approx(35.0)
    assert s["router"] is None
    trace = chrome_trace(events + batches)["traceEvents"]
    track = [e for e in trace if e.get("cat") == "router"]
    assert [round(e["dur"]) for e in track] == [20000, 50000]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[track[0]["tid"]] == "router loop" and len(names) == 3

    trace = chrome_trace(events)["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == 5 * 3  # every step: itself, forward, route+commit
    starts = {e["id"]: e for e in trace if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace if e["ph"] == "f"}
    assert set(starts) == set(ends) and len(starts) == 2  # each handoff an arrow from source to target
    names = {e["args"]["name"]: e["tid"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(ends[i]["tid"] != starts[i]["tid"] for i in starts) and set(names) == {"small", "large"}


def test_where_a_requests_time_goes() -> None:
    """request_life: a visit at the large model from its arrival (in process: the loop's; served: its process's
    receive, before the inbox) waits for the step in flight, then for the idle model's next step (the hold), then
    runs until its handoff; transits between. Visits with no arrival or no handoff in the window are left out; a visit
    with no step of its own (a shadow token committed on arrival) is not."""
    events = [
        {"kind": "arrive", "request_id": "a", "model": "small", "source": None, "t": 0.0},
        step("small", 0.0, 0.5, 1, first_ready=0.0),
        {"kind": "handoff", "request_id": "a", "source": "small", "target": "large", "t": 0.8},
        step("large", 1.0, 2.0, 2, first_ready=0.9),  # a step without a, in flight when a arrives
        {"kind": "arrive", "request_id": "a", "model": "large", "source": "small", "t": 1.2},
        step("large", 2.5, 3.5, 3, threshold=3, first_ready=1.2),
        {"kind": "handoff", "request_id": "a", "source": "large", "target": "small", "t": 3.4},
        {"kind": "arrive", "request_id": "a", "model": "small", "source": "large", "t": 3.6},
        # b: its arrival at the large lies before the window (no arrive): its visit there is left out
        {"kind": "handoff", "request_id": "b", "source": "large", "target": "small", "t": 3.45},
    ]

    def rounded(life: dict) -> dict:
        return {k: {part: [round(x, 6) for x in v] for part, v in parts.items()} for k, parts in life.items()}

    assert rounded(request_life(events)) == {
        "small": {"waiting: the model in another step": [0.0], "waiting: the model idle": [0.0],
                  "in its steps": [0.8]},
        "small -> large": {"transit": [0.4]},
        "large": {"waiting: the model in another step": [0.8], "waiting: the model idle": [0.5],
                  "in its steps": [0.9]},
        "large -> small": {"transit": [0.2]},
    }
    # Served: the large's process received a at 1.1, and its loop took it at 2.0, after the step in flight.
    served = [e for e in events if not (e["kind"] == "arrive" and e["model"] == "large")] + [
        {"kind": "receive", "request_id": "a", "model": "large", "source": "small", "t": 1.1},
        {"kind": "arrive", "request_id": "a", "model": "large", "source": "small", "t": 2.0}]
    life = rounded(request_life(served))
    assert life["small -> large"] == {"transit": [0.3]}
    assert life["large"] == {"waiting: the model in another step": [0.9], "waiting: the model idle": [0.5],
                             "in its steps": [0.9]}
    summary = summarize(sorted(served, key=lambda e: e.get("start", e.get("t"))))
    hold = summary["request_life"]["large"]["waiting: the model idle"]
    assert hold["count"] == 1 and hold["mean_ms"] == pytest.approx(500.0)
    total = 0.8 + 0.3 + 0.9 + 0.5 + 0.9 + 0.2
    # A step launched ahead (no first_ready: it runs the rows of the step before it) takes in no arrival: c, received
    # during step k, waits behind k and the step launched ahead of it, and its first step is the next one scheduled.
    ahead = [
        step("small", 1.0, 1.5, 2, first_ready=0.9),
        {**step("small", 1.5, 1.9, 2), "first_ready": None},
        step("small", 1.9, 2.3, 3, first_ready=1.2),
        {"kind": "handoff", "request_id": "c", "source": "large", "target": "small", "t": 1.0},
        {"kind": "receive", "request_id": "c", "model": "small", "source": "large", "t": 1.2},
        {"kind": "arrive", "request_id": "c", "model": "small", "source": "large", "t": 1.5},
        {"kind": "handoff", "request_id": "c", "source": "small", "target": "large", "t": 2.25},
    ]
    assert rounded(request_life(ahead))["small"] == {
        "waiting: the model in another step": [0.7], "waiting: the model idle": [0.0], "in its steps": [0.35]}
    assert f"| large | waiting: the model idle | 1 | 500.00 | 500.00 | 500.00 | {100 * 0.5 / total:.1f} % |" in (
        markdown(summary, "t"))
    # A visit with no step of its own: its shadow row's token (engine/shadow.py) committed once the loop took it in,
    # after the step in flight; it is counted, with nothing in its steps.
    shadow_hit = [
        step("large", 2.5, 3.5, 3, first_ready=2.4),
        {"kind": "handoff", "request_id": "d", "source": "small", "target": "large", "t": 2.55},
        {"kind": "receive", "request_id": "d", "model": "large", "source": "small", "t": 2.6},
        {"kind": "arrive", "request_id": "d", "model": "large", "source": "small", "t": 3.5},
        {"kind": "handoff", "request_id": "d", "source": "large", "target": "small", "t": 3.52},
        step("large", 3.6, 4.6, 2, first_ready=3.6),
    ]
    assert rounded(request_life(shadow_hit))["large"] == {
        "waiting: the model in another step": [0.9], "waiting: the model idle": [0.02], "in its steps": [0.0]}


def test_step_phases() -> None:
    """The phases of a step (mean and median ms) from its stamps; events recorded before the launch was told
    apart from the preparation get one `prepare+launch` phase."""
    def stamped(start: float, prepare: float, launch: float, wait: float) -> dict:
        e = step("small", start, start + 0.001 + prepare + launch + wait + 0.002, 1)
        e.update(schedule_start=start - 0.001, submitted=start + prepare, launched=start + prepare + launch,
                 forward_end=start + prepare + launch + wait)
        return e

    events = [stamped(0.0, 0.001, 0.001, 0.010), stamped(1.0, 0.001, 0.002, 0.010),
              stamped(2.0, 0.004, 0.006, 0.010)]
    small = summarize(events)["models"]["small"]
    assert list(small["phase_ms"]) == ["schedule", "prepare", "launch", "GPU wait", "route+commit"]
    assert small["phase_ms"]["prepare"] == pytest.approx(2.0) and small["phase_ms_p50"]["prepare"] == pytest.approx(1.0)
    assert small["phase_ms"]["launch"] == pytest.approx(3.0) and small["phase_ms_p50"]["launch"] == pytest.approx(2.0)
    assert small["phase_ms"]["GPU wait"] == pytest.approx(10.0)
    slices = {e["name"]: e["dur"] for e in chrome_trace(events[:1])["traceEvents"] if e["ph"] == "X"}
    assert round(slices["prepare"]) == 1000 and round(slices["launch"]) == 1000 and "prepare+launch" not in slices
    for e in events:
        del e["submitted"]
    old = summarize(events)["models"]["small"]
    assert list(old["phase_ms"]) == ["schedule", "prepare+launch", "GPU wait", "route+commit"]
    assert old["phase_ms"]["prepare+launch"] == pytest.approx(5.0)
    assert "prepare+launch" in {e["name"] for e in chrome_trace(events)["traceEvents"] if e["ph"] == "X"}


def check_recording(events: list[dict], models: set[str], cancelled: int = 0) -> None:
    """Every model stepped; every arrival from another model follows exactly one handoff to it, and every
    handoff arrives unless a cancel overtook it (at most one per cancelled request)."""
    steps = [e for e in events if e["kind"] == "step"]
    assert {e["model"] for e in steps} == models
    assert all(e["start"] <= e["forward_end"] <= e["end"] for e in steps)
    # The host's part of a step: its batch chosen, its inputs prepared, its launch returned, its tokens back.
    assert all(e["schedule_start"] <= e["start"] <= e["submitted"] <= e["launched"] <= e["forward_end"] for e in steps)
    handoffs = [e for e in events if e["kind"] == "handoff"]
    arrivals = [e for e in events if e["kind"] == "arrive" and e["source"] is not None]
    assert handoffs, "a routed run at p=0.3 hands off"
    sent = Counter((e["request_id"], e["target"]) for e in handoffs)
    taken = Counter((e["request_id"], e["model"]) for e in arrivals)
    assert not taken - sent, "an arrival without its handoff"
    lost = sent - taken
    assert sum(lost.values()) <= cancelled and len({rid for rid, _ in lost}) == sum(lost.values()), lost
    assert all(x >= 0 for v in transits(events).values() for x in v)


def test_in_process_recording(tiny_dir: Path) -> None:
    cfg = {
        "models": {m: {"path": str(tiny_dir / m), "kv_cache_tokens": 2048} for m in ("small", "large")},
        "entry": "small",
        "policy": {"name": "random", "p": 0.3, "seed": 0},
        "batching": {"thresholds": 1},
    }
    engine = Engine.from_config(cfg)
    try:
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        prompts = [[5 + i, 9, 17, 33 + i] for i in range(6)]
        engine.generate(prompts[:2], params)  # before recording: nothing is kept
        assert all(s.timeline is None for s in engine.subservers.values())
        steps_before = {m: s.num_steps for m, s in engine.subservers.items()}
        engine.record_timeline()
        outs = engine.generate(prompts, params)
        steps_during = {m: s.num_steps - steps_before[m] for m, s in engine.subservers.items()}
        events = engine.timeline_events()
        engine.record_timeline(False)
        engine.generate(prompts[:1], params)
        assert engine.timeline_events() == []
        check_recording(events, {"small", "large"})
        for m in engine.subservers:
            assert sum(1 for e in events if e["kind"] == "step" and e["model"] == m) == steps_during[m] > 0
        assert sum(1 for e in events if e["kind"] == "handoff") == sum(o.stats["handoffs"] for o in outs)
        assert sorted(e["request_id"] for e in events if e["kind"] == "arrive" and e["source"] is None) == sorted(
            o.request_id for o in outs)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_file_recorder_appends_and_merges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMELINE_DIR_ENV, str(tmp_path / "tl"))
    a, b = Timeline.from_env("small"), Timeline.from_env("large")
    assert a is not None and b is not None
    a.arrive("r", None, 2.0)
    b.arrive("r", "small", 1.0)
    a.flush()
    a.handoff("r", "large", 3.0)
    a.close()
    b.close()
    events = read_events(tmp_path / "tl")
    assert [(e["kind"], e["t"]) for e in events] == [("arrive", 1.0), ("arrive", 2.0), ("handoff", 3.0)]
    monkeypatch.delenv(TIMELINE_DIR_ENV)
    assert Timeline.from_env("small") is None


def test_file_recorder_that_cannot_write_keeps_recording_in_memory(tmp_path: Path) -> None:
    """A timeline file that cannot be written (here: its folder is a file) must not fail the loop that
    records: file output turns off and the events stay in memory."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    tl = Timeline("small", blocker / "small.jsonl")
    tl.arrive("r", None, 1.0)
    tl.flush()  # raises nothing
    assert tl.path is None
    tl.arrive("s", None, 2.0)
    assert [e["request_id"] for e in tl.take()] == ["r", "s"]


@pytest.mark.slow
def test_served_recording_under_load(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real tritonserver started with TOKENROUTER_TIMELINE_DIR records every subserver under a soak with
    cancellations, and `perf/timeline.py served` makes the trace and the summary from its files."""
    from soak import run_soak

    from triton_harness import running_server, tiny_deployment

    config = tiny_deployment(tmp_path / "timeline.yaml", tiny_dir, kv_cache_tokens=4096,
                             policy={"name": "random", "p": 0.3, "seed": 0},
                             batching={"thresholds": {"small": 2, "large": 1}})
    folder = tmp_path / "timeline"
    monkeypatch.setenv(TIMELINE_DIR_ENV, str(folder))
    with running_server(config, tmp_path) as server:
        result = run_soak(server.grpc_url, requests=60, concurrency=4, cancel_fraction=0.2, max_tokens=16,
                          metrics_url=server.metrics_url, seed=3)
        assert result.problems() == [], result
    events = read_events(folder)  # the server has stopped: every subserver flushed on finalize
    check_recording(events, {"small", "large"}, cancelled=result.cancelled)
    out = tmp_path / "out"
    tool = [sys.executable, str(REPO / "perf" / "timeline.py"), "served", str(folder), "--out", str(out)]
    proc = subprocess.run(tool,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["models"]) == {"small", "large"} and summary["handoffs"]["small -> large"]["count"] > 0
    # The router relayed every handoff and the target's process received it, in that order on one clock.
    relays = {(e["request_id"], e["target"]) for e in events if e["kind"] == "relay"}
    assert relays and relays <= {(e["request_id"], e["target"]) for e in events if e["kind"] == "handoff"}
    assert summary["router"]["batches"] > 0 and 0 < summary["router"]["busy_fraction"] < 1
    for direction, legs in ((k, h["legs"]) for k, h in summary["handoffs"].items()):
        assert legs["to the router"]["count"] > 0, direction
        assert all(leg["p50_ms"] >= 0 for leg in legs.values()), (direction, legs)
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
