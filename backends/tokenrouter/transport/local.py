"""In-process transports: the models are `Subserver` objects of this process.

`SteppedTransport` runs everything in the caller's thread (Engine.step / generate without start()): a
delivery is handled at once and the events it causes are handled, one at a time and in order, before the
call returns. `ThreadedTransport` is the background mode (Engine.start()): a delivery goes to the model's
inbox for its loop thread, and the models' events queue for the coordinator thread (`run`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from tokenrouter.transport.base import Message, OnEvent, Transport
from tokenrouter.transport.messages import Event

if TYPE_CHECKING:
    from tokenrouter.engine.subserver import Subserver

log = logging.getLogger(__name__)


class _Local(Transport):
    def __init__(self, subservers: dict[str, Subserver], on_event: OnEvent) -> None:
        self.subservers = subservers
        self.on_event = on_event

    def thresholds_changed(self, thresholds: dict[str, int]) -> None:
        for model, b in thresholds.items():
            self.subservers[model].threshold = b


class SteppedTransport(_Local):
    def __init__(self, subservers: dict[str, Subserver], on_event: OnEvent) -> None:
        super().__init__(subservers, on_event)
        self.events: list[Event] = []
        self._pumping = False

    def emit(self, ev: Event) -> None:
        """A model's event (its `emit` callback): handled by the next `pump`."""
        self.events.append(ev)

    def deliver(self, model: str, msg: Message) -> None:
        sub = self.subservers[model]
        sub.note_arrival(msg)
        sub.handle(msg)
        self.pump()

    def pump(self) -> None:
        """Handle events until none are left (handling one may deliver more).

        One event at a time, as the threaded coordinator does: a delivery made while handling an event queues
        its events for this loop instead of handling them in the middle of that handler (which could finalize
        a request under it, and the handler would then report a second final output)."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self.events:
                self.on_event(self.events.pop(0))
        finally:
            self._pumping = False


class ThreadedTransport(_Local):
    def __init__(self, subservers: dict[str, Subserver], on_event: OnEvent) -> None:
        super().__init__(subservers, on_event)
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def emit(self, ev: Event) -> None:
        """A model's event, from its loop thread: queued for the coordinator thread."""
        self.events.put(ev)

    def deliver(self, model: str, msg: Message) -> None:
        self.subservers[model].submit(msg)

    def run(self, stop: threading.Event) -> None:
        """The coordinator thread: hand every event to `on_event` until `stop` is set."""
        while not stop.is_set():
            try:
                ev = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.on_event(ev)
            except Exception:  # the coordinator must outlive any one request's failure
                log.exception("coordinator: failed to handle %r", ev)
