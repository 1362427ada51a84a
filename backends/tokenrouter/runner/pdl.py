"""Programmatic dependent launch (PDL) for the runner's Triton kernels, on Hopper and later GPUs.

A small model's decode step is a chain of ~200 short kernels, each reading what the one before wrote. Launched
plainly, a kernel's programs start only after its predecessor has finished and flushed; every link of the chain
pays for a launch and a ramp-up during which the memory system idles. Launched with PDL, a kernel may start while
its predecessor still runs: its programs do what does not depend on earlier kernels (the skinny matmul pulls its
weight slice toward L2), then wait (`gdc_wait`) until the predecessor has completed and its writes are visible,
and from then on run exactly as before. So the results are the same bit for bit; only the gaps shrink.

The rule every kernel launched this way keeps: `gdc_wait` comes before anything that reads or writes memory
another kernel may touch (activations, the KV pool, split-K scratch and counters), on every path through the
kernel, early returns included. Weights are only read, so they may be touched before it. After its wait a kernel
lets its own successor launch (`gdc_launch_dependents`): at most two kernels of a chain are resident at once, and
each waits for the whole of the one before, so ordering is transitive through kernels launched without PDL too
(torch's and cuBLAS's, which never start early).

Off where it cannot work: CPU tensors (Triton's interpreter has no grid-dependency ops), GPUs before sm_90, a
Triton without the `launch_pdl` option. `TOKENROUTER_PDL=0` turns it off (benchmarks compare both ways).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("TOKENROUTER_PDL", "1") != "0"


@cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@cache
def _device_has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    return (ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and _triton_has_pdl() and _device_has_pdl(device))


def launch_args(device: torch.device) -> dict[str, Any]:
    """The keyword arguments a kernel taking the `PDL` constexpr is launched with on `device`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has completed and its writes are visible, then let the next kernel
    launch. A no-op otherwise. Call it before the kernel's first access to memory other kernels write."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask the memory system to bring the lines at `ptrs` (every address valid: clamp, don't mask) into L2, without
    waiting for them. Compiled GPU code only (inline PTX): call it under `PDL`, which the interpreter never runs."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
