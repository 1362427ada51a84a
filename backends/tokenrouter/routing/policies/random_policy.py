"""`random`: the small model hands each token to the large model with probability `p` (a routing baseline
at a matched large-model rate).

Rule: on models[0], after each sampled token, route to models[1] iff `uniform(req, "random") < p`; the
small model's token is dropped and the large model produces exactly one token, then hands back (the base
default lease). On the large model `route` answers "stay" (the lease governs it).
"""

from __future__ import annotations

from typing import Any

from tokenrouter.routing.policies._common import check_models, home_or_default_receive, number_arg
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register


@register
class RandomPolicy(Policy):
    """Route a token from the small to the large model with probability `p`, reproducibly per request."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "random"
    ARGS = {"p": 0.1}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.p: float = number_arg(self, "p", lo=0.0, hi=1.0)

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        small, large = self.models
        if self.model != small:
            return [self.model] * len(batch)
        # The draw depends only on (seed, prompt, length): the same in any batch or deployment.
        return [large if self.uniform(req, "random") < self.p else small for req in batch]

    def receive(self, req: RouteRequest, source: str) -> Lease:
        return home_or_default_receive(self, req, source)
