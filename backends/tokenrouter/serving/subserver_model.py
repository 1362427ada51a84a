"""Role `subserver` (models `small`, `large`, ...): one model's decoding loop in its own Triton instance.

The router reaches it over a local socket (`transport.ipc`), not through Triton requests: messages come in
on a connection's reader thread and go to the decoding loop; events leave from a response thread,
batched per router connection. If a router goes away, every request it brought here is released (its KV
freed). Triton requests sent to this model directly are answered with an error: it is internal.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from tokenrouter.config import load_config
from tokenrouter.engine.stop import StopChecker
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.routing.policy import make_policy
from tokenrouter.runner.arch import ArchConfig, declared_context_limit
from tokenrouter.serving.metrics import SubserverMetrics
from tokenrouter.transport import ipc
from tokenrouter.transport.messages import Append, Arrive, Event, Handoff, Release, Released, StepStatsReport

log = logging.getLogger(__name__)


class SubserverModel:
    def __init__(self, args: dict[str, Any], settings: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        config = load_config(settings["config"])
        name = settings["model"]
        if name not in config.models:
            raise ValueError(f"model.json names model {name!r}, which the config does not define")
        self.name = name
        mcfg = config.models[name]
        if args.get("model_instance_kind") == "GPU":
            mcfg.device = f"cuda:{args['model_instance_device_id']}"
        tokenizer = load_tokenizer(config.tokenizer_path)
        entry_arch = ArchConfig.from_dir(config.entry_model.path)
        max_len = declared_context_limit(config)
        pol_name, pol = config.policy_spec()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.sub = Subserver(
            mcfg,
            make_policy(pol_name, list(config.models), name, pol),
            StopChecker(tokenizer, set(entry_arch.eos_token_ids), max_len),
            self._events.put,
            default_kv_tokens=config.cpu_kv_cache_tokens,
            threshold=config.batching.threshold_of(name),
            max_wait_s=config.batching.max_wait_ms / 1000.0,
        )
        self.sub.stop.max_model_len = min(max_len, self.sub.runner.max_model_len)
        # Which router connection each request came from: its events go back there.
        self._lock = threading.Lock()
        self._owner: dict[str, ipc.Peer] = {}
        self._stop = threading.Event()
        self.metrics = SubserverMetrics(pb_utils, name, self.sub)
        self._report_every = config.batching.auto_interval_s if config.batching.thresholds == "auto" else None
        self._threads = [
            threading.Thread(target=self.sub.serve_forever, args=(self._stop,), name=f"tr-{name}", daemon=True),
            threading.Thread(target=self._send_forever, name=f"tr-{name}-responses", daemon=True),
            threading.Thread(target=self.metrics.update_forever, args=(self._stop,), daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.listener = ipc.ModelListener(name, self._on_messages, self._on_router_gone)

    # -- from the router (connection reader threads) ----------------------------------------------------

    def _on_messages(self, peer: ipc.Peer, messages: list[Any]) -> None:
        for msg in messages:
            if not isinstance(msg, Arrive | Append | Release):
                log.error("%s: ignoring a %s from the router", self.name, type(msg).__name__)
                continue
            with self._lock:
                self._owner[msg.request_id] = peer
            self.sub.submit(msg)

    def _on_router_gone(self, peer: ipc.Peer) -> None:
        with self._lock:
            orphans = [rid for rid, p in self._owner.items() if p is peer]
        if orphans:
            log.warning("%s: a router connection closed; releasing its %d request(s)", self.name, len(orphans))
        for rid in orphans:
            self.sub.submit(Release(rid, "abort"))

    # -- to the router ------------------------------------------------------------------------------------

    def _send_forever(self) -> None:
        """Drain events and send each router connection what is ready for it as one batch."""
        next_report = 0.0
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
                    self.metrics.observe(ev)
                    rid = ev.arrive.request_id if isinstance(ev, Handoff) else ev.request_id
                    peer = self._owner.get(rid)
                    if isinstance(ev, Released):
                        self._owner.pop(rid, None)
                    if peer is None or peer.closed:
                        continue  # its router went away; the request was released here
                    per_peer.setdefault(peer, []).append(ev)
                peers = {p for p in self._owner.values() if not p.closed}
            if self._report_every is not None and time.monotonic() >= next_report and peers:
                next_report = time.monotonic() + self._report_every
                report = StepStatsReport(self.name, self.sub.stats.snapshot())
                for p in peers:
                    per_peer.setdefault(p, []).append(report)
            for peer, events in per_peer.items():
                try:
                    peer.send(events)
                except OSError:
                    peer.close()  # its reader thread releases what that router brought here

    # -- Triton entry points ----------------------------------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        message = (
            f"model {self.name!r} is internal to the tokenrouter deployment; send requests to model 'tokenrouter'"
        )
        for request in requests:
            response = self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message))
            try:
                request.get_response_sender().send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                log.debug("could not answer a direct request")
        return None

    def finalize(self) -> None:
        self.listener.close()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
