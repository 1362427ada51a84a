"""The router's responses to clients, sent from a thread of their own, in the order they were made.

Sending a response is a round trip to tritonserver, and so is every Prometheus update; each blocks the thread
that makes it until tritonserver answered. On the router's event loop those round trips, one per token of every
stream, kept the loop busy a third of the time at 8 streams on the H200 host (1.2 ms per batch of events), and a
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
    """`keep(*objects)`: given each sent response with its sender and the objects queued with it, once sent (the
    router's graveyard: Triton may still use them for a while after the send, so that while counts from the
    send, however long the response waited in the queue)."""

    def __init__(self, keep: Callable[..., None] = lambda *objects: None) -> None:
        self._keep = keep
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tr-router-responses", daemon=True)
        self._thread.start()

    def send(self, sender: Any, response: Any, flags: int, *keep: Any) -> None:
        """Queue `response` for `sender` (a Triton response sender) with `flags`; `keep`: objects Triton may use
        until the send is done (the response's tensors, the request a final response ends)."""
        self._queue.put((sender, response, flags, keep))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the sending thread, after what was queued before it (a metric update)."""
        self._queue.put((None, fn, 0, ()))

    def finish(self) -> None:
        """No more responses: what is queued is sent, then the thread ends."""
        self._queue.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the thread to end after `finish`; False if it has not."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("router responder: responses still queued after %.0f s; they may be lost", timeout)
            return False
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sender, what, flags, keep = item
            if sender is None:
                try:
                    what()
                except Exception:  # a metric update that failed: the responses go on
                    log.exception("router responder: a call failed")
                continue
            try:
                sender.send(what, flags=flags)
            except Exception:  # the client went away; the cancellation watcher aborts its request
                log.debug("router responder: a send failed", exc_info=True)
            self._keep(sender, what, *keep)
