"""Two models stepping at once on one GPU: how much each slows the other, and what partitions the SMs better.

Served, the 0.6B's step takes 3.4-3.6 ms beside the 32B's against 1.44 ms alone
(perf/results/timeline_h200_2026-12-02): its ~200 short kernels wait for SMs the 32B's matmuls hold. This
replays each model's captured step (dummy weights, real shapes) alone and side by side, under the ways of
sharing the SMs that a deployment can choose:

- in one process (the in-process engine): `plain` (two streams), `small_high` (the small model's stream at high
  priority), `small_cublas` (the small model without skinny matmuls: more, shorter kernels), `carveout<K>` (the
  large model's cuBLAS matmuls captured with K SMs left out: torch's SM carve-out), `large_skinny` (the large
  model's matmuls on the skinny kernels wherever the tuned table has them, its step-level row cap lifted: their
  programs hold a tile's worth of shared memory where cuBLAS's hold more), `large_skinny_high` (that, and the
  small model's stream at high priority), `large_streamk<P>` (the large model's matmuls as stream-K over P programs
  per SM with the small model at high priority: many short programs, so that an SM comes free every few
  microseconds for the small model's kernels to take first, where cuBLAS's and the tuned stream-K's programs hold
  their SMs through a whole matmul), `green<N>` (the large model's steps on a CUDA green context of N SMs:
  `ModelConfig.num_sms`; the small model keeps the whole GPU), `lt<K>` / `lt<K>_high` (the large model's matmuls
  captured through cuBLASLt with K SMs carved out, `lt0` none: the carve-out reaches cuBLASLt only, whose
  heuristics then size their grids for the SMs left; `_high`: the small model's stream at high priority),
  `small_r2r` / `small_r2r_torch` (the small model's steps with R2R's router in their graphs, as its subserver runs
  them: the router's matmuls as the tuned table says, or on cuBLAS; beside the large model's graphs as the variants
  before left them, so `lt48,small_r2r` is the served deployment's pairing);
- in two processes under CUDA MPS (the served deployment: one process per model): `mps<P>`, the large model's
  process limited to P % of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), the small model's unlimited. Caution:
  on the H200 with torch 2.11 a limited process's cuBLAS matmuls returned NaN from finite inputs at some
  shares (perf/results/sm_share_h200_2026-12-02); the check of the large model's outputs is there for that.

Per variant: each model's step alone and beside the other (GPU time per step, median), the slowdowns, and the
work the two do together in units of "one model alone" (1.0 = taking turns gains nothing; 2.0 = no
interference). Also whether the large model's outputs were finite: after every step in the MPS workers, after the
last one in one process.

    python perf/bench_corun.py --variants plain,small_high,carveout16 --out corun.json
    python perf/bench_corun.py --mps 100,80,60 --out corun_mps.json    # starts the MPS daemon itself
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))
sys.path.insert(0, str(ROOT / "perf"))

# KV pool tokens per model; --kv-tokens sets them all (an 80 GB GPU holds the 32B's weights and ~20k tokens).
KV_TOKENS = {"qwen3-0.6b": 50_000, "qwen3-8b": 50_000, "qwen3-32b": 50_000}


def build(name: str, skinny: bool = True, priority: str = "normal", router: str = ""):
    """A runner with dummy weights and its graphs captured, and its block manager. `router` ("auto" or "torch"):
    with R2R's router in its graphs (bench_runner.r2r_hook), its matmuls as the tuned table says or on cuBLAS."""
    from tokenrouter.config import ModelConfig
    from tokenrouter.engine.block_manager import BlockManager
    from tokenrouter.runner.model_runner import ModelRunner

    cfg = ModelConfig(name=name, path=str(ROOT / "perf" / "models" / name), dtype="bfloat16", device="cuda:0",
                      load_format="dummy", kv_cache_tokens=KV_TOKENS[name], max_model_len=4096,
                      skinny_gemm=skinny, stream_priority=priority,
                      cuda_graph_max_batch=16, cuda_graph_max_tokens=32)  # what the cases need: quick captures
    runner = ModelRunner(cfg, default_kv_tokens=KV_TOKENS[name])
    hook = None
    if router:
        from bench_runner import r2r_hook

        hook = r2r_hook(runner, skinny=router == "auto")
    runner.setup_step(hook)
    return runner, BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)


