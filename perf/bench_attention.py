#!/usr/bin/env python3
"""Paged attention alone, per layer, as the step graphs run it (issue 12): decode, and the short extends a
request returning from another model brings (a few new tokens over a long cached context).

Every case is captured in a CUDA graph that runs one attention call per layer over that layer's own K/V pool
(so the KV is read from HBM, not from L2, as in a real step), laid out like the runner's graph for the batch:
the graph shape's padding sequences and tokens included (`cuda_graph.pick_shape`). Reported per layer: the
backend's default, each swept extend configuration (row tile, key tile, stages, warps, KV splits), each swept
decode configuration (key tile, stages, warps, forced KV splits), and the floor (K/V bytes read / copy bandwidth
measured in the same run). What the defaults should be is read off this.

    python perf/bench_attention.py --out perf/results/NAME.json [--models ...] [--tiles ...] [--splits ...]
        [--batches 1,4,8,12 --contexts 1024,8192]
        [--decode-tiles 64x3x4,32x3x4 --decode-splits 1,4,16]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "backends"))
sys.path.insert(0, str(ROOT / "perf"))

from _common import command_line, machine_info, now_iso  # noqa: E402
from bench_runner import copy_bandwidth, median_gpu_seconds  # noqa: E402

from tokenrouter.runner.arch import ArchConfig  # noqa: E402
from tokenrouter.runner.cuda_graph import GraphShape, graph_shapes, pick_shape  # noqa: E402
from tokenrouter.runner.forward_batch import ForwardBatch  # noqa: E402

try:
    from tokenrouter.runner.cuda_graph import fewest_tokens
except ImportError:  # a tree from before it (only used where graph_state takes the bound)
    fewest_tokens = None
from tokenrouter.runner.triton_attention import TritonAttention  # noqa: E402

PAGE = 16
MAX_MODEL_LEN = 16384  # what the graphs size their splits for (bench_runner's max_model_len)


class SweptAttention(TritonAttention):
    """The backend with the extend kernel's tile and launch shape fixed (and its split count forced)."""

    def __init__(self, extend_cfg: dict[str, int], splits: int) -> None:
        super().__init__(num_kv_splits=splits)
        self.extend_cfg = extend_cfg

    def _extend_config(self, d_pad: int, elem_size: int, *_: object) -> dict[str, int]:
        return dict(self.extend_cfg)


class DecodeSweptAttention(TritonAttention):
    """The backend with the decode kernel's key tile and launch shape fixed and its split count forced."""

    def __init__(self, decode_cfg: dict[str, int], splits: int) -> None:
        super().__init__(num_kv_splits=splits)
        self.decode_cfg = decode_cfg

    def _decode_config(self, d_pad: int) -> dict[str, int]:
        return dict(self.decode_cfg)


def decode_configs(tiles: str, splits: str) -> list[tuple[dict[str, int], int]]:
    """Decode sweep: key tile x stages x warps, each at every forced split count."""
    out = []
    for tile in filter(None, tiles.split(",")):
        n, stages, warps = (int(x) for x in tile.split("x"))
        for sp in filter(None, splits.split(",")):
            out.append(({"BLOCK_N": n, "num_stages": stages, "num_warps": warps}, int(sp)))
    return out


SHAPES = graph_shapes(64, 128, 256)  # the runner's short-suffix graphs (up to 128 tokens; the default goes on to 512)


def make_batch(batch: int, new: int, context: int, pool_blocks: int, device: torch.device,
               gen: torch.Generator) -> tuple[ForwardBatch, GraphShape]:
    """`batch` sequences of `context` cached + `new` new tokens, padded to the graph shape the runner would
    replay (padding sequences have no tokens, padding tokens belong to no sequence); returns the batch and the
    shape."""
    shape = pick_shape(SHAPES, batch, batch * new)
    if shape is None:
        raise ValueError(f"no graph shape for {batch} x {new}")
    seqs, tokens = shape.num_seqs, shape.num_tokens
    kv_len = context + new
    nblk = -(-kv_len // PAGE)
    max_blocks = -(-MAX_MODEL_LEN // PAGE)
    # Blocks scattered over the pool as a long-running server's would be.
    perm = torch.randperm(pool_blocks, generator=gen)[: batch * nblk].view(batch, nblk)
    tables = torch.zeros(seqs, max_blocks, dtype=torch.int32)
    tables[:batch, :nblk] = perm.to(torch.int32)
    cu = [min(i, batch) * new for i in range(seqs + 1)]
    kv_lens = [kv_len] * batch + [0] * (seqs - batch)
    positions = [context + j for _ in range(batch) for j in range(new)] + [0] * (tokens - batch * new)
    fb = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int64, device=device),  # int64 in graph batches
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=device),
        logits_indices=torch.zeros(seqs, dtype=torch.int64, device=device),
        block_size=PAGE,
    )
    return fb, shape


