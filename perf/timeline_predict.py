"""Does the tuning model predict what a deployment measured? (issue 11: measured >= 0.9x the prediction)

From one recorded window (perf/timeline.py) and the benchmark's runs in it (perf/bench_served.py's json), the
tuning model's inputs are rebuilt the way the deployment measures them itself (engine/step_stats.py: each model's
mean step time by batch size, which includes the slowdown of sharing the GPU with the other model; where requests
go after a step), and the simulator (tuning/simulator.py) predicts the long-run tokens/s at the thresholds the
steps ran with. Once from step times and routing alone (how the tuner ranks thresholds) and once with the
handoffs' measured way between the models (a served timeline's legs "to the router" + "to the process", mean per
direction; what the tuner's expected tokens/s now counts too): the part of a handoff's transit that is not
queueing at the target.

Committed tokens per move: a row that stays commits its token, and so does one handed back to the entry model (the
model that ends a lease commits its last token, engine/subserver.py); of the rows that leave the entry model a share
c commits, solved from the benchmark's token count (R2R and random drop the small model's token when they escalate:
c = 0; the timeline does not record commits).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from timeline_analysis import transit_legs

from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning.simulator import simulate
from tokenrouter.tuning.system import SystemModel, sanitize_latency

Event = dict[str, Any]
SIM_SECONDS = 300.0


def measured_rate(runs: list[dict[str, Any]]) -> float:
    """Output tokens / seconds over the benchmark's runs (each run's ramp and drain included, as it reports)."""
    return sum(r["output_tokens"] for r in runs) / sum(r["duration_s"] for r in runs)


def entry_first(events: list[Event], models: list[str]) -> tuple[str, list[str]]:
    """(the entry model: where new requests arrive, else the first of `models`; `models` with it first)."""
    entry = next((e["model"] for e in events if e["kind"] == "arrive" and e.get("source") is None), models[0])
    return entry, sorted(models, key=lambda m: m != entry)


def steps_as_recorded(models: list[str], steps: list[Event], with_ends: bool = False
                      ) -> tuple[dict[str, StepStats], Counter]:
    """Each model's StepStats fed `steps` as its subserver records them (the batch the GPU ran, void and shadow rows
    included; `with_ends`: each step's end too, a record of recent steps from the first one's start on), and the rows
    each model sampled (without void or shadow ones)."""
    since = min((e["start"] for e in steps), default=0.0)
    stats = {m: StepStats(since=since) for m in models}
    rows: Counter = Counter()
    for e in steps:
        stats[e["model"]].record_step(e["batch"] + e.get("void", 0) + e.get("shadow", 0), e["end"] - e["start"],
                                      e["end"] if with_ends else None)
        rows[e["model"]] += e["batch"]
    return stats, rows


def system_model(events: list[Event], concurrency: int, output_tokens: int,
                 with_transit: bool) -> tuple[SystemModel, tuple[int, ...], dict[str, Any]]:
    """(the model, the thresholds the steps ran with, what went into it) from the window's events."""
    steps = [e for e in events if e["kind"] == "step"]
    models = list(dict.fromkeys(e["model"] for e in steps))
    if len(models) < 2:
        raise ValueError(f"the window holds steps of {len(models)} model(s); a routed deployment needs two or more")
    entry, models = entry_first(events, models)  # the simulator starts every request at model 0: the entry model
    stats, rows = steps_as_recorded(models, steps)
    moves = Counter((e["source"], e["target"]) for e in events if e["kind"] == "handoff")
    escalated = sum(n for (src, _), n in moves.items() if src == entry)
    sure = sum(rows.values()) - escalated  # rows that stayed, and rows handed back to the entry model
    commit = min(1.0, max(0.0, (output_tokens - sure) / escalated)) if escalated else 1.0
    n = concurrency
    route, tokens, latency = [], [], []
    for m in models:
        probs = [moves[(m, t)] / rows[m] if t != m else 0.0 for t in models]
        probs[models.index(m)] = max(0.0, 1.0 - sum(probs))
        route.append(probs)
        tokens.append([commit if m == entry and t != m else 1.0 for t in models])
        latency.append(sanitize_latency(stats[m].latency_table(n)))
    transit = None
    legs = transit_legs(events) if with_transit else {}
    if legs:
        transit = [[0.0] * len(models) for _ in models]
        for i, a in enumerate(models):
            for j, b in enumerate(models):
                leg = legs.get(f"{a} -> {b}")
                if leg:
                    transit[i][j] = statistics.mean(leg["to the router"]) + statistics.mean(leg["to the process"])
    thresholds = tuple(Counter(e["threshold"] for e in steps if e["model"] == m).most_common(1)[0][0]
                       for m in models)
    inputs = {"models": models, "route_probs": route, "commit_on_move": commit, "transit_s": transit,
              "latency_ms": {m: [round(x * 1e3, 3) for x in row] for m, row in zip(models, latency)},
              "steps": {m: sum(1 for e in steps if e["model"] == m) for m in models}}
    return SystemModel(n, route, latency, tokens=tokens, transit=transit), thresholds, inputs


def predict(events: list[Event], runs: list[dict[str, Any]], max_wait_s: float | None = None) -> dict[str, Any]:
    """Measured tokens/s against the model's prediction, without and with transit; `max_wait_s`: the deployment's
    bounded wait below a threshold (batching.max_wait_ms)."""
    concurrency = runs[0]["concurrency"]
    if any(r["concurrency"] != concurrency for r in runs):
        raise ValueError("the benchmark's runs mix concurrencies: give one point's runs")
    tokens = sum(r["output_tokens"] for r in runs)
    out: dict[str, Any] = {"concurrency": concurrency, "measured_tok_s": measured_rate(runs), "max_wait_s": max_wait_s}
    for label, with_transit in (("no_transit", False), ("transit", True)):
        model, thresholds, inputs = system_model(events, concurrency, tokens, with_transit)
        if with_transit and not model.has_transit:
            out[label] = {"note": "no handoff legs in the window (an in-process timeline): nothing to add"}
            continue
        sim = simulate(model, thresholds, duration=SIM_SECONDS, max_wait=max_wait_s)
        out[label] = {"predicted_tok_s": sim.throughput, "ratio": out["measured_tok_s"] / sim.throughput,
                      "thresholds": list(thresholds), "mean_batch": sim.mean_batch,
                      "utilization": sim.utilization, "inputs": inputs}
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"C={result['concurrency']}: measured {result['measured_tok_s']:,.1f} tok/s", "",
             "| model inputs | predicted tok/s | measured / predicted | thresholds | mean batch (sim) |",
             "|---|---:|---:|---|---|"]
    for label in ("no_transit", "transit"):
        r = result[label]
        if "note" in r:
            lines.append(f"| {label} | - | - | {r['note']} | |")
            continue
        lines.append(f"| {'step times and routing' if label == 'no_transit' else '+ handoff transit'} | "
                     f"{r['predicted_tok_s']:,.1f} | {r['ratio']:.3f} | {r['thresholds']} | "
                     f"{', '.join(f'{b:.2f}' for b in r['mean_batch'])} |")
    inputs = result["no_transit"]["inputs"]
    lines += ["", f"Inputs: routing {inputs['route_probs']}, committed per move {inputs['commit_on_move']:.3f}, "
              f"steps {inputs['steps']}; mean step ms by batch: {inputs['latency_ms']}"]
    if "inputs" in result["transit"]:
        lines.append(f"Transit (to the router + to the process, mean s): {result['transit']['inputs']['transit_s']}")
    return "\n".join(lines) + "\n"