class Step:
    """One captured step of `runner`: `batch` sequences of `context` cached tokens running `new` more each,
    its inputs filled once."""

    def __init__(self, runner, bm, batch: int, context: int, new: int) -> None:
        from bench_runner import load_graph, make_chunks

        self.runner = runner
        chunks = make_chunks(bm, batch, context, new, runner.arch.vocab_size)
        key = load_graph(runner, chunks)
        if key is None:
            raise SystemExit(f"no captured graph for {batch} x {new} tokens on {runner.cfg.name}")
        self.shape = runner.graphs.fits(chunks)
        self.graph, self.out = runner.graphs.graphs[key], runner.graphs.outputs[key]

    def finite(self) -> bool:
        return bool(self.out.logits.float().isfinite().all())


# Replays a model has queued at once beside the other: a subserver launches a step, and at most one more ahead of
# it (stepping ahead), before it waits for results. Launching 30 large graphs at once instead (as this bench did
# until 2026-12-05) queues ~25k kernels, and the other model's launches then waited for room in the queue: its
# steps "stalled for part of the window" beside carved cuBLASLt graphs (perf/results/r2r_served_h100_2026-12-05).
DEPTH = 2


def timed(step: Step, n: int, depth: int = 0) -> list:
    """Launch `n` replays on the step's stream, an event before, between and after them; with `depth`, each
    launch first waits until at most depth - 1 earlier replays are unfinished (0: all back to back)."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    with torch.cuda.stream(step.runner.stream):
        events[0].record()
        for i in range(n):
            if depth and i >= depth:
                events[i - depth + 1].synchronize()  # replay i - depth has finished
            step.graph.replay()
            events[i + 1].record()
    return events


def alone(step: Step, n: int = 30) -> float:
    """Median ms of one replay with nothing else on the GPU."""
    import torch

    timed(step, 3)
    torch.cuda.synchronize()
    ev = timed(step, n)
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))


def side_by_side(small: Step, large: Step, n_large: int = 30, depth: int | None = None) -> dict:
    """Both streams loaded at once: `n_large` large steps, and enough small steps to outlast them, each model with
    at most `depth` replays queued (DEPTH unless given; 0: all at once). Returns the median ms of the small steps
    that ran wholly inside the large model's window, and the large steps' mean."""
    import torch

    depth = DEPTH if depth is None else depth
    t_small, t_large = alone(small), alone(large)
    n_small = math.ceil(n_large * t_large / t_small) + 10
    torch.cuda.synchronize()
    # Each model's replays are launched from a thread of its own (replay releases the GIL): a launch that waits for
    # room in the device's queue, 30 large graphs at once, then holds up only its own model's launches. Launched
    # one after the other from one thread, the small model's steps started late beside some large graphs
    # (perf/results/sm_carveout_h200_2026-12-04: 40-56 SMs carved out).
    sev: list = []
    both = threading.Barrier(2)

    def small_loop() -> None:
        both.wait()
        sev.extend(timed(small, n_small, depth))

    thread = threading.Thread(target=small_loop, name="corun-small")
    thread.start()
    both.wait()
    lev = timed(large, n_large, depth)
    thread.join()
    torch.cuda.synchronize()
    start, end = lev[0], lev[-1]
    inside = [a.elapsed_time(b) for a, b in zip(sev, sev[1:])
              if start.elapsed_time(a) >= 0 and b.elapsed_time(end) >= 0]
    large_ms = start.elapsed_time(end) / n_large
    covered = start.elapsed_time(sev[-1]) >= start.elapsed_time(end)  # the small loop outlasted the large one
    # The window's time per small step: far above the median when the small model's steps started late or stalled
    # for part of the window (then the large one ran alone for that part, and its "beside" time says little).
    window_ms = start.elapsed_time(end)
    return result(t_small, statistics.median(inside) if inside else float("nan"), t_large, large_ms,
                  small_steps=len(inside), small_window_ms_per_step=window_ms / max(1, len(inside)),
                  covered=covered, large_finite=large.finite())


def result(small_alone: float, small_beside: float, large_alone: float, large_beside: float, **extra) -> dict:
    return {"small_alone_ms": small_alone, "small_beside_ms": small_beside,
            "small_slowdown": small_beside / small_alone,
            "large_alone_ms": large_alone, "large_beside_ms": large_beside,
            "large_slowdown": large_beside / large_alone,
            "work_together": small_alone / small_beside + large_alone / large_beside, **extra}


def run_inprocess(args) -> dict:
    import torch

    out = {}
    large_runner, large_bm = build(args.large)
    small_runner, small_bm = build(args.small)
    large = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
    small = Step(small_runner, small_bm, args.small_batch, args.context, 1)
    # The large model's skinny variants and then the carve-outs recapture its graphs, which the earlier variants'
    # step replays: they go last (a carve-out or an `lt` variant after a skinny variant measures the skinny large
    # model).
    order = {"large_skinny": 1, "large_streamk": 1, "green": 2, "carveout": 3, "lt": 4, "small_r2r": 5}
    small_high = None
    for variant in sorted(args.variants.split(","),
                          key=lambda v: next((k for p, k in order.items() if v.startswith(p)), 0)):
        try:
            if variant == "plain":
                out[variant] = side_by_side(small, large)
            elif variant in ("small_r2r", "small_r2r_torch"):
                runner, bm = build(args.small, router="torch" if variant.endswith("_torch") else "auto")
                now = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)  # its graphs as left
                out[variant] = side_by_side(Step(runner, bm, args.small_batch, args.context, 1), now)
                del runner, bm
            elif variant in ("small_high", "small_cublas"):
                runner, bm = build(args.small, skinny=variant != "small_cublas",
                                   priority="high" if variant == "small_high" else "normal")
                out[variant] = side_by_side(Step(runner, bm, args.small_batch, args.context, 1), large)
                del runner, bm
            elif variant in ("large_skinny", "large_skinny_high"):
                from tokenrouter.runner import skinny_gemm

                # The large model's graphs recaptured (one copy of its weights fits beside the small model's).
                skinny_gemm.LAYER_CAPS = False
                try:
                    large_runner.model.use_skinny_gemm(large_runner.device)
                finally:
                    skinny_gemm.LAYER_CAPS = True
                large_runner.graphs = None
                large_runner.setup_step(None)
                print(f"{args.large}: skinny matmuls up to {large_runner.model.skinny_max_m} rows", flush=True)
                other = small
                if variant == "large_skinny_high":
                    runner, bm = build(args.small, priority="high")
                    other = Step(runner, bm, args.small_batch, args.context, 1)
                    del runner, bm  # (the step holds them)
                skinny_large = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
                out[variant] = side_by_side(other, skinny_large)
                out[variant]["large_skinny_max_m"] = large_runner.model.skinny_max_m
                del other
            elif variant.startswith("large_streamk"):
                if small_high is None:
                    runner, bm = build(args.small, priority="high")
                    small_high = Step(runner, bm, args.small_batch, args.context, 1)
                    del runner, bm
                with short_programs(large_runner, int(variant.removeprefix("large_streamk"))):
                    short = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
                    out[variant] = side_by_side(small_high, short)
                    out[variant]["large_skinny_max_m"] = large_runner.model.skinny_max_m
            elif variant.startswith("green"):
                # The large model's steps on a green context of N SMs (ModelConfig.num_sms), graphs recaptured
                # there; the small model keeps the whole GPU. Its plain stream comes back afterwards.
                from tokenrouter.runner.green import green_stream

                plain_stream = large_runner.stream
                try:
                    large_runner.green_context, large_runner.stream = green_stream(
                        large_runner.device, int(variant.removeprefix("green")))
                    large_runner.graphs = None
                    large_runner.setup_step(None)
                    green = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
                    out[variant] = side_by_side(small, green)
                finally:  # graphs recaptured on the plain stream before the green context goes
                    large_runner.stream, large_runner.graphs = plain_stream, None
                    large_runner.setup_step(None)
                    large_runner.green_context = None
            elif variant.startswith("carveout"):
                # Recapture the large model's graphs with its cuBLAS matmuls told to leave K SMs out.
                torch._C._set_sm_carveout_experimental(int(variant.removeprefix("carveout")))
                try:
                    large_runner.graphs = None
                    large_runner.setup_step(None)
                finally:
                    _carveout_off()
                carved = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
                out[variant] = side_by_side(small, carved)
            elif variant.startswith("lt"):
                # The large model's graphs recaptured with its `cublas_sm_carveout` at K (the deployment's path:
                # cuBLASLt with K SMs carved out; `lt0`: cuBLASLt alone, set here); `_high`: the small model's stream
                # at high priority, to take the SMs left free first.
                carve, _, high = variant.removeprefix("lt").partition("_")
                other = small
                if high:
                    if small_high is None:
                        runner, bm = build(args.small, priority="high")
                        small_high = Step(runner, bm, args.small_batch, args.context, 1)
                        del runner, bm
                    other = small_high
                prev_lib, prev_cfg = torch.backends.cuda.preferred_blas_library(), large_runner.cfg
                try:
                    if not int(carve):
                        torch.backends.cuda.preferred_blas_library("cublaslt")
                    large_runner.cfg = dataclasses.replace(prev_cfg, cublas_sm_carveout=int(carve))
                    large_runner.graphs = None
                    large_runner.setup_step(None)
                finally:
                    large_runner.cfg = prev_cfg
                    torch.backends.cuda.preferred_blas_library(prev_lib)
                carved = Step(large_runner, large_bm, args.large_batch, args.context, args.large_new)
                out[variant] = side_by_side(other, carved)
            else:
                raise SystemExit(f"unknown variant {variant!r}")
        except Exception as exc:  # a variant this torch or GPU does not support: say so, go on
            out[variant] = {"error": f"{type(exc).__name__}: {exc}"}
        report(variant, out[variant])
    return out


@contextlib.contextmanager
def short_programs(runner, per_sm: int):
    """The runner's model on the skinny matmuls, every tuned config of its shapes turned into stream-K over
    `per_sm` programs per SM (tiles as tuned; the programs count is a runtime argument, so nothing recompiles
    between counts), its graphs recaptured; the table and the graphs restored afterwards."""
    import torch

    from tokenrouter.runner import skinny_gemm as sg
    from tokenrouter.runner.model import layer_shapes

    table = sg._table(runner.device)
    saved = dict(table.matmuls)
    programs = per_sm * torch.cuda.get_device_properties(runner.device).multi_processor_count
    for n, k in layer_shapes(runner.arch):
        for bm in sg.BLOCK_M_SIZES:
            e = table.matmuls.get(sg.table_key(n, k, bm))
            if e is not None:
                cfg = dataclasses.replace(e.config, programs=programs, split_k=1)
                table.matmuls[sg.table_key(n, k, bm)] = sg.TunedEntry(cfg, 0.0, e.baseline_us)  # (0: "it pays")
    sg.LAYER_CAPS = False
    try:
        runner.model.use_skinny_gemm(runner.device)
        runner.graphs = None
        runner.setup_step(None)
        print(f"{runner.cfg.name}: stream-K over {programs} programs, up to {runner.model.skinny_max_m} rows",
              flush=True)
        yield
    finally:
        table.matmuls.clear()
        table.matmuls.update(saved)
        sg.LAYER_CAPS = True
        runner.model.use_skinny_gemm(runner.device)
        runner.graphs = None
        runner.setup_step(None)


def _carveout_off() -> None:
    import torch

    try:
        torch._C._set_sm_carveout_experimental(None)
    except TypeError:  # a torch whose setter takes only an int
        torch._C._set_sm_carveout_experimental(0)


def report(variant: str, r: dict) -> None:
    if "error" in r:
        print(f"{variant}: {r['error']}", flush=True)
        return
    if r.get("small_window_ms_per_step", 0) > 1.5 * r["small_beside_ms"]:
        print(f"{variant}: the small model stepped through only part of the window ({r['small_steps']} steps, "
              f"{r['small_window_ms_per_step']:.2f} ms each over it): its large 'beside' time is mostly alone",
              flush=True)
    print(f"{variant}: small {r['small_alone_ms']:.2f} -> {r['small_beside_ms']:.2f} ms ({r['small_slowdown']:.2f}x), "
          f"large {r['large_alone_ms']:.2f} -> {r['large_beside_ms']:.2f} ms ({r['large_slowdown']:.2f}x), "
          f"together {r['work_together']:.2f}, large outputs finite: {r.get('large_finite')}", flush=True)


# Two processes under MPS: this process orchestrates (it never touches CUDA, so that both workers are MPS clients
# of the daemon it starts); the small worker measures, a large worker per percentage loops its step.

def large_worker(args) -> None:
    """Capture the large step, print 'ready', then on 'go' replay it for --seconds and print the median ms of
    the steps in the middle half of that window (the small worker steps through all of it but its edges)."""
    import torch

    runner, bm = build(args.large)
    step = Step(runner, bm, args.large_batch, args.context, args.large_new)
    t_alone = alone(step)
    print(json.dumps({"ready": True, "alone_ms": t_alone,
                      "sms_seen": torch.cuda.get_device_properties(0).multi_processor_count}), flush=True)
    sys.stdin.readline()
    times, finite, t0 = [], True, time.perf_counter()
    while (now := time.perf_counter() - t0) < args.seconds:
        ev = timed(step, 1)
        torch.cuda.synchronize()
        finite &= step.finite()  # every step, outside its events (a fault under an SM limit came and went)
        if args.seconds / 4 <= now <= 3 * args.seconds / 4:
            times += [a.elapsed_time(b) for a, b in zip(ev, ev[1:])]
    print(json.dumps({"beside_ms": statistics.median(times), "finite": finite}), flush=True)


def small_worker(args) -> dict:
    """Measure the small step alone, then beside a large worker at each MPS percentage."""
    runner, bm = build(args.small)
    small = Step(runner, bm, args.small_batch, args.context, 1)
    out = {}
    for pct in args.mps.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--role", "large"]  # (the last --role wins)
        env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=pct)  # read when the worker's CUDA starts
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = _json_line(proc)
            if ready is None:
                raise RuntimeError(f"large worker at {pct} % exited ({proc.wait()}) before it was ready")
            t_small = alone(small)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(args.seconds / 10)
            beside = []
            t_end = time.perf_counter() + 0.8 * args.seconds
            while time.perf_counter() < t_end:
                beside.append(alone(small, n=10))
            done = _json_line(proc)
            if done is None:
                raise RuntimeError(f"large worker at {pct} % exited ({proc.wait()}) while stepping")
            out[f"mps{pct}"] = result(t_small, statistics.median(beside), ready["alone_ms"], done["beside_ms"],
                                      large_finite=done["finite"], large_sms_seen=ready["sms_seen"])
        except Exception as exc:
            out[f"mps{pct}"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            proc.kill()
            proc.wait()
        report(f"mps{pct}", out[f"mps{pct}"])
    return out


def _json_line(proc) -> dict | None:
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    return None


def run_mps(args) -> dict:
    from tokenrouter.serving import mps

    started = not mps.running()
    if started:
        mps.start()
    try:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--role", "small"]  # the same options, as a worker
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        print(proc.stdout, end="")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(lines[-1].removeprefix("RESULT ")) if lines else {"error": f"small worker {proc.returncode}"}
    finally:
        if started:
            mps.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="qwen3-0.6b")
    ap.add_argument("--large", default="qwen3-32b")
    ap.add_argument("--small-batch", type=int, default=4, help="the small model's decode batch (served C=8: ~3)")
    ap.add_argument("--large-batch", type=int, default=4, help="the large model's batch (served C=8: ~3.4)")
    ap.add_argument("--large-new", type=int, default=8, help="tokens per large row: the extend a handoff brings")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--variants", default="plain,small_high,small_cublas,carveout8,carveout16,carveout32")
    ap.add_argument("--mps", default="", help="comma-separated MPS percentages for the large model's process")
    ap.add_argument("--seconds", type=float, default=4.0, help="(MPS) how long the large worker steps")
    ap.add_argument("--role", choices=["small", "large"], help=argparse.SUPPRESS)
    ap.add_argument("--kv-tokens", type=int, help="KV pool tokens of each model (default: 50,000)")
    ap.add_argument("--depth", type=int,
                    help="replays each model has queued at once side by side (default: DEPTH; 0: all at once)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.kv_tokens:
        KV_TOKENS.update(dict.fromkeys(KV_TOKENS, args.kv_tokens))
    if args.depth is not None:
        global DEPTH  # (side_by_side's default)
        DEPTH = args.depth
    if args.role == "large":
        large_worker(args)
        return
    if args.role == "small":
        print("RESULT " + json.dumps(small_worker(args)), flush=True)
        return
    results = run_mps(args) if args.mps else run_inprocess(args)
    record = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
