"""The router's responses to clients, sent from a thread of their own, in the order they were made; a stream's
responses that queued up behind one another leave as one.

Sending a response is a round trip to tritonserver, and so is every Prometheus update; each blocks the thread
that makes it until tritonserver answered, holding the router process's GIL. On the router's event loop those round
trips, one per token of every stream, kept the loop busy a third of the time at 8 streams on the H200 host (1.2 ms
per batch of events), and a handoff or a new request that arrived meanwhile waited for them. The loop now only
makes each response's `Chunk` and queues it; one thread sends them in order, so a stream's responses keep their
order and its final one comes last.

That thread can fall behind: at 16 streams on the H200 (2026-12-05) clients saw their final responses 0.3-0.9 s
after the server had made them (perf/results/served_h200_2026-12-05), and a closed loop of clients waits for
them. So the thread takes
everything queued at once and merges each stream's chunks that wait there into one response (their texts joined;
each chunk's metrics still recorded as its own): the more it falls behind, the fewer responses it sends per token,
and a stream that is not behind still gets each chunk as it comes.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# At most this many queued items are taken at once (a bound on how long a batch holds its first chunk back).
MAX_BATCH = 1024


@dataclass
class Chunk:
    """One response of a stream as the loop made it: `text` (UTF-8) and, for a final one, its other outputs, or an
    error; and the request metrics it settles (TTFT, time between tokens, the finish reason counted)."""

    text: bytes = b""
    final: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # a final response's other outputs, by name
    error: str | None = None  # a final response that is this error
    keep: tuple = ()  # what Triton may use until the send is done (the request a final response ends)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # time between tokens, one value per chunk the loop made
    finished: str | None = None  # the finish reason to count once sent
    queued: float = 0.0  # when the loop queued it (the first of a merged run)

    @property
    def sendable(self) -> bool:
        """A response to send (else only its metrics to settle: text held back, or a request not streamed)."""
        return bool(self.text) or self.final

    def absorb(self, later: Chunk) -> None:
        """Take in the same stream's next chunk (not an error: that one goes on its own, after this). Each chunk's
        time between tokens stays its own: merged by a responder that fell behind, they still show each gap."""
        self.text += later.text
        if later.final:
            self.final, self.extras, self.finished = True, later.extras, later.finished
        self.keep += later.keep
        if self.ttft_s is None:
            self.ttft_s = later.ttft_s
        self.itl_s += later.itl_s


class Responder:
    """`build(chunk)`: the response to send for a chunk, its flags and the objects Triton may use until it is sent
    (its tensors); `observe(chunk)`: the chunk's request metrics, recorded before it is sent; `keep(*objects)`: given
    each sent response with its sender and those objects, once sent (the router's graveyard: Triton may still use
    them for a while after the send, so that while counts from the send, however long the chunk waited in the
    queue). `on_batch(start, end, chunks, sends, oldest_wait_s)`: what each batch taken from the queue came to
    (the timeline): its chunks with a response to send, and the responses sent. A final response that cannot be
    made is sent as an error: every request still ends with exactly one final response."""

    def __init__(self, build: Callable[[Chunk], tuple[Any, int, list]],
                 observe: Callable[[Chunk], None] = lambda chunk: None,
                 keep: Callable[..., None] = lambda *objects: None,
                 on_batch: Callable[[float, float, int, int, float], None] | None = None) -> None:
        self._build, self._observe, self._keep, self._on_batch = build, observe, keep, on_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tr-router-responses", daemon=True)
        self._thread.start()

    def send(self, sender: Any, chunk: Chunk) -> None:
        """Queue `chunk` for `sender` (a Triton response sender). A chunk with no text that is not final is sent
        with the stream's next one, or only settles its metrics."""
        chunk.queued = time.monotonic()
        self._queue.put((sender, chunk))

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
        done = False
        while not done:
            items = [self._queue.get()]
            start = time.monotonic()
            while len(items) < MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # Each stream's chunks, merged in queue order; an error first sends what is pending of its stream.
            pending: dict[int, tuple[Any, Chunk]] = {}
            chunks = sends = 0
            oldest = min((it[1].queued for it in items if it is not None), default=start)
            for item in items:
                if item is None:
                    done = True
                    break
                sender, what = item
                chunks += what.sendable
                held = pending.get(id(sender))  # (a pending chunk's sender is alive: its id is its own)
                if what.error is None:
                    if held is None:
                        pending[id(sender)] = (sender, what)
                    else:
                        held[1].absorb(what)
                    continue
                # An error: what its stream had pending goes first, then the error on its own.
                if held is not None:
                    sends += self._send([pending.pop(id(sender))])
                sends += self._send([(sender, what)])
            sends += self._send(pending.values())
            if self._on_batch is not None and chunks:
                self._call(functools.partial(self._on_batch, start, time.monotonic(), chunks, sends, start - oldest))

    def _send(self, chunks: Iterable[tuple[Any, Chunk]]) -> int:
        """Send each (sender, chunk), in order, after recording its metrics; the number of responses sent."""
        n = 0
        for sender, chunk in chunks:
            self._call(lambda chunk=chunk: self._observe(chunk))
            if not chunk.sendable:
                continue
            try:
                response, flags, objects = self._build(chunk)
            except Exception as e:
                log.exception("router responder: a response could not be made")
                if not chunk.final:
                    continue
                # The request's final response all the same (every request ends with exactly one), as an error.
                response, flags, objects = self._build(
                    Chunk(final=True, error=f"the router could not make this response: {type(e).__name__}: {e}"))
            n += 1
            try:
                sender.send(response, flags=flags)
            except Exception:  # the client went away; the cancellation watcher aborts its request
                log.debug("router responder: a send failed", exc_info=True)
            self._keep(sender, response, *objects, *chunk.keep)
        return n

    @staticmethod
    def _call(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # a metric update that failed: the responses go on
            log.exception("router responder: a call failed")
