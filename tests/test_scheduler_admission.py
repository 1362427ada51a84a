"""A newcomer is admitted where the KV pool holds its whole prompt beside what the running sequences still need,
not only its first chunk: long prompts admitted on a first chunk each could not all finish their prefill and
preempted each other."""

from __future__ import annotations

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import Sequence
from tokenrouter.sampling_params import SamplingParams


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), n, SamplingParams(temperature=0.0))


def _step(sched: Scheduler) -> list[str]:
    """One step as if its chunks ran and each finished prompt sampled a token; the ids scheduled."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
        if c.seq.num_computed_tokens == c.seq.num_tokens:
            c.seq.token_ids.append(7)
    return [c.seq.request_id for c in chunks]


def test_chunked_prompts_are_admitted_only_where_they_fit_whole() -> None:
    # A pool of 20 blocks of 4 tokens, prompts of 32 tokens (8 blocks), 24 tokens a step: two fit whole, three not.
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=24)
    seqs = [_seq(f"r{i}", 32) for i in range(3)]
    for s in seqs:
        sched.add(s)
    admitted = set()
    for _ in range(12):
        admitted.update(_step(sched))
        if all(s.num_computed_tokens >= 32 for s in seqs[:2]):
            break
    # The third's first chunk would have fit beside them (as it was admitted before, then preempted): it waited.
    assert admitted == {"r0", "r1"} and sched.num_preemptions == 0
    assert all(s.num_computed_tokens >= 32 for s in seqs[:2]) and seqs[2].status.value == "waiting"
    sched.finish(seqs[0])
    assert "r2" in _step(sched)
    assert sched.num_preemptions == 0


def test_with_nothing_running_a_prompt_larger_than_the_free_pool_still_starts() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    big = _seq("big", 40)  # 10 blocks: more than the pool; its first chunk runs (the engine refuses it earlier)
    sched.add(big)
    assert _step(sched) == ["big"]
