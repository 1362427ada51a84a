"""A router network's linear layers through the skinny matmul kernel (runner/skinny_gemm.py) on a GPU.

A router runs inside the small model's CUDA graph on every step, on a handful of rows, in float32: each linear
layer only streams its weight. On cuBLAS, R2R's network (55 M float32 parameters) took 0.50 ms of a 1.4 ms
Qwen3-0.6B step on an H200 (perf/results/skinny_h200_2026-12-02): cuBLAS picks a CUDA-core GEMV for float32 at a
few rows, and each LayerNorm, bias, GELU and residual add is a kernel of its own. Here each of the network's
`fused_linears` is one kernel with the LayerNorm in front and the bias, activation and residual add behind it.
The policy's argument `router_kernel: torch` keeps the torch modules whatever the table says.

Only where the tuned table (`skinny_gemm_tuned.json`) has every one of the network's float32 shapes on this GPU,
measured no slower than cuBLAS with the separate ops (`perf/bench_gemm.py --routers r2r`), and only up to the rows
it measured; otherwise, and on a CPU, the network runs its plain torch modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FusedLinear:
    """One linear layer of a router as the kernel runs it: LayerNorm `norm` in front (or none), the layer's bias,
    `activation` ("none", "gelu", "relu") and, when `residual`, the caller's residual add behind."""

    name: str
    linear: nn.Linear
    norm: nn.LayerNorm | None = None
    activation: str = "none"
    residual: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as the tuned table is keyed."""
        return self.linear.out_features, self.linear.in_features

    @property
    def prologue(self) -> str:
        return "none" if self.norm is None else "layer_norm"

    def __call__(self, x: torch.Tensor, workspace, residual: torch.Tensor | None = None) -> torch.Tensor:
        from tokenrouter.runner.skinny_gemm import skinny_linear

        norm = self.norm
        return skinny_linear(
            x, self.linear.weight, workspace, prologue=self.prologue,
            norm_weight=None if norm is None else norm.weight, norm_bias=None if norm is None else norm.bias,
            eps=0.0 if norm is None else norm.eps, bias=self.linear.bias, activation=self.activation,
            residual=residual,
        )  # fmt: skip


class SkinnyRouter(nn.Module):
    """A router network whose `fused_linears` can run through the skinny kernel; `forward` asks `skinny(rows)`."""

    def __init__(self) -> None:
        super().__init__()
        self.workspace = None  # skinny_gemm.SplitKWorkspace once `use_skinny_gemm` turned the kernel on
        self.skinny_max_m = 0
        self.skinny_off = ""  # why `use_skinny_gemm` kept cuBLAS, in words for the log

    def fused_linears(self) -> list[FusedLinear]:
        raise NotImplementedError

    def skinny(self, rows: int) -> bool:
        """Whether a batch of `rows` runs through the kernel."""
        return self.workspace is not None and 0 < rows <= self.skinny_max_m

    def use_skinny_gemm(self, device: torch.device, max_rows: int | None = None) -> bool:
        """Turn the kernel on for batches of up to the rows the tuned table allows on `device` (`max_rows` forces
        that many: tests under Triton's interpreter). Returns whether it did."""
        try:
            from tokenrouter.runner import skinny_gemm
        except ImportError:  # no Triton: the torch modules it is
            self.skinny_off = "Triton is not installed"
            return False
        shapes = [f.shape for f in self.fused_linears()]
        if max_rows is None:
            if device.type != "cuda":
                self.skinny_off = "not a CUDA device"
                return False
            max_rows = skinny_gemm.max_rows(shapes, device, torch.float32)
            if max_rows <= 0:
                self.skinny_off = skinny_gemm.cublas_reason(shapes, device, torch.float32)
        if max_rows <= 0:
            return False
        self.skinny_max_m = min(max_rows, skinny_gemm.MAX_M)
        self.workspace = skinny_gemm.workspace_for(shapes, self.skinny_max_m, device, torch.float32)
        return True
