"""Role `subserver` (models `small`, `large`, ...): one model's decoding loop in its own Triton instance.

The router reaches it over a local socket (`transport.ipc`), not through Triton requests: messages come in
on a connection's reader thread and go to the decoding loop; events leave from a response thread,
batched per router connection. If a router goes away, every request it brought here is released (its KV
freed). Its only Triton input is the router's probe: clients cannot send it generation requests.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from tokenrouter.config import load_config
from tokenrouter.engine.autotune import report_interval
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.timeline import Timeline
from tokenrouter.serving.metrics import SubserverMetrics
from tokenrouter.serving.tensors import ROLE_PARAMETER, role_of
from tokenrouter.serving.watchdog import CHECK_EVERY_S, HEARTBEAT_S, LoopWatchdog
from tokenrouter.tokenizer import load_tokenizer
from tokenrouter.transport import ipc
from tokenrouter.transport.messages import (
    Append,
    Arrive,
    Event,
    Handoff,
    Heartbeat,
    Release,
    Released,
    StepStatsReport,
    Unavailable,
)

log = logging.getLogger(__name__)


class SubserverModel:
    def __init__(self, args: dict[str, Any], settings: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        if role_of(model_config) != "subserver":
            raise ValueError(
                f"model {args['model_name']!r} is a subserver (model.json) but its config.pbtxt lacks "
                f'parameters {{ key: "{ROLE_PARAMETER}", value: {{ string_value: "subserver" }} }}: regenerate '
                "the repository (tokenrouter serve, or tokenrouter.serving.repository.write_repository)"
            )
        config = load_config(settings["config"])
        name = settings["model"]
        if name not in config.models:
            raise ValueError(f"model.json names model {name!r}, which the config does not define")
        self.name = name
        mcfg = config.models[name]
        if args.get("model_instance_kind") == "GPU":
            mcfg.device = f"cuda:{args['model_instance_device_id']}"
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        # Events put on that queue and not yet through the response thread: a handoff's events skip the queue
        # (`_send_now`) only when it holds none, so nothing leaves out of order.
        self._queued_lock = threading.Lock()
        self._queued = 0
        self.sub = Subserver.from_config(config, name, self._queue_event, load_tokenizer(config.tokenizer_path))
        if self.sub.warmup_s is not None:
            pb_utils.Logger.log_info(f"model {name!r} on {mcfg.device}: warm-up {self.sub.warmup_s:.1f} s"
                                     + (f"; {self.sub.graph_admission}" if self.sub.graph_admission else ""))
        self.sub.timeline = Timeline.from_env(name)  # TOKENROUTER_TIMELINE_DIR: record for perf/timeline.py
        self.sub.defer_events()  # the response thread's work overlaps the GPU's step, not the next step's host work
        self.sub.send_now = self._send_now  # a handoff's step sends its events from the loop, if that cannot block
        # Which router connection each request came from: its events go back there.
        self._lock = threading.Lock()
        self._owner: dict[str, ipc.Peer] = {}
        self._stop = threading.Event()
        self.metrics = SubserverMetrics(pb_utils, name, self.sub)
        self._report_every = config.batching.auto_interval_s if config.batching.thresholds == "auto" else None
        loop = threading.Thread(target=self.sub.serve_forever, args=(self._stop,), name=f"tr-{name}", daemon=True)
        timeout = config.watchdog_timeout_s
        self._watchdog = None if timeout is None else LoopWatchdog(name, lambda: self.sub.loop_beat, loop, timeout)
        self.listener: ipc.ModelListener | None = None  # (the response thread starts first)
        self._threads = [
            loop,
            threading.Thread(target=self._send_forever, name=f"tr-{name}-responses", daemon=True),
            threading.Thread(target=self.metrics.update_forever, args=(self._stop,), daemon=True),
            threading.Thread(target=self._beat_forever, name=f"tr-{name}-watchdog", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.listener = ipc.ModelListener(name, self._on_messages, self._on_router_gone, on_open=self._greet)

    # -- from the router (connection reader threads) ----------------------------------------------------

    def _on_messages(self, peer: ipc.Peer, messages: list[Any]) -> None:
        timeline = self.sub.timeline  # read once: it may be switched off from another thread
        received = time.monotonic() if timeline is not None else 0.0
        for msg in messages:
            if isinstance(msg, Unavailable):
                if isinstance(msg.models, list) and all(isinstance(m, str) for m in msg.models):
                    self.sub.submit(msg)
                else:
                    log.error("%s: ignoring a malformed Unavailable from the router: %r", self.name, msg.models)
                continue
            if not isinstance(msg, Arrive | Append | Release) or not isinstance(msg.request_id, str):
                log.error("%s: ignoring a %s from the router", self.name, type(msg).__name__)
                continue
            with self._lock:
                self._owner[msg.request_id] = peer
            problem = self._check(msg)
            if problem is None:
                if timeline is not None and isinstance(msg, Arrive) and msg.source is not None:
                    timeline.receive(msg.request_id, msg.source, received)
                self.sub.submit(msg)
                continue
            # Fail that request alone: the loop reports why and releases it here (Failed, then Released), after
            # whatever it emitted for the request before.
            log.error("%s: refused a %s for %s: %s", self.name, type(msg).__name__, msg.request_id, problem)
            self.sub.submit(Release(msg.request_id, "error", f"model {self.name!r} refused the request: {problem}"))

    def _check(self, msg: Arrive | Append | Release) -> str | None:
        """What is wrong with a message from the router, or None. The router validated the request already;
        this keeps anything else that reaches the socket from indexing out of the embedding table (on a GPU
        a device-side assert that takes the whole process down) or stalling the loop."""
        if isinstance(msg, Release):
            return None if msg.error is None else "a release from the router carries no error"
        tokens = msg.tokens
        if not isinstance(tokens, list) or (isinstance(msg, Arrive) and msg.first_visit and not tokens):
            return "tokens must be a list of token ids (not empty on a first visit)"
        vocab = self.sub.runner.arch.vocab_size
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                return f"token {t!r} at position {i} is not a token id in [0, {vocab})"
        if isinstance(msg, Arrive):
            if not isinstance(msg.state, dict) or not isinstance(msg.seen, dict):
                return "state and seen must be mappings"
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in msg.seen.values()):
                return f"seen must map models to token counts, got {msg.seen!r}"
            n = msg.num_prompt_tokens
            known = len(tokens) + max(msg.seen.values(), default=0)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= known:
                return f"num_prompt_tokens {n!r} does not fit the request"
            if msg.threshold is not None and (not isinstance(msg.threshold, int) or msg.threshold < 1):
                return f"threshold {msg.threshold!r} must be an integer >= 1"
            for name, least in (("kv_budget", 1), ("max_len", 1), ("arrival", 0)):
                value = getattr(msg, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                    return f"{name} {value!r} must be an integer >= {least}"
            try:
                msg.params.validate()
            except (ValueError, TypeError, AttributeError) as e:
                return str(e)
        return None

    def _on_router_gone(self, peer: ipc.Peer) -> None:
        with self._lock:
            orphans = [rid for rid, p in self._owner.items() if p is peer]
        if orphans:
            log.warning("%s: a router connection closed; releasing its %d request(s)", self.name, len(orphans))
        for rid in orphans:
            self.sub.submit(Release(rid, "abort"))

    # -- to the router ------------------------------------------------------------------------------------

    def _queue_event(self, ev: Event) -> None:
        """`emit` of the loop: for the response thread."""
        with self._queued_lock:
            self._queued += 1
            self._events.put(ev)

    def _send_now(self, events: list[Event]) -> bool:
        """A step's events after a handoff, sent by the loop thread itself (`Subserver.send_now`): the response thread
        would first have to wake and then wait for the GIL, which the loop holds while it prepares the next step
        (served on the H200 at C=8, the 32B's handoffs took 1.07 ms p50 to reach the router's loop,
        perf/results/flat_extend_grid_h200_2026-12-05).
        Only when nothing queued before them is unsent, all go to one router connection, and that socket takes
        them without blocking (`Peer.try_send`); False otherwise, and they take the queue."""
        if not self._queued_lock.acquire(blocking=False):
            return False
        try:
            if self._queued:
                return False
            with self._lock:
                peers = {self._owner.get(self._request_of(ev)) for ev in events}
            peer = peers.pop() if len(peers) == 1 else None
            if peer is None or peer.closed:
                return False
            try:
                if not peer.try_send(events):
                    return False
            except OSError:
                peer.close()  # as the response thread would: its reader thread releases what that router brought
                return False  # (the queue then drops them: their router is gone)
            with self._lock:
                for ev in events:
                    if isinstance(ev, Released):
                        self._owner.pop(ev.request_id, None)
            self.metrics.observe(events)
            return True
        finally:
            self._queued_lock.release()

    @staticmethod
    def _request_of(ev: Event) -> str:
        return ev.arrive.request_id if isinstance(ev, Handoff) else ev.request_id

    def _send_forever(self) -> None:
        """Drain events and send each router connection what is ready for it as one batch."""
        next_report = 0.0
        reports = 0  # sent reports that held steps: the first few go out faster (autotune.report_interval)
        while not self._stop.is_set():
            try:
                first = self._events.get(timeout=0.1)
                batch = [first]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            per_peer: dict[ipc.Peer, list[Event]] = {}
            with self._lock:
                for ev in batch:
                    rid = self._request_of(ev)
                    peer = self._owner.get(rid)
                    if isinstance(ev, Released):
                        self._owner.pop(rid, None)
                    if peer is None or peer.closed:
                        continue  # its router went away; the request was released here
                    per_peer.setdefault(peer, []).append(ev)
                peers = {p for p in self._owner.values() if not p.closed}
            if self._report_every is not None and time.monotonic() >= next_report and peers:
                report = StepStatsReport(self.name, self.sub.stats.snapshot())
                reports += bool(report.stats["latency"])
                next_report = time.monotonic() + report_interval(self._report_every, reports)
                for p in peers:
                    per_peer.setdefault(p, []).append(report)
            for peer, events in per_peer.items():
                try:
                    peer.send(events)
                except OSError:
                    peer.close()  # its reader thread releases what that router brought here
            if batch:
                with self._queued_lock:
                    self._queued -= len(batch)
            self.metrics.observe(batch)  # (counted here, sent to tritonserver by the metrics thread)

    def _heartbeat(self) -> Heartbeat:
        """This model's heartbeat: it tells the router this model's KV pool (the deployment's admission budget and
        longest request)."""
        return Heartbeat(self.name, self.sub.block_manager.num_tokens)

    def _greet(self, peer: ipc.Peer) -> None:
        """A router's new connection gets a heartbeat at once, before any request can come through it: so the
        router knows the pools before its first request, not a check interval later."""
        peer.send([self._heartbeat()])

    def _beat_forever(self) -> None:
        """Heartbeats to the routers that heard nothing for a while, and the loop's watchdog (serving/watchdog.py).
        A thread of its own that does nothing else: the response thread can wait on a send to a slow router."""
        beat = self._heartbeat()
        while not self._stop.wait(CHECK_EVERY_S):
            now = time.monotonic()
            for peer in self.listener.peers() if self.listener is not None else []:
                if now - peer.last_sent >= HEARTBEAT_S:
                    try:
                        peer.send([beat])
                    except OSError:
                        peer.close()
            if self._watchdog is not None:
                self._watchdog.check(now)

    # -- Triton entry points ----------------------------------------------------------------------------

    def execute(self, requests: list[Any]) -> list[Any]:
        """The probe (`tokenrouter_probe`), which only the router sends: answers that this model is up. (A
        probe to a stub that died makes the Python backend restart it; see `RouterModel._revive`.)"""
        ready = self.pb.Tensor("tokenrouter_ready", np.array([True], dtype=np.bool_))
        return [self.pb.InferenceResponse(output_tensors=[ready]) for _ in requests]

    def finalize(self) -> None:
        self.listener.close()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.sub.timeline is not None:
            self.sub.timeline.close()
