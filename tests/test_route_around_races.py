"""Routing around a model whose process died (model_down: route_around), at the router's coordinator, driven through
its real socket transport and an event loop run by hand: what the links' reader threads post, in the order they post
it. Only the entry model's link is a fake that records what it is sent; the large model's link is in the state its
reader thread leaves when the process's socket closes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from tokenrouter.config import load_config
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.serving.router_model import SocketCoordinator
from tokenrouter.transport.messages import Arrive, Commit, Handoff, Release, Released, Unavailable

REPO = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0)


class _RecordingLink:
    """The entry model's link: takes every batch at once and keeps it."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, messages: list) -> None:
        self.sent.extend(messages)

    def connect(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def _run(loop: asyncio.AbstractEventLoop) -> None:
    """Run what the loop has queued, and what that queues in turn, until nothing is left."""
    while loop._ready:  # (asyncio's queue of callbacks due now: nothing here waits on a timer)
        loop.call_soon(loop.stop)
        loop.run_forever()


@pytest.fixture
def coordinator(tiny_dir: Path):
    cfg = yaml.safe_load((REPO / "config" / "random" / "tiny-small_tiny-large.yaml").read_text())
    for name, m in cfg["models"].items():
        m["path"] = str(tiny_dir / name)
    cfg["model_down"] = "route_around"
    loop = asyncio.new_event_loop()
    coord = SocketCoordinator(load_config(cfg), loop)
    small = coord.transport.links["small"] = _RecordingLink()
    large = coord.transport.links["large"]
    # As ModelLink._closed leaves it once its process's socket closed: every send fails at once.
    large._ever_connected, large._down_until = True, float("inf")
    large._down_error = "model 'large' is unavailable: its process exited"
    yield coord, loop, small
    coord.transport.closing = True
    loop.close()


def test_a_handoff_to_a_model_that_just_died_is_taken_back_not_failed(coordinator) -> None:
    """The small model's handoff reached the loop before it learnt that the large model's socket closed (the two
    links' reader threads post independently): the loop forwards it, the send fails (its failure is posted), then
    routing around the model takes the request back to the small model. The failed send's Failed, handled last, is
    about a model that no longer holds the request: the request goes on, and ends whole."""
    coord, loop, small = coordinator
    rid = coord.add_request([5, 6, 7], PARAMS)
    handoff = Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {"k": 1}, "small",
                                               {"small": 4, "large": 4}))
    loop.call_soon_threadsafe(coord._handle_events, [handoff])  # small's reader thread
    loop.call_soon_threadsafe(coord._model_gone, "large")  # large's reader thread, at its socket's end
    _run(loop)
    req = coord.requests[rid]
    assert req.owner == "small" and req.holders == {"small"}
    assert not req.finished and req.error is None, req.error
    back = [m for m in small.sent if isinstance(m, Arrive) and not m.first_visit]
    assert len(back) == 1 and back[0].source == "large" and back[0].tokens == []
    assert not any(isinstance(m, Release) for m in small.sent), small.sent
    assert any(isinstance(m, Unavailable) and m.models == ["large"] for m in small.sent)
    # The small model finishes it: one final output, whole.
    outputs = []
    req.listener = outputs.append
    coord._handle_events([Commit(rid, "small", [11], "length"), Released(rid, "small", 4, 0)])
    assert rid not in coord.requests
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    assert outputs[-1].finish_reason == "length" and outputs[-1].error is None and outputs[-1].token_ids == [11]


def test_a_failed_send_handled_before_the_loss_is_read_takes_the_request_back(coordinator) -> None:
    """The other order (a CI failure of tests/test_route_around_three.py): the large model's reader thread posts its
    socket's end only after the failed send's callback ran. The request must go on at the small model, with the
    large model's KV forgotten in what it has seen, rather than fail; the loss read later changes nothing for it."""
    coord, loop, small = coordinator
    rid = coord.add_request([5, 6, 7], PARAMS)
    handoff = Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {"k": 1}, "small",
                                               {"small": 4, "large": 4}))
    coord._handle_events([handoff])
    _run(loop)  # the send failed and its callback ran; the loss is not read yet
    req = coord.requests[rid]
    assert not req.finished and req.error is None, req.error
    assert req.owner == "small" and req.holders == {"small"}
    back = [m for m in small.sent if isinstance(m, Arrive) and not m.first_visit]
    assert len(back) == 1 and back[0].source == "large" and "large" not in back[0].seen, back
    coord._model_gone("large")
    _run(loop)
    assert not req.finished and req.holders == {"small"} and "large" not in req.seen
    assert len([m for m in small.sent if isinstance(m, Arrive) and not m.first_visit]) == 1
    assert not any(isinstance(m, Release) for m in small.sent), small.sent


