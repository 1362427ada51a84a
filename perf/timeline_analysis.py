"""Where the time goes: a Perfetto / chrome://tracing trace and a summary from timeline events
(backends/tokenrouter/engine/timeline.py).

Summary, per model, over the window from the first step's start to the last step's end (all models):
- busy fraction: time inside its steps / window; of a step, `forward` is the forward pass up to its tokens
  (and the policy's values) on the host, `route+commit` the routing, commit and handoffs after it;
- the step's phases, mean and median ms per step: `schedule` (choosing the batch), `prepare` (the host builds the
  inputs, up to the graph's replay or the first kernel's call), `launch` (that call until it returned: the
  launches, and the loop waiting for the GIL back from its process's other threads; the GPU is already working),
  `GPU wait` (from the launch until tokens and values are on the host: the GPU's work not hidden behind the
  host's, and the other model's kernels when they share the GPU), `route+commit`; the host's share of a step is
  everything but `GPU wait`. Events recorded before `prepare` and `launch` were told apart have one phase
  `prepare+launch`;
- batch histogram, mean batch, tokens per step, steps with an extend or prefill, step time by batch size;
- idle gaps between its consecutive steps, split by cause: `no request ready` (until the first of the next
  step's rows became ready); `waiting below threshold` (delayed batching, threshold > 1: from then until the
  last of its rows became ready, or until the step when it ran below the threshold after its bounded wait);
  the rest `host work` (rows ready, nothing to wait for: loop, inbox, scheduling; with lockstep loops also
  the other models' steps). A step that ran below its threshold because no request could arrive counts as
  waiting too (the event does not say why the loop stepped);
- handoff transit: a request parked by one model -> taken on by the next, per direction; where a served
  deployment recorded its legs, split into `to the router` (the source's response thread, its socket, the router's
  reader thread and loop), `to the process` (the router's send, the target's socket and reader thread) and `to the
  loop` (queued in the target's inbox until its loop takes it on: mostly the target finishing a step).
And across models: the time two or more models stepped at once (they share the GPU then); served, how busy the
router's loop was (handling the models' event batches: relaying handoffs, sending responses to clients).

Where a request's time goes (`request_life`): each visit of a request at a model, from its arrival there (served:
in the model's process, `receive`; in process: taken by its loop) to its handoff away, split into `waiting: the
model in another step` (it arrived while the model ran a step without it), `waiting: the model idle` (after that,
until its first step there started: delayed batching's hold, or the loop's host work), and `in its steps` (from its
first step's start to its handoff: the steps, and the gaps between them when it stays for several tokens, so a
hold between two of its tokens counts there); plus each handoff's transit (served: to the target's process). A
new request's first visit starts when its entry model's loop takes it. Its first step is the first to schedule
after it arrived (one that could not take it in, for KV blocks or the token budget, counts as its). Visits cut by
the window's edges, and the last visit of a request (it ends with no handoff), are left out.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from typing import Any

Event = dict[str, Any]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def window(events: list[Event]) -> tuple[float, float] | None:
    steps = [e for e in events if e["kind"] == "step"]
    if not steps:
        return None
    return min(e["start"] for e in steps), max(e["end"] for e in steps)


def models_of(events: list[Event]) -> list[str]:
    seen: dict[str, None] = {}
    for e in events:
        name = e.get("model") if e["kind"] != "handoff" else e.get("source")
        if name is not None:
            seen.setdefault(name, None)
    return list(seen)


def _gaps(steps: list[Event]) -> dict[str, float]:
    """A model's idle time between consecutive steps, by cause (see the module docstring)."""
    causes = {"no request ready": 0.0, "waiting below threshold": 0.0, "host work": 0.0}
    for prev, cur in zip(steps, steps[1:]):
        gap = max(0.0, cur["start"] - prev["end"])
        first = cur.get("first_ready")
        last = cur.get("last_ready", first)
        first = prev["end"] if first is None else min(max(first, prev["end"]), cur["start"])
        last = first if last is None else min(max(last, first), cur["start"])
        causes["no request ready"] += first - prev["end"]
        if cur.get("threshold", 1) > 1:
            # Delayed batching: from the first ready row until the last one came; and when the step still ran
            # below the threshold (its bounded wait expired), until the step too.
            waited = (cur["start"] if cur["batch"] < cur["threshold"] else last) - first
        else:
            waited = 0.0
        causes["waiting below threshold"] += waited
        causes["host work"] += gap - (first - prev["end"]) - waited
    return causes


