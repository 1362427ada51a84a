"""The one-kernel MLP (runner/fused_mlp.py) against the skinny path's two launches, per launch on this GPU.

    python perf/bench_mlp.py --models qwen3-0.6b --rows 1,4,8,16 --out mlp_h200.json

For each model and row count: the decoder layer's MLP as the runner runs it today (skinny gate_up with the RMSNorm
prologue, then skinny down with the silu * up prologue and the residual add, each with its tuned config) and as one
fused_mlp launch for a grid of configs (intermediate columns per program, K and N steps, warps, stages). Every time
is the median over replays of a CUDA graph of 32 launches cycling through copies of the layer's weights totalling
> 4x the L2 cache, so weights come from HBM as in a model step; PDL as the runner launches (TOKENROUTER_PDL=0 off).
The floor is the MLP's weight bytes over this run's device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))
sys.path.insert(0, str(ROOT / "perf"))

from bench_gemm import graph_us  # noqa: E402
from bench_runner import copy_bandwidth  # noqa: E402

from tokenrouter.runner import fused_mlp as fm  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.arch import ArchConfig  # noqa: E402

EPS = 1e-6


def configs() -> list[fm.MlpConfig]:
    return [fm.MlpConfig(programs=p, block_k=bk, block_k2=bk2, num_warps=w, num_stages=st)
            for p, bk, bk2, w, st in itertools.product((0, 128), (128, 256), (256, 512), (4, 8), (3, 4))]


class Layer:
    """One model's MLP weights (copies enough to defeat L2) and inputs at m rows."""

    def __init__(self, arch: ArchConfig, m: int, l2_bytes: int) -> None:
        dev, dt = torch.device("cuda"), torch.bfloat16
        h, i = arch.hidden_size, arch.intermediate_size
        self.h, self.i, self.m = h, i, m
        self.bytes = 3 * h * i * dt.itemsize
        copies = max(1, math.ceil(4 * l2_bytes / self.bytes))
        self.gate_up = [torch.randn(2 * i, h, device=dev, dtype=dt) * h**-0.5 for _ in range(copies)]
        self.down = [torch.randn(h, i, device=dev, dtype=dt) * i**-0.5 for _ in range(copies)]
        self.x = torch.randn(m, h, device=dev, dtype=dt)
        self.norm_w = torch.ones(h, device=dev, dtype=dt)
        skinny = [sg.workspace_need(n, k, m, dev) for n, k in ((2 * i, h), (h, i))]
        fused = fm.workspace_need(i, m)
        self.ws = sg.SplitKWorkspace(dev, max(p for p, _ in skinny + [fused]), max(c for _, c in skinny + [fused]))

    def two_launches(self, j: int) -> torch.Tensor:
        gu = sg.skinny_linear(self.x, self.gate_up[j % len(self.gate_up)], self.ws, prologue="rms_norm",
                              norm_weight=self.norm_w, eps=EPS)
        return sg.skinny_linear(gu, self.down[j % len(self.down)], self.ws, prologue="silu_mul", residual=self.x)

    def gate_up_launch(self, j: int) -> torch.Tensor:
        return sg.skinny_linear(self.x, self.gate_up[j % len(self.gate_up)], self.ws, prologue="rms_norm",
                                norm_weight=self.norm_w, eps=EPS)

    def fused(self, cfg: fm.MlpConfig, j: int, stop: int = 0) -> torch.Tensor:
        return fm.fused_mlp(self.x, self.norm_w, EPS, self.gate_up[j % len(self.gate_up)],
                            self.down[j % len(self.down)], self.ws, cfg, stop=stop)


def write_table(path: Path, results: dict) -> None:
    """Each model's entry in the table's `mlp` section: the best config at the model's largest row count measured
    (the kernel's one 16-row tile serves every row count) and both times there, which `fused_mlp.pays` compares."""
    table = json.loads(path.read_text()) if path.exists() else {}
    part = table.setdefault(results["device"], {}).setdefault("mlp", {})
    for model in dict.fromkeys(r["model"] for r in results["rows"]):
        row = max((r for r in results["rows"] if r["model"] == model and r["fused"]), key=lambda r: r["m"],
                  default=None)
        if row is None:
            continue
        arch = ArchConfig.from_dir(ROOT / "perf" / "models" / model)
        part[fm.table_key(arch.hidden_size, arch.intermediate_size)] = {
            "config": row["fused"][0]["config"], "us": round(row["fused"][0]["us"], 2),
            "baseline_us": round(row["two_launches_us"], 2), "model": model, "rows": row["m"]}
    path.write_text(json.dumps(table, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--out", default="bench_mlp.json")
    ap.add_argument("--phases", action="store_true", help="also time the best config cut short after each phase "
                    "(gate/up; + the barrier) and the skinny gate_up launch alone")
    ap.add_argument("--table", default=None, help="merge each model's best config at its largest --rows into this "
                    "JSON table (the runner's: backends/tokenrouter/runner/skinny_gemm_tuned.json)")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.UTC).isoformat(),
               "copy_bandwidth_tb_s": bandwidth / 1e12, "rows": []}
    lines = [f"# One-kernel MLP against two skinny launches ({results['device']}, {results['date'][:10]})", "",
             f"Command: `python {' '.join(sys.argv)}`. Copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds "
             "per launch in a CUDA graph, weights from HBM.", "",
             "| model | M | floor us | two launches us | fused us (best) | fused / two | best (programs/K/K2 steps) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for model in filter(None, args.models.split(",")):
        arch = ArchConfig.from_dir(ROOT / "perf" / "models" / model)
        grid = configs()
        for m in (int(r) for r in args.rows.split(",")):
            layer = Layer(arch, m, props.L2_cache_size)
            ref = layer.two_launches(0)
            two = graph_us(layer.two_launches)
            timed = []
            for cfg in grid:
                try:
                    out = layer.fused(cfg, 0)
                    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
                    timed.append((graph_us(lambda j, c=cfg, ly=layer: ly.fused(c, j)), cfg))
                except Exception as e:  # a config that does not compile (shared memory) or disagrees: reported
                    print(f"{model} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            timed.sort(key=lambda t: t[0])
            floor = layer.bytes / bandwidth * 1e6
            row = {"model": model, "m": m, "floor_us": floor, "two_launches_us": two,
                   "fused": [{"us": us, "config": cfg.__dict__} for us, cfg in timed]}
            results["rows"].append(row)
            if timed and args.phases:
                best = timed[0][1]
                row["phases_us"] = {str(stop): graph_us(lambda j, c=best, ly=layer, st=stop: ly.fused(c, j, st))
                                    for stop in (1, 2)}
                row["gate_up_launch_us"] = graph_us(layer.gate_up_launch)
                print(f"{model} M={m}: cut after gate/up {row['phases_us']['1']:.2f}, after the barrier "
                      f"{row['phases_us']['2']:.2f} us; skinny gate_up launch alone {row['gate_up_launch_us']:.2f} us",
                      flush=True)
            if timed:
                us, best = timed[0]
                print(f"{model} M={m}: two launches {two:.2f} us, fused best {us:.2f} us ({best}), floor {floor:.2f}",
                      flush=True)
                lines.append(f"| {model} | {m} | {floor:.2f} | {two:.2f} | {us:.2f} | {us / two:.2f} | "
                             f"{best.programs or props.multi_processor_count}/{best.block_k}/{best.block_k2}, "
                             f"{best.num_warps}w{best.num_stages}s |")
            del layer
    if args.table:
        write_table(Path(args.table), results)
    Path(args.out).write_text(json.dumps(results, indent=1))
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
