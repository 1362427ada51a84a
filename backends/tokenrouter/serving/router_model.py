"""Role `router` (the `tokenrouter` model, the entry point): the coordinator of a Triton deployment.

It tokenizes, admits each request to the entry subserver and forwards every handoff's token suffix and
routing state to its target over that model's local socket (`transport.ipc`); each model's events come
back on the same connection. Routing decisions stay inside the subservers: only handoffs cross models.
Everything runs on one asyncio loop thread but the handoffs, which the socket reader threads forward themselves
(under the coordinator's lock); `execute` only enqueues, the reader threads post the rest, and the responses to
clients (and the request metrics: TTFT, inter-token latency, finished) leave from a responder thread in the order
the loop made them (a stream's that queued up behind one another as one response).
With `thresholds: auto` the router also solves the delayed-batching thresholds from the step statistics
the subservers report, and exports them and the predicted throughput as metrics.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenrouter.config import EngineConfig, load_config
from tokenrouter.engine.autotune import (
    SolveFailures,
    TunedThresholds,
    measured,
    solve_in_subprocess,
    solve_interval,
)
from tokenrouter.engine.coordinator import Coordinator
from tokenrouter.engine.outputs import RequestOutput, RequestState
from tokenrouter.engine.timeline import Timeline
from tokenrouter.routing.policy import make_policy
from tokenrouter.runner.arch import declared_context_limit, shared_vocab_size
from tokenrouter.serving.metrics import RouterMetrics
from tokenrouter.serving.model_control import (
    ReviveAttempts,
    UnloadedOnPurpose,
    cannot_reload,
    check_not_unloaded,
    reload_model,
)
from tokenrouter.serving.responder import Chunk, Responder
from tokenrouter.serving.server import ROUTER_BEAT_ENV
from tokenrouter.serving.tensors import TIMEOUT_ERROR, GenerateRequest, parse_request
from tokenrouter.serving.watchdog import CHECK_EVERY_S, HEARTBEAT_S, SilenceWatch
from tokenrouter.tokenizer import load_tokenizer
from tokenrouter.transport import ipc
from tokenrouter.transport.messages import Handoff, Heartbeat, Released, StepStatsReport, Unavailable
from tokenrouter.transport.sockets import SocketTransport

log = logging.getLogger(__name__)

# How often the router asks Triton whether a client cancelled (one IPC round trip per live request).
CANCEL_POLL_S = 0.05
# How long Python keeps every request, response sender and response it handed to Triton after the last use
# (see `_Graveyard`).
KEEP_TRITON_OBJECTS_S = 10.0
# Reviving a model whose process died: how long its socket may take to answer once Triton says it is
# loaded again.
REVIVE_CONNECT_S = 10.0
# Threads that tokenize text prompts (off the loop, off Triton's execute thread): a prompt near the length bound
# takes 1-3 s and holds hundreds of MB meanwhile; a short prompt behind one need not wait for it.
TOKENIZE_WORKERS = 2
# How long a link's reader thread waits for the coordinator's lock to forward a handoff itself before it leaves the
# handoff to the loop (`SocketCoordinator._from_link`): it must never wait on whatever holds the lock.
FORWARD_LOCK_WAIT_S = 0.002
# How long the first requests after start may wait for every model's KV pool (`SocketCoordinator.await_pools`):
# each model sends it as it accepts the router's connection, a few ms at most once the model is loaded.
POOLS_WAIT_S = 2.0
# What a request still unanswered when the router unloads is told.
SHUTTING_DOWN = "the server is shutting down"


def _log_failure(job: concurrent.futures.Future) -> None:
    """A tokenizing job that raised past its own handlers (its request may be unanswered): logged, not lost."""
    if not job.cancelled() and job.exception() is not None:
        log.error("tokenizing a request failed", exc_info=job.exception())


class SocketCoordinator(Coordinator):
    """The coordinator over the local sockets' transport (transport/sockets.py), plus what the router knows
    of its models' processes (down or back, step statistics). Call it on the loop thread only, but for
    `tokenize` and `_check_open`, which read only what is fixed at start (the tokenizer, the bound) or one dict
    read (`down`), and `_from_link`, the links' reader threads, which forwards handoffs under the lock."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        tokenizer = load_tokenizer(config.tokenizer_path)
        vocab_size = shared_vocab_size(config)
        name, pol = config.policy_spec()
        entry_policy = make_policy(name, list(config.models), config.entry, pol)
        super().__init__(config, tokenizer, vocab_size, declared_context_limit(config), entry_policy)
        self.loop = loop
        # Models whose process went away, with why; requests are refused until they are back.
        self.down: dict[str, str] = {}
        # Models the watchdog killed, with why: what their requests are told when the socket closes.
        self.killed: dict[str, str] = {}
        self.on_model_down: Callable[[str], None] = lambda model: None
        self.on_kv_budget: Callable[[int | None], None] = lambda tokens: None  # (a model's pool became known)
        # Each model's latest step statistics as it reported them (StepStats.snapshot()): checked only by the
        # solve's child process, off this loop.
        self.step_reports: dict[str, dict[str, Any]] = {}
        urls = {n: m.url for n, m in config.models.items() if m.url is not None}
        self.transport = SocketTransport(self.model_names, urls, loop, self._on_event, self._from_link,
                                         self._model_gone, self._send_failed)
        self._update_thresholds()
        # TOKENROUTER_TIMELINE_DIR: when each handoff passed through here (perf/timeline.py served)
        self.timeline = Timeline.from_env("router")
        self._pools_settled = threading.Event()  # await_pools has run
        self._pools_lock = threading.Lock()

    def await_pools(self, timeout: float = POOLS_WAIT_S) -> None:
        """Before the first requests (on a tokenizing thread, not the loop): connect to each model whose KV pool is
        not known yet, of this server or a peer's, and wait, `timeout` at most, until its greeting heartbeat (sent
        as it accepts the connection; a peer's gateway relays it) has been handled, so that the first requests are
        limited and admitted by the pools as all later ones are. tritonserver reports ready as soon as every model
        is loaded, which can be before the router's watchdog thread has connected to the last one; a peer's model
        is connected by the first message sent to it. Returns at once after the first wait, whatever it found (a
        model that never reports must not hold every request)."""
        if self._pools_settled.is_set():
            return
        with self._pools_lock:  # one thread waits, the others wait for it
            if self._pools_settled.is_set():
                return
            deadline = time.monotonic() + timeout
            links = {m: link for m, link in self.transport.links.items() if m not in self.down}
            for link in links.values():
                with contextlib.suppress(ConnectionError):
                    link.connect(timeout=max(0.0, deadline - time.monotonic()))
            while any(m not in self.pool_tokens for m in links) and time.monotonic() < deadline:
                time.sleep(0.002)
            missing = [m for m in links if m not in self.pool_tokens]
            if missing:
                log.warning("no KV pool heard from %s within %.1f s: requests are admitted without it", missing,
                            timeout)
            self._pools_settled.set()

    # -- on a link's reader thread ----------------------------------------------------------------------

    def _from_link(self, events: list[Any]) -> None:
        """A batch from a model: its plain handoffs go on from here (`_forward_now`), the rest to the loop. A
        handoff waited behind whatever the loop was doing (other models' commits, clients' responses) and for the
        loop to wake. Under the coordinator's lock, as on the loop, with the same bookkeeping: what the loop does
        about the request (a cancel, a commit) comes wholly before or after it. The rest of the batch reaches the
        loop's queue before an Arrive leaves, so everything its target then sends is handled after it.

        A reader thread never waits long: the lock for FORWARD_LOCK_WAIT_S at most, and an Arrive goes only if its
        socket takes it at once (`SocketTransport.try_deliver`); a model that stopped reading must not stop the
        router from hearing the others. Everything else is the loop's, as before: batches without a handoff,
        handoffs of requests gone or finished, to a model that is down (its link closes before the loop learns
        it, and then routing around it takes the request back) or on a peer server, or that could not go at once."""
        handoffs = [ev for ev in events if isinstance(ev, Handoff)]
        if not handoffs or not self._lock.acquire(timeout=FORWARD_LOCK_WAIT_S):
            self.loop.call_soon_threadsafe(self._handle_events, events)
            return
        try:
            rest = [ev for ev in events if not isinstance(ev, Handoff)]
            if rest:
                self.loop.call_soon_threadsafe(self._handle_events, rest)
            for ev in handoffs:
                relayed = time.monotonic()
                try:
                    sent = self._forward_now(ev, self.transport.try_deliver)
                except Exception:  # the loop forwards it instead, and reports what goes wrong there
                    log.exception("relaying a handoff of %s to %r failed", ev.arrive.request_id, ev.target)
                    sent = False
                if not sent:
                    self.loop.call_soon_threadsafe(self._handle_events, [ev])
                elif self.timeline is not None:
                    self.timeline.relay(ev.arrive.request_id, ev.model, ev.target, relayed)
        finally:
            self._lock.release()

    # -- on the loop thread -----------------------------------------------------------------------------

    def _handle_events(self, events: list[Any]) -> None:
        timeline = self.timeline
        start = time.monotonic() if timeline is not None else 0.0
        # Handoffs first: a batch holds a step's commits too, and each commit costs a response to a client while
        # the handed-off requests wait idle for their target. A handoff may pass its request's commit of the same
        # step (it carries that token already); nothing of its request follows it out of that step. (Its Arrive
        # may carry a threshold from before a request that finishes in this batch: one bounded wait at most.)
        for ev in sorted(events, key=lambda e: not isinstance(e, Handoff)):
            if isinstance(ev, StepStatsReport):
                self.step_reports[ev.model] = ev.stats
            elif isinstance(ev, Heartbeat):
                # (its arrival was noted where it was read: ModelLink.last_heard)
                tokens = ev.kv_tokens
                if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 and (
                        self.pool_tokens.get(ev.model) != tokens):
                    self.pool_tokens[ev.model] = tokens
                    self.transport.max_len = self.context_limit()
                    self.on_kv_budget(self.kv_budget())
            else:
                if timeline is not None and isinstance(ev, Handoff):  # before the send: the target may be quicker
                    timeline.relay(ev.arrive.request_id, ev.model, ev.target, time.monotonic())
                self._on_event(ev)
        if timeline is not None:
            timeline.router_batch(start, time.monotonic(), len(events))

    def _model_gone(self, model: str) -> None:
        """The model's process exited: everything it held is lost; fail those requests cleanly (or, routing
        around it, go on with them at the entry model), refuse new ones until it is back, and have it revived."""
        around = self._routes_around(model)
        held = [rid for rid, r in self.requests.items() if model in r.holders]
        log.error("model %r went away holding %d request(s); %s", model, len(held),
                  "the entry model goes on with them" if around else "failing them")
        url = self.config.models[model].url
        cause = self.killed.pop(model, None) or (
            "its process exited, or the server is shutting down" if url is None
            else f"its peer server at {url} went away or cannot be reached")
        if model not in self.down:
            self.down[model] = (
                f"model {model!r} is unavailable: its process exited and is being restarted; retry shortly"
                if url is None else f"model {model!r} is unavailable: {cause}; retry shortly"
            )
            self._tell_unavailable()  # before any request is taken back: nothing is routed there again
            self.on_model_down(model)
        with self._lock:
            for rid in held:
                req = self.requests.get(rid)
                if req is not None and not self._go_on_without(req, model):
                    self.transport.fail(model, rid, f"model {model!r} went away during the request ({cause})")

    def _send_failed(self, model: str, request_id: str, error: str) -> None:
        """A message about a request could not be sent to `model`: its connection broke or is down. Routing around
        it, the entry model goes on with the request at once; its link's reader thread reports the loss itself
        (`_model_gone`), but may post it only after this (each link has its own thread): failing the request here
        would end a request that routing around keeps (a CI failure of tests/test_route_around_three.py)."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is not None and self._go_on_without(req, model):
                return
        self.transport.fail(model, request_id, error)

    def _go_on_without(self, req: RequestState, model: str) -> bool:
        """Routing around `model`, which lost its part of `req` (its KV there is gone): the entry model, which kept
        its own, goes on with the request where `model` had it. False when it cannot: not routing around that
        model, the request finished, or the entry model no longer holds it (the caller fails the request)."""
        if not (self._routes_around(model) and not req.finished and model in req.holders
                and self.config.entry in req.holders):
            return False
        self._on_event(Released(req.request_id, model, 0, 0, held=False))
        if req.owner == model:
            self._take_back(req, self.config.entry, model, req.seen, req.route_state)
        return True

    def model_back(self, model: str) -> None:
        if self.down.pop(model, None) is not None:
            log.warning("model %r is back", model)
            self._tell_unavailable()

    def _routes_around(self, model: str) -> bool:
        return self.config.model_down == "route_around" and model != self.config.entry

    def _unavailable(self, model: str) -> bool:
        return model in self.down and self._routes_around(model)

    def _tell_unavailable(self) -> None:
        """model_down: route_around: every model that is up learns which are down (subserver._set_unavailable)."""
        if self.config.model_down != "route_around":
            return
        down = sorted(self.down)
        for m in self.model_names:
            if m not in self.down:
                self.transport.deliver(m, Unavailable(down))

    def _check_open(self) -> None:
        # Any model may be routed to, so a request admitted now could fail half-way: refuse it up front; routing
        # around models that are down, only the entry model's absence refuses. (One copy of the reasons: a
        # tokenizing thread asks while the loop may add or pop one.)
        for model, reason in list(self.down.items()):
            if not self._routes_around(model):
                raise ValueError(reason)

    def retune(self) -> TunedThresholds | None:
        """`thresholds: auto`: solve B* from the reported statistics, in a child process (blocking: call it
        off the loop)."""
        reports = dict(self.step_reports)
        if set(reports) != set(self.model_names) or not measured(reports):
            return None
        return solve_in_subprocess(self.model_names, reports, self.load.take(),
                                   max_wait=self.config.batching.max_wait_ms / 1000.0,
                                   one_device=self.config.one_device, current=self._incumbent())

    def close(self) -> None:
        self.transport.close()
        if self.timeline is not None:
            self.timeline.close()


class _Graveyard:
    """Keeps Triton's Python objects (requests, response senders, responses and their tensors) alive for a
    while after their last use, then drops them on the router's loop.

    Triton 2.51's Python backend (python_backend r24.10) frees a tensor's numpy arrays in C++ without
    holding the GIL when C++ drops the last reference (e.g. pruning a response's outputs while sending, or
    releasing a request once its final response went out; fixed upstream in python_backend PR #390,
    r24.12). Under sustained load that corrupts the stub's heap: the router's stub crashed after about
    6,000 requests of a 10,000-request soak. When Python holds a reference longer than C++ does, the last
    reference is always ours, dropped with the GIL held."""

    def __init__(self, keep_s: float = KEEP_TRITON_OBJECTS_S) -> None:
        self.keep_s = keep_s
        self._graves: collections.deque[tuple[float, Any]] = collections.deque()  # appends are thread-safe

    def keep(self, *objects: Any) -> None:
        self._graves.append((time.monotonic() + self.keep_s, objects))

    def sweep(self) -> None:
        now = time.monotonic()
        while self._graves and self._graves[0][0] <= now:
            self._graves.popleft()


class _Client:
    """One client request: where its responses go and what it asked for."""

    def __init__(self, sender: Any, request: Any, gen: GenerateRequest, prompt_ids: list[int], start: float) -> None:
        self.sender, self.request, self.gen, self.prompt_ids = sender, request, gen, prompt_ids
        self.request_id: str | None = None
        self.start = start
        self.last_token: float | None = None
        self.done = False
        self.deadline: float | None = None  # request_timeout_s: when it is aborted and answered with an error
        self.timed_out = False


class RouterModel:
    def __init__(self, args: dict[str, Any], settings: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        self.config = load_config(settings["config"])
        self.loop = asyncio.new_event_loop()
        self.coordinator = SocketCoordinator(self.config, self.loop)
        self.coordinator.on_model_down = self._model_down
        self.metrics = RouterMetrics(pb_utils, args["model_name"])
        self.coordinator.on_kv_budget = self.metrics.kv_budget
        for model in self.config.models:
            self.metrics.model_up(model, True)
        self.clients: dict[str, _Client] = {}
        self.graveyard = _Graveyard()
        # Every response and request metric leaves from the responder's thread, in order (serving/responder.py).
        timeline = self.coordinator.timeline
        self.responder = Responder(self._build, self._observe, self.graveyard.keep,
                                   timeline.responses if timeline is not None else None)
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="tr-tokenize")
        self._closing = False
        self._thread = threading.Thread(target=self._run_loop, name="tr-router-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._watch_cancellations())
        self.loop.create_task(self._sweep_forever())
        if self.config.batching.thresholds == "auto":
            self.loop.create_task(self._tune_forever())
        if self.config.watchdog_timeout_s is not None:
            threading.Thread(target=self._watch_liveness, args=(self.config.watchdog_timeout_s,),
                             name="tr-router-watchdog", daemon=True).start()
        beat = os.environ.get(ROUTER_BEAT_ENV)
        if beat:  # tokenrouter serve watches this loop by it
            self.loop.create_task(self._beat_forever(Path(beat)))
        self.loop.run_forever()
        # Stopped by finalize: let the background tasks end cleanly instead of being destroyed pending.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    # -- Triton entry points ------------------------------------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            start = time.monotonic()
            sender = request.get_response_sender()
            try:
                gen = parse_request(lambda name, r=request: self._input(r, name))  # (validates the parameters)
            except ValueError as e:
                self._refuse(sender, str(e), request)
                continue
            try:
                job = self._tokenizing.submit(self._tokenize_then_admit, sender, request, gen, start)
            except RuntimeError:  # the pool is shut down: finalize ran
                self._send_error(sender, SHUTTING_DOWN, request)
                continue
            job.add_done_callback(_log_failure)
        return None

    def _tokenize_then_admit(self, sender: Any, request: Any, gen: GenerateRequest, start: float) -> None:
        """On a tokenizing thread. Not on the router's loop: a prompt near the length bound takes 1-3 s to
        tokenize, and on the loop it held every other stream's tokens back as long (perf/tokenize_stall.py). Not
        on Triton's execute thread either, where every request behind it would wait. The Rust tokenizer releases
        the GIL while it encodes (building the ids' Python list does not)."""
        if self._closing:
            self._send_error(sender, SHUTTING_DOWN, request)
            return
        try:
            self.coordinator._check_open()  # a model down: refused before the tokenizer's seconds
            self.coordinator.await_pools()  # (the first requests after start: the context limit needs the pools)
            ids = self.coordinator.tokenize(gen.prompt)
        except ValueError as e:
            self._refuse(sender, str(e), request)
            return
        except Exception as e:  # nothing may leave a request unanswered
            log.exception("tokenizing a prompt failed")
            self._refuse(sender, f"the prompt could not be tokenized: {e}", request)
            return
        try:
            self.loop.call_soon_threadsafe(self._admit, _Client(sender, request, gen, ids, start))
        except RuntimeError:  # the loop is closed: finalize ran
            self._send_error(sender, SHUTTING_DOWN, request)

    def _input(self, request: Any, name: str) -> np.ndarray | None:
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def finalize(self) -> None:
        # Requests still waiting to be tokenized are answered at once; those being tokenized reach the loop
        # (and are aborted below with the rest) before it stops.
        self._closing = True
        self._tokenizing.shutdown(wait=True)

        def stop() -> None:
            for rid, client in list(self.clients.items()):
                self.coordinator.abort(rid)
                if not client.done:  # its final response would come from models that are unloading
                    client.done = True
                    self._send_error(client.sender, SHUTTING_DOWN, client.request)
            self.coordinator.close()
            self.responder.finish()  # after the final responses above
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # the loop is stuck: end the responder after what it has
            log.warning("router: the event loop did not stop within 10 s")
            self.responder.finish()
        self.responder.join(timeout=10)  # the final responses go out before the model unloads
        if self.coordinator.timeline is not None:  # (closed with the coordinator: the responder's last batches)
            self.coordinator.timeline.flush()

    # -- on the loop thread ---------------------------------------------------------------------------------

    def _admit(self, client: _Client) -> None:
        rid = f"tr-{uuid.uuid4().hex[:16]}"
        client.request_id = rid
        if self.config.request_timeout_s is not None:
            client.deadline = client.start + self.config.request_timeout_s
        self.clients[rid] = client
        try:
            self.coordinator.add_request(client.prompt_ids, client.gen.params, rid, lambda o: self._respond(client, o))
        except ValueError as e:
            del self.clients[rid]
            self._refuse(client.sender, str(e), client.request)

    def _respond(self, client: _Client, out: RequestOutput) -> None:
        if client.done:
            return
        now = time.monotonic()
        chunk = Chunk()
        if out.delta_token_ids:
            if client.last_token is None:
                chunk.ttft_s = now - client.start
            else:
                chunk.itl_s.append((now - client.last_token) / len(out.delta_token_ids))
            client.last_token = now
        gen = client.gen
        if out.finished:
            client.done = True
            self.clients.pop(out.request_id, None)
            chunk.final, chunk.keep = True, (client.request,)  # (Triton ends the request with it)
            chunk.finished = out.finish_reason or "unknown"
            if client.timed_out:  # aborted at its deadline: the client learns why, not just "abort"
                chunk.finished = "timeout"
                chunk.error = f"{TIMEOUT_ERROR} ({self.config.request_timeout_s:g} s): aborted"
            elif out.finish_reason == "error":
                chunk.error = out.error or "request failed"
            else:
                chunk.extras = self._final_outputs(gen, out)
        if chunk.error is None:
            if gen.stream:
                chunk.text = out.delta_text.encode()
            elif out.finished:
                chunk.text = (out.text if gen.exclude_input_in_output else gen.prompt + out.text).encode()
        if chunk.sendable or chunk.ttft_s is not None or chunk.itl_s:
            self.responder.send(client.sender, chunk)

    def _final_outputs(self, gen: GenerateRequest, out: RequestOutput) -> dict[str, np.ndarray]:
        """The outputs a final response carries beside its text, as the request asked."""
        extras = {}
        if gen.return_finish_reason:
            extras["finish_reason"] = np.array([(out.finish_reason or "").encode()], dtype=np.object_)
        if gen.return_num_output_tokens:
            extras["num_output_tokens"] = np.array([len(out.token_ids)], dtype=np.uint32)
        if gen.return_routing_stats:
            keys = ("tokens_per_model", "first_token_model", "handoffs", "large_token_share")
            stats = {k: out.stats[k] for k in keys}
            stats["request_id"] = out.request_id  # the id the server's logs and timeline know it by
            extras["routing_stats"] = np.array([json.dumps(stats).encode()], dtype=np.object_)
        return extras

    def _build(self, chunk: Chunk) -> tuple[Any, int, list]:
        """The responder's: the response for `chunk`, its flags, and its tensors (kept from the send on)."""
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if chunk.error is not None:
            return self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(chunk.error)), final, []
        tensors = [self.pb.Tensor("text_output", np.array([chunk.text], dtype=np.object_))]
        tensors += [self.pb.Tensor(name, value) for name, value in chunk.extras.items()]
        return self.pb.InferenceResponse(output_tensors=tensors), final if chunk.final else 0, tensors

    def _observe(self, chunk: Chunk) -> None:
        """The responder's: the request metrics a chunk settles, before it is sent; one that fails does not keep
        the others from being recorded."""
        updates = [(self.metrics.inter_token_latency, itl) for itl in chunk.itl_s]
        if chunk.ttft_s is not None:
            updates.insert(0, (self.metrics.time_to_first_token, chunk.ttft_s))
        if chunk.finished is not None:
            updates.append((self.metrics.finished, chunk.finished))
        for update, value in updates:
            try:
                update(value)
            except Exception:
                log.exception("router: a request metric could not be recorded")

    def _model_down(self, model: str) -> None:
        self.metrics.model_up(model, False)
        threading.Thread(target=self._revive, args=(model,), name=f"tr-revive-{model}", daemon=True).start()

    def _revive(self, model: str) -> None:
        """Bring back a model whose process died: reload it through Triton's model-control API (Triton 2.51's
        Python backend never restarts a dead stub itself), then reconnect its socket; a model on a peer server
        is only reconnected, with back-off, once that server answers again. Runs on its own thread:
        a reload loads the model's weights. Without explicit model control (`tokenrouter serve` enables it)
        the model stays down, and requests are refused with a message that says so."""
        link = self.coordinator.transport.links[model]
        remote = self.config.models[model].url is not None  # its server is not ours to reload: reconnect
        attempts = ReviveAttempts(log, f"model {model!r}")
        reloading = False  # our reload began (its unload leaves the model "unloaded" should its load fail)
        unloaded = False  # Triton had unloaded it on request: once it is READY again, it only needs connecting
        while not self.coordinator.transport.closing:
            try:
                if not remote:
                    if not reloading:
                        check_not_unloaded(model)
                    if not unloaded:
                        log.warning("model %r: reloading it", model)
                        reloading = True
                        reload_model(model, self.pb)
                link.connect(timeout=REVIVE_CONNECT_S)
                break
            except ConnectionError as e:
                log.warning("model %r: its socket does not answer (%s); retrying", model, e)
                unloaded = False  # loaded by someone else but not answering: reload it ourselves
            except Exception as e:  # pb_utils.TritonModelException and anything else the reload raises
                if cannot_reload(e):
                    reason = (
                        f"model {model!r} is unavailable: its process exited, and this server cannot reload it "
                        f"({e}); restart tritonserver, or run it with --model-control-mode=explicit "
                        "--load-model=* (as tokenrouter serve does)"
                    )
                    log.error("%s", reason)
                    self.loop.call_soon_threadsafe(self.coordinator.down.__setitem__, model, reason)
                    return
                if isinstance(e, UnloadedOnPurpose):  # what a refused request is told, until it is loaded
                    unloaded = True
                    self.loop.call_soon_threadsafe(self.coordinator.down.__setitem__, model,
                                                   f"model {model!r} is unavailable: {e}")
                attempts.failed(e)
            time.sleep(attempts.wait())
        else:
            return
        self.metrics.model_up(model, True)
        self.loop.call_soon_threadsafe(self.coordinator.model_back, model)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.graveyard.sweep()

    async def _watch_cancellations(self) -> None:
        """Client cancelled the stream (or disconnected), or the request outlived request_timeout_s: abort on
        every model, which frees its KV."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            now = time.monotonic()
            for rid, client in list(self.clients.items()):
                if client.done or client.timed_out:
                    continue
                if client.deadline is not None and now >= client.deadline:
                    client.timed_out = True  # before the abort, which may deliver the final output itself
                    if self.coordinator.abort(rid) is None:  # it had finished: its own final answer stands
                        client.timed_out = False
                elif client.sender.is_cancelled():
                    self.coordinator.abort(rid)

    async def _beat_forever(self, path: Path) -> None:
        """Renew the beat file's time while this loop goes round: `tokenrouter serve` kills a router whose beat
        is older than watchdog_timeout_s (stopped or hung), and reloads it."""
        while True:
            with contextlib.suppress(OSError):
                path.touch()
            await asyncio.sleep(HEARTBEAT_S)

    def _watch_liveness(self, timeout_s: float) -> None:
        """Kill a model of this machine that sent nothing for watchdog_timeout_s (serving/watchdog.py): its socket
        then closes, which fails what it held and revives it. On a thread of its own: a check may wait a second
        for tritonserver's answer."""
        reason = f"its process made no progress for {timeout_s:g} s (watchdog_timeout_s) and was killed to restart it"
        watch = SilenceWatch(timeout_s, on_kill=lambda model: self.coordinator.killed.__setitem__(model, reason))
        links = self.coordinator.transport.links
        while not self.coordinator.transport.closing:
            time.sleep(CHECK_EVERY_S)
            for model, link in links.items():
                # Connected as soon as it listens, not at its first request: a process that stood still before
                # that is watched too.
                if isinstance(link, ipc.ModelLink) and not link.connected and model not in self.coordinator.down:
                    with contextlib.suppress(ConnectionError):
                        link.connect(timeout=0.0)
            watch.check(links, time.monotonic())

    async def _tune_forever(self) -> None:
        """Re-solve the thresholds every auto_interval_s while requests are in the system (the first solves
        sooner: autotune.solve_interval); the solve runs on a worker thread so the loop keeps serving."""
        failures = SolveFailures(log)
        while True:
            await asyncio.sleep(solve_interval(self.config.batching.auto_interval_s, self.coordinator.num_solves,
                                               failing=failures.last is not None))
            if not self.coordinator.requests:
                continue
            try:
                tuned = await self.loop.run_in_executor(None, self.coordinator.retune)
            except Exception as e:  # tuning is an optimization: never let it take serving down
                failures.failed(e)
                continue
            if tuned is not None:
                failures.solved()
                self.coordinator.apply_tuned(tuned.thresholds)
                self.metrics.tuned(tuned.thresholds, tuned.predicted_tok_s)

    def _refuse(self, sender: Any, message: str, request: Any) -> None:
        """A request refused before it was admitted (bad input, a model down): its error, counted as finished with
        reason "refused" so that the finished counter accounts for every request the router answered."""
        self._send_error(sender, message, request, finished="refused")

    def _send_error(self, sender: Any, message: str, request: Any = None, finished: str | None = None) -> None:
        """The final response: `message` as the request's error (`request` is kept from the send on); `finished`:
        the finish reason to count."""
        self.responder.send(sender, Chunk(final=True, error=message, keep=(request,), finished=finished))
