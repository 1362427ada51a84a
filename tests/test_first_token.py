"""Delayed batching never holds a request's first token: a model held back for a fuller batch (its threshold, up to
max_wait_ms) still steps at once for a ready request that has made no token yet (time to first token), and holds
the requests that have made one as before; a first token waiting for KV blocks steps no one until blocks are
freed."""

from __future__ import annotations

from pathlib import Path

from test_routing_vs_naive import prompts_for
from test_stepped_finals import assert_all_free
from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def _held_engine(tiny_dir: Path, policy: dict, small_kv_tokens: int = 2048) -> Engine:
    """Both tiny models; every model held for 3 ready requests for up to a minute, more always able to come."""
    models = {m: {"path": str(tiny_dir / m), "kv_cache_tokens": kv, "block_size": 4}
              for m, kv in (("small", small_kv_tokens), ("large", 2048))}
    eng = Engine.from_config({"models": models, "entry": "small", "policy": policy, "batching": {"thresholds": 1}})
    for sub in eng.subservers.values():
        sub.threshold, sub.max_wait_s, sub.arrivals_possible = 3, 60.0, (lambda: True)
    return eng


def _ready_at(eng: Engine, sub_name: str) -> int:
    eng._pump()  # (stepped mode: the coordinator delivers what the last step emitted)
    sub = eng.subservers[sub_name]
    sub.drain()
    return sub.scheduler.num_ready


def test_the_first_token_steps_at_once_and_later_tokens_wait_for_the_batch(tiny_dir: Path) -> None:
    """The entry model: a lone new request is stepped at once (its prefill and first token); its next token waits
    for the hold. The 32B's case: a first token the policy routes to the held large model is made at once there."""
    eng = _held_engine(tiny_dir, {"name": "always", "model": "small"})
    small = eng.subservers["small"]
    rid = eng.add_request(prompts_for(1024)[0], PARAMS)
    assert _ready_at(eng, "small") == 1
    assert small.should_step()
    assert small.safe_step() == 1
    assert _ready_at(eng, "small") == 1 and eng.requests[rid].output_ids  # its first token committed
    assert not small.should_step()  # one ready of 3, a minute's wait: held as before
    eng.abort(rid)
    eng._pump()
    assert_all_free(eng)

    eng = _held_engine(tiny_dir, {"name": "always", "model": "large"})
    small, large = eng.subservers["small"], eng.subservers["large"]
    rid = eng.add_request(prompts_for(1024)[1], PARAMS)
    assert _ready_at(eng, "small") == 1 and small.should_step()
    small.safe_step()  # the prefill: the policy routes the first token to the large model
    assert _ready_at(eng, "large") == 1 and not eng.requests[rid].output_ids
    assert large.should_step()
    assert large.safe_step() == 1
    assert _ready_at(eng, "large") == 1 and len(eng.requests[rid].output_ids) == 1
    assert not large.should_step()
    eng.abort(rid)
    eng._pump()
    assert_all_free(eng)


def test_a_first_token_waiting_for_kv_blocks_steps_no_one_until_blocks_are_freed(tiny_dir: Path) -> None:
    """The entry model's pool holds 32 blocks of 4 tokens. A new request that finds too few free blocks (B, 60
    tokens, beside A's 80) is stepped for once; then it steps the held model no more (it would step the others
    below their hold on every round, and its token would come no sooner) until blocks are freed. Another new
    request that fits (C) is stepped for at once meanwhile."""
    prompts = [list(range(10, 90)), list(range(100, 160)), list(range(200, 208))]  # 80, 60 and 8 tokens
    # A parked on the entry model (its first token went to the large one), B waiting for its blocks
    eng = _held_engine(tiny_dir, {"name": "always", "model": "large"}, small_kv_tokens=128)
    small = eng.subservers["small"]
    a = _stepped_alone(eng, prompts[0])
    b = eng.add_request(prompts[1], PARAMS)
    assert _ready_at(eng, "small") == 1 and small.should_step()
    assert small.safe_step() == 0  # nothing it could schedule: B waits for blocks
    assert not small.should_step()
    eng.abort(b)  # B leaves without a step here
    _end(eng, a, _stepped_alone(eng, prompts[2]))

    # A decoding on the entry model beside B waiting for its blocks: A is held as before, until its blocks are freed
    eng = _held_engine(tiny_dir, {"name": "always", "model": "small"}, small_kv_tokens=128)
    small = eng.subservers["small"]
    a = _stepped_alone(eng, prompts[0])
    b = eng.add_request(prompts[1], PARAMS)
    assert _ready_at(eng, "small") == 2 and small.should_step()
    assert small.safe_step() == 1  # A's next token; B left waiting
    assert _ready_at(eng, "small") == 2 and not small.should_step()  # 2 ready of 3, a minute's wait: held
    eng.abort(a)  # its blocks are freed
    assert _ready_at(eng, "small") == 1 and small.should_step() and small.safe_step() == 1
    assert _ready_at(eng, "small") == 1 and eng.requests[b].output_ids  # B's first token
    _end(eng, b)


def test_a_first_token_left_out_of_a_full_step_is_not_held(tiny_dir: Path) -> None:
    """A new request that a step left out for its token budget (not for KV blocks) is stepped for at once next."""
    eng = _held_engine(tiny_dir, {"name": "always", "model": "small"})
    small = eng.subservers["small"]
    small.scheduler.max_num_batched_tokens = 64
    a = eng.add_request(list(range(10, 74)), PARAMS)  # 64 tokens: the whole budget
    b = eng.add_request(list(range(100, 110)), PARAMS)
    assert _ready_at(eng, "small") == 2 and small.should_step() and small.safe_step() == 1
    assert _ready_at(eng, "small") == 2 and small.should_step() and small.safe_step() == 2
    assert _ready_at(eng, "small") == 2 and eng.requests[b].output_ids
    _end(eng, a, b)


def _stepped_alone(eng: Engine, prompt: list[int]) -> str:
    """A new request, the entry model's only ready one: stepped for at once, held as it is."""
    rid = eng.add_request(prompt, PARAMS)
    small = eng.subservers["small"]
    assert _ready_at(eng, "small") == 1 and small.should_step() and small.safe_step() == 1
    return rid


def _end(eng: Engine, *request_ids: str) -> None:
    for rid in request_ids:
        eng.abort(rid)
    eng._pump()
    assert_all_free(eng)
