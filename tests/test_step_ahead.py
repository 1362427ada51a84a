"""Stepping ahead (ModelConfig.step_ahead): a subserver launches its next decode step before this step's tokens
reach the host, fed them on the device. Outputs are exactly those of the plain loop; a row whose token was not
committed there after all (routed away, finished, cancelled) computes for nothing and is dropped, and no KV it
wrote is ever read: the prefix cache and later requests see only what committed tokens computed."""

from __future__ import annotations

from pathlib import Path

from test_cuda_graph_runner import PADDING_ROWS_UNWRITTEN
from test_routing_vs_naive import naive_generate, prompts_for
from test_stepped_finals import assert_all_free
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.sequence import SeqStatus
from tokenrouter.engine.timeline import Timeline
from tokenrouter.routing.policy import Policy, RouteRequest, StepResult, register
from tokenrouter.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
RANDOM = (["small", "large"], {"name": "random", "p": 0.15, "seed": 11})


def _engine(tiny_dir: Path, models: list[str], policy: dict, ahead: bool, **model: object) -> Engine:
    """make_engine's deployment, every model with `step_ahead: ahead` (and `model`'s other keys)."""
    cfg = {
        "models": {m: {"path": str(tiny_dir / m), "kv_cache_tokens": 2048, "block_size": 4, "step_ahead": ahead,
                       **model} for m in models},
        "entry": models[0], "policy": policy, "batching": {"thresholds": 1},
    }
    return Engine.from_config(cfg)


def _generate(eng: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    out = [o.token_ids for o in eng.generate(prompts, params)]
    assert_all_free(eng)
    return out


def test_routed_output_equals_the_plain_loop_and_the_naive_reference(tiny_dir: Path) -> None:
    prompts = prompts_for(1024)[2:5]
    plain = _engine(tiny_dir, *RANDOM, ahead=False)
    expected = _generate(plain, prompts)
    assert plain.subservers["small"].num_ahead_steps == 0
    eng = _engine(tiny_dir, *RANDOM, ahead=True)
    assert _generate(eng, prompts) == expected
    small = eng.subservers["small"]
    # It really stepped ahead, and some of those rows were void (their token went to the large model).
    assert small.num_ahead_steps > 5 and small.num_void_rows > 0
    ref, _ = naive_generate(tiny_dir, *RANDOM, prompts[1], GREEDY.max_new_tokens)
    assert expected[1] == ref


def test_forwarded_tokens_count_only_what_committed(tiny_dir: Path) -> None:
    """One request on the small model alone: every step after the prefill runs ahead but the one after its last
    token; the request is credited prompt + outputs - 1 tokens, as without, and nothing was computed for nothing.
    With random routing, void rows are computed but never credited."""
    prompt = prompts_for(1024)[5]
    for ahead in (False, True):
        eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=ahead)
        (out,) = eng.generate([prompt], GREEDY)
        assert out.stats["num_forwarded_tokens"] == len(prompt) + GREEDY.max_new_tokens - 1
        small = eng.subservers["small"]
        assert small.num_ahead_steps == (GREEDY.max_new_tokens - 1 if ahead else 0) and small.num_void_rows == 0
        assert small.runner.num_forwarded_tokens == len(prompt) + GREEDY.max_new_tokens - 1
        assert_all_free(eng)
    eng = _engine(tiny_dir, *RANDOM, ahead=True)
    res = eng.generate(prompts_for(1024)[:3], GREEDY)
    small = eng.subservers["small"]
    credited = sum(o.stats["forwarded_per_model"].get("small", 0) for o in res)
    assert small.num_void_rows > 0 and small.runner.num_forwarded_tokens == credited + small.num_void_rows
    assert_all_free(eng)


def test_one_token_requests_are_not_stepped_ahead(tiny_dir: Path) -> None:
    """A request whose next token is its last has no next step (Std. Serving asks for one token per call): no step
    is launched ahead for it, so none of its rows is computed twice."""
    eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=True)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for prompt in prompts_for(1024)[:3]:
        (out,) = eng.generate([prompt], one)
        assert len(out.token_ids) == 1
    small = eng.subservers["small"]
    assert small.num_ahead_steps == 0 and small.num_void_rows == 0
    assert_all_free(eng)


