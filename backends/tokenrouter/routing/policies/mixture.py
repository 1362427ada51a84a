"""`mixture` (the evaluation's "ME", a mixture of experts at the token level): after each token the model
that produces the next token is drawn at random with fixed probabilities.

Rule: for N >= 2 models with `weights` w (default uniform; len(w) == N, w >= 0, sum(w) == 1), after every
sampled token on any model draw u = uniform(req, "mixture:<output_len>") and continue on the first model i
with u < w_0 + ... + w_i. The current token is always committed (`send` -> True); the drawn model receives
the request with `Lease(until_route=True)` so that its own `route` makes the next draw.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import accumulate
from typing import Any

from tokenrouter.routing.policies._common import check_models
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register


@register
class MixturePolicy(Policy):
    """Per-token random choice of the next model with probabilities `weights`."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "mixture"
    ARGS = {"weights": None}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, at_least=2)
        n = len(self.models)
        weights = self.args["weights"]
        if weights is None:
            weights = [1.0 / n] * n
        if not isinstance(weights, (list, tuple)) or len(weights) != n:
            raise ValueError(
                f"policy 'mixture': 'weights' must be a list of {n} numbers (one per model {self.models})"
                f", got {weights!r}"
            )
        ok = all(
            not isinstance(w, bool) and isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in weights
        )
        if not ok:
            raise ValueError(f"policy 'mixture': 'weights' must be finite numbers >= 0, got {weights!r}")
        if abs(sum(weights) - 1.0) > 1e-6:
            raise ValueError(f"policy 'mixture': 'weights' must sum to 1, got {weights!r} (sum {sum(weights)!r})")
        self.weights: list[float] = [float(w) for w in weights]
        self.cumulative: list[float] = list(accumulate(self.weights))
        # Where a u above a rounded-down total (1 - eps) lands: the last model that can be picked at all.
        self.last_positive: int = max(i for i, w in enumerate(self.weights) if w > 0)

    def pick(self, u: float) -> str:
        """The model whose cumulative-weight interval holds u (zero-weight models are never picked)."""
        # bisect_right: u lands in [cum[i-1], cum[i]), so a zero-width interval is never hit.
        return self.models[min(bisect_right(self.cumulative, u), self.last_positive)]

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        # Each token position is drawn once: tokens are always committed, so output_len grows every step.
        return [self.pick(self.uniform(req, f"mixture:{req.output_len}")) for req in batch]

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        return True

    def receive(self, req: RouteRequest, source: str) -> Lease:
        return Lease(until_route=True)
