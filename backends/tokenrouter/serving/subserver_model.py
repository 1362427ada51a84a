"""Role `subserver` (models `small`, `large`, ...): one model's decoding loop in its own Triton instance.

`execute` only decodes messages and hands them to the loop thread; events leave from a separate response
thread. Each visit of a request (an `Arrive`) is one decoupled BLS stream from the router: commits stream
back on it, and it ends (final flag) with the handoff, or when the request's KV is freed here. A `Release`
call ends with the `Released` event.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from tokenrouter.config import load_config
from tokenrouter.engine.stop import StopChecker
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.routing.policy import make_policy
from tokenrouter.runner.arch import ArchConfig, declared_context_limit
from tokenrouter.serving.metrics import SubserverMetrics
from tokenrouter.transport import codec
from tokenrouter.transport.messages import Arrive, Commit, Event, Failed, Handoff, Release, Released

log = logging.getLogger(__name__)


class SubserverModel:
    def __init__(self, args: dict[str, Any], settings: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        config = load_config(settings["config"])
        name = settings["model"]
        if name not in config.models:
            raise ValueError(f"model.json names model {name!r}, which the config does not define")
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
        # Senders by request id: the open visit stream, and pending Release calls.
        self._lock = threading.Lock()
        self._visits: dict[str, Any] = {}
        self._releases: dict[str, list[Any]] = defaultdict(list)
        self._stop = threading.Event()
        self.metrics = SubserverMetrics(pb_utils, name, self.sub)
        self._threads = [
            threading.Thread(target=self.sub.serve_forever, args=(self._stop,), name=f"tr-{name}", daemon=True),
            threading.Thread(target=self._send_forever, name=f"tr-{name}-responses", daemon=True),
            threading.Thread(target=self.metrics.update_forever, args=(self._stop,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                raw = self.pb.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
                messages = codec.decode(raw)
            except Exception as e:
                self._final_error(sender, f"malformed subserver message: {e}")
                continue
            for msg in messages:
                with self._lock:
                    if isinstance(msg, Arrive):
                        self._visits[msg.request_id] = sender
                    elif isinstance(msg, Release):
                        self._releases[msg.request_id].append(sender)
                self.sub.submit(msg)
        return None

    def _send_forever(self) -> None:
        """Drain events, batching what is ready per request into one response (fewer IPC round trips)."""
        while not self._stop.is_set():
            try:
                first = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            per_request: dict[str, list[Event]] = {}
            for ev in batch:
                rid = ev.arrive.request_id if isinstance(ev, Handoff) else ev.request_id
                per_request.setdefault(rid, []).append(ev)
                self.metrics.observe(ev)
            for rid, events in per_request.items():
                self._send(rid, events)

    def _send(self, rid: str, events: list[Event]) -> None:
        last = events[-1]
        ends_visit = isinstance(last, Handoff | Released)
        with self._lock:
            visit = self._visits.pop(rid, None) if ends_visit else self._visits.get(rid)
            releases = self._releases.pop(rid, []) if isinstance(last, Released) else []
        payload = self._response(events)
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if visit is not None:
            _try_send(visit, payload, final if ends_visit else 0)
        for sender in releases:
            _try_send(sender, self._response([last]), final)
        if visit is None and not releases and isinstance(last, Commit | Failed):
            log.warning("%s: events for %s with no open stream", self.sub.name, rid)

    def _response(self, events: list[Event]) -> Any:
        data = np.array([codec.encode(events).encode()], dtype=np.object_)
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor("text_output", data)])

    def _final_error(self, sender: Any, message: str) -> None:
        response = self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message))
        _try_send(sender, response, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)


def _try_send(sender: Any, response: Any, flags: int) -> None:
    try:
        sender.send(response, flags=flags)
    except Exception:  # the router went away (server shutting down)
        log.debug("response could not be sent")

