"""Warm-up before a model reports ready: no request pays for a kernel compile.

CUDA graphs are captured at start (runner/cuda_graph.py), and their warm-up compiles the kernels they hold.
Steps that run eagerly do not replay a graph: prefills, chunked prefills, batches mixing a prefill with
decoding rows, extends larger than the captured shapes, sampled (non-greedy) rows. Triton compiles a kernel
the first time it meets a new specialization (its constexprs, and whether an integer argument is 1 or a
multiple of 16), which costs seconds. Measured on one H200 (perf/results/timeline_h200_2026-12-02): the first
8 requests of a fresh server had a TTFT p99 of 3.2 s against 16 ms at p50.

So a subserver runs throwaway sequences through its real runner, scheduler and sampler before it serves:
prefills of mixed lengths (up to 16 rows), extends over cached context as a returning request brings them,
a prefill arriving while others decode, a prompt chunked over several steps (long context: split
attention), and a seeded sampled row; and before its first step it compiles every attention kernel variant
(runner.precompile), since these batches cannot meet each split count. Nothing is routed or committed, no
event leaves and no block is registered for prefix caching; afterwards every block is free again and the
counters (step statistics, which the threshold tuner reads; forwarded tokens; graph replays) start from zero.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.runner.forward_batch import ScheduledChunk
from tokenrouter.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenrouter.engine.subserver import Subserver

log = logging.getLogger(__name__)

# Where a step of whole prompts runs this many times slower eagerly than replayed from its CUDA graph, admission
# makes the newcomers that would push a step out of the graphs wait one step where they then fit one graph
# (Scheduler.graph_fits): they pay about one graph step more, and the step they would have joined saves more.
EAGER_PENALTY = 2.0
GREEDY = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=0)


def warm_up(sub: Subserver, max_seqs: int = 16) -> float:
    """Run the shapes `sub` meets when serving through its forward pass and sampler; returns the seconds it
    took. Leaves no sequence, no held or cached KV block and no counters behind."""
    t0 = time.perf_counter()
    rng = random.Random(0)
    vocab = sub.runner.arch.vocab_size
    bm = sub.block_manager
    budget = sub.scheduler.max_num_batched_tokens
    # Room for a few decode steps after the longest prompt (no stop rule runs here), and a pool that keeps
    # three quarters free for the other sequences.
    limit = max(1, min(sub.runner.max_model_len - 8, bm.num_free_blocks * bm.block_size // 4))
    seqs: list[Sequence] = []
    compiled = False

    def add(length: int, params: SamplingParams = GREEDY) -> Sequence:
        length = max(1, min(length, limit))
        seq = Sequence(f"warm-up-{len(seqs)}", [rng.randrange(vocab) for _ in range(length)], length, params)
        if params.seed is not None:
            seq.generator = torch.Generator(device=sub.runner.device).manual_seed(params.seed)
        seqs.append(seq)
        sub.scheduler.add(seq)
        return seq

    def run(steps: int) -> None:
        nonlocal compiled
        for _ in range(steps):
            if not _step(sub, precompile=not compiled):
                return
            compiled = True

    try:
        # Prefills of mixed lengths in one batch (1, multiples of 16 and not), then decoding them.
        n = max(1, min(max_seqs, sub.scheduler.max_num_seqs, limit // 128))
        lengths = [1, 5, 16, 37, 64, 100, 128, 257]
        batch = [add(lengths[i % len(lengths)] + 3 * (i // len(lengths)), SAMPLED if i == 1 else GREEDY)
                 for i in range(n)]
        run(4)
        # A request returning from another model: an extend over its cached context, next to decoding rows.
        for seq in batch[: max(1, n // 2)]:
            if not seq.is_finished and seq.num_tokens + 9 < sub.runner.max_model_len - 1:
                seq.token_ids.extend(rng.randrange(vocab) for _ in range(9))
        run(2)
        # A new prompt while the others decode (a mixed batch), and a lone prefill.
        add(77)
        run(2)
        _finish(sub, seqs)
        add(45)
        run(2)
        _finish(sub, seqs)
        # A prompt longer than one step's token budget: chunked prefill over cached context, then decoding
        # with a long context (split attention).
        long = add(2 * budget + 7)
        run(-(-long.num_prompt_tokens // budget) + 2)
        _finish(sub, seqs)
        try:
            _graph_admission(sub, rng)
        except Exception as e:  # the kernels are warm: serving goes on with admission as before
            if "CUDA error" in str(e):
                raise  # the device context is lost (the subserver refuses to serve)
            log.warning("%s: graph-aware admission not measured (%s: %s); it stays off", sub.name,
                        type(e).__name__, e)
    finally:
        _finish(sub, seqs)
        sub.stats = StepStats()
        sub.num_steps = 0
        sub.scheduler.num_preemptions = sub.scheduler.num_reclaims = 0
        sub.scheduler.num_graph_waits = 0
        sub.runner.num_forwarded_tokens = 0
        if sub.runner.graphs is not None:
            sub.runner.graphs.num_replays = 0
    seconds = time.perf_counter() - t0
    log.info("%s: warm-up in %.1f s", sub.name, seconds)
    return seconds


def _graph_admission(sub: Subserver, rng: random.Random) -> None:
    """Time a step of whole prompts (up to four) with as many tokens as the largest captured extend graph holds,
    replayed and eagerly (best of three each: served, another model may be warming up on the same GPU); where
    eager costs over EAGER_PENALTY times the replay (a small model: its eager steps are bound by the host's kernel
    launches, perf/results/graphs_prefill_h200_2026-12-02), turn on the scheduler's graph-aware admission. A
    large model's eager prefill is bound by the GPU's work and keeps admitting as before. The figures and the
    decision go to `sub.graph_admission` (the served model logs them with its warm-up time)."""
    graphs = sub.runner.graphs
    captured = [s for s, _ in (graphs.graphs if graphs is not None else ()) if s.has_extend]
    if not captured:
        return
    shape = max(captured, key=lambda s: (s.num_tokens, s.num_seqs))
    k = min(4, shape.num_seqs)
    length = min(shape.num_tokens // k, sub.runner.max_model_len - 1)
    vocab = sub.runner.arch.vocab_size
    seqs = [Sequence(f"warm-up-graph-{i}", [rng.randrange(vocab) for _ in range(length)], length, GREEDY)
            for i in range(k)]
    bm = sub.block_manager
    try:
        if length < 2 or not all(bm.ensure(seq, length) for seq in seqs):
            return
        chunks = [ScheduledChunk(seq, length) for seq in seqs]
        best = {False: float("inf"), True: float("inf")}
        with sub.runner.stream_context():
            for eager in (False, True) * 3:
                torch.cuda.synchronize(sub.runner.device)
                t0 = time.perf_counter()
                sub.runner.forward(chunks, eager=eager)
                torch.cuda.synchronize(sub.runner.device)
                best[eager] = min(best[eager], time.perf_counter() - t0)
    finally:
        for seq in seqs:
            bm.release(seq)
    on = best[True] > EAGER_PENALTY * best[False]
    if on:
        sub.scheduler.graph_fits = graphs.holds
    sub.graph_admission = (f"graph-aware admission {'on' if on else 'off'} (a step of {k} x {length} prompt tokens: "
                           f"{best[True] * 1e3:.2f} ms eagerly, {best[False] * 1e3:.2f} ms in its graph)")
    log.info("%s: %s", sub.name, sub.graph_admission)


def _step(sub: Subserver, precompile: bool = False) -> bool:
    """One forward pass over what the scheduler picks, its tokens appended (greedy or sampled as each row
    asks), nothing routed or committed. False when nothing was scheduled. `precompile`: first compile every
    attention kernel variant (the batches below cannot meet each of them)."""
    chunks = sub.scheduler.schedule()
    if not chunks:
        return False
    run_chunks(sub, chunks, precompile)
    return True


def run_chunks(sub: Subserver, chunks: list[ScheduledChunk], precompile: bool = False) -> None:
    """`_step`'s forward pass over `chunks` (what the scheduler picked): tokens appended, nothing routed."""
    if precompile and sub.runner.device.type == "cuda":  # nothing compiles on the CPU (the interpreter runs)
        log.info("%s: %d attention kernel variants compiled", sub.name, sub.runner.precompile(chunks))
    sampling = [c.seq for c in chunks if c.samples]
    with sub.runner.stream_context():
        out = sub.runner.forward(chunks)
        _, tokens, _, finite = sub._sample(out, sampling)
    for c in chunks:  # (blocks are not registered for prefix caching: no later request should match them)
        c.seq.num_computed_tokens += c.num_new_tokens
    if sampling and not bool(finite.all()):  # a model that cannot compute must not report ready
        raise NonFiniteLogits(f"{sub.name}: non-finite logits in the warm-up (rows of "
                              f"{[c.num_new_tokens for c in chunks]} new tokens): the model or the GPU is faulty")
    if sampling:
        for seq, tok in zip(sampling, tokens.tolist()):
            seq.token_ids.append(tok)
            if seq.num_tokens >= sub.runner.max_model_len - 1:  # no room for another position
                sub.scheduler.finish(seq)


class NonFiniteLogits(RuntimeError):
    """The warm-up met logits that are not finite: the model is not fit to serve."""


def _finish(sub: Subserver, seqs: list[Sequence]) -> None:
    for seq in seqs:
        if not seq.is_finished:
            sub.scheduler.finish(seq)
