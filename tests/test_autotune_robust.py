"""`thresholds: auto` on H200-like measurements: the solver always answers, quickly, with a feasible vector.

Latencies are shaped like those measured on an H200 with dummy weights: Qwen3-0.6B ~1.5 ms per decode step and nearly
flat over batch 1-8, 8B ~6 ms, 32B ~17-20 ms. With a tick fine enough for the 0.6B model, the exact Markov chain of
three such models has hundreds of thousands of states per threshold vector, and one absurd extrapolated latency (1 us)
used to shrink the tick by another factor of a thousand.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest

from tokenrouter.engine.autotune import (
    MAX_SOLVED_N,
    TunedThresholds,
    solve_in_subprocess,
    solve_thresholds,
    system_model,
)
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning import SystemModel, choose_thresholds, rank_by_simulation, sanitize_latency, simulate, solve
from tokenrouter.tuning.markov import STATE_BUDGET, build_chain, default_tick, estimated_states
from tokenrouter.tuning.system import feasible_thresholds, is_feasible, linear_latency

N = 8
# Wall-clock limit for one solve. Measured ~1-1.5 s on 2 shared CPU cores; generous for a loaded CI box.
SOLVE_SECONDS = 6.0

SMALL = linear_latency(N, 0.0015, 0.00002)  # 0.6B
MID = linear_latency(N, 0.0060, 0.0001)  # 8B
LARGE = linear_latency(N, 0.0170, 0.0004)  # 32B


def measured(latency: dict[int, float], stay: int, moves: dict[str, tuple[int, int]]) -> StepStats:
    """StepStats with `latency` (batch -> seconds, 3 steps each), `stay` rows kept and `moves` (target -> (rows,
    committed))."""
    s = StepStats()
    for b, t in latency.items():
        for _ in range(3):
            s.record_step(b, t)
    for _ in range(stay):
        s.record_route(None, True)
    for target, (rows, committed) in moves.items():
        for k in range(rows):
            s.record_route(target, k < committed)
    return s


def two_model_stats(dive: bool = False) -> dict[str, StepStats]:
    # dive: the small model was only ever timed at batches 7 and 8, and noisily, so the least-squares line through
    # them reaches below zero at batch 1 (the old table then said 1 us there).
    timed = {7: 0.0015, 8: 0.0019} if dive else {b: SMALL[b - 1] for b in range(1, N + 1)}
    small = measured(timed, stay=90, moves={"large": (10, 0)})  # p = 0.1 to the large model, escalated token dropped
    large = measured({b: LARGE[b - 1] for b in range(1, N + 1)}, stay=10, moves={"small": (90, 90)})
    return {"small": small, "large": large}


def three_model_stats() -> dict[str, StepStats]:
    def timed(row: list[float]) -> dict[int, float]:
        return {b: row[b - 1] for b in range(1, N + 1)}

    return {
        "small": measured(timed(SMALL), stay=85, moves={"mid": (10, 0), "large": (5, 0)}),
        "mid": measured(timed(MID), stay=15, moves={"small": (80, 80), "large": (5, 0)}),
        "large": measured(timed(LARGE), stay=5, moves={"small": (90, 90), "mid": (5, 5)}),
    }


def timed_solve(models: list[str], stats: dict[str, StepStats], **kw: Any) -> tuple[TunedThresholds, float]:
    t0 = time.perf_counter()
    tuned = solve_thresholds(models, stats, N, **kw)
    elapsed = time.perf_counter() - t0
    assert tuned is not None
    return tuned, elapsed


def as_system(models: list[str], stats: dict[str, StepStats], n: int = N) -> SystemModel:
    rows = [stats[m].route_row(models, m) for m in models]
    tables = [stats[m].latency_table(n) for m in models]
    return SystemModel(
        n,
        [r[0] for r in rows if r],
        [sanitize_latency(t) for t in tables if t],
        tokens=[r[1] for r in rows if r],
    )


# ------------------------------------------------------------------------------------------- latency tables


def test_extrapolated_latencies_stay_physical() -> None:
    table = two_model_stats(dive=True)["small"].latency_table(N)
    assert table is not None and table[6:] == pytest.approx([0.0015, 0.0019])
    # Smaller batches: no slower than batch 7, and no cheaper per request.
    for b in range(1, 7):
        assert 0.0015 * b / 7 <= table[b - 1] <= 0.0015
    up = measured({1: 0.010, 2: 0.030}, stay=1, moves={}).latency_table(4)
    assert up is not None and up[2] <= 0.030 * 3 / 2 and up[3] <= 0.030 * 4 / 2  # slope 20 ms/req, capped


def test_bad_step_timings_are_not_recorded() -> None:
    s = StepStats()
    for seconds in (math.nan, math.inf, 0.0, -0.002):
        s.record_step(2, seconds)
    s.record_step(0, 0.002)
    assert s.latency_table(2) is None
    s.record_step(2, 0.002)
    assert s.latency_table(2) == pytest.approx([0.002, 0.002])


def test_a_rarely_seen_slow_batch_size_does_not_reprice_the_smaller_ones() -> None:
    """Served on an H200 (C=16): three 32B steps at 13 requests carried a burst of prompts, 43 ms against a trend of
    ~31 ms there. As the table's largest size, their raw mean raised every smaller size through the rule that no
    smaller batch runs a request more cheaply (12 requests: 43 * 12 / 13 = 39.7 ms for a measured 32)."""
    def trend(b: int) -> float:
        return 0.020 + 0.001 * b

    s = StepStats()
    for b in range(1, 13):
        for _ in range(40):
            s.record_step(b, trend(b))
    for _ in range(3):
        s.record_step(13, 0.043)
    table = sanitize_latency(s.latency_table(16))
    assert table[12] < 0.036  # pooled with the trend: mostly the line while seen 3 times
    assert table[11] < 0.0335  # lifted by ~1 ms, not ~8
    assert table[:11] == pytest.approx([trend(b) for b in range(1, 12)], rel=0.01)
    for _ in range(60):  # seen often, a size's own mean stands
        s.record_step(13, 0.043)
    assert s.latency_table(16)[12] > 0.041


def test_sanitize_latency() -> None:
    assert sanitize_latency([1e-6, 0.0015, 0.0016]) == pytest.approx([0.00075, 0.0015, 0.0016])
    assert sanitize_latency([math.nan, 0.002, -1.0, 0.0, 0.003]) == pytest.approx([0.002, 0.002, 0.00225, 0.003, 0.003])
    assert sanitize_latency(SMALL) == SMALL  # a sane row is left alone
    with pytest.raises(ValueError):
        sanitize_latency([0.0, math.nan])


# ------------------------------------------------------------------------------------------- the chain's tick


def test_one_tiny_latency_does_not_shrink_the_tick() -> None:
    rows = [[1e-6, *SMALL[1:]], MID, LARGE]
    probs = [[0.85, 0.1, 0.05], [0.8, 0.15, 0.05], [0.9, 0.05, 0.05]]
    tiny = SystemModel(N, probs, rows)
    clean = SystemModel(N, probs, [SMALL, MID, LARGE])
    tick = default_tick(tiny)
    assert tick == pytest.approx(default_tick(clean), rel=0.01)
    assert estimated_states(tiny, tick) <= STATE_BUDGET * 1.0001
    # The largest chain of this system ((1, 1, 1): everything launches at once) now fits the budget's scale; before,
    # the tick came from the 1 us entry and the chain passed 400k states.
    assert len(build_chain(tiny, (1, 1, 1), tick=tick).states) <= STATE_BUDGET


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param([linear_latency(N, 0.010, 0.0002), linear_latency(N, 0.030, 0.001)], id="r2r-1:3"),
        pytest.param([SMALL, LARGE], id="h200-1:13"),
    ],
)
def test_state_estimate_bounds_the_largest_chain(rows: list[list[float]]) -> None:
    """The estimate that sizes the tick must track the real chain size within a small factor, or the budget is moot."""
    model = SystemModel(N, [[0.9, 0.1], [0.9, 0.1]], rows, tokens=[[1, 0], [1, 1]])
    tick = default_tick(model, state_budget=2_000)
    worst = max(len(build_chain(model, thr, tick=tick).states) for thr in [(1, 1), (1, 2), (2, 1), (4, 4)])
    assert 0.2 * estimated_states(model, tick) <= worst <= 1.5 * estimated_states(model, tick)


# ------------------------------------------------------------------------------------------- solve_thresholds


def test_two_h200_models_solve_exactly() -> None:
    stats = two_model_stats()
    tuned, elapsed = timed_solve(["small", "large"], stats)
    assert elapsed < SOLVE_SECONDS
    assert tuned.method == "markov" and tuned.concurrency == N
    assert set(tuned.thresholds) == {"small", "large"}
    assert is_feasible(list(tuned.thresholds.values()), N)
    # The prediction is a throughput of the measured system, not just a ranking score.
    sim = simulate(as_system(["small", "large"], stats), list(tuned.thresholds.values()), duration=60.0, seed=1)
    assert tuned.predicted_tok_s == pytest.approx(sim.throughput, rel=0.05)


def test_a_diving_extrapolation_still_solves() -> None:
    tuned, elapsed = timed_solve(["small", "large"], two_model_stats(dive=True))
    assert elapsed < SOLVE_SECONDS
    assert is_feasible(list(tuned.thresholds.values()), N) and tuned.predicted_tok_s > 0.0


def test_three_h200_models_solve_within_seconds() -> None:
    models = ["small", "mid", "large"]
    tuned, elapsed = timed_solve(models, three_model_stats())
    assert elapsed < SOLVE_SECONDS
    assert tuned.method == "simulator"  # the exact chain would need ~0.2 ticks per small step to fit the budget
    assert [*tuned.thresholds] == models and is_feasible(list(tuned.thresholds.values()), N)
    assert 1000.0 < tuned.predicted_tok_s < 3000.0  # ~1.9k tok/s: mostly 0.6B steps of up to 8 requests


def test_tiny_state_cap_falls_back_to_the_simulator() -> None:
    """The chain is tried (its tick resolves both models) but overflows max_states: the simulator still answers."""
    stats = two_model_stats()
    tuned = solve_thresholds(["small", "large"], stats, 4, state_budget=5_000, max_states=10)
    assert tuned is not None and tuned.method == "simulator" and tuned.concurrency == 4
    assert is_feasible(list(tuned.thresholds.values()), 4) and tuned.predicted_tok_s > 0.0
    exact = solve_thresholds(["small", "large"], stats, 4, state_budget=5_000)
    assert exact is not None and exact.method == "markov"
    assert tuned.predicted_tok_s == pytest.approx(exact.predicted_tok_s, rel=0.05)


def test_simulated_ranking_is_close_to_the_exact_best() -> None:
    """Where both methods work, the simulator's pick must be (nearly) as good as the chain's, judged by the chain."""
    model = SystemModel(
        N,
        [[0.7, 0.3], [0.9, 0.1]],
        [linear_latency(N, 0.010, 0.0002), linear_latency(N, 0.060, 0.0005)],  # batching the large model pays
        tokens=[[1, 0], [1, 1]],
    )
    candidates = list(feasible_thresholds(2, N))
    sim = rank_by_simulation(model, candidates, sim_steps=600)
    exact = choose_thresholds(model)
    assert sim.method == "simulator" and exact.method == "markov"
    tick = default_tick(model)
    judged = {thr: solve(model, thr, tick=tick).throughput for thr in (sim.thresholds, exact.thresholds)}
    assert judged[sim.thresholds] >= 0.98 * judged[exact.thresholds]
    assert sim.throughput == pytest.approx(exact.throughput, rel=0.05)


def test_no_answer_until_every_model_was_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = two_model_stats()
    assert solve_thresholds(["small", "large"], {"small": stats["small"]}, N) is None
    assert solve_thresholds(["small", "large"], {**stats, "large": StepStats()}, N) is None
    unrouted = StepStats()
    unrouted.record_step(1, 0.02)
    assert solve_thresholds(["small", "large"], {**stats, "large": unrouted}, N) is None
    assert solve_thresholds(["small", "large"], stats, 0) is None
    monkeypatch.setitem(MAX_SOLVED_N, 2, 3)  # a small cap keeps this quick
    capped = solve_thresholds(["small", "large"], stats, 1000)
    assert capped is not None and capped.concurrency == 3 and is_feasible(list(capped.thresholds.values()), 3)


# ------------------------------------------------------------------------------------------- snapshots


def test_snapshot_round_trips_through_json() -> None:
    models = ["small", "mid", "large"]
    stats = three_model_stats()
    stats["small"].record_step(3, 0.00161)  # a second reading at one size: sums and counts, not means, travel
    wire = {m: json.loads(json.dumps(s.snapshot())) for m, s in stats.items()}
    back = {m: StepStats.from_snapshot(d) for m, d in wire.items()}
    for m in models:
        assert back[m].snapshot() == wire[m]  # (a live record's snapshot ends now; a rebuilt one where it was taken)
        assert back[m].latency_table(N) == stats[m].latency_table(N)
        assert back[m].route_row(models, m) == stats[m].route_row(models, m)
    empty = StepStats.from_snapshot(json.loads(json.dumps(StepStats().snapshot())))
    assert empty.latency_table(4) is None and empty.route_row(models, "small") is None
    # What the router solves from the snapshots is what the subservers would have solved themselves.
    pair = ["small", "large"]
    assert solve_thresholds(pair, {m: back[m] for m in pair}, 4, state_budget=5_000) == solve_thresholds(
        pair, {m: stats[m] for m in pair}, 4, state_budget=5_000
    )


def test_transit_travels_and_counts_in_the_expected_throughput() -> None:
    """Handoffs' transit measured at each target crosses the snapshot, lands in the tuning model, and lowers the
    expected tokens/s of the chosen vector (which is ranked as before: the ranking does not see transit)."""
    pair = ["small", "large"]
    plain = two_model_stats()
    slow = {m: StepStats.from_snapshot(json.loads(json.dumps(s.snapshot()))) for m, s in two_model_stats().items()}
    for _ in range(3):
        slow["large"].record_transit("small", 0.004)
        slow["small"].record_transit("large", 0.006)
    slow["small"].record_transit("large", 99.0)  # another clock: not a transit
    back = {m: StepStats.from_snapshot(json.loads(json.dumps(s.snapshot()))) for m, s in slow.items()}
    assert back["small"].mean_transit("large") == pytest.approx(0.006) and back["small"].mean_transit("x") is None
    model = system_model(pair, back, N)
    assert model.transit == [[0.0, pytest.approx(0.004)], [pytest.approx(0.006), 0.0]]
    assert not system_model(pair, plain, N).has_transit
    fast, delayed = solve_thresholds(pair, plain, N), solve_thresholds(pair, back, N)
    assert delayed.thresholds == fast.thresholds and delayed.method == fast.method
    assert delayed.predicted_tok_s < 0.97 * fast.predicted_tok_s


def good_snapshot() -> dict[str, Any]:
    return json.loads(json.dumps(two_model_stats()["small"].snapshot()))


def recent(**changes: Any) -> dict[str, Any]:
    """A snapshot's record of recent steps, valid but for `changes`."""
    return {"since": 0.0, "as_of": 2.0, "steps": [[1.0, 0.002, 2], [1.5, 0.003, 3]], **changes}


