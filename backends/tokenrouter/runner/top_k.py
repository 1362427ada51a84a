"""The k largest logits of each row, sorted, by a radix select over bfloat16 keys, in three Triton kernels.

A learned router (R2R) reads the top-100 logits of every row the small model decodes, inside its CUDA graph. torch's
topk over a [S, 151936] row is a multi-block radix select: about ten kernels (digit counts and prefix sums per
pass, a gather, a sort), ~40 us of a 0.6B step on an H200 (perf/results/router_skinny_h200_2026-12-02), and
beside the 32B every kernel also waits for SMs. The logits are a bfloat16 model's, widened to float32, so each is
one of 65,536 keys. Here, over chunks of a row in parallel:

1. `_high_byte_kernel`: a histogram of the keys' high bytes; the row's last chunk to finish finds the bucket B
   that holds the k-th largest key and how many keys lie above it.
2. `_low_byte_kernel`: a histogram of the low bytes of the keys in B; the last chunk finds the k-th largest key T
   itself and the count G (< k) of keys above T.
3. `_gather_kernel`: the keys above T go to a row's slots (fewer than k); the last chunk fills the rest with T,
   sorts the keys and writes their values.

The values only (R2R reads no indices), bit for bit torch.topk(..., sorted=True).values, -inf, +inf and NaN
included (every NaN sorts above +inf, as in torch; -0.0 sorts below +0.0, which torch takes as equal). Every count
a kernel uses is zeroed again by the program that used it last, so the workspace is reusable across launches and
graph replays without a memset. Tested on the CPU under TRITON_INTERPRET=1 (tests/test_top_k.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 128  # the slots a row gathers into; a larger k takes torch.topk
# Keys per program. On an H100 a pass took 9-13 us at 4,096 keys a program and 9-12 us at 1,024: each is a chain
# of dependent steps (load, histogram, atomics, the arrival count, the last program's scan), not the keys' work.
CHUNK = 1024
TOP_K_ROWS = 1024  # rows a policy's workspace holds (a step with more takes torch.topk)
_BINS = 256  # a byte of the 16-bit keys a pass
# A row's int32 state: 0-2 the three kernels' arrival counters, 3 the slot counter (zero between launches), then
# written by the kernels in turn: 4 the bucket B, 5 the count of keys above B, 6 the key T, 7 the count G above T.
_STATE = 8
_NAN_KEY = tl.constexpr(0xFFFF)  # every NaN, above +inf's 0xFF80 as torch.topk ranks NaN


@triton.jit
def _keys(logits_ptr, stride, row, chunk, V, CHUNK: tl.constexpr):
    """This program's keys (int32 in [0, 65536), order-preserving: larger logit, larger key) and which lanes hold
    one. A logit's bfloat16 bits: the sign bit flipped for positives, every bit for negatives; NaN the largest."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=0.0)
    bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # exact: bfloat16 values
    keys = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
    return tl.where(x != x, _NAN_KEY, keys), valid


