"""The coordinator: per-request bookkeeping across models, independent of where the models run.

It admits requests to the entry model, forwards each handoff to its target, collects committed tokens
for streaming, and finalizes a request (exactly one final output) once it finished and every model that
held it freed its KV. It never touches a tensor, and it does not know where the models run: messages go
out through `self.transport` (transport/base.py; in process: transport/local.py, served:
transport/sockets.py) and the models' events come back to `_on_event`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from tokenrouter.config import EngineConfig
from tokenrouter.engine.autotune import EARLY_SOLVES, LoadMeter
from tokenrouter.engine.outputs import RequestOutput, RequestState
from tokenrouter.routing.policy import Policy
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.tokenizer import PromptCharBound, encode_prompt
from tokenrouter.transport.base import Transport
from tokenrouter.transport.messages import Append, Arrive, Commit, Event, Failed, Handoff, Release, Released
from tokenrouter.tuning.system import clamp_thresholds

Prompt = str | list[int]

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        max_model_len: int,
        entry_policy: Policy,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_names = list(config.models)
        self.entry_policy = entry_policy
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._tuned: dict[str, int] | None = None
        self.num_solves = 0  # `thresholds: auto` solves that answered (the first ones come sooner: autotune.py)
        self.load = LoadMeter()  # the concurrency `thresholds: auto` solves for
        self.thresholds: dict[str, int] = {}
        self.pool_tokens: dict[str, int] = {}  # each model's KV pool in tokens, where known (kv_budget)
        self._prompt_char_bound: PromptCharBound | None = None
        if tokenizer is not None:
            self._warm_tokenizer()
        # How messages reach the models; set by the subclass before the first delivery or threshold update.
        self.transport: Transport

    def _deliver(self, model: str, msg: Arrive | Append | Release) -> None:
        """Send a message to a model through the transport (its events come back through `_on_event`)."""
        self.transport.deliver(model, msg)

    def _collect(self, out: RequestOutput) -> None:
        """Hook: an output for a request without a listener."""

    # -- input ----------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated against the vocabulary and the context limit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            # Refused before tokenizing: tokenizing megabytes stalls every other request on this thread.
            self._prompt_bound().check(len(prompt))
            ids = encode_prompt(self.tokenizer, prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty")
            self._check_token_ids(ids, "prompt")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        limit = self.context_limit()
        if len(ids) >= limit:
            held = ", the smallest KV pool among the deployment's models" if limit < self.max_model_len else ""
            raise ValueError(
                f"prompt has {len(ids)} tokens, but the context limit is {limit}{held} "
                "(prompt plus at least one generated token)"
            )
        return ids

    def context_limit(self) -> int:
        """The most tokens a request (prompt and output) may reach: the models' declared limit, lowered to the
        smallest KV pool once the models have told it (`pool_tokens`; each model stops requests there, so a longer
        prompt could only fail after a model had prefilled it)."""
        return min([self.max_model_len, *self.pool_tokens.values()])

    def _warm_tokenizer(self) -> None:
        """What the first text prompt would otherwise pay for, before any request: the vocabulary scan behind
        the prompt length bound (Qwen3's 151,936 entries: a fresh server's first requests reached the model 60-64
        ms after they were sent on the H200 host, 4-8 ms once the scan ran at start) and the tokenizer's first
        call."""
        self._prompt_bound()
        self.tokenizer("warm-up")

    def _prompt_bound(self) -> PromptCharBound:
        """The character bound on text prompts (the OpenAI frontend applies the same one) for the context limit now
        (`context_limit`: lower once the models' pools are known); the vocabulary is scanned once."""
        if self._prompt_char_bound is None:
            self._prompt_char_bound = PromptCharBound.of(self.tokenizer, self.max_model_len)
        limit = self.context_limit()
        bound = self._prompt_char_bound
        return bound if bound.max_model_len == limit else bound.for_limit(limit)

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{what} token at position {i} is not an integer: {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"{what} token id {t} at position {i} is out of the vocabulary (size {self.vocab_size})"
                )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        listener: Callable[[RequestOutput], None] | None = None,
    ) -> str:
        """Validate and queue one request; raises ValueError (and queues nothing) on bad input.

        `listener`, if given, is called (from the engine's thread) with every output delta."""
        self._check_open()
        params = params or SamplingParams()
        params.validate()
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        ids = self.tokenize(prompt)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already in use")
            state = self.entry_policy.initial_state(ids)
            req = RequestState(rid, ids, params, self.config.entry, listener, self.model_names)
            req.holders.add(self.config.entry)
            self.requests[rid] = req
            self._update_thresholds()
            arrival = time.time_ns()  # (Arrive.arrival: its age, on every model)
        arrive = Arrive(rid, list(ids), True, len(ids), params, state, None, {}, kv_budget=self.kv_budget(),
                        arrival=arrival)
        self._deliver(self.config.entry, arrive)
        return rid

    def kv_budget(self) -> int | None:
        """The smallest KV pool (tokens) of the models other than the entry, of those known: what the requests the
        entry model holds must fit, since each may come to hold KV on every model. A model whose pool is smaller
        than the entry's otherwise took parked requests' blocks for every first visit once the entry admitted
        more than it holds (perf/results/kv_reclaims_cpu_2026-12-06)."""
        pools = [n for m, n in self.pool_tokens.items() if m != self.config.entry]
        return min(pools) if pools else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request on every model and free its KV; returns its final output if it was live."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return None
            req.finish_reason = "abort"
            req.result_taken = True  # the caller gets the final output from this call
            for model in list(req.holders):
                self._deliver(model, Release(request_id, "abort"))
            self._maybe_finalize(req)
        self._after_abort()
        return req.output(self.tokenizer, final=True)

    def _after_abort(self) -> None:
        """Hook: run what the abort set in motion (stepped mode handles the releases right away)."""

    def _check_open(self) -> None:
        """Hook: refuse work after shutdown."""

    # -- events ---------------------------------------------------------------------------------------

    def _on_event(self, ev: Event) -> None:
        with self._lock:
            req = self.requests.get(ev.request_id if not isinstance(ev, Handoff) else ev.arrive.request_id)
            if req is None:
                return
            if not isinstance(ev, Released) and ev.model not in req.holders:
                # Stale: from a model whose part of the request is gone already. Routing around a model that went
                # down takes the request back to the entry model; what the dead model sent just before (a commit,
                # a handoff, a send to it that failed), read or handled after that, must not add tokens the entry
                # model computes again, hand it a request it already runs, or fail the request
                # (tests/test_route_around_races.py).
                return
            if isinstance(ev, Commit):
                req.on_commit(ev)
                if ev.finish_reason is not None:
                    for model in req.holders - {ev.model}:
                        self._deliver(model, Release(req.request_id))
                self._notify(req)
            elif isinstance(ev, Handoff):
                if req.finished:
                    return  # cancelled in flight: the source was already told to release
                if self._unavailable(ev.target):  # went down meanwhile: the source goes on (it is told why first)
                    self._take_back(req, ev.model, ev.target, ev.arrive.seen, ev.arrive.state)
                    return
                self._note_handoff(req, ev)
                self._deliver(ev.target, ev.arrive)
            elif isinstance(ev, Released):
                req.holders.discard(ev.model)
                if ev.held:
                    req.forwarded[ev.model] = ev.num_forwarded_tokens
                    req.cached[ev.model] = ev.num_cached_tokens
            elif isinstance(ev, Failed):
                if not req.finished:
                    req.finish_reason, req.error = "error", ev.error
                    for model in req.holders - {ev.model}:
                        self._deliver(model, Release(req.request_id, "error"))
            self._maybe_finalize(req)

    def _forward_now(self, ev: Handoff, send: Callable[[str, Arrive], bool]) -> bool:
        """Forward a plain handoff (its request live, its target not down) through `send`, from the thread that got
        it rather than the coordinator's (served: a link's reader thread; the caller holds the lock, waited for a
        bounded time). `send` must not block; False from it, or a handoff that is not plain, leaves
        the handoff to the coordinator's thread, untouched. (In process the models' loops leave their handoffs to
        the coordinator's thread: forwarding them from the loops measured no shorter on the CPU,
        perf/results/handoff_short_way_cpu_2026-12-05.)"""
        req = self.requests.get(ev.arrive.request_id)
        if (req is None or req.finished or ev.model not in req.holders or self._unavailable(ev.target)
                or not send(ev.target, ev.arrive)):
            return False
        self._note_handoff(req, ev)
        return True

    @staticmethod
    def _note_handoff(req: RequestState, ev: Handoff) -> None:
        """The request's bookkeeping for a handoff forwarded to its target (under the lock)."""
        req.handoffs += 1
        req.owner = ev.target
        req.holders.add(ev.target)
        req.seen, req.route_state = ev.arrive.seen, ev.arrive.state

    def _unavailable(self, model: str) -> bool:
        """Hook: whether `model` is down and requests go on without it (served, model_down: route_around)."""
        return False

    def _take_back(self, req: RequestState, model: str, gone: str, seen: dict[str, int], state: dict) -> None:
        """`model`, which kept the request's KV, goes on with it where `gone` (down) had it: the tokens it has not
        seen (none, when `gone` had produced nothing: it then computes its last token again)."""
        tokens = req.prompt_ids + req.output_ids
        # Its KV on `gone` is lost, whether or not `gone` is marked down yet (a send to it failed first).
        seen = {m: n for m, n in seen.items() if m != gone and not self._unavailable(m)}
        suffix = tokens[seen.get(model, len(tokens)) :]
        seen[model] = max(seen.get(model, 0), len(tokens))
        req.owner, req.seen, req.route_state = model, seen, state
        log.warning("request %s: model %r is down; %r goes on with it from its own KV (%d new token(s))",
                    req.request_id, gone, model, len(suffix))
        self._deliver(model, Arrive(req.request_id, suffix, False, len(req.prompt_ids), req.params, state, gone, seen))

    def _maybe_finalize(self, req: RequestState) -> None:
        """A request ends (one final output) once it finished and every model freed its KV."""
        if req.finished and not req.holders and not req.finalized:
            req.finalized = True
            del self.requests[req.request_id]
            self._update_thresholds()
            self._notify(req)

    def _notify(self, req: RequestState) -> None:
        out = req.output(self.tokenizer, final=req.finalized)
        if out.finished or out.delta_token_ids:
            if req.listener is not None:
                try:
                    req.listener(out)
                except Exception:  # a consumer that went away must not stop the others
                    log.exception("request %s: output listener failed; detaching it", req.request_id)
                    req.listener = None
            elif not req.result_taken:
                self._collect(out)

    # -- delayed batching ------------------------------------------------------------------------------

    def _incumbent(self) -> dict[str, int] | None:
        """The thresholds a re-solve keeps unless beaten by SWITCH_GAIN; none during the early solves, made from
        the least data (autotune.EARLY_SOLVES)."""
        return self._tuned if self.num_solves >= EARLY_SOLVES else None

    def apply_tuned(self, tuned: dict[str, int]) -> None:
        """A solve's thresholds (model -> B), in force from now on (clamped for the requests in the system; under
        the lock, as every other caller of _update_thresholds: the tuner's thread would otherwise clamp for a stale
        count of requests)."""
        with self._lock:
            self._tuned = tuned
            self.num_solves += 1
            self._update_thresholds()

    def _update_thresholds(self) -> None:
        """Keep sum(B_i - 1) < N for the N requests in the system, so they can never all wait in queues."""
        tuned = self._tuned or {}
        want = {m: tuned.get(m, self.config.batching.threshold_of(m)) for m in self.model_names}
        self.load.update(len(self.requests))
        want = dict(zip(want, clamp_thresholds(list(want.values()), len(self.requests))))
        if want != self.thresholds:
            self.thresholds = want
            self.transport.thresholds_changed(dict(want))

