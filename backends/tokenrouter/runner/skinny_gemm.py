"""Small-M matmuls (decode and short extends) as one Triton kernel each, with their neighbours fused in.

`skinny_linear` computes y = f(x) @ W^T for a few rows x (M <= MAX_M) and a large weight W [N, K]. At such M a
matmul only streams W from memory, so what matters is keeping enough bytes in flight on every SM and launching as
few kernels as possible. The kernel therefore

* tiles W by BLOCK_N output columns and, when N alone gives too few programs, splits K over SPLIT_K programs whose
  float32 partials are reduced by the last of them to finish (a counter per column tile), not by a second kernel;
  or (stream-K, `GemmConfig.programs`) lays every tile's K blocks end to end and gives each of a fixed number of
  programs an equal run of them, so no SM idles through a partial last wave (the 32B's matmuls: 240-400 tiles on
  132 SMs); tiles shared between programs are reduced the same way;
* computes the tile transposed (W_tile @ x^T), so the large N side fills the MMA's M dimension and x's few rows its
  N dimension of 16;
* fuses the element-wise op in front of it (`prologue`): RMSNorm of x (statistics over the whole row, then the
  normalised value times the norm weight, rounded where `RMSNorm` rounds), LayerNorm (mean and variance over the
  row in one pass, around the mean of its first block, then weight and bias, one rounding as `nn.LayerNorm`) or
  SwiGLU's silu(gate) * up (x holds [gate | up], rounded where `fused_ops.silu_mul` rounds);
* and what follows it: a bias (added to the float32 product before its rounding, as cuBLAS's epilogue does), an
  activation (GELU with erf, or ReLU, on the rounded value as torch applies it), and the residual add:
  y = round(act(round(x @ W^T + b)) + residual), as torch's `h + residual` is computed after the rounded matmul. A
  decoder layer then hands one residual stream from matmul to matmul (model.py); a router network its own
  (routing/policies/r2r.py). The qkv matmul can instead end in the attention's preamble (`QKRope`: per-head q/k
  RMSNorm, RoPE, k and v into the KV pool), one head per column tile.

float32 inputs (the routers) multiply on the tensor cores in three TF32 passes ("tf32x3": each operand split into
a TF32 high part and a TF32 remainder, errors of float32's order), or in plain IEEE float32 arithmetic when the
tuned config says so (`GemmConfig.fp32_dot`): at a few rows both only stream the weight, and the tensor-core path
keeps the kernel's layout where IEEE dot falls back to the CUDA cores.

N and M are runtime arguments (K too, except the norm statistics' unrolled loop count), so a model's shapes
share compiled variants. Tile sizes and split counts come per (N, K, M) from a table measured on the target GPU
by perf/bench_gemm.py and persisted beside this module (`skinny_gemm_tuned.json`, which also caps the rows per
model from step-level measurements, perf/bench_runner.py); a model whose shapes or GPU it lacks stays on cuBLAS.
Nothing is tuned at start.
The split-K reduction sums partials in a fixed order, so results do not depend on which program finishes last.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from tokenrouter.runner import pdl
from tokenrouter.runner.pdl import wait_for_predecessor

log = logging.getLogger(__name__)

MAX_M = 64  # rows the kernel takes; larger batches go to cuBLAS (they are no longer weight-read bound)
BLOCK_M_SIZES = (16, 32, 64)  # the row tiles up to MAX_M, each a tuned table column
PROLOGUES = ("none", "rms_norm", "silu_mul", "layer_norm")
ACTIVATIONS = ("none", "gelu", "relu")
# Elements per load of the RMSNorm statistics (rows x columns): 16 x 512 is 32 float32 values a thread at 4
# warps. Wider row tiles load fewer columns at a time, or the unrolled loads spill registers.
_STATS_ELEMS = 16 * 512
TUNED_PATH = Path(__file__).with_name("skinny_gemm_tuned.json")
# Apply the table's step-level row caps (`layers`). perf/bench_runner.py turns this off to measure a model at the
# rows the per-matmul table allows, so that a new cap can come out higher than the last.
LAYER_CAPS = True


@triton.jit
def _row_stats(x_rows, m_ok, K, eps, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, STATS_BLOCK: tl.constexpr,
               STATS_ITERS: tl.constexpr):
    """(mean, rstd) of each of x's rows for the norm prologues (RMSNorm: mean 0); zeros for the others.

    A norm needs the whole row's statistics before any K slice: every program reads x's few rows once more (M x K,
    from L2) rather than a separate norm kernel writing and re-reading them. The loop is unrolled (STATS_ITERS is a
    constant) so its loads are issued together: one L2 round trip, not one per block."""
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 3:
        rs = tl.arange(0, STATS_BLOCK)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)  # RMSNorm: sum of squares; LayerNorm: of deviations from shift
        dev_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(STATS_ITERS):
            # (its own mask name: compiled, a name shared with the main loop would be a loop-carried variable
            # whose shape changes, which Triton rejects and the interpreter does not notice)
            s_ok = (i * STATS_BLOCK + rs) < K
            s_mask = m_ok[:, None] & s_ok[None, :]
            xs = tl.load(x_rows + i * STATS_BLOCK + rs[None, :], mask=s_mask, other=0.0).to(tl.float32)
            if PROLOGUE == 3:
                # LayerNorm in one pass: sums of the deviations from the mean of the row's first block (already in
                # registers), which is near the row's mean on the scale of its spread. So float32 sums lose
                # nothing when the mean dwarfs the spread (a plain sum of squares minus the squared mean would
                # cancel to noise), and a single outlier column cannot throw the shift off.
                if i == 0:
                    shift = tl.sum(xs, 1) / tl.sum(s_ok.to(tl.float32), 0)
                dev = tl.where(s_mask, xs - shift[:, None], 0.0)
                dev_sum += tl.sum(dev, 1)
                sq += tl.sum(dev * dev, 1)
            else:
                sq += tl.sum(xs * xs, 1)
        if PROLOGUE == 3:
            dm = dev_sum / K
            mean = shift + dm
            sq = tl.maximum(sq - dm * dev_sum, 0.0)  # deviations from the mean: sum (x - shift)^2 - K dm^2
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    return mean, rstd


@triton.jit
def _accumulate(acc, x_rows, w_rows, m_ok, n_ok, k_lo, k_hi, K, norm_w_ptr, norm_b_ptr, mean, rstd, dtype: tl.constexpr,
                PROLOGUE: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += W[cols, k_lo:k_hi] @ prologue(x)[:, k_lo:k_hi]^T (k_lo a multiple of BLOCK_K)."""
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + rk) < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 2:
            gate = tl.load(x_rows + k0 + rk[None, :], mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k0 + rk[None, :], mask=x_mask, other=0.0).to(tl.float32)
            # As fused_ops.silu_mul: silu rounded to the dtype, then the product rounded.
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up).to(dtype)
        else:
            x = tl.load(x_rows + k0 + rk[None, :], mask=x_mask, other=0.0)
            if PROLOGUE == 1:
                nw = tl.load(norm_w_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                # As RMSNorm: the normalised value rounded to the dtype, then the weight product rounded.
                y = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
                x = (y * nw[None, :]).to(dtype)
            elif PROLOGUE == 3:
                nw = tl.load(norm_w_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                nb = tl.load(norm_b_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                # As nn.LayerNorm: everything in float32, one rounding at the end (masked columns come out 0).
                y = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
                x = (y * nw[None, :] + nb[None, :]).to(dtype)
        w = tl.load(w_rows + k0 + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP32_DOT == "":
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(w, tl.trans(x), input_precision=FP32_DOT)
    return acc


# M (the batch's rows) must not pick a variant: Triton would compile one for M == 1 and for multiples of 16.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] (prologue silu_mul: [M, 2K], gate then up), row stride stride_x
    w_ptr,  # [N, K], row stride stride_w
    out_ptr,  # [M, N] contiguous
    norm_w_ptr,  # [K], read when PROLOGUE is 1 or 3
    norm_b_ptr,  # [K] LayerNorm bias, read when PROLOGUE == 3
    bias_ptr,  # [N], read when HAS_BIAS
    res_ptr,  # [M, N] residual, row stride stride_res, read when HAS_RESIDUAL
    part_ptr,  # [SPLIT_K, M, N] float32 partials, used when SPLIT_K > 1
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 zeros, used when SPLIT_K > 1 (left zero again)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    eps,
    stride_x,
    stride_w,
    stride_res,
    pos_ptr,  # QK_ROPE: [M] positions
    cos_ptr,  # QK_ROPE: [P, HEAD_DIM / 2] float32, row stride stride_cos (sin_ptr alike)
    sin_ptr,
    q_norm_ptr,  # QK_ROPE with QK_NORM: [HEAD_DIM] (k_norm_ptr alike)
    k_norm_ptr,
    slot_ptr,  # QK_ROPE: [M] KV slots, negative = a padding token
    k_cache_ptr,  # QK_ROPE: [num_slots, Hkv, HEAD_DIM] (v_cache_ptr alike)
    v_cache_ptr,
    rope_eps,
    stride_cos,
    stride_kc,
    stride_kh,
    stride_vc,
    stride_vh,
    PROLOGUE: tl.constexpr,  # 0 none, 1 rms_norm, 2 silu_mul, 3 layer_norm
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 gelu (erf), 2 relu
    HAS_RESIDUAL: tl.constexpr,
    FP32_DOT: tl.constexpr,  # float32 inputs: tl.dot's input_precision ("tf32x3" or "ieee"); "" for 16-bit inputs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,  # prologue rms_norm / layer_norm: columns per statistics load
    STATS_ITERS: tl.constexpr,  # prologue rms_norm / layer_norm: cdiv(K, STATS_BLOCK); 0 otherwise
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
    QK_ROPE: tl.constexpr = False,  # the qkv epilogue (`QKRope`): a column tile is one head (BLOCK_N == head_dim)
    QK_NORM: tl.constexpr = False,  # ... with Qwen3's per-head q/k RMSNorm first
    NUM_HEADS: tl.constexpr = 0,  # QK_ROPE: Hq, then Hkv k heads, then the v heads
    NUM_KV_HEADS: tl.constexpr = 0,
):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) owns columns n*BLOCK_N.. over the s-th K range."""
    wait_for_predecessor(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    mean, rstd = _row_stats(x_rows, m_ok, K, eps, PROLOGUE, BLOCK_M, STATS_BLOCK, STATS_ITERS)

    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc = _accumulate(acc, x_rows, w_rows, m_ok, n_ok, k_begin, k_begin + k_per_split, K, norm_w_ptr, norm_b_ptr,
                      mean, rstd, dtype, PROLOGUE, FP32_DOT, BLOCK_K)

    out_offs = rm[None, :] * N + rn[:, None]  # [BLOCK_N, BLOCK_M] view of out[M, N]
    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)
        # Every thread's stores before the one atomic (the barrier), and acq_rel on it: this program's partial is
        # visible before its count, and the last program sees every partial.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1)
        if done == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):  # a fixed order: the sum does not depend on which program finished last
                acc += tl.load(part_ptr + s * M * N + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)  # zero again for the next launch (also inside a CUDA graph)
            if QK_ROPE:
                _store_qk_rope(acc, out_ptr, out_offs, rm, m_ok, pid_n, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr,
                               k_norm_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, rope_eps, stride_cos, stride_kc,
                               stride_kh, stride_vc, stride_vh, QK_NORM, NUM_HEADS, NUM_KV_HEADS, BLOCK_N, BLOCK_M)
            else:
                _store_out(acc, out_ptr, out_offs, out_mask, bias_ptr, res_ptr, rm, rn, n_ok, stride_res, HAS_BIAS,
                           ACTIVATION, HAS_RESIDUAL)
    elif QK_ROPE:
        _store_qk_rope(acc, out_ptr, out_offs, rm, m_ok, pid_n, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                       slot_ptr, k_cache_ptr, v_cache_ptr, rope_eps, stride_cos, stride_kc, stride_kh, stride_vc,
                       stride_vh, QK_NORM, NUM_HEADS, NUM_KV_HEADS, BLOCK_N, BLOCK_M)
    else:
        _store_out(acc, out_ptr, out_offs, out_mask, bias_ptr, res_ptr, rm, rn, n_ok, stride_res, HAS_BIAS, ACTIVATION,
                   HAS_RESIDUAL)


@triton.jit(do_not_specialize=["M", "units"])
def _stream_k_gemm_kernel(
    x_ptr, w_ptr, out_ptr, norm_w_ptr, norm_b_ptr, bias_ptr, res_ptr,  # as _skinny_gemm_kernel's
    part_ptr,  # [2 * programs, BLOCK_N, BLOCK_M] float32: each program's partial tiles (its first, its last)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 zeros (left zero again)
    M,
    N,
    K,
    units,  # K blocks per program
    eps,
    stride_x,
    stride_w,
    stride_res,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    STATS_ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stream-K: the column tiles' K blocks laid end to end (tile after tile) and cut into equal runs of `units`,
    one per program, so every program streams the same number of weight bytes whatever the tile count (a split-K
    grid leaves a partial last wave when its programs are not a multiple of the SMs'). A tile a program covers
    whole is stored at once; a tile shared by several programs is summed by the last of them to finish, in program
    order (as split-K's partials are), from the partial each stored."""
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    mean, rstd = _row_stats(x_rows, m_ok, K, eps, PROLOGUE, BLOCK_M, STATS_BLOCK, STATS_ITERS)  # once per program
    iters = tl.cdiv(K, BLOCK_K)  # K blocks per tile
    start = pid * units
    end = tl.minimum(start + units, tl.cdiv(N, BLOCK_N) * iters)
    first_tile = start // iters
    local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]  # a partial tile's layout
    u = start
    while u < end:
        tile = u // iters
        tile_start = tile * iters
        seg_end = tl.minimum(end, tile_start + iters)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _accumulate(acc, x_rows, w_rows, m_ok, n_ok, (u - tile_start) * BLOCK_K, (seg_end - tile_start) * BLOCK_K,
                          K, norm_w_ptr, norm_b_ptr, mean, rstd, dtype, PROLOGUE, FP32_DOT, BLOCK_K)
        out_offs = rm[None, :] * N + rn[:, None]
        out_mask = n_ok[:, None] & m_ok[None, :]
        if (u == tile_start) & (seg_end == tile_start + iters):
            _store_out(acc, out_ptr, out_offs, out_mask, bias_ptr, res_ptr, rm, rn, n_ok, stride_res, HAS_BIAS,
                       ACTIVATION, HAS_RESIDUAL)
        else:
            # Slot 0 holds a program's part of its first tile, slot 1 of its last (the tiles between, it covers whole).
            tl.store(part_ptr + (2 * pid + (tile != first_tile).to(tl.int32)) * (BLOCK_N * BLOCK_M) + local, acc)
            tl.debug_barrier()  # as in _skinny_gemm_kernel: every partial store before the acq_rel count
            first_p = tile_start // units
            last_p = (tile_start + iters - 1) // units
            done = tl.atomic_add(count_ptr + tile, 1)
            if done == last_p - first_p:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for p in range(first_p, last_p + 1):  # program order: the sum does not depend on who finished last
                    slot = 2 * p + ((p * units) // iters != tile).to(tl.int32)
                    acc += tl.load(part_ptr + slot * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0)  # zero again for the next launch
                _store_out(acc, out_ptr, out_offs, out_mask, bias_ptr, res_ptr, rm, rn, n_ok, stride_res, HAS_BIAS,
                           ACTIVATION, HAS_RESIDUAL)
        u = seg_end


@triton.jit
def _store_out(acc, out_ptr, out_offs, out_mask, bias_ptr, res_ptr, rm, rn, n_ok, stride_res, HAS_BIAS: tl.constexpr,
               ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(dtype)  # the matmul's own rounding, as cuBLAS writes its output (bias included)
    if ACTIVATION == 1:  # GELU, the exact (erf) form as nn.GELU(), on the rounded output
        yf = y.to(tl.float32)
        y = (0.5 * yf * (1.0 + tl.math.erf(yf * 0.7071067811865476))).to(dtype)
    elif ACTIVATION == 2:
        y = tl.maximum(y, 0.0).to(dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rm.to(tl.int64)[None, :] * stride_res + rn[:, None], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(out_ptr + out_offs, y, mask=out_mask)


@triton.jit
def _store_qk_rope(acc, out_ptr, out_offs, rm, m_ok, head, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr,
                   k_cache_ptr, v_cache_ptr, eps, stride_cos, stride_kc, stride_kh, stride_vc, stride_vh,
                   QK_NORM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The qkv matmul's epilogue: what fused_ops.qk_norm_rope_store does to a head, on the tile [HEAD_DIM, BLOCK_M]
    of head `head` (q heads, then k, then v) with the same roundings: the matmul's output rounded, per-head RMSNorm
    (normalised value rounded, then the weight product rounded), rotate-half RoPE rounded once. q lands in `out`
    (its k and v columns are left unwritten), k and v in the KV pool at each token's slot."""
    dtype = out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    y = acc.to(dtype).to(tl.float32)  # as the qkv tensor the separate kernel reads
    slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1).to(tl.int64)  # int64: slot * stride can exceed 2**31
    kv_mask = (m_ok & (slot >= 0))[None, :]  # padding tokens (slot < 0) write no k/v
    slot = tl.maximum(slot, 0)
    if head >= NUM_HEADS + NUM_KV_HEADS:  # a v head: into the pool as it is
        v_dst = v_cache_ptr + slot[None, :] * stride_vc + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + d[:, None]
        tl.store(v_dst, y.to(dtype), mask=kv_mask)
    else:
        is_q = head < NUM_HEADS
        if QK_NORM:
            r = 1.0 / tl.sqrt(tl.sum(y * y, 0) / HEAD_DIM + eps)  # [BLOCK_M]
            w = tl.where(is_q, tl.load(q_norm_ptr + d), tl.load(k_norm_ptr + d)).to(tl.float32)
            y = ((y * r[None, :]).to(dtype).to(tl.float32) * w[:, None]).to(dtype).to(tl.float32)
        # Rotate-half: each element's partner is the other half's element at the same offset (the halves swapped in
        # registers), entering with a minus sign in the first half.
        partner = tl.reshape(tl.flip(tl.reshape(y, (2, HALF, BLOCK_M)), 0), (HEAD_DIM, BLOCK_M))
        pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        j = (d % HALF)[:, None]
        c = tl.load(cos_ptr + pos[None, :] * stride_cos + j)
        s = tl.load(sin_ptr + pos[None, :] * stride_cos + j)
        first = (d < HALF)[:, None]
        roped = tl.where(first, y * c - partner * s, y * c + partner * s).to(dtype)
        if is_q:
            tl.store(out_ptr + out_offs, roped, mask=m_ok[None, :])
        else:
            k_dst = k_cache_ptr + slot[None, :] * stride_kc + (head - NUM_HEADS) * stride_kh + d[:, None]
            tl.store(k_dst, roped, mask=kv_mask)


@dataclass(frozen=True)
class QKRope:
    """The qkv matmul's epilogue (`skinny_linear(..., qk_rope=...)`): the work of fused_ops.qk_norm_rope_store
    (per-head q/k RMSNorm, rotate-half RoPE, k and v into the paged pool) done by the matmul's programs, so a
    decoder layer launches one kernel fewer. Arguments as qk_norm_rope_store's; both norms or neither."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @staticmethod
    def supports(head_dim: int, has_q_norm: bool, has_k_norm: bool) -> bool:
        """Whether a layer of this shape can take the epilogue: a head is one column tile (a power of two, for
        tl.arange) and the q and k norms come together (Qwen3) or not at all (Llama, Qwen2)."""
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and has_q_norm == has_k_norm

    def check(self, m: int, n: int, dtype: torch.dtype) -> None:
        """The arguments fit an [m, n] qkv output of `dtype` (fused_ops' rules, and this epilogue's own)."""
        from tokenrouter.runner import fused_ops

        d = self.head_dim
        if not self.supports(d, self.q_norm_weight is not None, self.k_norm_weight is not None):
            raise ValueError(f"qk_rope needs a power-of-two head_dim >= 16 (got {d}) and both q/k norms or neither")
        if self.sin.stride(0) != self.cos.stride(0):
            raise ValueError("qk_rope: cos and sin must have the same row stride")
        fused_ops.check_qk_rope_args(m, n, dtype, self.positions, self.cos, self.sin, self.q_norm_weight,
                                     self.k_norm_weight, self.k_cache, self.v_cache, self.slot_mapping,
                                     self.num_heads, self.num_kv_heads, d)


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one (N, K, M) shape."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    fp32_dot: str = "tf32x3"  # float32 inputs only: tl.dot's input_precision, "tf32x3" or "ieee"
    programs: int = 0  # > 0: stream-K over this many programs (split_k 1); 0: the split-K grid


def qk_rope_config(cfg: GemmConfig, n: int, k: int, head_dim: int) -> GemmConfig:
    """`cfg` (tuned for the plain qkv matmul) reshaped for the `QKRope` epilogue, one head per column tile: about as
    many programs (the K split grows as the tiles get fewer), and K blocks of at most 128 columns at head_dim 128
    so that the wider tile's pipeline stages still fit in shared memory."""
    block_k = max(16, min(cfg.block_k, 128 * 128 // head_dim))
    programs = cfg.programs or triton.cdiv(n, cfg.block_n) * cfg.split_k
    split = max(1, min(16, triton.cdiv(programs, triton.cdiv(n, head_dim)), k // block_k))
    return dataclasses.replace(cfg, block_n=head_dim, block_k=block_k, split_k=split, programs=0)


def block_m(m: int) -> int:
    """The kernel's row tile: tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(m))


def heuristic_config(n: int, k: int, m: int, num_sms: int = 132) -> GemmConfig:
    """A config for shapes the tuned table lacks: 64-column tiles, K split until there are ~2 programs per SM."""
    block_n = 64 if n >= 64 * num_sms // 2 else 32
    block_k = 128 if block_m(m) <= 32 else 64
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * num_sms and k // (split * 2) >= 2 * block_k and split < 16:
        split *= 2
    return GemmConfig(block_n, block_k, split)


@dataclass(frozen=True)
class TunedEntry:
    """One measured table entry: the best config and its time against what it replaces (cuBLAS plus the fused
    element-wise op), both in a CUDA graph with the weights out of L2."""

    config: GemmConfig
    us: float
    baseline_us: float


FP32_DOTS = ("tf32x3", "ieee")


def table_key(n: int, k: int, bm: int, dtype: torch.dtype = torch.bfloat16, epilogue: str = "") -> str:
    """16-bit shapes as "NxKxBM" (the models' matmuls); float32 ones (the routers') as "NxKxBM:float32", which are
    other kernels (twice the bytes per tile) of what may be the same N and K; the qkv matmul with the `QKRope`
    epilogue as "NxKxBM:qk_rope" (its own tiles: one head each)."""
    return f"{n}x{k}x{bm}" + (":float32" if dtype == torch.float32 else "") + (f":{epilogue}" if epilogue else "")


def layer_key(shapes: list[tuple[int, int]]) -> str:
    """A layer's matmul shapes as the table's `layers` section names them: "NxK;NxK;..."."""
    return ";".join(f"{n}x{k}" for n, k in shapes)


@dataclass(frozen=True)
class TunedTable:
    """One GPU model's part of the persisted table: `matmuls` (perf/bench_gemm.py: per matmul and row tile) and
    `layers` (perf/bench_runner.py --skinny-gemm both: per layer, the most rows at which the whole model step
    was measured no slower skinny than on cuBLAS)."""

    matmuls: dict[str, TunedEntry]
    layer_rows: dict[str, int]


@cache
def _tuned_table(device_name: str) -> TunedTable:
    """The persisted table for this GPU model. Empty when that GPU was never tuned."""
    part = json.loads(TUNED_PATH.read_text()).get(device_name, {}) if TUNED_PATH.exists() else {}
    if set(part) - {"matmuls", "layers"}:
        log.warning("%s: %s has keys other than 'matmuls' and 'layers' (an older format?); they are ignored",
                    TUNED_PATH, device_name)
    matmuls = {key: TunedEntry(GemmConfig(**e["config"]), e["us"], e["baseline_us"])
               for key, e in part.get("matmuls", {}).items()}
    return TunedTable(matmuls, {key: e["max_rows"] for key, e in part.get("layers", {}).items()})


@cache
def _device_name(device: torch.device) -> str:
    # Looked up once: every eager skinny launch asks for its config.
    return torch.cuda.get_device_name(device)


def _table(device: torch.device) -> TunedTable | None:
    return _tuned_table(_device_name(device)) if device.type == "cuda" else None


def _tuned(n: int, k: int, m: int, device: torch.device, dtype: torch.dtype, epilogue: str = "") -> TunedEntry | None:
    table = _table(device)
    return None if table is None else table.matmuls.get(table_key(n, k, block_m(m), dtype, epilogue))


def qk_rope_pays(n: int, k: int, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the qkv matmul of m rows should take the `QKRope` epilogue: where the GPU's tuned table measured it
    no slower than the plain matmul followed by fused_ops.qk_norm_rope_store (untuned shapes keep the separate
    kernel, as untuned matmuls keep cuBLAS); off a GPU (Triton's interpreter, the tests) always."""
    if _table(device) is None:
        return True
    entry = _tuned(n, k, m, device, dtype, "qk_rope")
    return entry is not None and entry.us <= entry.baseline_us


def qk_rope_config_for(n: int, k: int, m: int, head_dim: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16, config: GemmConfig | None = None) -> GemmConfig:
    """The config a qkv matmul with the `QKRope` epilogue launches with: `config` or the tuned epilogue entry, kept
    as it is when it has one head per tile; else the plain matmul's config reshaped (`qk_rope_config`)."""
    if config is None:
        entry = _tuned(n, k, m, device, dtype, "qk_rope")
        config = entry.config if entry is not None else config_for(n, k, m, device, dtype)
    if config.block_n == head_dim and not config.programs:
        return config
    return qk_rope_config(config, n, k, head_dim)


def config_for(n: int, k: int, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    entry = _tuned(n, k, m, device, dtype)
    if entry is not None:
        return entry.config
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return heuristic_config(n, k, m, sms)


def max_rows(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows a layer with these (N, K) matmuls should run skinny (0: never). Up to the last row tile where
    the tuned table has every matmul and measured their sum no slower than cuBLAS with the separate ops, capped
    by the layer's measured step-level limit when the table has one. Untuned shapes and GPUs stay on cuBLAS: the
    heuristic configs are for explicit calls, not a default (on the H200 they ran up to 3.5x slower than the tuned
    ones, perf/results/skinny_h200_2026-12-02)."""
    table = _table(device)
    if table is None:
        return 0
    rows = 0
    for bm in BLOCK_M_SIZES:
        entries = [table.matmuls.get(table_key(n, k, bm, dtype)) for n, k in shapes]
        if any(e is None for e in entries) or sum(e.us for e in entries) > sum(e.baseline_us for e in entries):
            break
        rows = bm
    cap = table.layer_rows.get(layer_key(shapes)) if LAYER_CAPS else None
    return rows if cap is None else min(rows, cap)


def cublas_reason(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """Why `max_rows` keeps a layer of these (N, K) matmuls on cuBLAS on this GPU, for the log: a GPU the table has
    never measured is the case a deployment on a new kind of GPU meets, and it says how to tune one."""
    table = _table(device)
    if table is None:
        return "not a CUDA device"
    gpu = _device_name(device) if device.type == "cuda" and torch.cuda.is_available() else str(device)
    if not table.matmuls:
        return (f"{TUNED_PATH.name} has no entries for {gpu}; `bash perf/gpu_kernels.sh OUT_DIR MODEL` on this "
                "GPU measures them (perf/README.md)")
    missing = [f"{n}x{k}" for n, k in shapes if table_key(n, k, BLOCK_M_SIZES[0], dtype) not in table.matmuls]
    if missing:
        return f"{TUNED_PATH.name} has no {dtype} entries for {', '.join(missing)} on {gpu}"
    if LAYER_CAPS and table.layer_rows.get(layer_key(shapes)) == 0:
        return f"{TUNED_PATH.name} caps this layer at 0 rows on {gpu} (its steps were measured no faster)"
    return f"{TUNED_PATH.name} measured cuBLAS faster for this layer on {gpu}"


class SplitKWorkspace:
    """Float32 partials and per-tile counters of split-K and stream-K launches, one per model (one CUDA stream):
    launches on one stream run one after another, and each leaves its counters zero for the next."""

    def __init__(self, device: torch.device, partial_elems: int, tiles: int) -> None:
        self.partials = torch.empty(max(partial_elems, 1), dtype=torch.float32, device=device)
        self.counts = torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)

    def fits(self, partial_elems: int, tiles: int) -> bool:
        return partial_elems <= self.partials.numel() and tiles <= self.counts.numel()


def _stream_k_units(cfg: GemmConfig, n: int, k: int) -> tuple[int, int]:
    """(K blocks per program, programs launched) of a stream-K config: its programs' equal runs over every tile's
    K blocks (fewer programs than the config's when the last would have none)."""
    total = triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k)
    units = triton.cdiv(total, cfg.programs)
    return units, triton.cdiv(total, units)


def _split_k_need(cfg: GemmConfig, m: int, n: int, k: int) -> tuple[int, int]:
    """(float32 partial elements, counters) a launch of `cfg` on m x n outputs (over k) uses."""
    if cfg.programs:
        return 2 * _stream_k_units(cfg, n, k)[1] * cfg.block_n * block_m(m), triton.cdiv(n, cfg.block_n)
    if cfg.split_k == 1:
        return 0, 0
    return cfg.split_k * m * n, triton.cdiv(n, cfg.block_n)


def workspace_need(n: int, k: int, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
                   ) -> tuple[int, int]:
    """(float32 partial elements, counters) one launch of this shape uses."""
    return _split_k_need(config_for(n, k, m, device, dtype), m, n, k)


def workspace_for(shapes: list[tuple[int, int]], rows: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, qkv: tuple[int, int, int] | None = None) -> SplitKWorkspace:
    """A workspace big enough for any launch of these (N, K) shapes at up to `rows` rows; with `qkv` (N, K,
    head_dim), also for that matmul with the `QKRope` epilogue."""
    tiles = {min(bm, rows) for bm in BLOCK_M_SIZES}  # the most rows of each row tile
    needs = [workspace_need(n, k, m, device, dtype) for n, k in shapes for m in tiles]
    if qkv is not None:
        n, k, d = qkv
        needs += [_split_k_need(qk_rope_config_for(n, k, m, d, device, dtype), m, n, k) for m in tiles]
    return SplitKWorkspace(device, max(p for p, _ in needs), max(t for _, t in needs))


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    workspace: SplitKWorkspace | None = None,
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    qk_rope: QKRope | None = None,
) -> torch.Tensor:
    """activation(prologue(x) @ weight^T + bias) (+ residual) -> new contiguous [M, N] in x's dtype.

    prologue: "none"; "rms_norm" (RMSNorm of x with `norm_weight` and `eps` first); "layer_norm" (LayerNorm with
    `norm_weight`, `norm_bias` and `eps`); "silu_mul" (x is [M, 2K] = [gate | up], the input is silu(gate) * up).
    `bias` [N] joins the product before its rounding; activation: "none", "gelu" (erf) or "relu"; `residual`
    [M, N] is added last. A split-K or stream-K config needs `workspace` (SplitKWorkspace). `qk_rope` (a layer's
    qkv matmul, without bias, activation or residual): the output's q columns come out normed and rotated, k and v
    go to the KV pool (`QKRope`). Never synchronises, so it can be captured in a CUDA graph.
    """
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D, last dim contiguous")
    M = x.shape[0]
    N, K = weight.shape
    if M > MAX_M:
        raise ValueError(f"skinny_linear takes at most {MAX_M} rows, got {M}")
    if K == 0:
        raise ValueError("skinny_linear needs K >= 1 (a norm over no columns is undefined)")
    if x.shape[1] != (2 * K if prologue == "silu_mul" else K) or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype} "
                         f"with prologue {prologue!r}")
    if prologue in ("rms_norm", "layer_norm") and (norm_weight is None or norm_weight.shape != (K,)):
        raise ValueError(f"prologue {prologue!r} needs norm_weight of shape ({K},)")
    if prologue == "layer_norm" and (norm_bias is None or norm_bias.shape != (K,)):
        raise ValueError(f"prologue 'layer_norm' needs norm_bias of shape ({K},)")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{N}], got {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (M, N) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{M}, {N}] with a contiguous last dim, got {tuple(residual.shape)}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if qk_rope is not None:
        if bias is not None or residual is not None or activation != "none":
            raise ValueError("qk_rope takes no bias, activation or residual")
        qk_rope.check(M, N, x.dtype)
        cfg = qk_rope_config_for(N, K, M, qk_rope.head_dim, x.device, x.dtype, config)
    else:
        cfg = config or config_for(N, K, M, x.device, x.dtype)
    if cfg.fp32_dot not in FP32_DOTS:
        raise ValueError(f"fp32_dot must be one of {FP32_DOTS}, got {cfg.fp32_dot!r}")
    if cfg.programs and cfg.split_k != 1:
        raise ValueError(f"a stream-K config ({cfg.programs} programs) takes split_k 1, got {cfg.split_k}")
    if cfg.split_k > 1 or cfg.programs:
        need = _split_k_need(cfg, M, N, K)
        if workspace is None or not workspace.fits(*need):
            kind = f"stream-K over {cfg.programs} programs" if cfg.programs else f"split-K x{cfg.split_k}"
            raise ValueError(f"{kind} for [{M}, {N}, {K}] needs a workspace of {need} (partials, counters)")
        part, counts = workspace.partials, workspace.counts
    else:
        part, counts = out, out  # never read: SPLIT_K == 1 compiles the branch away
    stats_block = _STATS_ELEMS // block_m(M)
    args = (x, weight, out,
            norm_weight if norm_weight is not None else out,
            norm_bias if norm_bias is not None else out,
            bias if bias is not None else out,
            residual if residual is not None else out,
            part, counts, M, N, K)
    rest = (eps, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0)
    consts = dict(
        PROLOGUE=PROLOGUES.index(prologue), HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS.index(activation),
        HAS_RESIDUAL=residual is not None, FP32_DOT=cfg.fp32_dot if x.dtype == torch.float32 else "",
        BLOCK_M=block_m(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STATS_BLOCK=stats_block,
        STATS_ITERS=triton.cdiv(K, stats_block) if prologue in ("rms_norm", "layer_norm") else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_args(x.device),
    )  # fmt: skip
    if cfg.programs:
        units, programs = _stream_k_units(cfg, N, K)
        _stream_k_gemm_kernel[(programs,)](*args, units, *rest, **consts)
    else:
        k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
        r = qk_rope
        if r is None:  # (pointer slots the kernel never reads without QK_ROPE)
            rope = (out,) * 8 + (0.0, 0, 0, 0, 0, 0)
        else:
            kc, vc = r.k_cache, r.v_cache
            rope = (r.positions, r.cos, r.sin, r.q_norm_weight if r.q_norm_weight is not None else out,
                    r.k_norm_weight if r.k_norm_weight is not None else out, r.slot_mapping, kc, vc, r.eps,
                    r.cos.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1))
            consts.update(QK_ROPE=True, QK_NORM=r.q_norm_weight is not None, NUM_HEADS=r.num_heads,
                          NUM_KV_HEADS=r.num_kv_heads)
        _skinny_gemm_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](*args, k_per_split, *rest, *rope,
                                                                        SPLIT_K=cfg.split_k, **consts)
    return out
