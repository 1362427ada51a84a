"""One model's subserver: its runner, KV blocks, scheduler, local router and decoding loop.

The loop never waits on another model: admit -> (delayed batching) -> schedule -> forward -> sample ->
route locally -> commit, or park and hand off. Everything that crosses to another model leaves as an
event through `emit`; everything that arrives comes through `handle` (directly, or via the inbox from
another thread). Nothing here assumes the other models live in this process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch

from tokenrouter.config import EngineConfig, ModelConfig
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import SeqStatus, Sequence
from tokenrouter.engine.shadow import ShadowDecoder
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.engine.stop import StopChecker
from tokenrouter.engine.timeline import Timeline
from tokenrouter.engine.warmup import NonFiniteLogits, warm_up
from tokenrouter.routing.policy import Policy, RouteRequest, StepResult, make_policy, resolve, step_hook
from tokenrouter.runner.arch import ArchConfig, declared_context_limit
from tokenrouter.runner.forward_batch import ScheduledChunk
from tokenrouter.runner.model_runner import ForwardOutput, ModelRunner
from tokenrouter.runner.sampler import sample
from tokenrouter.transport.messages import (
    Append,
    Arrive,
    Commit,
    Event,
    Failed,
    Handoff,
    Release,
    Released,
    Unavailable,
)

log = logging.getLogger(__name__)

NON_FINITE_ERROR = ("model {model!r} produced non-finite logits (NaN or inf) for this request, so no token could be "
                    "chosen; the model or the GPU is faulty (the server log names the request)")


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Copy device tensors to the host with one synchronization for all of them."""
    return HostCopies(*tensors).wait()


class HostCopies:
    """Device tensors on their way to the host, queued on the current stream; `wait` returns them once they are
    there, without waiting for what the stream was given after them (a step launched ahead)."""

    __slots__ = ("out", "event")

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self.out = [t if t is None or t.device.type == "cpu" else t.to("cpu", non_blocking=True) for t in tensors]
        cuda = [t.device for t in tensors if t is not None and t.device.type == "cuda"]
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(cuda[0]))

    def wait(self) -> list[torch.Tensor | None]:
        if self.event is not None:
            self.event.synchronize()
        return self.out


