"""Do CUDA green contexts partition the SMs for what our runner launches? (issue 11: the small model's kernels wait
for SMs the large model's matmuls hold; MPS's thread percentage partitioned them but broke cuBLAS.)

Checks, on GPU 0, each printed as one line:
1. torch's green-context API (`torch.cuda.green_contexts`) is there and makes a context of N SMs with a stream;
2. cuBLAS and a Triton kernel run on that stream and give the same results as on an ordinary stream;
3. they are confined: a compute-bound matmul and a Triton kernel with many programs take about 132/N times as long;
4. a CUDA graph captured on the green stream keeps the limit when replayed (on its stream, and on another one);
5. side by side: a chain of short kernels on the rest of the GPU beside a long matmul on the green context.

    python3 perf/probe_green.py --sms 64,96,112
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from tokenrouter.runner.green import green_stream


@triton.jit
def _spin(x_ptr, out_ptr, iters: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    for _ in range(iters):  # compute bound: each program holds its SM for a fixed time
        v = v * 1.0001 + 0.5
    tl.store(out_ptr + offs, v)


def spin(x: torch.Tensor, out: torch.Tensor, iters: int = 4000) -> None:
    _spin[(x.numel() // 256,)](x, out, iters=iters, BLOCK=256, num_warps=8)


def timed(fn, stream: torch.cuda.Stream, n: int = 10) -> float:
    """Median ms of `fn` on `stream`."""
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            fn()
            ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))


def side_by_side(long_fn, long_stream: torch.cuda.Stream, short_fn, short_stream: torch.cuda.Stream) -> float:
    """Median ms of `short_fn` on `short_stream` while `long_fn` runs 20 times on `long_stream`."""
    torch.cuda.synchronize()
    with torch.cuda.stream(long_stream):
        for _ in range(20):
            long_fn()
    with torch.cuda.stream(short_stream):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        ev[0].record()
        for i in range(5):
            short_fn()
            ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", default="64,96,112")
    args = ap.parse_args()
    from torch.cuda import green_contexts

    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {props.name}, {props.multi_processor_count} SMs, "
          f"green contexts supported: {green_contexts.SUPPORTED}, "
          f"GreenContext has: {sorted(n for n in dir(green_contexts.GreenContext) if not n.startswith('_'))}")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(132 * 8 * 256, device="cuda")
    out = torch.empty_like(x)
    plain = torch.cuda.Stream()
    ref_mm = a @ b
    spin(x, out)
    ref_spin = out.clone()
    t_mm, t_spin = timed(lambda: a @ b, plain), timed(lambda: spin(x, out), plain)
    print(f"plain stream: matmul {t_mm:.3f} ms, spin {t_spin:.3f} ms")
    tiny = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    chain = lambda: [tiny @ w for _ in range(100)]  # noqa: E731 (100 short dependent-ish kernels)
    t_chain = timed(chain, plain)
    print(f"plain stream: a chain of 100 small matmuls {t_chain:.3f} ms")
    for n in (int(s) for s in args.sms.split(",")):
        try:
            ctx, gs = green_stream(torch.device("cuda", 0), n)
        except Exception as exc:
            print(f"green {n}: create failed: {type(exc).__name__}: {exc}")
            continue
        try:
            with torch.cuda.stream(gs):
                mm = a @ b
                spin(x, out)
            torch.cuda.synchronize()
            same = torch.equal(mm, ref_mm) and torch.equal(out, ref_spin)
            g_mm, g_spin = timed(lambda: a @ b, gs), timed(lambda: spin(x, out), gs)
            print(f"green {n}: results equal {same}; matmul {g_mm:.3f} ms ({g_mm / t_mm:.2f}x), "
                  f"spin {g_spin:.3f} ms ({g_spin / t_spin:.2f}x); 132/{n} = {132 / n:.2f}")
            graph = torch.cuda.CUDAGraph()
            gs.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=gs):
                gm = a @ b
                spin(x, out)
            torch.cuda.synchronize()
            r_green = timed(graph.replay, gs)
            r_plain = timed(graph.replay, plain)
            print(f"green {n}: graph captured on it, replayed on it {r_green:.3f} ms, on a plain stream "
                  f"{r_plain:.3f} ms (plain matmul+spin {t_mm + t_spin:.3f}); output equal {torch.equal(gm, ref_mm)}")
            # beside: the long graph on the green context (or plain matmuls), the chain on a plain stream
            beside = side_by_side(graph.replay, gs, chain, plain)
            beside_plain = side_by_side(lambda: a @ b, plain, chain, torch.cuda.Stream())
            print(f"green {n}: chain of 100 small matmuls beside the green graph {beside:.3f} ms; beside plain "
                  f"matmuls {beside_plain:.3f} ms; alone {t_chain:.3f} ms")
        except Exception as exc:
            print(f"green {n}: failed: {type(exc).__name__}: {exc}")
        finally:
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
