"""`r2r` (R2R, "Roads to Rome"): a neural token router on the small model.

Rule: for every token the small model (models[0]) samples, the router reads

- h: the small model's final hidden state of the last token, [S, H];
- the top-k raw logits (values sorted in descending order, k = `top_k_logits` clamped to the vocabulary size),
  projected by Linear(k, H);
- e: the input embedding of the sampled token, [S, H] (`StepResult.token_embeddings`),

concatenates [h, proj(top-k), e] -> [S, 3H] -> Linear(3H, d) -> Linear(d, d) -> 6 residual blocks
(x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))) -> LayerNorm -> Linear(d, 1) = z, and routes to the
large model (models[1]) when sigmoid(z) >= `threshold`. The small model's token is then dropped and the large
model produces exactly one token and hands back (the base default lease); the large model's `route` answers
"stay".

On a GPU the network's large matmuls (input projection, mix, the blocks' two layers: ~220 MB of float32 weights
a step at d = 1024) run as skinny Triton matmuls with the bias and residual fused in (runner/skinny_gemm.py,
full float32 precision): cuBLAS serves an 8-row float32 matmul with a non-tensor-core GEMV at a fraction of the
bandwidth. Only the summation order differs from the torch path, as between any two GEMM kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenrouter.routing.policies._common import number_arg
from tokenrouter.routing.policies.learned import LearnedRouterPolicy
from tokenrouter.routing.policy import StepResult, register

if TYPE_CHECKING:
    from tokenrouter.runner.skinny_gemm import SplitKWorkspace

NUM_BLOCKS = 6


def _linear(layer: nn.Linear, x: torch.Tensor, workspace: SplitKWorkspace | None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """layer(x) (+ residual): skinny on the GPU for up to skinny_gemm.MAX_M rows, else torch."""
    if workspace is not None:
        from tokenrouter.runner import skinny_gemm

        if x.shape[0] <= skinny_gemm.MAX_M:
            return skinny_gemm.skinny_linear(x, layer.weight, workspace, bias=layer.bias, residual=residual)
    out = layer(x)
    return out if residual is None else residual + out


class ResidualBlock(nn.Module):
    """Pre-LayerNorm MLP block: x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

        self.workspace: SplitKWorkspace | None = None  # set by R2RRouter.use_skinny_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(_linear(self.fc1, self.norm(x), self.workspace))
        return _linear(self.fc2, h, self.workspace, residual=x)


class R2RRouter(nn.Module):
    """R2R's router network (see the module docstring); `forward` returns [S] logits."""

    def __init__(self, hidden_size: int, top_k: int, d: int, num_blocks: int = NUM_BLOCKS) -> None:
        super().__init__()
        self.top_k = top_k
        self.logits_proj = nn.Linear(top_k, hidden_size)
        self.in_proj = nn.Linear(3 * hidden_size, d)
        # As specified: a second linear map straight after the input projection (no nonlinearity between).
        self.mix = nn.Linear(d, d)
        self.blocks = nn.ModuleList(ResidualBlock(d) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)
        self.workspace: SplitKWorkspace | None = None

    def use_skinny_gemm(self, device: torch.device | None) -> None:
        """Run the large matmuls as skinny Triton matmuls on `device` (one split-K workspace for the network; the
        policy does this on CUDA, the tests under Triton's interpreter); None: torch's matmuls again."""
        self.workspace = None
        if device is not None:
            from tokenrouter.runner import skinny_gemm

            layers = [self.in_proj, self.mix] + [fc for b in self.blocks for fc in (b.fc1, b.fc2)]
            needs = [skinny_gemm.workspace_need(*fc.weight.shape, m, device) for fc in layers
                     for m in skinny_gemm.BLOCK_M_SIZES]
            self.workspace = skinny_gemm.SplitKWorkspace(device, max(p for p, _ in needs), max(t for _, t in needs))
        for block in self.blocks:
            block.workspace = self.workspace

    def forward(self, hidden: torch.Tensor, top_logits: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, self.logits_proj(top_logits), token_emb], dim=-1)
        x = _linear(self.mix, _linear(self.in_proj, x, self.workspace), self.workspace)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).squeeze(-1)


@register
class R2RPolicy(LearnedRouterPolicy):
    """R2R: the large model writes one token whenever the router's probability is >= threshold."""

    name = "r2r"
    ARGS = {**LearnedRouterPolicy.ARGS, "hidden_dim": 1024, "top_k_logits": 100}
    RULE = ">="

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        self.hidden_dim: int = number_arg(self, "hidden_dim", lo=1, integer=True)
        self.top_k_logits: int = number_arg(self, "top_k_logits", lo=1, integer=True)

    def build_net(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return R2RRouter(hidden_size, min(self.top_k_logits, vocab_size), self.hidden_dim)

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        super().setup(device, dtype, hidden_size, vocab_size)
        if self.net is not None and torch.device(device).type == "cuda":
            self.net.use_skinny_gemm(torch.device(device))

    def net_inputs(self, result: StepResult) -> tuple[torch.Tensor, ...]:
        k = self.net.top_k
        if result.logits.shape[-1] < k:
            raise ValueError(f"policy 'r2r': router expects the top {k} logits, the step has {result.logits.shape[-1]}")
        top = torch.topk(result.logits.float(), k, dim=-1, sorted=True).values
        return result.hidden.float(), top, result.token_embeddings.float()
