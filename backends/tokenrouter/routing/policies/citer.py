"""`citer` (CITER): an MLP router on the small model's last hidden state scores whether the small model's
token is good enough.

Rule: score = sigmoid(MLP(h)), MLP = Linear(H, 2H) -> ReLU -> Linear(2H, H) -> ReLU -> Linear(H, 1), on the
small model's final hidden state h of the last token; when score < `threshold` the small model's token
is dropped and the large model (models[1]) produces one token, then hands back (the base default lease).
Note the direction: a high score means "the small model is fine", so threshold 0 routes nothing and
threshold 1 routes every token.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenrouter.routing.policies.learned import LearnedRouterPolicy
from tokenrouter.routing.policy import register


class CiterRouter(nn.Module):
    """CITER's token router: Linear(H, 2H) ReLU Linear(2H, H) ReLU Linear(H, 1)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        h = hidden_size
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h), nn.ReLU(), nn.Linear(h, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S] logits
        return self.mlp(hidden).squeeze(-1)


@register
class CiterPolicy(LearnedRouterPolicy):
    """Route one token to the large model when the router's score is below `threshold`."""

    name = "citer"
    RULE = "<"

    def build_net(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return CiterRouter(hidden_size)