PHASES = (("schedule", "schedule_start", "start"), ("prepare", "start", "submitted"),
          ("launch", "submitted", "launched"), ("GPU wait", "launched", "forward_end"),
          ("route+commit", "forward_end", "end"))
# Events recorded before `submitted` was: preparing and launching in one phase.
PHASES_UNSPLIT = (("schedule", "schedule_start", "start"), ("prepare+launch", "start", "launched"),
                  ("GPU wait", "launched", "forward_end"), ("route+commit", "forward_end", "end"))


def _phases(steps: list[Event]) -> tuple[dict[str, float], dict[str, float]] | None:
    """Mean and median milliseconds per step in each phase (see the module docstring), over the steps that
    recorded every stamp of PHASES (or, where none did, of PHASES_UNSPLIT); None for events recorded before the
    phases were (no `launched` time)."""
    for phases in (PHASES, PHASES_UNSPLIT):
        timed = [e for e in steps if all(e.get(k) is not None for _, a, b in phases for k in (a, b))]
        if timed:
            ms = {name: [1000 * (e[b] - e[a]) for e in timed] for name, a, b in phases}
            return ({n: statistics.fmean(v) for n, v in ms.items()}, {n: statistics.median(v) for n, v in ms.items()})
    return None


def _overlap(intervals_by_model: dict[str, list[tuple[float, float]]]) -> float:
    """Seconds during which at least two models were inside a step."""
    points = sorted((t, d) for ivs in intervals_by_model.values() for a, b in ivs for t, d in ((a, 1), (b, -1)))
    total, depth, last = 0.0, 0, None
    for t, d in points:
        if depth >= 2 and last is not None:
            total += t - last
        depth += d
        last = t
    return total


def transits(events: list[Event]) -> dict[str, list[float]]:
    """Seconds from a model's handoff to the target's arrival, by 'source -> target'."""
    pending: dict[tuple[str, str], float] = {}
    out: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e["kind"] == "handoff":
            pending[(e["request_id"], e["target"])] = e["t"]
        elif e["kind"] == "arrive" and e.get("source") is not None:
            sent = pending.pop((e["request_id"], e["model"]), None)
            if sent is not None:
                out[f"{e['source']} -> {e['model']}"].append(e["t"] - sent)
    return dict(out)


LEGS = (("to the router", "handoff", "relay"), ("to the process", "relay", "receive"),
        ("to the loop", "receive", "arrive"))


def transit_legs(events: list[Event]) -> dict[str, dict[str, list[float]]]:
    """Seconds of each leg of a handoff's transit (LEGS), by 'source -> target', for handoffs whose every leg
    was recorded (served deployments: the router records `relay`, the target's process `receive`)."""
    marks: dict[tuple[str, str], dict[str, float]] = {}
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        kind = e["kind"]
        if kind == "handoff":
            marks[(e["request_id"], e["target"])] = {"handoff": e["t"]}
        elif kind in ("relay", "receive"):
            # A mark that has this leg already was left by a handoff that never arrived (a cancel overtook it),
            # and this one's own handoff was not recorded (cut off by the window): neither is split.
            key = (e["request_id"], e["target"] if kind == "relay" else e["model"])
            m = marks.get(key)
            if m is not None and (kind in m or (kind == "receive" and "relay" not in m)):
                del marks[key]
            elif m is not None:
                m[kind] = e["t"]
        elif kind == "arrive" and e.get("source") is not None:
            m = marks.pop((e["request_id"], e["model"]), None)
            if m is None:
                continue
            m["arrive"] = e["t"]
            if all(k in m for _, a, b in LEGS for k in (a, b)):
                for name, a, b in LEGS:
                    out[f"{e['source']} -> {e['model']}"][name].append(m[b] - m[a])
    return {k: dict(v) for k, v in out.items()}


LIFE = ("waiting: the model in another step", "waiting: the model idle", "in its steps")


