"""The subserver's counters are updated once per batch of events that leaves it (each update is a round trip
from the Python stub to tritonserver), with the totals the events add up to."""

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


def test_one_update_per_counter_and_batch() -> None:
    pb = _PbUtils()
    sub = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=64))
    metrics = SubserverMetrics(pb, "small", sub)
    pb.log.clear()
    batch = [Commit("a", "small", [5]), Commit("b", "small", [6, 7]), Handoff("small", "large", _arrive("c")),
             Released("d", "small", 3, 0), Handoff("small", "large", _arrive("e")), Commit("f", "small", [8])]
    metrics.observe(batch)
    assert sorted(pb.log) == sorted([
        ("increment", ("tokenrouter_tokens_total", (("model", "small"),)), 4),
        ("increment", ("tokenrouter_handoffs_total", (("from", "small"), ("to", "large"))), 2),
    ])
    pb.log.clear()
    metrics.observe([Released("g", "small", 1, 0)])
    assert pb.log == []  # nothing to count: no round trip
