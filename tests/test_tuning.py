"""Delayed-batching threshold tuning: the Markov chain against the discrete-event simulator, and input validation.

The reference system is a two-model R2R-like deployment: a small model (10 ms + 0.2 ms per request) that hands 10% of
its requests to a large model (30 ms + 1 ms per request), the small model's token being discarded on a hand-off.
"""

from __future__ import annotations

import itertools
import math

import pytest

from tokenrouter.tuning import (
    SystemModel,
    best_thresholds,
    expected_throughput,
    feasible_thresholds,
    is_feasible,
    linear_latency,
    simulate,
    solve,
)
from tokenrouter.tuning.markov import build_chain

N = 8
SIM_SECONDS = 600.0  # ~55k small-model steps: simulator noise well under 1%


def r2r(n: int = N, large_to_small: float = 0.9, large: tuple[float, float] = (0.030, 0.001), **kw) -> SystemModel:
    """Small model 0 and large model 1; the small model's token is dropped when it escalates (tokens[0][1] == 0)."""
    return SystemModel(
        concurrency=n,
        route_probs=[[0.9, 0.1], [large_to_small, 1.0 - large_to_small]],
        step_latency=[linear_latency(n, 0.010, 0.0002), linear_latency(n, *large)],
        tokens=[[1.0, 0.0], [1.0, 1.0]],
        **kw,
    )