def test_a_failed_send_fails_the_request_when_not_routing_around(coordinator) -> None:
    """model_down: refuse (the default): a send that fails ends its request with that error, once."""
    coord, loop, small = coordinator
    coord.config.model_down = "refuse"
    rid = coord.add_request([5, 6, 7], PARAMS)
    coord._handle_events([Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {}, "small",
                                                           {"small": 4, "large": 4}))])
    _run(loop)
    req = coord.requests[rid]
    assert req.finished and "large" in req.error and "unavailable" in req.error, req.error
    assert [m.request_id for m in small.sent if isinstance(m, Release)] == [rid]


def test_what_a_dead_model_sent_before_it_died_is_dropped_once_its_request_was_taken_back(coordinator) -> None:
    """The large model sent a commit and handed its request back to the small model just before it died; the router
    learnt of its death first (a send to it failed) and took the request back to the small model. What its reader
    thread read off the socket afterwards is stale: that model no longer holds the request. Relaying the handoff
    would make the small model take a request it is already running ("returned but is not parked here": a CI
    failure of tests/test_faults.py::test_routing_around_a_killed_subserver), and the commit would add tokens the
    small model computes again."""
    coord, loop, small = coordinator
    rid = coord.add_request([5, 6, 7], PARAMS)
    coord._handle_events([Commit(rid, "small", [9], None)])
    # The handoff to the large model went out (as from small's reader thread) and it took the request on.
    to_large = Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {}, "small",
                                                {"small": 4, "large": 4}))
    assert coord._forward_now(to_large, lambda model, msg: True)
    coord._model_gone("large")
    _run(loop)
    req = coord.requests[rid]
    assert req.owner == "small" and req.holders == {"small"} and req.output_ids == [9]
    sent = len(small.sent)
    # Read off the dead model's socket after the router took the request back: both on the loop and as the reader
    # thread would relay the handoff itself.
    back = Handoff("large", "small", Arrive(rid, [10], False, 3, PARAMS, {}, "large", {"small": 5, "large": 5}))
    assert not coord._forward_now(back, lambda model, msg: True)
    coord._handle_events([Commit(rid, "large", [10], None), back])
    _run(loop)
    assert req.output_ids == [9] and req.owner == "small" and req.holders == {"small"}
    assert not [m for m in small.sent[sent:] if isinstance(m, Arrive)], small.sent[sent:]
    assert not req.finished and req.error is None


def test_the_router_learns_the_pools_from_heartbeats_and_tells_the_models(coordinator) -> None:
    """Each model's first heartbeat carries its KV pool: a new request's Arrive then carries the smallest other
    pool (the entry's admission budget) and every Arrive the deployment's longest request (the smallest pool of
    all), at which each model stops a request as at its own limit."""
    from tokenrouter.transport.messages import Heartbeat

    coord, loop, small = coordinator
    coord._handle_events([Heartbeat("small", 4096), Heartbeat("large", 1024)])
    assert coord.pool_tokens == {"small": 4096, "large": 1024} and coord.kv_budget() == 1024
    coord.add_request([5, 6, 7], PARAMS)
    arrive = [m for m in small.sent if isinstance(m, Arrive)][-1]
    assert arrive.kv_budget == 1024 and arrive.max_len == 1024


def test_a_prompt_the_smallest_pool_cannot_hold_is_refused_at_once(coordinator) -> None:
    """Once the models have told the router their pools, a prompt of the smallest pool's length or more is refused
    when it is added, naming the limit, before any model prefills it (each model would stop it there: it could
    only fail later, after the entry model's prefill). One token shorter is taken."""
    from tokenrouter.transport.messages import Heartbeat

    coord, loop, small = coordinator
    declared = coord.max_model_len
    assert declared > 1024
    coord._handle_events([Heartbeat("small", 4096), Heartbeat("large", 1024)])
    assert coord.context_limit() == 1024
    sent = len(small.sent)
    with pytest.raises(ValueError, match="prompt has 1024 tokens, but the context limit is 1024, the smallest KV pool"):
        coord.add_request([5] * 1024, PARAMS)
    assert small.sent[sent:] == [] and not coord.requests
    coord.add_request([5] * 1023, PARAMS)
    assert [m for m in small.sent[sent:] if isinstance(m, Arrive)]
    # A text prompt longer than the pool's tokens could cover is refused by its length alone, before it is tokenized
    per_token = coord._prompt_bound().max_chars // 1024
    with pytest.raises(ValueError, match="more than a context limit of 1024 tokens can hold"):
        coord.tokenize("a" * (1024 * per_token + 1))


