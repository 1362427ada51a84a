"""What `thresholds: auto` would choose at a moment of a recorded served run (issue 11: why one server held the 32B
for 7 requests at C=16 where another, of the same code, held it for 11).

A deployment's tuner solves from each model's StepStats, recorded over the server's life. A raw timeline (the
folder a server wrote with TOKENROUTER_TIMELINE_DIR) holds what went into them, so the events up to a moment T
rebuild them as the subservers recorded them: each step's time by the batch the GPU ran (void rows included) with
its end (how models sharing a GPU slow each other), where each sampled row went, each handoff's transit to its
target's process. Then engine/autotune.solve_thresholds answers as the router's tuner does, but picking freely as its
first solves do: the rule that keeps the thresholds in force unless beaten by SWITCH_GAIN makes each solve depend on the
ones before (and the coordinator lowers a threshold while fewer requests are in the system, so a step's threshold is
not the solve's). The concurrency is given, not measured (the tuner's LoadMeter). For comparison, each line names the
threshold each model's steps ran at most often in the RAN_WINDOW_S before the moment.

Not recorded in a timeline, so assumed: a row that leaves the entry model does not commit its token (R2R and random
drop the small model's token when they escalate; `commit_on_move` otherwise), and every other sampled row commits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from timeline_predict import entry_first, steps_as_recorded

from tokenrouter.engine.autotune import solve_thresholds, system_model
from tokenrouter.engine.step_stats import StepStats

Event = dict[str, Any]
RAN_WINDOW_S = 2.0


@dataclass
class Replayed:
    """The tuner's inputs at a moment: `models` (the entry model first), their StepStats; `ran`: the threshold each
    model's steps ran at most often in the RAN_WINDOW_S before the moment."""

    models: list[str]
    stats: dict[str, StepStats]
    ran: dict[str, int]


def replay_stats(events: list[Event], moment: float, commit_on_move: float = 0.0) -> Replayed:
    """Each model's StepStats as recorded up to `moment` (time.monotonic() of the machine that recorded)."""
    steps = [e for e in events if e["kind"] == "step" and e["end"] <= moment]
    models = list(dict.fromkeys(e["model"] for e in steps))
    if not models:
        raise ValueError(f"no step ended by {moment}")
    entry, models = entry_first(events, models)
    stats, rows = steps_as_recorded(models, steps, with_ends=True)
    ran: dict[str, Counter] = {m: Counter() for m in models}
    for e in steps:
        if e["end"] > moment - RAN_WINDOW_S:
            ran[e["model"]][int(e.get("threshold", 1))] += 1
    moves = Counter((e["source"], e["target"]) for e in events if e["kind"] == "handoff" and e["t"] <= moment)
    for m in models:
        stats[m].as_of = moment
        for target in models:
            for k in range(moves[(m, target)]):
                # the share commit_on_move of the entry model's moves commits, spread evenly over them
                committed = m != entry or int((k + 1) * commit_on_move) > int(k * commit_on_move)
                stats[m].record_route(target, committed)
        for _ in range(max(0, rows[m] - sum(moves[(m, t)] for t in models))):
            stats[m].record_route(None, True)
    for src, dst, seconds in _received(events, moment):
        if dst in stats:
            stats[dst].record_transit(src, seconds)
    return Replayed(models, stats, {m: c.most_common(1)[0][0] for m, c in ran.items() if c})


def _received(events: list[Event], moment: float) -> list[tuple[str, str, float]]:
    """(source, target, seconds) of each handoff received by `moment`: from the source's handoff to the target
    process's `receive`, where a subserver measures a transit (Subserver.note_arrival; the wait for its loop after
    that is queueing, which the tuner's model has). An in-process timeline has no `receive`: its handoffs take
    microseconds, which the tuner leaves out anyway."""
    sent: dict[tuple[str, str], Event] = {}
    out = []
    for e in events:
        if e["kind"] == "handoff":
            sent[(e["request_id"], e["target"])] = e
        elif e["kind"] == "receive" and e["t"] <= moment:
            h = sent.pop((e["request_id"], e["model"]), None)
            if h is not None:
                out.append((h["source"], e["model"], e["t"] - h["t"]))
    return out


def replay(events: list[Event], concurrency: int, moment: float, max_wait: float | None = None,
           one_device: bool = False, commit_on_move: float = 0.0) -> str:
    """What the tuner solves at `moment` for `concurrency` requests, in one line: the thresholds, those the steps
    ran at, the expected tokens/s, and each model's step time by batch size as the tuner's model had it
    (ms; on one GPU, the time alone). `max_wait`, `one_device`: the deployment's (batching.max_wait_ms in seconds;
    every model on one GPU)."""
    r = replay_stats(events, moment, commit_on_move)
    tuned = solve_thresholds(r.models, r.stats, concurrency, max_wait=max_wait, one_device=one_device)
    model = system_model(r.models, r.stats, concurrency, one_device=one_device)
    if tuned is None or model is None:
        return f"T={moment:.1f}: no solve (a model has measured nothing yet)"
    ran = ", ".join(f"{m} {r.ran.get(m, '-')}" for m in r.models)
    tables = "; ".join(f"{m} ms [{', '.join(f'{x * 1e3:.1f}' for x in row)}]"
                       for m, row in zip(r.models, model.step_latency))
    return (f"T={moment:.1f} N={tuned.concurrency}: thresholds {tuned.thresholds} ({tuned.predicted_tok_s:,.0f} "
            f"tok/s expected, {tuned.method}; the steps ran at {ran}); {tables}")
