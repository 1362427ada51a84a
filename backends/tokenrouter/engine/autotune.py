"""`thresholds: auto`: re-solve the delayed-batching thresholds B* from what the subservers measured.

The tuning model (tuning/) takes the concurrency N, per-model step-latency tables and the observed routing rates,
and returns the feasible threshold vector with the highest expected committed tokens per second: from the exact
Markov chain when it is small enough at a useful resolution, else from the discrete-event simulator (a 0.6B model
next to a 32B one makes the chain huge). The number of candidate vectors grows fast with N and the number of models,
so N is capped for the solve (the shape of the optimum changes little past a few requests per model).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenrouter.engine.sharing import shared_gpu
from tokenrouter.engine.step_stats import StepStats
from tokenrouter.tuning.choose import TOTAL_STATE_BUDGET, Method, choose_thresholds, simulated_throughput
from tokenrouter.tuning.markov import DEFAULT_MAX_STATES
from tokenrouter.tuning.system import SystemModel, clamp_thresholds, sanitize_latency

log = logging.getLogger(__name__)

TRANSIT_NEGLIGIBLE = 0.01
"""Transit below this share of the fastest step is left out of the model (in process a handoff takes microseconds:
the exact chain then still answers)."""

# A fresh deployment runs at the configured thresholds until the tuner's first solve. With a report and a solve
# every auto_interval_s that took 4.5 s of traffic (served on an H200, C=8: the 32B at threshold 1 and ~1,140
# tok/s for the first run's first 4.5 s, against ~1,400 once solved), while a solve from 1 s of steps already
# picks the thresholds of the steady state. So the first solves come faster: models report every
# EARLY_INTERVAL_S for their first EARLY_REPORTS reports that hold steps, and the tuner tries every
# EARLY_INTERVAL_S until it has solved EARLY_SOLVES times (a solve takes ~0.35 s in its child process). A try
# starts no solve before every model has measured something (`measured`), and a failing solve is retried at
# auto_interval_s. These early solves, made from the least data, pick freely: only later ones keep the
# thresholds in force unless beaten by SWITCH_GAIN.
EARLY_INTERVAL_S = 0.25
EARLY_REPORTS = 8
EARLY_SOLVES = 3


def solve_interval(auto_interval_s: float, solves: int, failing: bool = False) -> float:
    """Seconds until the next try of a tuner that has solved `solves` times (`failing`: its last try failed)."""
    early = solves < EARLY_SOLVES and not failing
    return min(auto_interval_s, EARLY_INTERVAL_S) if early else auto_interval_s


def report_interval(auto_interval_s: float, reports: int) -> float:
    """Seconds until a model's next statistics report, after `reports` reports that held steps."""
    return min(auto_interval_s, EARLY_INTERVAL_S) if reports < EARLY_REPORTS else auto_interval_s


def measured(stats: Mapping[str, StepStats | Mapping[str, Any]]) -> bool:
    """Whether every model has timed a step and sampled a row (its StepStats, or a snapshot another process
    reported): before that a solve answers None, so a try starts none (each would be a child process). A report
    malformed here counts as measured: the solve's child then names what is wrong with it."""
    for s in stats.values():
        if isinstance(s, StepStats):
            rows, steps = s.rows, s.latency_count
        elif isinstance(s, Mapping):
            rows, steps = s.get("rows", 1), s.get("latency", True)
        else:
            continue
        if not rows or not steps:
            return False
    return True


# Largest concurrency solved, by number of models: C(N - 1 + M, M) candidates (136 for M=2, N=16; 120 for M=3, N=8).
MAX_SOLVED_N = {1: 64, 2: 16, 3: 8}


class LoadMeter:
    """The mean number of requests in the system while there were any, between two solves: the concurrency a
    re-solve tunes for. The count at the moment of a solve is a poor sample of it: between two runs of a closed loop
    of 8 clients one solve saw 2 requests, and the 32B ran at threshold 1 for the next 2.4 s (served, H200,
    perf/results/tuner_h200_2026-12-04). Idle time is left out: the tuner does not solve while idle, and a minute
    idle before a burst of 8 would otherwise read as a concurrency of 1."""

    def __init__(self, now: float | None = None) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._at = time.monotonic() if now is None else now
        self._area = 0.0  # request-seconds since the last take
        self._busy = 0.0  # seconds with at least one request since the last take

    def _advance(self, now: float) -> None:
        if now > self._at and self._n > 0:
            self._area += self._n * (now - self._at)
            self._busy += now - self._at
        self._at = max(now, self._at)

    def update(self, n: int, now: float | None = None) -> None:
        """`n` requests are in the system from `now` (time.monotonic()) on."""
        with self._lock:
            self._advance(time.monotonic() if now is None else now)
            self._n = n

    def take(self, now: float | None = None) -> int:
        """The mean number of requests since the last take, over the time there were any (rounded, at least 1;
        the count now where there was no such time); starts the next interval."""
        with self._lock:
            self._advance(time.monotonic() if now is None else now)
            mean = self._area / self._busy if self._busy > 0.0 else float(self._n)
            self._area = self._busy = 0.0
        return max(1, int(mean + 0.5))


