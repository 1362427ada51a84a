"""How much models that share a GPU slow each other, read from the overlap of their recent steps.

On one H200 a Qwen3-0.6B step takes ~1.2 ms alone and ~2.3 ms while Qwen3-32B steps beside it; the 32B ~18 ms and
~22 ms (perf/results/served_h200_2026-12-04). A tuner that takes the latencies measured at the current operating
point as fixed cannot see that holding the 32B back for a fuller batch lets the 0.6B run alone meanwhile, and it kept
the 32B at threshold 1 where a threshold of 6 served 14 % more at C=8 (perf/results/sharing_h200_2026-12-04).

Each model's recent steps (StepStats.recent_record: end and duration on the machine's monotonic clock, which every
process shares) are set against the union of the other models' steps: the share `f` of a step's time during which
another model stepped too. Steps with f <= ALONE and f >= BESIDE of the same batch size give, where both were seen
at least MIN_STEPS times, the ratio of their mean times; a model's slowdown is those ratios' mean, weighted by the
rarer side's count. Under processor sharing a step of time alone A lasting T satisfies A = T * ((1 - f) + f / s),
which turns every recent step into an estimate of its time alone; the model's measured latency table, divided by how
much longer its recent steps took than that, is the table the simulator then runs at those rates
(tuning/simulator.py). Only for a deployment whose models all run on one device, locally (EngineConfig.one_device):
a model on another GPU or machine overlaps in time without slowing anyone, and another machine's clock is not
this one's.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence

from tokenrouter.engine.step_stats import StepStats

ALONE = 0.1
BESIDE = 0.9
MIN_STEPS = 3
MIN_SLOWDOWN = 1.05
"""A measured slowdown below this is noise (or models on separate GPUs): the model counts as unslowed."""

Interval = tuple[float, float]


def _union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(union: list[Interval], starts: list[float], start: float, end: float) -> float:
    """Seconds of [start, end] inside `union` (sorted, disjoint; `starts` its start times)."""
    total = 0.0
    k = max(0, bisect.bisect_right(starts, start) - 1)
    while k < len(union) and union[k][0] < end:
        a, b = union[k]
        total += max(0.0, min(b, end) - max(a, start))
        k += 1
    return total


def overlap_shares(models: Sequence[str], stats: Mapping[str, StepStats]) -> dict[str, list[tuple[int, float, float]]]:
    """Per model, its recent steps as (batch size, seconds, share of those seconds another model stepped too): only
    the steps inside the time every model's record covers (StepStats.recent_record). Outside it a model's steps would
    look alone where another's record has merely run out: a 0.6B keeps ~2.5 s of steps, a 32B ~40 s, and each
    snapshot reaches the router at its own moment."""
    records = {m: stats[m].recent_record() for m in models}
    lo = max(since for _, since, _ in records.values())
    hi = min(as_of for _, _, as_of in records.values())
    out: dict[str, list[tuple[int, float, float]]] = {}
    for m in models:
        union = _union([(end - s, end) for o in models if o != m for end, s, _ in records[o][0]])
        starts = [a for a, _ in union]
        out[m] = [(b, s, min(1.0, _covered(union, starts, end - s, end) / s))
                  for end, s, b in records[m][0] if end - s >= lo and end <= hi]
    return out


def slowdown_of(steps: list[tuple[int, float, float]]) -> float:
    """A model's slowdown beside others (1.0 where the steps cannot tell: too few alone or beside at one size)."""
    alone: dict[int, list[float]] = defaultdict(list)
    beside: dict[int, list[float]] = defaultdict(list)
    for b, s, f in steps:
        if f <= ALONE:
            alone[b].append(s)
        elif f >= BESIDE:
            beside[b].append(s)
    num = den = 0.0
    for b in alone.keys() & beside.keys():
        if len(alone[b]) >= MIN_STEPS and len(beside[b]) >= MIN_STEPS:
            w = min(len(alone[b]), len(beside[b]))
            num += w * (sum(beside[b]) / len(beside[b])) / (sum(alone[b]) / len(alone[b]))
            den += w
    factor = num / den if den else 1.0
    return factor if factor >= MIN_SLOWDOWN else 1.0


def alone_latency(steps: list[tuple[int, float, float]], slowdown: float, measured: list[float]) -> list[float]:
    """The measured latency table (`measured`, batch sizes 1..len) taken back to each step's time alone: divided,
    size by size, by how much longer the recent steps of that size took than alone (their summed times over their
    summed times alone; all recent steps together for a size too rarely seen). The measured table keeps every
    size's own measurement: the recent steps cover only the sizes of the last seconds, and extrapolating from those
    once made a 0.6B step at 8 rows look 4x its time at 1."""
    took: dict[int, float] = defaultdict(float)
    alone: dict[int, float] = defaultdict(float)
    seen: dict[int, int] = defaultdict(int)
    for b, s, f in steps:
        took[b] += s
        alone[b] += s * ((1.0 - f) + f / slowdown)
        seen[b] += 1
    overall = sum(took.values()) / sum(alone.values()) if alone else 1.0
    stretch = {b: took[b] / alone[b] for b in seen if seen[b] >= MIN_STEPS}
    return [t / stretch.get(b, overall) for b, t in enumerate(measured, start=1)]


def shared_gpu(models: Sequence[str], stats: Mapping[str, StepStats], max_batch: int
               ) -> tuple[list[float], list[list[float] | None]] | None:
    """(slowdown per model, latency table alone per model: None for an unslowed model, whose measured table stands),
    or None where no model measurably slows beside another. For models that all share one device (the caller
    knows): each is set against all the others together, as the simulator slows it beside any of them."""
    shares = overlap_shares(models, stats)
    factors = [slowdown_of(shares[m]) for m in models]
    if all(f == 1.0 for f in factors):
        return None
    tables: list[list[float] | None] = []
    for m, f in zip(models, factors):
        measured = stats[m].latency_table(max_batch)
        tables.append(alone_latency(shares[m], f, measured) if f > 1.0 and measured is not None else None)
    return factors, tables
