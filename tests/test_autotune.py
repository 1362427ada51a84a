"""`thresholds: auto`: measurements -> Markov-chain solve -> thresholds applied, outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenrouter import Engine, SamplingParams
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning.system import is_feasible


def test_latency_table_fills_unmeasured_sizes_on_a_line() -> None:
    s = StepStats()
    for b, t in ((1, 0.010), (2, 0.012), (4, 0.016)):
        s.record_step(b, t)
        s.record_step(b, t)
    table = s.latency_table(6)
    assert table[:2] == pytest.approx([0.010, 0.012])
    assert table[2] == pytest.approx(0.014)  # interpolated
    assert table[5] == pytest.approx(0.020)  # extrapolated
    assert StepStats().latency_table(4) is None


def test_route_row_from_counts() -> None:
    s = StepStats()
    for _ in range(8):
        s.record_route(None, True)
    s.record_route("large", False)
    s.record_route("large", False)
    probs, tokens = s.route_row(["small", "large"], "small")
    assert probs == pytest.approx([0.8, 0.2])
    assert tokens == [1.0, 0.0]  # R2R-like: the escalated token is dropped


def test_auto_thresholds_are_solved_applied_and_keep_outputs(tiny_dir: Path) -> None:
    cfg = {
        "models": {m: {"path": str(tiny_dir / m), "kv_cache_tokens": 4096} for m in ("small", "large")},
        "entry": "small",
        "policy": {"name": "random", "p": 0.3, "seed": 1},
        "batching": {"thresholds": "auto", "max_wait_ms": 2.0, "auto_interval_s": 0.05},
    }
    prompts = [[5 + i, 9, 30 + i, 7] * (i + 1) for i in range(8)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with Engine.from_config(cfg) as stepped:
        expected = [o.token_ids for o in stepped.generate(prompts, params)]
        assert stepped.retune(concurrency=0) is None  # nothing to solve without requests
        best = stepped.retune(concurrency=8)
        assert best is not None and set(best) == {"small", "large"}
        assert is_feasible([best["small"], best["large"]], 8)
    with Engine.from_config(cfg) as bg:
        bg.start()  # the tuner thread re-solves every 50 ms while requests run
        got = [o.token_ids for o in bg.generate(prompts, params)]
        assert got == expected
        assert bg.retune(concurrency=8) is not None
        bg.check_integrity()
