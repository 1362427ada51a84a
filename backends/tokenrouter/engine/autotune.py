"""`thresholds: auto`: re-solve the delayed-batching thresholds B* from what the subservers measured.

The Markov-chain model (tuning/) takes the concurrency N, per-model step-latency tables and the observed
routing rates, and returns the feasible threshold vector with the highest expected committed tokens per
second. The chain's state space grows fast with N and the number of models, so N is capped for the
solve (the shape of the optimum changes little past a few requests per model).
"""

from __future__ import annotations

import logging

from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning.markov import best_thresholds
from tokenrouter.tuning.system import SystemModel

log = logging.getLogger(__name__)

# Largest concurrency solved exactly, by number of models (see tuning/markov.py for state counts).
MAX_SOLVED_N = {1: 64, 2: 16, 3: 8}


def solve_thresholds(models: list[str], stats: dict[str, StepStats], concurrency: int) -> dict[str, int] | None:
    """Best thresholds for `concurrency` requests, or None while some model has no measurements yet."""
    n = min(concurrency, MAX_SOLVED_N.get(len(models), 4))
    if n < 1:
        return None
    rows, tokens, latency = [], [], []
    for m in models:
        route = stats[m].route_row(models, m)
        table = stats[m].latency_table(n)
        if route is None or table is None:
            return None
        rows.append(route[0])
        tokens.append(route[1])
        latency.append(table)
    system = SystemModel(concurrency=n, route_probs=rows, step_latency=latency, tokens=tokens)
    best, throughput = best_thresholds(system)
    log.info("auto thresholds for N=%d: %s (%.1f tok/s expected)", n, best, throughput)
    return dict(zip(models, best))
