"""The peer gateway `peer_<model>`: offers a subserver of this server to a router on another server, over
Triton gRPC streaming (the router's side: transport/grpc_link.py).

A router opens a connection with one request that carries only `tokenrouter_connection` (an id it chose):
the gateway connects a local socket to the subserver for it (transport/ipc.py, as a local router would)
and streams every batch of the subserver's events back as responses to that request, for as long as the
connection lives. Each later request carries a batch of messages (`tokenrouter_messages`, transport/codec.py
JSON) for a connection and is answered at once with an empty final response (or an error for that request
alone). When the router's stream goes away (Triton cancels the request), the gateway closes the socket and
the subserver releases every request that connection brought, as for a local router that died. When the
subserver's process dies, every connection ends with an error and the gateway reloads the model through
this server's model control (serving/model_control.py), as a router does for its local models; the
routers reconnect on their own.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from tokenrouter.config import load_config
from tokenrouter.serving.model_control import (
    ReviveAttempts,
    cannot_reload,
    check_not_unloaded,
    reload_model,
)
from tokenrouter.serving.watchdog import SilenceWatch
from tokenrouter.transport import codec, ipc
from tokenrouter.transport.grpc_link import BATCH_PREFIX, CONNECTION_CLOSED

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.5  # how often open connections are checked for a router that went away


class _Connection:
    def __init__(self, link: ipc.ModelLink, sender: Any) -> None:
        self.link, self.sender = link, sender


class PeerModel:
    def __init__(self, args: dict[str, Any], settings: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        self.model = settings["model"]
        timeout = load_config(settings["config"]).watchdog_timeout_s
        self._silence = None if timeout is None else SilenceWatch(timeout)
        self._conns: dict[str, _Connection] = {}
        # Recent responses stay referenced a while: Triton 2.51's Python backend may free a dropped response's
        # tensors without the GIL (router_model._Graveyard has the story); dropped here, by Python, later.
        self._recent: collections.deque[Any] = collections.deque(maxlen=4096)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reviving = False
        threading.Thread(target=self._watch_cancellations, name=f"tr-peer-{self.model}", daemon=True).start()

    # -- Triton entry points ------------------------------------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            body = None
            try:
                conn = self._string(request, "tokenrouter_connection")
                if not conn:
                    raise ValueError("tokenrouter_connection must be a non-empty string")
                body = self._string(request, "tokenrouter_messages")
                if body is None:
                    try:
                        self._open(conn, sender)  # stays open: the connection's events stream back on it
                    except Exception as e:  # the connection never opened: the router must know it is over
                        self._end(sender, str(e))
                    continue
                with self._lock:
                    c = self._conns.get(conn)
                if c is None:
                    raise ValueError(f"no open connection {conn!r} to model {self.model!r}: open it first")
                c.link.send(codec.decode(body))
                sender.send(flags=final)
            except Exception as e:  # this request alone fails; the connection and the model carry on
                log.warning("peer %s: refused a request: %s", self.model, e)
                # Named by its request id, so the router can fail the requests that batch carried.
                why = f"{BATCH_PREFIX}{request.request_id()}: {e}" if body is not None else str(e)
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(why)), flags=final)
        return None

    def finalize(self) -> None:
        self._stop.set()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.link.close()
            self._end(c.sender, "the peer server is shutting down")

    # -- connections --------------------------------------------------------------------------------------

    def _string(self, request: Any, name: str) -> str | None:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        value = tensor.as_numpy().reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def _open(self, conn: str, sender: Any) -> None:
        link = ipc.ModelLink(self.model, lambda items: self._relay(conn, items), lambda: self._lost(conn))
        # Registered before it connects: the subserver greets a new connection at once with its heartbeat (its KV
        # pool, which the router admits requests by), and `_relay` drops events of a connection it does not know.
        with self._lock:
            if conn in self._conns:
                raise ValueError(f"connection {conn!r} is already open")
            self._conns[conn] = _Connection(link, sender)
        try:
            link.connect()  # ConnectionError: the local subserver is not up
        except Exception:
            with self._lock:
                if (c := self._conns.get(conn)) is not None and c.link is link:
                    del self._conns[conn]
            raise
        with self._lock:
            ours = (c := self._conns.get(conn)) is not None and c.link is link
        if not ours:  # ended while it connected (the router's stream cancelled, or shutdown): close what it opened
            link.close()

    def _relay(self, conn: str, items: list[Any]) -> None:
        """A batch of the subserver's events for `conn` (the link's reader thread): one response."""
        with self._lock:
            c = self._conns.get(conn)
        if c is None:
            return
        payload = np.array([codec.encode(items).encode("utf-8")], dtype=np.object_)
        response = self.pb.InferenceResponse(output_tensors=[self.pb.Tensor("tokenrouter_events", payload)])
        self._recent.append(response)
        try:
            c.sender.send(response)
        except Exception:  # the router's stream is gone: the watcher closes the connection
            log.warning("peer %s: could not send events on connection %s", self.model, conn)

    def _lost(self, conn: str) -> None:
        """The local subserver's socket closed (its process died): the connection ends with an error, and
        the model is reloaded (once, whatever the number of connections that saw it go)."""
        with self._lock:
            c = self._conns.pop(conn, None)
            # Only a live connection that broke: the gateway's own closes (a router gone, shutdown) land here too.
            revive = c is not None and not self._reviving and not self._stop.is_set()
            self._reviving = self._reviving or revive
        if c is not None:
            self._end(c.sender, f"model {self.model!r} went away on the peer server")
        if revive:
            threading.Thread(target=self._revive, name=f"tr-peer-revive-{self.model}", daemon=True).start()

    def _alive(self) -> bool:
        """Whether the subserver still answers on its socket (it may have closed one connection only)."""
        probe = ipc.ModelLink(self.model, lambda items: None, lambda: None)
        try:
            probe.connect(timeout=0.5)
        except ConnectionError:
            return False
        probe.close()
        return True

    def _revive(self) -> None:
        attempts = ReviveAttempts(log, f"peer {self.model}")
        reloading = False  # our reload began (its unload leaves the model "unloaded" should its load fail)
        try:
            if self._alive():
                return
            while not self._stop.is_set():
                try:
                    if not reloading:
                        check_not_unloaded(self.model)
                        if self._alive():  # loaded again by whoever unloaded it
                            return
                    log.warning("peer %s: the model's process exited; reloading it", self.model)
                    reloading = True
                    reload_model(self.model, self.pb)
                    log.warning("peer %s: model reloaded", self.model)
                    return
                except Exception as e:  # the server's answer, or pb_utils.TritonModelException
                    if cannot_reload(e):
                        log.error("peer %s: the model stays down: this server cannot reload it (%s); restart "
                                  "tritonserver, or run it with --model-control-mode=explicit", self.model, e)
                        return
                    attempts.failed(e)
                self._stop.wait(attempts.wait())
        finally:
            with self._lock:
                self._reviving = False

    def _end(self, sender: Any, error: str) -> None:
        try:
            sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(CONNECTION_CLOSED + error)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass  # already cancelled or closed

    def _watch_cancellations(self) -> None:
        """A router that went away cancels its connection's request: close the socket, so the subserver
        releases what that router brought. Also the watchdog of the subserver's process, as a local router's
        (serving/watchdog.py): killed when none of the connections heard from it for watchdog_timeout_s."""
        while not self._stop.wait(CANCEL_CHECK_S):
            with self._lock:
                conns = list(self._conns.items())
            if self._silence is not None and conns:
                freshest = max((c.link for _, c in conns), key=lambda link: link.last_heard)
                self._silence.check({self.model: freshest}, time.monotonic())
            gone = [k for k, c in conns if c.sender.is_cancelled()]  # outside the lock: it asks Triton
            with self._lock:
                closed = [(k, self._conns.pop(k)) for k in gone if k in self._conns]
            for k, c in closed:
                log.warning("peer %s: connection %s went away; releasing its requests", self.model, k)
                c.link.close()
                self._end(c.sender, "cancelled")