@dataclass(frozen=True)
class TunedThresholds:
    """A solved threshold vector.

    Attributes:
        thresholds: model name -> B_i; feasible for ``concurrency`` (``sum(B_i - 1) < concurrency``).
        predicted_tok_s: long-run committed tokens per second the tuning model expects under ``thresholds`` (simulated
            with the handoffs' measured transit when there is any).
        method: how the candidates were ranked: "markov" (exact chain) or "simulator" (the chain was too large, see
            tuning/choose.py).
        concurrency: the N solved for: the requested concurrency capped by :data:`MAX_SOLVED_N`.
    """

    thresholds: dict[str, int]
    predicted_tok_s: float
    method: Method
    concurrency: int


def solve_thresholds(
    models: list[str],
    stats: Mapping[str, StepStats],
    concurrency: int,
    *,
    state_budget: float = TOTAL_STATE_BUDGET,
    max_states: int = DEFAULT_MAX_STATES,
    max_wait: float | None = None,
    one_device: bool = False,
    current: Mapping[str, int] | None = None,
) -> TunedThresholds | None:
    """Best thresholds for `concurrency` requests, or None while some model has no measurements yet.

    `stats` may come from other processes (:meth:`StepStats.from_snapshot`). `state_budget` and `max_states` bound
    the exact chain (see tuning/choose.py); past them the simulator ranks the candidates, so this always answers.
    `one_device`: the models all run on one device (`EngineConfig.one_device`): how much they slow each other is read
    from their steps and simulated (engine/sharing.py). `max_wait`: the deployment's bounded wait in seconds
    (`batching.max_wait_ms`); the ranking of such a shared device applies it (a threshold that waits longer than it
    for its batch does not get it). Other systems are ranked as before, without it (not measured).
    `current`: the thresholds in force (model -> B), kept unless the best is expected to serve
    :data:`~tokenrouter.tuning.choose.SWITCH_GAIN` more.
    """
    system = system_model(models, stats, concurrency, one_device=one_device)
    if system is None:
        return None
    if not system.shares_gpu:
        max_wait = None
    # The candidates are ranked without the handoffs' transit (it delays every vector's moves alike, and the exact
    # chain cannot model it); the chosen vector's expected tokens/s counts it, simulated (served on an H200:
    # 0.7-1.9 ms a handoff, 4-5 % of the C=1 and C=8 throughput, perf/results/green_h200_2026-12-03).
    incumbent = None
    if current and set(current) == set(models):  # lowered as the coordinator lowers it for fewer requests
        incumbent = clamp_thresholds([current[m] for m in models], system.concurrency)
    choice = choose_thresholds(dataclasses.replace(system, transit=None), state_budget=state_budget,
                               max_states=max_states, max_wait=max_wait, incumbent=incumbent)
    expected = choice.throughput
    if system.has_transit:
        expected = simulated_throughput(system, choice.thresholds, max_wait=max_wait)
    best = dict(zip(models, choice.thresholds))
    n = system.concurrency
    log.info("auto thresholds for N=%d: %s (%.1f tok/s expected, %s; slowdown beside another model: %s)%s", n, best,
             expected, choice.method, system.slowdown, " (kept)" if choice.thresholds == incumbent else "")
    return TunedThresholds(best, expected, choice.method, n)


