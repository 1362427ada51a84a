"""`collm` (Co-LLM): a learned deferral head on the small model.

Rule: an extra logit z = Linear(H, 1)(h) on the small model's final hidden state h of the last token; when
sigmoid(z) > `threshold` the small model's token is dropped and the large model (models[1]) produces one
token, then hands back (the base default lease). The large model's `route` answers "stay".
"""

from __future__ import annotations

import torch
from torch import nn

from tokenrouter.routing.policies.learned import LearnedRouterPolicy
from tokenrouter.routing.policy import register


class DeferralHead(nn.Module):
    """Co-LLM's deferral logit: one Linear(H, 1) on the last hidden state."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S] logits
        return self.proj(hidden).squeeze(-1)


@register
class CoLLMPolicy(LearnedRouterPolicy):
    """Defer one token to the large model when sigmoid(deferral logit) > threshold."""

    name = "collm"
    RULE = ">"

    def build_net(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return DeferralHead(hidden_size)