def three_models(n: int) -> SystemModel:
    return SystemModel(
        concurrency=n,
        route_probs=[[0.85, 0.1, 0.05], [0.8, 0.15, 0.05], [0.9, 0.05, 0.05]],
        step_latency=[
            linear_latency(n, 0.010, 0.0002),
            linear_latency(n, 0.020, 0.0005),
            linear_latency(n, 0.030, 0.001),
        ],
        tokens=[[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
    )


# --------------------------------------------------------------------------------------------------- system model


def test_feasible_thresholds_is_exactly_the_pigeonhole_set() -> None:
    for m, n in [(1, 5), (2, 8), (3, 6)]:
        got = list(feasible_thresholds(m, n))
        brute = [t for t in itertools.product(range(1, n + 2), repeat=m) if sum(b - 1 for b in t) < n]
        assert got == sorted(brute)
        assert len(got) == math.comb(n - 1 + m, m)
        assert all(is_feasible(t, n) and max(t) <= n for t in got)
    assert not is_feasible((2, 8), 8) and is_feasible((1, 8), 8)


LAT = [linear_latency(4, 0.01, 0.001), linear_latency(4, 0.03, 0.001)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(concurrency=0, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT),
        dict(concurrency=4, route_probs=[[0.5, 0.4], [0.0, 1.0]], step_latency=LAT),  # row sums to 0.9
        dict(concurrency=4, route_probs=[[1.2, -0.2], [0.0, 1.0]], step_latency=LAT),  # negative entry
        dict(concurrency=4, route_probs=[[1.0, 0.0]], step_latency=LAT[:1]),  # not square
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT[:1]),  # one latency row
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=[LAT[0], LAT[1][:3]]),  # too short
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=[LAT[0], [0.01, 0.0, 0.01, 0.01]]),
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT, tokens=[[1.0, 1.0]]),
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT, tokens=[[1, -1], [1, 1]]),
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT, max_batch=[4]),
        dict(concurrency=4, route_probs=[[1.0, 0.0], [0.0, 1.0]], step_latency=LAT, max_batch=[4, 0]),
    ],
)
def test_system_model_rejects_bad_input(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SystemModel(**kwargs)


def test_latency_rows_may_stop_at_the_batch_cap() -> None:
    model = SystemModel(4, [[1.0]], [[0.01, 0.02]], max_batch=[2])
    assert model.batch_cap(0) == 2 and model.tokens == [[1.0]]


@pytest.mark.parametrize("thresholds", [(1,), (1, 0), (1, 2.0), (True, 1)])
def test_bad_thresholds_and_arguments_are_rejected(thresholds: tuple) -> None:
    model = r2r(4)
    with pytest.raises(ValueError):
        expected_throughput(model, thresholds)
    with pytest.raises(ValueError):
        simulate(model, thresholds, duration=1.0)


def test_bad_solver_and_simulator_arguments_are_rejected() -> None:
    model = r2r(4)
    with pytest.raises(ValueError):
        expected_throughput(model, (1, 1), tick=0.0)
    with pytest.raises(ValueError):
        solve(model, (1, 1), method="exact")
    with pytest.raises(ValueError):
        simulate(model, (1, 1))  # neither duration nor num_steps
    with pytest.raises(ValueError):
        simulate(model, (1, 1), duration=1.0, max_wait=-1.0)
    with pytest.raises(ValueError, match="reachable states"):
        build_chain(r2r(16), (1, 1), max_states=1000)  # refuses (early) instead of thrashing


# --------------------------------------------------------------------------------------------------- Markov chain


def test_single_model_closed_form() -> None:
    """One model, 5 requests, batch cap 2: every step runs 2 requests for 20 ms -> 100 tokens/s, waits 1.5 steps."""
    model = SystemModel(5, [[1.0]], [[0.01, 0.02, 0.03, 0.04, 0.05]], max_batch=[2])
    res = solve(model, (1,), tick=0.01)
    assert res.throughput == pytest.approx(100.0)
    assert res.mean_batch == pytest.approx([2.0]) and res.utilization == pytest.approx([1.0])
    assert res.mean_wait == pytest.approx([0.03])
    sim = simulate(model, (1,), duration=20.0)
    assert sim.throughput == pytest.approx(100.0, rel=0.01) and sim.mean_wait == pytest.approx([0.03])


@pytest.mark.parametrize("thresholds", [(1, 1), (2, 1), (1, 3), (3, 2)])
def test_event_chain_equals_per_tick_chain(thresholds: tuple[int, int]) -> None:
    """Jumping from completion to completion is an exact reduction of the literal per-tick chain."""
    model = SystemModel(4, [[0.7, 0.3], [0.6, 0.4]], [[3, 4, 5, 6], [7, 8, 9, 9]], tokens=[[1, 0], [1, 1]])
    event = solve(model, thresholds, tick=1.0, method="event")
    tick = solve(model, thresholds, tick=1.0, method="tick")
    assert event.num_states < tick.num_states
    assert event.throughput == pytest.approx(tick.throughput, rel=1e-8)
    assert event.mean_wait == pytest.approx(tick.mean_wait, rel=1e-7)
    assert event.utilization == pytest.approx(tick.utilization, rel=1e-8)
    chain = build_chain(model, thresholds, tick=1.0)
    assert chain.probs.min() > 0.0
    sums = [0.0] * len(chain.states)
    for r, p in zip(chain.rows.tolist(), chain.probs.tolist()):
        sums[r] += p
    assert sums == pytest.approx([1.0] * len(sums))


def test_stochastic_rounding_is_exact_in_the_mean_and_helps_coarse_ticks() -> None:
    model = SystemModel(
        4, [[0.7, 0.3], [0.6, 0.4]], [[3.3, 4.5, 5.2, 6.8], [7.1, 8.6, 9.4, 9.5]], tokens=[[1, 0], [1, 1]]
    )
    for thresholds in [(1, 1), (2, 2)]:
        event = solve(model, thresholds, tick=1.0, rounding="stochastic")
        tick = solve(model, thresholds, tick=1.0, method="tick", rounding="stochastic")
        assert event.throughput == pytest.approx(tick.throughput, rel=1e-8)
    # Three ticks per small step: nearest rounding is 5-8% off, mean-exact rounding stays within 2.5%.
    coarse = 0.0102 / 3
    model = r2r()
    for thresholds in [(1, 1), (3, 3)]:
        sim = simulate(model, thresholds, duration=300.0, seed=11).throughput
        assert expected_throughput(model, thresholds, tick=coarse) > 1.04 * sim
        assert expected_throughput(model, thresholds, tick=coarse, rounding="stochastic") == pytest.approx(
            sim, rel=0.025
        )
    with pytest.raises(ValueError):
        solve(model, (1, 1), rounding="up")


# ------------------------------------------------------------------------------------- Markov against simulation


@pytest.mark.parametrize("thresholds", [(1, 1), (2, 2), (4, 2), (1, 4), (3, 3), (6, 3), (8, 1), (1, 8)])
def test_markov_matches_simulator(thresholds: tuple[int, int]) -> None:
    model = r2r()
    markov = solve(model, thresholds)
    sim = simulate(model, thresholds, duration=SIM_SECONDS, seed=11)
    assert not sim.deadlocked
    # The brief asks for 5%; measured agreement is ~0.5%, so hold it to 2%.
    assert markov.throughput == pytest.approx(sim.throughput, rel=0.02)
    assert markov.mean_batch == pytest.approx(sim.mean_batch, rel=0.03)
    assert markov.utilization == pytest.approx(sim.utilization, abs=0.02)
    # Queue waits: the small model's are sub-millisecond, so compare them against the step time scale.
    assert markov.mean_wait == pytest.approx(sim.mean_wait, rel=0.05, abs=0.0005)


def test_markov_matches_simulator_with_batch_cap_and_n16() -> None:
    model = r2r(16, max_batch=[6, 3])
    for thresholds in [(1, 1), (4, 3), (2, 6)]:
        markov = expected_throughput(model, thresholds)
        sim = simulate(model, thresholds, duration=300.0, seed=5)
        assert sim.mean_batch[0] <= 6 and sim.mean_batch[1] <= 3
        assert markov == pytest.approx(sim.throughput, rel=0.02)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(r2r(large_to_small=0.9), id="large-stays-10%"),
        pytest.param(r2r(large_to_small=1.0), id="large-always-returns"),
        # A slower, flatter large model and more escalation: waiting for a batch of ~5 pays 3.6% over (1, 1).
        pytest.param(
            SystemModel(
                N,
                [[0.7, 0.3], [0.9, 0.1]],
                [linear_latency(N, 0.010, 0.0002), linear_latency(N, 0.060, 0.0005)],
                tokens=[[1, 0], [1, 1]],
            ),
            id="batching-pays",
        ),
    ],
)
def test_best_thresholds_is_the_simulators_best(model: SystemModel) -> None:
    best, best_tp = best_thresholds(model)
    assert is_feasible(best, N)
    sim = {}
    for thr in feasible_thresholds(2, N):
        res = simulate(model, thr, duration=250.0, seed=3)  # same seed for all: common random numbers
        assert not res.deadlocked
        sim[thr] = res.throughput
    sim_best = max(sim, key=sim.get)
    # The throughput surface is flat near its top; the pick must be the simulator's best or within 1% of it.
    assert sim[best] >= 0.99 * sim[sim_best], (best, sim[best], sim_best, sim[sim_best])
    assert best_tp == pytest.approx(sim[best], rel=0.02)


