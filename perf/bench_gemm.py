"""Tunes the skinny matmul (runner/skinny_gemm.py) on this GPU and writes the table the runner reads.

    python perf/bench_gemm.py --models qwen3-0.6b,qwen3-32b --table backends/tokenrouter/runner/skinny_gemm_tuned.json \
        --report perf/results/gemm_h200.md
    python perf/bench_gemm.py --models '' --routers r2r:qwen3-0.6b --tiles 16   # R2R's float32 router network

For every matmul of a decoder layer (qkv, o, gate_up, down, with the prologue and residual add the model fuses
into each) and every row tile (M = 8, 32, 64 for the tiles of 16, 32, 64 rows), it times a grid of tile sizes and
split counts, then the best three with other warp and stage counts, and the op it replaces: cuBLAS plus the
separate fused op (add + RMSNorm before qkv and gate_up, silu * up before down). `--routers POLICY:MODEL` tunes a
router network's float32 linear layers on that model's hidden size (routing/policies/skinny_router.py) against cuBLAS
with their separate LayerNorm, bias, activation and residual add, and also tries IEEE float32 dots against TF32x3
for the best configs. Every time is the median over
replays of a CUDA graph of 32 launches that cycles through copies of the weight totalling > 4x the L2 cache, so
weights come from HBM as they do in a model step. Candidates are compiled first in parallel worker processes (the
Triton cache on disk is shared), so the timing loop does not wait on the compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))

from tokenrouter.routing.policy import make_policy  # noqa: E402
from tokenrouter.runner import fused_ops  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.arch import ArchConfig  # noqa: E402
from tokenrouter.runner.model import layer_matmuls  # noqa: E402

ROWS = {16: 8, 32: 32, 64: 64}  # row tile -> the M it is tuned at (8: the decode batch routing runs most)
LAUNCHES = 32
EPS = 1e-6


ACTIVATION_FNS = {"none": lambda t: t, "gelu": F.gelu, "relu": F.relu}


class Case:
    """One matmul at one M: its inputs, weight copies and workspace on the GPU. A spec is (name, N, K, prologue,
    residual, M, dtype, bias, activation[, rope: (head_dim, num_heads, num_kv_heads, q/k norms) for the qkv matmul
    with its QKRope epilogue]); the models' matmuls are bfloat16 without bias or activation."""

    def __init__(self, name: str, n: int, k: int, prologue: str, residual: bool, m: int, dtype: str, bias: bool,
                 activation: str, rope: tuple[int, int, int, bool] | None = None, *, l2_bytes: int) -> None:
        self.spec = (name, n, k, prologue, residual, m, dtype, bias, activation, rope)
        self.name, self.n, self.k, self.prologue, self.has_residual, self.m = self.spec[:6]
        self.activation = activation
        dev, dt = torch.device("cuda"), getattr(torch, dtype)
        self.dtype = dt
        copies = max(1, math.ceil(4 * l2_bytes / (n * k * dt.itemsize)))
        self.weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        self.x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, device=dev, dtype=dt)
        self.res_in = torch.randn(m, k, device=dev, dtype=dt)  # the baseline's add + RMSNorm input pair
        self.norm_w = torch.ones(k, device=dev, dtype=dt)
        self.norm_b = torch.zeros(k, device=dev, dtype=dt)
        self.bias = torch.randn(n, device=dev, dtype=dt) if bias else None
        self.residual = torch.randn(m, n, device=dev, dtype=dt) if residual else None
        # split-K up to 16 splits; stream-K up to 4 programs per SM, two partial tiles each (up to 256 SMs)
        self.ws = sg.SplitKWorkspace(dev, max(16 * m * n, 2 * 4 * 256 * 128 * sg.block_m(m)), sg.MAX_M * 64 + n)
        self.qk_rope = None
        if rope is not None:  # the qkv matmul with its QKRope epilogue: (head_dim, num_heads, num_kv_heads, norms)
            d, h, hkv, norms = rope
            cos = torch.randn(4096, d // 2, device=dev)
            cache = lambda: torch.zeros(m, hkv, d, device=dev, dtype=dt)  # noqa: E731
            norm = torch.ones(d, device=dev, dtype=dt) if norms else None
            self.qk_rope = sg.QKRope(torch.arange(m, device=dev), cos, cos.clone(), norm, norm, EPS, cache(), cache(),
                                     torch.arange(m, device=dev), h, hkv, d)

    @property
    def floor_bytes(self) -> int:
        return self.n * self.k * self.dtype.itemsize

    def skinny(self, cfg: sg.GemmConfig, i: int) -> torch.Tensor:
        normed = self.prologue in ("rms_norm", "layer_norm")
        return sg.skinny_linear(self.x, self.weights[i % len(self.weights)], self.ws, prologue=self.prologue,
                                norm_weight=self.norm_w if normed else None,
                                norm_bias=self.norm_b if self.prologue == "layer_norm" else None, eps=EPS,
                                bias=self.bias, activation=self.activation, residual=self.residual, config=cfg,
                                qk_rope=self.qk_rope)

    def baseline(self, i: int) -> torch.Tensor:
        """What the model (or router) ran before: the separate element-wise kernels around cuBLAS."""
        if self.qk_rope is not None:  # what a skinny layer ran before: its tuned qkv matmul, then the separate kernel
            r = self.qk_rope
            qkv = sg.skinny_linear(self.x, self.weights[i % len(self.weights)], self.ws, prologue=self.prologue,
                                   norm_weight=self.norm_w, eps=EPS)
            return fused_ops.qk_norm_rope_store(qkv, r.positions, r.cos, r.sin, r.q_norm_weight, r.k_norm_weight,
                                                EPS, r.k_cache, r.v_cache, r.slot_mapping, r.num_heads,
                                                r.num_kv_heads, r.head_dim)
        x = self.x
        if self.prologue == "rms_norm":
            x, _ = fused_ops.add_rms_norm(x, self.res_in, self.norm_w, EPS)
        elif self.prologue == "silu_mul":
            x = fused_ops.silu_mul(x)
        elif self.prologue == "layer_norm":
            x = F.layer_norm(x, (self.k,), self.norm_w, self.norm_b, EPS)
        y = ACTIVATION_FNS[self.activation](F.linear(x, self.weights[i % len(self.weights)], self.bias))
        return y if self.residual is None else y + self.residual


def router_specs(spec: str, m: int) -> list[tuple]:
    """The Case specs of a router network's fused linear layers: `spec` is POLICY:MODEL (the small model whose
    hidden size and vocabulary the router reads), built with the policy's default arguments."""
    policy_name, model = spec.split(":")
    arch = ArchConfig.from_dir(ROOT / "perf" / "models" / model)
    policy = make_policy(policy_name, ["small", "large"], "small")
    with torch.device("meta"):
        net = policy.build_net(arch.hidden_size, arch.vocab_size) if hasattr(policy, "build_net") else None
    if not hasattr(net, "fused_linears"):
        raise SystemExit(f"--routers {spec}: policy {policy_name!r} has no router network for the skinny kernel")
    specs = {}  # one per distinct kernel: R2R's six blocks share two
    for f in net.fused_linears():
        rest = (*f.shape, f.prologue, f.residual, m, "float32", f.linear.bias is not None, f.activation)
        specs.setdefault(rest, f"{policy_name}/{f.name}")
    shapes = [rest[:2] for rest in specs]
    if len(set(shapes)) != len(shapes):  # the table keys entries by N x K x rows x dtype, not by the fused ops
        raise SystemExit(f"--routers {spec}: two layers of one shape with different fused ops; the table can hold "
                         "one config per shape")
    return [(name, *rest) for rest, name in specs.items()]


def graph_us(fn) -> float:
    """Median microseconds per launch of `fn(i)` over replays of a graph of LAUNCHES launches."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            fn(i)
    times = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / LAUNCHES)
    del graph
    return statistics.median(times[2:])


def grid(n: int, k: int, bm: int, sms: int) -> list[sg.GemmConfig]:
    """Tile sizes and split counts worth timing: 0.75..6 programs per SM (any unsplit tiling is kept); and stream-K
    over 1..4 programs per SM where each program gets at least two K blocks."""
    out = []
    for bn, bk in itertools.product((32, 64, 128), (64, 128, 256) if bm == 16 else (64, 128)):
        tiles = math.ceil(n / bn)
        for split in (1, 2, 3, 4, 6, 8, 12, 16):
            if split > 1 and (k / split < bk or not 0.75 * sms <= tiles * split <= 6 * sms):
                continue
            out.append(sg.GemmConfig(bn, bk, split))
        if bn == 32:
            continue
        for per_sm in (1, 2, 3, 4):
            if tiles * math.ceil(k / bk) >= 2 * per_sm * sms:
                out.append(sg.GemmConfig(bn, bk, 1, programs=per_sm * sms))
    return out


def rope_grid(n: int, k: int, head_dim: int) -> list[sg.GemmConfig]:
    """The qkv matmul with the QKRope epilogue: one head per column tile, every K block and split that fits."""
    return [sg.GemmConfig(head_dim, bk, split) for bk in (32, 64, 128) for split in (1, 2, 3, 4, 6, 8, 12, 16)
            if k / split >= bk]


def variants(best: list[sg.GemmConfig], float32: bool = False) -> list[sg.GemmConfig]:
    """Other warp and stage counts for the best configs; for float32, each also with IEEE dots."""
    out = [dataclasses.replace(c, num_warps=w, num_stages=s) for c in best
           for w, s in ((4, 3), (4, 6), (8, 4), (8, 6)) if (w, s) != (c.num_warps, c.num_stages)]
    if float32:
        out += [dataclasses.replace(c, fp32_dot="ieee") for c in best]
    return out


def _compile(jobs: list[tuple[tuple, list[sg.GemmConfig]]]) -> int:
    """Worker: run each config once so its kernel lands in the Triton cache on disk."""
    done = 0
    case = None
    for spec, cfgs in jobs:
        if case is None or case.spec != spec:  # one case's tensors at a time: 16 workers share the GPU
            case = None
            case = Case(*spec, l2_bytes=0)
        for cfg in cfgs:
            try:
                case.skinny(cfg, 0)
                done += 1
            except Exception as e:  # a config the compiler rejects (shared memory) is skipped, not fatal
                print(f"skip {spec[0]} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[tuple, list[sg.GemmConfig]]], workers: int) -> None:
    t0 = time.perf_counter()
    flat = [(spec, [c]) for spec, cfgs in jobs for c in cfgs]
    chunks = [flat[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        n = sum(pool.map(_compile, chunks))
    print(f"compiled {n} variants in {time.perf_counter() - t0:.0f} s ({workers} processes)", flush=True)


def timed(case: Case, cfgs: list[sg.GemmConfig]) -> list[tuple[float, sg.GemmConfig]]:
    """(us, config) of each config that compiles, fastest first."""
    out = []
    for cfg in cfgs:
        try:
            out.append((graph_us(lambda i, c=cfg: case.skinny(c, i)), cfg))
        except Exception as e:  # e.g. out of shared memory for this tile and stage count
            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
    return sorted(out, key=lambda t: t[0])


def rope_of(spec: tuple) -> tuple[int, int, int, bool] | None:
    """A spec's QKRope shape (head_dim, num_heads, num_kv_heads, q/k norms), or None (router specs have none)."""
    return spec[9] if len(spec) > 9 else None


def heuristic(spec: tuple, sms: int) -> sg.GemmConfig:
    """What the runner picks without a table entry: the heuristic, or for the QKRope epilogue the plain matmul's
    (tuned) config, reshaped to one head per tile."""
    n, k, m = spec[1], spec[2], spec[5]
    if rope_of(spec):
        dev = torch.device("cuda")
        return sg.qk_rope_config_for(n, k, m, rope_of(spec)[0], dev, config=sg.config_for(n, k, m, dev))
    return sg.heuristic_config(n, k, m, sms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-32b")
    ap.add_argument("--tiles", default="16,32,64", help="row tiles to tune (each at its M in ROWS)")
    ap.add_argument("--routers", default="", help="router networks to tune, POLICY:MODEL,... (e.g. r2r:qwen3-0.6b)")
    ap.add_argument("--matmuls", default="", help="only these of each model's matmuls (e.g. qkv_proj+qk_rope: the "
                    "qkv matmul with its QK-norm/RoPE/KV-write epilogue); default all")
    ap.add_argument("--table", default=str(sg.TUNED_PATH), help="the JSON table to merge this GPU's entries into")
    ap.add_argument("--report", default=None, help="markdown report path")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    device_name, sms, l2 = torch.cuda.get_device_name(0), props.multi_processor_count, props.L2_cache_size
    from bench_runner import copy_bandwidth

    bandwidth = copy_bandwidth()
    specs = []
    tiles = [int(t) for t in args.tiles.split(",")]
    for model in filter(None, args.models.split(",")):
        arch = ArchConfig.from_dir(ROOT / "perf" / "models" / model)
        for bm in tiles:
            rows = [(name, n, k, prologue, residual, None) for name, n, k, prologue, residual in layer_matmuls(arch)]
            if sg.QKRope.supports(arch.head_dim, arch.qk_norm, arch.qk_norm):
                name, n, k, prologue, residual, _ = rows[0]
                rows.append((name + "+qk_rope", n, k, prologue, residual,
                             (arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.qk_norm)))
            for name, n, k, prologue, residual, rope in rows:
                if args.matmuls and name not in args.matmuls.split(","):
                    continue
                specs.append((model, (f"{model}/{name}", n, k, prologue, residual, ROWS[bm], "bfloat16", False,
                                      "none", rope)))
    for router in filter(None, args.routers.split(",")):
        specs += [(router, spec) for bm in tiles for spec in router_specs(router, ROWS[bm])]
    # Shapes shared by models (none today) are tuned once.
    unique = list(dict.fromkeys(spec for _, spec in specs))
    firsts = {s: rope_grid(s[1], s[2], rope_of(s)[0]) if rope_of(s) else grid(s[1], s[2], sg.block_m(s[5]), sms)
              for s in unique}
    heuristics = [(s, [heuristic(s, sms)]) for s in unique]
    precompile(list(firsts.items()) + heuristics, args.workers)
    ranked = {}
    for spec in unique:  # round 1: the tile and split grid at 4 warps, 4 stages
        case = Case(*spec, l2_bytes=l2)
        ranked[spec] = timed(case, firsts[spec])
        del case
    seconds = {s: variants([c for _, c in ranked[s][:3]], float32=s[6] == "float32") for s in unique}
    precompile(list(seconds.items()), args.workers)
    results = {}
    for spec in unique:  # round 2: other warp and stage counts for the best three; then the baseline
        case = Case(*spec, l2_bytes=l2)
        candidates = ranked[spec][:1] + timed(case, seconds[spec])
        if not candidates:
            print(f"{spec[0]} M={spec[5]}: no config compiled; left out of the table", flush=True)
            continue
        us, best = min(candidates, key=lambda t: t[0])
        heuristic_cfg = heuristic(spec, sms)
        r = {"config": best.__dict__, "us": us, "baseline_us": graph_us(case.baseline),
             "heuristic_us": graph_us(lambda i, c=case, h=heuristic_cfg: c.skinny(h, i)),
             "floor_us": case.floor_bytes / bandwidth * 1e6}
        results[spec] = r
        print(f"{spec[0]:24s} N={spec[1]:6d} K={spec[2]:6d} M={spec[5]:3d}: skinny {r['us']:8.1f} us "
              f"(heuristic {r['heuristic_us']:8.1f}), cuBLAS + op {r['baseline_us']:8.1f} us, floor "
              f"{r['floor_us']:7.1f} us  {r['config']}", flush=True)
        del case
        torch.cuda.empty_cache()

    table_path = Path(args.table)
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    entries = table.setdefault(device_name, {}).setdefault("matmuls", {})
    for spec, r in results.items():
        entries[sg.table_key(spec[1], spec[2], sg.block_m(spec[5]), getattr(torch, spec[6]),
                             "qk_rope" if rope_of(spec) else "")] = {
            "config": r["config"], "us": round(r["us"], 2), "baseline_us": round(r["baseline_us"], 2)}
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    if args.report:
        Path(args.report).write_text(report(results, device_name, bandwidth))
    return 0


def report(results: dict, device_name: str, bandwidth: float) -> str:
    lines = [f"# Skinny matmul tuning ({device_name}, {datetime.date.today()})", "",
             f"Command: `python perf/bench_gemm.py {' '.join(sys.argv[1:])}`. Copy bandwidth (read + write) "
             f"{bandwidth / 1e12:.2f} TB/s; floor = weight bytes / that. Times per launch in a CUDA graph, weights "
             "from HBM. 'cuBLAS + op' is what the layer ran before (add + RMSNorm or silu * up, then cuBLAS).", "",
             "| matmul | N | K | M | skinny us | x floor | cuBLAS + op us | skinny / cuBLAS+op | heuristic us | "
             "config |", "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, r in results.items():
        c = r["config"]
        lines.append(f"| {spec[0]} | {spec[1]} | {spec[2]} | {spec[5]} | {r['us']:.1f} | "
                     f"{r['us'] / r['floor_us']:.2f} | {r['baseline_us']:.1f} | {r['us'] / r['baseline_us']:.2f} | "
                     f"{r['heuristic_us']:.1f} | {c['block_n']}x{c['block_k']} "
                     f"{'stream-K ' + str(c['programs']) if c.get('programs') else 'split ' + str(c['split_k'])}, "
                     f"{c['num_warps']} warps, {c['num_stages']} stages"
                     f"{', ' + c['fp32_dot'] if spec[6] == 'float32' else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
