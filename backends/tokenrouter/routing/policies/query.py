"""`query`: query-level routing; the whole response is written by one model chosen once from the prompt.

Rule: at a request's first `route` call (`req.output_len == 0`, i.e. right after the prompt's prefill) the
policy chooses a model and stores it in `state["query_model"]`; every later `route` call, on either model,
returns that choice. If the choice is the other model, the token sampled at the prefill is dropped and the
chosen model receives the request with `Lease(until_route=True)`.

Choosers (`by`):

- "length": prompts with more than `max_prompt_tokens` tokens go to the large model (models[1]).
- "score": an untrained, seeded stand-in for a learned query router: score = sigmoid(w . h) with h the final
  hidden state at the last prompt token of the model that ran the prefill (the only hidden state the engine
  hands over; the causal model has folded the whole prompt into it) and w ~ N(0, 1/H) drawn from
  `torch.Generator().manual_seed(seed)`; score >= `threshold` -> large.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenrouter.routing.policies._common import check_models, choice_arg, number_arg, sigmoid_rule
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register

STATE_KEY = "query_model"


@register
class QueryPolicy(Policy):
    """Choose one model per request from its prompt (length or a seeded linear score), then keep it."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "query"
    ARGS = {"by": "length", "max_prompt_tokens": 512, "threshold": 0.5}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.by: str = choice_arg(self, "by", ("length", "score"))
        self.max_prompt_tokens: int = number_arg(self, "max_prompt_tokens", lo=0, integer=True)
        self.threshold: float = number_arg(self, "threshold", lo=0.0, hi=1.0)
        self.direction: torch.Tensor | None = None

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        if self.by == "score":
            g = torch.Generator().manual_seed(self.seed)
            w = torch.randn(hidden_size, generator=g, dtype=torch.float32) / math.sqrt(hidden_size)
            self.direction = w.to(device)

    def scores_logit(self, result: StepResult) -> torch.Tensor:
        """[S] pre-sigmoid scores w . h for the "score" chooser."""
        if self.direction is None:
            raise RuntimeError("policy 'query' (by: score): setup() must run before route()")
        return result.hidden.float() @ self.direction

    def step_tensors(self, result: StepResult) -> torch.Tensor | None:
        return self.scores_logit(result) if self.by == "score" else None

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        small, large = self.models
        undecided = [i for i, req in enumerate(batch) if STATE_KEY not in req.state]
        if undecided:
            if self.by == "length":
                for i in undecided:
                    req = batch[i]
                    req.state[STATE_KEY] = large if req.num_prompt_tokens > self.max_prompt_tokens else small
            else:
                # One batched projection and one host copy for the whole step.
                to_large = sigmoid_rule(self.host_step_values(result), ">=", self.threshold).tolist()
                for i in undecided:
                    batch[i].state[STATE_KEY] = large if to_large[i] else small
        return [req.state[STATE_KEY] for req in batch]

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        # The chosen model writes the response from its first token.
        return False

    def receive(self, req: RouteRequest, source: str) -> Lease:
        return Lease(until_route=True)