# ------------------------------------------------------------------------------------------------------ deadlock


@pytest.mark.parametrize("thresholds", [(2, 8), (8, 8), (1, 9), (3, 7)])
def test_infeasible_thresholds_deadlock(thresholds: tuple[int, int]) -> None:
    model = r2r()
    assert not is_feasible(thresholds, N)
    sim = simulate(model, thresholds, duration=1000.0, seed=0)
    assert sim.deadlocked and sim.throughput == 0.0
    assert sim.deadlock_time is not None and sim.deadlock_time < 1000.0
    assert sim.deadlock_queues is not None and sum(sim.deadlock_queues) == N
    assert all(q < b for q, b in zip(sim.deadlock_queues, thresholds))
    markov = solve(model, thresholds)
    assert markov.throughput == 0.0 and markov.deadlock_prob == pytest.approx(1.0)


def test_max_wait_breaks_deadlock() -> None:
    model = r2r()
    res = simulate(model, (2, 8), duration=100.0, max_wait=0.05)
    assert not res.deadlocked and res.throughput > 0.0
    assert res.mean_wait[1] <= 0.05 + 0.04  # bounded wait, plus at most one large step behind a busy model
    # max_wait=0 starts every step as soon as a request is queued: exactly thresholds (1, 1).
    zero = simulate(model, (8, 8), num_steps=5000, seed=2, max_wait=0.0)
    ones = simulate(model, (1, 1), num_steps=5000, seed=2)
    assert zero.tokens == ones.tokens and zero.end_time == pytest.approx(ones.end_time)