def test_a_valid_record_of_recent_steps_is_kept() -> None:
    back = StepStats.from_snapshot({**good_snapshot(), "recent": recent()})
    assert back.recent_record() == ([(1.0, 0.002, 2), (1.5, 0.003, 3)], 0.0, 2.0)


def broken(**changes: Any) -> dict[str, Any]:
    d = good_snapshot()
    for key, value in changes.items():
        if value is KeyError:
            del d[key]
        else:
            d[key] = value
    return d


@pytest.mark.parametrize(
    "snapshot",
    [
        pytest.param([], id="not-a-mapping"),
        pytest.param(broken(rows=KeyError), id="missing-key"),
        pytest.param({**good_snapshot(), "extra": 1}, id="extra-key"),
        pytest.param(broken(version=4), id="future-version"),
        pytest.param(broken(version=1), id="old-version"),
        pytest.param(broken(recent=[[1.0, 0.002, 2]]), id="recent-not-a-mapping"),
        pytest.param(broken(recent={"since": 0.0, "steps": []}), id="recent-missing-as-of"),
        pytest.param(broken(recent=recent(as_of=-1.0)), id="recent-negative-as-of"),
        pytest.param(broken(recent=recent(steps={"a": 1})), id="recent-steps-not-a-list"),
        pytest.param(broken(recent=recent(steps=[[1.0, 0.002]])), id="recent-short-step"),
        pytest.param(broken(recent=recent(steps=[[1.0, 0.0, 2]])), id="recent-zero-seconds"),
        pytest.param(broken(recent=recent(steps=[[1.0, 0.002, 0]])), id="recent-batch-zero"),
        pytest.param(broken(recent=recent(steps=[[math.inf, 0.002, 2]])), id="recent-infinite-end"),
        pytest.param(broken(recent=recent(steps=[[1.0, 0.002, 2]] * 2049)), id="recent-too-many"),
        pytest.param(broken(transit={"large": [0.001]}), id="short-transit"),
        pytest.param(broken(transit={"large": [-0.001, 1]}), id="negative-transit"),
        pytest.param(broken(transit={"large": [0.001, 0]}), id="transit-without-handoffs"),
        pytest.param(broken(transit={"large": [60.0, 2]}), id="transit-from-another-clock"),
        pytest.param(broken(transit={"": [0.001, 1]}), id="transit-unnamed-source"),
        pytest.param(broken(latency={"0": [0.01, 1]}), id="batch-zero"),
        pytest.param(broken(latency={"x": [0.01, 1]}), id="batch-not-a-number"),
        pytest.param(broken(latency={"1": [0.01, True]}), id="bool-count"),
        pytest.param(broken(latency={"1": [0.01, 1.5]}), id="float-count"),
        pytest.param(broken(latency={"1": [math.nan, 1]}), id="nan-seconds"),
        pytest.param(broken(latency={"1": [0.0, 3]}), id="zero-seconds"),
        pytest.param(broken(latency={"1": [0.01]}), id="short-pair"),
        pytest.param(broken(latency={"1": "0.01"}), id="string-pair"),
        pytest.param(broken(latency={"1": [0.01, 1], 1: [0.01, 1]}), id="duplicate-batch"),
        pytest.param(broken(rows=-1), id="negative-rows"),
        pytest.param(broken(rows="100"), id="string-rows"),
        pytest.param(broken(moves={"large": 101}), id="more-moves-than-rows"),
        pytest.param(broken(moves={7: 1}, committed_on_move={}), id="non-string-model"),
        pytest.param(broken(committed_on_move={"large": 11}), id="more-committed-than-moved"),
        pytest.param(broken(committed_on_move={"mid": 0}), id="committed-without-moves"),
        pytest.param(broken(moves=[("large", 10)]), id="moves-not-a-mapping"),
    ],
)
def test_malformed_snapshot_is_rejected(snapshot: Any) -> None:
    with pytest.raises(ValueError):
        StepStats.from_snapshot(snapshot)


def test_the_served_router_solves_from_reports_and_the_child_checks_them() -> None:
    """The served router hands the subservers' reports to the solve's child process as they came (it does not
    check them on its event loop): the child solves what the StepStats would have, and a bad report fails the
    solve with the model named, so the router logs it and keeps its thresholds."""
    pair = ["small", "large"]
    stats = two_model_stats()
    reports = {m: json.loads(json.dumps(s.snapshot())) for m, s in stats.items()}
    assert solve_in_subprocess(pair, reports, 4) == solve_in_subprocess(pair, stats, 4) is not None
    with pytest.raises(RuntimeError, match="bad step statistics from large: .*version"):
        solve_in_subprocess(pair, {**reports, "large": broken(version=4)}, 4)