def test_the_first_requests_wait_for_the_models_pools_once(tiny_dir: Path) -> None:
    """tritonserver may report ready before the router has connected to the last model loaded. The first request
    (`await_pools`, on a tokenizing thread) connects to each model and waits until its greeting heartbeat, sent as
    the model accepts the connection, has told the router its KV pool: a prompt the smallest pool cannot hold is then
    refused from the first request on. A model that never greets holds that first wait for its timeout only; every
    later request goes through at once."""
    import os
    import threading
    import time
    import uuid

    from tokenrouter.transport import ipc
    from tokenrouter.transport.messages import Heartbeat

    cfg = yaml.safe_load((REPO / "config" / "random" / "tiny-small_tiny-large.yaml").read_text())
    for name, m in cfg["models"].items():
        m["path"] = str(tiny_dir / name)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    coord = SocketCoordinator(load_config(cfg), loop)
    listeners = []
    try:
        for name, link in coord.transport.links.items():
            link.address = f"\0tokenrouter-test/{os.getpid()}/{uuid.uuid4().hex}"
            # The large model greets; the small one (as a subserver from before greetings) does not.
            greet = (lambda p: p.send([Heartbeat("large", 1024)])) if name == "large" else None
            listeners.append(ipc.ModelListener(name, lambda p, msgs: None, lambda p: None, addr=link.address,
                                               on_open=greet))
        assert coord.pool_tokens == {} and coord.context_limit() == coord.max_model_len > 1024
        start = time.monotonic()
        coord.await_pools(timeout=0.5)
        waited = time.monotonic() - start
        assert coord.pool_tokens == {"large": 1024} and 0.5 <= waited < 3.0, (coord.pool_tokens, waited)
        with pytest.raises(ValueError, match="context limit is 1024, the smallest KV pool"):
            coord.tokenize([5] * 1024)
        start = time.monotonic()
        coord.await_pools(timeout=0.5)  # settled: no second wait for the model that never greets
        assert time.monotonic() - start < 0.1
    finally:
        coord.transport.closing = True
        for link in coord.transport.links.values():
            link.close()
        for listener in listeners:
            listener.close()
        loop.call_soon_threadsafe(loop.stop)


def test_the_first_requests_wait_for_a_peer_servers_pool_too(tiny_dir: Path) -> None:
    """A model on a peer server (`url:`, a GrpcLink) is waited for as a local one is: `await_pools` connects to it,
    and its greeting, relayed by the peer's gateway, arrives on the link's reader thread. Left out, the first
    requests of a cross-node deployment went in before any pool of the peer's was known: neither the admission
    budget nor the longest request held for them."""
    import threading
    import time

    from tokenrouter.transport.messages import Heartbeat

    cfg = yaml.safe_load((REPO / "config" / "random" / "tiny-small_tiny-large.yaml").read_text())
    for name, m in cfg["models"].items():
        m["path"] = str(tiny_dir / name)
    cfg["models"]["large"]["url"] = "127.0.0.1:1"  # never dialled: its link is the stand-in below
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    coord = SocketCoordinator(load_config(cfg), loop)
    assert type(coord.transport.links["large"]).__name__ == "GrpcLink"

    class _PeerLink:
        """Connecting opens the peer's stream; its greeting comes back on the stream's thread."""

        connected = False

        def connect(self, timeout: float | None = None) -> None:
            self.connected = True
            threading.Timer(0.05, coord._from_link, args=([Heartbeat("large", 1024)],)).start()

        def close(self) -> None:
            pass

    coord.transport.links["small"] = _RecordingLink()
    coord.transport.links["large"] = peer = _PeerLink()
    coord.pool_tokens["small"] = 4096  # (known already: the wait is for the peer's alone)
    try:
        start = time.monotonic()
        coord.await_pools(timeout=10.0)
        assert peer.connected and coord.pool_tokens == {"small": 4096, "large": 1024}
        assert time.monotonic() - start < 5  # it ended with the greeting, not at its timeout
        assert coord.kv_budget() == 1024 and coord.context_limit() == 1024
    finally:
        coord.transport.closing = True
        loop.call_soon_threadsafe(loop.stop)


def test_a_peer_never_reached_is_marked_down_and_the_request_goes_on_without_it(coordinator) -> None:
    """A model on a peer server that refuses the connection from the first send (a GrpcLink to a port nothing
    listens on). Its refusal reports the outage, as a local model's does: the model is marked down and the entry
    model told, so the request that was handed to it is taken back once and not handed to it again. (Before, the
    link never reported it: routing around took the request back on every handoff, the entry model handed it
    over again, and the request made no progress for ever; a review found it.)"""
    from tokenrouter.transport.grpc_link import GrpcLink

    coord, loop, small = coordinator
    transport = coord.transport
    coord.config.models["large"].url = "127.0.0.1:1"
    transport.links["large"] = GrpcLink("large", "127.0.0.1:1", transport.on_items, lambda: transport._lost("large"),
                                        connect_timeout=0.1)
    rid = coord.add_request([5, 6, 7], PARAMS)
    coord._handle_events([Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {}, "small",
                                                           {"small": 4}))])
    _run(loop)
    req = coord.requests[rid]
    assert "large" in coord.down and not req.finished and req.owner == "small", (coord.down, req.error)
    assert any(isinstance(m, Unavailable) and m.models == ["large"] for m in small.sent), small.sent
    # The entry model hands it over again before it reads the Unavailable: taken back at once, no send tried.
    coord._handle_events([Handoff("small", "large", Arrive(rid, [5, 6, 7, 9], True, 3, PARAMS, {}, "small",
                                                           {"small": 4}))])
    _run(loop)
    assert not req.finished and req.owner == "small"
    assert len([m for m in small.sent if isinstance(m, Arrive) and not m.first_visit]) == 2
