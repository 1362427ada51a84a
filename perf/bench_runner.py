"""Runner benchmark on one GPU: Qwen3-0.6B / 8B / 32B with dummy weights (real shapes, bf16).

Measures, per model: decode step latency at several batch sizes and contexts, extend latency for short
suffixes (what a request returning from another model costs), prefill throughput, and each decode time as
a ratio to the weight-read floor (weight bytes / device-to-device copy bandwidth measured in this run).
Each case runs twice in the same process: replaying the captured CUDA graph, and eagerly (same fused kernels,
no graph), so the ratio is side by side. At the end the three models are loaded together by memory fraction
(the coordinated budget of config/mixture) and each runs a graph decode step.

    python perf/bench_runner.py --out perf/results/runner_h200.json [--models qwen3-0.6b,qwen3-32b] [--quick]

`--pdl on,off` runs each model once per setting of programmatic dependent launch (runner/pdl.py), side by side in
one process.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))

from tokenrouter.config import ModelConfig  # noqa: E402
from tokenrouter.engine.block_manager import BlockManager  # noqa: E402
from tokenrouter.engine.sequence import Sequence  # noqa: E402
from tokenrouter.runner import cuda_graph, model_runner, pdl  # noqa: E402
from tokenrouter.runner.arch import ArchConfig  # noqa: E402
from tokenrouter.runner.forward_batch import ScheduledChunk  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner, carves  # noqa: E402
from tokenrouter.sampling_params import SamplingParams  # noqa: E402


def median_gpu_seconds(fn, iters: int, warmup: int) -> float:
    """Median seconds of `fn()` on the GPU (CUDA events around each call), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def copy_bandwidth(n_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    a = torch.empty(n_bytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return n_bytes / median_gpu_seconds(lambda: b.copy_(a), iters=10, warmup=2)


def time_forward(runner: ModelRunner, chunks: list[ScheduledChunk], iters: int) -> float:
    """Median seconds of runner.forward over `iters` runs (KV content is irrelevant to timing). The events
    bracket the host work of the step too (batch preparation, launches): the GPU idles through it."""
    return median_gpu_seconds(lambda: runner.forward(chunks), iters=iters, warmup=3)


def time_both(runner: ModelRunner, chunks: list[ScheduledChunk], iters: int) -> tuple[float | None, float]:
    """(seconds with the CUDA graph, seconds eager); the first is None when no captured graph fits."""
    graphs = runner.graphs
    graph_t = None
    if graphs is not None and graphs.fits(chunks) is not None:
        before = graphs.num_replays
        graph_t = time_forward(runner, chunks, iters)
        assert graphs.num_replays > before, "the graph path did not run"
    runner.graphs = None
    try:
        eager_t = time_forward(runner, chunks, iters)
    finally:
        runner.graphs = graphs
    return graph_t, eager_t


def time_replay(runner: ModelRunner, chunks: list[ScheduledChunk], iters: int) -> float | None:
    """Median seconds of the graph replay alone (inputs already on the device): the step's GPU time, without the
    host's batch preparation."""
    key = load_graph(runner, chunks)
    return None if key is None else median_gpu_seconds(runner.graphs.graphs[key].replay, iters=iters, warmup=3)


def load_graph(runner: ModelRunner, chunks: list[ScheduledChunk]):
    """Fill the graph inputs with `chunks`; the key of the captured graph that replays them, or None. (A tree from
    before graphs per context bound keys them by shape: gpu_ab.sh runs this script against baselines.)"""
    graphs = runner.graphs
    shape = graphs.fits(chunks) if graphs is not None else None
    if shape is None:
        return None
    if hasattr(graphs, "load"):
        key = graphs.load(chunks, shape)
    else:
        graphs.inputs.fill(chunks, shape, runner.block_size)
        key = shape
    return key if key in graphs.graphs else None


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.2f}"


def make_chunks(bm: BlockManager, batch: int, context: int, new: int, vocab: int) -> list[ScheduledChunk]:
    """`batch` sequences whose first `context` tokens are 'cached', each running `new` more tokens."""
    chunks = []
    for i in range(batch):
        tokens = torch.randint(0, vocab, (context + new,)).tolist()
        seq = Sequence(f"b{i}", tokens, context, SamplingParams())
        assert bm.ensure(seq, context + new), "KV pool too small for this case"
        seq.num_computed_tokens = context
        chunks.append(ScheduledChunk(seq, new))
    return chunks


def decode_floor_bytes(arch: ArchConfig) -> int:
    """Bytes a bf16 decode step must read: every weight once except the input embedding (only B rows of it); a
    tied embedding is read in full as the LM head."""
    return arch.weight_bytes(2) - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size * 2)


