"""The router's responses to clients, sent from a thread of their own, in the order they were made.

Sending a response is a round trip to tritonserver (measured: ~0.1 ms on a slow core), and so is every Prometheus
update (which holds the GIL meanwhile). On the router's event loop those round trips, one per token of every
stream, kept the loop busy a third of the time at 8 streams on the H200 host (1 ms per batch of events), and a
handoff or a new request that arrived meanwhile waited for them. The loop now only builds each response and
queues it; one thread sends them in order, so a stream's responses keep their order and its final one comes last.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Responder:
    """`keep(*objects)`: called with each sender and response once sent (the router's graveyard, which must hold
    what Triton may still use for a while after the send, counted from the send)."""

    def __init__(self, keep: Callable[..., None] = lambda *objects: None) -> None:
        self._keep = keep
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tr-router-responses", daemon=True)
        self._thread.start()

    def send(self, sender: Any, response: Any, flags: int) -> None:
        """Queue `response` for `sender` (a Triton response sender) with `flags`."""
        self._queue.put((sender, response, flags))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the sending thread, after what was queued before it (a metric update)."""
        self._queue.put((None, fn, 0))

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop (waits up to `timeout` seconds)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sender, what, flags = item
            try:
                if sender is None:
                    what()
                else:
                    sender.send(what, flags=flags)
                    self._keep(sender, what)
            except Exception:  # a client that went away, a metric that failed: the others go on
                log.debug("router responder: %s failed", "a call" if sender is None else "a send", exc_info=True)
