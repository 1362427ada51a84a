"""The deployment's KV budget: every request the entry model holds may come to hold KV on every model, so the entry
admits new requests while they all fit the smallest other pool (Arrive.kv_budget). With a large model whose pool is
smaller than the entry's, the entry admitted more than the large model could hold, and each first visit there took
the blocks of requests parked there (each came back to a whole re-prefill), in process as served."""

from __future__ import annotations

from pathlib import Path

import torch

from test_routing_vs_naive import assert_all_free, naive_generate
from tokenrouter import Engine
from tokenrouter.sampling_params import SamplingParams

POLICY = {"name": "random", "p": 0.3, "seed": 0}


def _engine(tiny: Path, small_kv: int, large_kv: int) -> Engine:
    models = {"small": small_kv, "large": large_kv}
    return Engine.from_config({
        "models": {m: {"path": str(tiny / m), "kv_cache_tokens": kv, "block_size": 4} for m, kv in models.items()},
        "entry": "small", "policy": POLICY, "batching": {"thresholds": 1},
    })


def test_the_entry_admits_what_the_smallest_pool_holds(tiny_dir: Path) -> None:
    """8 prompts of 200 tokens (50 blocks of 4) into a small model that holds them all and a large model of 256
    blocks: at most 5 are in the system at once (before the budget: all 8), and each output is still the naive
    reference's."""
    engine = _engine(tiny_dir, 4096, 1024)
    small, large = engine.subservers["small"], engine.subservers["large"]
    assert engine.kv_budget() == large.block_manager.num_blocks * large.block_manager.block_size == 1024
    in_system = []
    schedule = small.scheduler.schedule

    def counted() -> list:
        chunks = schedule()
        s = small.scheduler
        in_system.append(len(s.running) + len(s.parked) + sum(not q.new_request for q in s.waiting))
        return chunks

    small.scheduler.schedule = counted
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, engine.vocab_size, (200,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert max(in_system) == 5
    assert sum(o.stats["handoffs"] for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == naive_generate(tiny_dir, ["small", "large"], POLICY, prompt, 24)[0]
    assert_all_free(engine)
    engine.shutdown()


def test_without_another_pool_known_the_entry_admits_what_its_own_pool_holds(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, 4096, 1024)
    engine.pool_tokens = {"small": 4096}  # (served: no heartbeat from the large model yet)
    assert engine.kv_budget() is None
    small = engine.subservers["small"]
    g = torch.Generator().manual_seed(1)
    rids = [engine.add_request(torch.randint(3, engine.vocab_size, (200,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)) for _ in range(8)]
    engine.step()
    assert len(small.scheduler.running) == 8 and small.scheduler.kv_budget is None
    while engine.has_unfinished():
        engine.step()
    assert len(rids) == 8
    assert_all_free(engine)
    engine.shutdown()