def test_a_row_beside_a_finishing_one_goes_on_ahead(tiny_dir: Path) -> None:
    """Requests of different lengths in one batch: the step that ends one launches the next for the others alone,
    each row fed its own request's token; nothing is routed, so no row is void."""
    prompts = prompts_for(1024)[:3]
    lens = [5, 24, 11]
    outs = []
    for ahead in (False, True):
        eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=ahead)
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
               for p, n in zip(prompts, lens)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        outs.append([done[i] for i in ids])
        small = eng.subservers["small"]
        assert small.num_void_rows == 0
        assert_all_free(eng)
    assert outs[0] == outs[1] and [len(o) for o in outs[1]] == lens


def test_sampled_rows_are_not_stepped_ahead(tiny_dir: Path) -> None:
    """A void row's draw would move its generator: seeded sampled requests give what they give without."""
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    prompts = prompts_for(1024)[:4]
    outs = []
    for ahead in (False, True):
        eng = _engine(tiny_dir, *RANDOM, ahead=ahead)
        outs.append(_generate(eng, prompts, params))
        assert eng.subservers["small"].num_ahead_steps == 0
    assert outs[0] == outs[1]


def test_cancel_while_a_step_runs_ahead(tiny_dir: Path) -> None:
    """A request cancelled while its next step is in flight: that row is void, the others go on exactly as
    without stepping ahead, and every block is free at the end."""
    prompts = prompts_for(1024)[:3]
    plain = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=False)
    expected = _generate(plain, prompts)
    eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=True)
    small = eng.subservers["small"]
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(4):
        eng.step()
    assert small._ahead is not None, "expected a step in flight ahead"
    assert eng.abort(ids[1]).finished
    outs = {}
    for _ in range(200):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert outs == {ids[0]: expected[0], ids[2]: expected[2]}
    assert small.num_void_rows >= 1
    assert_all_free(eng)


def test_prefix_cache_sees_only_committed_kv(tiny_dir: Path) -> None:
    """Requests routed away leave void rows behind; later prompts that extend their outputs hit the prefix cache
    (blocks of 4 tokens) and must still generate what a fresh engine without any cache generates."""
    prompts = prompts_for(1024)[4:8]
    eng = _engine(tiny_dir, *RANDOM, ahead=True)
    first = _generate(eng, prompts)
    assert eng.subservers["small"].num_void_rows > 0
    follow = [p + out[:21] for p, out in zip(prompts, first)]  # prompt + outputs: cut mid-block
    got = _generate(eng, follow)
    fresh = _engine(tiny_dir, *RANDOM, ahead=False)
    for sub in fresh.subservers.values():
        sub.block_manager.enable_prefix_caching = False
    assert got == _generate(fresh, follow)


@PADDING_ROWS_UNWRITTEN
def test_through_the_graph_runner_s_static_inputs(tiny_dir: Path) -> None:
    """The padded static-input path of CUDA graphs (run uncaptured on the CPU): the fed tokens are copied into its
    input buffer after the host's placeholders."""
    prompts = prompts_for(1024)[:3]
    graphs = {"attention": "triton", "cuda_graph_max_batch": 4, "cuda_graph_max_tokens": 32}
    expected = _generate(_engine(tiny_dir, *RANDOM, ahead=False, **graphs), prompts)
    eng = _engine(tiny_dir, *RANDOM, ahead=True, **graphs)
    for sub in eng.subservers.values():
        sub.runner.setup_step(sub.runner.step_hook, capture=False)
    assert eng.subservers["small"].runner.graphs is not None
    assert _generate(eng, prompts) == expected
    small = eng.subservers["small"]
    assert small.num_ahead_steps > 0 and small.runner.graphs.num_replays > 0


