"""A handoff's way between two models (the tuner's transit): stamped by the source model, measured where it
arrives, kept within one machine's clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_stepped_finals import engine_for
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.transport import codec
from tokenrouter.transport.grpc_link import _without_clock
from tokenrouter.transport.messages import Arrive, Commit, Handoff

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _arrive(sent_at: float | None) -> Arrive:
    return Arrive("r1", [5, 6], False, 2, GREEDY, {}, "small", {"small": 2}, sent_at=sent_at)


@pytest.mark.parametrize("background", [False, True], ids=["lockstep", "background"])
def test_routed_handoffs_are_measured_where_they_arrive(tiny_dir: Path, background: bool) -> None:
    eng = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.3)  # requests move both ways
    if background:  # each model's own loop thread, messages through its inbox
        eng.start()
    try:
        eng.generate([[5, 6, 7], [100, 200, 300, 400], [17] * 11], GREEDY)
    finally:
        if background:
            eng.shutdown()
    small, large = eng.subservers["small"].stats, eng.subservers["large"].stats
    assert large.transit_count["small"] > 0 and small.transit_count["large"] > 0
    assert 0.0 <= large.mean_transit("small") < 1.0 and 0.0 <= small.mean_transit("large") < 1.0


def test_a_malformed_stamp_is_not_measured_and_stops_nothing(tiny_dir: Path) -> None:
    """Off a socket anything can come: a stamp that is not a number, or no source name, is ignored."""
    eng = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.3)
    sub = eng.subservers["large"]
    for sent_at, source in (("soon", "small"), (True, "small"), (1.0, ""), (1.0, ["small"])):
        bad = _arrive(None)
        bad.sent_at, bad.source = sent_at, source
        sub.note_arrival(bad)
    assert not sub.stats.transit_count


def test_the_stamp_crosses_a_local_socket_but_not_a_link_to_another_machine() -> None:
    stamped = [_arrive(12.5), Handoff("small", "large", _arrive(7.0)), Commit("r1", "small", [3], None, 0)]
    assert [m.sent_at for m in codec.decode(codec.encode(stamped[:1]))] == [12.5]
    bare = _without_clock(stamped)
    assert bare[0].sent_at is None and bare[1].arrive.sent_at is None and bare[2] is stamped[2]
    assert bare[0].tokens == [5, 6] and bare[1].target == "large"
    assert stamped[0].sent_at == 12.5 and stamped[1].arrive.sent_at == 7.0  # the caller's messages are untouched


class _Events:
    """A peer gateway's stream response carrying a batch of events (what tritonclient hands the callback)."""

    def __init__(self, payload: str) -> None:
        self.payload = payload

    def as_numpy(self, name: str):
        import numpy as np

        return np.array([self.payload.encode()], dtype=np.object_)


def test_a_link_to_another_machine_carries_no_stamp_either_way() -> None:
    from tokenrouter.transport.grpc_link import GrpcLink

    got: list = []
    link = GrpcLink("large", "127.0.0.1:1", got.extend, lambda: None)
    link._conn, link._client = "c1", object()
    link._on_result("c1", _Events(codec.encode([Handoff("large", "small", _arrive(3.0))])), None)
    assert isinstance(got[0], Handoff) and got[0].arrive.sent_at is None  # the peer's clock: not measured here
    bodies: list = []
    link._request = lambda client, conn, body, request_id: bodies.append(body)
    link.send([_arrive(5.0)])
    assert codec.decode(bodies[0])[0].sent_at is None
