"""The shared shape of the learned token routers (R2R, CITER, Co-LLM): a small network on the small
model's step outputs yields one logit per request, and sigmoid(logit) compared with `threshold` sends
one token to the large model (which writes it and hands back)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from tokenrouter.routing.policies._common import (
    build_router,
    check_models,
    checkpoint_arg,
    home_or_default_receive,
    number_arg,
    sigmoid_rule,
)
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult


class LearnedRouterPolicy(Policy):
    """Subclasses give the network (`build_net`), its inputs (`net_inputs`) and the comparison (`RULE`)."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    ARGS: ClassVar[dict[str, Any]] = {"threshold": 0.5, "checkpoint": None}
    RULE: ClassVar[str] = ">="  # escalate when sigmoid(z) RULE threshold

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.threshold: float = number_arg(self, "threshold", lo=0.0, hi=1.0)
        # Checked here, not first in `setup`: the config check constructs the policy before any model loads.
        self.checkpoint: str | None = checkpoint_arg(self)
        self.net: nn.Module | None = None

    @abstractmethod
    def build_net(self, hidden_size: int, vocab_size: int) -> nn.Module:
        """The router network (random init is seeded by `build_router`; a checkpoint replaces it)."""

    def net_inputs(self, result: StepResult) -> tuple[torch.Tensor, ...]:
        return (result.hidden.float(),)

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        # Only the small model routes. float32 whatever the model's dtype: the router is small, and a bf16
        # router would shift decisions near the threshold between deployments.
        if self.model == self.models[0]:
            build = lambda: self.build_net(hidden_size, vocab_size)  # noqa: E731
            self.net = build_router(self, build, device, self.checkpoint)

    def logits(self, result: StepResult) -> torch.Tensor:
        """[S] router logits for the step: one batched call on the model's device."""
        if self.net is None:
            raise RuntimeError(f"policy {self.name!r}: setup() must run on the small model before route()")
        with torch.inference_mode():
            return self.net(*self.net_inputs(result))

    def step_tensors(self, result: StepResult) -> torch.Tensor | None:
        return self.logits(result) if self.model == self.models[0] else None

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        small, large = self.models
        if self.model != small or not batch:
            return [self.model] * len(batch)
        # The network ran on the device with the step; the rule is applied to its host copy.
        flags = sigmoid_rule(self.host_step_values(result), self.RULE, self.threshold).tolist()
        return [large if f else small for f in flags]

    def receive(self, req: RouteRequest, source: str) -> Lease | None:
        return home_or_default_receive(self, req, source)
