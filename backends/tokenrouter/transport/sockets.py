"""The Triton deployment's transport: the router reaches each model's process over its local socket
(transport/ipc.py's ModelLink), or a model on a peer server over Triton gRPC (transport/grpc_link.py), and
hands what comes back to the router (on the link's reader thread: the router relays handoffs from there).

Thresholds travel with each Arrive (no extra message per change). A message that cannot be sent goes to
`on_send_failed` (by default the model fails the message's request as it would have: Failed, then Released); a link
that closes under the router calls `on_lost` (the router then fails what that model held and revives it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from tokenrouter.transport import ipc
from tokenrouter.transport.base import Message, OnEvent, Transport
from tokenrouter.transport.grpc_link import GrpcLink
from tokenrouter.transport.messages import Arrive, Failed, Released, Unavailable

log = logging.getLogger(__name__)


class SocketTransport(Transport):
    def __init__(
        self,
        models: list[str],
        urls: dict[str, str],
        loop: asyncio.AbstractEventLoop,
        on_event: OnEvent,
        on_items: Callable[[list[Any]], None],
        on_lost: Callable[[str], None],
        on_send_failed: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """`urls`: the models served by peer servers (their gRPC addresses), reached through a GrpcLink; the
        others through their local socket. `on_items`: every batch a model sends (events and its step
        statistics), on that link's reader thread (the caller hands the loop its share);
        `on_event`: one event, for the failures this transport reports itself (on the loop's thread); `on_lost`: a
        model's link closed (not at `close`); `on_send_failed(model, request_id, error)`: a message about a request
        could not be sent (on the loop's thread; default `fail`)."""
        self.loop = loop
        self.on_event = on_event
        self.on_items = on_items
        self.on_lost = on_lost
        self.on_send_failed = on_send_failed or self.fail
        self.closing = False
        self.thresholds: dict[str, int] = {}
        self.max_len: int | None = None  # stamped on every Arrive (Arrive.max_len)
        self.links: dict[str, ipc.ModelLink | GrpcLink] = {}
        for m in models:
            items, lost = functools.partial(self._items_from, m), functools.partial(self._lost, m)
            self.links[m] = GrpcLink(m, urls[m], items, lost) if m in urls else ipc.ModelLink(m, items, lost)

    def deliver(self, model: str, msg: Message) -> None:
        if isinstance(msg, Arrive):
            msg.threshold, msg.max_len = self.thresholds.get(model), self.max_len
        try:
            self.links[model].send([msg])
        except ConnectionError as e:
            log.error("%s", e)
            if isinstance(msg, Unavailable):  # about no request: the model's own outage is reported apart
                return
            # Deferred: the coordinator may be inside its own bookkeeping for this request.
            self.loop.call_soon(self.on_send_failed, model, msg.request_id, str(e))

    def try_deliver(self, model: str, msg: Arrive) -> bool:
        """Send an Arrive now if that cannot block: `model` on a local socket that is connected and has room
        (`ipc.ModelLink.try_send`). For a link's reader thread, which must never wait on another model. False:
        nothing was sent (a peer server's model, a link not connected or closing, a full socket)."""
        link = self.links.get(model)
        if not isinstance(link, ipc.ModelLink):
            return False
        msg.threshold, msg.max_len = self.thresholds.get(model), self.max_len
        return link.try_send([msg])

    def fail(self, model: str, request_id: str, error: str) -> None:
        """`model`'s part of a request is lost: the events it would have sent for a failure (loop thread)."""
        self.on_event(Failed(request_id, model, error))
        self.on_event(Released(request_id, model, 0, 0, held=False))

    def thresholds_changed(self, thresholds: dict[str, int]) -> None:
        self.thresholds = dict(thresholds)

    def close(self) -> None:
        self.closing = True
        for link in self.links.values():
            link.close()

    # -- from the links' reader threads -----------------------------------------------------------------------

    def _items_from(self, model: str, items: list[Any]) -> None:
        self.on_items(items)

    def _lost(self, model: str) -> None:
        if not self.closing:  # at shutdown the router closed the link itself
            self.loop.call_soon_threadsafe(self.on_lost, model)
