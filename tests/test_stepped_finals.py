"""Stepped mode (`add_request` + repeated `step()`): every request ends with exactly one final output, whatever
models it visited and however it ended, and every model's KV is free afterwards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from tokenrouter.engine.engine import Engine
from tokenrouter.engine.outputs import RequestOutput
from tokenrouter.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [17] * 11, [40, 41, 42, 43, 44, 45, 46]]


def engine_for(tiny_dir: Path, config: str, model: dict | None = None, **policy: object) -> Engine:
    """A shipped tiny config with its model paths pointed at the tiny fixture and a small KV pool; `model`
    overrides keys of every model, `policy` arguments of the policy."""
    cfg = yaml.safe_load((REPO / "config" / config).read_text())
    for name, m in cfg["models"].items():
        m.update({"path": str(tiny_dir / name), "kv_cache_tokens": 1024, "block_size": 4, **(model or {})})
    cfg["policy"].update(policy)
    return Engine.from_config(cfg)


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished()
    for sub in engine.subservers.values():
        assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks, sub.name
        assert not sub.seqs, sub.name


def run_stepped(engine: Engine, abort_after: dict[str, int] | None = None) -> list[RequestOutput]:
    """Step until idle; a request in `abort_after` is aborted once it has that many output tokens."""
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    abort_after = abort_after or {}
    outs: list[RequestOutput] = []
    for _ in range(500):
        if not engine.has_unfinished():
            break
        outs += engine.step()
        for rid, n in abort_after.items():
            req = engine.requests.get(rid)
            if req is not None and len(req.output_ids) >= n:
                assert engine.abort(rid).finished
    outs += engine.step()  # nothing more may come after the last request finished
    assert {o.request_id for o in outs} <= set(ids)
    return outs


def assert_one_final_each(outs: list[RequestOutput], ids: list[str]) -> None:
    finals = Counter(o.request_id for o in outs if o.finished)
    assert finals == Counter({rid: 1 for rid in ids}), finals
    for rid in ids:
        mine = [o for o in outs if o.request_id == rid]
        assert mine[-1].finished, f"{rid}: an output came after its final one"
        assert sum(len(o.delta_token_ids) for o in mine) == len(mine[-1].token_ids)


@pytest.mark.parametrize(
    ("config", "policy"),
    [
        ("always/tiny-small_tiny-large.yaml", {}),  # every request moves to the large model at once
        ("random/tiny-small_tiny-large.yaml", {"p": 0.5}),  # many handoffs back and forth
        ("mixture/tiny-small_tiny-medium_tiny-large.yaml", {}),  # three models
    ],
)
def test_one_final_output_per_request(tiny_dir: Path, config: str, policy: dict) -> None:
    with engine_for(tiny_dir, config, **policy) as engine:
        outs = run_stepped(engine)
        assert_one_final_each(outs, [f"req-{i}" for i in range(len(PROMPTS))])
        assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs if o.finished)
        if config.startswith("random"):
            assert any(o.stats["handoffs"] > 1 for o in outs if o.finished)
        assert_all_free(engine)


def test_aborted_mid_way_gets_its_final_from_abort_only(tiny_dir: Path) -> None:
    with engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.5) as engine:
        outs = run_stepped(engine, abort_after={"req-1": 3, "req-2": 6})
        # An aborted request's final output is abort()'s return value; step() reports the others' finals.
        assert_one_final_each([o for o in outs if o.request_id not in ("req-1", "req-2")], ["req-0", "req-3"])
        assert not [o for o in outs if o.request_id in ("req-1", "req-2") and o.finished]
        assert_all_free(engine)


def test_listener_sees_one_final(tiny_dir: Path) -> None:
    with engine_for(tiny_dir, "always/tiny-small_tiny-large.yaml") as engine:
        seen: list[RequestOutput] = []
        params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        engine.add_request(PROMPTS[0], params, listener=seen.append)
        while engine.has_unfinished():
            assert engine.step() == []  # a listener's outputs go to the listener only
        assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished
        assert_all_free(engine)
