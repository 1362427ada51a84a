"""The k largest values of each row of a wide float32 matrix (R2R's router reads the top-100 of 151,936 logits).

torch.topk on a vocabulary-wide row is a multi-pass radix select: on an H200 the router's top-100 over a Qwen3
step's logits took ~40 us in ~12 kernels (perf/results/router_skinny_h200_2026-12-02). Inside a small model's step
beside a large model every kernel waits for SMs, so the count matters as much as the time. Here it is two kernels:

1. grid (rows, chunks): each program keeps the K_PAD largest of its CHUNK columns (`tl.topk`, a bitonic sort);
2. grid (rows,): each row's chunk candidates, K_PAD per chunk, reduced to its k largest, in descending order.

Every row's k largest are among its chunks' K_PAD largest (K_PAD >= k), so the values are exactly torch.topk's
(`sorted=True`); only values are returned, so ties need no index order. Masked columns read as -inf. A row with NaN
gets an unspecified order (torch puts NaN first); the step that produced it fails its request anyway.

Needs `tl.topk` (Triton >= 3.3); `supported` says whether this Triton has it and k is small enough for one
program's registers, and callers keep torch.topk otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrouter.runner import pdl
from tokenrouter.runner.pdl import wait_for_predecessor

# Columns per first-stage program: 151,936 logits are 19 chunks, so a batch of 8 rows is ~150 programs (about one
# per SM) and the second stage merges 19 x 128 candidates.
CHUNK = 8192
# The largest k (rounded up to a power of two) taken: the second stage sorts a row's chunks x K_PAD candidates in
# one program's registers.
MAX_K = 256


def supported(k: int) -> bool:
    """Whether `top_k_values` takes this k with this Triton (`tl.topk`)."""
    return hasattr(tl, "topk") and 1 <= k and triton.next_power_of_2(k) <= MAX_K


@triton.jit
def _chunk_top_kernel(x_ptr, cand_ptr, n_cols, stride_x, CHUNK: tl.constexpr, K_PAD: tl.constexpr,
                      PDL: tl.constexpr):
    """Program (row, chunk): the K_PAD largest of the chunk's columns, into the row's candidates."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    top = tl.topk(x, K_PAD)
    tl.store(cand_ptr + (row * tl.num_programs(1) + chunk) * K_PAD + tl.arange(0, K_PAD), top)


@triton.jit
def _merge_top_kernel(cand_ptr, out_ptr, n_cand, k, CAND_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program (row,): the k largest of the row's n_cand candidates, largest first."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, CAND_PAD)
    c = tl.load(cand_ptr + row * n_cand + i, mask=i < n_cand, other=float("-inf"))
    top = tl.topk(c, K_PAD)
    j = tl.arange(0, K_PAD)
    tl.store(out_ptr + row * k + j, top, mask=j < k)


def top_k_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] float32: each row's k largest values of x [rows, n] (float32, last dim contiguous), largest first,
    as `torch.topk(x, k, sorted=True).values`. Never synchronises (it can be captured in a CUDA graph)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"top_k_values takes a 2-D float32 tensor with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, n = x.shape
    if not 1 <= k <= n or not supported(k):
        raise ValueError(f"k must be in [1, {min(n, MAX_K)}] (and this Triton have tl.topk), got {k}")
    out = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    k_pad = triton.next_power_of_2(k)
    chunk = max(CHUNK, k_pad)  # a chunk holds at least K_PAD columns (the masked rest reads as -inf)
    chunks = triton.cdiv(n, chunk)
    cand = torch.empty(rows, chunks * k_pad, dtype=torch.float32, device=x.device)
    launch = pdl.launch_args(x.device)
    _chunk_top_kernel[(rows, chunks)](x, cand, n, x.stride(0), CHUNK=chunk, K_PAD=k_pad,
                                      num_warps=8, **launch)
    _merge_top_kernel[(rows,)](cand, out, chunks * k_pad, k, CAND_PAD=triton.next_power_of_2(chunks * k_pad),
                               K_PAD=k_pad, num_warps=8, **launch)
    return out
