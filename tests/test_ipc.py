"""The local-socket transport between the router and the subservers (transport/ipc.py): messages arrive in
order and intact, a broken peer is noticed on both sides, an unreachable model fails fast."""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from multiprocessing.connection import Client

import pytest

from tokenrouter.sampling_params import SamplingParams
from tokenrouter.transport import ipc
from tokenrouter.transport.messages import Arrive, Commit, Release


def _addr() -> str:
    return f"\0tokenrouter-test/{os.getpid()}/{uuid.uuid4().hex}"


def test_address_names_the_server_and_model() -> None:
    assert ipc.address("large", server_pid=123) == "\0tokenrouter/123/large"
    assert ipc.address("small") == f"\0tokenrouter/{os.getppid()}/small"


def test_round_trip_in_order_and_close_seen_on_both_sides() -> None:
    addr = _addr()
    got: queue.Queue = queue.Queue()
    closed = threading.Event()
    peers: list[ipc.Peer] = []

    def on_messages(peer: ipc.Peer, msgs: list) -> None:
        peers.append(peer)
        for m in msgs:
            got.put(m)
            peer.send([Commit(m.request_id, "small", [1, 2, 3])])  # answer on the same connection

    listener = ipc.ModelListener("small", on_messages, lambda p: closed.set(), addr=addr)
    events: queue.Queue = queue.Queue()
    lost = threading.Event()
    link = ipc.ModelLink("small", lambda evs: [events.put(e) for e in evs], lost.set, addr=addr)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        for i in range(50):
            link.send([Arrive(f"r{i}", [5, 6, 7], True, 3, params, {"x": i}, None, {})])
        link.send([Release("r0", "abort")])
        received = [got.get(timeout=5) for _ in range(51)]
        assert [m.request_id for m in received[:50]] == [f"r{i}" for i in range(50)]
        assert received[3].state == {"x": 3} and received[3].params.max_new_tokens == 4
        assert isinstance(received[50], Release) and received[50].reason == "abort"
        answers = [events.get(timeout=5) for _ in range(51)]
        assert all(isinstance(a, Commit) and a.token_ids == [1, 2, 3] for a in answers)
        # The router goes away: the subserver's side notices (it releases what that router brought).
        link.close()
        assert closed.wait(5)
        # A new connection works after that.
        link.send([Release("r1")])
        assert got.get(timeout=5).request_id == "r1"
        # The subserver goes away: the router's side notices.
        for p in peers:
            p.close()
        listener.close()
        assert lost.wait(5)
    finally:
        link.close()
        listener.close()


def test_malformed_batch_is_dropped_and_the_connection_keeps_working() -> None:
    addr = _addr()
    got: queue.Queue = queue.Queue()
    listener = ipc.ModelListener("m", lambda p, msgs: [got.put(m) for m in msgs], lambda p: None, addr=addr)
    try:
        conn = Client(addr, family="AF_UNIX")
        conn.send_bytes(b"not json")
        conn.send_bytes(b'[{"type": "Nope"}]')
        conn.send_bytes(b'[{"type": "Release", "request_id": "ok", "reason": "finished"}]')
        assert got.get(timeout=5).request_id == "ok"
        conn.close()
    finally:
        listener.close()


def test_unreachable_model_fails_fast_after_the_first_try() -> None:
    """...and is reported lost once, so that the router has it revived: a model whose process died while no link
    was connected to it (a router revived after it died) answered every request "not reachable", for ever."""
    lost: list[int] = []
    link = ipc.ModelLink("gone", lambda evs: None, lambda: lost.append(1), addr=_addr(), connect_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="'gone' is not reachable"):
        link.send([Release("a")])
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        link.send([Release("b")])  # within RETRY_AFTER_S: no second wait
    assert time.monotonic() - start < 0.1
    time.sleep(ipc.RETRY_AFTER_S)
    with pytest.raises(ConnectionError, match="'gone' is not reachable"):
        link.send([Release("c")])  # tried again, refused again: the same outage
    assert lost == [1]


def test_a_lost_model_fails_sends_at_once_until_it_is_reconnected() -> None:
    """The router's loop thread sends: once a model's process is gone, sends must not wait for it (a revive
    thread reconnects with `connect`, and sends go through again)."""
    addr = _addr()
    listener = ipc.ModelListener("m", lambda p, msgs: None, lambda p: None, addr=addr)
    accepted: list[ipc.Peer] = []
    listener._on_messages = lambda p, msgs: accepted.append(p)
    lost = threading.Event()
    link = ipc.ModelLink("m", lambda evs: None, lost.set, addr=addr, connect_timeout=1.0)
    try:
        link.send([Release("a")])
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        listener.close()
        accepted[0].close()  # the model's process exits
        assert lost.wait(5) and not link.connected
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(ConnectionError, match="'m' is unavailable"):
                link.send([Release("b")])
            assert time.monotonic() - start < 0.1
        with pytest.raises(ConnectionError):
            link.connect(timeout=0.2)  # still down
        listener = ipc.ModelListener("m", lambda p, msgs: None, lambda p: None, addr=addr)  # restarted
        link.connect()
        assert link.connected
        link.send([Release("c")])
    finally:
        link.close()
        listener.close()


