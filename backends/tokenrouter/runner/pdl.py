"""Programmatic dependent launch (PDL) for the runner's Triton kernels, on Hopper and later GPUs.

A small model's decode step is a chain of ~200 short kernels, each reading what the one before wrote. Launched
plainly, a kernel starts only after its predecessor has finished and its writes are flushed. Launched with PDL, it
is launched as the predecessor's programs exit, and its programs wait (`gdc_wait`) until the predecessor has
completed and its writes are visible; from then on they run exactly as before. The results are the same bit for
bit; only the launch gap between links shrinks.

The rule every kernel launched this way keeps: `gdc_wait` comes first, before anything that reads or writes memory,
on every path through the kernel (early returns included), so each kernel waits for the whole of the one before and
ordering stays transitive through kernels launched without PDL (torch's and cuBLAS's).

Measured on an H200 (perf/results/pdl_h200_2026-12-02): a link of a captured chain of tiny kernels costs 1.18 us
plain and 0.94 us with PDL; the Qwen3-0.6B decode step (skinny matmuls, b1 / b4) 1.22-1.24 -> 1.19 ms and
1.36-1.39 -> 1.32 ms. Two variants were slower and are not kept: releasing the successor early (right after the
wait, `gdc_launch_dependents`; its programs then sit resident beside the running kernel's: 1.30 ms at b1), and
the skinny matmul prefetching its weights into L2 before its wait (1.34 ms).

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

ENABLED = os.environ.get("TOKENROUTER_PDL", "1").strip().lower() not in ("0", "false", "off", "no")


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


@cache
def _interpreted() -> bool:
    """Triton's interpreter runs the kernels (it reads TRITON_INTERPRET as a boolean: 1, true, on, ...). Asked once:
    triton decides it at import, and `enabled` runs at every launch."""
    knob = getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "interpret", None)
    if knob is not None:
        return bool(knob)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    return (ENABLED and device.type == "cuda" and _triton_has_pdl() and _device_has_pdl(device)
            and not _interpreted())


def launch_args(device: torch.device) -> dict[str, Any]:
    """The keyword arguments a kernel taking the `PDL` constexpr is launched with on `device`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has completed and its writes are visible (a no-op otherwise). Call
    it first in the kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()
