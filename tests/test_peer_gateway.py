"""The peer gateway (serving/peer_model.py) on a real tritonserver: a model served in peer mode answers a
remote router's messages over Triton gRPC streaming with the same events a local router gets over its
socket; its greedy tokens equal the in-process engine's; a bad message fails that request alone; and a
router that goes away (its stream closed) has its requests released on the peer, KV and all."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tokenrouter import Engine, SamplingParams
from tokenrouter.serving import triton_install
from tokenrouter.serving.repository import write_repository
from tokenrouter.serving.server import TritonServer, free_ports
from tokenrouter.transport import codec
from tokenrouter.transport.grpc_link import peer_model_name
from tokenrouter.transport.messages import Arrive, Commit, Heartbeat, Release, Released
from triton_harness import metrics, served_again, stream_text

PROMPT = [5, 9, 17, 33, 65, 129]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def peer(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("peer")
    # A deployment whose one model lives on a peer (`url`): in peer mode this server is that peer.
    cfg = {"models": {"large": {"path": str(tiny_dir / "large"), "kv_cache_tokens": 2048, "url": "127.0.0.1:1"}},
           "entry": "large"}
    config = work / "peer.yaml"
    config.write_text(yaml.safe_dump(cfg))
    repo = write_repository(config, work / "repository", execution_env=triton_install.execution_env(), peer=True)
    http, grpc, port_metrics = free_ports(3)
    server = TritonServer(repo, http, grpc, port_metrics, log_file=work / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(timeout=240)
        yield server, config
    finally:
        server.stop()


class Router:
    """A minimal remote router: one gRPC stream, one connection, messages in, events out."""

    def __init__(self, url: str, conn: str) -> None:
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.conn = conn
        self.events: queue.Queue = queue.Queue()
        self.errors: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_result)
        self._request(None, "open")

    def _on_result(self, result, error) -> None:
        if error is not None:
            self.errors.put(str(error))
            return
        out = result.as_numpy("tokenrouter_events")
        if out is not None:
            for ev in codec.decode(out.reshape(-1)[0]):
                self.events.put(ev)

    def _request(self, body: str | None, rid: str) -> None:
        conn = self.grpc.InferInput("tokenrouter_connection", [1], "BYTES")
        conn.set_data_from_numpy(np.array([self.conn.encode()], dtype=np.object_))
        inputs = [conn]
        if body is not None:
            msgs = self.grpc.InferInput("tokenrouter_messages", [1], "BYTES")
            msgs.set_data_from_numpy(np.array([body.encode()], dtype=np.object_))
            inputs.append(msgs)
        self.client.async_stream_infer(peer_model_name("large"), inputs, request_id=rid)

    def send(self, messages: list, rid: str) -> None:
        self._request(codec.encode(messages), rid)

    def until_released(self, request_id: str, timeout: float = 60.0) -> list:
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            got.append(ev)
            if isinstance(ev, Released) and ev.request_id == request_id:
                return got
        errors = list(self.errors.queue)
        raise AssertionError(f"no Released for {request_id} in {timeout} s; got {got}, errors {errors}")

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def arrive(request_id: str, params: SamplingParams = GREEDY) -> Arrive:
    return Arrive(request_id, list(PROMPT), True, len(PROMPT), params)


@pytest.mark.slow
def test_a_remote_router_gets_the_local_events_and_tokens(peer, tiny_dir: Path) -> None:
    server, config = peer
    router = Router(server.grpc_url, "router-a")
    try:
        router.send([arrive("q1")], "m1")
        events = router.until_released("q1")
    finally:
        router.close()
    # First, the subserver's greeting, relayed as the connection opened: the router learns the model's KV pool before
    # any event of its first request (dropped, it learnt it from a heartbeat after 1 s of quiet, too late for those).
    assert isinstance(events[0], Heartbeat) and events[0].model == "large" and events[0].kv_tokens == 2048, events[:2]
    tokens = [t for ev in events if isinstance(ev, Commit) for t in ev.token_ids]
    assert [ev.finish_reason for ev in events if isinstance(ev, Commit)][-1] == "length"
    local = yaml.safe_load(config.read_text())
    del local["models"]["large"]["url"]
    with Engine.from_config(local) as engine:
        expected = engine.generate(PROMPT, GREEDY)[0].token_ids
    assert tokens == expected


@pytest.mark.slow
def test_bad_messages_fail_alone_and_a_router_that_goes_away_is_released(peer) -> None:
    server, _ = peer
    router = Router(server.grpc_url, "router-b")
    try:
        router._request("not json", "bad")
        router.send([Release("nothing-here")], "harmless")
        long = SamplingParams(max_new_tokens=400, ignore_eos=True, temperature=0.0)
        router.send([arrive("q2", long)], "m2")
        deadline = time.monotonic() + 30
        while router.events.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not router.events.empty(), "the request never started"
        assert router.errors.get(timeout=10)  # the malformed request's own error
    finally:
        router.close()  # the router goes away mid-request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        held = m.get('tokenrouter_requests_held{model="large"}', 1)
        if held == 0 and m.get('tokenrouter_kv_blocks_used{model="large"}', 1) == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the peer still holds the router's request: {metrics(server)}")
    # And it keeps serving the next router.
    again = Router(server.grpc_url, "router-c")
    try:
        again.send([arrive("q3")], "m3")
        assert any(isinstance(ev, Commit) for ev in again.until_released("q3"))
    finally:
        again.close()


def _start(server: TritonServer) -> TritonServer:
    server.start()
    server.wait_ready(timeout=240)
    return server


class NamespacedServer(TritonServer):
    """tritonserver inside the network namespace `netns` (its own loopback and a veth address `host`):
    reachable from here only over that link, as a server on another machine would be."""

    def __init__(self, *args, netns: str, host: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.netns, self.host = netns, host  # `host`: its health checks and URLs go over the veth link

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command()]


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (name, address inside it, this side's veth);
    skipped where namespaces cannot be made (no root, no `ip`)."""
    name, n = f"trpeer{os.getpid() % 10000}", os.getpid() % 200 + 20
    host_if, peer_if = f"trh{n}", f"trp{n}"
    here, there = f"10.231.{n}.1", f"10.231.{n}.2"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if],
        ["ip", "link", "set", peer_if, "netns", name],
        ["ip", "addr", "add", f"{here}/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{there}/30", "dev", peer_if],
        ["ip", "netns", "exec", name, "ip", "link", "set", peer_if, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for cmd in steps:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        pytest.skip(f"cannot make a network namespace here ({detail}): needs root and iproute2")
    try:
        yield name, there, host_if
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes the veth pair with it


def _cross_node(tiny_dir: Path, tmp_path: Path, peer_host: str, make_peer, partition: str | None = None) -> None:
    """The router's server holds `small`; `large` is on a peer server at `peer_host` (`url:`). Routed greedy
    output equals the in-process engine's with both models local; the peer dying mid-request (or, with
    `partition`, the network interface of that name going down: no reset, packets just vanish) fails that
    request with a clear error, the router keeps answering (refusing while the peer is away), and once the
    peer is back the router reconnects and serves routed requests again."""
    from triton_harness import generate_stream

    env = triton_install.execution_env()
    peer_ports = free_ports(3)
    policy = {"name": "random", "p": 0.3, "seed": 0}
    # The small model's pool is the larger: the deployment's KV budget (the smallest pool of the models other than the
    # entry) can only be the peer's, which the router learns from its greeting heartbeat relayed over gRPC.
    models = {"small": {"path": str(tiny_dir / "small"), "kv_cache_tokens": 8192},
              "large": {"path": str(tiny_dir / "large"), "kv_cache_tokens": 4096,
                        "url": f"{peer_host}:{peer_ports[1]}"}}
    deployment = {"models": models, "entry": "small", "policy": policy, "tokenizer": str(tiny_dir / "tokenizer")}
    config = tmp_path / "deployment.yaml"
    config.write_text(yaml.safe_dump(deployment, sort_keys=False))  # model order: small, large
    local = dict(deployment, models={k: {kk: vv for kk, vv in v.items() if kk != "url"} for k, v in models.items()})
    body = {"text_input": "def fibonacci(n):", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 24, "temperature": 0, "ignore_eos": True}),
            "return_routing_stats": True}
    # Both servers read the same deployment: the peer serves the models with a url, the router the others.
    peer_repo = write_repository(config, tmp_path / "peer_repo", execution_env=env, peer=True)
    router_repo = write_repository(config, tmp_path / "router_repo", execution_env=env)
    assert not (router_repo / "large").exists() and (peer_repo / peer_model_name("large")).is_dir()
    assert not (peer_repo / "small").exists() and not (peer_repo / "tokenrouter").exists()

    peer = _start(make_peer(peer_repo, peer_ports, tmp_path / "peer.log"))
    router = _start(TritonServer(router_repo, *free_ports(3), log_file=tmp_path / "router.log"))
    try:
        status, events = generate_stream(router, body)
        assert status == 200 and not any("error" in e for e in events), events
        # Known before the first request was admitted (`await_pools`), not a heartbeat interval later.
        assert metrics(router)['tokenrouter_kv_budget_tokens{model="tokenrouter"}'] == 4096
        text = stream_text(events)
        with Engine.from_config(local) as engine:
            ref = engine.generate("def fibonacci(n):", SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                        ignore_eos=True))[0]
        assert text == ref.text and ref.stats["tokens_per_model"].get("large", 0) > 0, (events[-1], router.log_file)

        # The peer dies while a long request is routed across: that request fails with a clear error.
        long = dict(body, sampling_parameters=json.dumps({"max_tokens": 3000, "temperature": 0, "ignore_eos": True}))
        link = lambda state: subprocess.run(["ip", "link", "set", partition, state], check=True)  # noqa: E731
        killer = threading.Timer(2.0, peer.stop if partition is None else lambda: link("down"))
        killer.start()
        started = time.monotonic()
        status, events = generate_stream(router, long, timeout=120)
        killer.join()
        errors = [e["error"] for e in events if "error" in e]
        assert status >= 400 or errors, events
        assert "large" in " ".join(errors) + str(events)
        if partition is not None:  # found by keepalive (a ping after 10 s, 5 s to answer), not never
            assert time.monotonic() - started < 2.0 + 45, time.monotonic() - started
        # The router keeps answering: it refuses while the peer is away, saying why.
        status, events = generate_stream(router, body)
        assert status >= 400 or any("error" in e for e in events)
        assert "peer server" in json.dumps(events)

        if partition is None:
            peer = _start(make_peer(peer_repo, peer_ports, tmp_path / "peer2.log"))
        else:
            link("up")
        assert stream_text(served_again(router, body, 60, "the router did not reconnect to the peer")) == ref.text
        assert router.proc.poll() is None
    finally:
        router.stop()
        peer.stop()


