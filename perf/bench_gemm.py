"""How close the decode-shaped matmuls of Qwen3-32B come to the memory floor, per BLAS backend.

A decode or short-extend step is four weight matmuls per layer with few rows (M = tokens in the step); their
time over the weight bytes is the bandwidth they reach, compared here with a device-to-device copy measured in
the same run. Used to decide whether small-M matmuls need a kernel of our own.

    python perf/bench_gemm.py --out perf/results/gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import copy_bandwidth, median_gpu_seconds  # noqa: E402

# (name, K, N) of Qwen3-32B's per-layer weights: qkv, o_proj, gate_up, down.
SHAPES = [("qkv", 5120, 10240), ("o_proj", 8192, 5120), ("gate_up", 5120, 51200), ("down", 25600, 5120)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,64,80,128")
    ap.add_argument("--out", default="gemm.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_tb_s": bw / 1e12, "rows": []}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in (int(x) for x in args.rows.split(",")):
            total_s = total_bytes = 0.0
            for _, k, n in SHAPES:
                w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                total_s += median_gpu_seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), iters=50, warmup=5)
                total_bytes += w.numel() * 2
            row = {"blas": lib, "m": m, "layer_us": total_s * 1e6, "x_floor": total_s / (total_bytes / bw)}
            results["rows"].append(row)
            print(f"{lib:9s} M={m:4d}: one layer's four matmuls {row['layer_us']:7.1f} us, "
                  f"{row['x_floor']:.3f}x the weight-read floor", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
