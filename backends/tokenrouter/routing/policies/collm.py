"""`collm` (Co-LLM): a learned deferral head on the small model.

Rule: an extra logit z = Linear(H, 1)(h) on the small model's final hidden state h of the last token; when
sigmoid(z) > `threshold` the small model's token is dropped and the large model (models[1]) produces one
token, then hands back (the base default lease). The large model's `route` answers "stay".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenrouter.routing.policies._common import (
    build_router,
    check_models,
    home_or_default_receive,
    number_arg,
    sigmoid_rule,
)
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register


class DeferralHead(nn.Module):
    """Co-LLM's deferral logit: one Linear(H, 1) on the last hidden state."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S] logits
        return self.proj(hidden).squeeze(-1)


@register
class CoLLMPolicy(Policy):
    """Defer one token to the large model when sigmoid(deferral logit) > threshold."""

    name = "collm"
    ARGS = {"threshold": 0.5, "checkpoint": None}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.threshold: float = number_arg(self, "threshold", lo=0.0, hi=1.0)
        self.net: nn.Module | None = None

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        # Only the small model routes; the large subserver needs no network.
        if self.model == self.models[0]:
            self.net = build_router(self, lambda: DeferralHead(hidden_size), device, self.args["checkpoint"])

    def logits(self, result: StepResult) -> torch.Tensor:
        """[S] deferral logits (float32, on the model's device)."""
        if self.net is None:
            raise RuntimeError("policy 'collm': setup() must run on the small model before route()")
        with torch.inference_mode():
            return self.net(result.hidden.float())

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        small, large = self.models
        if self.model != small or not batch:
            return [self.model] * len(batch)
        # The rule sigmoid(z) > t, as one device op and one host copy for the whole step.
        flags = sigmoid_rule(self.logits(result), ">", self.threshold).tolist()
        return [large if f else small for f in flags]

    def receive(self, req: RouteRequest, source: str) -> Lease:
        return home_or_default_receive(self, req, source)
