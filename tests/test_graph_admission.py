"""Graph-aware admission (Scheduler.graph_fits): prompts that would take a step out of every CUDA graph wait one
step, once, where they then fit one graph together; nothing else changes. The graphs are the served default's
shapes (decode up to 64 sequences, extends up to 512 tokens, 16 sequences past 128 tokens)."""

from __future__ import annotations

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import Sequence
from tokenrouter.runner.cuda_graph import graph_shapes, pick_shape
from tokenrouter.sampling_params import SamplingParams

SHAPES = graph_shapes(64, 512, 256)


def _holds(num_seqs: int, num_tokens: int) -> bool:
    return pick_shape(SHAPES, num_seqs, num_tokens) is not None


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), n, SamplingParams(temperature=0.0))


def _scheduler(graphs: bool, budget: int = 2048) -> Scheduler:
    sched = Scheduler(BlockManager(num_blocks=512, block_size=16, enable_prefix_caching=False), 256, budget)
    sched.graph_fits = _holds if graphs else None
    return sched


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, pretend the step ran (each sampling row gets a token), return (request, tokens) per chunk."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
        if c.seq.num_computed_tokens == c.seq.num_tokens:
            c.seq.token_ids.append(7)
    return [(c.seq.request_id, c.num_new_tokens) for c in chunks]


def _decoding(sched: Scheduler) -> Sequence:
    seq = _seq("dec", 40)
    sched.add(seq)
    _step(sched)  # its prefill
    return seq


def test_a_burst_of_prompts_runs_as_two_graph_steps() -> None:
    """A decoding row and seven 100-token prompts (701 tokens: past the 512-token graphs): five prompts join the
    decode (501 tokens, a graph); the other two follow in the next step (a graph again)."""
    sched = _scheduler(graphs=True)
    _decoding(sched)
    for i in range(7):
        sched.add(_seq(f"p{i}", 100))
    first = _step(sched)
    assert first == [("dec", 1)] + [(f"p{i}", 100) for i in range(5)]
    assert _holds(len(first), sum(n for _, n in first)) and sched.num_graph_waits == 1
    second = _step(sched)
    assert [r for r, _ in second] == ["dec"] + [f"p{i}" for i in range(7)]
    assert second[-2:] == [("p5", 100), ("p6", 100)] and _holds(len(second), sum(n for _, n in second))


def test_without_graphs_admission_is_unchanged() -> None:
    sched = _scheduler(graphs=False)
    _decoding(sched)
    for i in range(7):
        sched.add(_seq(f"p{i}", 100))
    assert len(_step(sched)) == 8 and sched.num_graph_waits == 0


def test_no_wait_where_the_next_step_holds_no_graph_either() -> None:
    """A wait must buy a graph step: a prompt no graph holds beside the decoding row (600 tokens), a queue of
    prompts too big for one graph together (six of 300: admitted at once, one eager step, not six graph steps one
    prompt each), or more rows than the big graphs hold (20 decoding rows beside a 200-token prompt)."""
    sched = _scheduler(graphs=True)
    _decoding(sched)
    sched.add(_seq("long", 600))
    assert _step(sched) == [("dec", 1), ("long", 600)]
    sched = _scheduler(graphs=True)
    _decoding(sched)
    for i in range(6):
        sched.add(_seq(f"p{i}", 300))
    assert len(_step(sched)) == 7
    sched = _scheduler(graphs=False)
    for i in range(20):
        sched.add(_seq(f"d{i}", 10))
    _step(sched)
    sched.graph_fits = _holds
    sched.add(_seq("p", 200))
    assert _step(sched)[-1] == ("p", 200)
    assert sched.num_graph_waits == 0


def test_a_group_waits_once() -> None:
    """The prompt that waited is admitted next step even where that step again has no graph room for it (a request
    returning with a 400-token extend), rather than wait again."""
    sched = _scheduler(graphs=True)
    _decoding(sched)
    for i in range(4):
        sched.add(_seq(f"p{i}", 150))
    first = _step(sched)  # dec + p0, p1, p2 (451 tokens); p3 (150) waits
    assert [r for r, _ in first] == ["dec", "p0", "p1", "p2"] and sched.num_graph_waits == 1
    back = _seq("back", 420)  # its first 20 tokens cached, 400 new: (5 rows, 404 tokens) still fits a graph
    back.num_computed_tokens = 20
    assert sched.bm.ensure(back, 420)
    back.status = back.status.RUNNING
    sched.running.append(back)
    second = _step(sched)
    assert second[-2:] == [("back", 400), ("p3", 150)] and sched.num_graph_waits == 1
    assert not any(s.waited_for_graph for s in sched.running)  # admitted: a later admission may wait again


def test_a_chunk_of_a_longer_prompt_does_not_wait() -> None:
    """With a token budget below the graphs' (300), a prompt of 400 beside a decoding row runs its first 299
    tokens at once: next step it would be cut into chunks too (eager), so waiting buys nothing."""
    sched = _scheduler(graphs=True, budget=300)
    _decoding(sched)
    sched.add(_seq("p", 400))
    assert _step(sched) == [("dec", 1), ("p", 299)] and sched.num_graph_waits == 0


def test_nothing_to_keep_in_a_graph() -> None:
    """A prompt no graph holds, admitted into an empty step, makes it eager: what joins it costs no graph."""
    sched = _scheduler(graphs=True)
    sched.add(_seq("long", 600))
    sched.add(_seq("short", 100))
    assert _step(sched) == [("long", 600), ("short", 100)]
    assert sched.num_graph_waits == 0


def test_a_prompt_that_keeps_the_graph_is_admitted() -> None:
    sched = _scheduler(graphs=True)
    _decoding(sched)
    sched.add(_seq("p", 100))
    assert _step(sched) == [("dec", 1), ("p", 100)] and sched.num_graph_waits == 0
