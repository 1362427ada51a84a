"""Prometheus metrics through `pb_utils.MetricFamily` (Triton serves them on :8002), updated off the
decode loop: the subserver's counters are read by a metrics thread; events are counted as they leave."""

from __future__ import annotations

import threading
from typing import Any

from tokenrouter.transport.messages import Commit, Event, Handoff


class _Families:
    """MetricFamily objects must outlive their metrics (Triton refuses updates otherwise): keep them."""

    def __init__(self, pb_utils: Any) -> None:
        self.mf = pb_utils.MetricFamily
        self.alive: list[Any] = []

    def __call__(self, name: str, description: str, kind: Any) -> Any:
        family = self.mf(name, description, kind)
        self.alive.append(family)
        return family


_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class SubserverMetrics:
    def __init__(self, pb_utils: Any, model: str, sub: Any) -> None:
        mf = self._families = _Families(pb_utils)
        labels = {"model": model}
        self.sub = sub
        self.tokens = mf("tokenrouter_tokens_total", "Tokens committed by this model", mf.mf.COUNTER).Metric(labels)
        self._handoffs_family = mf("tokenrouter_handoffs_total", "Requests handed to another model", mf.mf.COUNTER)
        self._handoffs: dict[str, Any] = {}
        self.model = model
        self.steps = mf("tokenrouter_steps_total", "Forward passes", mf.mf.COUNTER).Metric(labels)
        self.preemptions = mf("tokenrouter_preemptions_total", "Running requests preempted for KV blocks (recomputed "
                              "later)", mf.mf.COUNTER).Metric(labels)
        self.reclaims = mf("tokenrouter_kv_reclaims_total", "Parked requests (in flight on another model) whose KV "
                           "blocks were taken back (prefilled again on return)", mf.mf.COUNTER).Metric(labels)
        self.graph_waits = mf("tokenrouter_graph_waits_total", "Times admission held new prompts back a step to keep "
                              "steps in CUDA graphs (graph-aware admission)", mf.mf.COUNTER).Metric(labels)
        self.ahead_steps = mf("tokenrouter_ahead_steps_total", "Forward passes launched ahead, before the step "
                              "before's tokens reached the host (step_ahead)", mf.mf.COUNTER).Metric(labels)
        self.void_rows = mf("tokenrouter_ahead_void_rows_total", "Rows of steps launched ahead whose request had "
                            "gone elsewhere or finished: computed for nothing", mf.mf.COUNTER).Metric(labels)
        self.shadow_rows = mf("tokenrouter_shadow_rows_total", "Rows decoding the next token of a request away "
                              "from this model, in case it is sent straight back (shadow_decode)",
                              mf.mf.COUNTER).Metric(labels)
        self.shadow_hits = mf("tokenrouter_shadow_hits_total", "Shadow rows whose token committed when their request "
                              "came back: a step it did not wait for", mf.mf.COUNTER).Metric(labels)
        self.batch = mf("tokenrouter_batch_size", "Sequences in the last forward pass", mf.mf.GAUGE).Metric(labels)
        self.wait = mf(
            "tokenrouter_queue_wait_seconds", "Time a ready request waited for its step", mf.mf.HISTOGRAM
        ).Metric(labels, buckets=_LATENCY_BUCKETS)
        self.kv_usage = mf("tokenrouter_kv_cache_usage", "Fraction of KV blocks in use", mf.mf.GAUGE).Metric(labels)
        self.kv_used = mf("tokenrouter_kv_blocks_used", "KV blocks in use", mf.mf.GAUGE).Metric(labels)
        self.kv_total = mf("tokenrouter_kv_blocks_total", "KV blocks in the pool", mf.mf.GAUGE).Metric(labels)
        self.active = mf("tokenrouter_requests_held", "Requests with state on this model", mf.mf.GAUGE).Metric(labels)
        self.threshold = mf("tokenrouter_batching_threshold", "Batching threshold B", mf.mf.GAUGE).Metric(labels)
        self.kv_total.set(sub.block_manager.num_blocks)
        self._counts_lock = threading.Lock()
        self._tokens_counted = 0
        self._handoffs_counted: dict[str, int] = {}

    def observe(self, events: list[Event]) -> None:
        """Called by the response thread for each batch of events that leaves the subserver: counted here, sent to
        tritonserver by `flush_counts` (the metrics thread), one update per counter, not one per event. Each update
        is a round trip to tritonserver, which can stall for seconds (while it loads a model: a revived model's
        requests then got their errors only once it was back); the response thread never waits on it."""
        with self._counts_lock:
            for ev in events:
                if isinstance(ev, Commit):
                    self._tokens_counted += len(ev.token_ids)
                elif isinstance(ev, Handoff):
                    self._handoffs_counted[ev.target] = self._handoffs_counted.get(ev.target, 0) + 1

    def flush_counts(self) -> None:
        """Send what `observe` counted since the last flush."""
        with self._counts_lock:
            tokens, handoffs = self._tokens_counted, self._handoffs_counted
            self._tokens_counted, self._handoffs_counted = 0, {}
        if tokens:
            self.tokens.increment(tokens)
        for target, n in handoffs.items():
            metric = self._handoffs.get(target)
            if metric is None:
                metric = self._handoffs_family.Metric({"from": self.model, "to": target})
                self._handoffs[target] = metric
            metric.increment(n)

    def update_forever(self, stop: threading.Event, period: float = 0.25) -> None:
        # Counters raised to the subserver's running totals (`counted`: what each was last raised to).
        totals = [(self.steps, lambda: self.sub.num_steps),
                  (self.preemptions, lambda: self.sub.scheduler.num_preemptions),
                  (self.reclaims, lambda: self.sub.scheduler.num_reclaims),
                  (self.graph_waits, lambda: self.sub.scheduler.num_graph_waits),
                  (self.ahead_steps, lambda: self.sub.num_ahead_steps),
                  (self.void_rows, lambda: self.sub.num_void_rows),
                  (self.shadow_rows, lambda: self.sub.shadow.num_rows),
                  (self.shadow_hits, lambda: self.sub.shadow.num_hits)]
        counted = [0] * len(totals)
        while not stop.wait(period):
            self.flush_counts()
            sub = self.sub
            bm = sub.block_manager
            used = bm.num_blocks - bm.num_free_blocks
            self.kv_used.set(used)
            self.kv_usage.set(used / bm.num_blocks)
            self.active.set(len(sub.seqs))
            self.batch.set(sub.last_batch_size)
            self.threshold.set(sub.threshold)
            for k, (counter, total) in enumerate(totals):
                now = total()
                if now > counted[k]:
                    counter.increment(now - counted[k])
                    counted[k] = now
            for waited in sub.drain_queue_waits():
                self.wait.observe(waited)