def release(bm: BlockManager, chunks: list[ScheduledChunk]) -> None:
    for c in chunks:
        bm.release(c.seq)


def profile_graph(runner: ModelRunner, bm: BlockManager, batch: int, context: int, new: int = 1,
                  iters: int = 20):
    """(the graph's shape, its kernel profile: kernel_profile.py) of the captured step `batch` sequences of
    `context` cached tokens running `new` more take; None without a captured graph for it."""
    from kernel_profile import profile_calls

    chunks = make_chunks(bm, batch, context, new, runner.arch.vocab_size)
    try:
        key = load_graph(runner, chunks)
        if key is None:
            return None
        return runner.graphs.fits(chunks), profile_calls(runner.graphs.graphs[key].replay, iters=iters)
    finally:
        release(bm, chunks)


def profile_decode(runner: ModelRunner, bm: BlockManager, batch: int, context: int) -> dict | None:
    """The kernel breakdown of one captured decode step, for the results JSON; None without a graph for it."""
    profiled = profile_graph(runner, bm, batch, context)
    if profiled is None:
        return None
    prof = profiled[1]
    return {"batch": batch, "context": context, "kernel_ms": prof.total_us / 1e3, "kernels": prof.kernels,
            "groups_ms": {g: t / 1e3 for g, t in prof.groups().items()},
            "top": [{"name": k[:100], "us": t, "launches": n} for k, t, n in prof.top(6)]}


def r2r_hook(runner: ModelRunner, skinny: bool = True):
    """R2R's router (hidden_dim 1024, top-100 logits) as the step hook, as the small model's subserver runs it: its
    linear layers through the skinny kernel where the tuned table has them, or (`skinny=False`) on cuBLAS."""
    from tokenrouter.routing.policy import make_policy, step_hook

    args = {"threshold": 0.5, "router_kernel": "auto" if skinny else "torch"}
    policy = make_policy("r2r", ["small", "large"], "small", args)
    a = runner.arch
    policy.setup(runner.device, runner.dtype, a.hidden_size, a.vocab_size)
    hook = step_hook(policy, runner.model.model.embed_tokens)
    hook.router_matmuls = "skinny" if policy.net.workspace is not None else "cuBLAS"
    print(f"R2R router: {hook.router_matmuls} (skinny up to {policy.net.skinny_max_m} rows)", flush=True)
    return hook


PDL_MODES = ("on", "off")


def set_pdl(mode: str) -> None:
    """Programmatic dependent launch for kernels launched from now on (graphs captured after this call)."""
    pdl.ENABLED = mode == "on"


