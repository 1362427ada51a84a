"""What programmatic dependent launch saves between dependent kernels in a captured CUDA graph (runner/pdl.py).

    python perf/bench_pdl.py [--kernels 200]

A graph of N launches of one tiny kernel, each reading the value the previous one wrote, timed (CUDA events, median
of 20 replays) with PDL off, with PDL as the runner's kernels use it (the successor launches as this kernel's
programs exit), and with each kernel releasing its successor early, right after its own wait
(`gdc_launch_dependents`, which the runner does not do: on real kernels the early successor's programs sit
resident beside the running ones, perf/results/pdl_h200_2026-12-02): the per-link cost of a chain, which a small
model's decode step has ~200 of.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))
sys.path.insert(0, str(ROOT / "perf"))
from bench_runner import median_gpu_seconds  # noqa: E402

from tokenrouter.runner import pdl  # noqa: E402
from tokenrouter.runner.pdl import wait_for_predecessor  # noqa: E402


@triton.jit
def _link(src, dst, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_predecessor(PDL)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i) + 1)


def chain_us(n: int, programs: int, release: str | None) -> float:
    """Microseconds per link; release None: no PDL, "exit" or "early"."""
    pdl.ENABLED = release is not None
    a = torch.zeros(programs * 128, device="cuda")
    b = torch.zeros_like(a)
    args = {**pdl.launch_args(a.device), "EARLY": release == "early"}

    def run() -> None:
        for i in range(n):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _link[(programs,)](src, dst, BLOCK=128, **args)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.synchronize()
    a.zero_()
    b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert float(a[0] if n % 2 == 0 else b[0]) == n, "a link read a stale value"
    return median_gpu_seconds(graph.replay, iters=20, warmup=3) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not pdl.enabled(torch.device("cuda", 0)):
        print("needs a GPU and Triton with PDL (sm_90+)", file=sys.stderr)
        return 2
    print("| programs per kernel | PDL off us/link | PDL (release at exit) | PDL, early release |\n|---|---|---|---|")
    for programs in (1, 132, 264):
        row = [chain_us(args.kernels, programs, r) for r in (None, "exit", "early")]
        print(f"| {programs} | " + " | ".join(f"{t:.2f}" for t in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