@pytest.mark.slow
def test_two_servers_route_across_nodes_and_survive_the_peer_dying(tiny_dir: Path, tmp_path: Path) -> None:
    _cross_node(tiny_dir, tmp_path, "127.0.0.1",
                lambda repo, ports, log: TritonServer(repo, *ports, log_file=log))


@pytest.mark.slow
def test_a_peer_in_its_own_network_namespace(tiny_dir: Path, tmp_path: Path, netns) -> None:
    """The same with the peer in a network namespace of its own, reached over a veth pair: nothing but
    Triton gRPC crosses between the servers (the abstract local sockets are per namespace)."""
    name, address, _ = netns
    _cross_node(tiny_dir, tmp_path, address,
                lambda repo, ports, log: NamespacedServer(repo, *ports, log_file=log, netns=name, host=address))


@pytest.mark.slow
def test_a_silent_partition_between_the_nodes(tiny_dir: Path, tmp_path: Path, netns) -> None:
    """The link to the peer's namespace goes down mid-request: no process dies and no connection is reset,
    so only gRPC keepalive can tell; the request fails with a clear error, and routing resumes once the link
    is back up."""
    name, address, host_if = netns
    _cross_node(tiny_dir, tmp_path, address,
                lambda repo, ports, log: NamespacedServer(repo, *ports, log_file=log, netns=name, host=address),
                partition=host_if)


