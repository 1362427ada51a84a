"""How the coordinator reaches the models: the one interface every transport implements.

A handoff's data path reads in one direction: a subserver emits an event -> the transport carries it to the
coordinator (`on_event`) -> the coordinator delivers the next message -> the transport carries it to the
target subserver. Implementations: `local.SteppedTransport` (in process, the caller's thread),
`local.ThreadedTransport` (in process, one loop thread per model) and `sockets.SocketTransport` (the Triton
deployment: one local socket per model process).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from tokenrouter.transport.messages import Append, Arrive, Event, Release, Unavailable

Message = Arrive | Append | Release | Unavailable
OnEvent = Callable[[Event], None]


class Transport(ABC):
    @abstractmethod
    def deliver(self, model: str, msg: Message) -> None:
        """Send `msg` to `model`; what the model does about it comes back as events through `on_event`. A
        model that cannot be reached fails the message's request (Failed, then Released) the same way; a message
        about no request (`Unavailable`) is then dropped."""

    @abstractmethod
    def thresholds_changed(self, thresholds: dict[str, int]) -> None:
        """The delayed-batching thresholds the coordinator wants now (set directly, or sent along)."""

    def close(self) -> None:
        """Stop carrying messages (no-op for transports that own no connection)."""
