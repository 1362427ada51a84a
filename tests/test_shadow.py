"""Shadow decoding (engine/shadow.py): the large model decodes the next token of a request it handed back, and a
return with nothing new commits that token without a step. The outputs stay those of the naive reference, no
position is computed twice, KV is all free afterwards, and a shadow that cannot be used is dropped cleanly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from test_routing_vs_naive import (
    MAX_NEW,
    assert_all_free,
    computed_run,
    make_engine,
    naive_generate,
    prompts_for,
    record_chunks,
)
from tokenrouter import Engine, SamplingParams
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import SeqStatus, Sequence
from tokenrouter.engine.shadow import ShadowDecoder
from tokenrouter.routing.policy import POLICIES, Lease, Policy, register
from tokenrouter.runner.forward_batch import ScheduledChunk
from triton_harness import generate_stream, metrics, running_server, stream_text, tiny_deployment, wait_metric

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


class _RunsPolicy(Policy):
    """Runs of tokens on the large model (R2R's untrained router sends some requests there for long stretches): the
    small model sends positions 1-5 of every 7 to the large one; the large one makes one token under a lease and
    hands back. The return for the last position of a run comes under a lease that does not decide (the large
    model's `route` hands it back, its token committed), so its shadow token may not be used as it stands: taken
    for the step's, it would keep the request on the large model for position 6, the small one's."""

    name = "test-runs"
    PURE_LEASED_ROUTE = True

    def route(self, batch, result):
        if self.model == self.models[0]:
            return [self.models[-1] if r.output_len % 7 not in (0, 6) else self.model for r in batch]
        return [self.models[0]] * len(batch)

    def send(self, req, target, token):
        return self.model != self.models[0]  # the large model's token under its `route` commits; the small one's not

    def receive(self, req, source):
        if self.model == self.models[0]:
            return None
        return Lease(until_route=True) if req.output_len % 7 == 5 else Lease(return_to=source, max_tokens=1)


def _runs_engine(tiny: Path, shadow: bool = True, thresholds: dict | int | None = None) -> Engine:
    if _RunsPolicy.name not in POLICIES:
        register(_RunsPolicy)
    engine = make_engine(tiny, ["small", "large"], {"name": _RunsPolicy.name},
                         thresholds=thresholds or {"small": 3, "large": 2})
    if not shadow:
        for sub in engine.subservers.values():
            sub.shadow.enabled = False
    return engine


def _generate_with_gaps(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Stepped generation, with the large model given one more turn after each round: the time it has in a
    deployment between handing a request back and the request's return (in stepped mode a request handed back
    returns within the same round, before the large model steps again)."""
    done: dict[str, object] = {}

    def finished(out) -> None:
        if out.finished:
            done[out.request_id] = out

    ids = [engine.add_request(p, params, listener=finished) for p in prompts]
    large = engine.subservers["large"]
    for _ in range(2000):
        if len(done) == len(ids):
            break
        engine.step()
        if large.should_step():
            large.safe_step()
    return [done[r] for r in ids]


def test_shadow_tokens_commit_on_return_and_equal_the_reference(tiny_dir: Path) -> None:
    engine = _runs_engine(tiny_dir)
    prompts = prompts_for(engine.vocab_size)
    chunks = record_chunks(engine)
    outs = _generate_with_gaps(engine, prompts, GREEDY)
    large = engine.subservers["large"]
    for prompt, out in zip(prompts, outs):
        ref, per_model = naive_generate(tiny_dir, ["small", "large"], {"name": _RunsPolicy.name}, prompt, MAX_NEW)
        assert out.token_ids == ref
        assert out.stats["tokens_per_model"] == per_model
        # No position computed twice on the small model, and on the large one only the token of a shadow that a
        # return under a lease that does not decide could not use (its last token runs again, for the logits).
        pos, _ = computed_run(chunks[("small", out.request_id)], "small")
        assert out.stats["forwarded_per_model"]["small"] == pos
    assert large.shadow.num_hits > 0, "no shadow token was ever committed: the test would prove nothing"
    dropped = large.shadow.num_rows - large.shadow.num_hits
    assert dropped > 0, "every shadow was used: the path that drops one is not exercised"
    assert engine.subservers["small"].shadow.num_rows == 0  # the small model never hands back under a lease
    assert_all_free(engine)
    engine.shutdown()


def test_shadow_changes_no_token_and_adds_at_most_one_position(tiny_dir: Path) -> None:
    """Against the same deployment with shadow decoding off: the same tokens from the same models; per request the
    large model computes what it did without shadows, give or take its last shadow (which the request, finished
    elsewhere, never used) and the tokens recomputed where a return could not use its shadow."""
    prompts = prompts_for(1024)
    results = {}
    for shadow in (False, True):
        engine = _runs_engine(tiny_dir, shadow=shadow)
        results[shadow] = _generate_with_gaps(engine, prompts, GREEDY)
        assert_all_free(engine)
        engine.shutdown()
    for off, on in zip(results[False], results[True]):
        assert on.token_ids == off.token_ids
        assert on.stats["tokens_per_model"] == off.stats["tokens_per_model"]
        extra = on.stats["forwarded_per_model"]["large"] - off.stats["forwarded_per_model"]["large"]
        runs = on.stats["tokens_per_model"]["large"] // 5 + 1
        assert 0 <= extra <= 1 + runs, extra


def test_background_loops_with_shadows_equal_stepped(tiny_dir: Path) -> None:
    prompts = prompts_for(1024)
    stepped = _runs_engine(tiny_dir, shadow=False)
    expected = [o.token_ids for o in stepped.generate(prompts, GREEDY)]
    stepped.shutdown()
    engine = _runs_engine(tiny_dir, thresholds=1)
    engine.start()
    try:
        for _ in range(3):  # (whether a shadow row runs before its request returns is a race here)
            outs = engine.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == expected
            assert_all_free(engine)
    finally:
        engine.shutdown()


class _CountingPolicy(Policy):
    """A `route` that keeps state on leased rows (the large model counts its tokens there; the small one sends every
    token to it until it made 6): the engine may not skip it, so this policy (PURE_LEASED_ROUTE False) gets no
    shadow rows. (A shadow token committed without `route` left the count behind: all 20 tokens went to the large
    model, against 6 in the reference.)"""

    name = "test-count-in-route"

    def route(self, batch, result):
        small, large = self.models
        if self.model == small:
            return [large if r.state.get("n", 0) < 6 else small for r in batch]
        for r in batch:
            r.state["n"] = r.state.get("n", 0) + 1
        return [large] * len(batch)

    def receive(self, req, source):
        return None if self.model == self.models[0] else Lease(return_to=source, max_tokens=1)


def test_a_route_with_state_on_leased_rows_gets_no_shadows(tiny_dir: Path) -> None:
    if _CountingPolicy.name not in POLICIES:
        register(_CountingPolicy)
    policy = {"name": _CountingPolicy.name}
    engine = make_engine(tiny_dir, ["small", "large"], policy, thresholds={"small": 3, "large": 2})
    prompts = prompts_for(engine.vocab_size)[:4]
    outs = _generate_with_gaps(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref, per_model = naive_generate(tiny_dir, ["small", "large"], policy, prompt, MAX_NEW)
        assert out.token_ids == ref and out.stats["tokens_per_model"] == per_model == {"large": 6, "small": 14}
    assert engine.subservers["large"].shadow.num_rows == 0
    assert_all_free(engine)
    engine.shutdown()


def test_sampled_requests_get_no_shadow_rows(tiny_dir: Path) -> None:
    engine = _runs_engine(tiny_dir)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3, ignore_eos=True)
    outs = engine.generate(prompts_for(1024)[:4], params)
    assert all(o.stats["tokens_per_model"].get("large") for o in outs)
    assert engine.subservers["large"].shadow.num_rows == 0
    assert_all_free(engine)
    engine.shutdown()


def test_cancel_with_a_shadow_pending_frees_kv(tiny_dir: Path) -> None:
    engine = _runs_engine(tiny_dir)
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts_for(1024)]
    large = engine.subservers["large"]
    pending: list[str] = []
    for _ in range(200):
        engine.step()
        if large.should_step():
            large.safe_step()
        pending = [r for r in ids if r in large.seqs and large.seqs[r].shadow is not None]
        if pending:
            break
    assert pending, "no request ever held a shadow token on the large model"
    for rid in ids:
        out = engine.abort(rid)
        assert out is not None and out.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_all_free(engine)
    engine.shutdown()


def _parked(bm: BlockManager, sched: Scheduler, rid: str, in_run: bool) -> Sequence:
    """A request parked at a model that made its last token there and handed it back under a lease."""
    seq = Sequence(rid, [1, 2, 3, 4, 5], 3, SamplingParams(temperature=0.0))
    assert bm.ensure(seq, 4)
    seq.num_computed_tokens = 4
    seq.status, seq.shadow_ok, seq.in_run = SeqStatus.PARKED, True, in_run
    sched.parked[rid] = seq
    return seq


def test_steps_of_shadows_alone_follow_how_often_runs_go_on() -> None:
    bm = BlockManager(64, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    shadow = ShadowDecoder(True, 1024)
    running = _parked(bm, sched, "a", in_run=True)
    away = _parked(bm, sched, "b", in_run=False)
    assert shadow.due(sched.parked.values())
    # Alone: only the request in a run; riding along a step: both, the one in a run first.
    assert [c.seq for c in shadow.rows(sched, bm, [], None)] == [running]
    running.num_computed_tokens = 4  # (the step did not run: it still wants one)
    # Requests in a run that came back with tokens (their run ended) most of the time: no steps of shadows alone.
    for _ in range(40):
        probe = _parked(bm, sched, "probe", in_run=True)
        shadow.returned(probe, [9])
        sched.parked.pop("probe")
        bm.release(probe)
    assert shadow.continue_p < 0.5
    assert not shadow.due(sched.parked.values())
    assert shadow.rows(sched, bm, [], None) == []
    # Beside a step the model runs anyway, shadows still ride along.
    other = Sequence("c", [7, 8], 2, SamplingParams(temperature=0.0))
    rows = shadow.rows(sched, bm, [ScheduledChunk(other, 2)], None)
    assert [c.seq for c in rows] == [running, away]
    # A return with nothing new takes the shadow token only while the request is as the shadow row left it.
    shadow.keep([running], [42], [True])
    running.num_computed_tokens = running.num_tokens
    assert shadow.returned(running, []) == 42 and running.shadow is None
    shadow.keep([away], [43], [True])
    away.num_computed_tokens = away.num_tokens
    assert shadow.returned(away, [11]) is None  # it brought a token: its shadow was not its next token
    # A non-finite row leaves nothing to take.
    shadow.keep([running], [44], [False])
    assert running.shadow is None


def test_a_shadow_row_takes_no_block_a_running_request_needs() -> None:
    bm = BlockManager(4, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    shadow = ShadowDecoder(True, 1024)
    parked = _parked(bm, sched, "p", in_run=True)  # 5 tokens, 4 computed: its shadow row needs a second block
    # A running request with 8 tokens in 2 full blocks: its next token needs a third, the pool's last free block.
    running = Sequence("r", list(range(1, 9)), 4, SamplingParams(temperature=0.0))
    assert bm.ensure(running, 8)
    running.num_computed_tokens, running.status = 7, SeqStatus.RUNNING
    sched.running.append(running)
    assert bm.num_free_blocks == 1
    assert shadow.rows(sched, bm, [ScheduledChunk(running, 1)], None) == []
    assert len(parked.block_table) == 1 and bm.num_free_blocks == 1
    # With a block to spare, it takes one.
    bm2 = BlockManager(5, 4, False)
    sched2 = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=64)
    parked2 = _parked(bm2, sched2, "p", in_run=True)
    assert bm2.ensure(running, 8)
    sched2.running.append(running)
    assert [c.seq for c in shadow.rows(sched2, bm2, [ScheduledChunk(running, 1)], None)] == [parked2]


def test_a_failing_shadow_row_fails_no_request_and_does_not_spin(tiny_dir: Path) -> None:
    engine = _runs_engine(tiny_dir)
    large = engine.subservers["large"]
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    finals = []
    for p in prompts_for(1024)[:2]:
        engine.add_request(p, params, listener=lambda o: o.finished and finals.append(o))
    for _ in range(200):
        engine.step()
        if large.shadow.due(large.scheduler.parked.values()) and not large.scheduler.num_ready:
            break
    assert large.should_step() and not large.scheduler.num_ready, "no step of shadow rows alone came due"
    real_forward = large.runner.forward

    def broken(chunks, **kw):
        raise RuntimeError("injected fault")

    large.runner.forward = broken
    assert large.safe_step() == 0
    assert not large.should_step(), "the model would step its failing shadow rows again at once"
    large.runner.forward = real_forward
    for _ in range(2000):  # the requests, never failed, run on to their end
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert [(o.finish_reason, len(o.token_ids)) for o in finals] == [("length", 200)] * 2
    assert_all_free(engine)
    engine.shutdown()


def test_served_shadows_equal_the_engine(tiny_dir: Path, tmp_path: Path) -> None:
    """Through a real tritonserver (each model its own process): concurrent streams under R2R-style runs give the
    in-process engine's tokens without shadows, the large model's shadow tokens commit (metrics), and every KV block
    is free afterwards."""
    # The served processes import the policy by the name in the config: the shipped co-LLM pair (its untrained
    # router sends some requests to the large model for long runs) stands in.
    shipped = REPO / "config" / "collm" / "tiny-small_tiny-large.yaml"
    config = tiny_deployment(tmp_path / "collm.yaml", tiny_dir, shipped, kv_cache_tokens=4096)
    prompts = ["def main():", "import numpy as np", "class Stack:", "for i in range(10):", "Hello, world",
               "The quick brown fox", "while True:", "x = [1, 2, 3]"]
    with Engine.from_config(config) as engine:
        for sub in engine.subservers.values():
            sub.shadow.enabled = False
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        expected = {p: o.text for p, o in zip(prompts, engine.generate(prompts, params))}
    body = {"stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})}
    with running_server(config, tmp_path) as server:
        for _ in range(3):
            got: dict[str, str] = {}

            def one(prompt: str, got: dict[str, str] = got) -> None:
                status, events = generate_stream(server, {**body, "text_input": prompt})
                assert status == 200, events
                got[prompt] = stream_text(events)

            threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert got == expected
        m = metrics(server)
        assert m['tokenrouter_shadow_hits_total{model="large"}'] > 0, m
        assert m['tokenrouter_shadow_rows_total{model="small"}'] == 0
        for model in ("small", "large"):
            key = f'tokenrouter_kv_blocks_used{{model="{model}"}}'
            assert wait_metric(server, key, 0.0) == 0.0, f"{key} did not go back to 0"
