"""Continuous-time discrete-event simulation of the delayed-batching system of :mod:`tokenrouter.tuning.system`.

Same model as the Markov chain of :mod:`tokenrouter.tuning.markov`, but with the real step latencies (no tick
rounding), plus an optional bounded wait. The state changes only at *event times*; at one event time (events closer
than :data:`SIMULTANEOUS` seconds count as simultaneous) the simulator applies the chain's order:

1. *complete* -- every step finishing now, in model order: each request of the batch, in FIFO order, draws its next
   model ``j`` with probability ``P[i][j]`` from the seeded ``random.Random``, commits ``tokens[i][j]`` tokens and
   joins the tail of ``j``'s queue (``transit[i][j]`` seconds later, when the model has transit); the model becomes
   idle;
2. *launch* -- every idle model ``i`` with ``q_i >= B_i`` -- or, with ``max_wait``, with ``q_i >= 1`` and a head of
   queue that has waited at least ``max_wait`` seconds -- starts a step on ``min(q_i, max_batch_i)`` requests from the
   head of its queue, which finishes ``step_latency[i][b - 1]`` seconds later.

With ``model.slowdown`` (models sharing one GPU) steps are processor-shared: a step runs at its time alone while no
other model steps, ``slowdown[i]`` times slower while one does, and the steps in flight are re-timed whenever a model
starts or ends one.

``max_wait`` is implemented with timer events at (arrival of the queue head + ``max_wait``). A deadlock -- nobody busy
and nothing scheduled, i.e. all ``N`` requests parked in queues below their thresholds -- ends the run and is
reported in :class:`SimResult` (it cannot happen with feasible thresholds or with ``max_wait``).

Statistics are taken after a warm-up (the first ``warmup_fraction`` of the duration or of the steps), so that the
start state (all requests queued at model 0) does not bias the steady-state estimates.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenrouter.tuning.system import SystemModel

SIMULTANEOUS = 1e-9
"""Events closer than this (seconds) are processed as one event time, so float noise cannot reorder them."""

_COMPLETE, _TIMER, _ARRIVE = 0, 1, 2


@dataclass
class SimResult:
    """Measurements over the window ``[window_start, end_time]`` (after warm-up).

    Attributes:
        throughput: committed tokens per second in the window; 0.0 if the run deadlocked (the long-run rate).
        tokens: tokens committed in the window.
        mean_batch: per model, mean batch size of the steps completed in the window (0 if none).
        mean_wait: per model, mean seconds a request waited in that model's queue before its step started, over the
            steps started in the window (0 if none).
        utilization: per model, fraction of the window it spent running steps.
        steps: per model, steps completed in the window.
        deadlocked: all requests were queued and no model could start; the run stopped at ``deadlock_time`` with
            ``deadlock_queues`` requests waiting per model.
    """

    throughput: float
    tokens: float
    window_start: float
    end_time: float
    mean_batch: list[float]
    mean_wait: list[float]
    utilization: list[float]
    steps: list[int]
    deadlocked: bool = False
    deadlock_time: float | None = None
    deadlock_queues: list[int] | None = None


def simulate(
    model: SystemModel,
    thresholds: Sequence[int],
    duration: float | None = None,
    num_steps: int | None = None,
    seed: int = 0,
    max_wait: float | None = None,
    warmup_fraction: float = 0.05,
) -> SimResult:
    """Simulate ``model`` under ``thresholds`` from "all requests queued at model 0".

    Args:
        duration: simulated seconds to run (events after it are not processed).
        num_steps: stop once this many steps (over all models) have completed. At least one of the two is required;
            with both, whichever comes first ends the run.
        seed: seed of the ``random.Random`` that draws the routing decisions.
        max_wait: if set, an idle model with ``1 <= q_i < B_i`` starts anyway once its oldest queued request has
            waited ``max_wait`` seconds.
        warmup_fraction: leading fraction of the duration (or of the steps) excluded from the statistics.
    """
    thr = model.check_thresholds(thresholds)
    if duration is None and num_steps is None:
        raise ValueError("give duration and/or num_steps")
    if duration is not None and not duration > 0.0:
        raise ValueError(f"duration must be positive, got {duration}")
    if num_steps is not None and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if max_wait is not None and not max_wait >= 0.0:
        raise ValueError(f"max_wait must be >= 0, got {max_wait}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")

    m, n_req = model.num_models, model.concurrency
    rng = random.Random(seed)
    caps = [model.batch_cap(i) for i in range(m)]
    cum = [list(itertools.accumulate(row)) for row in model.route_probs]
    assert model.tokens is not None
    toks = model.tokens
    lat = model.step_latency
    transit = model.transit if model.has_transit else None

    queues: list[deque[float]] = [deque() for _ in range(m)]  # enqueue times, FIFO
    queues[0].extend([0.0] * n_req)
    batch = [0] * m  # batch of the step in flight (0 = idle)
    started = [0.0] * m  # start time of the step in flight
    timer_due: list[float | None] = [None] * m  # the pending max_wait timer of each model, to avoid duplicates
    heap: list[tuple[float, int, int, int]] = []  # (time, tie-breaker, kind, model)
    counter = itertools.count()
    # Processor sharing (model.slowdown): a step holds `work` seconds of its time alone, done at `rate` (1 alone,
    # 1 / slowdown beside another model) since `since`; when the set of models stepping changes, every step in flight
    # is re-timed and its earlier completion event goes stale (`done_key` names the one that counts).
    share = model.slowdown if model.shares_gpu else None
    work, rate, since = [0.0] * m, [1.0] * m, [0.0] * m
    done_key: list[int | None] = [None] * m

    def reschedule(now: float) -> None:
        assert share is not None
        running = [i for i in range(m) if batch[i]]
        for i in running:
            work[i] = max(0.0, work[i] - (now - since[i]) * rate[i])
            new_rate = 1.0 / share[i] if len(running) > 1 else 1.0
            if new_rate != rate[i] or done_key[i] is None:
                rate[i], key = new_rate, next(counter)
                done_key[i] = key
                heapq.heappush(heap, (now + work[i] / new_rate, key, _COMPLETE, i))
            since[i] = now

    # Window statistics; reset() restarts them when the warm-up ends.
    window_start = 0.0
    tokens = 0.0
    steps = [0] * m
    batch_sum = [0] * m
    busy_time = [0.0] * m
    wait_sum = [0.0] * m
    launched = [0] * m  # requests that started a step (the denominator of the mean wait)

    def reset(now: float) -> None:
        nonlocal window_start, tokens
        window_start, tokens = now, 0.0
        for i in range(m):
            steps[i] = batch_sum[i] = launched[i] = 0
            busy_time[i] = wait_sum[i] = 0.0

    def launch_phase(now: float) -> None:
        for i in range(m):
            if batch[i]:
                continue
            qi = queues[i]
            if not qi:
                continue
            expired = max_wait is not None and now - qi[0] >= max_wait - SIMULTANEOUS
            if len(qi) >= thr[i] or expired:
                b = min(len(qi), caps[i])
                for _ in range(b):
                    wait_sum[i] += now - qi.popleft()
                launched[i] += b
                batch[i] = b
                started[i] = now
                if share is None:
                    heapq.heappush(heap, (now + lat[i][b - 1], next(counter), _COMPLETE, i))
                else:  # (timed by reschedule, once every launch of this time is known)
                    work[i], rate[i], since[i] = lat[i][b - 1], 0.0, now
            elif max_wait is not None:
                due = qi[0] + max_wait
                if timer_due[i] != due:
                    timer_due[i] = due
                    heapq.heappush(heap, (due, next(counter), _TIMER, i))

    warm_steps = int(warmup_fraction * num_steps) if num_steps is not None else None
    warm_time = warmup_fraction * duration if duration is not None else None
    warm_done = warmup_fraction == 0.0
    total_steps = 0
    now = 0.0
    launch_phase(now)
    if share is not None:
        reschedule(now)
    deadlocked = False
    while True:
        if not heap:
            # Nobody busy and no timer: every request sits in a queue below its threshold, forever.
            deadlocked = True
            break
        t = heap[0][0]
        if not warm_done and warm_time is not None and t > warm_time:
            reset(warm_time)
            warm_done = True
        if duration is not None and t > duration:
            now = duration
            break
        now = t
        finished: list[int] = []
        while heap and heap[0][0] <= now + SIMULTANEOUS:
            _, key, kind, i = heapq.heappop(heap)
            if kind == _COMPLETE:
                if share is None or key == done_key[i]:  # (else re-timed since: stale)
                    finished.append(i)
            elif kind == _ARRIVE:  # a request that was between models joins model i's queue
                queues[i].append(now)
            elif timer_due[i] is not None and timer_due[i] <= now + SIMULTANEOUS:
                timer_due[i] = None  # fired; launch_phase re-arms it if the model still has to wait
        finished.sort()
        for i in finished:
            b = batch[i]
            row_cum, row_tok = cum[i], toks[i]
            for _ in range(b):
                j = min(bisect.bisect_right(row_cum, rng.random()), m - 1)
                tokens += row_tok[j]
                if transit is not None and transit[i][j] > 0.0:
                    heapq.heappush(heap, (now + transit[i][j], next(counter), _ARRIVE, j))
                else:
                    queues[j].append(now)
            busy_time[i] += now - max(started[i], window_start)
            steps[i] += 1
            batch_sum[i] += b
            batch[i] = 0
            done_key[i] = None
        total_steps += len(finished)
        if not warm_done and warm_steps is not None and total_steps >= warm_steps:
            reset(now)  # after this time's completions, before its launches (those belong to the window)
            warm_done = True
        if num_steps is not None and total_steps >= num_steps:
            break
        launch_phase(now)
        if share is not None:
            reschedule(now)

    end = now
    for i in range(m):
        if batch[i]:  # a step still in flight at the end counts as busy up to the end
            busy_time[i] += max(0.0, end - max(started[i], window_start))
    span = end - window_start
    return SimResult(
        throughput=0.0 if deadlocked or span <= 0.0 else tokens / span,
        tokens=tokens,
        window_start=window_start,
        end_time=end,
        mean_batch=[batch_sum[i] / steps[i] if steps[i] else 0.0 for i in range(m)],
        mean_wait=[wait_sum[i] / launched[i] if launched[i] else 0.0 for i in range(m)],
        utilization=[busy_time[i] / span if span > 0.0 else 0.0 for i in range(m)],
        steps=steps,
        deadlocked=deadlocked,
        deadlock_time=end if deadlocked else None,
        deadlock_queues=[len(q) for q in queues] if deadlocked else None,
    )
