"""Fused Triton kernels for the element-wise chains of a decoder layer.

Each op here replaces a run of small torch ops (casts, reductions, indexing, cat, index_copy_) with one kernel, so
a CUDA-graph decode step launches a handful of kernels per layer instead of dozens:

* `rms_norm`, `add_rms_norm`: RMSNorm, optionally with the residual add in front of it;
* `qk_norm_rope_store`: everything in `Attention.forward` between qkv_proj and the attention call (split, per-head
  q/k RMSNorm, rotate-half RoPE, K/V write into the paged pool);
* `silu_mul`: the SwiGLU activation `silu(gate) * up`;
* `layer_norm_dot`: a router's head, LayerNorm then a dot product per row (R2R's Linear(d, 1)).

Every op rounds to the activation dtype exactly where the torch reference in layers.py / model.py does (RMSNorm
rounds the normalised value before the weight multiply, RoPE rounds only its result, silu is rounded before the
product), so outputs match the reference bit for bit up to float32 summation order. Only long-standing `tl` APIs
are used (masked pointer loads/stores, reductions, exp, sqrt, casts) so the kernels compile on triton >= 3.2 and
also run on the CPU under TRITON_INTERPRET=1, which is how CI tests them. None of the wrappers synchronises with
the device or reads tensor values on the host, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrouter.runner import pdl
from tokenrouter.runner.pdl import wait_for_predecessor

# Columns per program of silu_mul: wide enough for full-width vector accesses, small enough that short rows
# (decode, T = 1) still spread over many programs.
_SILU_BLOCK = 1024


def _num_warps(elems: int) -> int:
    """Warps for a one-tile program over `elems` elements: about 256 elements per warp, 1..8 warps.

    These kernels are memory bound: 8 elements per thread allows 16-byte vector accesses on 16-bit data, and rows
    wider than 2048 elements give each thread more rather than use more than 8 warps, which only adds
    cross-warp reduction traffic.
    """
    return min(8, max(1, elems // 256))


@triton.jit
def _rms_norm_row(x, w, eps, dtype: tl.constexpr, N: tl.constexpr):
    """One [BLOCK] row: float32 statistics, normalised value rounded to `dtype`, weight product rounded to `dtype`."""
    ms = tl.sum(x * x, 0) / N
    y = x * (1.0 / tl.sqrt(ms + eps))
    # The reference casts the normalised value to the activation dtype before the weight multiply; rounding here
    # too keeps low-precision outputs identical to it (an exact float32 product of two 16-bit values, then one
    # rounding) rather than "more accurate" and different.
    y = y.to(dtype).to(tl.float32)
    return (y * w).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    w_ptr,  # [N]
    out_ptr,  # [T, N] contiguous
    eps,
    stride_x,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (T,): one row per program."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = _rms_norm_row(x, w, eps, out_ptr.dtype.element_ty, N)
    tl.store(out_ptr + row * N + cols, out, mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N]
    w_ptr,  # [N]
    out_ptr,  # [T, N] contiguous
    new_res_ptr,  # [T, N] contiguous
    eps,
    stride_x,
    stride_res,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (T,): new_res = x + res (rounded to the dtype), out = RMSNorm(new_res)."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    # torch adds 16-bit tensors in float32 and rounds once; the norm must see that rounded sum, as the next layer
    # does through the residual stream.
    h = (x + res).to(dtype)
    tl.store(new_res_ptr + row * N + cols, h, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = _rms_norm_row(h.to(tl.float32), w, eps, dtype, N)
    tl.store(out_ptr + row * N + cols, out, mask=ok)


@triton.jit
def _norm_rope_heads(
    x1,  # [H_PAD, HALF_PAD] float32, first halves of the heads (padding lanes 0)
    x2,  # [H_PAD, HALF_PAD] float32, second halves
    w_ptr,  # [D] norm weight, read only when HAS_NORM
    cos,  # [HALF_PAD] float32
    sin,  # [HALF_PAD] float32
    j,  # [HALF_PAD] offsets within a half
    j_ok,  # [HALF_PAD] j < HALF
    eps,
    dtype: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Per-head RMSNorm (optional) then rotate-half RoPE of a tile of heads; returns both halves in `dtype`."""
    if HAS_NORM:
        # The head's statistics cover both halves; padding lanes are 0 and the mean divides by the true HEAD_DIM.
        ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        r = (1.0 / tl.sqrt(ms + eps))[:, None]
        w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HEAD_DIM // 2 + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        # Same roundings as RMSNorm.forward (normalised value, then weight product), and the norm's output is
        # materialised in the activation dtype before RoPE reads it back as float32.
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    return (x1 * c - x2 * s).to(dtype), (x2 * c + x1 * s).to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,  # [T, (Hq + 2 * Hkv) * D], row stride stride_qkv
    pos_ptr,  # [T]
    cos_ptr,  # [P, D / 2] float32
    sin_ptr,  # [P, D / 2] float32
    q_w_ptr,  # [D], read only when HAS_Q_NORM
    k_w_ptr,  # [D], read only when HAS_K_NORM
    slot_ptr,  # [T], negative = padding token
    q_out_ptr,  # [T, Hq, D] contiguous
    k_cache_ptr,  # [num_slots, Hkv, D]
    v_cache_ptr,
    eps,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_kc,
    stride_kh,
    stride_vc,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (T,): one token's q (normed, rotated, to q_out), k (normed, rotated) and v (as is) into the cache.

    Heads are tiled as [heads, HALF_PAD] halves so rotate-half is element-wise between the two tiles.
    """
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    HALF = HEAD_DIM // 2
    dtype = q_out_ptr.dtype.element_ty
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + j, mask=j_ok, other=0.0).to(tl.float32)
    row_ptr = qkv_ptr + t * stride_qkv

    hq = tl.arange(0, HQ_PAD)
    q_mask = (hq < NUM_HEADS)[:, None] & j_ok[None, :]
    q_off = hq[:, None] * HEAD_DIM + j[None, :]  # first-half offsets of each head in the row (and in q_out)
    q1 = tl.load(row_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row_ptr + q_off + HALF, mask=q_mask, other=0.0).to(tl.float32)
    q1, q2 = _norm_rope_heads(q1, q2, q_w_ptr, cos, sin, j, j_ok, eps, dtype, HAS_Q_NORM, HEAD_DIM)
    q_row_ptr = q_out_ptr + t * (NUM_HEADS * HEAD_DIM)
    tl.store(q_row_ptr + q_off, q1, mask=q_mask)
    tl.store(q_row_ptr + q_off + HALF, q2, mask=q_mask)

    # The CUDA-graph runner pads batches with slot -1 tokens: their k/v must not land anywhere, so such a token
    # gets zero valid KV heads. (Folding the flag into the head bound rather than and-ing a scalar bool into the
    # mask also sidesteps the interpreter, which turns `bool tile & bool scalar` into an int mask it rejects.)
    # Clamping keeps even the masked-off addresses inside the pool.
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * stride can exceed 2**31 in large pools
    kv_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    slot = tl.maximum(slot, 0)
    hk = tl.arange(0, HKV_PAD)
    kv_mask = (hk < kv_heads)[:, None] & j_ok[None, :]
    kv_off = hk[:, None] * HEAD_DIM + j[None, :]
    k_src = row_ptr + NUM_HEADS * HEAD_DIM + kv_off
    k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1, k2 = _norm_rope_heads(k1, k2, k_w_ptr, cos, sin, j, j_ok, eps, dtype, HAS_K_NORM, HEAD_DIM)
    k_dst = k_cache_ptr + slot * stride_kc + hk[:, None] * stride_kh + j[None, :]
    tl.store(k_dst, k1, mask=kv_mask)
    tl.store(k_dst + HALF, k2, mask=kv_mask)

    # v is copied untouched, in the same two halves (one tile shape for the whole kernel).
    v_src = row_ptr + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_off
    v_dst = v_cache_ptr + slot * stride_vc + hk[:, None] * stride_vh + j[None, :]
    tl.store(v_dst, tl.load(v_src, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask, other=0.0), mask=kv_mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * I], row stride stride_in
    out_ptr,  # [T, I] contiguous
    stride_in,
    INTER: tl.constexpr,  # intermediate size I
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (T, cdiv(I, BLOCK)): silu(gate) * up over one BLOCK-column slice of one row."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    # F.silu computes x / (1 + exp(-x)) in float32 and rounds; the product with up is a second rounded op.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (act * up).to(dtype), mask=ok)


@triton.jit
def _layer_norm_dot_kernel(
    x_ptr,  # [T, N] float32
    norm_w_ptr,  # [N]
    norm_b_ptr,  # [N]
    w_ptr,  # [N] the head's weight row
    b_ptr,  # [1] its bias
    out_ptr,  # [T] float32
    eps,
    stride_x,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T,): one row per program, float32 throughout (a router's head)."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    xc = tl.where(ok, x - tl.sum(x, 0) / N, 0.0)  # two passes over registers: no cancellation for rows far from 0
    y = xc * (1.0 / tl.sqrt(tl.sum(xc * xc, 0) / N + eps))
    y = y * tl.load(norm_w_ptr + cols, mask=ok, other=0.0) + tl.load(norm_b_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row, tl.sum(y * tl.load(w_ptr + cols, mask=ok, other=0.0), 0) + tl.load(b_ptr))


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, N], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")


def _check_weight(weight: torch.Tensor, n: int) -> None:
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"norm weight must be a contiguous [{n}] tensor, got shape {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` in one kernel: [T, H] -> new contiguous [T, H] in x's dtype.

    Statistics in float32, the normalised value rounded to x's dtype, then `weight * y` computed in float32 and
    rounded to x's dtype (the reference's rounding points). `x` may have any row stride.
    """
    _check_rows("x", x)
    T, N = x.shape
    _check_weight(weight, N)
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](x, weight, out, eps, x.stride(0), N=N, BLOCK=block, num_warps=_num_warps(block),
                           **pdl.launch_args(x.device))
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel, both new [T, H] tensors in x's dtype.

    The sum is rounded to the dtype first, as torch's `x + residual` is, and the norm reads that rounded sum; the
    inputs are not modified.
    """
    _check_rows("x", x)
    _check_rows("residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )
    T, N = x.shape
    _check_weight(weight, N)
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    if T == 0:
        return out, new_residual
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(T,)](
        x, residual, weight, out, new_residual, eps, x.stride(0), residual.stride(0),
        N=N, BLOCK=block, num_warps=_num_warps(block), **pdl.launch_args(x.device),
    )  # fmt: skip
    return out, new_residual


def check_qk_rope_args(
    T: int, width: int, dtype: torch.dtype, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    """What `qk_norm_rope_store` (and the skinny qkv matmul's QKRope epilogue) need of their arguments, for T rows
    of `width` q | k | v columns of `dtype`; a ValueError names the first that does not fit."""
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv width {width} != (num_heads + 2 * num_kv_heads) * head_dim"
            f" = ({num_heads} + 2 * {num_kv_heads}) * {head_dim}"
        )
    if positions.shape != (T,) or slot_mapping.shape != (T,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be [{T}]"
        )
    if T > 1 and (positions.stride(0) != 1 or slot_mapping.stride(0) != 1):
        raise ValueError("positions and slot_mapping must be contiguous")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.stride(1) != 1:
            raise ValueError(
                f"{name} must be [P, {head_dim // 2}] with a contiguous last dim, got {tuple(table.shape)}"
            )
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor, got shape {tuple(w.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (num_kv_heads, head_dim) or cache.stride(2) != 1:
            raise ValueError(
                f"{name} must be [num_slots, {num_kv_heads}, {head_dim}] contiguous along head_dim,"
                f" got {tuple(cache.shape)}"
            )
        if cache.dtype != dtype:
            raise ValueError(f"{name} dtype {cache.dtype} != qkv dtype {dtype}")


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The part of `Attention.forward` between qkv_proj and attention, in one kernel.

    Args:
        qkv: [T, (Hq + 2 * Hkv) * D] rows laid out q | k | v; any row stride (e.g. a column slice).
        positions: [T] integer position of each token, indexes the cos/sin tables.
        cos, sin: [P, D / 2] float32 RoPE tables (`RotaryEmbedding.cos` / `.sin`).
        q_norm_weight, k_norm_weight: [D] per-head RMSNorm weights (Qwen3), or None to skip that norm.
        eps: RMSNorm epsilon.
        k_cache, v_cache: [num_slots, Hkv, D] KV pool views in qkv's dtype; k (normed, rotated) and v (as is)
            are written at row slot_mapping[t].
        slot_mapping: [T] integer slot per token; a negative slot is a padding token whose k/v is not written.

    Returns:
        q after norm and RoPE, a new contiguous [T, Hq, D] tensor in qkv's dtype.
    """
    _check_rows("qkv", qkv)
    T = qkv.shape[0]
    check_qk_rope_args(T, qkv.shape[1], qkv.dtype, positions, cos, sin, q_norm_weight, k_norm_weight, k_cache,
                       v_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    hq_pad = triton.next_power_of_2(num_heads)
    half_pad = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_store_kernel[(T,)](
        qkv, positions, cos, sin,
        # Unused pointer slots get qkv: HAS_*_NORM is constexpr, so the kernel never reads them.
        qkv if q_norm_weight is None else q_norm_weight,
        qkv if k_norm_weight is None else k_norm_weight,
        slot_mapping, q, k_cache, v_cache, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HQ_PAD=hq_pad, HKV_PAD=triton.next_power_of_2(num_kv_heads), HALF_PAD=half_pad,
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None,
        num_warps=_num_warps(hq_pad * half_pad * 2), **pdl.launch_args(qkv.device),
    )  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` with `gate, up = gate_up.chunk(2, -1)`: [T, 2 * I] -> new contiguous [T, I].

    silu in float32 rounded to the dtype, then the product in float32 rounded to the dtype, as torch does it.
    `gate_up` may have any row stride.
    """
    _check_rows("gate_up", gate_up)
    T, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up width must be even (gate | up), got {two_i}")
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or inter == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), INTER=inter, BLOCK=block, num_warps=_num_warps(block),
        **pdl.launch_args(gate_up.device),
    )
    return out


def layer_norm_dot(x: torch.Tensor, norm: torch.nn.LayerNorm, head: torch.nn.Linear) -> torch.Tensor:
    """head(norm(x)).squeeze(-1) for a float32 head of one output in one kernel: [T, N] -> [T] float32 (equal to
    torch's LayerNorm and GEMV up to float32 summation order). Torch ran it as two kernels, more in eager mode."""
    _check_rows("x", x)
    T, N = x.shape
    params = (norm.weight, norm.bias, head.weight, head.bias)
    if (x.dtype != torch.float32 or tuple(norm.normalized_shape) != (N,) or tuple(head.weight.shape) != (1, N)
            or any(p is None or not p.is_contiguous() or p.dtype != torch.float32 for p in params)):
        raise ValueError(f"layer_norm_dot: needs float32 rows [T, {N}], a LayerNorm({N}) with weight and bias and a "
                         f"Linear({N}, 1) with a bias, all float32 and contiguous")
    out = torch.empty(T, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    block = triton.next_power_of_2(N)
    _layer_norm_dot_kernel[(T,)](x, norm.weight, norm.bias, head.weight, head.bias, out, norm.eps, x.stride(0), N=N,
                                 BLOCK=block, num_warps=_num_warps(block), **pdl.launch_args(x.device))
    return out