def request_life(events: list[Event]) -> dict[str, dict[str, list[float]]]:
    """Seconds of each part of each complete visit (LIFE), by model, and of each handoff's transit, by
    'source -> target' (see the module docstring)."""
    steps: dict[str, list[tuple[float, float]]] = defaultdict(list)  # model -> (start, end) of its steps, by start
    # model -> the starts of its steps that scheduled their rows: not those launched ahead (ModelConfig.step_ahead,
    # recorded with no `first_ready`), which run the rows of the step before them and take in no arrival
    scheduled: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e["kind"] == "step":
            steps[e["model"]].append((e["start"], e["end"]))
            if e.get("first_ready", e["start"]) is not None:
                scheduled[e["model"]].append(e["start"])
    for v in steps.values():
        v.sort()
    for v in scheduled.values():
        v.sort()
    begins = {m: [a for a, _ in v] for m, v in steps.items()}
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    arrived: dict[str, tuple[str, float]] = {}  # request -> (model, when) of its open visit
    sent: dict[tuple[str, str], float] = {}  # (request, target) -> its handoff's time
    received: set[tuple[str, str]] = set()  # (request, model): arrived in the process, not yet taken by the loop
    for e in sorted((e for e in events if e["kind"] in ("arrive", "receive", "handoff")), key=lambda e: e["t"]):
        rid = e["request_id"]
        if e["kind"] in ("arrive", "receive"):
            # Served, a handoff is `receive`d by the target's process and then waits in its loop's inbox, mostly for
            # the step in flight to end: the visit starts at the receive. In process: at the loop's `arrive`.
            if e["kind"] == "arrive" and (rid, e["model"]) in received:
                received.discard((rid, e["model"]))
                continue
            if e["kind"] == "receive":
                received.add((rid, e["model"]))
            arrived[rid] = (e["model"], e["t"])
            t0 = sent.pop((rid, e["model"]), None)
            if t0 is not None:
                out[f"{e['source']} -> {e['model']}"]["transit"].append(e["t"] - t0)
            continue
        sent[(rid, e["target"])] = e["t"]
        visit = arrived.pop(rid, None)
        if visit is None or visit[0] != e["source"]:
            continue  # its arrival lies before the window
        model, t_in = visit
        firsts = scheduled.get(model, [])
        i = bisect.bisect_left(firsts, t_in)  # its first step there: the first to schedule at or after its arrival
        # None before it left: the token a shadow row made while it was away committed on its arrival
        # (engine/shadow.py), once the loop took it in (after the step in flight).
        first = firsts[i] if i < len(firsts) and firsts[i] <= e["t"] else e["t"]
        # The model's steps in flight between its arrival and that step (the one it arrived during, and any
        # launched ahead of the rows before it).
        runs, starts = steps[model], begins[model]
        j, other = max(bisect.bisect_left(starts, t_in) - 1, 0), 0.0
        while j < len(runs) and runs[j][0] < first:
            other += max(0.0, min(runs[j][1], first) - max(runs[j][0], t_in))
            j += 1
        other = min(other, first - t_in)
        life = out[model]
        life[LIFE[0]].append(other)
        life[LIFE[1]].append(first - t_in - other)
        life[LIFE[2]].append(e["t"] - first)
    return {k: dict(v) for k, v in out.items()}


