"""Paged attention in Triton: a split-K decode kernel and a tiled causal extend/prefill kernel.

Both read K/V straight from the paged pool ([num_slots, Hkv, D], slot = block_id * block_size + offset) through
the block tables, so no per-sequence gather is materialised. Both are GQA-aware: one program owns one KV head
and all the query heads that share it, so each K/V tile is loaded once per group rather than once per query head.

Softmax runs online in float32 in the base-2 domain (scores are pre-multiplied by scale * log2(e) so `exp2` can
be used); the output is written in q's dtype. Everything here uses only long-standing `tl` APIs (pointer loads
and stores with masks, `tl.dot`, `tl.exp2`, reductions) so it compiles on triton >= 3.0 and also runs on the CPU
under TRITON_INTERPRET=1, which is how CI tests it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from tokenrouter.runner import pdl
from tokenrouter.runner.attention import AttentionBackend
from tokenrouter.runner.forward_batch import ForwardBatch
from tokenrouter.runner.pdl import wait_for_predecessor

_LOG2E = math.log2(math.e)
# Cap on KV splits per (sequence, KV head) in decode: more splits than this only grow the reduction.
_MAX_KV_SPLITS = 64
# Extend partials hold a row per (token, head, split) of the whole batch: fewer splits than decode, and a bound
# on their bytes (a big mixed batch with one short suffix would otherwise allocate hundreds of MB per step).
_MAX_EXTEND_SPLITS = 16
_MAX_EXTEND_SCRATCH_BYTES = 64 << 20
# Extend programs with work to aim for per SM. A short suffix's partials are q_len x GROUP rows per split, as
# many bytes as a few hundred keys of K/V, so extend wants fewer programs than decode: perf/bench_attention.py
# (perf/results/attention_h200_2026-12-02) measured 2 per SM at 3 % from the best split count per case on
# geometric mean (9 % in the worst case).
_EXTEND_PROGRAMS_PER_SM = 2
# Graphs of up to this many tokens get the short-suffix tile (what returning requests bring); larger ones hold
# prefills and get the prefill tile.
_SHORT_EXTEND_TOKENS = 128
# A target no batch reaches: every launched split is used (as far as the sequence's context has key tiles).
_EVERY_SPLIT = 1 << 30
# A split shorter than this does too little work to pay for its share of the reduction.
_MIN_TOKENS_PER_SPLIT = 256
# Extend graphs are also captured for batches whose every context is at most this many tokens, launched on one KV
# split: no partials, no reduce kernel. The split path costs ~10-13 us a layer whatever its split count (H200, per
# layer in graphs: Qwen3-32B 8 x 10 tokens over 256 keys 27.7 us split, 14.7 on one split; 4 x 10 17.3 / 13.1;
# 12 x 10, where no sequence splits, 27.0 on the split path), and one split stays about as fast as the split path for
# a single sequence up to ~384 keys (1 x 10 over 256 keys 12.8 / 13.1 us, over 1k 30.5 / 18.1; the 0.6B alike:
# perf/results/flat_extend_grid_h200_2026-12-05).
_UNSPLIT_EXTEND_CONTEXT = 384
# Sequences whose ends the extend reduce compares at once to find a token's sequence (one load for most batches).
_SEQ_CHUNK = tl.constexpr(64)
# Decode programs to aim for per SM: a few resident programs per SM hide the block-table -> K/V load latency. Also
# the most a decode launches (rounded down): past it, measured, a partial last round of programs costs more.
_PROGRAMS_PER_SM = 4


@triton.jit
def _attend_tile(
    acc,  # [M, D_PAD] float32 running sum of p @ v (unnormalised)
    l_i,  # [M] float32 running softmax denominator
    m_i,  # [M] float32 running max of the base-2 scores
    q,  # [M, D_PAD] in the cache dtype
    q_pos,  # [M] absolute position of each row's query (only read when CAUSAL)
    k_ptr,
    v_ptr,
    bt_row_ptr,  # this sequence's row of the block table
    start,  # first key position of the tile
    end,  # keys at positions >= end are out of range (only applied when BOUNDED)
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    sm_scale_log2,
    d,  # [D_PAD] head-dim offsets
    d_ok,  # [D_PAD] d < HEAD_DIM
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOUNDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SAFE: tl.constexpr = False,
):
    """One BLOCK_N-key step of online softmax for a tile of query rows that share one KV head."""
    n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if BOUNDED:
        n_ok = n < end
    else:
        # The caller guarantees the whole tile is inside the sequence; a constant mask folds away.
        n_ok = n >= 0
    # Per-token block lookup works for any page size, including pages smaller or larger than BLOCK_N.
    block = tl.load(bt_row_ptr + n // PAGE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * PAGE + n % PAGE  # int64: slot * stride can exceed 2**31 in large pools
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    # "ieee" keeps float32 inputs exact (no TF32); it has no effect on bf16/fp16 inputs.
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2  # [M, BLOCK_N]
    if CAUSAL:
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    elif BOUNDED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        # A row may have seen no key yet (a KV split of an extend that ends before its position): keep its
        # reference point finite so that (-inf) - (-inf) never makes a NaN; alpha and p are then 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Callers order tiles so that every row sees >= 1 key in its first tile, so m_new is finite.
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_new


# Runtime ints that change with the batch are not specialized on (Triton compiles a variant per value class:
# 1, a multiple of 16, other), so a new batch never compiles a kernel on a request.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_slots, Hkv, D]
    v_ptr,
    o_ptr,  # [T, Hq, D], written directly when DIRECT_OUT
    mid_o_ptr,  # [B, Hq, num_splits, HEAD_DIM] float32, per-split normalised output
    mid_lse_ptr,  # [B, Hq, num_splits] float32, per-split log2-sum-exp2 of the scores
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    kv_lens_ptr,  # [B] int32
    sm_scale_log2,
    num_splits,  # runtime, not constexpr: it changes with the batch and would recompile the kernel each time
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # num_splits == 1: write the final output, no reduce kernel
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (B, Hkv, num_splits): one sequence's single query, all GROUP query heads of one KV head, one KV split.

    In a mixed batch the sequences with q_len != 1 belong to the extend kernel and are skipped here.
    """
    wait_for_predecessor(PDL)  # first: the early returns below must have waited too
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(cu_seqlens_q_ptr + seq)  # row of q/out holding this sequence's query
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - tok
    kv_len = tl.load(kv_lens_ptr + seq)
    # Per-sequence split length, BLOCK_N-aligned, so each sequence spreads over all splits whatever its length.
    split_len = (kv_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    if (start >= end) | (q_len != 1):
        # Empty split (short sequence; the reduce kernel skips it using the same formula) or not a decode row.
        return

    g = tl.arange(0, GROUP_PAD)  # GROUP_PAD >= 16 rows so tl.dot has a legal M; extra rows are masked
    g_ok = g < GROUP
    head = kv_head * GROUP + g  # [GROUP_PAD]
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        # The single query is the last position, so every key < kv_len is visible: only the length bound.
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, l_i, k_ptr, v_ptr, bt_row_ptr, tile, end, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, d, d_ok,
            PAGE, BLOCK_N, True, False,
        )  # fmt: skip
    out = acc / l_i[:, None]  # [GROUP_PAD, D_PAD]; l_i >= 1 for real rows since the split is non-empty

    if DIRECT_OUT:
        # Nothing to merge: write the final output and skip the reduce kernel.
        o_ptrs = o_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * NUM_HEADS + head) * num_splits + split  # [GROUP_PAD]
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    mid_o_ptr,  # [B, Hq, num_splits, HEAD_DIM] float32
    mid_lse_ptr,  # [B, Hq, num_splits] float32
    o_ptr,  # [T, Hq, D]
    cu_seqlens_q_ptr,  # [B + 1] int32
    kv_lens_ptr,  # [B] int32
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (B, Hq): merge one head's split partials, weighting each by exp2(lse_split - lse_max)."""
    wait_for_predecessor(PDL)  # first: the early returns below must have waited too
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) - tok != 1:
        return  # an extend row of a mixed batch
    kv_len = tl.load(kv_lens_ptr + seq)
    split_len = (kv_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N) * BLOCK_N  # as in the split kernel
    s = tl.arange(0, SPLITS_PAD)
    s_ok = (s < num_splits) & (s * split_len < kv_len)  # splits the split kernel actually wrote
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + s  # [SPLITS_PAD]
    lse = tl.load(mid_lse_ptr + row, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # Only an empty sequence (kv_len == 0) has no split; keep its output 0 instead of NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for skipped splits
    part = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(part * w[:, None], 0)  # [D_PAD]
    den = tl.sum(w, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _extend_num_splits(q_len, kv_len, total_tokens, num_kv_heads, max_splits, target_programs,
                       Q_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many of the launched KV splits a sequence uses: enough programs with work for the whole batch to reach
    `target_programs`, estimating the batch as total_tokens / q_len sequences like this one (a CUDA graph's
    launch is fixed for any batch it replays, so this is decided on the device), and no split shorter than a
    key tile. The extend kernel and its reduce compute it alike."""
    seqs = tl.maximum(total_tokens // q_len, 1)
    programs = seqs * num_kv_heads * ((q_len + Q_PER_PROG - 1) // Q_PER_PROG)
    splits = tl.maximum(target_programs // programs, 1)
    splits = tl.minimum(splits, (kv_len + BLOCK_N - 1) // BLOCK_N)
    return tl.maximum(tl.minimum(splits, max_splits), 1)


@triton.jit(do_not_specialize=["num_splits", "target_programs", "stride_bt"])
def _extend_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_slots, Hkv, D]
    v_ptr,
    o_ptr,  # [T, Hq, D]
    mid_o_ptr,  # [T, Hq, num_splits, HEAD_DIM] float32, only read with SPLIT
    mid_lse_ptr,  # [T, Hq, num_splits] float32
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    kv_lens_ptr,  # [B] int32
    sm_scale_log2,
    num_splits,  # launched splits (the grid); a sequence uses _extend_num_splits of them
    target_programs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_PER_PROG: tl.constexpr,  # BLOCK_M // GROUP queries per program
    SKIP_DECODE: tl.constexpr,  # q_len == 1 rows are left to the decode kernel (mixed batches)
    SPLIT: tl.constexpr,  # num_splits > 1: write per-split partials for _extend_reduce_kernel
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (B, Hkv, _extend_grid_work(...)): Q_PER_PROG new tokens x GROUP heads of one KV head, over one KV split.

    The BLOCK_M rows of the tile are (query, head) pairs, row = query_local * GROUP + g, so the K/V tile feeds
    all heads of the group at once. Keys are visited in two phases: tiles strictly before the first query's
    position need no mask (every row sees them), the rest up to the last query's position get the causal mask.
    A short suffix over a long prefix (a request returning from another model) has only a few such programs,
    each walking the whole prefix: with SPLIT the keys are divided among up to num_splits programs, as in
    decode; programs past a sequence's (query tile, split) pairs return at once, and a sequence that uses one
    split writes its output directly (no partials, no reduce).
    """
    wait_for_predecessor(PDL)  # first: the early returns below must have waited too
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    work = tl.program_id(2)
    # Every length this program needs, loaded at once: most programs of a graph's grid return after these.
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    total_tokens = tl.load(cu_seqlens_q_ptr + tl.num_programs(0))
    num_m = (q_len + Q_PER_PROG - 1) // Q_PER_PROG  # this sequence's query tiles
    if SPLIT:
        # The sequence's (query tile, split) pairs are numbered densely, so the grid needs only as many programs
        # as the busiest sequence has pairs (_extend_grid_work), not its longest suffix times the launched splits.
        # (a padding sequence, q_len 0, returns below: counted as one token here, so nothing divides by zero)
        used = _extend_num_splits(tl.maximum(q_len, 1), kv_len, total_tokens, tl.num_programs(1), num_splits,
                                  target_programs, Q_PER_PROG, BLOCK_N)
        split = work % used
        m_prog = work // used
    else:
        split = 0
        m_prog = work
    # Causal work grows with m_block: hand out the longest query tiles first so the short ones fill the tail.
    m_block = num_m - 1 - m_prog
    m_first = m_block * Q_PER_PROG  # first new token (index within the sequence's new tokens) of this program
    # The grid is sized for the busiest sequence; the others have nothing here.
    skip = m_prog >= num_m
    if SKIP_DECODE:
        # A single query would fill 1/Q_PER_PROG of the tile: the split-K decode kernel does it far cheaper.
        skip = skip | (q_len == 1)
    if skip:
        return
    prefix = kv_len - q_len  # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    m_idx = m_first + rows // GROUP  # [BLOCK_M] new-token index of each row
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head of each row
    # Rows past Q_PER_PROG * GROUP (when GROUP does not divide BLOCK_M) or past the sequence are padding.
    row_ok = (rows < Q_PER_PROG * GROUP) & (m_idx < q_len)
    q_pos = prefix + m_idx  # [BLOCK_M] absolute position; padding rows get larger ones and stay NaN-free
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = (q_start + m_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq * stride_bt

    m_last = tl.minimum(q_len, m_first + Q_PER_PROG) - 1
    # Keys below prefix + m_first are visible to every row: whole tiles there run unmasked.
    full_end = ((prefix + m_first) // BLOCK_N) * BLOCK_N
    # The last real query sees keys up to its own position; prefix + m_last + 1 <= kv_len.
    causal_end = prefix + m_last + 1
    if SPLIT:
        # This split's keys: a BLOCK_N-aligned share of the sequence (as in the decode kernel), so both phase
        # boundaries below stay tile-aligned. Rows may see no key here; the reduce kernel drops those splits.
        split_len = (kv_len + used * BLOCK_N - 1) // (used * BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, causal_end)
    else:
        lo = 0
        hi = causal_end
    for tile in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, bt_row_ptr, tile, full_end, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, d, d_ok,
            PAGE, BLOCK_N, False, False, SPLIT,
        )  # fmt: skip
    # Without splits the first masked tile starts at full_end <= prefix + m_first <= every row's q_pos, so each
    # row sees a key.
    for tile in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, bt_row_ptr, tile, hi, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, d, d_ok,
            PAGE, BLOCK_N, True, True, SPLIT,
        )  # fmt: skip
    if SPLIT:
        if used > 1:
            seen = l_i > 0.0
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            row = (tok * (tl.num_programs(1) * GROUP) + head) * num_splits + split  # [BLOCK_M] (token, head, split)
            tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
            tl.store(mid_lse_ptr + row, lse, mask=row_ok)
            return
    # Unsplit, or a sequence that uses one split (it walked every key, as unsplit): the output directly, and the
    # reduce leaves its rows alone. Each real row saw its own key, so l_i > 0.
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "target_programs"])
def _extend_reduce_kernel(
    mid_o_ptr,  # [T, Hq, num_splits, HEAD_DIM] float32
    mid_lse_ptr,  # [T, Hq, num_splits] float32
    o_ptr,  # [T, Hq, D]
    cu_seqlens_q_ptr,  # [B + 1]
    kv_lens_ptr,  # [B]
    num_seqs,  # B
    num_splits,
    target_programs,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    Q_PER_PROG: tl.constexpr,  # the extend kernel's, for _extend_num_splits
    BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """Grid (T, Hkv): one token's GROUP query heads of one KV head, every split's partial merged in one load
    (weights exp2(lse_split - lse_max)), as the decode reduce does. Only the rows of sequences the extend kernel
    split are touched (decode rows belong to the decode kernel; a sequence that uses one split got its output
    from the extend kernel; a graph's padding tokens belong to no sequence).

    One program per token rather than per query tile: merging the splits in a loop made each program wait for
    one load per split, and with few sequences that latency, not bandwidth, set the kernel's time. The grid runs
    over the batch's tokens, not (longest suffix x sequences): a graph's grid has to cover its longest possible
    suffix for every sequence, which was mostly programs that return (64 sequences x 128 tokens for at most 128
    tokens' work)."""
    wait_for_predecessor(PDL)  # first: the early returns below must have waited too
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The token's sequence: how many sequences end at or before it (cu_seqlens_q[1:] is non-decreasing).
    seq = num_seqs * 0  # (an int32 scalar, as the loop makes it)
    for b0 in range(0, num_seqs, _SEQ_CHUNK):
        b = b0 + tl.arange(0, _SEQ_CHUNK)
        ends = tl.load(cu_seqlens_q_ptr + 1 + b, mask=b < num_seqs, other=2147483647)
        seq += tl.sum((ends <= t).to(tl.int32), 0)
    if seq >= num_seqs:  # a padding token past every sequence
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if SKIP_DECODE:
        if q_len == 1:
            return
    total_tokens = tl.load(cu_seqlens_q_ptr + num_seqs)
    used = _extend_num_splits(q_len, tl.load(kv_lens_ptr + seq), total_tokens, tl.num_programs(1), num_splits,
                              target_programs, Q_PER_PROG, BLOCK_N)
    if used == 1:  # the extend kernel wrote this sequence's output itself
        return
    tok = t.to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kv_head * GROUP + g  # [GROUP_PAD]
    row = (tok * (tl.num_programs(1) * GROUP) + head)[:, None] * num_splits + s[None, :]  # [GROUP_PAD, SPLITS_PAD]
    row_ok = g_ok[:, None] & (s < used)[None, :]  # the splits the extend kernel wrote
    # Every real row saw its own position's key in some split, so lse_max is finite; splits a row saw nothing
    # of carry lse = -inf and weigh 0.
    lse = tl.load(mid_lse_ptr + row, mask=row_ok, other=float("-inf"))
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # padding heads: keep them NaN-free
    w = tl.exp2(lse - lse_max[:, None])  # [GROUP_PAD, SPLITS_PAD]
    part = tl.load(mid_o_ptr + row[:, :, None] * HEAD_DIM + d[None, None, :],
                   mask=row_ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [GROUP_PAD, SPLITS_PAD, D_PAD]
    num = tl.sum(part * w[:, :, None], 1)  # [GROUP_PAD, D_PAD]
    den = tl.sum(w, 1)
    out = num / tl.where(den > 0.0, den, 1.0)[:, None]
    o_ptrs = o_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@dataclass
class _TritonState:
    """Per-batch launch parameters, computed once on the host from the CPU length lists (no device sync)."""

    num_decode: int  # sequences with q_len == 1 (decode kernel)
    num_extend: int  # sequences with q_len > 1 (extend kernel)
    max_decode_kv_len: int
    max_extend_q_len: int
    max_extend_kv_len: int = 0
    # A CUDA graph's batch: lengths are unknown on the host, so the extend launches as many KV splits as a
    # sequence could use (_extend_launch_bound) and each sequence decides on the device how many it uses.
    in_graph: bool = False
    # The fewest new tokens a batch this graph replays has: bounds how many extend splits any of its sequences
    # can use.
    min_tokens: int = 1
    # Split scratch reused by every layer of the step (`_split_scratch`).
    scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _split_scratch(
    state: _TritonState, kernel: str, rows: int, num_heads: int, splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs [rows, Hq, splits, D] and log-sum-exps [rows, Hq, splits] (float32), allocated
    once per step and shape and shared by every layer."""
    key = (kernel, rows, num_heads, splits, head_dim, device)
    if key not in state.scratch:
        state.scratch[key] = (
            torch.empty(rows, num_heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, num_heads, splits, dtype=torch.float32, device=device),
        )
    return state.scratch[key]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _extend_launch_bound(target_programs: int, num_kv_heads: int, min_tokens: int, q_per_prog: int) -> int:
    """The most KV splits any sequence of a batch of at least `min_tokens` new tokens uses on the device: with
    suffix q, _extend_num_splits counts (tokens // q) * cdiv(q, q_per_prog) > tokens / (2 * q_per_prog) programs
    per KV head. Launching no more keeps a graph's grid (sized for its longest suffix and most sequences) from
    being mostly programs that return at once; fewer would only cost speed (the device clamps to the launch)."""
    return triton.cdiv(target_programs, num_kv_heads * max(1, min_tokens // (2 * q_per_prog)))


def _extend_grid_work(max_m: int, splits: int, target_programs: int, num_kv_heads: int) -> int:
    """Programs per (sequence, KV head) of a split extend launch: the most (query tile, split) pairs any sequence
    has. A sequence of m <= `max_m` query tiles uses at most `splits` splits, and past one split at most
    target_programs // (its estimated sequences x num_kv_heads x m) of them (_extend_num_splits, the estimate at
    least 1): m x splits pairs, at most max(m, target_programs // num_kv_heads). A graph's grid, sized for its
    longest possible suffix, is then ~2.5x smaller than max_m x splits (e.g. 33 against 88 programs for 64
    tokens of 8 query tiles and 11 splits), and its padding sequences, which return at once, cost that much less."""
    return max(1, min(max_m * splits, max(max_m, target_programs // num_kv_heads)))


class TritonAttention(AttentionBackend):
    """Paged attention with Triton kernels: split-K decode for q_len == 1 rows, tiled causal extend for the rest.

    A pure decode batch launches only the decode kernels, a batch without decode rows only the extend kernel;
    a mixed batch launches both over all sequences and each kernel skips the other's rows on the device.

    Tile sizes and the number of decode splits default to GPU heuristics; tests pass small ones so that tile
    and split boundaries are exercised on tiny shapes under the interpreter.
    """

    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self,
        decode_block_n: int | None = None,
        extend_block_m: int | None = None,
        extend_block_n: int | None = None,
        num_kv_splits: int | None = None,
    ) -> None:
        for v in (decode_block_n, extend_block_m, extend_block_n):
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"tile sizes must be powers of two >= 16 (tl.dot operand minimum), got {v}")
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        self.num_kv_splits = num_kv_splits
        self._num_sms: dict[torch.device, int] = {}
        # While `precompile` runs: the variants compiled so far (`_launch` compiles, launches nothing); else None.
        self._compile_only: set[tuple] | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        dec_kv = [kv for q, kv in zip(batch.q_lens_cpu, batch.kv_lens_cpu) if q == 1]
        ext_q = [q for q in batch.q_lens_cpu if q != 1]
        batch.attn_state = _TritonState(
            num_decode=len(dec_kv),
            num_extend=len(ext_q),
            max_decode_kv_len=max(dec_kv, default=0),
            max_extend_q_len=max(ext_q, default=0),
            max_extend_kv_len=max((kv for q, kv in zip(batch.q_lens_cpu, batch.kv_lens_cpu) if q != 1), default=0),
        )

    def graph_context_bounds(self, max_model_len: int) -> list[int]:
        """Shorter context bounds than `max_model_len` for which an extend graph launches differently (one KV split
        at most _UNSPLIT_EXTEND_CONTEXT keys)."""
        return [_UNSPLIT_EXTEND_CONTEXT] if _UNSPLIT_EXTEND_CONTEXT < max_model_len else []

    def graph_state(self, num_seqs: int, num_tokens: int, has_extend: bool, max_kv_len: int,
                    min_tokens: int = 1) -> _TritonState:
        # Every row may be a decode row (the decode grid covers all sequences and skips the others on the
        # device); the extend grid is sized for the longest possible suffix. Decode splits are picked for the
        # longest context, so short ones leave most splits empty (those programs return at once); the extend's
        # are decided per sequence on the device (_extend_num_splits).
        return _TritonState(
            num_decode=num_seqs,
            num_extend=1 if has_extend else 0,
            max_decode_kv_len=max_kv_len,
            max_extend_q_len=num_tokens,
            max_extend_kv_len=max_kv_len,
            in_graph=True,
            min_tokens=min_tokens,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,  # [num_slots, Hkv, D]
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D] in q's dtype
        state = batch.attn_state
        if not isinstance(state, _TritonState):
            self.prepare(batch)
            state = batch.attn_state
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
        if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
            raise ValueError("k_cache and v_cache must have the same dtype and shape")
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            # Copying the pool to fix its layout would cost more than the attention itself.
            raise ValueError("the KV pool must be contiguous along head_dim")
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
        if state.num_decode:
            self._decode(q, k_cache, v_cache, out, batch, state, scale)
        if state.num_extend:
            self._extend(q, k_cache, v_cache, out, batch, state, scale)
        return out

    def precompile(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                   scale: float) -> int:
        """Every variant a step can launch, compiled before serving: decode with one split (direct output)
        and with each power-of-two split count (the reduce's SPLITS_PAD), extend with and without decode rows
        beside it (SKIP_DECODE) and with and without splits. `batch` gives the tensors' types and layouts (the
        eager path's: graphs, whose lengths are int64 and whose short extends take their own tile, compile their
        variants when they are captured, before serving too); nothing is launched."""
        # A few rows are enough (a variant does not depend on the row count) and keep the extend's split scratch
        # under its byte cap, which would otherwise hold a large batch of a wide model at one split and leave
        # the split variants uncompiled.
        q = q[:16]
        seqs, tokens = batch.num_seqs, q.shape[0]
        counts = sorted({1} | {1 << i for i in range(1, _MAX_KV_SPLITS.bit_length())})
        forced, self.num_kv_splits = self.num_kv_splits, None
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self._compile_only = set()
        try:
            for splits in counts:
                self.num_kv_splits = splits
                for num_decode, num_extend in ((seqs, 0), (0, seqs), (seqs, seqs)):
                    state = _TritonState(num_decode=num_decode, num_extend=num_extend, max_decode_kv_len=1 << 20,
                                         max_extend_q_len=tokens, max_extend_kv_len=1 << 20)
                    if num_decode:
                        self._decode(q, k_cache, v_cache, out, batch, state, scale)
                    if num_extend:
                        self._extend(q, k_cache, v_cache, out, batch, state, scale)
            return len(self._compile_only)
        finally:
            self._compile_only, self.num_kv_splits = None, forced

    def _launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Run `kernel`, or only compile it for these arguments while `precompile` runs (counting variants)."""
        kwargs.update(pdl.launch_args(args[0].device))  # (every kernel's first argument is on the launch's device)
        if self._compile_only is None:
            kernel[grid](*args, **kwargs)
            return
        kernel.warmup(*args, grid=grid, **kwargs)
        self._compile_only.add((getattr(kernel, "__name__", repr(kernel)), tuple(sorted(kwargs.items()))))

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            if device.type == "cuda":
                self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                # Interpreter on the CPU: the split count only matters for correctness coverage there.
                self._num_sms[device] = 4
        return self._num_sms[device]

    def _pick_num_splits(self, device: torch.device, num_seqs: int, num_kv_heads: int, max_kv_len: int,
                         round_down: bool = False) -> int:
        """Splits to launch: enough (sequence, KV head, split) programs to fill every SM, without splits too short
        to pay off. `round_down` (decode): no more programs than the target, since rounding up adds a partial last
        round of them (perf/results/decode_splits_h200_2026-12-03: Qwen3 decoding 8 sequences over 8k keys, 9
        splits 80-83 us a layer, 8 splits 70-73 us). A CUDA graph's padded batch counts its padding (12 sequences
        in a 16-row graph: 4 splits where 5 measured 3-6 % faster); counting the rows on the device cost up to
        ~1 us a layer at short contexts. Eager extends (not measured that way) keep rounding up."""
        if self.num_kv_splits is not None:
            return max(1, self.num_kv_splits)
        target = _PROGRAMS_PER_SM * self._sm_count(device)
        per_split = num_seqs * num_kv_heads
        want = target // per_split if round_down else triton.cdiv(target, per_split)
        worth = triton.cdiv(max_kv_len, _MIN_TOKENS_PER_SPLIT)
        return max(1, min(want, worth, _MAX_KV_SPLITS))

    def _decode_config(self, d_pad: int) -> dict[str, int]:
        """Key tile and launch shape of the split kernel (memory bound: 3 stages keep K/V loads in flight).

        Picked from a sweep on an H200 (triton 3.6, bf16, Hq=32 Hkv=8 D=128, page 16) over BLOCK_N 32..128,
        2..8 warps, 1..3 stages.
        """
        return {"BLOCK_N": self.decode_block_n or (64 if d_pad <= 128 else 32), "num_warps": 4, "num_stages": 3}

    def _extend_config(self, d_pad: int, elem_size: int, short: bool) -> dict[str, int]:
        """Row/key tiles and launch shape of the extend kernel.

        Prefill and long extends, from the same H200 sweep: 128 rows x 32 keys, 4 warps, 2 stages was the best
        geometric mean over prefill/extend/mixed batches and needs little shared memory (2 x 8 KiB per K/V
        stage), so it also fits smaller GPUs. `short`: the graphs of short suffixes over a cached prefix (what a
        request returning from another model brings), which read far more keys than they have queries: 64 x 64
        tiles, 3 % from the best configuration per case on geometric mean (9 % in the worst) for Qwen3-0.6B and
        -32B, 1-12 requests x 10 tokens over 1k and 8k tokens (perf/results/attention_h200_2026-12-02). float32
        or head_dim > 128 get smaller tiles to keep the accumulator in registers and the K/V stages in shared
        memory."""
        big = d_pad <= 128 and elem_size <= 2
        return {
            "BLOCK_M": self.extend_block_m or (64 if short or not big else 128),
            "BLOCK_N": self.extend_block_n or (64 if short and big else 32),
            "num_warps": 4,
            "num_stages": 2,
        }

    def _decode(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,
        out: torch.Tensor,  # [T, Hq, D]
        batch: ForwardBatch,
        state: _TritonState,
        scale: float,
    ) -> None:
        B = batch.num_seqs
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        d_pad = max(16, _next_pow2(head_dim))
        cfg = self._decode_config(d_pad)
        splits = self._pick_num_splits(q.device, state.num_decode, num_kv_heads, state.max_decode_kv_len,
                                       round_down=True)
        mid_o = mid_lse = out  # with one split the kernel writes `out` directly, never the scratch
        if splits > 1:
            mid_o, mid_lse = _split_scratch(state, "decode", B, num_heads, splits, head_dim, q.device)
        # Grid over all B sequences: in a mixed batch the extend rows' programs return at once.
        self._launch(_decode_split_kernel, (B, num_kv_heads, splits),
            q, k_cache, v_cache, out, mid_o, mid_lse, batch.block_tables, batch.cu_seqlens_q, batch.kv_lens,
            scale * _LOG2E, splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), batch.block_tables.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group,
            GROUP_PAD=max(16, _next_pow2(group)), PAGE=batch.block_size, DIRECT_OUT=splits == 1, **cfg,
        )  # fmt: skip
        if splits > 1:
            self._launch(_decode_reduce_kernel, (B, num_heads),
                mid_o, mid_lse, out, batch.cu_seqlens_q, batch.kv_lens, splits, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=cfg["BLOCK_N"],
                SPLITS_PAD=_next_pow2(splits),
                num_warps=4, num_stages=1,
            )  # fmt: skip

    def _extend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,
        out: torch.Tensor,  # [T, Hq, D]
        batch: ForwardBatch,
        state: _TritonState,
        scale: float,
    ) -> None:
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        d_pad = max(16, _next_pow2(head_dim))
        short = state.in_graph and state.max_extend_q_len <= _SHORT_EXTEND_TOKENS
        cfg = self._extend_config(d_pad, k_cache.element_size(), short)
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], _next_pow2(group))  # at least one query (all its heads) per program
        q_per_prog = cfg["BLOCK_M"] // group
        num_m = triton.cdiv(state.max_extend_q_len, q_per_prog)
        per_split = q.shape[0] * num_heads * (head_dim + 1) * 4  # float32 partial output + lse per split
        if self.num_kv_splits is not None:
            splits, target = max(1, self.num_kv_splits), _EVERY_SPLIT
        elif state.in_graph and state.max_extend_kv_len <= _UNSPLIT_EXTEND_CONTEXT:
            splits, target = 1, _EVERY_SPLIT  # (a graph replayed only by batches of short contexts)
        elif state.in_graph:
            # A graph replays batches whose lengths the host never sees: each sequence decides on the device how
            # many of the launched splits it uses (_extend_num_splits).
            target = _EXTEND_PROGRAMS_PER_SM * self._sm_count(q.device)
            splits = min(_extend_launch_bound(target, num_kv_heads, state.min_tokens, q_per_prog),
                         triton.cdiv(state.max_extend_kv_len, cfg["BLOCK_N"]))  # fmt: skip
        else:
            # Eager batches (those no graph holds: more tokens than the largest extend graph, chunks of a prompt
            # that do not sample): the host sees every length and picks one split count for the batch, as for
            # decode.
            splits = self._pick_num_splits(q.device, state.num_extend * num_m, num_kv_heads, state.max_extend_kv_len)
            target = _EVERY_SPLIT
        splits = max(1, min(splits, _MAX_EXTEND_SPLITS, _MAX_EXTEND_SCRATCH_BYTES // per_split))
        skip_decode = state.num_decode > 0
        mid_o = mid_lse = out  # never read without SPLIT
        if splits > 1:
            mid_o, mid_lse = _split_scratch(state, "extend", q.shape[0], num_heads, splits, head_dim, q.device)
        work = _extend_grid_work(num_m, splits, target, num_kv_heads) if splits > 1 else num_m
        self._launch(_extend_kernel, (batch.num_seqs, num_kv_heads, work),
            q, k_cache, v_cache, out, mid_o, mid_lse, batch.block_tables, batch.cu_seqlens_q, batch.kv_lens,
            scale * _LOG2E, splits, target,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), batch.block_tables.stride(0),
            HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, PAGE=batch.block_size,
            Q_PER_PROG=q_per_prog, SKIP_DECODE=skip_decode, SPLIT=splits > 1, **cfg,
        )  # fmt: skip
        if splits > 1:
            splits_pad, group_pad = _next_pow2(splits), _next_pow2(group)
            # One reduce program per (token, KV head); tokens on the grid's first axis, the only one without a
            # 65,535 limit.
            self._launch(_extend_reduce_kernel, (q.shape[0], num_kv_heads),
                mid_o, mid_lse, out, batch.cu_seqlens_q, batch.kv_lens, batch.num_seqs, splits, target, out.stride(0),
                out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, GROUP_PAD=group_pad,
                SPLITS_PAD=splits_pad, Q_PER_PROG=q_per_prog, BLOCK_N=cfg["BLOCK_N"], SKIP_DECODE=skip_decode,
                # 8 warps once the merged tile has 16K elements: 64 float32 registers per thread instead of 128.
                num_warps=8 if group_pad * splits_pad * d_pad >= 16384 else 4, num_stages=1,
            )  # fmt: skip
