"""Tuning of delayed-batching thresholds for token-level routing.

* :mod:`~tokenrouter.tuning.system` -- :class:`SystemModel`, the queueing abstraction (N requests, M models, Markov
  routing between steps, batch-size dependent step latency) and the feasible threshold vectors.
* :mod:`~tokenrouter.tuning.markov` -- exact long-run throughput from a discrete-time Markov chain, and the best
  feasible thresholds.
* :mod:`~tokenrouter.tuning.simulator` -- a continuous-time discrete-event simulation of the same system (also with a
  bounded wait), used to validate the chain and to explore what the chain does not model.
* :mod:`~tokenrouter.tuning.choose` -- :func:`choose_thresholds`: the best feasible thresholds of a measured system,
  by the chain when it is small enough and by the simulator otherwise, so it always answers.
"""

from tokenrouter.tuning.choose import Choice, choose_thresholds, rank_by_simulation
from tokenrouter.tuning.markov import MarkovResult, best_thresholds, default_tick, expected_throughput, solve
from tokenrouter.tuning.simulator import SimResult, simulate
from tokenrouter.tuning.system import (
    SystemModel,
    feasible_thresholds,
    is_feasible,
    linear_latency,
    sanitize_latency,
)

__all__ = [
    "Choice",
    "MarkovResult",
    "SimResult",
    "SystemModel",
    "best_thresholds",
    "choose_thresholds",
    "default_tick",
    "expected_throughput",
    "feasible_thresholds",
    "is_feasible",
    "linear_latency",
    "rank_by_simulation",
    "sanitize_latency",
    "simulate",
    "solve",
]
