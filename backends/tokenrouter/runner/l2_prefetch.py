"""The next matmul's weight asked into L2 on a side stream while the chain runs (a small model's CUDA graphs).

A small model's decode step is a chain of short matmuls, each streaming its weight from HBM after the one before
has finished. Each pays the memory's latency afresh and never has enough bytes in flight: on an H100 the Qwen3-0.6B's
matmuls at 8 rows take ~3.4 us plus ~2.6 TB/s of streaming (perf/results/h100_table_2026-12-05), a layer ~27 us
against its ~9 us of weights at full bandwidth. A weight depends on nothing the chain computes, so while matmul j
runs, a kernel on a second stream asks the L2 for matmul j + `distance`'s weight: one `prefetch.global.L2`
instruction per 128-byte line, which holds no register or shared memory and returns at once; the lines arrive while
the chain works, and the matmul reads them from L2.

Only where it can pay: CUDA graphs being captured (an eager step is bound by the host's launches, and a launch per
matmul would add to them), weights of at most a third of the L2 each (the 0.6B's largest, gate/up, is 12.6 MB of
an H100's or H200's 50 MB; the 32B's do not fit and stream at ~3.8 TB/s anyway). The results are unchanged bit for
bit: a prefetch moves no data anyone reads, it only warms the cache.

`TOKENROUTER_L2_PREFETCH`: `off` (default until a GPU measures it faster), `last` (the lines are kept ahead of
others, so that the attention's stream of K/V or another model's matmuls do not push them out before their matmul
runs) or `normal` (plain priority).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MODES = ("last", "normal", "off")
MODE = os.environ.get("TOKENROUTER_L2_PREFETCH", "off").strip().lower()
if MODE not in MODES:
    raise ValueError(f"TOKENROUTER_L2_PREFETCH must be one of {', '.join(MODES)}, got {MODE!r}")
LINE_BYTES = 128  # an L2 cache line
_LINES_PER_PROGRAM = 1024  # 8 prefetches per thread at 4 warps: a program issues them and is gone
# A weight this share of the L2 or less is prefetched: the matmul running holds its own weight there too, and the
# attention streams K/V through it.
_L2_SHARE = 1 / 3
# How many matmuls ahead of the running one a weight is asked for: one matmul's time (5-8 us) covers fetching the
# next one's weight at the memory's bandwidth.
DISTANCE = int(os.environ.get("TOKENROUTER_L2_PREFETCH_DISTANCE", "1"))


@triton.jit(do_not_specialize=["num_lines"])
def _prefetch_kernel(base, num_lines, LINES: tl.constexpr, LINE: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask the L2 for lines [program * LINES, ...) of the bytes at address `base` (an int: no pointer is loaded)."""
    i = tl.program_id(0) * LINES + tl.arange(0, LINES)
    i = tl.minimum(i, num_lines - 1)  # the last program's spare lanes ask for the last line again: never past it
    addr = base + i.to(tl.int64) * LINE
    # Not pure: the instruction's effect is on the cache, and its unused result must not let the compiler drop it.
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, evict_last: bool = True) -> None:
    """Ask the L2 for the bytes of contiguous CUDA tensor `t`, on the current stream."""
    if not t.is_contiguous():
        raise ValueError("prefetch takes a contiguous tensor")
    lines = (t.numel() * t.element_size() + LINE_BYTES - 1) // LINE_BYTES
    if lines == 0:
        return
    grid = (triton.cdiv(lines, _LINES_PER_PROGRAM),)
    _prefetch_kernel[grid](t.data_ptr(), lines, LINES=_LINES_PER_PROGRAM, LINE=LINE_BYTES, EVICT_LAST=evict_last,
                           num_warps=4)


def fits(weights: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Every weight is at most `_L2_SHARE` of `device`'s L2 (false off CUDA)."""
    if device.type != "cuda" or not weights:
        return False
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return all(w.numel() * w.element_size() <= l2 * _L2_SHARE for w in weights)


class WeightPrefetcher:
    """Prefetches `weights[j + distance]` when the chain is about to launch matmul j (`before(j)`), on a stream of
    its own that forks from the chain there, so the prefetch starts once matmul j - 1 has finished; `join` makes the
    chain wait for it again (a CUDA graph's capture must end on its origin stream). Active only while the current
    stream is capturing a CUDA graph."""

    def __init__(self, weights: Sequence[torch.Tensor], device: torch.device, distance: int | None = None,
                 evict_last: bool | None = None) -> None:
        distance = DISTANCE if distance is None else distance
        if distance < 1:
            raise ValueError(f"distance must be >= 1, got {distance}")
        self.weights = list(weights)
        self.device = device
        self.distance = distance
        self.evict_last = MODE == "last" if evict_last is None else evict_last
        self._stream: torch.cuda.Stream | None = None
        self._forked = False
        self._active = False

    def begin(self) -> None:
        """The chain is about to start: active for this pass if capturing; asks for the first `distance` weights."""
        self._active = MODE != "off" and self._capturing()
        for j in range(min(self.distance, len(self.weights))):
            self._ask(j)

    def before(self, j: int) -> None:
        """Matmul j is launched next on the current stream."""
        if j + self.distance < len(self.weights):
            self._ask(j + self.distance)

    def join(self) -> None:
        """The current stream waits for every prefetch issued (once per pass, after the last matmul)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._forked = False
        self._active = False

    def _ask(self, j: int) -> None:
        if self._active:
            self._issue(j)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _issue(self, j: int) -> None:
        """Fork from the current stream, prefetch weight j on the side stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            prefetch(self.weights[j], self.evict_last)
        self._forked = True
