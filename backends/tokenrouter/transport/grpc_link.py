"""The router's link to a model on another Triton server (a model with `url:` in the deployment YAML): one
Triton gRPC stream to that server's peer gateway `peer_<model>` (serving/peer_model.py), with the interface
of the local `ipc.ModelLink`, so transport/sockets.py treats local and remote models alike.

The stream's first request opens a connection (its id is random per link); the gateway streams the model's
events back as responses to it. Each `send` is one more request carrying a batch of messages (the codec's
JSON). A stream that fails (the peer server died, or the network between them) calls `on_lost` once;
sends then fail fast with a clear error until `connect` succeeds again. A silent partition (no reset, no
close: a cable, a firewall dropping packets) is found by gRPC keepalive: a ping every KEEPALIVE_TIME_MS,
the stream ends when one is not acknowledged within KEEPALIVE_TIMEOUT_MS. Both servers accept pings that
often (serving/server.py passes `keepalive_flags()` to tritonserver: its default treats them as abuse).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenrouter.transport import codec
from tokenrouter.transport.ipc import RETRY_AFTER_S
from tokenrouter.transport.messages import Arrive, Failed, Handoff, Released

log = logging.getLogger(__name__)

OPEN_REQUEST = "open"
SENT_REMEMBERED = 4096  # message batches whose request ids are kept, so a refused batch can fail its requests
BATCH_PREFIX = "batch "  # the gateway's error for a refused batch: "batch <its request id>: why"
# How the peer gateway's error for a connection's own request begins: the connection is over (a refused
# message batch is an error of that request alone, without it).
CONNECTION_CLOSED = "connection closed: "
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def keepalive_flags() -> list[str]:
    """tritonserver's gRPC settings that let the other node's keepalive pings in (and send its own, so a
    peer also notices a router that vanished silently and releases what it held)."""
    return [
        f"--grpc-keepalive-time={KEEPALIVE_TIME_MS}",
        f"--grpc-keepalive-timeout={KEEPALIVE_TIMEOUT_MS}",
        "--grpc-keepalive-permit-without-calls=1",
        "--grpc-http2-max-pings-without-data=0",
        f"--grpc-http2-min-recv-ping-interval-without-data={KEEPALIVE_TIME_MS // 2}",
    ]


def peer_model_name(model: str) -> str:
    """The gateway's Triton model name (serving/repository.py writes it)."""
    return f"peer_{model}"


