"""Models sharing a GPU: the simulator's processor sharing, the slowdown read from overlapping steps, and the tuner
that holds the large model back for a fuller batch only because of them."""

from __future__ import annotations

import json

import pytest

from tokenrouter.config import EngineConfig, ModelConfig
from tokenrouter.engine.autotune import solve_in_subprocess, solve_thresholds, system_model
from tokenrouter.engine.sharing import overlap_shares, shared_gpu, slowdown_of
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning import SystemModel, choose_thresholds, simulate, solve


def ping_pong(slowdown: list[float] | None) -> SystemModel:
    """Two requests bouncing between two models of 1 s steps, one request per step."""
    return SystemModel(concurrency=2, route_probs=[[0.0, 1.0], [1.0, 0.0]], step_latency=[[1.0], [1.0]],
                       max_batch=[1, 1], slowdown=slowdown)


@pytest.mark.parametrize(
    ("slowdown", "tok_s"),
    [
        (None, 2.0),  # both models busy all the time, 1 s a step
        ([1.0, 1.0], 2.0),
        ([2.0, 2.0], 1.0),  # always side by side: 2 s a step
        # A's step 2 s beside B, B's 1 s: B ends at +1 with A half done; A alone ends at +1.5: 2 steps every 1.5 s.
        ([2.0, 1.0], 2.0 / 1.5),
    ],
)
def test_processor_sharing_by_hand(slowdown: list[float] | None, tok_s: float) -> None:
    r = simulate(ping_pong(slowdown), (1, 1), duration=600.0)
    assert r.throughput == pytest.approx(tok_s, rel=0.01)


def test_a_model_that_never_shares_is_unchanged() -> None:
    plain = SystemModel(concurrency=4, route_probs=[[0.8, 0.2], [1.0, 0.0]],
                        step_latency=[[0.001 + 0.0001 * b for b in range(1, 5)], [0.02] * 4])
    shared = SystemModel(**{**plain.__dict__, "slowdown": [1.0, 1.0]})
    assert not shared.shares_gpu
    assert simulate(shared, (1, 2), num_steps=5_000).throughput == simulate(plain, (1, 2), num_steps=5_000).throughput


def test_the_chain_refuses_a_shared_gpu() -> None:
    with pytest.raises(ValueError, match="shared GPU"):
        solve(ping_pong([2.0, 1.0]), (1, 1))


def h200_pair(slowdown: list[float] | None) -> SystemModel:
    """Qwen3-0.6B + Qwen3-32B served on one H200 (served_h200_2026-12-04): 0.6B ~1.3 ms alone, ~2.5 ms beside the
    32B; the 32B ~21-23 ms at the batches it runs beside the 0.6B; 10 % of tokens routed, the routed token redone."""
    n = 8
    return SystemModel(concurrency=n, route_probs=[[0.9, 0.1], [1.0, 0.0]],
                       step_latency=[[0.0013 + 0.00003 * b for b in range(1, n + 1)],
                                     [0.0208 + 0.0009 * b for b in range(1, n + 1)]],
                       tokens=[[1.0, 0.0], [1.0, 1.0]], transit=[[0.0, 0.0013], [0.0015, 0.0]], slowdown=slowdown)


def test_the_tuner_holds_the_large_model_back_only_on_a_shared_gpu() -> None:
    shared = choose_thresholds(h200_pair([1.92, 1.0]), max_wait=0.1)
    assert shared.method == "simulator" and shared.thresholds[1] >= 4
    # What it expects from its choice, against the large model stepping for any one request, at the same wait:
    base = simulate(h200_pair([1.92, 1.0]), (1, 1), num_steps=20_000, max_wait=0.1).throughput
    assert shared.throughput > 1.08 * base
    # The models on two GPUs (the same latencies, no slowdown): nothing runs alone faster meanwhile, and the tuner
    # holds the large model for fewer.
    apart = choose_thresholds(h200_pair(None), max_wait=0.1)
    assert apart.thresholds[1] < shared.thresholds[1]


def test_a_short_bounded_wait_takes_the_fuller_batch_away() -> None:
    """The wait the deployment allows is part of the choice: a threshold whose batch never fills within it runs
    smaller batches anyway, and the tuner must not expect the fuller ones."""
    long_wait = choose_thresholds(h200_pair([1.92, 1.0]), max_wait=0.1)
    short_wait = choose_thresholds(h200_pair([1.92, 1.0]), max_wait=0.002)
    assert short_wait.throughput < long_wait.throughput


def steps(stats: StepStats, start: float, seconds: float, count: int, batch: int) -> float:
    """`count` back-to-back steps from `start`; returns when the last ended."""
    t = start
    for _ in range(count):
        t += seconds
        stats.record_step(batch, seconds, end=t)
    return t


def two_on_one_gpu() -> dict[str, StepStats]:
    """The large model steps for 0.1 s (5 steps of 20 ms); the small one runs 2 ms steps beside it, then 1 ms steps
    alone; both always at batch 2. Both records begin at 0."""
    small, large = StepStats(since=0.0), StepStats(since=0.0)
    steps(large, 0.0, 0.02, 5, 2)
    steps(small, 0.0, 0.002, 40, 2)  # 0 .. 0.08, beside
    steps(small, 0.2, 0.001, 40, 2)  # alone
    for s in (small, large):
        for _ in range(9):
            s.record_route(None, True)
    small.record_route("large", False)
    large.record_route("small", True)
    return {"small": small, "large": large}


