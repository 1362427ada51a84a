"""What a subserver measures about itself for threshold tuning: step latency by batch size, where its requests
go after a step (routing rates, and how many tokens such a step commits), and how long a handoff takes to reach it
from each other model (the transit).

The served deployment runs each subserver in its own process and solves thresholds in the router's, so the
measurements cross a process boundary as a plain, JSON-safe :meth:`StepStats.snapshot`, rebuilt (and validated) by
:meth:`StepStats.from_snapshot`.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

SNAPSHOT_VERSION = 3
_SNAPSHOT_KEYS = {"version", "latency", "rows", "moves", "committed_on_move", "transit", "recent"}
RECENT_STEPS = 2048
"""Steps kept with their end time (the last ones): the tuner reads from their overlap with other models' steps how
much models sharing a GPU slow each other (engine/sharing.py)."""
MAX_STEP_S = 60.0
"""A longer step is a suspended process or a clock glitch; as a recent step it is not kept."""
TREND_STEPS = 8
"""How many steps on the trend line a batch size's mean step time is pooled with (`StepStats.latency_table`). A size
seen in a few steps is mostly what those steps carried: in one served C=16 run on an H200 three 32B steps at 13
requests held a burst of prompts (267 tokens each, 43 ms against ~30 ms at 10-12 requests). As the table's largest
size, with no cheaper request allowed at a smaller batch (`tuning.system.sanitize_latency`), their raw mean raised
the entries at 10-12 by 4-7 ms, and the tuner held the 32B for 7 requests where servers without such a burst held
for 10-12 (perf/results/large_extend_2026-12-05). Pooled with 8 steps on the line they weigh as 36.5 ms, and replayed
from that server's steps the tuner holds for 10-11 (perf/results/tuner_trend_2026-12-05)."""
MAX_TRANSIT_S = 10.0
"""A longer handoff transit is not one: a stamp from another clock (or a suspended process); it is not counted."""


