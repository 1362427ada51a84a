"""The engine's ablation switches change how it runs, never what it writes: with the policy's work outside
the step (`route_in_step: false`) and the models stepped in turn on one thread (`independent_loops: false`),
routed greedy output equals the default engine's, handoffs happen, and every KV block is free afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [17] * 11, [40, 41, 42, 43, 44, 45, 46]]


def engine_for(tiny_dir: Path, config: str, route_in_step: bool = True, independent_loops: bool = True) -> Engine:
    cfg = yaml.safe_load((REPO / "config" / config).read_text())
    for name, m in cfg["models"].items():
        m.update(path=str(tiny_dir / name), kv_cache_tokens=2048, route_in_step=route_in_step)
    cfg["independent_loops"] = independent_loops
    return Engine.from_config(cfg)


@pytest.mark.parametrize("config", ["r2r/tiny-small_tiny-large.yaml", "rstitch/tiny-small_tiny-large.yaml"])
def test_switches_keep_the_routed_output(tiny_dir: Path, config: str) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    with engine_for(tiny_dir, config) as ref_engine:
        ref = ref_engine.generate(PROMPTS, params)
    assert sum(o.stats["handoffs"] for o in ref) > 0, "the reference must route, or the test proves nothing"
    for route_in_step, independent in [(False, True), (True, False), (False, False)]:
        with engine_for(tiny_dir, config, route_in_step, independent) as engine:
            engine.start()  # background mode: with independent_loops false, the one lockstep thread
            got = engine.generate(PROMPTS, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in ref], (route_in_step, independent)
            assert [o.stats["tokens_per_model"] for o in got] == [o.stats["tokens_per_model"] for o in ref]
            engine.check_integrity()
            for sub in engine.subservers.values():
                assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks, sub.name


def test_lockstep_runs_one_thread_for_all_models(tiny_dir: Path) -> None:
    with engine_for(tiny_dir, "r2r/tiny-small_tiny-large.yaml", independent_loops=False) as engine:
        engine.start()
        names = sorted(t.name for t in engine._threads)
        assert "tr-models" in names and not any(n in names for n in ("tr-small", "tr-large")), names