def test_the_slowdown_comes_from_steps_alone_and_beside() -> None:
    stats = two_on_one_gpu()
    shares = overlap_shares(["small", "large"], stats)
    assert [f for _, _, f in shares["small"]] == pytest.approx([1.0] * 40 + [0.0] * 40, abs=1e-9)
    assert slowdown_of(shares["small"]) == pytest.approx(2.0)
    # The large model's last step (0.08-0.1) ran alone, once: too few to tell; it counts as unslowed.
    assert [f for _, _, f in shares["large"]] == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0], abs=1e-9)
    assert slowdown_of(shares["large"]) == 1.0
    factors, tables = shared_gpu(["small", "large"], stats, 4)
    assert factors == pytest.approx([2.0, 1.0]) and tables[1] is None
    assert tables[0][1] == pytest.approx(0.001)  # every step of batch 2 taken back to its time alone


def test_the_tuning_model_takes_the_alone_table_and_the_slowdown() -> None:
    stats = two_on_one_gpu()
    model = system_model(["small", "large"], stats, 4, one_device=True)
    assert model is not None and model.shares_gpu
    assert model.slowdown == pytest.approx([2.0, 1.0])
    assert model.step_latency[0][1] == pytest.approx(0.001)
    assert model.step_latency[1] == stats["large"].latency_table(4)
    # Through a process boundary (the served router solves from the subservers' snapshots) nothing changes.
    wire = {m: StepStats.from_snapshot(json.loads(json.dumps(s.snapshot()))) for m, s in stats.items()}
    assert wire["small"].recent_record()[:2] == stats["small"].recent_record()[:2]
    assert system_model(["small", "large"], wire, 4, one_device=True) == model
    tuned = solve_thresholds(["small", "large"], wire, 4, max_wait=0.05, one_device=True)
    assert tuned is not None and tuned.method == "simulator"
    # The served router's child process solves the same (the bounded wait and the device travel with the stats).
    assert solve_in_subprocess(["small", "large"], wire, 4, max_wait=0.05, one_device=True) == tuned
    # Models not on one device are not modelled as sharing, whatever their steps' overlap.
    assert system_model(["small", "large"], stats, 4).slowdown is None
    assert solve_thresholds(["small", "large"], wire, 4, max_wait=0.05).method == "markov"


def test_steps_outside_every_record_are_not_judged() -> None:
    """The large model's record ends at 0.041 s (its snapshot was taken then): the small model's 2 ms steps after it,
    which the large model's next steps overlapped unrecorded, must not count as alone."""
    small, large = StepStats(since=0.0), StepStats(since=0.0)
    steps(large, 0.0, 0.02, 2, 2)  # 0 .. 0.04
    large.as_of = 0.041
    steps(small, 0.0, 0.002, 40, 2)  # 0 .. 0.08: beside the large model's steps up to 0.04, after that unknown
    steps(small, 0.2, 0.001, 40, 2)  # alone, but after the large model's record ended
    shares = overlap_shares(["small", "large"], {"small": small, "large": large})
    assert len(shares["small"]) == 20  # the steps ending by 0.041, all beside the large model's
    assert slowdown_of(shares["small"]) == 1.0  # no alone steps inside the common window: it cannot tell


def test_one_device() -> None:
    def config(*models: ModelConfig) -> EngineConfig:
        return EngineConfig(models={m.name: m for m in models}, entry=models[0].name)

    gpu0 = [ModelConfig(name="small", path="x", device="cuda:0"), ModelConfig(name="large", path="y", device="cuda")]
    assert config(*gpu0).one_device
    assert not config(gpu0[0], ModelConfig(name="large", path="y", device="cuda:1")).one_device
    assert not config(gpu0[0], ModelConfig(name="large", path="y", device="cuda:0", url="peer:8001")).one_device
    assert not config(gpu0[0]).one_device
    assert config(ModelConfig(name="a", path="x"), ModelConfig(name="b", path="y")).one_device  # both on the CPU


def test_models_that_never_overlap_or_give_no_end_keep_the_measured_tables() -> None:
    small, large = StepStats(since=0.0), StepStats(since=0.0)
    steps(large, 0.0, 0.02, 5, 2)
    steps(small, 1.0, 0.001, 40, 2)
    for s in (small, large):
        s.record_step(2, 0.5)  # no end: counted in the table, not among the recent steps
        s.record_route(None, True)
    stats = {"small": small, "large": large}
    assert shared_gpu(["small", "large"], stats, 4) is None
    model = system_model(["small", "large"], stats, 4, one_device=True)
    assert model is not None and model.slowdown is None
    assert model.step_latency[0] == small.latency_table(4)


def test_on_a_shared_gpu_the_fastest_model_is_never_held_back() -> None:
    """The simulator rated holding the 0.6B for a batch higher than it served (H200, C=16: (11, 3) committed
    1,400-1,600 tok/s, (1, 6) ~2,150): on a shared GPU only the slower model's threshold is tuned. With these
    slowdowns the simulator alone would choose (2, 6)."""
    choice = choose_thresholds(h200_pair([2.4, 1.1]), max_wait=0.1)
    assert choice.thresholds[0] == 1 and choice.thresholds[1] >= 4
    model = h200_pair([1.1, 2.4])
    model.step_latency = [model.step_latency[1], model.step_latency[0]]  # the fastest listed second: found by time
    model.route_probs, model.tokens = [[0.0, 1.0], [0.1, 0.9]], [[1.0, 1.0], [0.0, 1.0]]
    model.transit = None
    for incumbent in (None, (1, 3), (3, 1), (4, 2)):  # an incumbent that holds it back cannot stay
        choice = choose_thresholds(model, max_wait=0.1, incumbent=incumbent)
        assert choice.thresholds[1] == 1 and choice.thresholds[0] >= 4, incumbent