class _Unknown:
    """The token ids of a row stepped ahead as the runner reads them: `length` tokens, the last of which is still on
    the device (read here as 0; the runner feeds the device's copy)."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> list[int]:
        return [0] * len(range(*s.indices(self.length)))


class AheadRow:
    """A request in a step launched ahead (`Subserver.step_ahead`): position `num_computed_tokens` runs the token
    the step before sampled for it, before that step's results reach the host. The runner counts its tokens here;
    the request is credited only if that token was committed here (`fed`) and nothing else changed."""

    __slots__ = ("seq", "token_ids", "num_computed_tokens", "block_table", "num_forwarded_tokens", "fed")

    def __init__(self, seq: Sequence, computed: int) -> None:
        self.seq = seq
        self.token_ids = _Unknown(computed + 1)
        self.num_computed_tokens = computed
        self.block_table = seq.block_table
        self.num_forwarded_tokens = 0
        self.fed = -1  # the token it runs, once the step before has it on the host

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens + 1


class Ahead:
    """A step launched ahead: its rows, which of the step before's rows each continues (`src`), its output buffers,
    and when it could start on the device (the step before's results on the host)."""

    __slots__ = ("rows", "src", "out", "start", "t0")

    def __init__(self, rows: list[AheadRow], src: list[int], out: ForwardOutput) -> None:
        self.rows, self.src, self.out = rows, src, out
        self.start = self.t0 = 0.0


class Subserver:
    def __init__(
        self,
        cfg: ModelConfig,
        policy: Policy,
        stop: StopChecker,
        emit: Callable[[Event], None],
        default_kv_tokens: int,
        threshold: int = 1,
        max_wait_s: float = 0.005,
    ) -> None:
        self.name = cfg.name
        self.runner = ModelRunner(cfg, default_kv_tokens=default_kv_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.policy = policy
        policy.tokenizer = stop.tokenizer
        a = self.runner.arch
        policy.setup(self.runner.device, self.runner.dtype, a.hidden_size, a.vocab_size)
        embed = self.runner.model.model.embed_tokens
        self._hook = step_hook(policy, embed) if len(policy.models) > 1 else None
        # route_in_step: false keeps the policy's work out of the forward step (and its CUDA graph).
        self._route_in_step = cfg.route_in_step
        self.runner.setup_step(self._hook if cfg.route_in_step else None)
        self.stop = stop
        self.emit = emit
        # defer_events(): events wait here until the loop has launched its next step or is about to idle.
        self._deferred: deque[Event] | None = None
        self._handed_off = False  # this step emitted a handoff (sent at the step's end, not deferred)
        self._send = emit
        # A handoff's way out that skips the thread behind `emit` (served: the loop writes to the router's socket
        # itself); given the step's events in order, it returns whether it sent them. None: `emit` alone.
        self.send_now: Callable[[list[Event]], bool] | None = None
        self.seqs: dict[str, Sequence] = {}
        # Delayed batching: step when >= threshold requests are ready, or the oldest waited max_wait_s,
        # or `arrivals_possible()` says nothing else can come (set by whoever knows the whole system).
        self.threshold = threshold
        self.max_wait_s = max_wait_s
        self.arrivals_possible: Callable[[], bool] = lambda: True
        self._ready_since: float | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Requests released before they arrived here (bounded memory of ids).
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._wake = threading.Event()
        self.stats = StepStats()
        # Seconds each scheduled request waited since it became ready (read by the metrics thread).
        self._queue_waits: deque[float] = deque(maxlen=65536)
        self.num_steps = 0
        self.last_batch_size = 0
        # What the loop does and when (engine/timeline.py); None: not recording.
        self.timeline: Timeline | None = None
        self._in_step: list[str] = []  # request ids of the step in flight, for failing just those
        self._shadows_in_step: list[Sequence] = []  # and the requests of its shadow rows (away from here)
        self.warmup_s: float | None = None  # how long the warm-up before serving took (None: none ran)
        self.graph_admission = ""  # what the warm-up measured for graph-aware admission and decided (engine/warmup.py)
        # Step ahead (ModelConfig.step_ahead): the next decode step is launched before this one's tokens reach the
        # host, so that the host's work between steps (routing, commits, the next step's inputs) overlaps the GPU.
        self.step_ahead = cfg.step_ahead and cfg.route_in_step and policy.HOST_ROUTE
        self._ahead: Ahead | None = None
        self.num_ahead_steps = 0  # steps launched ahead
        # Rows of those whose request had gone elsewhere, finished or changed: computed for nothing.
        self.num_void_rows = 0
        # Shadow decoding (engine/shadow.py): the next token of a request handed back under a lease, decoded anyway.
        self.shadow = ShadowDecoder(cfg.shadow_decode and len(policy.models) > 1 and policy.PURE_LEASED_ROUTE,
                                    self.runner.max_model_len)
        # The last step found requests ready but none it could schedule (they wait for KV blocks): the loop waits.
        self.stalled = False
        # Requests the last scheduling left waiting before their first token (KV blocks short), and the free blocks
        # then: their first token steps the model at once again only once blocks were freed (`_first_token_due`).
        self._first_tokens_left: tuple[frozenset[str], int] = (frozenset(), 0)
        # When the decoding loop last went round (`serve_forever`; None before it runs): an idle loop still goes
        # round every max_wait_s or 50 ms, so a beat much older than any step means the loop is stuck
        # (serving/watchdog.py).
        self.loop_beat: float | None = None
        # Models that are down (model_down: route_around; the router says so): nothing is routed to them.
        self.unavailable: frozenset[str] = frozenset()

    @classmethod
    def from_config(
        cls, config: EngineConfig, name: str, emit: Callable[[Event], None], tokenizer: Any
    ) -> Subserver:
        """Model `name` of the deployment `config`, with its policy and its stop rule (the entry model's EOS, the
        deployment's declared context limit lowered to what this model's KV pool holds): the one way the
        in-process engine and a served subserver build a subserver."""
        pol_name, pol = config.policy_spec()
        entry_eos = set(ArchConfig.from_dir(config.entry_model.path).eos_token_ids)
        sub = cls(
            config.models[name],
            make_policy(pol_name, list(config.models), name, pol),
            StopChecker(tokenizer, entry_eos, declared_context_limit(config)),
            emit,
            default_kv_tokens=config.cpu_kv_cache_tokens,
            threshold=config.batching.threshold_of(name),
            max_wait_s=config.batching.max_wait_ms / 1000.0,
        )
        sub.stop.max_model_len = min(sub.stop.max_model_len, sub.runner.max_model_len)
        if config.models[name].warmup and sub.runner.device.type == "cuda":
            sub.warm_up_or_refuse()  # before anything is served: no request pays for a kernel compile
        return sub

    def warm_up_or_refuse(self) -> None:
        """Warm up (engine/warmup.py); RuntimeError when the model must not serve: it computed NaN, or the GPU
        failed. Any other failure only costs the warm-up: serving goes on without it."""
        try:
            self.warmup_s = warm_up(self)
        except NonFiniteLogits as e:
            raise RuntimeError(f"model {self.name!r} failed its warm-up: {e}") from e
        except Exception as e:
            if "CUDA error" in str(e):  # the device context is lost: serving on would fail every request
                raise RuntimeError(
                    f"model {self.name!r}: the GPU failed during the warm-up, before serving: {e}"
                ) from e
            log.exception("%s: warm-up failed; serving without it (first requests may compile kernels)", self.name)

    # -- events out ---------------------------------------------------------------------------------------

    def defer_events(self) -> None:
        """From now on, what the loop emits waits until it has launched its next step (then leaves while that
        step runs on the GPU) or is about to idle, in the order it was emitted. For a deployment whose events
        leave through another thread of this process (served: the response thread pickles, sends and counts
        each batch): that thread's Python work then overlaps the GPU's step instead of contending for the GIL
        with the next step's preparation. A step that hands a request off sends its events at its end instead: a
        handoff is on its request's critical path, and waiting for the next launch held it 0.3-0.6 ms longer
        (perf/results/green_h200_2026-12-03). Only for loops run by `serve_forever`, which flushes before it
        waits; a caller stepping by hand (the in-process engine's `step`) keeps direct emission."""
        if self._deferred is None:
            self._deferred = deque()
            self.emit = self._deferred.append

    def flush_events(self) -> None:
        """Emit every deferred event, in order (loop thread only; one taken off at a time, so an event appended
        meanwhile or a send that raises loses nothing). After a handoff, `send_now` gets them all first."""
        handed_off, self._handed_off = self._handed_off, False
        buf = self._deferred
        if handed_off and buf and self.send_now is not None and self.send_now(list(buf)):
            buf.clear()
            return
        while buf:
            self._send(buf.popleft())

    # -- messages in ------------------------------------------------------------------------------------

    def submit(self, msg: Arrive | Append | Release) -> None:
        """Thread-safe: queue a message for the loop thread."""
        self.note_arrival(msg)
        self.inbox.put(msg)
        self._wake.set()

    def drain(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.handle(msg)
            except Exception as e:  # a malformed or out-of-order message fails its request, not the loop
                log.exception("%s: could not handle %s", self.name, type(msg).__name__)
                if isinstance(getattr(msg, "request_id", None), str):
                    self._fail_request(msg.request_id, f"model {self.name!r} rejected the request: {e}")

    def note_arrival(self, msg: Arrive | Append | Release) -> None:
        """A message reached this model (thread-safe): a handoff's way here from its source model is measured now.
        What follows, the wait until the loop takes it on, the tuner models as queueing."""
        if isinstance(msg, Arrive) and msg.source is not None and msg.sent_at is not None:
            sent, source = msg.sent_at, msg.source
            # (off a socket: a malformed stamp is not measured, and must not stop the message)
            if isinstance(sent, int | float) and not isinstance(sent, bool) and isinstance(source, str) and source:
                self.stats.record_transit(source, time.monotonic() - sent)

    def handle(self, msg: Arrive | Append | Release | Unavailable) -> None:
        if isinstance(msg, Arrive):
            self._arrive(msg)
        elif isinstance(msg, Unavailable):
            self._set_unavailable(msg.models)
        elif isinstance(msg, Append):
            seq = self.seqs.get(msg.request_id)
            if seq is not None:
                seq.token_ids.extend(msg.tokens)
        elif isinstance(msg, Release):
            if msg.error is not None:
                self.emit(Failed(msg.request_id, self.name, msg.error))
            self._release(msg.request_id)

    def _arrive(self, msg: Arrive) -> None:
        if msg.threshold is not None:
            self.threshold = msg.threshold
        if msg.max_len is not None:
            self.stop.max_model_len = min(self.stop.max_model_len, msg.max_len)
        if msg.request_id in self._tombstones:
            # Released before it arrived (a cancel overtook the handoff): never take it on.
            self.emit(Released(msg.request_id, self.name, 0, 0, held=False))
            return
        if msg.first_visit and len(msg.tokens) >= self.runner.max_model_len:
            self.emit(Failed(msg.request_id, self.name, self._too_long(len(msg.tokens))))
            self.emit(Released(msg.request_id, self.name, 0, 0, held=False))
            return
        seq = self.seqs.get(msg.request_id)
        shadow = None  # the token a shadow row made for it while it was away, where that is its next token
        if msg.first_visit:
            if seq is not None:
                raise RuntimeError(f"{self.name}: request {msg.request_id} arrived twice as new")
            gen = None
            if msg.params.seed is not None:
                # Seeded per model, so a request's draws do not depend on where else it has been.
                gen = torch.Generator(device=self.runner.device).manual_seed(msg.params.seed)
            seq = Sequence(msg.request_id, list(msg.tokens), msg.num_prompt_tokens, msg.params, generator=gen)
            if msg.arrival is not None:
                seq.arrival = msg.arrival
            self.seqs[msg.request_id] = seq
        else:
            if seq is None or seq.status is not SeqStatus.PARKED:
                raise RuntimeError(f"{self.name}: request {msg.request_id} returned but is not parked here")
            if len(seq.token_ids) + len(msg.tokens) >= self.runner.max_model_len:
                # Grown elsewhere past what this model holds (a model that did not know its limit yet): fails
                # clearly rather than wait for blocks it can never have.
                raise ValueError(self._too_long(len(seq.token_ids) + len(msg.tokens)))
            shadow = self.shadow.returned(seq, msg.tokens)
            seq.token_ids.extend(msg.tokens)
        seq.state, seq.seen = msg.state, msg.seen
        seq.lease = None
        if msg.source is not None:
            lease = self.policy.receive(self._route_view(seq), msg.source)
            if lease is not None:
                lease.begin(msg.source, len(seq.token_ids))
            seq.lease = lease
        if shadow is not None and (seq.lease is None or not seq.lease.decides):
            shadow = None  # its token's route would matter: the step runs again
        if not msg.first_visit and not msg.tokens and shadow is None and seq.num_pending_tokens == 0 \
                and seq.num_computed_tokens > 0:
            # Taken back with nothing new, with no token of its shadow row to take (model_down: route_around; its
            # target went down before it produced a token; or its shadow row's token cannot be used): its last
            # token is computed again, for the logits of the next one. (Its KV slot is rewritten with the same
            # values.)
            seq.num_computed_tokens -= 1
        seq.ready_since = time.monotonic()
        timeline = self.timeline  # read once: it may be switched off from another thread
        if timeline is not None:
            timeline.arrive(msg.request_id, msg.source, seq.ready_since)
        if msg.first_visit:
            if msg.source is None:
                self.scheduler.kv_budget = msg.kv_budget
            self.scheduler.add(seq, new_request=msg.source is None)
        else:
            self.scheduler.resume(seq)
            if shadow is not None:  # the token its next step would make, made already: committed as that step would
                self.shadow.num_hits += 1
                self._postprocess(seq, self._route_view(seq), shadow, self.name)

    def _set_unavailable(self, models: list[str]) -> None:
        """These models are down: route nothing to them, and forget what they had seen of each request here (their
        KV died with their process), so that a visit after their return is a first one, with every token."""
        newly = set(models) - self.unavailable
        self.unavailable = frozenset(models)
        if newly:
            for seq in self.seqs.values():
                seq.seen = {m: n for m, n in seq.seen.items() if m not in newly}

    def _too_long(self, n: int) -> str:
        return (
            f"request has {n} tokens, but model {self.name!r} can hold at most {self.runner.max_model_len - 1} "
            "(its context limit or KV pool)"
        )

    def _forget(self, request_id: str) -> Sequence | None:
        """Drop a request here for good. Its id is remembered: over a transport that does not keep one order
        across messages (each message its own call), a handoff sent just before a cancel can arrive after the
        cancel's release."""
        self._tombstones[request_id] = None
        while len(self._tombstones) > 65536:
            self._tombstones.popitem(last=False)
        return self.seqs.pop(request_id, None)

    def _release(self, request_id: str) -> None:
        seq = self._forget(request_id)
        if seq is None:
            # Always answer: a transport may be waiting for this release to complete.
            self.emit(Released(request_id, self.name, 0, 0, held=False))
            return
        self.scheduler.finish(seq)
        self.emit(Released(request_id, self.name, seq.num_forwarded_tokens, seq.num_cached_tokens))

    # -- the loop ---------------------------------------------------------------------------------------

    def should_step(self, now: float | None = None) -> bool:
        if self._ahead is not None:
            return True  # launched already: its results are due
        ready = self.scheduler.num_ready
        if ready == 0:
            self._ready_since = None
            return self.shadow.due(self.scheduler.parked.values())  # idle but for requests in a run (shadow.py)
        now = time.monotonic() if now is None else now
        if self._ready_since is None:
            self._ready_since = now
        if ready >= self.threshold or not self.arrivals_possible() or self._first_token_due():
            return True
        return now - self._ready_since >= self.max_wait_s

    def _first_token_due(self) -> bool:
        """Whether a ready request has made no token yet. Its first token waits for no fuller batch: delayed
        batching trades each request's latency for throughput, and the time to the first token is the latency a
        user sees first. (A new request whose first token was routed to the 32B waited out the 32B's hold for
        more requests, up to max_wait_ms. The requests ready beside it ride along. At the 32B such steps are rare,
        one request in ten under random p = 0.1, and the tuner does not model them; at an entry model every new
        request makes one. Served at C=16 on an H100, TTFT p99 fell from 158 to 103 ms:
        perf/results/first_token_2026-12-06.) Not for a request the last scheduling left waiting for KV blocks,
        until blocks were freed since: stepping the others at once would not bring its token sooner, and would
        step them below their hold on every round meanwhile."""
        sched = self.scheduler
        left, free = self._first_tokens_left
        if left and self.block_manager.num_free_blocks > free:
            left = frozenset()
        return (any(s.num_output_tokens == 0 and s.request_id not in left for s in sched.waiting)
                or any(s.num_output_tokens == 0 and s.num_pending_tokens > 0 for s in sched.running))

    def _note_first_tokens_left(self) -> None:
        """After scheduling: the requests before their first token that it left waiting for KV blocks
        (`_first_token_due`); none where it stopped for anything else (the next step takes them in as it is)."""
        waiting = self.scheduler.waiting if self.scheduler.waiting_for_kv else ()
        left = frozenset(s.request_id for s in waiting if s.num_output_tokens == 0)
        self._first_tokens_left = (left, self.block_manager.num_free_blocks)

    def step(self) -> int:
        """One forward pass over what is scheduled: schedule -> forward -> sample -> route -> commit.
        Returns the number of sequences it ran.

        Step ahead: where every row of this step decodes on here next as far as the host can tell (all greedy,
        none under a lease that decides, nothing else waiting), the next step is launched right after this one,
        fed this step's tokens on the device, before they reach the host; its results are taken at the next call.
        A row whose token was not committed here after all (routed away, finished, cancelled) is void there: its
        result is dropped, and the KV it wrote lies past its request's computed tokens, in no cached block,
        overwritten when that position runs again. The rows kept go on ahead (their tokens gathered on the device)."""
        timeline = self.timeline  # read once: it may be switched on or off from another thread
        scheduled = time.monotonic() if timeline is not None else 0.0
        ahead, self._ahead = self._ahead, None
        kept: list[int] | None = None  # of a step launched ahead with void rows: its rows still valid
        shadows: list[ScheduledChunk] = []  # rows of requests away from here (engine/shadow.py), after `chunks`
        if ahead is not None:
            keep = [i for i, r in enumerate(ahead.rows) if self._still_ahead(r)]
            self.num_void_rows += len(ahead.rows) - len(keep)
            if not keep:
                return 0  # nothing in it is wanted; the stream orders whatever comes next after it
            if len(keep) < len(ahead.rows):
                kept = keep
            chunks = [ScheduledChunk(ahead.rows[i].seq, 1) for i in keep]
            for c, i in zip(chunks, keep):
                c.seq.num_forwarded_tokens += ahead.rows[i].num_forwarded_tokens
            out, t0, start = ahead.out, ahead.t0, ahead.start
            scheduled = submitted = launched = start
        else:
            chunks = self.scheduler.schedule()
            self._note_first_tokens_left()
            graphs = self.runner.graphs  # (shadow rows keep a step in its CUDA graph: `holds`)
            shadows = self.shadow.rows(self.scheduler, self.block_manager, chunks,
                                       graphs.holds if graphs is not None else None)
            self._shadows_in_step = [c.seq for c in shadows]
            if not chunks and not shadows:
                self.flush_events()  # ready requests that cannot be scheduled yet: no launch to wait for
                self.stalled = True
                return 0
            t0, start = time.perf_counter(), time.monotonic()
        first_ready, last_ready, wait_max = self._begin_step(chunks, start, queued=ahead is None)
        sampling = [c.seq for c in chunks if c.samples]
        with self.runner.stream_context():
            if ahead is None:
                out = self.runner.forward(chunks + shadows)
                launched = time.monotonic() if timeline is not None else 0.0
                submitted = self.runner.submitted_at
            self.flush_events()  # the last step's events leave while this one runs (defer_events)
            tokens_dev, results = self._sample_async(out, sampling + [c.seq for c in shadows])
            # Held from its launch: should this step fail, the next takes it and finds every row void (`safe_step`
            # fails this step's requests; a row not yet fed matches no token).
            nxt = self._ahead = None if shadows else self._launch_ahead(chunks, tokens_dev, kept)
            tokens, values, finite = results()
        arrived, arrived_at = time.perf_counter(), time.monotonic()  # (the latter on the clock all processes share)
        if nxt is not None:
            nxt.t0, nxt.start = arrived, time.monotonic()  # this step is done: the next one runs
        if kept is not None:  # (every row of a step launched ahead samples)
            tokens, finite = tokens[kept], finite[kept]
            values = None if values is None else values[kept]
        forward_end = time.monotonic() if timeline is not None else 0.0
        for c in chunks + shadows:
            c.seq.num_computed_tokens += c.num_new_tokens
            self.block_manager.register_full_blocks(c.seq)
        if shadows:  # their tokens wait on their requests; the rows before them are the step's own
            n = len(sampling)
            self.shadow.keep([c.seq for c in shadows], tokens[n:].tolist(), finite[n:].tolist())
            for c in shadows:
                if c.seq.shadow is None:  # non-finite logits: nothing of that step may be matched as a prefix
                    self.block_manager.uncache(c.seq)
            tokens_dev, tokens, finite = tokens_dev[:n], tokens[:n], finite[:n]
            values = None if values is None else values[:n]
            out = ForwardOutput(*(None if t is None else t[:n]
                                  for t in (out.logits, out.hidden, out.greedy, out.step_values, out.finite)))
        if sampling:
            self._route_and_commit(sampling, out, tokens_dev, tokens, values, finite)
            if self._handed_off:  # (defer_events) a handoff leaves now, with what was emitted before it
                self.flush_events()
        if nxt is not None:
            toks = tokens.tolist()
            for r, i in zip(nxt.rows, nxt.src):
                r.fed = toks[i]
            if not any(self._still_ahead(r) for r in nxt.rows):  # every row went elsewhere or finished
                self._ahead = None  # nothing to take from it
                self.num_void_rows += len(nxt.rows)
        self.num_steps += 1
        self.last_batch_size = len(chunks) + len(shadows)
        # A step's time as the tuner models it, from its start to the next step's: a step launched ahead started
        # when the one before it ended, and its own routing and commits overlap the step after it. Its batch is
        # what the GPU ran, void rows included.
        void = len(ahead.rows) - len(chunks) if ahead is not None else 0
        # (a step not launched ahead ends here: its end at the same moment as its time)
        self.stats.record_step(len(chunks) + void + len(shadows),
                               (arrived if ahead is not None else time.perf_counter()) - t0,
                               arrived_at if ahead is not None else time.monotonic())
        if timeline is not None:
            timeline.step(
                start, forward_end, time.monotonic(), len(chunks), sum(c.num_new_tokens for c in chunks),
                sum(c.num_new_tokens > 1 for c in chunks), self.threshold, first_ready, last_ready, wait_max,
                schedule_start=scheduled, submitted=submitted, launched=launched, void=void, shadow=len(shadows),
            )
        return len(chunks)

    def _launch_ahead(self, chunks: list[ScheduledChunk], tokens_dev: torch.Tensor,
                      rows_of: list[int] | None = None) -> Ahead | None:
        """Launch the next step now, one token for each of this step's rows, fed their sampled tokens on the device
        (`tokens_dev`, or its rows `rows_of` where this step's output has more rows than it keeps); None where a row
        may not decode on here next as far as the host can tell, or KV blocks are short."""
        sched = self.scheduler
        if not self.step_ahead or sched.waiting or len(sched.running) != len(chunks):
            return None  # something else wants the next step: schedule it after this one, as usual
        if len(chunks) < self.threshold and self.arrivals_possible():
            return None  # delayed batching: the next step waits for more requests (should_step)
        limit = self.runner.max_model_len
        for c in chunks:
            seq = c.seq
            if (not c.samples or (seq.lease is not None and seq.lease.decides) or not seq.params.greedy
                    or seq.status is not SeqStatus.RUNNING or seq.num_computed_tokens + c.num_new_tokens >= limit - 1):
                # (a lease that decides hands the request back after its tokens here, most often this one; a
                # sampled row, void, would have moved its generator)
                return None
        # A request whose token now is its last (max_new_tokens, or the context limit) has no next step: without it
        # (Std. Serving asks for one token at a time: it would compute every row twice).
        go = [i for i, c in enumerate(chunks) if not self._last_token(c.seq)]
        if not go:
            return None
        for i in go:
            c = chunks[i]
            if not self.block_manager.ensure(c.seq, c.seq.num_computed_tokens + c.num_new_tokens + 1):
                return None  # (blocks taken so far stay with their requests: they need them next anyway)
        if rows_of is not None or len(go) < len(chunks):  # this step's rows that go on, gathered on the device
            index = [rows_of[i] for i in go] if rows_of is not None else go
            tokens_dev = tokens_dev.index_select(0, torch.tensor(index).to(tokens_dev.device, non_blocking=True))
        rows = [AheadRow(chunks[i].seq, chunks[i].seq.num_computed_tokens + chunks[i].num_new_tokens) for i in go]
        out = self.runner.forward([ScheduledChunk(r, 1) for r in rows], fed=tokens_dev)
        self.num_ahead_steps += 1
        return Ahead(rows, go, out)

    def _last_token(self, seq: Sequence) -> bool:
        """Whether the token this step samples for `seq` ends it whatever it is (StopChecker's length rule)."""
        return (seq.num_output_tokens + 1 >= seq.params.max_new_tokens
                or seq.num_tokens + 1 >= self.stop.max_model_len)

    def _still_ahead(self, row: AheadRow) -> bool:
        """Whether the row of a step launched ahead still runs what its request needs: the request is running here
        and its last token, the one after its computed ones, is the token the row was fed (no handoff, finish,
        release or append in between)."""
        seq = row.seq
        return (seq.status is SeqStatus.RUNNING and self.seqs.get(seq.request_id) is seq
                and seq.num_computed_tokens == row.num_computed_tokens and seq.num_tokens == row.num_tokens
                and seq.token_ids[-1] == row.fed)

    def _begin_step(self, chunks: list[ScheduledChunk], now: float, queued: bool = True
                    ) -> tuple[float | None, float | None, float]:
        """Note the step's requests (to fail just those if it breaks) and how long each waited since it became
        ready; returns when the first and the last of them became ready, and the longest wait. Not `queued` (a
        step launched ahead, before its rows' tokens were committed): they waited for nothing."""
        self._in_step = [c.seq.request_id for c in chunks]
        self._ready_since = None
        first_ready = last_ready = None
        for c in chunks:
            ready = c.seq.ready_since
            if not queued:
                c.seq.ready_since = None
            elif ready is not None:
                self._queue_waits.append(now - ready)
                first_ready = ready if first_ready is None else min(first_ready, ready)
                last_ready = ready if last_ready is None else max(last_ready, ready)
                c.seq.ready_since = None
        return first_ready, last_ready, 0.0 if first_ready is None else now - first_ready

    def _sample(self, out: ForwardOutput, sampling: list[Sequence]) -> tuple[torch.Tensor, Any, Any, Any]:
        """`_sample_async`, waited for: the sampled tokens on the device, then on the host the tokens, the
        policy's values and whether each row's logits were finite (None each when no row samples)."""
        tokens_dev, results = self._sample_async(out, sampling)
        return tokens_dev, *results()

    def _sample_async(self, out: ForwardOutput, sampling: list[Sequence]) -> tuple[torch.Tensor, Callable[[], Any]]:
        """The sampled tokens on the device, and a function that returns the tokens, the policy's values and
        whether each row's logits were finite on the host (None each when no row samples). Their copies are queued
        now, so a step launched after this call does not delay them. The forward pass chose greedy tokens and
        computed the values on them; rows that sample otherwise are drawn here and their values recomputed.

        A row whose logits are not all finite (a broken weight, a faulty kernel or library) must neither commit
        argmax(NaN) as if it were a token nor reach the sampler, whose device-side assert would end the process
        and every request in it: it samples from zeros here and its request fails alone (`_route_and_commit`)."""
        tokens_dev, values_dev = out.greedy, out.step_values
        if not sampling:
            return tokens_dev, lambda: (None, None, None)
        finite_dev = out.finite
        logits = out.logits
        if not all(s.params.greedy for s in sampling):
            logits = torch.where(finite_dev[:, None], logits, 0.0)
            tokens_dev = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
            values_dev = self._step_values(logits, out.hidden, tokens_dev)
        if self._route_in_step:
            # The step's one host synchronization: its tokens, the policy's values and the finiteness together.
            return tokens_dev, HostCopies(tokens_dev, values_dev, finite_dev).wait

        def separately() -> tuple[Any, Any, Any]:
            # The step ends with its tokens on the host; the policy's work follows, synchronized on its own.
            tokens, finite = to_host(tokens_dev, finite_dev)
            (values,) = to_host(self._step_values(logits, out.hidden, tokens_dev))
            return tokens, values, finite

        return tokens_dev, separately

    def _route_and_commit(self, sampling: list[Sequence], out: ForwardOutput, tokens_dev: torch.Tensor,
                          tokens: torch.Tensor, values: torch.Tensor | None, finite: torch.Tensor) -> None:
        """The policy decides for every sampling row at once; then each row commits, stays or hands off, or
        fails when its logits were not finite."""
        views = [self._route_view(s) for s in sampling]
        embed = self.runner.model.model.embed_tokens
        result = StepResult(out.logits, out.hidden, tokens_dev, embed, step_values=values)
        with self.runner.stream_context():  # device work a policy does in route() stays on this model's stream
            targets = self._route(views, result)
        for seq, view, tok, target, ok in zip(sampling, views, tokens.tolist(), targets, finite.tolist()):
            if ok:
                self._postprocess(seq, view, tok, target)
            else:
                log.error("%s: non-finite logits for request %s", self.name, seq.request_id)
                self.block_manager.uncache(seq)
                self._fail_request(seq.request_id, NON_FINITE_ERROR.format(model=self.name))
        done = time.monotonic()  # one clock read per step: when these requests became ready again
        for seq in sampling:
            seq.ready_since = done

    def _step_values(self, logits: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        if self._hook is None or not len(tokens):
            return None
        return self._hook(logits, hidden, tokens)

    def safe_step(self) -> int:
        """`step`, but an error (a policy routing to an unknown model, an internal failure) fails the
        requests of that step with a clear message instead of taking the loop down; requests that were not
        in it (waiting, or parked while another model has them) carry on."""
        self._in_step, self._shadows_in_step = [], []
        try:
            return self.step()
        except Exception as e:
            log.exception("%s: step failed", self.name)
            for seq in self._shadows_in_step:  # away from here: not failed, but taken into no step again until back
                seq.shadow_ok = False
            self.flush_events()  # what the step committed before it failed goes first
            msg = str(e) if isinstance(e, ValueError) else f"internal error on model {self.name}: {e!r}"
            for rid in self._in_step:
                if rid in self.seqs:
                    self._fail_request(rid, msg)
            return 0

    def _route(self, views: list[RouteRequest], result: StepResult) -> list[str]:
        # Requests under a fixed lease are decided by it; `route` still sees the whole batch (one call,
        # tensors stay batched) and its answers for those rows are ignored.
        if len(self.policy.models) == 1:
            return [self.name] * len(views)
        return resolve(self.policy, self.policy.route(views, result))

    def _route_view(self, seq: Sequence) -> RouteRequest:
        return RouteRequest(seq.request_id, self.name, seq.token_ids, seq.num_prompt_tokens, seq.state, seq.lease)

    def _postprocess(self, seq: Sequence, view: RouteRequest, tok: int, target: str) -> None:
        lease = seq.lease
        if lease is not None and lease.decides:
            # incremental stop check: no decode of the whole lease's text
            done = lease.advance(lambda: self.stop.lease_done(seq, tok))
            target = lease.return_to if done else self.name
            commit = True
        else:
            if target in self.unavailable:  # down (model_down: route_around): the token is this model's
                target = self.name
            commit = target == self.name or self.policy.send(view, target, tok)
        if target in self.unavailable:  # a lease that would return to a model that is down: to the entry model
            entry = self.policy.models[0]
            target = entry if entry not in self.unavailable else self.name
        self.stats.record_route(None if target == self.name else target, commit)
        if commit:
            seq.token_ids.append(tok)
            reason, stop_trim = self.stop.check(seq, tok)
            self.emit(Commit(seq.request_id, self.name, [tok], reason, stop_trim))
            if reason is not None:
                self._finish(seq)
                return
        if target != self.name:
            # Sent back by a lease after its token here: its next token here would decode that one (shadow.py).
            seq.shadow_ok = lease is not None and lease.decides
            self._handoff(seq, target)

    def _handoff(self, seq: Sequence, target: str) -> None:
        seen = dict(seq.seen)
        first = seen.get(target, 0) == 0
        suffix = list(seq.token_ids) if first else seq.token_ids[seen[target] :]
        seen[self.name] = seen[target] = len(seq.token_ids)
        seq.seen, seq.lease = seen, None
        self.scheduler.park(seq)
        now = time.monotonic()
        arrive = Arrive(
            seq.request_id, suffix, first, seq.num_prompt_tokens, seq.params, seq.state, self.name, seen,
            sent_at=now, arrival=seq.arrival,
        )
        timeline = self.timeline  # read once: it may be switched off from another thread
        if timeline is not None:
            timeline.handoff(seq.request_id, target, now)
        self.emit(Handoff(self.name, target, arrive))
        self._handed_off = True

    def _finish(self, seq: Sequence) -> None:
        self._forget(seq.request_id)
        self.scheduler.finish(seq)
        self.emit(Released(seq.request_id, self.name, seq.num_forwarded_tokens, seq.num_cached_tokens))

    def _fail_request(self, request_id: str, error: str) -> None:
        seq = self._forget(request_id)
        forwarded = cached = 0
        if seq is not None:
            self.scheduler.finish(seq)
            forwarded, cached = seq.num_forwarded_tokens, seq.num_cached_tokens
        self.emit(Failed(request_id, self.name, error))
        self.emit(Released(request_id, self.name, forwarded, cached, held=seq is not None))

    # -- background thread ------------------------------------------------------------------------------

    def serve_forever(self, stop_event: threading.Event) -> None:
        """The independent decoding loop (one thread per subserver)."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # a step's stream context then switches no device
        try:
            while not stop_event.is_set():
                self.loop_beat = time.monotonic()
                self.drain()
                if self._handed_off:  # a return that committed its shadow row's token went straight back
                    self.flush_events()
                if self.should_step():
                    self.stalled = False
                    self.safe_step()
                    if not self.stalled:
                        continue
                    # Ready requests that nothing here can schedule (they wait for KV blocks, which only a
                    # message frees: a release, a return): wait for one rather than go round at once, a core and
                    # this process's GIL spent on nothing.
                    timeout = 0.05
                else:
                    self.flush_events()  # no step launched to overlap with: out now (defer_events)
                    timeout = self.max_wait_s if self.scheduler.num_ready else 0.05
                self._wake.wait(timeout)
                self._wake.clear()
        finally:
            self.flush_events()

    # -- introspection ----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        live = [s for s in self.seqs.values() if s.block_table]
        self.block_manager.check_integrity(live)
        if not self.seqs and self.block_manager.num_free_blocks != self.block_manager.num_blocks:
            held = self.block_manager.num_blocks - self.block_manager.num_free_blocks
            raise AssertionError(f"idle subserver {self.name} holds {held} KV blocks")

    def drain_queue_waits(self) -> list[float]:
        out = []
        while self._queue_waits:
            out.append(self._queue_waits.popleft())
        return out