class _Error:
    def __init__(self, text: str, status: str | None = None) -> None:
        self.text, self.code = text, status

    def message(self) -> str:
        return self.text

    def status(self) -> str | None:
        return self.code


class _Result:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def as_numpy(self, name: str):
        return np.array([self.payload], dtype=np.object_)


def test_grpc_link_settles_refusals_and_ends_on_closed_or_broken_streams() -> None:
    """Without a server: a batch the peer refuses fails exactly its requests (they would wait forever
    otherwise); an error that ends the connection, a stream failure or undecodable events end the link."""
    from tokenrouter.transport.grpc_link import BATCH_PREFIX, CONNECTION_CLOSED, GrpcLink
    from tokenrouter.transport.messages import Failed

    got, lost = [], []
    link = GrpcLink("large", "127.0.0.1:1", got.extend, lambda: lost.append(1))
    link._conn, link._client = "c1", None
    link._sent["m7"] = ["r1", "r2"]
    link._on_result("c1", None, _Error(f"{BATCH_PREFIX}m7: model refused"))
    assert [(type(e).__name__, e.request_id) for e in got] == [
        ("Failed", "r1"), ("Released", "r1"), ("Failed", "r2"), ("Released", "r2")]
    assert "refused" in next(e for e in got if isinstance(e, Failed)).error and not lost
    link._on_result("old-stream", None, _Error(CONNECTION_CLOSED + "gone"))  # a stream given up: ignored
    assert not lost
    link._on_result("c1", _Result(b"not json"), None)  # undecodable events end the link
    assert lost == [1] and not link.connected
    link._conn, link._lost_told = "c2", False  # reconnected, as connect() leaves it
    link._on_result("c2", None, _Error("StatusCode.UNAVAILABLE", status="StatusCode.UNAVAILABLE"))
    assert lost == [1, 1]
    with pytest.raises(ConnectionError, match="unavailable"):
        link.send([Release("r3")])  # fails fast while down
    assert lost == [1, 1]  # (the same outage: not told again)
    link._down_until = 0.0  # its retry wait is over: the next send tries to connect, is refused, same outage
    with pytest.raises(ConnectionError, match="not reachable"):
        link.send([Release("r4")])
    assert lost == [1, 1]


