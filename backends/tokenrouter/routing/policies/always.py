"""`always`: every request is decoded by one fixed model (the single-model baselines, e.g. all-large).

Rule: `route` -> `model` for every request on every subserver. The token that the entry model sampled
before the first hand-off is dropped (the chosen model writes the whole response); the chosen model
receives the request with `Lease(until_route=True)`, and its own `route` then keeps it there.
"""

from __future__ import annotations

from typing import Any

from tokenrouter.routing.policies._common import check_models
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register


@register
class AlwaysPolicy(Policy):
    """Route everything to `model` (default: the last, i.e. largest, model)."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "always"
    ARGS = {"model": None}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, at_least=1)
        target = self.args["model"]
        self.target: str = self.models[-1] if target is None else target
        if self.target not in self.models:
            raise ValueError(f"policy 'always': argument 'model' must be one of {self.models}, got {target!r}")

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        return [self.target] * len(batch)

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        # The entry model's token is not the target's: drop it so the response is the target's alone.
        return False

    def receive(self, req: RouteRequest, source: str) -> Lease:
        return Lease(until_route=True)
