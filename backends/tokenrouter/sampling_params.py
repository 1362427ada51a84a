"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature a request samples greedily: dividing logits by a smaller one overflows to inf
# (and the softmax to NaN), which would fail the whole batch's step (vLLM draws the same line).
GREEDY_BELOW = 1e-5
SEED_RANGE = (0, 2**63 - 1)  # what torch.Generator.manual_seed takes


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below GREEDY_BELOW) means greedy. top_k 0 (or -1) and top_p 1.0 disable those
    filters. A seed makes the request's samples reproducible regardless of what it is batched with.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Copies of lists; anything else is left for validate() to name.
        if isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it accepts."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