def test_a_queued_request_stops_stepping_ahead(tiny_dir: Path) -> None:
    """A request waiting to be scheduled gets the next step: no step is launched ahead while one waits."""
    eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=True)
    small = eng.subservers["small"]
    a = eng.add_request(prompts_for(1024)[0], GREEDY)
    for _ in range(3):
        eng.step()
    assert small._ahead is not None
    b = eng.add_request(prompts_for(1024)[1], GREEDY)
    eng.step()  # takes the step in flight; the newcomer is queued now, so nothing is launched ahead
    assert small._ahead is None
    eng.step()  # a normal step: both requests
    assert {s.request_id for s in small.scheduler.running} == {a, b}
    while eng.has_unfinished():
        eng.step()
    assert_all_free(eng)


@register
class _DeviceRoute(Policy):
    """Routes on a tensor it computes in `route` itself (not through `step_tensors`): not HOST_ROUTE."""

    name = "test-device-route"

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[bool]:
        if self.model != self.models[0]:
            return [False] * len(batch)
        return (result.logits.argmax(-1) % 5 == 0).tolist()  # device work on this step's logits


@register
class _FailsOnItsThirdCall(Policy):
    """Raises in `route` on its third call (a policy's bug): the step fails after it launched the next one."""

    name = "test-fails-on-third-call"
    HOST_ROUTE = True

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[bool]:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("policy failure")
        return [False] * len(batch)


def test_a_step_failing_after_launching_ahead(tiny_dir: Path) -> None:
    """A step that fails after launching the next one fails its request; the step launched ahead is then taken and
    found void (counted, never credited), and every KV block is free."""
    eng = _engine(tiny_dir, ["small", "large"], {"name": "test-fails-on-third-call"}, ahead=True)
    small = eng.subservers["small"]
    eng.add_request(prompts_for(1024)[0], GREEDY, request_id="r")
    finals = []
    while eng.has_unfinished():
        finals += [o for o in eng.step() if o.finished]
    (out,) = finals
    assert out.finish_reason == "error" and "policy failure" in out.error
    for _ in range(2):
        eng.step()  # (takes the step in flight, if any)
    # (ahead after the prefill, after the second step, and the one launched by the failing third)
    assert small._ahead is None and small.num_ahead_steps == 3 and small.num_void_rows == 1
    assert small.runner.num_forwarded_tokens == out.stats["num_forwarded_tokens"] + small.num_void_rows
    assert_all_free(eng)


def test_a_policy_computing_in_route_is_not_stepped_ahead(tiny_dir: Path) -> None:
    """Stepping ahead, the next step may overwrite the step's device tensors before `route` reads them (a CUDA
    graph's buffers): a policy that computes on them in `route` keeps its models in the plain loop."""
    models, policy = ["small", "large"], {"name": "test-device-route"}
    prompts = prompts_for(1024)[:4]
    eng = _engine(tiny_dir, models, policy, ahead=True)
    assert not any(sub.step_ahead for sub in eng.subservers.values())
    res = eng.generate(prompts, GREEDY)
    assert sum(o.stats["handoffs"] for o in res) > 0, "nothing routed: the test checks nothing"
    assert eng.subservers["small"].num_ahead_steps == 0
    assert [o.token_ids for o in res] == _generate(_engine(tiny_dir, models, policy, ahead=False), prompts)
    assert _engine(tiny_dir, *RANDOM, ahead=True).subservers["small"].step_ahead  # (built-in policies do)


def test_append_while_a_step_runs_ahead(tiny_dir: Path) -> None:
    """Tokens appended to a request whose next step is in flight: that row is void, the appended tokens run as
    an extend next, and the output equals the plain loop's with the same append at the same point."""
    prompt = prompts_for(1024)[6]
    outs = []
    for ahead in (False, True):
        eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=ahead)
        rid = eng.add_request(prompt, GREEDY)
        for _ in range(5):
            eng.step()
        if ahead:
            assert eng.subservers["small"]._ahead is not None
        eng.append_tokens(rid, [7, 8, 9])
        out = None
        while eng.has_unfinished():
            for o in eng.step():
                out = o if o.finished else out
        outs.append(out.token_ids)
        assert_all_free(eng)
    assert outs[0] == outs[1]


