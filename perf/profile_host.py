"""Where an eager step's host time goes: the Python side of steps that do not replay a CUDA graph.

    python perf/profile_host.py --model qwen3-0.6b [--cases decode:8:1,prefill:1:100] [--top 25]

Eager steps (prefills, mixed batches, extends longer than the captured shapes) launch every kernel from
Python. For each case (KIND:BATCH:NEW, over 1k cached tokens for decode/extend) this prints the step's time
(CUDA events around the whole call, as bench_runner), the host's share (the call's wall time until it
returns, without waiting for the GPU), the number of kernel launches (torch.profiler), and the Python
functions that took the host's time (cProfile over a few steps, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import ROOT, make_chunks, median_gpu_seconds, release  # noqa: E402

from tokenrouter.config import ModelConfig  # noqa: E402
from tokenrouter.engine.block_manager import BlockManager  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402


def host_seconds(fn, iters: int) -> float:
    """Median wall seconds until `fn()` returns (the GPU drained before each call, not waited for after)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def kernel_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Kernels only: the step's host-to-device copies and fills are CUDA events too.
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--cases", default="decode:8:1,extend:4:40,prefill:1:100,prefill:4:100",
                    help="KIND:BATCH:NEW, comma-separated (prefill: no cached context; others: 1k cached)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--skinny-gemm", default="on", choices=["on", "off"])
    args = ap.parse_args()
    cfg = ModelConfig(name=args.model, path=str(ROOT / "perf" / "models" / args.model), dtype="bfloat16",
                      device="cuda:0", load_format="dummy", kv_cache_tokens=100_000, max_model_len=8192,
                      skinny_gemm=args.skinny_gemm == "on", enforce_eager=True)
    runner = ModelRunner(cfg, default_kv_tokens=0)
    runner.setup_step(None)
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    vocab = runner.arch.vocab_size
    print(f"{args.model}: eager steps (no CUDA graphs), skinny matmuls {runner.skinny_gemm}")
    for case in args.cases.split(","):
        kind, batch, new = case.split(":")
        if kind not in ("decode", "extend", "prefill"):
            ap.error(f"case {case!r}: KIND must be decode, extend or prefill")
        batch, new = int(batch), int(new)
        chunks = make_chunks(bm, batch, 0 if kind == "prefill" else 1024, new, vocab)
        with runner.stream_context():
            step = functools.partial(runner.forward, chunks)
            gpu = median_gpu_seconds(step, iters=args.iters, warmup=3)
            host = host_seconds(step, args.iters)
            launches = kernel_launches(step)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step()
            prof.disable()
            torch.cuda.synchronize()
        print(f"\n## {case}: step {gpu * 1e3:.2f} ms, host until return {host * 1e3:.2f} ms, {launches} kernels "
              f"({host / max(launches, 1) * 1e6:.1f} us of host per kernel)")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()))
        release(bm, chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
