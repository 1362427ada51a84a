"""The warm-up before a model reports ready (engine/warmup.py) runs prefills, extends, mixed, sampled and
chunked batches through the real runner, and leaves nothing behind: no sequence, no held KV block, no step
statistics (the threshold tuner reads them), and the routed output of later requests is what it would have
been without it. On the CPU it runs only when called (nothing compiles there); on a GPU every subserver
runs it before it serves."""

from __future__ import annotations

import time
from pathlib import Path

from test_routing_vs_naive import CASES, MAX_NEW, assert_all_free, make_engine, prompts_for
from tokenrouter import SamplingParams
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.engine.warmup import warm_up


def test_warm_up_leaves_nothing_behind_and_output_unchanged(tiny_dir: Path) -> None:
    models, policy = CASES["r2r"]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    cold = make_engine(tiny_dir, models, policy)
    prompts = prompts_for(cold.vocab_size)
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    cold.shutdown()

    warm = make_engine(tiny_dir, models, policy)
    forwarded = {}
    for name, sub in warm.subservers.items():
        calls = []
        orig = sub.runner.forward
        sub.runner.forward = lambda chunks, orig=orig, calls=calls: calls.append(
            (len(chunks), sum(c.num_new_tokens for c in chunks), sum(c.num_new_tokens > 1 for c in chunks))
        ) or orig(chunks)
        budget = sub.scheduler.max_num_batched_tokens
        sub.scheduler.max_num_batched_tokens = 128  # the test's KV pool (2,048 tokens) holds no longer prompt
        t_start = time.monotonic()
        assert warm_up(sub) >= 0.0
        sub.runner.forward, sub.scheduler.max_num_batched_tokens = orig, budget
        # What it ran: a batch of several prefills, single-token rows beside multi-token ones (extends next to
        # decodes), and a prompt longer than one step's token budget (chunked over several steps).
        assert any(n > 1 and extends > 1 for n, _, extends in calls), calls
        assert any(0 < extends < n for n, _, extends in calls), calls
        assert any(t == 128 for _, t, _ in calls), calls
        assert not sub.seqs and not sub.scheduler.has_work() and not sub.scheduler.parked
        assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks, name
        assert sub.num_steps == 0 and sub.runner.num_forwarded_tokens == 0
        got_stats, fresh = sub.stats.snapshot(), StepStats().snapshot()
        assert got_stats["recent"]["steps"] == [] and got_stats["recent"]["since"] >= t_start  # (a record from then on)
        assert {**got_stats, "recent": None} == {**fresh, "recent": None}
        forwarded[name] = len(calls)
    assert all(forwarded.values())

    got = [o.token_ids for o in warm.generate(prompts, params)]
    assert got == expected
    assert_all_free(warm)
    warm.shutdown()


def test_warm_up_stays_inside_small_limits(tiny_dir: Path) -> None:
    """A short context, a small step budget, one sequence at a time and a small pool: the warm-up never runs a
    position past the context (no stop rule applies to its rows), and still leaves nothing behind, nothing
    cached for prefix matching either."""
    from conftest import make_engine as single_engine

    for overrides in ({"max_model_len": 64, "max_num_batched_tokens": 32},
                      {"max_num_seqs": 1, "kv_cache_tokens": 256, "max_num_batched_tokens": 16}):
        engine = single_engine(tiny_dir, "small", **overrides)
        sub = engine.entry
        positions: list[int] = []
        orig = sub.runner.forward
        sub.runner.forward = lambda chunks, orig=orig, positions=positions: positions.extend(
            c.seq.num_computed_tokens + c.num_new_tokens for c in chunks) or orig(chunks)
        warm_up(sub)
        assert positions and max(positions) <= sub.runner.max_model_len, overrides
        assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks
        assert not sub.block_manager.hash_to_block and not sub.scheduler.has_work()
        assert sub.scheduler.num_preemptions == 0
        engine.shutdown()
