"""Age order under KV pressure (engine/scheduler.py): a request takes KV blocks only from younger ones. Requests
that together outgrow the pools used to take each other's blocks on every return and prefill again each time
(four long greedy requests on two 2,048-token pools: two of them crawled at ~5 tokens/s with ~9 reclaims/s per
model, none failing). Now the oldest always progresses and the younger wait for it."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from test_routing_vs_naive import assert_all_free
from tokenrouter import Engine
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import UNKNOWN_ARRIVAL, Sequence
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.serving.subserver_model import SubserverModel
from tokenrouter.transport.messages import Arrive, Handoff

POLICY = {"name": "random", "p": 0.3, "seed": 0}


def _engine(tiny: Path, kv_tokens: int) -> Engine:
    return Engine.from_config({
        "models": {m: {"path": str(tiny / m), "kv_cache_tokens": kv_tokens, "block_size": 4}
                   for m in ("small", "large")},
        "entry": "small", "policy": POLICY, "batching": {"thresholds": 1},
    })


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, engine.vocab_size, (16,), generator=g).tolist() for _ in range(n)]


def test_requests_outgrowing_the_pools_finish_without_taking_each_others_blocks(tiny_dir: Path) -> None:
    """Four greedy requests that each grow to the pools' size (512 tokens), with a loop per model as served: every
    one runs to the length limit with the tokens it makes with room to spare, and blocks change hands a few times
    (the old rule: ~700 reclaims on the two models; it is stopped after 120 s if it crawls)."""
    params = SamplingParams(max_new_tokens=600, temperature=0.0, ignore_eos=True)
    roomy = _engine(tiny_dir, 8192)
    prompts = _prompts(roomy, 4)
    reference = [o.token_ids for o in roomy.generate(prompts, params)]
    roomy.shutdown()

    engine = _engine(tiny_dir, 512)
    engine.start()  # (in stepped mode the models take turns, and the old rule reclaimed only a few times)
    outs: list = []
    worker = threading.Thread(target=lambda: outs.extend(engine.generate(prompts, params)), daemon=True)
    worker.start()
    worker.join(120)
    reclaims = {m: s.scheduler.num_reclaims for m, s in engine.subservers.items()}
    assert not worker.is_alive(), f"still generating after 120 s; KV reclaims so far: {reclaims}"
    # The deployment's length limit: the smallest pool, 512 tokens (16 of them the prompt's).
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 496)] * 4
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref[:496]
    assert sum(reclaims.values()) <= 24, reclaims
    engine.shutdown()
    assert_all_free(engine)


def _seq(rid: str, n: int, arrival: int) -> Sequence:
    seq = Sequence(rid, list(range(1, n + 1)), n, SamplingParams(temperature=0.0))
    seq.arrival = arrival
    return seq


def _run(sched: Scheduler) -> list[str]:
    """Pretend the scheduled chunks ran; the ids scheduled."""
    chunks = sched.schedule()
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
    return [c.seq.request_id for c in chunks]


def _grow(seq: Sequence, n: int) -> None:
    seq.token_ids.extend([7] * n)


def test_a_younger_request_preempts_itself_rather_than_take_an_older_ones_blocks() -> None:
    """The near-stall's step: a running request out of blocks took the parked (older) request's; now it goes back
    to the queue itself, and the older one finds its KV on return."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    older, younger = _seq("older", 12, 0), _seq("younger", 12, 1)
    for s in (older, younger):
        sched.add(s)
    _run(sched)
    sched.park(older)
    _grow(younger, 1)  # needs a 4th block: none free
    assert _run(sched) == []
    assert older.block_table and not younger.block_table and younger.status.value == "waiting"
    assert (sched.num_reclaims, sched.num_preemptions) == (0, 1)
    sched.resume(older)
    _grow(older, 1)
    assert _run(sched) == ["older"]  # (the younger one waits: 4 blocks would not leave the older one's owed)


def test_an_older_request_takes_the_youngest_parked_requests_blocks_first() -> None:
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = _seq("a", 12, 0), _seq("b", 12, 1), _seq("c", 12, 2)
    for s in (c, b, a):  # (added youngest first: the order of arrival here is not the age)
        sched.add(s)
    _run(sched)
    assert [s.request_id for s in sched.running] == ["a", "b", "c"]  # running oldest first
    sched.park(c)
    sched.park(b)  # parked longest: c
    _grow(a, 1)
    assert _run(sched) == ["a"]
    assert c.block_table == [] and b.block_table and sched.num_reclaims == 1


def test_a_request_in_the_system_takes_younger_parked_blocks_only_where_that_makes_room() -> None:
    """A request in the system waiting for blocks (a first visit from another model, a return whose blocks were
    taken) takes the blocks of younger parked requests, even while others run here; but none where all it may take
    would still not make room (blocks taken for nothing would cost their owners a prefill)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    oldest, young = _seq("oldest", 12, 0), _seq("young", 12, 2)
    for s in (oldest, young):
        sched.add(s)
    _run(sched)
    sched.park(young)  # 3 + 3 blocks held, 2 free
    visitor = _seq("visitor", 12, 1)  # needs 3
    sched.add(visitor)
    assert _run(sched) == ["visitor"] and not young.block_table and sched.num_reclaims == 1

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    oldest, mid, young = _seq("oldest", 12, 0), _seq("mid", 12, 1), _seq("young", 4, 3)
    for s in (oldest, mid, young):
        sched.add(s)
    _run(sched)
    sched.park(mid)
    sched.park(young)  # 3 + 3 + 1 held, 1 free
    visitor = _seq("visitor", 12, 2)  # needs 3: 1 free + young's 1 is not enough, and mid is older
    sched.add(visitor)
    assert _run(sched) == [] and young.block_table and mid.block_table and sched.num_reclaims == 0
    sched.resume(mid)
    sched.finish(mid)  # 4 free
    assert _run(sched) == ["visitor"] and young.block_table and sched.num_reclaims == 0


def test_the_arrival_number_travels_with_every_handoff(tiny_dir: Path) -> None:
    """The router numbers requests as they arrive; each model ranks a request by that number, and hands it on with
    its handoffs. A message without one ranks after every numbered request; a model refuses a malformed one off its
    socket (that request alone fails, saying why)."""
    engine = _engine(tiny_dir, 8192)
    handoffs: list[Arrive] = []
    emit = engine._emit

    def spy(ev) -> None:  # noqa: ANN001
        if isinstance(ev, Handoff):
            handoffs.append(ev.arrive)
        emit(ev)

    for sub in engine.subservers.values():
        sub.emit = spy
    prompts = _prompts(engine, 3)
    engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert handoffs and {a.arrival for a in handoffs} <= {0, 1, 2}
    small = engine.subservers["small"]
    small.handle(Arrive("unnumbered", [5, 6], True, 2, SamplingParams()))
    assert small.seqs["unnumbered"].arrival == UNKNOWN_ARRIVAL > max(a.arrival for a in handoffs)
    engine.shutdown()

    model = SimpleNamespace(sub=small)  # (SubserverModel._check reads only the subserver's vocabulary)
    for bad in ("3", -1, True, 1.5):
        problem = SubserverModel._check(model, Arrive("r", [5, 6], True, 2, SamplingParams(), arrival=bad))
        assert problem == f"arrival {bad!r} must be an integer >= 0"
    assert SubserverModel._check(model, Arrive("r", [5, 6], True, 2, SamplingParams(), arrival=7)) is None