class GrpcLink:
    def __init__(self, model: str, url: str, on_events: Callable[[list[Any]], None], on_lost: Callable[[], None],
                 connect_timeout: float = 2.0) -> None:
        self.model, self.url = model, url
        self._on_events, self._on_lost = on_events, on_lost
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._client: Any = None
        self._conn: str | None = None
        self._ids = itertools.count()
        self._ever_connected = False
        self._down_until, self._down_error = 0.0, ""
        # `on_lost` called for the current outage (a stream that broke, or a connect refused): once per outage, as
        # ipc.ModelLink does. A peer never reached otherwise was never marked down nor reconnected to, and routing
        # around it took each of its requests back to the entry model, which handed it over again, for ever.
        self._lost_told = False
        self._sent: OrderedDict[str, list[str]] = OrderedDict()  # batch request id -> its requests' ids

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _open(self, timeout: float) -> tuple[Any, str]:
        """A stream with an open connection; ConnectionError when the peer or its model is not ready."""
        import tritonclient.grpc as grpcclient

        keepalive = grpcclient.KeepAliveOptions(
            keepalive_time_ms=KEEPALIVE_TIME_MS, keepalive_timeout_ms=KEEPALIVE_TIMEOUT_MS,
            keepalive_permit_without_calls=True, http2_max_pings_without_data=0)
        client = grpcclient.InferenceServerClient(self.url, keepalive_options=keepalive)
        deadline = time.monotonic() + timeout
        while True:
            try:
                # The gateway and the model behind it: Triton loads them in parallel.
                if all(client.is_model_ready(m, client_timeout=max(1.0, timeout))
                       for m in (peer_model_name(self.model), self.model)):
                    break
                problem = f"{peer_model_name(self.model)} or {self.model} is not ready there"
            except Exception as e:  # tritonclient raises InferenceServerException for an unreachable server
                problem = str(e).splitlines()[0]
            if time.monotonic() >= deadline:
                _close(client)
                raise ConnectionError(f"model {self.model!r} at {self.url} is not reachable: {problem}")
            time.sleep(0.2)
        conn = uuid.uuid4().hex
        # The connection is this link's before any callback of its stream can run (an open refused at once
        # must end it, not be dropped as a stale stream's).
        self._conn = conn
        try:
            client.start_stream(callback=lambda result, error: self._on_result(conn, result, error))
            self._request(client, conn, None, OPEN_REQUEST)
        except Exception as e:
            self._conn = None
            _close(client)
            raise ConnectionError(f"model {self.model!r} at {self.url}: cannot open a stream: {e}") from None
        return client, conn

    def _request(self, client: Any, conn: str, body: str | None, request_id: str) -> None:
        import tritonclient.grpc as grpcclient

        inputs = [grpcclient.InferInput("tokenrouter_connection", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([conn.encode()], dtype=np.object_))
        if body is not None:
            inputs.append(grpcclient.InferInput("tokenrouter_messages", [1], "BYTES"))
            inputs[1].set_data_from_numpy(np.array([body.encode()], dtype=np.object_))
        client.async_stream_infer(peer_model_name(self.model), inputs, request_id=request_id)

    def _on_result(self, conn: str, result: Any, error: Any) -> None:
        """The stream's callback (tritonclient's thread): events, a refused batch, or the end of the stream."""
        if conn != self._conn:
            return  # a stream this link already gave up
        try:
            if error is None:
                out = result.as_numpy("tokenrouter_events")
                if out is not None:
                    self._on_events(_without_clock(codec.decode(out.reshape(-1)[0])))
                return
            text = error.message() if hasattr(error, "message") else str(error)
            status = error.status() if hasattr(error, "status") else None
        except Exception as e:  # undecodable events (e.g. other versions on the two nodes): the link is unusable
            self._lost(conn, f"bad events from the peer: {e!r}")
            return
        if status is None and not text.startswith(CONNECTION_CLOSED):
            # The peer refused one batch: fail its requests as the model would have, so none waits forever.
            log.error("model %r at %s refused a message batch: %s", self.model, self.url, text)
            batch = text[len(BATCH_PREFIX):].split(":", 1)[0] if text.startswith(BATCH_PREFIX) else ""
            rids = self._sent.pop(batch, None)
            if rids:
                self._on_events([ev for rid in rids for ev in (
                    Failed(rid, self.model, f"model {self.model!r} at {self.url} refused the request: {text}"),
                    Released(rid, self.model, 0, 0, held=False))])
            return
        self._lost(conn, text)

    def _lost(self, conn: str, why: str) -> None:
        with self._lock:
            if self._conn != conn:
                return
            client, self._client, self._conn = self._client, None, None
            self._down_until = float("inf")  # until connect() succeeds again
            self._down_error = f"model {self.model!r} at {self.url} is unavailable: {why.splitlines()[0]}"
            tell, self._lost_told = not self._lost_told, True
        log.error("%s", self._down_error)
        threading.Thread(target=_close, args=(client,), daemon=True).start()  # not on the stream's own thread
        if tell:
            self._on_lost()

    def connect(self, timeout: float | None = None) -> None:
        """Connect now (blocking up to `timeout`, default connect_timeout); ConnectionError if not reachable.
        Under the link's lock: one connection at a time (sends to this model wait meanwhile; while it is
        down the router refuses new requests, so only handoffs already under way to it do)."""
        with self._lock:
            if self.connected:
                return
            client, conn = self._open(self.connect_timeout if timeout is None else timeout)
            self._client, self._conn, self._ever_connected, self._down_until = client, conn, True, 0.0
            self._lost_told = False

    def send(self, messages: list[Any]) -> None:
        """Send a batch of messages; ConnectionError when the model cannot be reached."""
        refused: ConnectionError | None = None
        tell = False
        with self._lock:
            if self._client is None:
                if time.monotonic() < self._down_until:
                    raise ConnectionError(self._down_error)
                try:
                    # Only the first connection waits for the peer to come up (the servers are starting).
                    self._client, self._conn = self._open(1.0 if self._ever_connected else self.connect_timeout)
                    self._ever_connected, self._lost_told = True, False
                except ConnectionError as e:
                    self._down_until, self._down_error = time.monotonic() + RETRY_AFTER_S, str(e)
                    refused, tell, self._lost_told = e, not self._lost_told, True
            if refused is None:
                client, conn = self._client, self._conn
                request_id = f"m{next(self._ids)}"
                self._sent[request_id] = list(dict.fromkeys(m.request_id for m in messages
                                                            if hasattr(m, "request_id")))
                while len(self._sent) > SENT_REMEMBERED:
                    self._sent.popitem(last=False)
        if refused is not None:
            if tell:
                self._on_lost()  # (outside the lock: the router's revive thread connects under it)
            raise refused
        try:
            self._request(client, conn, codec.encode(_without_clock(messages)), request_id)
        except Exception as e:
            self._lost(conn, str(e))
            raise ConnectionError(f"model {self.model!r} at {self.url} went away: {e}") from None

    def close(self) -> None:
        with self._lock:
            client, self._client, self._conn = self._client, None, None
        if client is not None:
            _close(client)


def _without_clock(messages: list[Any]) -> list[Any]:
    """The messages with their handoff stamps (`Arrive.sent_at`) dropped: another machine's monotonic clock is
    not comparable with ours, so a transit measured across the link would be noise."""
    out = []
    for m in messages:
        if isinstance(m, Arrive) and m.sent_at is not None:
            m = dataclasses.replace(m, sent_at=None)
        elif isinstance(m, Handoff) and m.arrive.sent_at is not None:
            m = dataclasses.replace(m, arrive=dataclasses.replace(m.arrive, sent_at=None))
        out.append(m)
    return out


def _close(client: Any) -> None:
    try:
        client.stop_stream(cancel_requests=True)
        client.close()
    except Exception:  # closing a stream that already failed
        pass
