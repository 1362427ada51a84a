"""Age order under KV pressure (engine/scheduler.py): a request takes KV blocks only from younger ones. Requests
that together outgrow the pools used to take each other's blocks on every return and prefill again each time
(four long greedy requests on two 2,048-token pools: two of them crawled at ~5 tokens/s with ~9 reclaims/s per
model, none failing). Now the oldest always progresses and the younger wait for it."""

from __future__ import annotations

import threading
import time
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


def _seq(rid: str, n: int, arrival: int, first: int = 1) -> Sequence:
    seq = Sequence(rid, list(range(first, first + n)), n, SamplingParams(temperature=0.0))
    seq.arrival = arrival
    return seq


def _run(sched: Scheduler) -> list[str]:
    """Pretend the scheduled chunks ran; the ids scheduled."""
    chunks = sched.schedule()
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
        sched.bm.register_full_blocks(chunk.seq)
    return [c.seq.request_id for c in chunks]


def _loaded(num_blocks: int, *seqs: Sequence, caching: bool = False) -> Scheduler:
    """A scheduler over a pool of `num_blocks` blocks of 4 tokens, `seqs` added (in that order) and one step run."""
    sched = Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=caching), 8, 64)
    for s in seqs:
        sched.add(s)
    _run(sched)
    return sched


def _grow(seq: Sequence, n: int) -> None:
    seq.token_ids.extend([7] * n)


def test_a_younger_request_preempts_itself_rather_than_take_an_older_ones_blocks() -> None:
    """The near-stall's step: a running request out of blocks took the parked (older) request's; now it goes back
    to the queue itself, and the older one finds its KV on return."""
    older, younger = _seq("older", 12, 0), _seq("younger", 12, 1)
    sched = _loaded(6, older, younger)
    sched.park(older)
    _grow(younger, 1)  # needs a 4th block: none free
    assert _run(sched) == []
    assert older.block_table and not younger.block_table and younger.status.value == "waiting"
    assert (sched.num_reclaims, sched.num_preemptions) == (0, 1)
    sched.resume(older)
    _grow(older, 1)
    assert _run(sched) == ["older"]  # (the younger one waits: 4 blocks would not leave the older one's owed)


def test_an_older_request_takes_the_youngest_parked_requests_blocks_first() -> None:
    a, b, c = _seq("a", 12, 0), _seq("b", 12, 1), _seq("c", 12, 2)
    sched = _loaded(9, c, b, a)  # (added youngest first: the order of arrival here is not the age)
    assert [s.request_id for s in sched.running] == ["a", "b", "c"]  # running oldest first
    sched.park(b)
    sched.park(c)  # parked longest: b (older than c)
    _grow(a, 1)
    assert _run(sched) == ["a"]
    assert c.block_table == [] and b.block_table and sched.num_reclaims == 1


def test_a_request_in_the_system_takes_younger_parked_blocks_only_where_that_makes_room() -> None:
    """A request in the system waiting for blocks (a first visit from another model, a return whose blocks were
    taken) takes the blocks of younger parked requests, even while others run here; but none where all it may take
    would still not make room (blocks taken for nothing would cost their owners a prefill)."""
    oldest, young = _seq("oldest", 12, 0), _seq("young", 12, 2)
    sched = _loaded(8, oldest, young)
    sched.park(young)  # 3 + 3 blocks held, 2 free
    visitor = _seq("visitor", 12, 1)  # needs 3
    sched.add(visitor)
    assert _run(sched) == ["visitor"] and not young.block_table and sched.num_reclaims == 1

    oldest, mid, young = _seq("oldest", 12, 0), _seq("mid", 12, 1), _seq("young", 4, 3)
    sched = _loaded(8, oldest, mid, young)
    sched.park(mid)
    sched.park(young)  # 3 + 3 + 1 held, 1 free
    visitor = _seq("visitor", 12, 2)  # needs 3: 1 free + young's 1 is not enough, and mid is older
    sched.add(visitor)
    assert _run(sched) == [] and young.block_table and mid.block_table and sched.num_reclaims == 0
    sched.resume(mid)
    sched.finish(mid)  # 4 free
    assert _run(sched) == ["visitor"] and young.block_table and sched.num_reclaims == 0