def test_an_outage_a_send_reported_first_is_not_reported_again_when_the_reader_sees_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that breaks the connection closes it; the next send, before the reader thread has seen that close,
    is refused a new connection (the process is gone) and reports the outage. The reader thread's report of the
    same outage must not follow: each report has the model reloaded, and two reloaded it twice at once."""
    addr = _addr()
    listener = ipc.ModelListener("m", lambda p, msgs: None, lambda p: None, addr=addr)
    reader_may_close = threading.Event()
    closed_seen = threading.Event()
    original = ipc.ModelLink._closed

    def late_closed(self: ipc.ModelLink, peer: ipc.Peer) -> None:  # the reader thread, late
        reader_may_close.wait(5)
        original(self, peer)
        closed_seen.set()

    monkeypatch.setattr(ipc.ModelLink, "_closed", late_closed)
    lost: list[int] = []
    link = ipc.ModelLink("m", lambda evs: None, lambda: lost.append(1), addr=addr, connect_timeout=1.0)
    try:
        link.send([Release("a")])
        listener.close()  # the model's process exits
        link._peer.close()  # as a send that broke it does
        with pytest.raises(ConnectionError, match="'m' is not reachable"):
            link.send([Release("b")])
        assert lost == [1]
        reader_may_close.set()
        assert closed_seen.wait(5)
        assert lost == [1]
        with pytest.raises(ConnectionError, match="'m' is unavailable"):
            link.send([Release("c")])
        listener = ipc.ModelListener("m", lambda p, msgs: None, lambda p: None, addr=addr)  # revived
        link.connect()
        link.send([Release("d")])
        link._peer.close()  # the next outage is reported again, by the reader this time
        assert _wait_for(lambda: lost == [1, 1])
    finally:
        reader_may_close.set()
        link.close()
        listener.close()


def _wait_for(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def test_a_new_connection_is_greeted_before_anything_is_read_from_it() -> None:
    """`on_open` runs as a router's connection is accepted: what it sends (a subserver's heartbeat, which tells the
    router the model's KV pool) reaches the router first, before the answer to anything the router sends, on every
    new connection; an on_open that fails to send closes that connection alone."""
    from tokenrouter.transport.messages import Heartbeat

    addr = _addr()
    opened: list[ipc.Peer] = []

    def on_open(peer: ipc.Peer) -> None:
        opened.append(peer)
        peer.send([Heartbeat("m", 4096)])

    def on_messages(peer: ipc.Peer, msgs: list) -> None:
        peer.send([Commit(m.request_id, "m", [1]) for m in msgs])

    listener = ipc.ModelListener("m", on_messages, lambda p: None, addr=addr, on_open=on_open)
    events: queue.Queue = queue.Queue()
    link = ipc.ModelLink("m", lambda evs: [events.put(e) for e in evs], lambda: None, addr=addr)
    try:
        for round_ in range(2):
            link.send([Release(f"r{round_}")])
            first, second = events.get(timeout=5), events.get(timeout=5)
            assert isinstance(first, Heartbeat) and first.kv_tokens == 4096, first
            assert isinstance(second, Commit) and second.request_id == f"r{round_}", second
            link.close()  # the next round connects anew and is greeted again
        assert len(opened) == 2
    finally:
        link.close()
        listener.close()


def test_a_connection_that_lost_a_race_to_connect_is_not_a_lost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads of the router connect to one model at once (its watchdog, and the first request waiting for the
    models' pools): the one that finds the other's connection made closes its own. That closing is not the model
    going away: no `on_lost` (which made the router reload both models of a fresh server), and the link works on."""
    addr = _addr()
    got: queue.Queue = queue.Queue()
    listener = ipc.ModelListener("m", lambda p, msgs: [got.put(m) for m in msgs], lambda p: None, addr=addr)
    lost = threading.Event()
    link = ipc.ModelLink("m", lambda evs: None, lost.set, addr=addr)
    try:
        link.connect()
        first = link._peer
        real = ipc.ModelLink.connected
        seen = {"first": True}

        def connected(self) -> bool:  # the racing thread's first look: nothing connected yet
            if seen["first"]:
                seen["first"] = False
                return False
            return real.fget(self)

        monkeypatch.setattr(ipc.ModelLink, "connected", property(connected))
        link.connect()  # opens a second connection, finds the first one made, and closes its own
        monkeypatch.undo()
        assert link._peer is first and not seen["first"]
        assert not lost.wait(0.5)
        link.send([Release("r1")])
        assert got.get(timeout=5).request_id == "r1"
    finally:
        link.close()
        listener.close()