def time_layers(backend: TritonAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                shape: GraphShape, iters: int, max_kv: int = MAX_MODEL_LEN) -> float:
    """Seconds per layer of one graph that runs the attention of every layer (k, v: [L, slots, Hkv, D]), launched
    for contexts up to `max_kv` (the runner's graph of that context bound)."""
    scale = q.shape[-1] ** -0.5
    bounds = (shape.num_seqs, shape.num_tokens, shape.has_extend, max_kv)
    if "min_tokens" in inspect.signature(backend.graph_state).parameters:
        fb.attn_state = backend.graph_state(*bounds, min_tokens=fewest_tokens(SHAPES, shape))
    else:  # a tree from before the lower bound (perf/gpu_extend.sh runs this script against a baseline)
        fb.attn_state = backend.graph_state(*bounds)
    layers = k.shape[0]

    def step() -> None:
        for layer in range(layers):
            backend.forward(q, k[layer], v[layer], fb, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles; allocates the split scratch outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    t = median_gpu_seconds(graph.replay, iters=iters, warmup=2)
    del graph
    return t / layers


# Extend tiles swept by default (BLOCK_M, BLOCK_N, stages, warps): the prefill-tuned default (128 x 32) and the
# ones the first sweep over all 16 combinations of 64/128 x 32/64 x 2/3 stages x 4/8 warps ranked best for short
# suffixes, plus 32-row tiles (a whole 16-token suffix of a 2-query-head group in one program).
TILES = "64x64x2x4,64x64x3x4,64x32x2x4,32x64x2x4,32x64x3x4,128x64x3x8,128x32x2x4"
SPLITS = "1,2,3,4,6,8,12,16"


def extend_configs(tiles: str, splits: str) -> list[tuple[dict[str, int], int]]:
    out = []
    for tile in filter(None, tiles.split(",")):
        m, n, stages, warps = (int(x) for x in tile.split("x"))
        for sp in splits.split(","):
            out.append(({"BLOCK_M": m, "BLOCK_N": n, "num_stages": stages, "num_warps": warps}, int(sp)))
    return out


def bench_model(name: str, bandwidth: float, configs: list[tuple[dict[str, int], int]], iters: int,
                dec_configs: Sequence[tuple[dict[str, int], int]] = (), batches: Sequence[int] = (1, 4, 8, 12),
                contexts: Sequence[int] = (1024, 8192)) -> dict:
    arch = ArchConfig.from_dir(ROOT / "perf" / "models" / name)
    dev = torch.device("cuda")
    hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    new = 10
    pool_blocks = max(batches) * -(-(max(contexts) + 64) // PAGE) + 64
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(arch.num_layers, pool_blocks * PAGE, hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    out: dict = {"model": name, "heads": hq, "kv_heads": hkv, "head_dim": d, "layers": arch.num_layers,
                 "cases": []}
    for context in contexts:
        for batch in batches:
            kv_bytes = batch * (context + new) * hkv * d * 2 * 2
            floor = kv_bytes / bandwidth
            fb_d, shape_d = make_batch(batch, 1, context + new - 1, pool_blocks, dev, gen)
            q_d = torch.randn(shape_d.num_tokens, hq, d, dtype=torch.bfloat16, device=dev)
            decode = time_layers(TritonAttention(), q_d, k, v, fb_d, shape_d, iters)
            dec_swept = []
            for cfg, splits in dec_configs:
                t = time_layers(DecodeSweptAttention(cfg, splits), q_d, k, v, fb_d, shape_d, iters)
                dec_swept.append({**cfg, "splits": splits, "us": t * 1e6})
            dec_best = min(dec_swept, key=lambda r: r["us"], default=None)
            fb, shape = make_batch(batch, new, context, pool_blocks, dev, gen)
            q = torch.randn(shape.num_tokens, hq, d, dtype=torch.bfloat16, device=dev)
            default = time_layers(TritonAttention(), q, k, v, fb, shape, iters)
            # The graph the runner replays for this case where the backend has one for shorter contexts (a tree
            # from before those has none).
            fitting = [b for b in getattr(TritonAttention(), "graph_context_bounds", lambda _: [])(MAX_MODEL_LEN)
                       if context + new <= b]
            bounded = (time_layers(TritonAttention(), q, k, v, fb, shape, iters, max_kv=min(fitting))
                       if fitting else None)
            swept = []
            for cfg, splits in configs:
                t = time_layers(SweptAttention(cfg, splits), q, k, v, fb, shape, iters)
                swept.append({**cfg, "splits": splits, "us": t * 1e6})
            best = min(swept, key=lambda r: r["us"], default=None)
            case = {"batch": batch, "new": new, "context": context, "graph_seqs": shape.num_seqs,
                    "graph_tokens": shape.num_tokens,
                    "floor_us": floor * 1e6, "decode_us": decode * 1e6, "default_us": default * 1e6,
                    "bounded_us": None if bounded is None else bounded * 1e6,
                    "best": best, "swept": swept, "decode_best": dec_best, "decode_swept": dec_swept}
            out["cases"].append(case)
            print(f"{name} {batch}x{new} on {context}: floor {floor * 1e6:.1f} us, decode {decode * 1e6:.1f}, "
                  f"extend default {default * 1e6:.1f}"
                  + (f", as replayed {bounded * 1e6:.1f} (context bound {min(fitting)})" if bounded else "")
                  + (f", best {best['us']:.1f} ({best})" if best else "")
                  + (f", decode best {dec_best['us']:.1f} ({dec_best})" if dec_best else ""), flush=True)
    del k, v
    torch.cuda.empty_cache()
    return out


def decode_summary(results: dict) -> list[str]:
    """Decode: each tile's geometric mean over the cases relative to each case's best (each case at the tile's
    best split count), and each case's best split count and split length per tile."""
    lines = []
    for m in results["models"]:
        cases = [c for c in m["cases"] if c.get("decode_swept")]
        if not cases:
            continue
        tiles = sorted({(r["BLOCK_N"], r["num_stages"], r["num_warps"]) for r in cases[0]["decode_swept"]})

        def at(c: dict, tile: tuple) -> dict:
            rows = [r for r in c["decode_swept"] if (r["BLOCK_N"], r["num_stages"], r["num_warps"]) == tile]
            return min(rows, key=lambda r: r["us"])

        score = {t: math.exp(sum(math.log(at(c, t)["us"] / c["decode_best"]["us"]) for c in cases) / len(cases))
                 for t in tiles}
        default = math.exp(sum(math.log(c["decode_us"] / c["decode_best"]["us"]) for c in cases) / len(cases))
        lines.append(f"{m['model']} decode: default {default:.2f}x the per-case best (geometric mean); tiles "
                     "(BLOCK_N, stages, warps) at their best splits: "
                     + ", ".join(f"{t} {sc:.2f}x" for t, sc in sorted(score.items(), key=lambda kv: kv[1])))
        for c in cases:
            b = c["decode_best"]
            lines.append(f"  b{c['batch']} ctx {c['context']}: default {c['decode_us']:.1f} us, best {b['us']:.1f} "
                         f"({b['BLOCK_N']}x{b['num_stages']}x{b['num_warps']}, {b['splits']} splits), floor "
                         f"{c['floor_us']:.1f}")  # (decode reads the same context + new keys)
    return lines


def summary(results: dict) -> list[str]:
    """For each swept configuration, its geometric-mean time over the cases relative to each case's best."""
    lines = decode_summary(results)
    for m in results["models"]:
        if not m["cases"] or not m["cases"][0]["swept"]:
            continue
        keys = [tuple(r[x] for x in ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps", "splits"))
                for r in m["cases"][0]["swept"]]
        score = {}
        for i, key in enumerate(keys):
            score[key] = math.exp(sum(math.log(c["swept"][i]["us"] / c["best"]["us"]) for c in m["cases"])
                                  / len(m["cases"]))
        ranked = sorted(score.items(), key=lambda kv: kv[1])[:8]
        default = math.exp(sum(math.log(c["default_us"] / c["best"]["us"]) for c in m["cases"]) / len(m["cases"]))
        lines.append(f"{m['model']}: default {default:.2f}x the per-case best (geometric mean); best fixed "
                     "(BLOCK_M, BLOCK_N, stages, warps, splits): "
                     + ", ".join(f"{k} {s:.2f}x" for k, s in ranked))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-32b,qwen3-0.6b")
    ap.add_argument("--tiles", default=TILES,
                    help="extend tiles to sweep, BLOCK_MxBLOCK_NxSTAGESxWARPS,...; '' times the default alone")
    ap.add_argument("--splits", default=SPLITS, help="KV split counts to sweep")
    ap.add_argument("--decode-tiles", default="",
                    help="decode tiles to sweep, BLOCK_NxSTAGESxWARPS,... (each at every --decode-splits count)")
    ap.add_argument("--decode-splits", default="1,2,4,8,16,32,64", help="decode KV split counts to sweep")
    ap.add_argument("--batches", default="1,4,8,12", help="requests per case (12 x 10: the largest short-suffix "
                    "graph, 128 tokens)")
    ap.add_argument("--contexts", default="1024,8192",
                    help="cached tokens per request (routed serving's are a few hundred)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.time()
    bandwidth = copy_bandwidth()
    results = {"command": command_line(), "date": now_iso(), "machine": machine_info(),
               "copy_bandwidth_tb_s": bandwidth / 1e12, "models": []}
    for name in args.models.split(","):
        results["models"].append(bench_model(name, bandwidth, extend_configs(args.tiles, args.splits), args.iters,
                                             decode_configs(args.decode_tiles, args.decode_splits),
                                             [int(b) for b in args.batches.split(",")],
                                             [int(c) for c in args.contexts.split(",")]))
        args.out.write_text(json.dumps(results, indent=1))
    for line in summary(results):
        print(line)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