@pytest.mark.slow
def test_a_dead_model_on_a_live_peer_is_reloaded(tiny_dir: Path, tmp_path: Path) -> None:
    """The peer's `large` process dies while its tritonserver stays up: the request routed there fails with
    a clear error, the peer's gateway reloads the model, the router reconnects, and routed output is
    again the in-process engine's."""
    from triton_harness import generate_stream, one_stub, stubs_of

    env = triton_install.execution_env()
    peer_ports = free_ports(3)
    # The small model's pool is the larger: the deployment's KV budget (the smallest pool of the models other than the
    # entry) can only be the peer's, which the router learns from its greeting heartbeat relayed over gRPC.
    models = {"small": {"path": str(tiny_dir / "small"), "kv_cache_tokens": 8192},
              "large": {"path": str(tiny_dir / "large"), "kv_cache_tokens": 4096, "url": f"127.0.0.1:{peer_ports[1]}"}}
    deployment = {"models": models, "entry": "small", "policy": {"name": "random", "p": 0.3, "seed": 0},
                  "tokenizer": str(tiny_dir / "tokenizer")}
    config = tmp_path / "deployment.yaml"
    config.write_text(yaml.safe_dump(deployment, sort_keys=False))
    local = dict(deployment, models={k: {kk: vv for kk, vv in v.items() if kk != "url"} for k, v in models.items()})
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    body = {"text_input": "def fibonacci(n):", "stream": True, "sampling_parameters": json.dumps(greedy)}
    with Engine.from_config(local) as engine:
        ref = engine.generate("def fibonacci(n):", SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                    ignore_eos=True))[0]
    peer_repo = write_repository(config, tmp_path / "peer_repo", execution_env=env, peer=True)
    peer = _start(TritonServer(peer_repo, *peer_ports, log_file=tmp_path / "peer.log"))
    router = _start(TritonServer(write_repository(config, tmp_path / "router_repo", execution_env=env),
                                 *free_ports(3), log_file=tmp_path / "router.log"))
    try:
        status, events = generate_stream(router, body)
        assert status == 200 and stream_text(events) == ref.text, events
        large = one_stub(peer_repo, "large")
        long = dict(body, sampling_parameters=json.dumps({**greedy, "max_tokens": 3000}))
        killer = threading.Timer(1.0, os.kill, (large, signal.SIGKILL))
        killer.start()
        status, events = generate_stream(router, long, timeout=120)
        killer.join()
        assert status >= 400 or any("error" in e for e in events), events
        assert "large" in json.dumps(events)
        assert stream_text(served_again(router, body, 90, "routing did not resume after the peer's model died")) \
            == ref.text
        assert stubs_of(peer_repo, "large") not in ([], [large])  # a new process serves it
        assert peer.proc.poll() is None and router.proc.poll() is None
    finally:
        router.stop()
        peer.stop()
