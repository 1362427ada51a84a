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


def test_a_loop_whose_ready_requests_cannot_be_scheduled_waits_instead_of_spinning(tiny_dir: Path) -> None:
    """A new request waits for KV blocks that only a message can free (every block held by a request parked here
    while the other model runs it): the model's loop then waits for a message (up to 50 ms at a time) rather than
    going round at once. Before, it scheduled nothing thousands of times a second, a core and its process's GIL
    (the reader threads that receive the messages) spent on nothing."""
    import threading
    import time

    from tokenrouter.engine.sequence import Sequence

    engine = _engine(tiny_dir, 64, 1024)
    small = engine.subservers["small"]
    sched, bm = small.scheduler, small.block_manager
    parked = Sequence("parked", list(range(3, 3 + bm.num_blocks * bm.block_size)), 8, SamplingParams())
    assert bm.ensure(parked, parked.num_tokens) and bm.num_free_blocks == 0
    sched.parked[parked.request_id] = parked
    sched.add(Sequence("new", [5, 6, 7], 3, SamplingParams()), new_request=True)
    calls = []
    schedule = sched.schedule
    sched.schedule = lambda: calls.append(1) or schedule()
    stop = threading.Event()
    loop = threading.Thread(target=small.serve_forever, args=(stop,))
    loop.start()
    time.sleep(0.5)
    stop.set()
    small._wake.set()
    loop.join(timeout=5)
    assert not loop.is_alive()
    assert 1 <= len(calls) <= 20, len(calls)
    assert [s.request_id for s in sched.waiting] == ["new"]
    engine.shutdown()


def test_a_model_stops_requests_at_the_deployments_longest_and_refuses_a_return_it_cannot_hold(
        tiny_dir: Path) -> None:
    """Served, a model learns the smallest pool of the deployment from the router (Arrive.max_len) and stops a
    request there. One that came back longer than this model holds anyway (a model that did not know the limit
    yet) fails with the limit, rather than wait for blocks it can never have (a hostile trial, 2026-12-06: a
    request grown past the large model's pool on the small one stopped every request)."""
    from tokenrouter.engine.sequence import SeqStatus
    from tokenrouter.transport.messages import Arrive, Failed

    engine = _engine(tiny_dir, 4096, 1024)
    large = engine.subservers["large"]
    events = []
    large.emit = events.append
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    large.handle(Arrive("r", list(range(3, 103)), True, 100, params, {}, "small", {}, max_len=512))
    assert large.stop.max_model_len == 512
    seq = large.seqs["r"]  # as if it ran here and went back to the small model
    large.scheduler.waiting.remove(seq)
    seq.status = SeqStatus.PARKED
    large.scheduler.parked["r"] = seq
    large.submit(Arrive("r", list(range(3, 1003)), False, 100, params, {}, "small", {}))
    large.drain()
    failed = [e for e in events if isinstance(e, Failed)]
    assert failed and "can hold at most" in failed[0].error, events
    engine.shutdown()
