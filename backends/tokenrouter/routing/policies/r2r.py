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

On a GPU whose tuned table has the network's shapes, its linear layers run as skinny-matmul kernels with the
LayerNorms, biases, GELUs and residual adds fused in (skinny_router.py), all but the head: a dot product per row
(N = 1) is no matmul, and a kernel tiled for matmuls ran it 3x slower than torch's LayerNorm and GEMV; the head
runs as one row kernel instead, LayerNorm and dot product (fused_ops.layer_norm_dot). in_proj and mix run as one
folded map (`R2RRouter.fold_input_maps`), and with a bfloat16 small model on a GPU the top k come from a radix
select of three kernels (runner/top_k.py) instead of torch.topk's ~ten: fewer kernels matter most beside the
large model, where each waits for SMs (perf/results/router_kernels_h100_2026-12-06).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenrouter.routing.policies._common import choice_arg, number_arg
from tokenrouter.routing.policies.learned import LearnedRouterPolicy
from tokenrouter.routing.policies.skinny_router import FusedLinear, SkinnyRouter
from tokenrouter.routing.policy import StepResult, register

log = logging.getLogger(__name__)

NUM_BLOCKS = 6


class ResidualBlock(nn.Module):
    """Pre-LayerNorm MLP block: x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class R2RRouter(SkinnyRouter):
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
        # mix(in_proj(x)) as one map once `fold_input_maps` ran; a tuple so that it is no submodule: the
        # state_dict (checkpoints, training) keeps R2R's layers.
        self._folded: tuple[nn.Linear, ...] = ()

    @torch.no_grad()
    def fold_input_maps(self) -> None:
        """Serve time, once the weights are final: in_proj and mix as one linear map, W = W_mix W_in and
        b = W_mix b_in + b_mix (computed in float64), so a step runs one matmul of the in_proj's shape instead
        of two and reads 4 MB less (hidden 1024). The same map up to float32 rounding (~1e-7 relative). A copy:
        weights loaded or moved afterwards need another call."""
        w_in, w_mix = self.in_proj.weight.double(), self.mix.weight.double()
        # skip_init: no draw from the global RNG for weights overwritten at once.
        folded = nn.utils.skip_init(nn.Linear, self.in_proj.in_features, self.mix.out_features, device=w_in.device,
                                    dtype=self.in_proj.weight.dtype)
        folded.weight.copy_(w_mix @ w_in)
        folded.bias.copy_(w_mix @ self.in_proj.bias.double() + self.mix.bias.double())
        self._folded = (folded.eval().requires_grad_(False),)

    def fused_linears(self) -> list[FusedLinear]:
        """The linear layers the kernel runs, in `forward`'s order, each with the ops fused into it."""
        out = [FusedLinear("logits_proj", self.logits_proj)]
        if self._folded:
            out.append(FusedLinear("in_proj+mix", self._folded[0]))
        else:
            out += [FusedLinear("in_proj", self.in_proj), FusedLinear("mix", self.mix)]
        for i, b in enumerate(self.blocks):
            out += [FusedLinear(f"blocks.{i}.fc1", b.fc1, norm=b.norm, activation="gelu"),
                    FusedLinear(f"blocks.{i}.fc2", b.fc2, residual=True)]
        return out

    @staticmethod
    def _concat(hidden: torch.Tensor, projected: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        # One kernel: torch.cat promotes the model-dtype hidden state and embedding to the projection's float32.
        return torch.cat([hidden, projected, token_emb], dim=-1)

    def forward(self, hidden: torch.Tensor, top_logits: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """hidden and token_emb [S, H] in the model's dtype or float32, top_logits [S, k] (any float dtype)."""
        top_logits = top_logits.float()
        if self.skinny(hidden.shape[0]):
            return self._forward_skinny(hidden, top_logits, token_emb)
        x = self._concat(hidden, self.logits_proj(top_logits), token_emb)
        x = self._folded[0](x) if self._folded else self.mix(self.in_proj(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).squeeze(-1)

    def _forward_skinny(self, hidden: torch.Tensor, top_logits: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        ws = self.workspace
        proj, *layers = self.fused_linears()
        n_inputs = 1 if self._folded else 2
        x = self._concat(hidden, proj(top_logits, ws), token_emb)
        for linear in layers[:n_inputs]:
            x = linear(x, ws)
        blocks = layers[n_inputs:]
        for fc1, fc2 in zip(blocks[::2], blocks[1::2]):
            x = fc2(fc1(x, ws), ws, residual=x)
        from tokenrouter.runner.fused_ops import layer_norm_dot

        return layer_norm_dot(x, self.norm, self.head)


@register
class R2RPolicy(LearnedRouterPolicy):
    """R2R: the large model writes one token whenever the router's probability is >= threshold."""

    name = "r2r"
    # router_kernel: "auto" runs the network's linear layers through the skinny kernel where the tuned table has
    # them for this GPU (skinny_router.py), in_proj and mix folded, and the top k through runner/top_k.py where it
    # applies; "torch" always runs R2R's torch modules as trained (cuBLAS on a GPU) and torch.topk.
    ARGS = {**LearnedRouterPolicy.ARGS, "hidden_dim": 1024, "top_k_logits": 100, "router_kernel": "auto"}
    RULE = ">="

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        self.hidden_dim: int = number_arg(self, "hidden_dim", lo=1, integer=True)
        self.top_k_logits: int = number_arg(self, "top_k_logits", lo=1, integer=True)
        self.router_kernel: str = choice_arg(self, "router_kernel", ("auto", "torch"))
        self.logits_dtype = torch.float32  # the small model's dtype once `setup` ran
        self.top_k_workspace = None  # runner/top_k.py's, where `setup` found it applies

    def build_net(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return R2RRouter(hidden_size, min(self.top_k_logits, vocab_size), self.hidden_dim)

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        super().setup(device, dtype, hidden_size, vocab_size)
        if self.net is None:
            return
        # The runner widens the model's logits to float32 (CausalLM.compute_logits), so their top k in the
        # model's dtype are the same values, and a radix select over 16-bit keys takes half the passes.
        self.logits_dtype = dtype
        if self.router_kernel != "auto":
            return  # the layers as trained, on torch
        self.net.fold_input_maps()
        self.top_k_workspace = _top_k_workspace(torch.device(device), dtype, self.net.top_k)
        if self.net.use_skinny_gemm(torch.device(device)):
            log.info("policy r2r: router matmuls through the skinny kernel for up to %d rows", self.net.skinny_max_m)
        elif torch.device(device).type == "cuda":
            log.info("policy r2r: router matmuls on cuBLAS: %s", self.net.skinny_off)

    def net_inputs(self, result: StepResult) -> tuple[torch.Tensor, ...]:
        k = self.net.top_k
        if result.logits.shape[-1] < k:
            raise ValueError(f"policy 'r2r': router expects the top {k} logits, the step has {result.logits.shape[-1]}")
        ws = self.top_k_workspace
        if ws is not None and ws.fits(result.logits.shape[0], k):
            from tokenrouter.runner.top_k import top_k_values

            top = top_k_values(result.logits, k, ws)
        else:
            top = torch.topk(result.logits.to(self.logits_dtype), k, dim=-1, sorted=True).values
        return result.hidden, top, result.token_embeddings


def _top_k_workspace(device: torch.device, dtype: torch.dtype, k: int) -> Any:
    """The radix-select top k's workspace (runner/top_k.py: three kernels instead of torch's ~ten) where it
    applies: a CUDA device, bfloat16 logits (its keys), k within its slots; else None (torch.topk)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    try:
        from tokenrouter.runner.top_k import TOP_K_ROWS, TopKWorkspace
    except ImportError:  # no Triton
        return None
    ws = TopKWorkspace(TOP_K_ROWS, device)
    return ws if ws.fits(1, k) else None
