"""What a subserver measures about itself for threshold tuning: step latency by batch size, and where
its requests go after a step (routing rates, and how many tokens such a step commits)."""

from __future__ import annotations

import threading
from collections import defaultdict


class StepStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency_sum: dict[int, float] = defaultdict(float)  # batch size -> seconds
        self.latency_count: dict[int, int] = defaultdict(int)
        self.rows = 0  # requests that sampled a token here
        self.moves: dict[str, int] = defaultdict(int)  # target model -> requests sent there
        self.committed_on_move: dict[str, int] = defaultdict(int)  # ... of which committed their token

    def record_step(self, batch_size: int, seconds: float) -> None:
        with self._lock:
            self.latency_sum[batch_size] += seconds
            self.latency_count[batch_size] += 1

    def record_route(self, target: str | None, committed: bool) -> None:
        """One sampled row: `target` None means it stayed here."""
        with self._lock:
            self.rows += 1
            if target is not None:
                self.moves[target] += 1
                self.committed_on_move[target] += int(committed)

    def latency_table(self, max_batch: int) -> list[float] | None:
        """Mean step time for batch sizes 1..max_batch; unmeasured sizes from a least-squares line through
        the measured means (step time grows about linearly with batch size in the decode regime)."""
        with self._lock:
            points = {b: self.latency_sum[b] / c for b, c in self.latency_count.items() if c}
        if not points:
            return None
        xs, ys = list(points), list(points.values())
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        line = [max(1e-6, my + slope * (b - mx)) for b in range(1, max_batch + 1)]
        return [points.get(b, line[b - 1]) for b in range(1, max_batch + 1)]

    def route_row(self, models: list[str], me: str) -> tuple[list[float], list[float]] | None:
        """(probabilities of the next model, tokens committed for each choice), or None before any data."""
        with self._lock:
            if self.rows == 0:
                return None
            probs = [self.moves.get(m, 0) / self.rows for m in models]
            tokens = [
                (self.committed_on_move[m] / self.moves[m]) if self.moves.get(m) else 1.0 for m in models
            ]
        i = models.index(me)
        probs[i] = max(0.0, 1.0 - sum(p for j, p in enumerate(probs) if j != i))
        tokens[i] = 1.0
        return probs, tokens