class StepStats:
    def __init__(self, since: float | None = None) -> None:
        """`since`: when this record begins on `time.monotonic()` (now by default)."""
        self._lock = threading.Lock()
        self.latency_sum: dict[int, float] = defaultdict(float)  # batch size -> seconds
        self.latency_count: dict[int, int] = defaultdict(int)
        self.rows = 0  # requests that sampled a token here
        self.moves: dict[str, int] = defaultdict(int)  # target model -> requests sent there
        self.committed_on_move: dict[str, int] = defaultdict(int)  # ... of which committed their token
        self.transit_sum: dict[str, float] = defaultdict(float)  # source model -> seconds of its handoffs' way here
        self.transit_count: dict[str, int] = defaultdict(int)
        # (end on time.monotonic(), seconds, batch size) of the last steps that gave their end.
        self.recent: deque[tuple[float, float, int]] = deque(maxlen=RECENT_STEPS)
        self.since = time.monotonic() if since is None else since
        self.as_of: float | None = None  # a rebuilt snapshot's moment; None: this process's record, up to now

    def record_step(self, batch_size: int, seconds: float, end: float | None = None) -> None:
        """A step of `batch_size` requests took `seconds`; `end`: when it ended on `time.monotonic()` (the clock every
        process of the machine shares), which keeps it among the recent steps."""
        # One zero, negative or NaN reading (a clock glitch) would poison the mean of its batch size forever.
        if batch_size < 1 or not (math.isfinite(seconds) and seconds > 0.0):
            return
        with self._lock:
            self.latency_sum[batch_size] += seconds
            self.latency_count[batch_size] += 1
            if end is not None and math.isfinite(end) and seconds <= MAX_STEP_S:
                self.recent.append((float(end), float(seconds), batch_size))

    def recent_record(self) -> tuple[list[tuple[float, float, int]], float, float]:
        """(the recent steps as (end, seconds, batch size), oldest first; from when, up to when): every step of this
        model between the two is among them. A full buffer begins where its oldest step began."""
        with self._lock:
            steps, since, until = list(self.recent), self.since, self._until()
        if len(steps) == RECENT_STEPS:
            since = max(since, steps[0][0] - steps[0][1])
        return steps, since, until

    def _until(self) -> float:
        """Where this record ends: now for this process's own, where it was taken for a snapshot's."""
        return time.monotonic() if self.as_of is None else self.as_of

    def record_route(self, target: str | None, committed: bool) -> None:
        """One sampled row: `target` None means it stayed here."""
        with self._lock:
            self.rows += 1
            if target is not None:
                self.moves[target] += 1
                self.committed_on_move[target] += int(committed)

    def record_transit(self, source: str, seconds: float) -> None:
        """A handoff from `source` reached this model `seconds` after it left there."""
        if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_TRANSIT_S):
            return
        with self._lock:
            self.transit_sum[source] += seconds
            self.transit_count[source] += 1

    def mean_transit(self, source: str) -> float | None:
        """Mean seconds of a handoff's way from `source` to this model, or None before one was measured."""
        with self._lock:
            n = self.transit_count.get(source, 0)
            return self.transit_sum[source] / n if n else None

    def latency_table(self, max_batch: int) -> list[float] | None:
        """Mean step time for batch sizes 1..max_batch, or None before any step was timed.

        Step time grows about linearly with batch size in the decode regime: the trend is the least-squares line
        over all steps (each size weighs as many steps as it took). A size's mean is pulled toward that line as if
        :data:`TREND_STEPS` steps on the line were among its own: a size seen a few times is mostly the trend, one
        seen often mostly its own mean. Unmeasured sizes between two measured ones are interpolated between those
        two. Outside the measured range they follow the trend's slope from the nearest measured size, clamped to
        what batching allows: a smaller batch is no slower and no cheaper per request than a larger one. The line
        alone can dive below zero: noisy means of 10 ms at batch 7 and 20 ms at batch 8 extrapolate to -50 ms at
        batch 1, which used to become a 1 us step and blow up the tuner's Markov chain.
        """
        with self._lock:
            sums = {b: (self.latency_sum[b], c) for b, c in self.latency_count.items() if c}
        if not sums:
            return None
        xs = sorted(sums)
        weight = sum(c for _, c in sums.values())
        mx = sum(b * c for b, (_, c) in sums.items()) / weight
        my = sum(total for total, _ in sums.values()) / weight
        var = sum(c * (b - mx) ** 2 for b, (_, c) in sums.items())
        cov = sum((b - mx) * (total - c * my) for b, (total, c) in sums.items())
        slope = max(0.0, cov / var) if var else 0.0
        points = {}
        for b, (total, c) in sums.items():
            trend = my + slope * (b - mx)
            points[b] = (total + TREND_STEPS * trend) / (c + TREND_STEPS) if trend > 0.0 else total / c
        ys = [points[x] for x in xs]
        lo, hi = xs[0], xs[-1]
        table = []
        for b in range(1, max_batch + 1):
            if b in points:
                t = points[b]
            elif b < lo:
                t = min(points[lo], max(points[lo] * b / lo, points[lo] - slope * (lo - b)))
            elif b > hi:
                t = max(points[hi], min(points[hi] * b / hi, points[hi] + slope * (b - hi)))
            else:
                k = bisect.bisect_left(xs, b)
                x0, x1 = xs[k - 1], xs[k]
                t = ys[k - 1] + (ys[k] - ys[k - 1]) * (b - x0) / (x1 - x0)
            table.append(t)
        return table

    def route_row(self, models: list[str], me: str) -> tuple[list[float], list[float]] | None:
        """(probabilities of the next model, tokens committed for each choice), or None before any data."""
        with self._lock:
            if self.rows == 0:
                return None
            probs = [self.moves.get(m, 0) / self.rows for m in models]
            tokens = [(self.committed_on_move[m] / self.moves[m]) if self.moves.get(m) else 1.0 for m in models]
        i = models.index(me)
        probs[i] = max(0.0, 1.0 - sum(p for j, p in enumerate(probs) if j != i))
        tokens[i] = 1.0
        return probs, tokens

    # -- crossing a process boundary ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The raw counters as plain JSON types: ``json.dumps`` works on it and :meth:`from_snapshot` inverts it.

        Sums and counts travel, not means, so snapshots of one model's instances could later be merged exactly.
        Batch sizes become string keys because JSON object keys are strings.
        """
        with self._lock:
            return {
                "version": SNAPSHOT_VERSION,
                "latency": {
                    str(b): [float(self.latency_sum[b]), int(c)] for b, c in sorted(self.latency_count.items()) if c
                },
                "rows": int(self.rows),
                "moves": {m: int(c) for m, c in self.moves.items()},
                "committed_on_move": {m: int(c) for m, c in self.committed_on_move.items()},
                "transit": {m: [float(self.transit_sum[m]), int(c)] for m, c in self.transit_count.items() if c},
                "recent": {
                    "since": float(self.since),
                    "as_of": self._until(),
                    "steps": [[end, seconds, b] for end, seconds, b in self.recent],
                },
            }

    @classmethod
    def from_snapshot(cls, d: Mapping[str, Any]) -> StepStats:
        """Rebuild from :meth:`snapshot`'s output (after a JSON round trip or not); ``ValueError`` if malformed.

        The router trusts nothing from another process: a wrong type, a negative count or more moves than rows
        would otherwise surface later as a routing row that does not sum to 1, inside the tuner thread.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"StepStats snapshot must be a mapping, got {type(d).__name__}")
        if set(d) != _SNAPSHOT_KEYS:
            raise ValueError(f"StepStats snapshot keys must be {sorted(_SNAPSHOT_KEYS)}, got {sorted(map(str, d))}")
        if _count(d["version"], "version") != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported StepStats snapshot version {d['version']!r}")
        out = cls()
        latency = _mapping(d["latency"], "latency")
        for key, value in latency.items():
            b = _batch_size(key)
            total, count = _sum_count(value, f"latency[{key!r}]")
            if count < 1 or total <= 0.0:
                raise ValueError(f"latency[{key!r}] needs a positive sum over at least one step, got {value!r}")
            if b in out.latency_count:
                raise ValueError(f"batch size {b} appears twice in latency")
            out.latency_sum[b], out.latency_count[b] = total, count
        out.rows = _count(d["rows"], "rows")
        moves = _mapping(d["moves"], "moves")
        committed = _mapping(d["committed_on_move"], "committed_on_move")
        for target, c in moves.items():
            out.moves[_name(target)] = _count(c, f"moves[{target!r}]")
        for target, c in committed.items():
            if target not in moves:
                raise ValueError(f"committed_on_move[{target!r}] has no matching moves entry")
            out.committed_on_move[_name(target)] = _count(c, f"committed_on_move[{target!r}]")
            if out.committed_on_move[target] > out.moves[target]:
                raise ValueError(f"committed_on_move[{target!r}] exceeds moves[{target!r}]")
        if sum(out.moves.values()) > out.rows:
            raise ValueError(f"moves ({sum(out.moves.values())}) exceed rows ({out.rows})")
        for source, value in _mapping(d["transit"], "transit").items():
            total, count = _sum_count(value, f"transit[{source!r}]")
            if count < 1 or total > MAX_TRANSIT_S * count:
                raise ValueError(f"transit[{source!r}] needs at least one handoff of at most {MAX_TRANSIT_S} s, "
                                 f"got {value!r}")
            out.transit_sum[_name(source)], out.transit_count[source] = total, count
        recent = _mapping(d["recent"], "recent")
        if set(recent) != {"since", "as_of", "steps"}:
            raise ValueError(f"recent keys must be ['as_of', 'since', 'steps'], got {sorted(map(str, recent))}")
        out.since, out.as_of = _seconds(recent["since"], "recent since"), _seconds(recent["as_of"], "recent as_of")
        steps = recent["steps"]
        if not isinstance(steps, (list, tuple)) or len(steps) > RECENT_STEPS:
            raise ValueError(f"recent steps must be a list of at most {RECENT_STEPS}")
        for k, step in enumerate(steps):
            if not isinstance(step, (list, tuple)) or len(step) != 3:
                raise ValueError(f"recent[{k}] must be [end, seconds, batch size], got {step!r}")
            end, seconds = _seconds(step[0], f"recent[{k}] end"), _seconds(step[1], f"recent[{k}] seconds")
            b = _count(step[2], f"recent[{k}] batch size")
            if b < 1 or not 0.0 < seconds <= MAX_STEP_S:
                raise ValueError(f"recent[{k}] needs a batch size >= 1 and 0 < seconds <= {MAX_STEP_S}, got {step!r}")
            out.recent.append((end, seconds, b))
        return out


def _sum_count(value: Any, what: str) -> tuple[float, int]:
    """A snapshot's [seconds_sum, count] pair (latency per batch size, transit per source)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{what} must be [seconds_sum, count], got {value!r}")
    return _seconds(value[0], f"{what} sum"), _count(value[1], f"{what} count")


def _mapping(value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return value


def _count(value: Any, what: str) -> int:
    # bool is an int subclass; True as a count is a bug upstream, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative finite number, got {value!r}")
    return float(value)


def _batch_size(key: Any) -> int:
    # JSON turns the int batch sizes into strings; a snapshot that never left the process still has them as str.
    if isinstance(key, str) and key.isdigit() and key.isascii():
        b = int(key)
    elif isinstance(key, int) and not isinstance(key, bool):
        b = key
    else:
        raise ValueError(f"latency key must be a batch size, got {key!r}")
    if b < 1:
        raise ValueError(f"latency batch size must be >= 1, got {key!r}")
    return b


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"model name must be a non-empty string, got {value!r}")
    return value