def test_a_request_back_from_elsewhere_is_not_held_up(tiny_dir: Path) -> None:
    """A request resumed on a model (back from another) while a step runs ahead gets the step after it: the chain
    of steps ahead stops for it instead of going on without it."""
    eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=True)
    small = eng.subservers["small"]
    a, b = (eng.add_request(p, GREEDY) for p in prompts_for(1024)[:2])
    for _ in range(3):
        eng.step()
    seq_b = small.seqs[b]
    small.scheduler.park(seq_b)  # as if handed off: its row in the step in flight is void
    eng.step()
    eng.step()  # a's steps alone now, one running ahead
    assert small._ahead is not None and [r.seq.request_id for r in small._ahead.rows] == [a]
    seq_b.token_ids.append(11)  # back, with a token from elsewhere
    small.scheduler.resume(seq_b)
    assert seq_b.status is SeqStatus.RUNNING
    pending = seq_b.num_tokens  # (its token from before the handoff and the new one)
    small.safe_step()  # takes a's step in flight; nothing launched ahead: b waits
    assert small._ahead is None
    small.safe_step()
    assert seq_b.num_computed_tokens == pending
    for rid in (a, b):
        eng.abort(rid)
    assert_all_free(eng)


def test_below_its_batching_threshold_a_model_does_not_step_ahead(tiny_dir: Path) -> None:
    """Delayed batching: a model with fewer rows than its threshold, while more requests may still come to it,
    waits for them (`should_step`) instead of launching its next step at once; where nothing else can arrive, it
    steps ahead below its threshold. The tokens are the same either way."""
    prompt = prompts_for(1024)[0]
    outs = []
    for arrivals in (True, False):
        eng = _engine(tiny_dir, ["small", "large"], {"name": "always", "model": "small"}, ahead=True)
        small = eng.subservers["small"]
        small.threshold, small.arrivals_possible = 2, (lambda a=arrivals: a)
        outs.append(_generate(eng, [prompt]))
        assert (small.num_ahead_steps == 0) == arrivals, arrivals
    assert outs[0] == outs[1]


def test_the_tuner_records_the_rows_the_gpu_ran(tiny_dir: Path) -> None:
    """A step launched ahead with void rows ran all of them: the batch-latency sample the threshold tuner gets is
    that batch, not the rows kept; the timeline's step event says how many rows were void."""
    eng = _engine(tiny_dir, *RANDOM, ahead=True)
    small = eng.subservers["small"]
    small.timeline = Timeline("small")
    recorded = []
    real = small.stats.record_step
    small.stats.record_step = lambda batch, seconds, end=None: (recorded.append(batch), real(batch, seconds, end))
    for prompt in prompts_for(1024)[:3]:
        eng.add_request(prompt, GREEDY)
    partly_void = 0
    while eng.has_unfinished():
        ahead, before = small._ahead, len(recorded)
        eng.step()
        if ahead is not None and len(recorded) == before + 1:  # (one small step: the one taking `ahead`)
            assert recorded[before] == len(ahead.rows)
            partly_void += small.last_batch_size < len(ahead.rows)  # (the rows it kept)
    assert partly_void > 0
    steps = [e for e in small.timeline.take() if e["kind"] == "step"]
    assert sum(e["void"] > 0 for e in steps) >= partly_void
    assert sorted(e["batch"] + e["void"] for e in steps) == sorted(recorded)
    assert_all_free(eng)


def test_rows_run_ahead_record_no_queue_wait(tiny_dir: Path) -> None:
    """Rows of a step launched ahead were never waiting: the queue-wait metric gets nothing negative from them."""
    eng = _engine(tiny_dir, *RANDOM, ahead=True)
    small = eng.subservers["small"]
    _generate(eng, prompts_for(1024)[:3])
    waits = small.drain_queue_waits()
    assert small.num_ahead_steps > 0 and waits and min(waits) >= 0.0


def test_at_the_context_limit(tiny_dir: Path) -> None:
    """Requests that run into the context limit end with "length" and the same tokens as without stepping ahead."""
    prompts = prompts_for(1024)[5:8]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    outs = []
    for ahead in (False, True):
        eng = _engine(tiny_dir, *RANDOM, ahead=ahead, max_model_len=40)
        res = eng.generate(prompts, params)
        assert all(o.finish_reason == "length" for o in res)
        outs.append([o.token_ids for o in res])
        assert_all_free(eng)
    assert outs[0] == outs[1]