class RouterMetrics:
    def __init__(self, pb_utils: Any, model: str) -> None:
        mf = self._families = _Families(pb_utils)
        labels = {"model": model}
        self.ttft = mf(
            "tokenrouter_time_to_first_token_seconds", "Time to first token", mf.mf.HISTOGRAM
        ).Metric(labels, buckets=_LATENCY_BUCKETS)
        self.itl = mf(
            "tokenrouter_inter_token_latency_seconds", "Time between tokens", mf.mf.HISTOGRAM
        ).Metric(labels, buckets=_LATENCY_BUCKETS)
        self._finished_family = mf("tokenrouter_requests_finished_total", "Finished requests", mf.mf.COUNTER)
        self._finished: dict[str, Any] = {}
        self._labels = labels
        self._lock = threading.Lock()
        self._tuned_family = mf(
            "tokenrouter_tuned_threshold", "Batching threshold B chosen by the tuner (thresholds: auto)", mf.mf.GAUGE
        )
        self._tuned: dict[str, Any] = {}
        self.predicted = mf(
            "tokenrouter_predicted_throughput", "Output tokens/s the tuner predicts for its thresholds", mf.mf.GAUGE
        ).Metric(labels)
        self._up_family = mf(
            "tokenrouter_model_up", "1 while the router can reach this model, 0 while it is down or restarting",
            mf.mf.GAUGE,
        )
        self._up: dict[str, Any] = {}
        self._kv_budget = mf(
            "tokenrouter_kv_budget_tokens", "Tokens the requests in the system may hold: the smallest KV pool of the "
            "models other than the entry (new requests wait at the entry model beyond it; 0: none known)",
            mf.mf.GAUGE,
        ).Metric(labels)

    def kv_budget(self, tokens: int | None) -> None:
        self._kv_budget.set(tokens or 0)

    def model_up(self, model: str, up: bool) -> None:
        if model not in self._up:
            self._up[model] = self._up_family.Metric({"model": model})
        self._up[model].set(1 if up else 0)

    def time_to_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def tuned(self, thresholds: dict[str, int], predicted_tok_s: float) -> None:
        for model, b in thresholds.items():
            if model not in self._tuned:
                self._tuned[model] = self._tuned_family.Metric({"model": model})
            self._tuned[model].set(b)
        self.predicted.set(predicted_tok_s)

    def finished(self, reason: str) -> None:
        with self._lock:
            metric = self._finished.get(reason)
            if metric is None:
                metric = self._finished_family.Metric({**self._labels, "finish_reason": reason})
                self._finished[reason] = metric
        metric.increment(1)