def test_the_youngest_goes_first_whether_parked_or_running() -> None:
    """An older request out of blocks takes them from the youngest request younger than itself: a running one
    (preempted) before a parked one older than it, and never itself while a younger one holds blocks."""
    g, p, y = _seq("g", 12, 0), _seq("p", 12, 1), _seq("y", 12, 2)
    sched = _loaded(9, g, p, y)
    sched.park(p)
    _grow(g, 1)  # a 4th block; y (running, youngest) goes before p (parked, older than y)
    assert _run(sched) == ["g"]
    assert not y.block_table and y.status.value == "waiting" and p.block_table
    assert (sched.num_preemptions, sched.num_reclaims) == (1, 0)


def test_queues_and_running_list_stay_in_age_order() -> None:
    """Running oldest first (a chunk scheduled this step is never preempted for a later one), whatever the order of
    arrival here; the requests in the system wait by age, a preempted one too."""
    a, b, c = _seq("a", 4, 0), _seq("b", 4, 1), _seq("c", 4, 2)
    sched = _loaded(64, b)
    sched.park(b)
    sched.add(c)
    _run(sched)
    sched.add(a)  # admitted after c, older than it
    _run(sched)
    sched.resume(b)  # back after both
    assert [s.request_id for s in sched.running] == ["a", "b", "c"]

    old, mid, young = _seq("old", 8, 0), _seq("mid", 8, 1), _seq("young", 8, 3)
    sched = _loaded(6, old, young)  # 4 blocks held, 2 free
    sched.add(mid)  # needs 2, beside nothing owed: admitted
    _run(sched)
    visitor = _seq("visitor", 8, 2)  # waits: no block free
    sched.add(visitor)
    _grow(old, 4)  # takes a block from the youngest running: young preempted, queued behind the older visitor
    assert _run(sched) == ["old"]
    assert [s.request_id for s in sched.waiting] == ["visitor", "young"]
    sched.add(_seq("early", 8, -1))  # an in-system request older than both joins the queue ahead of them
    assert [s.request_id for s in sched.waiting] == ["early", "visitor", "young"]


def test_a_request_that_cannot_grow_even_taking_all_younger_ones_takes_nothing() -> None:
    """Back with a suffix longer than all it may take beside an older request's KV: it goes back to the queue alone.
    Taken one by one, the younger requests' KV all went for nothing, and they then waited behind it in the queue."""
    o, s, y1, y2, p = (_seq("o", 16, 0), _seq("s", 8, 1, 100), _seq("y1", 8, 2, 200), _seq("y2", 8, 3, 300),
                       _seq("p", 4, 4, 400))
    sched = _loaded(12, o, s, y1, y2, p)  # 4 + 2 + 2 + 2 + 1 blocks, 1 free
    for parked in (o, s, p):
        sched.park(parked)
    _grow(s, 28)  # 7 more blocks; all it may take: 1 free + p's 1 + y1's 2 + y2's 2
    sched.resume(s)
    assert _run(sched) == []
    assert (sched.num_preemptions, sched.num_reclaims) == (1, 0) and not s.block_table
    assert y1.block_table and y2.block_table and p.block_table and o.block_table
    _grow(y1, 1)
    assert _run(sched) == ["y1"]  # the younger ones go on; `s` waits for the older one


def test_nothing_is_taken_back_for_a_request_that_then_waits_for_a_cuda_graph() -> None:
    """A request in the system that would take a younger parked request's KV, but waits a step to keep this step in
    a CUDA graph: it takes nothing before it goes in (the parked one may come back meanwhile)."""
    sched = Scheduler(BlockManager(10, 4, enable_prefix_caching=False), 8, 64)
    sched.graph_fits = lambda num_seqs, num_tokens: num_tokens <= 16
    r, p = _seq("r", 4, 0), _seq("p", 16, 5, 200)
    for s in (r, p):
        sched.add(s)
    _run(sched)
    sched.park(p)  # r 1 block, p 4, 5 free
    _grow(r, 1)
    sched.add(_seq("w", 8, 1, 100))  # 2 blocks; r's growth takes 1: 2 free after
    visitor = _seq("v", 12, 2, 300)  # 3 blocks: p's would make room, but 9 + 12 tokens are out of every graph
    sched.add(visitor)
    assert _run(sched) == ["r", "w"]
    assert sched.num_graph_waits == 1 and sched.num_reclaims == 0 and p.block_table
    assert _run(sched) == ["v"] and sched.num_reclaims == 1  # next step it goes in, whatever the graphs


