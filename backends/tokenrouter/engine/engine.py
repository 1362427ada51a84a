"""The in-process engine: one subserver per model plus a coordinator that moves handoffs between them.

    engine = Engine.from_config("config/r2r/tiny-small_tiny-large.yaml")
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64))

Two ways to run the same subservers:
- stepped (default): `step()` runs every subserver whose batching condition holds, in this thread; handy
  for tests and scripts, deterministic.
- background (`start()`, or any streaming call): one decoding-loop thread per subserver and one
  coordinator thread; `generate` and `generate_stream` are then thread-safe.
The coordinator never touches a tensor: it forwards handoff messages, collects commits, and finalizes a
request once every model that held it has freed its KV.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from typing import Any

from tokenrouter.config import EngineConfig, load_config
from tokenrouter.engine.autotune import (
    SolveFailures,
    measured,
    solve_in_subprocess,
    solve_interval,
    solve_thresholds,
)
from tokenrouter.engine.coordinator import Coordinator, Prompt
from tokenrouter.engine.outputs import RequestOutput
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.timeline import Timeline, event_time
from tokenrouter.runner.arch import shared_vocab_size
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.tokenizer import load_tokenizer
from tokenrouter.transport.local import SteppedTransport, ThreadedTransport
from tokenrouter.transport.messages import Append, Event

log = logging.getLogger(__name__)


class Engine(Coordinator):
    def __init__(self, config: EngineConfig) -> None:
        remote = [n for n, m in config.models.items() if m.url is not None]
        if remote:
            raise ValueError(f"models {remote} are served by peer servers (url): only the Triton deployment "
                             "reaches those; the in-process Engine loads every model itself")
        tokenizer = load_tokenizer(config.tokenizer_path)
        vocab_size = shared_vocab_size(config)  # before any weights load: a mismatch fails at once
        self._threads: list[threading.Thread] = []
        self._stop_event = threading.Event()
        self._outputs: list[RequestOutput] = []
        self._closed = False
        self.subservers: dict[str, Subserver] = {}
        # Stepped (the caller's thread) until start() switches to the threaded transport.
        self.transport: SteppedTransport | ThreadedTransport = SteppedTransport(self.subservers, self._on_event)
        for name in config.models:
            sub = Subserver.from_config(config, name, self._emit, tokenizer)
            sub.arrivals_possible = self._arrivals_possible_for(name)
            self.subservers[name] = sub
        entry = self.subservers[config.entry]
        # In process every model's KV pool is known: a request stops (finish reason "length") where the
        # smallest of them ends, wherever it is decoding, rather than failing on a handoff to that model.
        max_len = min(s.runner.max_model_len for s in self.subservers.values())
        for sub in self.subservers.values():
            sub.stop.max_model_len = max_len
        super().__init__(config, tokenizer, vocab_size, max_len, entry.policy)
        self.pool_tokens = {name: s.block_manager.num_tokens for name, s in self.subservers.items()}
        self._update_thresholds()

    @classmethod
    def from_config(cls, source: str | os.PathLike | dict[str, Any] | EngineConfig) -> Engine:
        return cls(load_config(source))

    # -- the entry model's parts (single-model use and tests) ---------------------------------------

    @property
    def entry(self) -> Subserver:
        return self.subservers[self.config.entry]

    @property
    def runner(self):
        return self.entry.runner

    @property
    def scheduler(self):
        return self.entry.scheduler

    @property
    def block_manager(self):
        return self.entry.block_manager

    @property
    def running_in_background(self) -> bool:
        return bool(self._threads)

    # -- input ----------------------------------------------------------------------------------------

    def append_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Append known tokens to a live request; its next step *extends* the KV by them (no recompute)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            raise KeyError(f"no live request {request_id!r}")
        if not token_ids:
            raise ValueError("append_tokens needs at least one token")
        self._check_token_ids(list(token_ids), "appended")
        if len(req.prompt_ids) + len(req.output_ids) + len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r} would exceed the context limit {self.max_model_len}")
        req.output_ids.extend(token_ids)
        self._deliver(req.owner, Append(request_id, list(token_ids)))

    # -- events (the coordinator) ---------------------------------------------------------------------

    def _emit(self, ev: Event) -> None:
        """Every subserver's event callback: on to the coordinator through the current transport."""
        self.transport.emit(ev)

    def _collect(self, out: RequestOutput) -> None:
        if not self.running_in_background:
            self._outputs.append(out)

    def _after_abort(self) -> None:
        self._pump()

    def _pump(self) -> None:
        """Stepped mode: handle the events waiting for the coordinator (none in background mode)."""
        if isinstance(self.transport, SteppedTransport):
            self.transport.pump()

    # -- delayed batching ------------------------------------------------------------------------------

    def _arrivals_possible_for(self, model: str) -> Callable[[], bool]:
        def possible() -> bool:
            # Something can still come to `model` only if a live request is currently elsewhere.
            return any(r.owner != model for r in list(self.requests.values()) if not r.finished)

        return possible

    @property
    def auto_thresholds(self) -> bool:
        return self.config.batching.thresholds == "auto"

    def retune(self, concurrency: int | None = None) -> dict[str, int] | None:
        """`thresholds: auto`: solve B* for the mean concurrency since the last solve (LoadMeter; or the given one)
        from measured step latencies and routing rates, and apply it. Returns the thresholds, or None before enough
        was measured. With the model loops running in this process, the solve runs in a child process: it is seconds
        of pure Python that would otherwise hold the GIL against the decoding threads."""
        stats = {m: s.stats for m, s in self.subservers.items()}
        if not measured(stats):
            return None
        n = concurrency if concurrency is not None else self.load.take()
        solve = solve_in_subprocess if self.running_in_background else solve_thresholds
        tuned = solve(self.model_names, stats, n, max_wait=self.config.batching.max_wait_ms / 1000.0,
                      one_device=self.config.one_device, current=self._incumbent())
        best = tuned.thresholds if tuned is not None else None
        if best is not None:
            self.apply_tuned(best)
        return best

    def _tune_forever(self) -> None:
        failures = SolveFailures(log)
        while not self._stop_event.wait(solve_interval(self.config.batching.auto_interval_s, self.num_solves,
                                                       failing=failures.last is not None)):
            if self.requests:
                try:
                    solved = self.retune() is not None
                except Exception as e:  # tuning is an optimization: never let it take serving down
                    failures.failed(e)
                    continue
                if solved:
                    failures.solved()

    # -- stepped mode ---------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Stepped mode: one forward pass on each subserver whose batching condition holds (if none
        holds yet, the one with the most ready requests runs, as when its bounded wait expires)."""
        self._check_open()
        if self.running_in_background:
            raise RuntimeError("the engine runs in the background: use generate / generate_stream")
        self._pump()
        ran = False
        for sub in self.subservers.values():
            if sub.should_step():
                ran = sub.safe_step() > 0 or ran
                self._pump()
        if not ran:
            ready = [s for s in self.subservers.values() if s.scheduler.num_ready > 0]
            if ready:
                max(ready, key=lambda s: s.scheduler.num_ready).safe_step()
                self._pump()
        outputs, self._outputs = self._outputs, []
        return outputs

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; all inputs are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got {prompts!r}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                params.validate()
                self.tokenize(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        results: dict[str, RequestOutput] = {}
        done = threading.Event()

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                results[out.request_id] = out
                if len(results) == len(prompts):
                    done.set()

        ids = [self.add_request(p, sp, listener=on_output) for p, sp in zip(prompts, sampling_params)]
        own, others = set(ids), []
        try:
            if self.running_in_background:
                done.wait()
            else:
                while len(results) < len(ids):
                    # Outputs of requests added by `add_request` stay for the caller's next `step()`.
                    others.extend(o for o in self.step() if o.request_id not in own)
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            self._outputs[:0] = others
        return [results[rid] for rid in ids]

    # -- background mode ------------------------------------------------------------------------------

    def start(self) -> None:
        """Switch to background mode: one decoding-loop thread per subserver plus the coordinator."""
        self._check_open()
        if self._threads:
            return
        self._pump()
        if self.config.independent_loops:
            for sub in self.subservers.values():
                t = threading.Thread(
                    target=sub.serve_forever, args=(self._stop_event,), name=f"tr-{sub.name}", daemon=True
                )
                self._threads.append(t)
        else:
            self._threads.append(threading.Thread(target=self._lockstep, name="tr-models", daemon=True))
        self.transport = ThreadedTransport(self.subservers, self._on_event)
        self._threads.append(
            threading.Thread(target=self.transport.run, args=(self._stop_event,), name="tr-coordinator", daemon=True)
        )
        if self.auto_thresholds:
            self._threads.append(threading.Thread(target=self._tune_forever, name="tr-tuner", daemon=True))
        for t in self._threads:
            t.start()

    def _lockstep(self) -> None:
        """`independent_loops: false`: one thread steps the models in turn (each when its batching condition
        holds), so a model's step waits for the others' (the design's independent loops, switched off)."""
        subs = list(self.subservers.values())
        while not self._stop_event.is_set():
            ran = False
            for sub in subs:
                sub.drain()
                if sub.should_step():
                    ran = sub.safe_step() > 0 or ran
            if not ran:
                self._stop_event.wait(min(s.max_wait_s for s in subs) if any(s.scheduler.num_ready for s in subs)
                                      else 0.0005)

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield an output (with `delta_text` / `delta_token_ids`) as tokens commit; the last is final.
        Cancelling the consumer aborts the request on every model."""
        self.start()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self.add_request(prompt, params, request_id, lambda o: loop.call_soon_threadsafe(q.put_nowait, o))
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                req = self.requests.get(rid)
                if req is not None:
                    req.listener = None  # nobody is reading any more
                self.abort(rid)

    # -- lifecycle ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def check_integrity(self) -> None:
        """KV accounting invariants on every model; when idle, every block must be free."""
        for sub in self.subservers.values():
            sub.check_integrity()

    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording every model's steps and handoffs (engine/timeline.py); read them with
        `timeline_events` (perf/timeline.py makes a trace and a summary of them)."""
        for name, sub in self.subservers.items():
            sub.timeline = Timeline(name) if on else None

    def timeline_events(self) -> list[dict[str, Any]]:
        """The events recorded since the last call, every model's, in time order."""
        return sorted((e for s in self.subservers.values() if s.timeline for e in s.timeline.take()), key=event_time)

    def shutdown(self) -> None:
        if self._closed:
            return
        for rid in list(self.requests):
            self.abort(rid)
        self._stop_event.set()
        for t in self._threads:
            t.join(timeout=5)
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
