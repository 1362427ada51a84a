"""A model's timeline: its steps, the requests it hands off and the ones that arrive, with their times.

perf/timeline.py turns the events into a Perfetto / chrome://tracing trace and a summary of where the time
goes (busy fraction, batch sizes, idle gaps and their causes, handoff transit). Recording is off unless
asked for: `Engine.record_timeline()` in process, or the environment variable TIMELINE_DIR_ENV for a served
deployment's processes (each subserver and the router append their events to `<dir>/<name>.<pid>.jsonl`, from a
writer thread of their own every WRITE_INTERVAL_S: never on the decoding thread or the router's loop). When off,
a step pays one `is None` test.

Times are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process of a machine, so the
files of a served deployment's processes merge into one trace.

Events (plain dicts, JSON-safe):
- step: model, schedule_start (the scheduler starts choosing the batch), start (batch chosen), submitted (the
  forward pass's inputs prepared: its graph's replay or its first kernel called), launched (the call returned: its
  kernels or graph launched, and the GIL back from the process's other threads),
  forward_end (tokens and the policy's values on the host), end (routed and committed),
  batch, tokens (new tokens computed), extends (rows computing more than one token: prefills and extends),
  threshold (the delayed-batching threshold at the time), first_ready / last_ready (when the first and the
  last of its rows became ready to step), queue_wait_max.
- handoff: request_id, source, target, t (the source parks the request and sends it).
- arrive: request_id, model, source (None: a new request), t (the target takes it on).
Served deployments also record where a handoff is on its way (the legs of its transit):
- relay: request_id, source, target, t (the router forwards it to the target; recorded as "router").
- receive: request_id, model, source, t (the target's process has it off its socket, queued for its loop).
- router_batch: start, end, events (the router's loop handling one batch of a model's events: the handoffs it
  relays, the responses its commits send to clients).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

TIMELINE_DIR_ENV = "TOKENROUTER_TIMELINE_DIR"
WRITE_INTERVAL_S = 0.5  # how often a served process's writer thread appends what was recorded

log = logging.getLogger(__name__)


class Timeline:
    """Events of one model's loop, kept in memory (`take`) or appended to `path` as JSON lines (`flush`)."""

    def __init__(self, model: str, path: Path | None = None, capacity: int = 2_000_000) -> None:
        self.model = model
        self.path = path
        # Bounded: a recorder left on cannot grow without limit (the oldest events go first).
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._closed: threading.Event | None = None  # the file writer's stop signal (served recorders)

    @classmethod
    def from_env(cls, model: str) -> Timeline | None:
        """A served process's recorder (a subserver's, or the router's) when TIMELINE_DIR_ENV names a directory
        (its writer thread started), else None."""
        folder = os.environ.get(TIMELINE_DIR_ENV)
        if not folder:
            return None
        Path(folder).mkdir(parents=True, exist_ok=True)
        timeline = cls(model, Path(folder) / f"{model}.{os.getpid()}.jsonl")
        timeline._closed = threading.Event()
        threading.Thread(target=timeline._write_forever, name=f"tr-{model}-timeline", daemon=True).start()
        return timeline

    def record(self, event: dict[str, Any]) -> None:
        self._events.append(event)  # deque.append is atomic: the loop thread never waits here

    def _write_forever(self) -> None:
        assert self._closed is not None
        while not self._closed.wait(WRITE_INTERVAL_S):
            self.flush()

    def close(self) -> None:
        """Stop the writer thread and write what is left."""
        if self._closed is not None:
            self._closed.set()
        self.flush()

    def step(self, start: float, forward_end: float, end: float, batch: int, tokens: int, extends: int,
             threshold: int, first_ready: float | None, last_ready: float | None, queue_wait_max: float,
             schedule_start: float | None = None, launched: float | None = None, void: int = 0,
             submitted: float | None = None, shadow: int = 0) -> None:
        # batch: the rows the step committed or routed; void: rows of a step launched ahead that ran and were dropped;
        # shadow: rows for requests away from here (engine/shadow.py), beside the batch
        self.record({
            "kind": "step", "model": self.model, "schedule_start": schedule_start, "start": start,
            "submitted": submitted, "launched": launched, "forward_end": forward_end, "end": end,
            "batch": batch, "void": void, "shadow": shadow, "tokens": tokens, "extends": extends,
            "threshold": threshold, "first_ready": first_ready, "last_ready": last_ready,
            "queue_wait_max": queue_wait_max,
        })

    def handoff(self, request_id: str, target: str, t: float) -> None:
        self.record({"kind": "handoff", "request_id": request_id, "source": self.model, "target": target, "t": t})

    def arrive(self, request_id: str, source: str | None, t: float) -> None:
        self.record({"kind": "arrive", "request_id": request_id, "model": self.model, "source": source, "t": t})

    def relay(self, request_id: str, source: str, target: str, t: float) -> None:
        self.record({"kind": "relay", "request_id": request_id, "source": source, "target": target, "t": t})

    def router_batch(self, start: float, end: float, events: int) -> None:
        self.record({"kind": "router_batch", "start": start, "end": end, "events": events})

    def responses(self, start: float, end: float, chunks: int, sends: int, oldest_wait: float) -> None:
        """A batch the router's responder took from its queue: `chunks` responses as the loop made them, sent as
        `sends` (a stream's that queued up behind one another leave as one); the oldest had waited `oldest_wait`
        seconds when the batch began."""
        self.record({"kind": "responses", "start": start, "end": end, "chunks": chunks, "sends": sends,
                     "oldest_wait": oldest_wait})

    def receive(self, request_id: str, source: str, t: float) -> None:
        self.record({"kind": "receive", "request_id": request_id, "model": self.model, "source": source, "t": t})

    def take(self) -> list[dict[str, Any]]:
        """Every event recorded so far (and not yet taken or flushed), in order; they are forgotten here."""
        with self._lock:
            out = []
            while self._events:
                out.append(self._events.popleft())
            return out

    def flush(self) -> None:
        """Append what was recorded to `path` (one JSON object per line). A file that cannot be written turns
        file output off (logged once) and keeps the events in memory: recording must never fail a request."""
        path = self.path
        if path is None:
            return
        events = self.take()
        if not events:
            return
        try:
            with self._lock, path.open("a") as f:
                f.writelines(json.dumps(e) + "\n" for e in events)
        except OSError as e:
            log.error("timeline of %s: cannot write %s (%s); recording in memory only from now on", self.model,
                      path, e)
            self.path = None
            self._events.extendleft(reversed(events))  # kept, ahead of what was recorded since


def read_events(folder: Path) -> list[dict[str, Any]]:
    """All events of the `*.jsonl` files a served deployment's processes wrote to `folder`, by time."""
    events = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        with path.open() as f:
            events += [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=event_time)


def event_time(event: dict[str, Any]) -> float:
    return float(event["t"] if "t" in event else event["start"])
