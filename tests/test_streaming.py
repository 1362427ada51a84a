"""The async streaming API: deltas add up to the final output, exactly one final, cancellation frees KV."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenrouter import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    cfg = {
        "models": {m: {"path": str(tiny_dir / m), "kv_cache_tokens": 4096} for m in ("small", "large")},
        "entry": "small",
        "policy": {"name": "random", "p": 0.3, "seed": 3},
        "batching": {"thresholds": {"small": 2, "large": 1}, "max_wait_ms": 2.0},
    }
    with Engine.from_config(cfg) as e:
        yield e


def _idle(engine: Engine) -> None:
    for _ in range(200):
        if not engine.requests:
            break
        asyncio.run(asyncio.sleep(0.01))
    engine.check_integrity()
    for sub in engine.subservers.values():
        assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks


def test_stream_deltas_add_up(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["def parse(text):", "class Foo:", "import sys\n", "for i in range(10):"]

    async def consume(prompt: str):
        outs = [o async for o in engine.generate_stream(prompt, params)]
        return outs

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    streams = asyncio.run(main())
    reference = Engine.generate  # the same engine, non-streaming, must agree
    finals = reference(engine, prompts, params)
    for outs, final in zip(streams, finals):
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert sum((o.delta_token_ids for o in outs), []) == outs[-1].token_ids == final.token_ids
        assert "".join(o.delta_text for o in outs) == outs[-1].text == final.text
        assert outs[-1].finish_reason == "length"
        assert outs[-1].stats["handoffs"] == final.stats["handoffs"]
    _idle(engine)


def test_cancelling_a_stream_aborts_everywhere(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        n = 0
        async for out in engine.generate_stream("while True:", params):
            n += len(out.delta_token_ids)
            if n >= 10:
                break  # closing the generator cancels the request
        return n

    assert asyncio.run(main()) >= 10
    _idle(engine)
    # And the engine serves the next request normally.
    out = engine.generate(["x = 1"], SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0))[0]
    assert len(out.token_ids) == 5
    _idle(engine)
