"""The scheduler keeps a parked request's KV (it is in flight on another model and comes back) rather than
giving it to a newcomer, while anything runs here: under a pool smaller than the working set, evicting it
makes every return a whole re-prefill that evicts the next (a review saw 8 long prompts stall the served
default). With nothing running, a newcomer takes parked blocks (no progress otherwise)."""

from __future__ import annotations

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import Sequence
from tokenrouter.sampling_params import SamplingParams


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), n, SamplingParams(temperature=0.0))


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


def test_with_nothing_running_a_newcomer_takes_parked_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    parked, newcomer = _seq("parked", 12), _seq("new", 12)
    sched.add(parked)
    _run(sched)
    sched.park(parked)
    sched.add(newcomer)
    _run(sched)
    assert newcomer.status.value == "running" and not parked.block_table
