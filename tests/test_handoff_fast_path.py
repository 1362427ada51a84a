"""A handoff's short way, served: the source's decoding loop writes a handoff step's events to the router's socket
itself when that cannot block (`Peer.try_send`, `SubserverModel._send_now`), and the router forwards a plain handoff
from the link's reader thread (`SocketCoordinator._from_link`). Neither may reorder what a model sends, wait on
the other process, or forward a request that was cancelled meanwhile."""

from __future__ import annotations

import queue
import random
import socket
import threading
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

from tokenrouter.config import load_config
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.serving.router_model import SocketCoordinator
from tokenrouter.serving.subserver_model import SubserverModel
from tokenrouter.transport import codec, ipc
from tokenrouter.transport.messages import Arrive, Commit, Handoff, Released

REPO = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0)


def _pair() -> tuple[ipc.Peer, Connection]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ipc.Peer(Connection(a.detach()), "test"), Connection(b.detach())


def test_try_send_never_waits_for_the_reader() -> None:
    peer, reader = _pair()
    sent: list[int] = []
    refused = threading.Event()

    def fill() -> None:  # the reader reads nothing meanwhile: a blocking send would hang here
        for i in range(10_000):
            if not peer.try_send([Commit(f"r{i}", "small", list(range(1000)))]):
                refused.set()
                return
            sent.append(i)

    t = threading.Thread(target=fill, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and refused.is_set() and sent, "try_send blocked or never refused"
    assert ipc._unread_bytes(peer.conn) > 0
    with peer._lock:  # another thread sending: refused at once, nothing written
        assert not peer.try_send([Commit("busy", "small", [1])])
    assert not peer.try_send([Commit("big", "small", [1] * ipc.NONBLOCKING_SEND_BYTES)])  # too big for the bound
    got = [codec.decode(reader.recv_bytes())[0].request_id for _ in sent]
    assert got == [f"r{i}" for i in sent]
    assert not reader.poll(0.2)  # the refused batches left nothing behind
    peer.try_send([Commit("after", "small", [1])])  # read out: room again
    assert codec.decode(reader.recv_bytes())[0].request_id == "after"
    peer.close()
    reader.close()


def test_try_send_keeps_to_a_small_send_buffer() -> None:
    """Where the socket's send buffer is small, try_send's bound shrinks with it (a quarter of it)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # Linux doubles it: 16 KiB, so 4 KiB may go at once
    peer, reader = ipc.Peer(Connection(a.detach()), "test"), Connection(b.detach())
    assert not peer.try_send([Commit("big", "small", [1] * 3000)])  # ~9 KB of JSON
    assert peer.try_send([Commit("small", "small", [1] * 100)])
    assert codec.decode(reader.recv_bytes())[0].request_id == "small"
    peer.close()
    reader.close()


class _Counts:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def observe(self, events: list[Any]) -> None:
        self.events.extend(events)


def _responding_subserver(peer: ipc.Peer, request_ids: list[str]) -> SubserverModel:
    """A SubserverModel's outgoing half (its queue, response thread and direct sends) over `peer`, without a model."""
    m = SubserverModel.__new__(SubserverModel)
    m._events = queue.SimpleQueue()
    m._queued_lock, m._queued = threading.Lock(), 0
    m._lock, m._owner = threading.Lock(), dict.fromkeys(request_ids, peer)
    m._stop = threading.Event()
    m._report_every = None
    m.metrics = _Counts()
    return m


def test_direct_sends_keep_the_order_of_queued_events() -> None:
    """The loop emits through the queue and, after handoffs, directly, while the response thread drains the queue:
    the router reads every event once, in the order emitted (a direct send goes only when the response thread holds
    nothing unsent)."""
    peer, reader = _pair()
    m = _responding_subserver(peer, [f"r{i}" for i in range(8)])
    responses = threading.Thread(target=m._send_forever, daemon=True)
    responses.start()
    got: list[tuple[str, int]] = []
    reading = threading.Thread(target=lambda: _read_into(reader, got), daemon=True)
    reading.start()
    rng = random.Random(0)
    emitted: list[tuple[str, int]] = []
    direct = 0
    try:
        for n in range(3000):
            ev = Commit(f"r{n % 8}", "small", [n])
            emitted.append((ev.request_id, n))
            if rng.random() < 0.3 and m._send_now([ev]):  # a handoff's step: directly if they may go
                direct += 1
            else:
                m._queue_event(ev)
            if n % 16 == 0:
                time.sleep(0.0005)  # a step's time: the response thread catches up now and then
        deadline = time.monotonic() + 10
        while len(got) < len(emitted) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == emitted
        assert 0 < direct < 0.3 * len(emitted) and m._queued == 0  # both ways were taken
        assert len(m.metrics.events) == len(emitted)  # every event counted once, whichever way it left
    finally:
        m._stop.set()
        responses.join(5)
        peer.close()
        reader.close()


def _read_into(reader: Connection, got: list) -> None:
    try:
        while True:
            got += [(e.request_id, e.token_ids[0]) for e in codec.decode(reader.recv_bytes())]
    except (EOFError, OSError):
        pass


def test_a_direct_send_frees_the_owner_of_a_released_request() -> None:
    peer, reader = _pair()
    m = _responding_subserver(peer, ["a", "b"])
    assert m._send_now([Commit("a", "small", [1]), Released("a", "small", 3, 0)])
    assert "a" not in m._owner and "b" in m._owner
    assert [type(e).__name__ for e in codec.decode(reader.recv_bytes())] == ["Commit", "Released"]
    m._owner["c"] = None  # a request whose router went away: not this way (the queue drops it)
    assert not m._send_now([Commit("b", "small", [2]), Commit("c", "small", [3])])
    peer.close()
    reader.close()


def test_a_direct_send_to_a_router_gone_closes_its_connection() -> None:
    peer, reader = _pair()
    m = _responding_subserver(peer, ["a"])
    reader.close()  # the router's process went away
    assert not m._send_now([Commit("a", "small", [1])])  # the queue takes it (and drops it: its router is gone)
    assert peer.closed and m.metrics.events == []


def test_a_link_sends_at_once_only_on_an_open_connection() -> None:
    addr = f"\0tokenrouter-test/{uuid.uuid4().hex}"
    got: queue.Queue = queue.Queue()
    listener = ipc.ModelListener("large", lambda p, msgs: [got.put(x) for x in msgs], lambda p: None, addr=addr)
    link = ipc.ModelLink("large", lambda evs: None, lambda: None, addr=addr)
    try:
        arrive = Arrive("r", [1, 2], True, 2, PARAMS, {}, "small", {"small": 2})
        assert not link.try_send([arrive])  # not connected: no connecting from a reader thread
        link.connect()
        assert link.try_send([arrive])
        assert got.get(timeout=5).request_id == "r"
    finally:
        link.close()
        listener.close()


class _Loop:
    """What the coordinator posts to its loop (nothing runs it)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.log.append(("loop", fn.__name__, args))


def _coordinator(tiny_dir: Path, log: list, sends: bool = True) -> SocketCoordinator:
    """The router's coordinator over the tiny pair, its loop a log; `sends`: its links take every Arrive at once (the
    links' own `try_deliver` otherwise: nothing is connected here, so it sends nothing)."""
    cfg = yaml.safe_load((REPO / "config" / "random" / "tiny-small_tiny-large.yaml").read_text())
    for name, m in cfg["models"].items():
        m["path"] = str(tiny_dir / name)
    coord = SocketCoordinator(load_config(cfg), _Loop(log))
    coord.transport.deliver = lambda model, msg: log.append(("deliver", model, msg))
    if sends:
        coord.transport.try_deliver = lambda model, msg: log.append(("now", model, msg)) or True
    return coord


def _handoff(rid: str, seen: dict[str, int]) -> Handoff:
    return Handoff("small", "large", Arrive(rid, [9, 10], True, 3, PARAMS, {"k": 1}, "small", seen))


def _admitted(coord: SocketCoordinator, log: list, n: int = 1) -> list[str]:
    ids = [coord.add_request([5, 6, 7 + i], PARAMS) for i in range(n)]
    log.clear()
    return ids


def test_the_router_forwards_a_plain_handoff_from_the_reader_thread(tiny_dir: Path) -> None:
    log: list = []
    coord = _coordinator(tiny_dir, log)
    (rid,) = _admitted(coord, log)
    commit = Commit(rid, "small", [9])
    coord._from_link([commit, _handoff(rid, {"small": 4, "large": 4})])
    # The rest of the batch is on the loop's queue before the Arrive leaves: the target's answers come after it.
    assert [entry[0] for entry in log] == ["loop", "now"]
    assert log[0][1] == "_handle_events" and log[0][2] == ([commit],)
    assert log[1][1] == "large" and log[1][2].request_id == rid
    req = coord.requests[rid]
    assert req.owner == "large" and req.holders == {"small", "large"} and req.handoffs == 1
    assert req.seen == {"small": 4, "large": 4} and req.route_state == {"k": 1}


def test_the_loop_keeps_what_is_not_a_plain_handoff(tiny_dir: Path) -> None:
    """A handoff of a request cancelled meanwhile is not forwarded from the reader thread: the loop drops it."""
    log: list = []
    coord = _coordinator(tiny_dir, log)
    (cancelled,) = _admitted(coord, log)
    coord.abort(cancelled)
    log.clear()
    late = _handoff(cancelled, {"small": 4, "large": 4})
    coord._from_link([late])
    assert log == [("loop", "_handle_events", ([late],))]
    assert coord.requests[cancelled].holders == {"small"}  # the Release to small went out; large never held it


def test_a_handoff_that_cannot_go_at_once_is_the_loops(tiny_dir: Path) -> None:
    """Its target's link not connected (the model's process just exited: routing around it, the loop must take the
    request back rather than fail it), or a peer server's model, or a full socket: `try_deliver` sends nothing, and
    the loop gets the handoff with the request untouched. A relay that raises goes the same way."""
    log: list = []
    coord = _coordinator(tiny_dir, log, sends=False)
    rid, other = _admitted(coord, log, 2)
    ev = _handoff(rid, {"small": 4, "large": 4})
    coord._from_link([ev])
    assert log == [("loop", "_handle_events", ([ev],))]
    assert coord.requests[rid].holders == {"small"} and coord.requests[rid].owner == "small"
    log.clear()

    def broken(model: str, msg: Arrive) -> bool:
        raise RuntimeError("boom")

    coord.transport.try_deliver = broken
    ev = _handoff(other, {"small": 3, "large": 3})
    coord._from_link([ev])
    assert log == [("loop", "_handle_events", ([ev],))]
    assert coord.requests[other].holders == {"small"}


def test_a_reader_thread_never_waits_on_a_busy_coordinator(tiny_dir: Path) -> None:
    """While another thread holds the coordinator's lock (the loop inside a long send, say), a batch without a
    handoff goes to the loop at once and one with a handoff after FORWARD_LOCK_WAIT_S: a reader keeps reading, so the
    models it hears from are not taken for silent."""
    from tokenrouter.serving import router_model

    log: list = []
    coord = _coordinator(tiny_dir, log)
    (rid,) = _admitted(coord, log)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with coord._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)
    try:
        commit = Commit(rid, "small", [9])
        start = time.monotonic()
        coord._from_link([commit])
        assert time.monotonic() - start < router_model.FORWARD_LOCK_WAIT_S
        ev = _handoff(rid, {"small": 4, "large": 4})
        coord._from_link([commit, ev])
        assert time.monotonic() - start < 1.0
        assert log == [("loop", "_handle_events", ([commit],)), ("loop", "_handle_events", ([commit, ev],))]
        assert coord.requests[rid].holders == {"small"}
    finally:
        release.set()
        holder.join(5)

