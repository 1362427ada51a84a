"""Kernel times of a repeated GPU call (a CUDA-graph replay), per kernel and grouped: matmuls (ours or cuBLAS),
our other Triton kernels, the rest. Shared by profile_step.py (one step, printed) and bench_runner.py --profile
(the breakdown beside each model's step times)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch


def kind(name: str) -> str:
    """The group of a kernel by its name."""
    low = name.lower()
    if "skinny_gemm" in low:
        return "matmul (ours)"
    if any(k in low for k in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "matmul"
    if name.startswith("_") and "kernel" in low:
        return "triton (ours)"
    return "other"


@dataclass
class KernelProfile:
    per_kernel: dict[str, tuple[float, float]]  # name -> (us per call, launches per call)

    @property
    def total_us(self) -> float:
        return sum(t for t, _ in self.per_kernel.values())

    @property
    def kernels(self) -> float:
        return sum(n for _, n in self.per_kernel.values())

    def groups(self) -> dict[str, float]:
        """us per call per group, largest first."""
        out: dict[str, float] = defaultdict(float)
        for name, (t, _) in self.per_kernel.items():
            out[kind(name)] += t
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, n: int) -> list[tuple[str, float, float]]:
        """The n kernels that take longest: (name, us per call, launches per call)."""
        return [(k, t, c) for k, (t, c) in sorted(self.per_kernel.items(), key=lambda kv: -kv[1][0])[:n]]


def profile_calls(fn: Callable[[], None], iters: int = 20, warmup: int = 5) -> KernelProfile:
    """torch.profiler's CUDA kernel times over `iters` calls of `fn`, per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        t = evt.self_cuda_time_total if t is None else t
        if t > 0:
            per_kernel[evt.key] = (t / iters, evt.count / iters)
    return KernelProfile(per_kernel)
