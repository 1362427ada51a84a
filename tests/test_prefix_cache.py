"""Prefix caching: a request reuses the KV of full blocks another request computed, runs only the rest,
and produces exactly what it produces without caching; cached blocks are evicted, never leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_idle
from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

MODEL = "large"
GEN = 8
GREEDY = SamplingParams(max_new_tokens=GEN, temperature=0, ignore_eos=True)


def make_engine(tiny_dir: Path, block_size: int, caching: bool = True, kv_tokens: int = 4096, **kw) -> Engine:
    cfg = {
        "path": str(tiny_dir / MODEL),
        "block_size": block_size,
        "kv_cache_tokens": kv_tokens,
        "enable_prefix_caching": caching,
        **kw,
    }
    return Engine.from_config({"models": {MODEL: cfg}})


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def uncached_engines(tiny_dir: Path):
    """Reference engines without prefix caching, one per block size."""
    engines: dict[int, Engine] = {}

    def get(block_size: int) -> Engine:
        if block_size not in engines:
            engines[block_size] = make_engine(tiny_dir, block_size, caching=False)
        return engines[block_size]

    return get


def reference(uncached_engines, block_size: int, prompt: list[int]) -> list[int]:
    engine = uncached_engines(block_size)
    (out,) = engine.generate([prompt], GREEDY)
    assert out.stats["num_cached_tokens"] == 0
    assert out.stats["num_forwarded_tokens"] == len(prompt) + GEN - 1
    assert_idle(engine)
    return out.token_ids


@pytest.mark.parametrize("block_size", [4, 16])
def test_shared_prefix_computes_only_the_rest(tiny_dir: Path, uncached_engines, block_size: int) -> None:
    engine = make_engine(tiny_dir, block_size)
    prefix = rand_tokens(3 * block_size, seed=1)
    a = prefix + rand_tokens(5, seed=2)
    b = prefix + rand_tokens(7, seed=3)
    assert a[3 * block_size] != b[3 * block_size]

    (out_a,) = engine.generate([a], GREEDY)
    assert out_a.stats["num_cached_tokens"] == 0
    assert out_a.stats["num_forwarded_tokens"] == len(a) + GEN - 1
    assert_idle(engine)

    (out_b,) = engine.generate([b], GREEDY)
    assert out_b.stats["num_cached_tokens"] == 3 * block_size
    assert out_b.stats["num_forwarded_tokens"] == len(b) - 3 * block_size + (GEN - 1)
    assert out_b.token_ids == reference(uncached_engines, block_size, b)
    assert out_a.token_ids == reference(uncached_engines, block_size, a)
    assert_idle(engine)


@pytest.mark.parametrize("extra", [0, 1])
def test_identical_prompt_twice(tiny_dir: Path, uncached_engines, extra: int) -> None:
    bs = 4
    engine = make_engine(tiny_dir, bs)
    prompt = rand_tokens(5 * bs + extra, seed=4)
    (first,) = engine.generate([prompt], GREEDY)
    (second,) = engine.generate([prompt], GREEDY)
    # Whole blocks only, and the last prompt token always runs (its logits give the first output token).
    cached = 4 * bs if extra == 0 else 5 * bs
    assert second.stats["num_cached_tokens"] == cached
    assert second.stats["num_forwarded_tokens"] == len(prompt) - cached + GEN - 1
    assert first.token_ids == second.token_ids == reference(uncached_engines, bs, prompt)
    assert_idle(engine)


def test_continuation_reuses_generated_blocks(tiny_dir: Path, uncached_engines) -> None:
    """A follow-up whose prompt is an earlier prompt plus its answer reuses the answer's KV as well."""
    bs = 4
    engine = make_engine(tiny_dir, bs)
    prompt = rand_tokens(10, seed=5)
    (first,) = engine.generate([prompt], GREEDY)
    follow = prompt + first.token_ids + rand_tokens(3, seed=6)
    (second,) = engine.generate([follow], GREEDY)
    # The first request computed len(prompt) + GEN - 1 tokens (the last sampled one never ran).
    cached = (len(prompt) + GEN - 1) // bs * bs
    assert second.stats["num_cached_tokens"] == cached
    assert second.stats["num_forwarded_tokens"] == len(follow) - cached + GEN - 1
    assert second.token_ids == reference(uncached_engines, bs, follow)
    assert_idle(engine)


