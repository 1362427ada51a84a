"""Long-run throughput of the delayed-batching system (see :mod:`tokenrouter.tuning.system`) from a Markov chain.

Time is counted in *ticks* of ``tick`` seconds (default: :func:`default_tick`, a fraction of the fastest model's
typical step that keeps the chain within a state budget). Every step latency is rounded to the nearest whole number of
ticks, at least 1 (``rounding="nearest"``); that rounding is the only approximation of the continuous-time system of
:mod:`tokenrouter.tuning.simulator`. A finer tick means a smaller rounding error and more states.
``rounding="stochastic"`` instead lasts ``floor(L / tick)`` or ``ceil(L / tick)`` ticks with the probabilities that
make the mean exact, which removes most of the systematic bias of a coarse tick (at ~1.5-2x the states).

State, observed at tick boundaries: per subserver ``i`` the queue length ``q_i``, the batch ``a_i`` of the step in
flight (0 when idle) and its remaining ticks ``r_i`` (0 when idle), with ``sum(q_i + a_i) = N``. The chain starts with
all ``N`` requests queued at model 0, to which the launch rule below is applied.

Order of events within one tick (the simulator processes simultaneous events in the same order):

1. *advance* -- every busy subserver's ``r_i`` decreases by 1;
2. *complete* -- every subserver whose ``r_i`` reached 0 finishes its step: each of its ``a_i`` requests independently
   moves to the queue of model ``j`` with probability ``P[i][j]`` (so the destinations of a batch are multinomial) and
   commits ``tokens[i][j]`` tokens; the subserver becomes idle;
3. *launch* -- every idle subserver with ``q_i >= B_i`` starts a step on ``b = min(q_i, max_batch_i)`` requests taken
   from its queue, lasting ``L_i(b)`` ticks. (A subserver that just finished may therefore launch at once.)

A step launched in tick ``t`` with ``L`` ticks completes in tick ``t + L``: exactly ``L * tick`` seconds. Throughput is
the long-run average of committed tokens per tick divided by ``tick``.

Computation. Between two completions nothing but the countdown happens, so by default (``method="event"``) the chain
is built on completion epochs only: from a state it jumps ``dt = min(r_i over busy i)`` ticks at once. That is a
Markov renewal process whose long-run reward rate ``sum(pi R) / sum(pi dt)`` (``pi`` the stationary law of the jump
chain, ``R`` the expected tokens of a jump) equals that of the per-tick chain exactly, with far fewer states;
``method="tick"`` builds the literal per-tick chain (the tests check that both agree to 1e-8). Reachable states are
enumerated breadth-first from the start state, a whole frontier at a time with numpy (states are deduplicated by an
integer key). The limiting law comes from power iteration on the lazy chain ``alpha I + (1 - alpha) P`` (the jump
chain is often periodic because latencies are deterministic), started from the start state; that also handles
transient states and absorption into deadlock (infeasible thresholds), whose mass counts as zero throughput.

Measured (2 shared CPU cores; reference system of ``tests/test_tuning.py``: small 10 ms + 0.2 ms/request, large
30 ms + 1 ms/request, 10% escalation):

* 2 models, default tick (smallest latency / 20): ``N = 8``: <= 3k states, ~10-60 ms per threshold vector, within
  0.7% of a 600 s simulation (1.8% worst over all 36 feasible vectors at 250 s); ``N = 16``: <= 12k states, <= 0.2 s
  per vector, 7 s for all 136 vectors, within 0.25% of the simulator.
* 3 models, ``N = 8``, smallest latency / 6: <= 75k states, <= ~2 s per vector (mean 0.23 s, 28 s for all 120
  vectors); the coarse tick biases throughput by -1% to +4.6% (mean +2%) against the simulator. Pass a finer ``tick``
  (or ``rounding="stochastic"``) when that matters. ``N = 4``: tick / 20, within 3.3%.

Size of the chain: at a completion epoch one model has just relaunched (its residual time is fixed by its batch), so
the residual times of the other ``M - 1`` models multiply the ``C(N + 2M - 1, 2M - 1)`` queue/batch configurations.
Those are the *slowest* models' ticks per step, not the fastest's: with a 0.6B model at 1.5 ms next to a 32B model at
20 ms, a tick fine enough for the small model gives the large one hundreds of residual values. Measured over all
feasible vectors, the largest chain holds about ``C(N + 2M - 1, 2M - 1) / 4 * prod(ticks per step of the M - 1 slowest
models)`` states (:func:`estimated_states`); :func:`default_tick` sizes the tick from that, using each model's median
step latency so that one bogus entry of a latency table (an extrapolated 1 us next to 20 ms steps) cannot shrink the
tick. Beyond ``max_states`` (default 400k) :func:`build_chain` raises a ``ValueError``; callers that must always get an
answer (:mod:`tokenrouter.tuning.choose`) then rank thresholds with the simulator. ``max_wait`` (the simulator's bounded
wait) is not modelled. Requests are statistically identical and routing is memoryless (a request's next model depends
only on the model it just stepped on).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter.tuning.system import SystemModel, feasible_thresholds

MAX_TICKS_PER_MIN_LATENCY = 20
"""Finest default tick: the smallest step latency / 20, so that no latency is off by more than 2.5% after rounding."""

MIN_TICKS_PER_MIN_LATENCY = 3
"""Coarsest useful resolution of the fastest model: at 3 ticks per step nearest rounding is off by up to ~17%."""
STATE_BUDGET = 60_000
"""Rough state count of the largest chain the default tick aims at (such a chain takes about a second to solve)."""

DEFAULT_MAX_STATES = 400_000
_LAZY = 0.2  # self-loop weight of the lazy chain: breaks periodicity, costs ~25% more iterations than none would
_TOL = 1e-11  # L1 change of the distribution per lazy step at which power iteration stops
_MAX_ITERS = 200_000


@dataclass
class Chain:
    """The reachable part of the (event or tick) chain.

    ``states[s]`` is the row ``(q_0..q_{M-1}, a_0..a_{M-1}, r_0..r_{M-1})``.
    Transition ``k`` goes from ``rows[k]`` to ``cols[k]`` with probability ``probs[k]``. Leaving state ``s`` takes
    ``hold[s]`` ticks, commits ``reward[s]`` tokens in expectation and completes the steps flagged in ``done[s]``.
    """

    num_models: int
    tick: float
    states: np.ndarray  # (S, 3M) int64
    start: np.ndarray  # indices of the initial states (one, or two under stochastic rounding) ...
    start_probs: np.ndarray  # ... and their probabilities
    rows: np.ndarray
    cols: np.ndarray
    probs: np.ndarray
    hold: np.ndarray  # (S,) ticks before the jump (deadlock states: 1, with a self-loop)
    reward: np.ndarray  # (S,) expected committed tokens of the jump
    batch: np.ndarray  # (S, M) a_i
    done: np.ndarray  # (S, M) bool: model i completes its step on this jump
    dead: np.ndarray  # (S,) bool: nobody busy and nobody can start


@dataclass
class MarkovResult:
    """Long-run metrics of the chain.

    Attributes:
        throughput: tokens per second, counting a deadlocked future as zero throughput.
        utilization: per model, fraction of (live) time it is running a step.
        mean_batch: per model, mean batch size over its steps (0 if it never runs).
        mean_wait: per model, mean seconds a request waits in its queue before its step starts (Little's law).
        deadlock_prob: limiting probability mass absorbed in deadlock states (0 for feasible thresholds).
        num_states: size of the reachable chain; ``iterations``: power iterations used.
    """

    throughput: float
    utilization: list[float]
    mean_batch: list[float]
    mean_wait: list[float]
    deadlock_prob: float
    num_states: int
    iterations: int
    tick: float


def latency_scales(model: SystemModel) -> list[float]:
    """Each model's typical step time: the median of its latency row over the batch sizes it can run.

    The median, not the minimum, so that a single absurd entry (an unmeasured batch size extrapolated to ~0) neither
    sets the tick nor counts as the model's speed; such an entry is then simply rounded up to one tick.
    """
    return [statistics.median(model.step_latency[i][: model.batch_cap(i)]) for i in range(model.num_models)]


def estimated_states(model: SystemModel, tick: float) -> float:
    """Rough size of the largest chain over the feasible thresholds of ``model`` at ``tick`` (see the module docstring).

    Calibrated on 2 and 3 models at N = 4..16 with latency ratios 1:3 to 1:13 between models: the measured worst chain
    is 0.2x-1.1x this estimate.
    """
    m = model.num_models
    configurations = math.comb(model.concurrency + 2 * m - 1, 2 * m - 1)
    ticks = sorted(max(1.0, s / tick) for s in latency_scales(model))
    return configurations / 4 * math.prod(ticks[1:])  # all but the fastest: the slowest M - 1 residual clocks


def default_tick(model: SystemModel, state_budget: float = STATE_BUDGET) -> float:
    """The finest tick (at most :data:`MAX_TICKS_PER_MIN_LATENCY` per typical step of the fastest model) whose
    :func:`estimated_states` stays within ``state_budget``.

    With very different models (0.6B next to 32B) the budget can force a tick coarser than the fastest step; the chain
    stays bounded but rounds that model's steps up to whole ticks. :func:`resolution` tells the caller how fine the
    fastest model is resolved, so it can switch to the simulator instead (:mod:`tokenrouter.tuning.choose`). The tick
    depends on ``N``, ``M`` and the latencies only, so every threshold vector of one system is solved on the same tick.
    """
    if not state_budget > 0.0:
        raise ValueError(f"state_budget must be positive, got {state_budget}")
    scales = sorted(latency_scales(model))
    tick = scales[0] / MAX_TICKS_PER_MIN_LATENCY
    m = model.num_models
    if m == 1 or estimated_states(model, tick) <= state_budget:
        return tick  # a single model never has another step in flight: the tick does not multiply its states
    # estimated_states = c * prod(s_k / tick) over the M - 1 slowest models while each s_k >= tick; solve that for the
    # budget. If even one tick per slow step is over budget (huge N), this is about their geometric mean and the
    # chain may well exceed max_states: build_chain then refuses it early.
    configurations = math.comb(model.concurrency + 2 * m - 1, 2 * m - 1)
    residual_budget = max(1.0, state_budget / (configurations / 4))
    return max(tick, (math.prod(scales[1:]) / residual_budget) ** (1.0 / (m - 1)))


def resolution(model: SystemModel, tick: float) -> float:
    """Ticks per typical step of the fastest model: below ~3 the chain's rounding dominates its answer."""
    return min(latency_scales(model)) / tick


def _multinomials(p: Sequence[float], a: int) -> list[tuple[tuple[int, ...], float]]:
    """Every destination-count vector of ``a`` requests routed independently by ``p``, with its probability.

    Zero-probability destinations are skipped so impossible outcomes never become states.
    """
    m = len(p)
    support = [j for j in range(m) if p[j] > 0.0]
    out: list[tuple[tuple[int, ...], float]] = []
    log_fact = [math.lgamma(k + 1) for k in range(a + 1)]
    log_p = {j: math.log(p[j]) for j in support}

    def rec(k: int, left: int, counts: list[int]) -> None:
        j = support[k]
        if k == len(support) - 1:
            counts[j] = left
            logw = log_fact[a] - sum(log_fact[counts[t]] for t in support)
            logw += sum(counts[t] * log_p[t] for t in support)
            out.append((tuple(counts), math.exp(logw)))
            counts[j] = 0
            return
        for c in range(left + 1):
            counts[j] = c
            rec(k + 1, left - c, counts)
        counts[j] = 0

    rec(0, a, [0] * m)
    return out


class _Dynamics:
    """The one-jump dynamics of the chain, vectorized over many states at once (rows of an int64 array)."""

    def __init__(
        self, model: SystemModel, thresholds: tuple[int, ...], tick: float, event: bool, rounding: str
    ) -> None:
        m, n_req = model.num_models, model.concurrency
        self.m, self.event = m, event
        self.thr = np.asarray(thresholds, dtype=np.int64)
        self.caps = np.asarray([model.batch_cap(i) for i in range(m)], dtype=np.int64)
        # A step of b requests on model i lasts ticks_lo[i][b] ticks, or ticks_hi[i][b] with probability p_hi[i][b]
        # (index 0 unused). "nearest": lo == hi, p_hi == 0. "stochastic": floor/ceil with the fractional part as the
        # probability of ceil, so the mean duration is exact (except below 1 tick, which is clamped to 1).
        self.ticks_lo, self.ticks_hi, self.p_hi = [], [], []
        for i in range(m):
            lo, hi, ph = [0], [0], [0.0]
            for b in range(1, model.batch_cap(i) + 1):
                x = model.latency(i, b) / tick
                if rounding == "nearest" or x <= 1.0:
                    lo.append(max(1, round(x)))
                    hi.append(lo[-1])
                    ph.append(0.0)
                else:
                    fl = math.floor(x)
                    lo.append(fl)
                    hi.append(fl + 1)
                    ph.append(x - fl)
            self.ticks_lo.append(np.asarray(lo, dtype=np.int64))
            self.ticks_hi.append(np.asarray(hi, dtype=np.int64))
            self.p_hi.append(np.asarray(ph))
        self.tok = np.asarray([model.tokens_per_request(i) for i in range(m)])
        # Routing outcomes of a finishing batch, per model: a flat table whose entry 0 is the no-op ("did not
        # finish"), then for each batch size a the multinomial outcomes (destination counts, probability).
        self.out_counts: list[np.ndarray] = []
        self.out_probs: list[np.ndarray] = []
        self.out_start: list[np.ndarray] = []
        self.out_len: list[np.ndarray] = []
        for i in range(m):
            counts: list[tuple[int, ...]] = [(0,) * m]
            probs = [1.0]
            start = np.zeros(n_req + 1, dtype=np.int64)
            length = np.ones(n_req + 1, dtype=np.int64)
            for a in range(1, model.batch_cap(i) + 1):
                outcomes = _multinomials(model.route_probs[i], a)
                start[a], length[a] = len(counts), len(outcomes)
                counts += [c for c, _ in outcomes]
                probs += [p for _, p in outcomes]
            self.out_counts.append(np.asarray(counts, dtype=np.int64).reshape(-1, m))
            self.out_probs.append(np.asarray(probs))
            self.out_start.append(start)
            self.out_len.append(length)
        # Mixed-radix key of a state row, to dedupe and index states with numpy.
        radix = [n_req + 1] * (2 * m) + [int(max(t.max() for t in self.ticks_hi)) + 1] * m
        weights, w = [], 1
        for rdx in radix:
            weights.append(w)
            w *= rdx
        if w >= 2**62:
            raise ValueError("state encoding overflows int64: too many models or ticks")
        self.radix = np.asarray(radix, dtype=np.int64)
        self.weights = np.asarray(weights, dtype=np.int64)

    def key(self, s: np.ndarray) -> np.ndarray:
        return s @ self.weights

    def decode(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty((len(keys), len(self.radix)), dtype=np.int64)
        rest = keys.copy()
        for c, rdx in enumerate(self.radix):
            rest, out[:, c] = np.divmod(rest, rdx)
        return out

    def launch(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Event 3: idle models with ``q_i >= B_i`` start a step on ``min(q_i, cap_i)`` requests.

        Returns (index of the source row, resulting rows, probabilities): under stochastic rounding a row fans out
        over the floor/ceil latency of every launching model. ``s`` may be modified in place.
        """
        m, n = self.m, len(s)
        # Launch decisions are per model and independent of each other, so take them all first.
        batches, p_his = [], []
        fanout = np.ones(n, dtype=np.int64)
        for i in range(m):
            go = (s[:, m + i] == 0) & (s[:, i] >= self.thr[i]) & (s[:, i] >= 1)
            b = np.where(go, np.minimum(s[:, i], self.caps[i]), 0)
            batches.append(b)
            p_his.append(self.p_hi[i][b])
            fanout *= np.where(p_his[-1] > 0.0, 2, 1)
        src = np.arange(n)
        prob = np.ones(n)
        within = np.zeros(n, dtype=np.int64)  # which of its fanout copies a row is, as bits (one per split model)
        if fanout.max() > 1:
            src = np.repeat(src, fanout)
            within = np.arange(len(src)) - np.repeat(np.cumsum(fanout) - fanout, fanout)
            s, prob = s[src], prob[src]
            batches = [b[src] for b in batches]
            p_his = [p[src] for p in p_his]
        bit = np.zeros(len(src), dtype=np.int64)
        for i in range(m):
            b, p_hi = batches[i], p_his[i]
            split = p_hi > 0.0
            hi = split & ((within >> bit) & 1).astype(bool)
            bit += split
            prob *= np.where(hi, p_hi, 1.0 - p_hi)  # p_hi == 0 on unsplit rows: factor 1
            # b == 0 and ticks == 0 on rows that do not launch, and a launching model has a_i == r_i == 0, so
            # plain additions update exactly the launching rows (cheaper than masked assignment).
            s[:, m + i] += b
            s[:, 2 * m + i] += np.where(hi, self.ticks_hi[i][b], self.ticks_lo[i][b])
            s[:, i] -= b
        return src, s, prob

    def jump(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ticks until the next jump, models finishing on it, deadlocked) for post-launch states ``s``."""
        m = self.m
        a, r = s[:, m : 2 * m], s[:, 2 * m :]
        busy = a > 0
        dead = ~busy.any(axis=1)
        if self.event:
            dt = np.where(busy, r, np.iinfo(np.int64).max).min(axis=1)
            dt[dead] = 1
        else:
            dt = np.ones(len(s), dtype=np.int64)
        return dt, busy & (r == dt[:, None]), dead

    def successors(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All one-jump successors of states ``s``: (index of the source row, successor rows, probabilities)."""
        m = self.m
        dt, finished, _ = self.jump(s)
        a_before = s[:, m : 2 * m].copy()
        nxt = s.copy()
        busy = a_before > 0
        # Events 1-2: count down; finished models go idle (their requests are routed below).
        nxt[:, 2 * m :] -= np.where(busy, dt[:, None], 0)
        nxt[:, m : 2 * m][finished] = 0
        src = np.arange(len(s))
        prob = np.ones(len(s))
        for i in range(m):
            # Fan every row out over the routing outcomes of model i's batch (one no-op outcome if it did not finish).
            fin = finished[src, i]
            a_i = a_before[src, i]
            first = np.where(fin, self.out_start[i][a_i], 0)
            count = np.where(fin, self.out_len[i][a_i], 1)
            rep = np.repeat(np.arange(len(src)), count)
            within = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
            entry = first[rep] + within
            src, prob, nxt = src[rep], prob[rep] * self.out_probs[i][entry], nxt[rep]
            nxt[:, :m] += self.out_counts[i][entry]
        lsrc, nxt, lprob = self.launch(nxt)
        return src[lsrc], nxt, prob[lsrc] * lprob


def build_chain(
    model: SystemModel,
    thresholds: Sequence[int],
    tick: float | None = None,
    method: str = "event",
    rounding: str = "nearest",
    max_states: int = DEFAULT_MAX_STATES,
) -> Chain:
    """Enumerate the chain reachable from "all requests queued at model 0" (see the module docstring).

    Breadth-first, one whole frontier at a time with numpy; states are deduplicated by their integer key.
    """
    if method not in ("event", "tick"):
        raise ValueError(f"method must be 'event' or 'tick', got {method!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if model.has_transit:
        raise ValueError("the Markov chain does not model transit between models: rank with the simulator")
    if model.shares_gpu:
        raise ValueError("the Markov chain does not model a shared GPU: rank with the simulator")
    thr = model.check_thresholds(thresholds)
    tick = default_tick(model) if tick is None else float(tick)
    if not (math.isfinite(tick) and tick > 0.0):
        raise ValueError(f"tick must be positive, got {tick}")
    m = model.num_models
    dyn = _Dynamics(model, thr, tick, method == "event", rounding)

    start = np.zeros((1, 3 * m), dtype=np.int64)
    start[0, 0] = model.concurrency
    _, start, start_probs = dyn.launch(start)
    start_keys = dyn.key(start)
    known = set(start_keys.tolist())
    frontier = start
    src_keys: list[np.ndarray] = []
    dst_keys: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    while len(frontier):
        src, nxt, prob = dyn.successors(frontier)
        keys = dyn.key(nxt)
        src_keys.append(dyn.key(frontier)[src])
        dst_keys.append(keys)
        probs.append(prob)
        uniq = np.unique(keys).tolist()
        new = [k for k in uniq if k not in known]
        known.update(new)
        if len(known) > max_states:
            raise ValueError(
                f"more than {max_states} reachable states (N={model.concurrency}, M={m}, tick={tick:g}s); "
                "use a coarser tick or raise max_states"
            )
        frontier = dyn.decode(np.asarray(new, dtype=np.int64))

    all_keys = np.sort(np.fromiter(known, dtype=np.int64, count=len(known)))
    n = len(all_keys)
    states = dyn.decode(all_keys)
    dt, finished, dead = dyn.jump(states)
    batch = states[:, m : 2 * m]
    # Merge parallel transitions (different routing outcomes often lead to the same state) and order them by target:
    # that halves the work of every power-iteration step and makes its scatter sequential.
    rows = np.searchsorted(all_keys, np.concatenate(src_keys))
    cols = np.searchsorted(all_keys, np.concatenate(dst_keys))
    pair, inverse = np.unique(cols * n + rows, return_inverse=True)
    cols, rows = np.divmod(pair, n)
    return Chain(
        num_models=m,
        tick=tick,
        states=states,
        start=np.searchsorted(all_keys, start_keys),
        start_probs=start_probs,
        rows=rows,
        cols=cols,
        probs=np.bincount(inverse.ravel(), weights=np.concatenate(probs), minlength=len(pair)),
        hold=dt.astype(np.float64),
        reward=(finished * batch) @ dyn.tok,
        batch=batch,
        done=finished,
        dead=dead,
    )


def limiting_distribution(chain: Chain, tol: float = _TOL, max_iters: int = _MAX_ITERS) -> tuple[np.ndarray, int]:
    """Limit of the lazy jump chain's law from the start state(s), by power iteration; returns (pi, iterations).

    The lazy chain ``alpha I + (1 - alpha) P`` has the same stationary laws as ``P`` but is aperiodic, so the iterates
    converge. Iteration stops when the L1 change per step falls below ``tol``.
    """
    n = len(chain.states)
    x = np.zeros(n)
    np.add.at(x, chain.start, chain.start_probs)
    rows, cols, probs = chain.rows, chain.cols, chain.probs
    for it in range(1, max_iters + 1):
        y = np.bincount(cols, weights=x[rows] * probs, minlength=n)
        y *= 1.0 - _LAZY
        y += _LAZY * x
        if it % 8 == 0:
            diff = float(np.abs(y - x).sum())
            if diff < tol:
                return y / y.sum(), it
        x = y
    raise RuntimeError(f"power iteration did not converge in {max_iters} iterations ({n} states)")


def solve(
    model: SystemModel,
    thresholds: Sequence[int],
    tick: float | None = None,
    method: str = "event",
    rounding: str = "nearest",
    max_states: int = DEFAULT_MAX_STATES,
) -> MarkovResult:
    """Build the chain for ``thresholds`` and return its long-run metrics (see :class:`MarkovResult`).

    ``method``: "event" (jump from completion to completion; default) or "tick" (the literal per-tick chain, same
    answer, many more states). ``rounding``: "nearest" (default) or "stochastic" (see the module docstring).
    """
    chain = build_chain(model, thresholds, tick=tick, method=method, rounding=rounding, max_states=max_states)
    pi, iters = limiting_distribution(chain)
    m = chain.num_models
    dead_mass = float(pi[chain.dead].sum())
    if dead_mass >= 1.0 - 1e-9:
        return MarkovResult(0.0, [0.0] * m, [0.0] * m, [0.0] * m, 1.0, len(chain.states), iters, chain.tick)
    # Markov renewal reward theorem on the live states: rate = E_pi[reward] / E_pi[holding time]. Mass absorbed in
    # deadlock contributes an infinite stretch of zero throughput, hence the (1 - dead_mass) factor (exact when the
    # live states form a single closed class, which is the case whenever deadlock is unreachable).
    pl = np.where(chain.dead, 0.0, pi)
    time = float(pl @ chain.hold)  # ticks per jump
    rate = float(pl @ chain.reward) / time  # tokens per tick
    busy = chain.batch > 0
    queued = chain.states[:, :m]
    utilization, mean_batch, mean_wait = [], [], []
    for i in range(m):
        utilization.append(float(pl @ (chain.hold * busy[:, i])) / time)
        steps = float(pl @ chain.done[:, i])
        served = float(pl @ (chain.done[:, i] * chain.batch[:, i]))  # requests per jump
        mean_batch.append(served / steps if steps > 0 else 0.0)
        # Little's law on queue i: time-average queue length / rate of requests through it (queues only change at
        # jumps, so the time average weights each state by its holding time).
        avg_queue = float(pl @ (chain.hold * queued[:, i])) / time
        mean_wait.append(avg_queue / (served / time) * chain.tick if served > 0 else 0.0)
    return MarkovResult(
        throughput=(1.0 - dead_mass) * rate / chain.tick,
        utilization=utilization,
        mean_batch=mean_batch,
        mean_wait=mean_wait,
        deadlock_prob=dead_mass,
        num_states=len(chain.states),
        iterations=iters,
        tick=chain.tick,
    )


def expected_throughput(
    model: SystemModel,
    thresholds: Sequence[int],
    tick: float | None = None,
    *,
    rounding: str = "nearest",
    max_states: int = DEFAULT_MAX_STATES,
) -> float:
    """Long-run committed tokens per second of ``model`` under delayed-batching ``thresholds``.

    ``tick`` defaults to :func:`default_tick`. Raises ``ValueError`` if the chain exceeds ``max_states``.
    """
    return solve(model, thresholds, tick=tick, rounding=rounding, max_states=max_states).throughput


def best_thresholds(
    model: SystemModel,
    tick: float | None = None,
    *,
    rounding: str = "nearest",
    max_states: int = DEFAULT_MAX_STATES,
) -> tuple[tuple[int, ...], float]:
    """The feasible threshold vector with the highest :func:`expected_throughput`, and that throughput.

    Ties (within a relative 1e-9) go to the earlier vector in lexicographic order. Cost: one chain per feasible
    vector, ``C(N - 1 + M, M)`` of them (36 for N=8, M=2; 136 for N=16, M=2; 120 for N=8, M=3). Raises ``ValueError``
    if a chain exceeds ``max_states``; :func:`tokenrouter.tuning.choose.choose_thresholds` never does.
    """
    if tick is None:
        tick = default_tick(model)  # one tick for all candidates, so they are compared under the same rounding
    best: tuple[int, ...] | None = None
    best_tp = -math.inf
    for thr in feasible_thresholds(model.num_models, model.concurrency):
        tp = expected_throughput(model, thr, tick=tick, rounding=rounding, max_states=max_states)
        if best is None or tp > best_tp + 1e-9 * abs(best_tp):
            best, best_tp = thr, tp
    assert best is not None
    return best, best_tp
