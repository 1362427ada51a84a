"""The queueing abstraction of a token-routing deployment that the tuners reason about.

Model of the system (shared by :mod:`tokenrouter.tuning.markov` and :mod:`tokenrouter.tuning.simulator`):

* ``M`` subservers (models), each with its own FIFO queue and its own decoding loop. A subserver is either idle or
  running exactly one step (one forward pass) over a batch of requests taken from the head of its queue.
* A closed population of ``N`` requests (fixed concurrency): a finished request is immediately replaced by a new one,
  so the number of requests in the system never changes and request lengths do not appear in the model.
* After a step on model ``i`` every request of the batch independently picks the model of its next step: model ``j``
  with probability ``route_probs[i][j]`` (``j == i`` means it stays). Its choice commits ``tokens[i][j]`` tokens to its
  response (e.g. R2R discards the small model's token when the router escalates to the large model, so
  ``tokens[small][large] == 0``).
* A step of model ``i`` with batch size ``b`` takes the deterministic time ``step_latency[i][b - 1]`` seconds.
* Optionally, a request moving from ``i`` to ``j != i`` joins ``j``'s queue ``transit[i][j]`` seconds after its step
  ended (the handoff's way between the models: a served deployment's response thread, sockets and router). Only the
  simulator models transit; the Markov chain refuses a model with any.
* *Delayed batching*: an idle subserver ``i`` starts a step only when at least ``B_i`` requests wait in its queue; the
  batch is then ``min(queue, max_batch[i])``. Because a waiting subserver holds at most ``B_i - 1`` requests, if
  ``sum(B_i - 1) >= N`` all ``N`` requests can end up parked in queues with no subserver allowed to start (deadlock);
  ``sum(B_i - 1) < N`` rules this out by pigeonhole. Those are the thresholds :func:`feasible_thresholds` yields.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_ROW_SUM_TOL = 1e-9


@dataclass
class SystemModel:
    """A closed token-routing system: ``N`` requests over ``M`` models with Markov routing between steps.

    Attributes:
        concurrency: ``N``, the fixed number of requests in the system.
        route_probs: ``M x M``; ``route_probs[i][j]`` is the probability that a request, after a step on model ``i``,
            has its next step on model ``j``. Rows sum to 1.
        step_latency: ``M`` rows; ``step_latency[i][b - 1]`` is the duration in seconds of one step of model ``i`` with
            batch size ``b``. Each row must cover every batch size the model can run (``min(N, max_batch[i])``);
            longer rows are allowed and the extra entries are ignored.
        tokens: ``M x M``; ``tokens[i][j]`` tokens are committed by a request that steps on ``i`` and goes next to
            ``j``. ``None`` means 1.0 everywhere.
        max_batch: optional per-model cap on the batch size (``None``: no cap beyond ``N``).
        transit: optional ``M x M`` seconds a request moving from ``i`` to ``j`` spends between the models (the
            diagonal is ignored: a request that stays is queued at once). ``None`` means none.
        slowdown: optional, one factor >= 1 per model: the models share one GPU, and a step of model ``i`` runs
            ``slowdown[i]`` times slower while another model steps beside it (``step_latency`` is then its time
            alone). Only the simulator models it (processor sharing); ``None``: independent models.
    """

    concurrency: int
    route_probs: list[list[float]]
    step_latency: list[list[float]]
    tokens: list[list[float]] | None = None
    max_batch: list[int] | None = None
    transit: list[list[float]] | None = None
    slowdown: list[float] | None = None

    def __post_init__(self) -> None:
        n = self.concurrency
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"concurrency must be a positive int, got {n!r}")
        m = len(self.route_probs)
        if m < 1:
            raise ValueError("route_probs must have at least one row (one model)")
        self.route_probs = [[float(p) for p in row] for row in self.route_probs]
        for i, row in enumerate(self.route_probs):
            if len(row) != m:
                raise ValueError(f"route_probs must be square ({m}x{m}); row {i} has {len(row)} entries")
            if any(not math.isfinite(p) or p < 0.0 for p in row):
                raise ValueError(f"route_probs[{i}] has a negative or non-finite entry: {row}")
            if abs(sum(row) - 1.0) > _ROW_SUM_TOL:
                raise ValueError(f"route_probs[{i}] must sum to 1, sums to {sum(row)!r}")

        if self.max_batch is not None:
            if len(self.max_batch) != m:
                raise ValueError(f"max_batch needs one entry per model ({m}), got {len(self.max_batch)}")
            for i, cap in enumerate(self.max_batch):
                if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                    raise ValueError(f"max_batch[{i}] must be a positive int, got {cap!r}")
            self.max_batch = list(self.max_batch)

        if len(self.step_latency) != m:
            raise ValueError(f"step_latency needs one row per model ({m}), got {len(self.step_latency)}")
        self.step_latency = [[float(x) for x in row] for row in self.step_latency]
        for i, row in enumerate(self.step_latency):
            need = self.batch_cap(i)
            if len(row) < need:
                raise ValueError(f"step_latency[{i}] must give batch sizes 1..{need}, has only {len(row)} entries")
            if any(not math.isfinite(x) or x <= 0.0 for x in row):
                raise ValueError(f"step_latency[{i}] must be positive and finite: {row}")

        if self.tokens is None:
            self.tokens = [[1.0] * m for _ in range(m)]
        else:
            if len(self.tokens) != m or any(len(row) != m for row in self.tokens):
                raise ValueError(f"tokens must be {m}x{m}")
            self.tokens = [[float(t) for t in row] for row in self.tokens]
            if any(not math.isfinite(t) or t < 0.0 for row in self.tokens for t in row):
                raise ValueError(f"tokens must be non-negative and finite: {self.tokens}")

        if self.transit is not None:
            if len(self.transit) != m or any(len(row) != m for row in self.transit):
                raise ValueError(f"transit must be {m}x{m}")
            self.transit = [[0.0 if i == j else float(t) for j, t in enumerate(row)]
                            for i, row in enumerate(self.transit)]
            if any(not math.isfinite(t) or t < 0.0 for row in self.transit for t in row):
                raise ValueError(f"transit must be non-negative and finite: {self.transit}")

        if self.slowdown is not None:
            if len(self.slowdown) != m:
                raise ValueError(f"slowdown needs one factor per model ({m}), got {len(self.slowdown)}")
            self.slowdown = [float(f) for f in self.slowdown]
            if any(not (math.isfinite(f) and f >= 1.0) for f in self.slowdown):
                raise ValueError(f"slowdown factors must be finite and >= 1: {self.slowdown}")

    @property
    def shares_gpu(self) -> bool:
        """Some model's steps slow down beside another's (which only the simulator models)."""
        return self.slowdown is not None and any(f > 1.0 for f in self.slowdown)

    @property
    def has_transit(self) -> bool:
        """Some move between two models takes time (which only the simulator models)."""
        return self.transit is not None and any(t > 0.0 for row in self.transit for t in row)

    @property
    def num_models(self) -> int:
        return len(self.route_probs)

    def batch_cap(self, i: int) -> int:
        """Largest batch model ``i`` can run: ``min(N, max_batch[i])``."""
        return self.concurrency if self.max_batch is None else min(self.concurrency, self.max_batch[i])

    def latency(self, i: int, batch: int) -> float:
        """Seconds of one step of model ``i`` at batch size ``batch`` (1-based)."""
        return self.step_latency[i][batch - 1]

    def tokens_per_request(self, i: int) -> float:
        """Expected tokens one request commits per step on model ``i``: ``sum_j P[i][j] * tokens[i][j]``."""
        assert self.tokens is not None
        return sum(p * t for p, t in zip(self.route_probs[i], self.tokens[i]))

    def check_thresholds(self, thresholds: Sequence[int]) -> tuple[int, ...]:
        """Validate a threshold vector (one int >= 1 per model) and return it as a tuple.

        Thresholds above ``N`` are accepted (that model can then never start) and so are infeasible vectors: the
        simulator must be able to demonstrate the deadlock they cause.
        """
        raw = tuple(thresholds)
        if len(raw) != self.num_models:
            raise ValueError(f"need one threshold per model ({self.num_models}), got {len(raw)}")
        out = []
        for i, b in enumerate(raw):
            try:
                value = operator.index(b)  # ints and numpy integers; not floats
            except TypeError:
                value = 0
            if isinstance(b, bool) or value < 1:
                raise ValueError(f"thresholds[{i}] must be an int >= 1, got {b!r}")
            out.append(value)
        return tuple(out)


def is_feasible(thresholds: Sequence[int], concurrency: int) -> bool:
    """``sum(B_i - 1) < N``: the pigeonhole condition under which requests can never all wait in queues."""
    return sum(b - 1 for b in thresholds) < concurrency


def clamp_thresholds(thresholds: Sequence[int], concurrency: int) -> tuple[int, ...]:
    """`thresholds` lowered until feasible for `concurrency` requests (at least 1): the largest (the first of equals)
    down by one at a time until sum(B_i - 1) < N, so the requests can never all wait in queues."""
    want = list(thresholds)
    while not is_feasible(want, max(1, concurrency)):
        want[max(range(len(want)), key=want.__getitem__)] -= 1
    return tuple(want)


def feasible_thresholds(num_models: int, concurrency: int) -> Iterator[tuple[int, ...]]:
    """Every threshold vector ``(B_1, ..., B_M)`` with ``B_i >= 1`` and ``sum(B_i - 1) < N``, in lexicographic order.

    ``B_i <= N`` follows from the condition. There are ``C(N - 1 + M, M)`` of them (36 for ``M = 2, N = 8``).
    """
    if num_models < 1 or concurrency < 1:
        raise ValueError("num_models and concurrency must be >= 1")

    def rec(k: int, slack: int) -> Iterator[tuple[int, ...]]:
        # `slack` = how much of sum(B_i - 1) <= N - 1 is still unspent by the remaining k models.
        if k == 0:
            yield ()
            return
        for extra in range(slack + 1):
            for rest in rec(k - 1, slack - extra):
                yield (extra + 1, *rest)

    yield from rec(num_models, concurrency - 1)


def linear_latency(concurrency: int, base: float, per_request: float) -> list[float]:
    """A latency row ``base + per_request * b`` for ``b = 1..N`` (a decode step's usual shape)."""
    return [base + per_request * b for b in range(1, concurrency + 1)]


def sanitize_latency(row: Sequence[float]) -> list[float]:
    """A measured latency row made fit for the tuners: every entry positive and finite, and none absurdly small.

    Non-finite or non-positive entries (a clock glitch, a sum over zero steps) take the value of the nearest valid
    entry, the larger batch on a tie. Then no step may cost less per request than a larger batch does:
    ``row[b - 1] >= row[b' - 1] * b / b'`` for every ``b' > b`` -- batching only amortizes work, so a smaller batch
    never runs a request more cheaply. That bound lifts an extrapolated ~0 (1 us next to 20 ms steps), which would
    otherwise count as a free step. Raises ``ValueError`` when the row has no valid entry at all.
    """
    values = [float(x) for x in row]
    valid = [i for i, x in enumerate(values) if math.isfinite(x) and x > 0.0]
    if not valid:
        raise ValueError(f"latency row has no positive finite entry: {list(row)}")
    ok = set(valid)
    filled = [x if i in ok else values[min(valid, key=lambda v: (abs(v - i), -v))] for i, x in enumerate(values)]
    floor_per_request = 0.0  # max over larger batches of (their step time / their batch size)
    for i in range(len(filled) - 1, -1, -1):
        b = i + 1
        filled[i] = max(filled[i], floor_per_request * b)
        floor_per_request = max(floor_per_request, filled[i] / b)
    return filled