def test_in_flight_sharing(tiny_dir: Path, uncached_engines) -> None:
    """With chunked prefill, a later request shares blocks that a still-running one has published."""
    bs = 4
    engine = make_engine(tiny_dir, bs, max_num_batched_tokens=8)
    prefix = rand_tokens(16, seed=7)
    a, b = prefix + [5], prefix + [6, 7, 8]
    max_ref = 0
    bm = engine.block_manager
    orig = engine.scheduler.schedule

    def schedule():
        nonlocal max_ref
        chunks = orig()
        max_ref = max(max_ref, max(bm.ref_count))
        return chunks

    engine.scheduler.schedule = schedule
    out_a, out_b = engine.generate([a, b], GREEDY)
    assert max_ref == 2, "the two requests never held a block together"
    assert out_b.stats["num_cached_tokens"] == 16
    assert out_a.stats["num_cached_tokens"] == 0
    assert out_a.token_ids == reference(uncached_engines, bs, a)
    assert out_b.token_ids == reference(uncached_engines, bs, b)
    assert_idle(engine)


def test_cached_blocks_are_evicted_not_leaked(tiny_dir: Path, uncached_engines) -> None:
    bs = 4
    engine = make_engine(tiny_dir, bs, kv_tokens=64)  # 16 blocks; also the context limit
    bm = engine.block_manager
    assert bm.num_blocks == 16
    a = rand_tokens(21, seed=8)  # 21 + 8 tokens: 7 blocks, 7 of them full of computed KV once done
    ref_a = reference(uncached_engines, bs, a)

    (out,) = engine.generate([a], GREEDY)
    assert out.token_ids == ref_a
    assert_idle(engine)
    published = [b for b in range(bm.num_blocks) if bm.block_hashes[b] is not None]
    assert len(published) == (len(a) + GEN - 1) // bs == 7

    # A short request takes never-used / uncached blocks first: a's prefix survives it.
    (short,) = engine.generate([rand_tokens(3, seed=9)], GREEDY)
    assert short.stats["num_cached_tokens"] == 0
    assert_idle(engine)
    (again,) = engine.generate([a], GREEDY)
    assert again.stats["num_cached_tokens"] == 20
    assert again.token_ids == ref_a
    assert_idle(engine)

    # Requests that need (almost) the whole pool reclaim every cached block.
    for seed in (10, 11, 12):
        p = rand_tokens(50, seed=seed)
        (o,) = engine.generate([p], GREEDY)
        assert o.stats["num_cached_tokens"] == 0
        assert o.token_ids == reference(uncached_engines, bs, p)
        assert_idle(engine)
        assert len(bm.hash_to_block) <= bm.num_blocks
    (last,) = engine.generate([a], GREEDY)
    assert last.stats["num_cached_tokens"] == 0
    assert last.token_ids == ref_a
    assert_idle(engine)


def test_many_requests_churn_pool(tiny_dir: Path, uncached_engines) -> None:
    """Many overlapping-prefix requests through a small pool, batched: correct outputs and a clean pool."""
    bs = 4
    engine = make_engine(tiny_dir, bs, kv_tokens=96, max_num_batched_tokens=24)
    base = rand_tokens(24, seed=13)
    prompts = [base[: 8 + 4 * (i % 4)] + rand_tokens(1 + i, seed=100 + i) for i in range(8)]
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference(uncached_engines, bs, p)
    assert sum(o.stats["num_cached_tokens"] for o in outs) > 0
    assert_idle(engine)
