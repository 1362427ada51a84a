"""A served subserver defers its events (Subserver.defer_events): what a step emits leaves once the loop has
launched its next step, or before the loop idles, in the order it was emitted. Nothing is lost or reordered, and
a deployment running that way produces exactly the same output."""

from __future__ import annotations

import threading
from pathlib import Path

from test_stepped_finals import assert_all_free, engine_for
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.transport.messages import Commit, Failed, Handoff, Release, Released

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [17] * 11, [40, 41, 42, 43, 44, 45, 46]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


def _one_request_deferred(tiny_dir: Path, p: float, step_ahead: bool = False) -> tuple:
    """(engine, its small subserver, the log of what the subserver launched ("launch", or "ahead" for a step
    launched ahead) and sent) with events deferred and one request taken in, not yet stepped."""
    eng = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=p)
    sub = eng.subservers["small"]
    sub.step_ahead = step_ahead
    log: list[object] = []
    sent = sub._send
    sub._send = lambda ev: (log.append(ev), sent(ev))
    forward = sub.runner.forward
    sub.runner.forward = lambda chunks, **kw: (log.append("ahead" if kw.get("fed") is not None else "launch"),
                                               forward(chunks, **kw))[1]
    sub.defer_events()
    eng.add_request(PROMPTS[0], GREEDY)
    eng._pump()
    sub.drain()
    return eng, sub, log


def test_a_steps_events_leave_after_the_next_launch(tiny_dir: Path) -> None:
    eng, sub, log = _one_request_deferred(tiny_dir, p=0.0)  # stays on the small model
    sub.safe_step()  # the prefill: its first token is committed, and waits
    assert log == ["launch"]
    sub.safe_step()  # launched first, then the prefill's commit leaves; this step's own commit waits
    assert log[1] == "launch" and isinstance(log[2], Commit) and len(log) == 3
    first = log[2]
    sub.flush_events()
    assert isinstance(log[3], Commit) and log[3].token_ids != [] and len(log) == 4
    assert first.request_id == log[3].request_id
    eng.abort(first.request_id)
    eng._pump()


def test_stepping_ahead_a_steps_events_leave_when_the_next_step_is_taken(tiny_dir: Path) -> None:
    """Stepping ahead, the next step is launched before this one's results are in, so this step's events leave
    as soon as the next step is taken up (its launch long done), before the step after it is launched."""
    eng, sub, log = _one_request_deferred(tiny_dir, p=0.0, step_ahead=True)
    sub.safe_step()  # the prefill, then the next step at once; the first token is committed, and waits
    assert log == ["launch", "ahead"]
    sub.safe_step()  # the step launched ahead: the prefill's commit leaves, then the next step is launched
    assert isinstance(log[2], Commit) and log[3] == "ahead" and len(log) == 4
    sub.flush_events()
    assert isinstance(log[4], Commit) and log[4].request_id == log[2].request_id and len(log) == 5
    assert sub.num_ahead_steps == 2 and sub.num_void_rows == 0
    eng.abort(log[2].request_id)
    eng._pump()


def test_a_step_that_hands_off_sends_its_events_at_its_end(tiny_dir: Path) -> None:
    """A handoff is on its request's critical path: it leaves when its step ends, not after the next launch."""
    eng, sub, log = _one_request_deferred(tiny_dir, p=1.0)  # every token goes to the large model
    sub.safe_step()
    assert log[0] == "launch" and isinstance(log[-1], Handoff) and "launch" not in log[1:]
    assert not sub._deferred
    eng.abort(log[-1].arrive.request_id)
    eng._pump()


def test_deferred_events_change_no_output(tiny_dir: Path) -> None:
    """Routed (random p=0.3, so requests move both ways), in background mode where each subserver runs
    `serve_forever`: the same tokens as with direct emission, every request finished once, every block free."""
    plain = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.3)
    expected = plain.generate(PROMPTS, GREEDY)
    eng = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.3)
    emitted: dict[str, list] = {}
    sent: dict[str, list] = {}
    for sub in eng.subservers.values():
        sub.defer_events()
        buf, send = sub.emit, sub._send
        emit_log, send_log = emitted.setdefault(sub.name, []), sent.setdefault(sub.name, [])
        sub.emit = lambda ev, buf=buf, log=emit_log: (log.append(ev), buf(ev))[1]
        sub._send = lambda ev, send=send, log=send_log: (log.append(ev), send(ev))[1]
    eng.start()
    try:
        done: list = []
        runner = threading.Thread(target=lambda: done.append(eng.generate(PROMPTS, GREEDY)), daemon=True)
        runner.start()
        runner.join(120)
        assert done, "requests did not finish: a deferred event never left"
        got = done[0]
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert all(o.finished for o in got)
    finally:
        eng.shutdown()
    assert_all_free(eng)
    for name, events in emitted.items():  # every event left, in the order it was emitted
        assert len(events) > len(PROMPTS) and [id(e) for e in sent[name]] == [id(e) for e in events], name


def test_a_refused_request_fails_from_the_loop_in_order(tiny_dir: Path) -> None:
    """A message the model's process refused is released through the loop with its error: Failed, then Released,
    after what the loop emitted for the request before (the reader thread no longer sends the Failed itself)."""
    eng = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.0)
    sub = eng.subservers["small"]
    log: list[object] = []
    sub._send = log.append
    sub.defer_events()
    sub.handle(Release("r-refused", "error", "model 'small' refused the request: bad tokens"))
    assert log == []  # deferred like everything the loop emits
    sub.flush_events()
    assert isinstance(log[0], Failed) and log[0].error == "model 'small' refused the request: bad tokens"
    assert isinstance(log[1], Released) and not log[1].held and len(log) == 2
