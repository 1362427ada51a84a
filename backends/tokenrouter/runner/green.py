"""A model's own share of a GPU's SMs: a CUDA green context (`ModelConfig.num_sms`).

Two models stepping at once on one GPU interfere through its SMs: the large model's matmuls take every SM, and
each of the small model's ~200 short kernels per step waits for one of their CTAs to retire
(perf/results/sm_share_h200_2026-12-02). A green context is a CUDA context limited to a set of SMs; work
launched on its stream (and a CUDA graph captured there) runs on those SMs only, so the other model always
finds the rest free. Unlike MPS's thread percentage, it partitions SMs inside one process.
"""

from __future__ import annotations

from typing import Any

import torch


def green_stream(device: torch.device, num_sms: int) -> tuple[Any, torch.cuda.Stream]:
    """(green context, its stream) for `num_sms` SMs of `device`. Keep the context alive while the stream (or a
    graph captured on it) is in use. RuntimeError, naming the setting, where this torch, driver or GPU cannot
    make one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if num_sms > total:
        raise RuntimeError(f"num_sms: {num_sms}: GPU {index} has only {total} SMs")
    try:
        from torch.cuda.green_contexts import SUPPORTED, GreenContext
    except ImportError:
        SUPPORTED = False
    # A green context's own stream is the only one sure to be in it (torch's pooled streams belong to whichever
    # context was current when the pool was made), and torch offers it from 2.10 on.
    if not SUPPORTED or not hasattr(GreenContext, "Stream"):
        raise RuntimeError(f"num_sms: {num_sms}: this torch ({torch.__version__}) has no CUDA green context "
                           "streams; set num_sms: 0 (all SMs)")
    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=index)
        return ctx, ctx.Stream()
    except Exception as exc:  # the driver's refusal (granularity, an old driver) says why
        raise RuntimeError(f"num_sms: {num_sms}: no green context on GPU {index}: {exc}") from exc
