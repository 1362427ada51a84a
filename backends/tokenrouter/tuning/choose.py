"""Pick delayed-batching thresholds for a measured system, always with an answer and within a bounded time.

The exact chain (:mod:`tokenrouter.tuning.markov`) is the preferred judge, but its size is the product of the slower
models' ticks per step: with a 0.6B model (1.5 ms) next to 8B (6 ms) and 32B (20 ms) steps, a tick fine enough to
resolve the small model gives hundreds of thousands of states per threshold vector. So the chain is used only when one
tick both resolves the fastest model (at least :data:`~tokenrouter.tuning.markov.MIN_TICKS_PER_MIN_LATENCY` ticks per
step) and keeps every chain within a share of a total state budget; otherwise -- or if a chain still overflows or its
power iteration does not converge -- the discrete-event simulator ranks the feasible vectors instead. Its cost grows
with the number of candidates and steps only, not with the latency ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenrouter.tuning.markov import (
    DEFAULT_MAX_STATES,
    MAX_TICKS_PER_MIN_LATENCY,
    MIN_TICKS_PER_MIN_LATENCY,
    default_tick,
    resolution,
    solve,
)
from tokenrouter.tuning.simulator import simulate
from tokenrouter.tuning.system import SystemModel, feasible_thresholds

TOTAL_STATE_BUDGET = 60_000
"""Estimated states summed over all candidate chains; about 1 s of solving on 2 CPU cores (2 models, N = 8)."""

SIM_STEPS = 1_000
"""Simulated steps (all models together) per candidate in the first, screening round; ~10 ms each."""

SIM_REFINE = 6
"""Candidates re-simulated, REFINE_FACTOR x longer and on fresh random numbers, to pick the winner and estimate its
throughput."""

REFINE_FACTOR = 8
"""How much longer than a screening run a throughput estimate is simulated (~1-2 % noise at N = 8)."""

SWITCH_GAIN = 0.03
"""A re-solve keeps the thresholds in force (the incumbent) unless the best vector is expected to serve at least this
much more than it, judged by the same model and random numbers: close candidates must not trade places on noise.
Served at C=8 on an H200 the 32B's threshold moved between 1, 4, 6 and 7 from one 2 s solve to the next without it,
and still between 4, 5 and 7 with it: the tuner's inputs (a few seconds of steps) move by more than this
(perf/results/tuner_h200_2026-12-04)."""

Method = Literal["markov", "simulator"]


@dataclass(frozen=True)
class Choice:
    """The chosen thresholds, the long-run tokens/s predicted for them, and which method ranked the candidates."""

    thresholds: tuple[int, ...]
    throughput: float
    method: Method


def choose_thresholds(
    model: SystemModel,
    *,
    state_budget: float = TOTAL_STATE_BUDGET,
    max_states: int = DEFAULT_MAX_STATES,
    sim_steps: int = SIM_STEPS,
    seed: int = 0,
    max_wait: float | None = None,
    incumbent: tuple[int, ...] | None = None,
) -> Choice:
    """The feasible threshold vector with the highest predicted throughput (exact chain, else simulation).

    ``state_budget`` is shared by all ``C(N - 1 + M, M)`` candidates; ``max_states`` caps any single chain (a chain
    above it sends the whole ranking to the simulator, so all candidates are compared by one method). ``max_wait``:
    the bounded wait the simulator applies (the exact chain has none). ``incumbent``: the thresholds in force; where
    feasible it is kept unless the best is expected to serve :data:`SWITCH_GAIN` more.
    """
    candidates = list(feasible_thresholds(model.num_models, model.concurrency))
    if model.shares_gpu:
        candidates = _fastest_undelayed(model, candidates)
    if incumbent is not None and tuple(incumbent) not in candidates:
        incumbent = None  # infeasible at this concurrency: it cannot stay
    if model.has_transit or model.shares_gpu:  # only the simulator models transit and a shared GPU
        return rank_by_simulation(model, candidates, sim_steps=sim_steps, seed=seed, max_wait=max_wait,
                                  incumbent=incumbent)
    tick = default_tick(model, state_budget=max(1.0, state_budget / len(candidates)))
    ticks_per_step = resolution(model, tick)
    if ticks_per_step >= MIN_TICKS_PER_MIN_LATENCY:
        # Between 3 and 20 ticks per fast step, nearest rounding biases that model by up to ~15%; mean-exact rounding
        # removes most of it (the candidates' ranking barely moves, the predicted tokens/s does).
        rounding = "nearest" if ticks_per_step >= MAX_TICKS_PER_MIN_LATENCY else "stochastic"
        try:
            return _rank_by_chain(model, candidates, tick, rounding, max_states, incumbent)
        except (ValueError, RuntimeError):
            pass  # a chain overflowed max_states or did not converge: the simulator always answers
    return rank_by_simulation(model, candidates, sim_steps=sim_steps, seed=seed, max_wait=max_wait,
                              incumbent=incumbent)


def _fastest_undelayed(model: SystemModel, candidates: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """On a shared GPU, only the vectors that never hold the fastest model back. The simulator's processor sharing
    rates holding the 0.6B for a batch (so that the 32B steps alone) higher than it serves: served on an H200 at C=16,
    thresholds (0.6B, 32B) = (11, 3) committed 1,400-1,600 tokens/s where (1, 2) and (1, 6) committed 2,050-2,200, and
    at C=8 the 0.6B held at 2-4 did no better than at 1 (perf/results/tuner_h200_2026-12-04). Holding the slow model
    for a fuller batch is what the sharing model was measured right about (+14 % at C=8)."""
    fastest = min(range(model.num_models), key=lambda i: model.step_latency[i][0])
    return [thr for thr in candidates if thr[fastest] == 1]


def _keep_incumbent(best: tuple[int, ...], tp: dict[tuple[int, ...], float], incumbent: tuple[int, ...] | None,
                    method: Method) -> Choice:
    """The best vector, or the incumbent where the best does not beat it by SWITCH_GAIN (`tp` holds both)."""
    if incumbent is not None and incumbent != best and tp[best] < (1.0 + SWITCH_GAIN) * tp[incumbent]:
        return Choice(incumbent, tp[incumbent], method)
    return Choice(best, tp[best], method)


def _rank_by_chain(
    model: SystemModel, candidates: list[tuple[int, ...]], tick: float, rounding: str, max_states: int,
    incumbent: tuple[int, ...] | None = None,
) -> Choice:
    tp: dict[tuple[int, ...], float] = {}
    best: tuple[int, ...] | None = None
    for thr in candidates:
        tp[thr] = solve(model, thr, tick=tick, rounding=rounding, max_states=max_states).throughput
        if best is None or tp[thr] > tp[best] + 1e-9 * abs(tp[best]):  # ties keep the earlier, as best_thresholds
            best = thr
    assert best is not None
    return _keep_incumbent(best, tp, incumbent, "markov")


def rank_by_simulation(
    model: SystemModel, candidates: list[tuple[int, ...]], *, sim_steps: int = SIM_STEPS, seed: int = 0,
    max_wait: float | None = None, incumbent: tuple[int, ...] | None = None,
) -> Choice:
    """Screen every candidate with a short simulation, then re-simulate the best few for longer and pick among them.

    All candidates of a round share one seed (common random numbers: their differences are less noisy than their
    values). The second round uses a fresh seed so the reported throughput is not inflated by the screening's luck.
    An `incumbent` (one of the candidates) is always in the second round and stays unless beaten by SWITCH_GAIN.
    """
    if not candidates:
        raise ValueError("no candidate thresholds")
    if sim_steps < 1:
        raise ValueError(f"sim_steps must be >= 1, got {sim_steps}")
    screen = {thr: simulate(model, thr, num_steps=sim_steps, seed=seed, max_wait=max_wait).throughput
              for thr in candidates}
    finalists = sorted(candidates, key=lambda thr: -screen[thr])[:SIM_REFINE]
    if incumbent is not None and incumbent not in finalists:
        finalists.append(incumbent)
    final = {thr: simulated_throughput(model, thr, sim_steps=sim_steps, seed=seed + 1, max_wait=max_wait)
             for thr in finalists}
    best = max(finalists, key=lambda thr: final[thr])  # max keeps the first of equals: the screening's favourite
    return _keep_incumbent(best, final, incumbent, "simulator")


def simulated_throughput(model: SystemModel, thresholds: tuple[int, ...], *, sim_steps: int = SIM_STEPS,
                         seed: int = 0, max_wait: float | None = None) -> float:
    """Long-run tokens/s of `thresholds` from one simulation REFINE_FACTOR x a screening run long: the estimate
    for a chosen vector (and for any model the exact chain cannot take)."""
    return simulate(model, thresholds, num_steps=REFINE_FACTOR * sim_steps, seed=seed, max_wait=max_wait).throughput