def test_num_steps_and_determinism() -> None:
    model = r2r()
    a = simulate(model, (2, 2), num_steps=3000, seed=4, warmup_fraction=0.0)
    b = simulate(model, (2, 2), num_steps=3000, seed=4, warmup_fraction=0.0)
    assert sum(a.steps) == 3000 and a == b
    c = simulate(model, (2, 2), num_steps=3000, seed=5, warmup_fraction=0.0)
    assert c.tokens != a.tokens


# ------------------------------------------------------------------------------------------------------ 3 models


def test_three_models() -> None:
    model = three_models(8)
    for thresholds in [(3, 2, 2), (2, 1, 1)]:
        markov = solve(model, thresholds)
        sim = simulate(model, thresholds, duration=300.0, seed=1)
        assert markov.throughput == pytest.approx(sim.throughput, rel=0.05)
    small = three_models(4)
    best, best_tp = best_thresholds(small)
    assert is_feasible(best, 4) and best_tp > 0.0
    assert best_tp == pytest.approx(simulate(small, best, duration=200.0).throughput, rel=0.05)


# --------------------------------------------------------------------------------------------------- transit


def test_transit_closed_form() -> None:
    """One request alternating between two models: each round trip is both steps plus both transits."""
    steps, transit = [[0.010], [0.030]], [[0.0, 0.002], [0.005, 0.0]]
    model = SystemModel(1, [[0.0, 1.0], [1.0, 0.0]], steps, tokens=[[1.0, 1.0], [1.0, 1.0]], transit=transit)
    assert model.has_transit
    sim = simulate(model, (1, 1), duration=50.0)
    assert sim.throughput == pytest.approx(2 / 0.047, rel=1e-3)  # without transit: 2 / 0.040
    assert sim.utilization == pytest.approx([0.010 / 0.047, 0.030 / 0.047], rel=1e-2)


def test_transit_lowers_throughput_and_zero_transit_changes_nothing() -> None:
    plain = simulate(r2r(), (1, 1), duration=SIM_SECONDS / 4, seed=3)
    zero = simulate(r2r(transit=[[0.0, 0.0], [0.0, 0.0]]), (1, 1), duration=SIM_SECONDS / 4, seed=3)
    assert zero.throughput == plain.throughput and not r2r(transit=[[0.0, 0.0], [0.0, 0.0]]).has_transit
    slow = simulate(r2r(transit=[[0.0, 0.004], [0.004, 0.0]]), (1, 1), duration=SIM_SECONDS / 4, seed=3)
    assert slow.throughput < 0.97 * plain.throughput


def test_the_chain_refuses_transit_and_the_chooser_simulates() -> None:
    from tokenrouter.tuning.choose import choose_thresholds

    model = r2r(transit=[[0.0, 0.001], [0.002, 0.0]])
    with pytest.raises(ValueError, match="does not model transit"):
        build_chain(model, (1, 1))
    assert choose_thresholds(model).method == "simulator"


@pytest.mark.parametrize("transit", [[[0.0, -0.001], [0.0, 0.0]], [[0.0, math.inf], [0.0, 0.0]], [[0.0, 0.1]]])
def test_bad_transit_is_rejected(transit: list) -> None:
    with pytest.raises(ValueError, match="transit must be"):
        r2r(transit=transit)
