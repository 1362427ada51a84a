"""The subserver's counters are updated once per flush of the metrics thread (each update is a round trip from the
Python stub to tritonserver, never made by the response thread), with the totals the events add up to."""

from __future__ import annotations

from types import SimpleNamespace

from tokenrouter.sampling_params import SamplingParams
from tokenrouter.serving.metrics import SubserverMetrics
from tokenrouter.transport.messages import Arrive, Commit, Handoff, Released


class _Metric:
    def __init__(self, log: list, name: str, labels: dict) -> None:
        self.log, self.key = log, (name, tuple(sorted(labels.items())))

    def increment(self, value: float) -> None:
        self.log.append(("increment", self.key, value))

    def set(self, value: float) -> None:
        self.log.append(("set", self.key, value))

    def observe(self, value: float) -> None:
        self.log.append(("observe", self.key, value))


class _PbUtils:
    """What python_backend's pb_utils offers for metrics, recording every update."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self) -> None:
        self.log: list = []
        pb = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = pb.COUNTER, pb.GAUGE, pb.HISTOGRAM

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.name = name

            def Metric(self, labels: dict, buckets: list | None = None) -> _Metric:  # noqa: N802 (pb_utils' name)
                return _Metric(pb.log, self.name, labels)

        self.MetricFamily = MetricFamily


def _arrive(rid: str) -> Arrive:
    return Arrive(rid, [1, 2], False, 1, SamplingParams())


def test_one_update_per_counter_and_flush() -> None:
    pb = _PbUtils()
    sub = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=64))
    metrics = SubserverMetrics(pb, "small", sub)
    pb.log.clear()
    batch = [Commit("a", "small", [5]), Commit("b", "small", [6, 7]), Handoff("small", "large", _arrive("c")),
             Released("d", "small", 3, 0), Handoff("small", "large", _arrive("e")), Commit("f", "small", [8])]
    metrics.observe(batch)
    assert pb.log == []  # the response thread never waits on tritonserver: the metrics thread sends the counts
    metrics.observe([Commit("h", "small", [9, 10])])
    metrics.flush_counts()
    assert sorted(pb.log) == sorted([
        ("increment", ("tokenrouter_tokens_total", (("model", "small"),)), 6),
        ("increment", ("tokenrouter_handoffs_total", (("from", "small"), ("to", "large"))), 2),
    ])
    pb.log.clear()
    metrics.observe([Released("g", "small", 1, 0)])
    metrics.flush_counts()
    assert pb.log == []  # nothing to count: no round trip


def test_scheduler_counters_become_prometheus_counters() -> None:
    """Preemptions, graph-aware admission's waits, the steps launched ahead (and their void rows) and the shadow rows
    (and those committed) are counted by the scheduler or the subserver and exported as counters: the metrics thread
    adds what each grew by since its last look."""
    import threading
    import time

    pb = _PbUtils()
    sched = SimpleNamespace(num_preemptions=0, num_reclaims=0, num_graph_waits=0)
    sub = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=64, num_free_blocks=64), seqs={},
                          last_batch_size=0, threshold=1, num_steps=0, drain_queue_waits=lambda: [],
                          scheduler=sched, num_ahead_steps=0, num_void_rows=0,
                          shadow=SimpleNamespace(num_rows=0, num_hits=0))
    metrics = SubserverMetrics(pb, "small", sub)
    stop = threading.Event()
    thread = threading.Thread(target=metrics.update_forever, args=(stop, 0.01))
    thread.start()

    def increments(name: str) -> float:
        return sum(v for op, (n, _), v in list(pb.log) if op == "increment" and n == name)

    def wait_for(name: str, total: float) -> None:
        deadline = time.monotonic() + 5
        while increments(name) != total and time.monotonic() < deadline:
            time.sleep(0.01)
        assert increments(name) == total, name

    try:
        sched.num_preemptions, sched.num_reclaims, sched.num_graph_waits = 2, 5, 1
        wait_for("tokenrouter_preemptions_total", 2)
        wait_for("tokenrouter_kv_reclaims_total", 5)
        wait_for("tokenrouter_graph_waits_total", 1)
        sched.num_graph_waits = 4
        wait_for("tokenrouter_graph_waits_total", 4)
        sub.num_ahead_steps, sub.num_void_rows = 7, 3
        wait_for("tokenrouter_ahead_steps_total", 7)
        wait_for("tokenrouter_ahead_void_rows_total", 3)
        sub.shadow.num_rows, sub.shadow.num_hits = 9, 6
        wait_for("tokenrouter_shadow_rows_total", 9)
        wait_for("tokenrouter_shadow_hits_total", 6)
    finally:
        stop.set()
        thread.join()
    assert increments("tokenrouter_preemptions_total") == 2 and increments("tokenrouter_kv_reclaims_total") == 5