def test_requests_with_the_same_stamp_rank_alike_on_every_model() -> None:
    """Two requests with the same stamp (two routers, or none), each running on one model with its KV parked on the
    other: ranked by stamp then id, the same on both models, one of them takes the other's blocks and goes on.
    Ranked by order of arrival on each model, each was older where it ran: both preempted themselves for ever."""
    r_a, q_b = _seq("r", 16, 7), _seq("q", 16, 7, first=100)
    a_model, b_model = _loaded(8, r_a, caching=True), _loaded(8, q_b, caching=True)
    for s, model in ((r_a, a_model), (q_b, b_model)):  # each goes to the other model, its KV kept here
        _grow(s, 1)
        model.park(s)
    q_a, r_b = _seq("q", 17, 7, first=100), _seq("r", 17, 7)
    a_model.add(q_a)
    b_model.add(r_b)
    progress = []
    for _ in range(4):
        progress += _run(a_model) + _run(b_model)
        for s in (q_a, r_b):
            if s.status.value == "running" and s.num_computed_tokens == s.num_tokens:
                _grow(s, 1)
    # q ranks older on both (the same stamp, the smaller id): it takes r's KV on the first model; r waits for it.
    assert "q" in progress and "r" not in progress
    assert (a_model.num_reclaims, b_model.num_reclaims) == (1, 0) and q_b.block_table


def test_a_request_that_may_not_take_the_parked_blocks_waits_rather_than_start_again_each_step() -> None:
    """A younger request alone on a model, whose prompt does not fit beside an older parked request's KV: admitted
    chunk by chunk it could not grow and preempted itself every step (prefix caching off: its chunk computed again
    each time). It waits for the older one instead."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    old = _seq("old", 32, 0)
    sched.add(old)
    while old.num_computed_tokens < old.num_tokens:
        _run(sched)
    sched.park(old)  # 8 blocks kept
    young = _seq("young", 40, 1, first=100)  # 10 blocks: 8 free
    sched.add(young)
    for _ in range(5):
        assert _run(sched) == []
    assert sched.num_preemptions == 0 and old.block_table
    sched.resume(old)
    sched.finish(old)
    for _ in range(3):
        _run(sched)
    assert young.num_computed_tokens == 40


def test_a_shared_prefix_is_not_counted_as_room_twice() -> None:
    """A visitor whose cached prefix lies in a younger parked request's blocks: taking those back frees nothing
    for it (the prefix it takes over costs as much again), so with no other room it takes nothing and waits (it
    had taken the younger one's KV for nothing)."""
    old, young = _seq("old", 20, 0, first=500), _seq("young", 12, 2)
    sched = _loaded(8, old, young, caching=True)  # 5 + 3 blocks: none free
    sched.park(young)
    visitor = _seq("visitor", 15, 1)
    visitor.token_ids[12:] = [77, 78, 79]  # its first 12 tokens are young's three blocks
    assert sched.bm.match_prefix(visitor.token_ids) == young.block_table
    sched.add(visitor)
    assert _run(sched) == [] and young.block_table and sched.num_reclaims == 0


def test_the_arrival_stamp_travels_with_every_handoff(tiny_dir: Path) -> None:
    """The router stamps each request as it takes it; each model ranks a request by that stamp, and hands it on with
    its handoffs. A message without one ranks after every stamped request; a model refuses a malformed one off its
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
    before = time.time_ns()
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
           for p in _prompts(engine, 3)]
    while engine.has_unfinished():
        engine.step()
    stamps = {rid: {a.arrival for a in handoffs if a.request_id == rid} for rid in ids}
    assert all(len(v) == 1 for v in stamps.values()), stamps  # one stamp per request, on every handoff
    firsts = [next(iter(stamps[rid])) for rid in ids]
    assert before <= firsts[0] < firsts[1] < firsts[2] <= time.time_ns()
    small = engine.subservers["small"]
    small.handle(Arrive("unnumbered", [5, 6], True, 2, SamplingParams()))
    assert small.seqs["unnumbered"].arrival == UNKNOWN_ARRIVAL > max(firsts)
    engine.shutdown()

    model = SimpleNamespace(sub=small)  # (SubserverModel._check reads only the subserver's vocabulary)
    for bad in ("3", -1, True, 1.5):
        problem = SubserverModel._check(model, Arrive("r", [5, 6], True, 2, SamplingParams(), arrival=bad))
        assert problem == f"arrival {bad!r} must be an integer >= 0"
    assert SubserverModel._check(model, Arrive("r", [5, 6], True, 2, SamplingParams(), arrival=7)) is None