def summarize(events: list[Event]) -> dict[str, Any]:
    span = window(events)
    if span is None:
        return {"window_s": 0.0, "models": {}, "router": None, "handoffs": {}, "overlap_fraction": None}
    length = max(span[1] - span[0], 1e-9)
    steps_by_model: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e["kind"] == "step":
            steps_by_model[e["model"]].append(e)
    models: dict[str, Any] = {}
    for model in models_of(events):
        steps = sorted(steps_by_model.get(model, []), key=lambda e: e["start"])
        busy = sum(e["end"] - e["start"] for e in steps)
        forward = sum(e["forward_end"] - e["start"] for e in steps if e.get("forward_end"))
        phases = _phases(steps)
        phase_ms, phase_ms_p50 = phases if phases is not None else (None, None)
        by_batch: dict[int, list[float]] = defaultdict(list)
        for e in steps:
            by_batch[e["batch"]].append(e["end"] - e["start"])
        models[model] = {
            "steps": len(steps),
            "busy_fraction": busy / length,
            "forward_fraction_of_busy": forward / busy if busy else None,
            "mean_batch": statistics.fmean(e["batch"] for e in steps) if steps else None,
            "tokens_per_step": statistics.fmean(e["tokens"] for e in steps) if steps else None,
            "steps_with_extend": sum(1 for e in steps if e.get("extends")),
            # Rows for requests away from the model (engine/shadow.py), beside the batch; steps of those alone.
            "shadow_rows": sum(e.get("shadow", 0) for e in steps),
            "shadow_only_steps": sum(1 for e in steps if e.get("shadow") and not e["batch"]),
            "batch_histogram": dict(sorted(Counter(e["batch"] for e in steps).items())),
            "step_ms_by_batch": {b: 1000 * statistics.fmean(v) for b, v in sorted(by_batch.items())},
            "phase_ms": phase_ms,
            "phase_ms_p50": phase_ms_p50,
            "idle_s": _gaps(steps),
            # Per step, the longest a row waited since it became ready; the median over steps.
            "longest_wait_ms_p50": _ms(_pct([e["queue_wait_max"] for e in steps], 0.5)),
        }
    intervals = {m: [(e["start"], e["end"]) for e in s] for m, s in steps_by_model.items()}
    handoffs = {
        k: {"count": len(v), "p50_ms": _ms(_pct(v, 0.5)), "p99_ms": _ms(_pct(v, 0.99)),
            "mean_ms": _ms(statistics.fmean(v))}
        for k, v in transits(events).items()
    }
    for k, legs in transit_legs(events).items():
        if k in handoffs:
            handoffs[k]["legs"] = {
                name: {"count": len(v), "p50_ms": _ms(_pct(v, 0.5)), "mean_ms": _ms(statistics.fmean(v))}
                for name, v in legs.items()
            }
    batches = [e["end"] - e["start"] for e in events if e["kind"] == "router_batch"]
    router = None
    if batches:
        router = {"batches": len(batches), "busy_fraction": sum(batches) / length,
                  "mean_ms": _ms(statistics.fmean(batches)), "p99_ms": _ms(_pct(batches, 0.99))}
    sent = [e for e in events if e["kind"] == "responses"]
    responses = None
    if sent:
        waits = [e["oldest_wait"] for e in sent]
        responses = {"batches": len(sent), "chunks": sum(e["chunks"] for e in sent),
                     "sends": sum(e["sends"] for e in sent),
                     "busy_fraction": sum(e["end"] - e["start"] for e in sent) / length,
                     "oldest_wait_p50_ms": _ms(_pct(waits, 0.5)), "oldest_wait_p99_ms": _ms(_pct(waits, 0.99)),
                     "oldest_wait_max_ms": _ms(max(waits))}
    life = {
        k: {part: {"count": len(v), "mean_ms": _ms(statistics.fmean(v)), "p50_ms": _ms(_pct(v, 0.5)),
                   "p99_ms": _ms(_pct(v, 0.99)), "total_s": sum(v)} for part, v in parts.items()}
        for k, parts in request_life(events).items()
    }
    return {
        "window_s": length,
        "models": models,
        "router": router,
        "responses": responses,
        "handoffs": handoffs,
        "overlap_fraction": _overlap(intervals) / length if len(intervals) > 1 else None,
        "request_life": life,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def chrome_trace(events: list[Event]) -> dict[str, Any]:
    """The Trace Event Format (JSON) that Perfetto and chrome://tracing open: one track per model, each step a
    slice with `forward` (`prepare+launch` in it) and `route+commit` inside it, `schedule` before it, each
    handoff a flow arrow to the model that takes it; served, a `router loop` track with each batch of events
    its loop handled."""
    span = window(events)
    t0 = span[0] if span else min((e.get("t", 0.0) for e in events), default=0.0)
    tids = {m: i + 1 for i, m in enumerate(models_of(events))}
    router_tid = len(tids) + 1  # (its own track, whatever the models are called)
    out_router = []
    if any(e["kind"] == "router_batch" for e in events):
        out_router.append({"ph": "M", "pid": 1, "tid": router_tid, "name": "thread_name",
                           "args": {"name": "router loop"}})
    if any(e["kind"] == "responses" for e in events):
        out_router.append({"ph": "M", "pid": 1, "tid": router_tid + 1, "name": "thread_name",
                           "args": {"name": "router responder"}})
    out: list[dict[str, Any]] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "tokenrouter"}}]
    out += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": m}} for m, tid in tids.items()]
    out += out_router

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    flow = 0
    pending: dict[tuple[str, str], int] = {}
    for e in events:
        if e["kind"] == "step":
            tid = tids[e["model"]]
            args = {k: e.get(k) for k in ("batch", "shadow", "tokens", "extends", "threshold")}
            args["queue_wait_max_ms"] = round(1000 * e.get("queue_wait_max", 0.0), 3)
            out.append({"ph": "X", "pid": 1, "tid": tid, "name": f"step b{e['batch']}", "cat": "step",
                        "ts": us(e["start"]), "dur": us(e["end"]) - us(e["start"]), "args": args})
            if e.get("forward_end"):
                out.append({"ph": "X", "pid": 1, "tid": tid, "name": "forward", "cat": "step",
                            "ts": us(e["start"]), "dur": us(e["forward_end"]) - us(e["start"])})
                out.append({"ph": "X", "pid": 1, "tid": tid, "name": "route+commit", "cat": "step",
                            "ts": us(e["forward_end"]), "dur": us(e["end"]) - us(e["forward_end"])})
                if e.get("launched"):  # inside `forward`: the host's part before the GPU's work is waited on
                    split = e.get("submitted")
                    parts = ((("prepare", e["start"], split), ("launch", split, e["launched"])) if split is not None
                             else (("prepare+launch", e["start"], e["launched"]),))
                    for name, a, b in parts:
                        out.append({"ph": "X", "pid": 1, "tid": tid, "name": name, "cat": "step", "ts": us(a),
                                    "dur": us(b) - us(a)})
            if e.get("schedule_start"):
                out.append({"ph": "X", "pid": 1, "tid": tid, "name": "schedule", "cat": "host",
                            "ts": us(e["schedule_start"]), "dur": us(e["start"]) - us(e["schedule_start"])})
        elif e["kind"] == "router_batch":
            out.append({"ph": "X", "pid": 1, "tid": router_tid, "name": f"events x{e['events']}", "cat": "router",
                        "ts": us(e["start"]), "dur": us(e["end"]) - us(e["start"])})
        elif e["kind"] == "responses":
            out.append({"ph": "X", "pid": 1, "tid": router_tid + 1, "name": f"responses {e['chunks']}->{e['sends']}",
                        "cat": "router", "ts": us(e["start"]), "dur": us(e["end"]) - us(e["start"]),
                        "args": {"oldest_wait_ms": round(1000 * e["oldest_wait"], 3)}})
        elif e["kind"] == "handoff":
            flow += 1
            pending[(e["request_id"], e["target"])] = flow
            out.append({"ph": "s", "pid": 1, "tid": tids[e["source"]], "name": "handoff", "cat": "handoff",
                        "id": flow, "ts": us(e["t"])})
        elif e["kind"] == "arrive":
            tid = tids[e["model"]]
            fid = pending.pop((e["request_id"], e["model"]), None) if e.get("source") else None
            if fid is not None:
                out.append({"ph": "f", "bp": "e", "pid": 1, "tid": tid, "name": "handoff", "cat": "handoff",
                            "id": fid, "ts": us(e["t"])})
            out.append({"ph": "i", "s": "t", "pid": 1, "tid": tid, "cat": "arrive", "ts": us(e["t"]),
                        "name": "arrive" if e.get("source") else "new request",
                        "args": {"request_id": e["request_id"], "from": e.get("source")}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def markdown(summary: dict[str, Any], title: str) -> str:
    def f(v: Any, spec: str = ".1f") -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [f"# {title}", "", f"Window: {summary['window_s']:.3f} s (first step start -> last step end)."]
    if summary.get("overlap_fraction") is not None:
        lines.append(f"Two or more models stepping at once: {100 * summary['overlap_fraction']:.1f} % of the window.")
    lines += ["", "| model | steps | busy | forward of busy | mean batch | tokens/step | steps with extend | "
              "idle: no request ready | idle: below threshold | idle: host work | longest wait in a step, p50 ms |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in summary["models"].items():
        idle = s["idle_s"]
        share = {k: 100 * v / summary["window_s"] for k, v in idle.items()}
        lines.append(
            f"| {m} | {s['steps']} | {100 * s['busy_fraction']:.1f} % | "
            f"{f(None if s['forward_fraction_of_busy'] is None else 100 * s['forward_fraction_of_busy'])} % | "
            f"{f(s['mean_batch'], '.2f')} | {f(s['tokens_per_step'], '.1f')} | {s['steps_with_extend']} | "
            f"{share['no request ready']:.1f} % | {share['waiting below threshold']:.1f} % | "
            f"{share['host work']:.1f} % | {f(s['longest_wait_ms_p50'], '.2f')} |"
        )
    router = summary.get("router")
    if router:
        lines += ["", f"Router loop: {router['batches']} event batches, busy {100 * router['busy_fraction']:.1f} % of "
                  f"the window, {router['mean_ms']:.3f} ms per batch (p99 {router['p99_ms']:.3f})."]
    sent = summary.get("responses")
    if sent:
        lines += ["", f"Router responder: {sent['chunks']} responses as the loop made them (text or final), sent as "
                  f"{sent['sends']} "
                  f"(a stream's queued behind one another leave as one), busy {100 * sent['busy_fraction']:.1f} % of "
                  f"the window; the oldest of each batch had waited p50 {sent['oldest_wait_p50_ms']:.3f} / p99 "
                  f"{sent['oldest_wait_p99_ms']:.3f} / max {sent['oldest_wait_max_ms']:.3f} ms."]
    phased = {m: s for m, s in summary["models"].items() if s.get("phase_ms")}
    if phased:
        names = list(next(iter(phased.values()))["phase_ms"])
        lines += ["", "Phases of a step, mean / median ms (host share of the means: all but `GPU wait`):", "",
                  "| model | " + " | ".join(names) + " | host share |", "|---|" + "---:|" * (len(names) + 1)]
        for m, s in phased.items():
            ph, p50 = s["phase_ms"], s.get("phase_ms_p50") or {}
            total = sum(ph.values())
            host = (total - ph["GPU wait"]) / total if total else 0.0
            cells = [f"{ph[n]:.3f} / {p50[n]:.3f}" if n in p50 else f"{ph[n]:.3f}" for n in ph]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {100 * host:.1f} % |")
    lines += ["", "Batch sizes (steps per batch size) and mean step time by batch size:", ""]
    for m, s in summary["models"].items():
        hist = ", ".join(f"{b}: {n}" for b, n in s["batch_histogram"].items())
        times = ", ".join(f"{b}: {t:.2f}" for b, t in s["step_ms_by_batch"].items())
        lines += [f"- {m}: {hist or '-'}", f"  - ms per step: {times or '-'}"]
    if summary["handoffs"]:
        lines += ["", "| handoff | count | transit p50 ms | p99 ms | mean ms |", "|---|---:|---:|---:|---:|"]
        for k, h in summary["handoffs"].items():
            lines.append(f"| {k} | {h['count']} | {f(h['p50_ms'], '.3f')} | {f(h['p99_ms'], '.3f')} | "
                         f"{f(h['mean_ms'], '.3f')} |")
        legged = {k: h["legs"] for k, h in summary["handoffs"].items() if h.get("legs")}
        if legged:
            names = [name for name, _, _ in LEGS]
            lines += ["", "Legs of the transit (served), p50 / mean ms:", "",
                      "| handoff | handoffs | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
            for k, legs in legged.items():
                count = legs[names[0]]["count"]
                cells = " | ".join(f"{f(legs[n]['p50_ms'], '.3f')} / {f(legs[n]['mean_ms'], '.3f')}" for n in names)
                lines.append(f"| {k} | {count} | {cells} |")
    life = summary.get("request_life")
    if life:
        total = sum(part["total_s"] for parts in life.values() for part in parts.values())
        lines += ["", "Where the requests' time went: their complete visits at each model (from arrival to handoff) "
                  "and the transits between (`request_life`):", "",
                  "| where | part | count | mean ms | p50 ms | p99 ms | share of the time |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for k, parts in life.items():
            for name, part in parts.items():
                lines.append(f"| {k} | {name} | {part['count']} | {f(part['mean_ms'], '.2f')} | "
                             f"{f(part['p50_ms'], '.2f')} | {f(part['p99_ms'], '.2f')} | "
                             f"{100 * part['total_s'] / total if total else 0.0:.1f} % |")
    return "\n".join(lines) + "\n"
