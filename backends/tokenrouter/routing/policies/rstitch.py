"""`rstitch` (R-Stitch): entropy-triggered hand-over with hysteresis.

Rule, with normalized entropy H/log(V) of each model's own next-token distribution:

- on the small model (models[0]): if it is above `tau_high` the large model takes over; the small model's
  token is dropped (`send` -> False) and the large model receives `Lease(until_route=True, return_to=small)`;
- on the large model (models[1]): it keeps decoding until its normalized entropy falls below `tau_low`, then
  hands back, committing that token (`send` -> True); the small model resumes with `Lease(until_route=True)`.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenrouter.routing.policies._common import check_models, number_arg
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register


@register
class RStitchPolicy(Policy):
    """Small -> large when the small model is uncertain (> tau_high), back when the large one is sure (< tau_low)."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "rstitch"
    ARGS = {"tau_high": 0.1, "tau_low": 0.05}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.tau_high: float = number_arg(self, "tau_high", lo=0.0, hi=1.0)
        self.tau_low: float = number_arg(self, "tau_low", lo=0.0, hi=1.0)
        # No ordering between the two is imposed: each model compares its own entropy, so tau_low > tau_high
        # is legitimate (e.g. models whose entropies sit in different ranges).

    def step_tensors(self, result: StepResult) -> torch.Tensor:
        return result.normalized_entropy

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        if not batch:
            return []
        small, large = self.models
        ent = self.host_step_values(result)
        if self.model == small:
            flags = (ent > self.tau_high).tolist()
            return [large if f else small for f in flags]
        flags = (ent < self.tau_low).tolist()
        return [small if f else large for f in flags]

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        # The small model's uncertain token is replaced; the large model's confident token is kept.
        return self.model == self.models[1]

    def receive(self, req: RouteRequest, source: str) -> Lease:
        if self.model == self.models[1]:
            return Lease(until_route=True, return_to=source)
        return Lease(until_route=True)
