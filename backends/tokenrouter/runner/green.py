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
    """(green context, a stream of it) for `num_sms` SMs of `device`. Keep the context alive while the stream is
    in use. RuntimeError, naming the setting, where this torch, driver or GPU cannot make one."""
    from torch.cuda import green_contexts

    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not green_contexts.SUPPORTED:
        raise RuntimeError(f"num_sms: {num_sms}: this torch ({torch.__version__}) was built without CUDA green "
                           "contexts; set num_sms: 0 (all SMs)")
    if num_sms > total:
        raise RuntimeError(f"num_sms: {num_sms}: GPU {index} has only {total} SMs")
    try:
        ctx = green_contexts.GreenContext.create(num_sms=num_sms, device_id=index)
        if hasattr(ctx, "Stream"):
            return ctx, ctx.Stream()
        # Older torch: a stream made while the green context is current belongs to it.
        ctx.set_context()
        try:
            return ctx, torch.cuda.Stream(index)
        finally:
            ctx.pop_context()
    except Exception as exc:  # the driver's refusal (granularity, MPS, an old driver) says why
        raise RuntimeError(f"num_sms: {num_sms}: no green context on GPU {index}: {exc}") from exc
