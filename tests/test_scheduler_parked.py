"""The scheduler keeps a parked request's KV (it is in flight on another model and comes back) rather than
giving it to a newcomer: under a pool smaller than the working set, evicting it makes every return a whole
re-prefill that evicts the next (a review saw 8 long prompts stall the served default). Only an older request
(Sequence.age) takes a parked one's blocks (tests/test_kv_age_order.py); a new request never does."""

from __future__ import annotations

import itertools

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import Sequence
from tokenrouter.sampling_params import SamplingParams

_ARRIVALS = itertools.count()


def _seq(rid: str, n: int) -> Sequence:
    """Stamped as a router would: one made later is younger."""
    seq = Sequence(rid, list(range(1, n + 1)), n, SamplingParams(temperature=0.0))
    seq.arrival = next(_ARRIVALS)
    return seq


def _run(sched: Scheduler) -> None:
    """Pretend the scheduled chunks ran."""
    for chunk in sched.schedule():
        chunk.seq.num_computed_tokens += chunk.num_new_tokens


def test_newcomer_waits_for_running_requests_instead_of_evicting_a_parked_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    parked, running, newcomer = _seq("parked", 12), _seq("running", 12), _seq("new", 12)
    for s in (parked, running):
        sched.add(s)
    _run(sched)
    sched.park(parked)  # 3 blocks kept for its return; 3 more held by `running`; 2 free
    sched.add(newcomer)  # needs 3
    assert all(c.seq is not newcomer for c in sched.schedule())
    assert parked.block_table and newcomer.status.value == "waiting"

    sched.finish(running)  # blocks free up: the newcomer gets in, the parked request keeps its KV
    _run(sched)
    assert newcomer.status.value == "running" and parked.block_table


def test_with_nothing_running_an_older_request_takes_parked_blocks_a_younger_one_waits() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    parked, younger = _seq("parked", 12), _seq("younger", 12)
    sched.add(parked)
    _run(sched)
    sched.park(parked)
    sched.add(younger)
    _run(sched)
    assert younger.status.value == "waiting" and parked.block_table and sched.num_reclaims == 0
    sched.finish(younger)

    older = _seq("older", 12)
    older.arrival = -1  # (stamped before `parked`)
    sched.add(older)
    _run(sched)
    assert older.status.value == "running" and not parked.block_table
    assert sched.num_reclaims == 1 and sched.num_preemptions == 0  # counted apart: the parked one was not running


def test_a_new_request_waits_for_parked_requests_to_come_back_and_finish() -> None:
    """A request held by no model yet (its first arrival at the entry model) never takes parked blocks, even with
    nothing running here: the parked requests are in the system and finish without it. Served on the CPU, 6
    prompts of ~4,000 tokens into pools of 16,384 had new requests evict parked ones whenever every admitted request
    was at the other model; each then came back to a whole re-prefill that evicted the next (46 and 51 such
    reclaims on the two models in 218 s; perf/results/kv_reclaims_cpu_2026-12-06)."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    parked, new = _seq("parked", 12), _seq("new", 12)
    new.arrival = -1  # (even stamped before it: another router, whose clock runs behind)
    sched.add(parked, new_request=True)
    _run(sched)
    sched.park(parked)  # 3 blocks kept; 1 free: room for the new request's first chunk, not its prompt
    sched.add(new, new_request=True)
    for _ in range(3):
        assert all(c.seq is not new for c in sched.schedule())
    assert parked.block_table and new.status.value == "waiting"
    assert sched.num_reclaims == 0
    sched.resume(parked)  # back with its KV: it finishes, and then the new request gets in
    _run(sched)
    sched.finish(parked)
    _run(sched)
    assert new.status.value == "running" and new.num_computed_tokens == 12


def test_a_new_request_with_an_empty_pool_is_admitted_chunk_by_chunk() -> None:
    """Nothing parked and nothing running: a new request larger than one step's budget still goes in (its first
    chunk), as before."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    new = _seq("new", 24)
    sched.add(new, new_request=True)
    _run(sched)
    assert new.status.value == "running" and new.num_computed_tokens == 8


def test_new_requests_are_admitted_while_the_requests_in_the_system_fit_the_budget() -> None:
    """kv_budget: the smallest pool of the other models. The entry model's own pool holds three requests of 12
    tokens, the budget (the large model's pool) two: the third waits until one finishes, though the pool here
    has room for it, even with the other two parked here (at the other model)."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    sched.kv_budget = 24  # 6 blocks
    a, b, c = _seq("a", 12), _seq("b", 12), _seq("c", 12)
    for s in (a, b, c):
        sched.add(s, new_request=True)
    _run(sched)
    assert a.status.value == b.status.value == "running" and c.status.value == "waiting"
    sched.park(a)
    sched.park(b)
    _run(sched)
    assert c.status.value == "waiting" and a.block_table and b.block_table and sched.num_reclaims == 0
    sched.resume(a)
    sched.finish(a)
    _run(sched)
    assert c.status.value == "running"
    # Alone in the system a new request goes in whatever its size (a prompt no pool holds fails where it does not
    # fit).
    sched.finish(b)
    sched.finish(c)
    big = _seq("big", 40)
    sched.add(big, new_request=True)
    _run(sched)
    assert big.status.value == "running"


def test_a_prefix_the_requests_share_counts_once_in_the_budget() -> None:
    """Requests sharing a cached prefix hold its blocks once, here as on any model caching prefixes: 6 requests of
    a 40-token shared prefix and 8 tokens of their own take 10 + 6 x 2 = 22 blocks, within a budget of 30, though
    each alone is 12 (72 counted apart)."""
    bm = BlockManager(num_blocks=128, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    sched.kv_budget = 120  # 30 blocks
    shared = list(range(1000, 1040))
    seqs = [Sequence(f"r{i}", shared + [i] * 8, 48, SamplingParams(temperature=0.0)) for i in range(6)]
    sched.add(seqs[0], new_request=True)
    for c in sched.schedule():
        c.seq.num_computed_tokens += c.num_new_tokens
        bm.register_full_blocks(c.seq)
    for s in seqs[1:]:
        sched.add(s, new_request=True)
    _run(sched)
    assert all(s.status.value == "running" for s in seqs)
    assert len({b for s in seqs for b in s.block_table}) == 22


def test_a_return_that_must_prefill_again_goes_ahead_of_new_requests_the_budget_holds() -> None:
    """A parked request whose blocks were taken back returns and must prefill again. New requests at the head of
    the queue wait for the budget, which waits for that very request to finish: it goes ahead of them (queued
    behind them it never ran again, and the whole model stopped; a hostile trial, 2026-12-06)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    sched.kv_budget = 32  # 8 blocks
    back = _seq("back", 24)
    sched.add(back, new_request=True)
    _run(sched)
    sched.park(back)
    older = _seq("older", 4)
    older.arrival = -1
    assert sched._reclaim_parked(older)  # (taken for an older one: it holds no blocks now, 6 to compute on return)
    back.num_computed_tokens = 0
    new = [_seq(f"new{i}", 12) for i in range(2)]
    for s in new:
        sched.add(s, new_request=True)
    _run(sched)
    assert all(s.status.value == "waiting" for s in new)  # 6 + 3 blocks > 8: held for the budget
    sched.resume(back)
    assert [s.request_id for s in sched.waiting] == ["back", "new0", "new1"]
    _run(sched)
    assert back.status.value == "running" and back.num_computed_tokens == 24