@triton.jit
def _masked_histogram(values, keep, n_keep, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Counts of `values` where `keep`: the rest are counted in bin 0 and taken off it again."""
    hist = tl.histogram(tl.where(keep, values, 0), BINS)
    return hist - tl.where(tl.arange(0, BINS) == 0, CHUNK - n_keep, 0)


@triton.jit
def _last_to_arrive(state_ptr, column, num_chunks):
    """Whether this program is the row's last to finish this kernel (its stores and atomics before the count);
    then the counter is zeroed for the next launch."""
    # Every thread's stores and atomics before the one acq_rel count: the last program sees all of them. (So the
    # histogram's own atomics need no ordering of their own: relaxed.)
    tl.debug_barrier()
    last = tl.atomic_add(state_ptr + column, 1) == num_chunks - 1
    if last:
        tl.atomic_xchg(state_ptr + column, 0)
    return last


@triton.jit
def _kth_bin(hist, above, k, BINS: tl.constexpr):
    """Given a histogram over bins of keys and the count `above` of keys above all of them: the bin holding the
    k-th largest key, and the count of keys above that bin."""
    bins = tl.arange(0, BINS)
    total = tl.sum(hist, axis=0)
    over = above + total - tl.cumsum(hist, axis=0)  # keys above each bin
    kth = tl.max(tl.where(over + hist >= k, bins, -1), axis=0)
    return kth, tl.sum(tl.where(bins == kth, over, 0), axis=0)


@triton.jit
def _high_byte_kernel(logits_ptr, stride, V, k, hist_ptr, state_ptr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                      STATE: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    keys, valid = _keys(logits_ptr, stride, row, chunk, V, CHUNK)
    hist = _masked_histogram(keys >> 8, valid, tl.sum(valid.to(tl.int32), axis=0), CHUNK, BINS)
    row_hist = hist_ptr + row * BINS + tl.arange(0, BINS)
    # Logits crowd a few high bytes: most bins are empty and add nothing.
    tl.atomic_add(row_hist, hist, mask=hist != 0, sem="relaxed")
    state = state_ptr + row * STATE
    if _last_to_arrive(state, 0, tl.num_programs(1)):
        # Read at L2 and zeroed for the next launch in one.
        hist = tl.atomic_xchg(row_hist, tl.zeros([BINS], tl.int32), sem="relaxed")
        bucket, above = _kth_bin(hist, 0, k, BINS)
        tl.store(state + 4, bucket)
        tl.store(state + 5, above)


@triton.jit
def _low_byte_kernel(logits_ptr, stride, V, k, hist_ptr, state_ptr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                     STATE: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    state = state_ptr + row * STATE
    bucket = tl.load(state + 4)
    keys, valid = _keys(logits_ptr, stride, row, chunk, V, CHUNK)
    keep = valid & ((keys >> 8) == bucket)
    hist = _masked_histogram(keys & 0xFF, keep, tl.sum(keep.to(tl.int32), axis=0), CHUNK, BINS)
    row_hist = hist_ptr + row * BINS + tl.arange(0, BINS)
    tl.atomic_add(row_hist, hist, mask=hist != 0, sem="relaxed")  # only keys in B: most programs add nothing
    if _last_to_arrive(state, 1, tl.num_programs(1)):
        hist = tl.atomic_xchg(row_hist, tl.zeros([BINS], tl.int32), sem="relaxed")
        low, above = _kth_bin(hist, tl.load(state + 5), k, BINS)
        tl.store(state + 6, bucket * BINS + low)
        tl.store(state + 7, above)


@triton.jit
def _gather_kernel(logits_ptr, stride, V, k, slots_ptr, state_ptr, out_ptr, stride_out, CHUNK: tl.constexpr,
                   MAX_K: tl.constexpr, STATE: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    state = state_ptr + row * STATE
    kth = tl.load(state + 6)
    keys, valid = _keys(logits_ptr, stride, row, chunk, V, CHUNK)
    keep = valid & (keys > kth)
    n_keep = tl.sum(keep.to(tl.int32), axis=0)
    row_slots = slots_ptr + row * MAX_K
    if n_keep > 0:  # fewer than k in the whole row
        first = tl.atomic_add(state + 3, n_keep, sem="relaxed")
        at = first + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        # Keys above kth are the row's largest, in any slot order. (`at < MAX_K` always holds: G < k <= MAX_K.)
        tl.store(row_slots + at, keys, mask=keep & (at < MAX_K))
    if _last_to_arrive(state, 2, tl.num_programs(1)):
        tl.atomic_xchg(state + 3, 0)
        lanes = tl.arange(0, MAX_K)
        above = tl.load(state + 7)
        top = tl.load(row_slots + lanes, mask=lanes < above, other=0, cache_modifier=".cg")
        # Sorted as integer keys: exact, where a float sort would lose NaNs and swap zeros.
        top = tl.sort(tl.where(lanes < above, top, kth), descending=True)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + lanes, _value(top), mask=lanes < k)


@triton.jit
def _value(keys):
    """float32 logits of int32 keys (the inverse of `_keys`; NaN's key gives a NaN)."""
    bits = tl.where(keys >= 0x8000, keys ^ 0x8000, keys ^ 0xFFFF)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)


class TopKWorkspace:
    """Per-row histograms, counters and slots for up to `max_rows` rows (zero between launches)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.hist = torch.zeros(max_rows, _BINS, dtype=torch.int32, device=device)
        self.state = torch.zeros(max_rows, _STATE, dtype=torch.int32, device=device)
        self.slots = torch.zeros(max_rows, MAX_K, dtype=torch.int32, device=device)

    def fits(self, rows: int, k: int) -> bool:
        return 0 < rows <= self.max_rows and 0 < k <= MAX_K


def top_k_values(logits: torch.Tensor, k: int, workspace: TopKWorkspace) -> torch.Tensor:
    """[S, V] logits whose values are bfloat16's (float32 or bfloat16) -> [S, k] float32, each row's k largest in
    descending order. Needs workspace.fits(S, k) and k <= V."""
    rows, vocab = logits.shape
    if not workspace.fits(rows, k) or k > vocab or logits.stride(-1) != 1:
        raise ValueError(f"top_k_values: {rows} rows, k={k}, vocabulary {vocab} do not fit the kernel's workspace "
                         f"({workspace.max_rows} rows, k <= {MAX_K}, unit stride)")
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.device != workspace.hist.device:
        raise ValueError(f"top_k_values: {logits.dtype} logits on {logits.device}; the keys are bfloat16's "
                         f"(float32 or bfloat16 logits) on the workspace's device, {workspace.hist.device}")
    out = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    grid = (rows, triton.cdiv(vocab, CHUNK))
    args = (logits, logits.stride(0), vocab, k)
    _high_byte_kernel[grid](*args, workspace.hist, workspace.state, CHUNK=CHUNK, BINS=_BINS, STATE=_STATE)
    _low_byte_kernel[grid](*args, workspace.hist, workspace.state, CHUNK=CHUNK, BINS=_BINS, STATE=_STATE)
    _gather_kernel[grid](*args, workspace.slots, workspace.state, out, out.stride(0), CHUNK=CHUNK, MAX_K=MAX_K,
                         STATE=_STATE)
    return out
