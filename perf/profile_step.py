"""Where a captured decode step's GPU time goes: kernel times of one graph replay, grouped.

    python perf/profile_step.py --model qwen3-32b --batch 8 --context 1024 [--suffix 10] [--skinny-gemm off]
        [--router [--router-cublas]]

Builds the model with dummy weights, captures its graphs, and profiles `--iters` replays of the graph the
batch picks (torch.profiler, CUDA activity). Prints per-kernel totals per step, and the split between matmuls
(cuBLAS), our Triton kernels, and the rest, against the weight-read floor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import ROOT, copy_bandwidth, decode_floor_bytes, profile_graph, r2r_hook  # noqa: E402

from tokenrouter.config import ModelConfig  # noqa: E402
from tokenrouter.engine.block_manager import BlockManager  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-32b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=1, help="new tokens per request (1: decode)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skinny-gemm", default="on", choices=["on", "off"], help="the model's skinny_gemm setting")
    ap.add_argument("--router", action="store_true", help="R2R's router in the graph, as the small model runs it")
    ap.add_argument("--router-cublas", action="store_true",
                    help="with --router: its matmuls on cuBLAS even where the tuned table has them skinny")
    args = ap.parse_args()
    bw = copy_bandwidth()
    cfg = ModelConfig(name=args.model, path=str(ROOT / "perf" / "models" / args.model), dtype="bfloat16",
                      device="cuda:0", load_format="dummy", kv_cache_tokens=200_000, max_model_len=16384,
                      skinny_gemm=args.skinny_gemm == "on")
    runner = ModelRunner(cfg, default_kv_tokens=0)
    hook = r2r_hook(runner, skinny=not args.router_cublas) if args.router else None
    runner.setup_step(hook)
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    profiled = profile_graph(runner, bm, args.batch, args.context, args.suffix, args.iters)
    if profiled is None:
        print(f"no captured graph for batch {args.batch} x {args.suffix} new tokens", file=sys.stderr)
        return 2
    shape, prof = profiled
    total, groups = prof.total_us, prof.groups()
    floor_bytes = decode_floor_bytes(runner.arch)
    kernels = prof.kernels
    # What ran, not what was asked: the tuned table decides how many rows run skinny.
    rows = runner.model.skinny_max_m if runner.skinny_gemm else 0
    matmuls = (f"skinny matmuls (up to {rows} rows)" if shape.num_tokens <= rows else
               f"cuBLAS matmuls (skinny_gemm {args.skinny_gemm}, up to {rows} rows)")
    print(f"{args.model} batch {args.batch} x {args.suffix} new tokens, context {args.context}, graph {shape}, "
          f"{matmuls}{f', R2R router ({hook.router_matmuls})' if hook else ''}: {kernels:.0f} kernels, "
          f"kernel time {total / 1e3:.2f} ms per step; weight-read floor {floor_bytes / bw * 1e3:.2f} ms")
    for g, t in groups.items():
        print(f"  {g:14s} {t / 1e3:7.3f} ms ({t / total:5.1%})")
    print("top kernels (us per step, launches per step):")
    for name, t, n in prof.top(14):
        print(f"  {t:9.1f} us {n:6.0f}x  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