def bench_model(name: str, bandwidth: float, attention: str, quick: bool, with_router: bool,
                skinny: bool = True, profile: bool = False, pdl_mode: str = "on", decode_only: bool = False,
                carveout: int = 0, extends: list[tuple[int, int]] | None = None, extend_context: int = 1024,
                kv_tokens: int | None = None, contexts: tuple[int, ...] = (1024, 8192)) -> dict:
    path = ROOT / "perf" / "models" / name
    kv_tokens = kv_tokens or {"qwen3-0.6b": 600_000, "qwen3-8b": 300_000, "qwen3-32b": 160_000}[name]
    cfg = ModelConfig(name=name, path=str(path), dtype="bfloat16", device="cuda:0", load_format="dummy",
                      kv_cache_tokens=kv_tokens, max_model_len=16384, attention=attention, skinny_gemm=skinny,
                      cublas_sm_carveout=carveout)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, default_kv_tokens=kv_tokens)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner.setup_step(None)
    capture_s = time.perf_counter() - t0
    num_graphs = len(runner.graphs.graphs) if runner.graphs is not None else 0
    print(f"{name}: loaded in {load_s:.1f} s, {num_graphs} CUDA graphs captured in {capture_s:.1f} s, skinny matmuls "
          f"{'up to ' + str(runner.model.skinny_max_m) + ' rows' if runner.skinny_gemm else 'off'}, PDL {pdl_mode}, "
          f"cuBLAS SM carve-out {carveout}",
          flush=True)
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    arch = runner.arch
    floor_bytes = decode_floor_bytes(arch)
    floor = floor_bytes / bandwidth
    iters = 5 if quick else 20
    out: dict = {"model": name, "attention": runner.attn_backend.name, "weight_read_floor_ms": floor * 1e3,
                 "skinny_gemm": runner.skinny_gemm, "skinny_max_m": runner.model.skinny_max_m, "pdl": pdl_mode,
                 "cublas_sm_carveout": carveout, "carve_max_tokens": model_runner.CARVEOUT_MAX_TOKENS,
                 "extend_token_steps": list(cuda_graph._EXTEND_TOKEN_STEPS),
                 "pdl_active": pdl.enabled(runner.device),  # "on" is only asked for: pre-Hopper GPUs run without
                 "load_s": load_s, "num_graphs": num_graphs, "capture_s": capture_s,
                 "graph_pool_mib": torch.cuda.memory_reserved() / 2**20,
                 "decode": [], "extend": [], "prefill": [], "router": []}

    def case(batch: int, context: int, new: int, n_iters: int = iters, replay: bool = False):
        chunks = make_chunks(bm, batch, context, new, arch.vocab_size)
        try:
            g, e = time_both(runner, chunks, n_iters)
            return (g, e, time_replay(runner, chunks, n_iters)) if replay else (g, e)
        finally:
            release(bm, chunks)

    # KV bytes one decode token reads per context token (K and V of every layer).
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    for context in contexts:
        for batch in (1, 4, 8, 16, 32, 64):
            if batch * (context + 1) > runner.num_blocks * runner.block_size:
                continue
            g, e, r = case(batch, context, 1, replay=True)
            kv_floor = (floor_bytes + batch * context * kv_per_token) / bandwidth
            row = {"batch": batch, "context": context, "graph_ms": g and g * 1e3, "eager_ms": e * 1e3,
                   "replay_ms": r and r * 1e3, "graph_x_floor": g and g / floor, "eager_x_floor": e / floor,
                   "weights_kv_floor_ms": kv_floor * 1e3, "graph_x_weights_kv_floor": g and g / kv_floor}
            out["decode"].append(row)
            print(f"{name} decode b={batch:3d} ctx={context:5d}: graph {_ms(g)} ms ({row['graph_x_floor'] or 0:.2f}x "
                  f"floor; replay alone {_ms(r)} ms), eager {_ms(e)} ms", flush=True)
    if profile:  # after the decode timings (no decode case follows a profiler session); graphs without router
        for row in out["decode"]:
            row["profile"] = profile_decode(runner, bm, row["batch"], row["context"])
    decode8 = next((d for d in out["decode"] if d["batch"] == 8 and d["context"] == 1024), None)
    # Suffixes a returning request brings: 1..64 tokens for one request, and 8 requests x 1..10 tokens.
    suffixes = extends or ((1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (1, 64), (8, 2), (8, 4), (8, 8), (8, 10))
    for batch, new in () if decode_only else suffixes:
        g, e = case(batch, extend_context, new)
        shape = runner.graphs and cuda_graph.pick_shape(runner.graphs.shapes, batch, batch * new)
        row = {"batch": batch, "suffix": new, "tokens": batch * new, "context": extend_context,
               "graph_tokens": shape and shape.num_tokens, "carved": bool(shape and carveout and carves(shape)),
               "graph_ms": g and g * 1e3, "eager_ms": e * 1e3}
        if batch == 8 and g is not None and decode8 and decode8["graph_ms"]:
            row["graph_x_decode_b8"] = g * 1e3 / decode8["graph_ms"]
        out["extend"].append(row)
        print(f"{name} extend {batch}x{new} on {extend_context}: graph {_ms(g)} ms (graph of {row['graph_tokens']} "
              f"tokens, carved {row['carved']}), eager {_ms(e)} ms", flush=True)
    # Prompts: one short one, four arriving together (as many requests' first visits to a model), one long one.
    for seqs, length in () if decode_only else ((1, 100), (4, 100), (1, 8192)):
        g, e = case(seqs, 0, length, max(3, iters // 2))
        out["prefill"].append({"seqs": seqs, "tokens": seqs * length, "graph_ms": g and g * 1e3, "eager_ms": e * 1e3,
                               "tok_per_s": seqs * length / min(x for x in (g, e) if x is not None)})
        print(f"{name} prefill {seqs}x{length}: graph {_ms(g)} ms, eager {_ms(e)} ms", flush=True)
    if with_router:
        # The same decode steps with R2R's router captured into the graphs (what the small model runs): its
        # matmuls as the tuned table has them (the skinny kernel where it has), then all on cuBLAS.
        for router_skinny in (True, False):
            runner.graphs = None
            hook = r2r_hook(runner, router_skinny)
            kind = hook.router_matmuls
            if not router_skinny and out["router"] and out["router"][-1]["matmuls"] == kind:
                break  # the table had no router shapes: the first pass was cuBLAS already
            runner.setup_step(hook)
            for batch in (1, 4, 8, 16, 32):
                g, e, r = case(batch, 1024, 1, replay=True)
                plain = next(d for d in out["decode"] if d["batch"] == batch and d["context"] == 1024)
                out["router"].append({"batch": batch, "matmuls": kind, "graph_ms": g and g * 1e3,
                                      "eager_ms": e * 1e3, "replay_ms": r and r * 1e3,
                                      "plain_graph_ms": plain["graph_ms"], "plain_replay_ms": plain["replay_ms"]})
                print(f"{name} decode+r2r ({kind}) b={batch}: graph {_ms(g)} ms (without router "
                      f"{_f(plain['graph_ms'])} ms), replay alone {_ms(r)} ms (without router "
                      f"{_f(plain['replay_ms'])} ms), eager {_ms(e)} ms", flush=True)
    bm.check_integrity([])
    runner = None  # drop the weights before the next model loads
    gc.collect()
    torch.cuda.empty_cache()
    return out


def colocate(configs: list[tuple[str, float]]) -> dict:
    """Load several models on the one GPU, each sized by its kv_memory_fraction, capture their graphs, and run a
    decode step on each: the coordinated memory budget of a routed deployment (e.g. config/mixture)."""
    runners, rows = [], []
    for name, fraction in configs:
        cfg = ModelConfig(name=name, path=str(ROOT / "perf" / "models" / name), dtype="bfloat16", device="cuda:0",
                          load_format="dummy", kv_memory_fraction=fraction, max_model_len=16384)
        runner = ModelRunner(cfg, default_kv_tokens=0)
        runner.setup_step(None)
        runners.append(runner)
        rows.append({"model": name, "fraction": fraction, "weights_gib": runner.weight_bytes / 2**30,
                     "kv_tokens": runner.num_blocks * runner.block_size,
                     "allocated_gib": torch.cuda.memory_allocated() / 2**30})
    for runner, row in zip(runners, rows):
        bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        chunks = make_chunks(bm, 8, 1024, 1, runner.arch.vocab_size)
        row["decode_b8_graph_ms"] = time_forward(runner, chunks, 10) * 1e3
        release(bm, chunks)
    free, total = torch.cuda.mem_get_info()
    out = {"models": rows, "gpu_total_gib": total / 2**30, "gpu_free_gib": free / 2**30}
    for r in rows:
        print(f"colocated {r['model']}: fraction {r['fraction']}, weights {r['weights_gib']:.1f} GiB, "
              f"KV {r['kv_tokens']:,} tokens, decode b8 {r['decode_b8_graph_ms']:.2f} ms", flush=True)
    del runners
    gc.collect()
    torch.cuda.empty_cache()
    return out


def layer_caps(results: dict) -> dict[str, int]:
    """Per model run both ways (--skinny-gemm both): the largest decode batch (1k context) up to which every
    measured batch's graph replay was no slower with skinny matmuls than without. Only batches that ran skinny
    count (those within the table's own row limit)."""
    caps = {}
    # (with several --pdl settings, the first one's runs: the setting the caps are for)
    pdl_mode = results["models"][0].get("pdl", "on") if results["models"] else "on"
    for name in dict.fromkeys(m["model"] for m in results["models"]):
        runs = {m["skinny_gemm"]: m for m in results["models"] if m["model"] == name and m.get("pdl", "on") == pdl_mode}
        if True not in runs or False not in runs:
            continue
        limit = runs[True]["skinny_max_m"]
        rows = {mode: {d["batch"]: d["replay_ms"] for d in runs[mode]["decode"] if d["context"] == 1024}
                for mode in (True, False)}
        cap = 0
        for batch in sorted(b for b in rows[True] if b <= limit):
            skinny, cublas = rows[True][batch], rows[False].get(batch)
            if not skinny or not cublas or skinny > cublas:  # slower, or not measured both ways: stop here
                break
            cap = batch
        caps[name] = cap
    return caps


def write_layer_caps(results: dict, table_path: Path, source: str) -> None:
    """Merge `layer_caps` into the skinny-matmul table's `layers` section for this GPU (runner/skinny_gemm.py)."""
    from tokenrouter.runner.model import layer_shapes
    from tokenrouter.runner.skinny_gemm import layer_key

    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    layers = table.setdefault(results["device"], {}).setdefault("layers", {})
    for name, cap in layer_caps(results).items():
        shapes = layer_shapes(ArchConfig.from_dir(ROOT / "perf" / "models" / name))
        layers[layer_key(shapes)] = {"max_rows": cap, "model": name, "source": source}
        print(f"{name}: skinny matmuls up to {cap} rows (step-level, {source})", flush=True)
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(results: dict) -> str:
    lines = [f"# Runner benchmark ({results['device']}, {results['date']})", "",
             f"Command: `{results['command']}` (torch {results['torch']}).", "",
             f"Device-to-device copy bandwidth (read + write), measured in the same run: "
             f"{results['copy_bandwidth_tb_s']:.2f} TB/s. Weight-read floor = decode weight bytes / that bandwidth. "
             "Every time is the median of CUDA-event-timed steps including the host's batch preparation "
             "(graph: fill static inputs + one replay; eager: the same model, fused kernels, no graph); "
             "'replay alone' times the graph with its inputs already on the device. The (weights + KV) floor adds "
             "the KV bytes a decode step reads.", ""]
    for m in results["models"]:
        matmuls = f"skinny matmuls up to {m['skinny_max_m']} rows" if m.get("skinny_gemm") else "cuBLAS matmuls"
        carve = (f" (in graphs of up to {m.get('carve_max_tokens', 128)} tokens through cuBLASLt, "
                 f"{m['cublas_sm_carveout']} SMs carved out)" if m.get("cublas_sm_carveout") else "")
        lines += [f"## {m['model']}, {matmuls}{carve}, PDL {m.get('pdl', 'on')} (attention: {m['attention']}, "
                  f"weight-read floor {m['weight_read_floor_ms']:.2f} ms, {m['num_graphs']} graphs captured in "
                  f"{m['capture_s']:.1f} s)",
                  "",
                  "| decode batch | context | graph ms | x floor | replay alone ms | x (weights + KV) floor | eager ms "
                  "| x floor | eager / graph |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d in m["decode"]:
            ratio = d["eager_ms"] / d["graph_ms"] if d["graph_ms"] else None
            lines.append(f"| {d['batch']} | {d['context']} | {_f(d['graph_ms'])} | {_f(d['graph_x_floor'])} | "
                         f"{_f(d['replay_ms'])} | {_f(d['graph_x_weights_kv_floor'])} | "
                         f"{d['eager_ms']:.2f} | {d['eager_x_floor']:.2f} | {_f(ratio)} |")
        profiles = [d["profile"] for d in m["decode"] if d.get("profile")]
        if profiles:
            lines += ["", "Kernels of one decode replay per case (torch.profiler): count, kernel time and its groups, "
                          "the longest kernels:", "",
                      "| batch | context | kernels | kernel ms | groups ms | longest (us per step x launches) |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {p['batch']} | {p['context']} | {p['kernels']:.0f} | {p['kernel_ms']:.2f} | "
                      + ", ".join(f"{g} {t:.2f}" for g, t in p["groups_ms"].items()) + " | "
                      + "; ".join(f"{k['name'][:40]} {k['us']:.0f} x{k['launches']:.0f}" for k in p["top"][:3]) + " |"
                      for p in profiles]
        lines += ["", "| extend (requests x suffix) | context | tokens | graph of tokens (carved) | graph ms "
                      "| eager ms | graph / decode b8 |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {e['batch']} x {e['suffix']} | {e.get('context', 1024)} | {e['tokens']} | "
                  f"{e.get('graph_tokens')} ({'yes' if e.get('carved') else 'no'}) | {_f(e['graph_ms'])} | "
                  f"{e['eager_ms']:.2f} | {_f(e.get('graph_x_decode_b8'))} |" for e in m["extend"]]
        lines += ["", "| prefill (prompts x tokens) | graph ms | eager ms | tok/s |", "|---|---|---|---|"]
        lines += [f"| {p.get('seqs', 1)} x {p['tokens'] // p.get('seqs', 1)} | {_f(p['graph_ms'], '.1f')} | "
                  f"{p['eager_ms']:.1f} | {p['tok_per_s']:,.0f} |"
                  for p in m["prefill"]]
        if m["router"]:
            lines += ["", "| decode + R2R router (1k context) | router matmuls | graph ms | without router | "
                      "replay alone ms | without router | router's share of the replay, ms | eager ms |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['batch']} | {r.get('matmuls', 'cuBLAS')} | {_f(r['graph_ms'])} | "
                      f"{_f(r['plain_graph_ms'])} | {_f(r.get('replay_ms'))} | {_f(r.get('plain_replay_ms'))} | "
                      f"{_f(r.get('replay_ms') and r.get('plain_replay_ms') and r['replay_ms'] - r['plain_replay_ms'])}"
                      f" | {r['eager_ms']:.2f} |" for r in m["router"]]
        lines.append("")
    if results.get("colocate"):
        c = results["colocate"]
        lines += [f"## Colocated on one GPU ({c['gpu_total_gib']:.0f} GiB, {c['gpu_free_gib']:.1f} GiB left free)", "",
                  "| model | kv_memory_fraction | weights GiB | KV tokens | decode b8 1k graph ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['fraction']} | {r['weights_gib']:.1f} | {r['kv_tokens']:,} | "
                  f"{r['decode_b8_graph_ms']:.2f} |" for r in c["models"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3-32b")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-router", action="store_true", help="skip the decode + R2R router case on qwen3-0.6b")
    ap.add_argument("--colocate", default="qwen3-0.6b:0.06,qwen3-8b:0.16,qwen3-32b:0.72",
                    help="model:fraction list loaded together at the end ('' to skip)")
    ap.add_argument("--skinny-gemm", default="on", choices=["on", "off", "both"],
                    help="the models' skinny_gemm setting; both: each model twice, side by side")
    ap.add_argument("--layer-caps", metavar="TABLE",
                    help="with --skinny-gemm both: write each model's step-level row limit into this skinny-matmul "
                         "table (runner/skinny_gemm_tuned.json)")
    ap.add_argument("--caps-from", metavar="RESULTS_JSON",
                    help="no benchmark: compute the row limits from a saved --skinny-gemm both run into --layer-caps")
    ap.add_argument("--pdl", default="on",
                    help="comma list of on, off: programmatic dependent launch settings, each model run once per "
                         "setting (the first one's runs set --layer-caps)")
    ap.add_argument("--cublas-sm-carveout", default="0",
                    help="comma list of the models' cublas_sm_carveout settings, each model run once per setting "
                         "(graphs of up to 112 tokens captured through cuBLASLt with that many SMs carved out; 0: "
                         "torch's default)")
    ap.add_argument("--decode-only", action="store_true", help="skip the extend and prefill cases")
    ap.add_argument("--contexts", default="1024,8192", help="comma list of the decode cases' context lengths")
    ap.add_argument("--extends", metavar="BxS,...",
                    help="the extend cases instead of the default ones: B requests of S new tokens each")
    ap.add_argument("--extend-context", type=int, default=1024, help="the cached tokens of every extend case")
    ap.add_argument("--kv-tokens", type=int, metavar="N",
                    help="the KV pool of every model, in tokens (default: sized for an H200; cases that do not fit are "
                         "skipped): the 32B on an 80 GB GPU needs ~24000")
    ap.add_argument("--fine-tokens", type=int, metavar="N",
                    help="capture extend graphs in steps of 16 tokens up to N (the runner: up to 256, then of 64)")
    ap.add_argument("--carve-max-tokens", type=int, metavar="N",
                    help="carve graphs of up to N tokens out (the runner: model_runner.CARVEOUT_MAX_TOKENS)")
    ap.add_argument("--profile", action="store_true",
                    help="also the kernel breakdown of each decode case (torch.profiler)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "runner.json"))
    args = ap.parse_args()
    pdl_modes = list(dict.fromkeys(args.pdl.split(",")))  # each setting once
    carveouts = [int(c) for c in dict.fromkeys(args.cublas_sm_carveout.split(","))]
    if set(pdl_modes) - set(PDL_MODES):
        ap.error(f"--pdl takes a comma list of {', '.join(PDL_MODES)}, got {args.pdl!r}")
    if args.layer_caps and len(carveouts) > 1:
        ap.error("--layer-caps takes one --cublas-sm-carveout setting (the caps are for one)")
    if args.layer_caps and not args.caps_from and args.skinny_gemm != "both":
        ap.error("--layer-caps needs --skinny-gemm both (or --caps-from a saved run of it)")
    try:
        pairs = (c.split("x") for c in args.extends.split(",")) if args.extends else None
        extends = [(int(b), int(s)) for b, s in pairs] if pairs is not None else None
    except ValueError:
        ap.error(f"--extends takes a comma list of BxS (e.g. 8x10,16x12), got {args.extends!r}")
    if args.fine_tokens:
        cuda_graph._EXTEND_TOKEN_STEPS = ((args.fine_tokens, 16), (1 << 30, 64))
    if args.carve_max_tokens is not None:
        model_runner.CARVEOUT_MAX_TOKENS = args.carve_max_tokens
    if args.caps_from:
        if not args.layer_caps:
            ap.error("--caps-from needs --layer-caps TABLE")
        write_layer_caps(json.loads(Path(args.caps_from).read_text()), Path(args.layer_caps), args.caps_from)
        return 0
    if args.layer_caps:
        from tokenrouter.runner import skinny_gemm

        skinny_gemm.LAYER_CAPS = False  # measure at the rows the matmul table allows, not at the previous cap
    if not torch.cuda.is_available():
        print("bench_runner needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
               "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
               "copy_bandwidth_tb_s": bw / 1e12, "models": []}
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.skinny_gemm]
    for name in args.models.split(","):
        with_router = name == "qwen3-0.6b" and not args.no_router
        for pdl_mode in pdl_modes:
            set_pdl(pdl_mode)
            for skinny in modes:
                for carve in carveouts:
                    results["models"].append(bench_model(name, bw, args.attention, args.quick, with_router, skinny,
                                                         args.profile, pdl_mode, args.decode_only, carve,
                                                         extends, args.extend_context, args.kv_tokens,
                                                         tuple(int(c) for c in args.contexts.split(","))))
                    Path(args.out).write_text(json.dumps(results, indent=2))
    set_pdl(pdl_modes[0])
    if args.colocate:
        pairs = [(p.split(":")[0], float(p.split(":")[1])) for p in args.colocate.split(",")]
        results["colocate"] = colocate(pairs)
    Path(args.out).write_text(json.dumps(results, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(results))
    if args.layer_caps and args.skinny_gemm == "both":
        write_layer_caps(results, Path(args.layer_caps), args.out)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