def system_model(models: list[str], stats: Mapping[str, StepStats], concurrency: int, one_device: bool = False
                 ) -> SystemModel | None:
    """The tuning model's inputs from measurements: each model's routing row and tokens per step, its step
    latency by batch size, the mean transit of a handoff between two models where one was measured, and how much
    models on `one_device` slow each other where their recent steps tell (engine/sharing.py: then a slowed model's
    latency is its time alone), for `concurrency` requests (capped by :data:`MAX_SOLVED_N`); None while some model
    has no measurements yet."""
    n = min(concurrency, MAX_SOLVED_N.get(len(models), 4))
    if n < 1 or not models:
        return None
    rows, tokens, latency = [], [], []
    for m in models:
        s = stats.get(m)
        if s is None:
            return None
        route = s.route_row(models, m)
        table = s.latency_table(n)
        if route is None or table is None:
            return None
        rows.append(route[0])
        tokens.append(route[1])
        # The table comes from measurements and extrapolation; an entry of ~0 would count as a free step to the
        # tuner (and, as the tick's scale, once made the chain explode), so bound it by what batching allows.
        latency.append(sanitize_latency(table))
    # transit[i][j]: measured where it ends (at model j, from model i); a direction never measured counts as none
    # (a link to another machine carries no stamp: its transit is not known, so the expectation is optimistic there)
    transit = [[stats[dst].mean_transit(src) or 0.0 for dst in models] for src in models]
    fastest = min(row[0] for row in latency)
    if all(t < TRANSIT_NEGLIGIBLE * fastest for row in transit for t in row):
        transit = None
    slowdown = None
    shared = shared_gpu(models, stats, n) if one_device else None
    if shared is not None:
        slowdown, alone = shared
        latency = [row if table is None else sanitize_latency(table) for row, table in zip(latency, alone)]
    return SystemModel(concurrency=n, route_probs=rows, step_latency=latency, tokens=tokens, transit=transit,
                       slowdown=slowdown)


class SolveFailures:
    """Logs a failed re-solve once per cause, in one line: the tuner retries every `auto_interval_s`, and a cause
    that persists (a model reporting malformed statistics fails every solve) logged with a traceback each time
    would bury the server's log. The cause is the message's last line (a child's traceback ends with its error)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.last: str | None = None

    def failed(self, e: BaseException) -> None:
        lines = str(e).strip().splitlines()
        cause = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        if cause != self.last:  # (with its traceback the first time: an in-process bug keeps its stack)
            self.logger.error("threshold tuning failed (%s); the thresholds in force stay, and it is retried", cause,
                              exc_info=e)
            self.last = cause

    def solved(self) -> None:
        """A solve answered (not one skipped for want of measurements)."""
        if self.last is not None:
            self.logger.warning("threshold tuning works again")
        self.last = None


def solve_in_subprocess(
    models: list[str], stats: Mapping[str, StepStats | Mapping[str, Any]], concurrency: int, timeout: float = 60.0,
    max_wait: float | None = None, one_device: bool = False, current: Mapping[str, int] | None = None,
) -> TunedThresholds | None:
    """`solve_thresholds` in a child Python process. The solve is seconds of pure-Python work: run inside a
    serving process it would hold that process's GIL and stall the threads that forward handoffs.

    `stats` per model: its StepStats, or a snapshot of them as another process reported it. A snapshot is
    checked in the child only (the served router's loop would spend ~1.5 ms per report on it); one that is
    not valid fails the solve with a RuntimeError that names the model."""
    snapshots = {m: s.snapshot() if isinstance(s, StepStats) else s for m, s in stats.items()}
    payload = {"models": models, "concurrency": concurrency, "max_wait": max_wait, "one_device": one_device,
               "current": dict(current) if current else None, "stats": snapshots}
    python = Path(sys.prefix) / "bin" / "python"
    exe = str(python) if python.exists() else sys.executable
    proc = subprocess.run([exe, "-m", "tokenrouter.engine.autotune"], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"threshold solve failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout)
    if out is None:
        return None
    return TunedThresholds(out["thresholds"], out["predicted_tok_s"], out["method"], out["concurrency"])


def _main() -> None:
    """stdin: {"models", "concurrency", "max_wait", "one_device", "current", "stats": {model: StepStats.snapshot()}};
    stdout: the solve as JSON."""
    payload = json.loads(sys.stdin.read())
    stats = {}
    for model, snapshot in payload["stats"].items():
        try:
            stats[model] = StepStats.from_snapshot(snapshot)
        except ValueError as e:
            sys.exit(f"bad step statistics from {model}: {e}")
    wait = payload.get("max_wait")
    tuned = solve_thresholds(payload["models"], stats, int(payload["concurrency"]),
                             max_wait=None if wait is None else float(wait), one_device=bool(payload.get("one_device")),
                             current=payload.get("current"))
    print(json.dumps(None if tuned is None else dataclasses.asdict(tuned)))


if __name__ == "__main__":
    _main()
