"""Where a running engine's decoding loops spend their host time: each model's step, function by function.

    python perf/profile_loop.py --config config/random/qwen3-0.6b_qwen3-32b.yaml --concurrency 1,8
    python perf/profile_loop.py --config config/random/tiny-small_tiny-large.yaml --concurrency 1 \
        --num-requests 4 --output-len 64       # CPU plumbing run

The deployment runs in process in background mode (one loop thread per model, as `bench_engine.py` runs it),
closed loop at each concurrency after one warm-up round. Every subserver's `step` (schedule -> prepare and
launch -> GPU wait -> route and commit) runs under cProfile, enabled in its own loop thread for the measured
requests only. Printed per model: the steps, their mean wall time with and without the profiler, and the
functions that took the most time of their own (tottime) and in total (cumtime) per step. cProfile roughly
doubles pure-Python costs; the unprofiled mean says what a step really takes. Also: the host time of one
`CUDAGraph.replay()` call for the smallest captured shape of each model (the launch alone, the GPU drained
before each call).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time
from pathlib import Path

from _common import machine_info, machine_line, parse_concurrency
from bench_engine import closed_loop, make_prompts

from tokenrouter import Engine, SamplingParams
from tokenrouter.config import load_config


class StepProfiler:
    """cProfile around every `step` of one subserver while `on` is set (enabled in the calling thread: the
    subserver's own loop)."""

    def __init__(self, sub) -> None:
        self.sub, self.profile, self.on = sub, cProfile.Profile(), threading.Event()
        self.steps, self.seconds = 0, 0.0
        self._step = sub.step
        sub.step = self.step

    def step(self) -> int:
        if not self.on.is_set():
            return self._step()
        t0 = time.perf_counter()
        self.profile.enable()
        try:
            return self._step()
        finally:
            self.profile.disable()
            self.steps += 1
            self.seconds += time.perf_counter() - t0

    def report(self, top: int) -> str:
        lines = [f"## {self.sub.name}: {self.steps} steps, {1e3 * self.seconds / max(self.steps, 1):.3f} ms a step "
                 "under the profiler"]
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            stats = pstats.Stats(self.profile, stream=buf)
            stats.sort_stats(key).print_stats(top)
            lines += ["", f"### by {key} (seconds over all profiled steps)", "", "```", buf.getvalue().strip(), "```"]
        return "\n".join(lines)


def replay_host_us(engine: Engine, iters: int = 200) -> dict[str, float]:
    """Per model with captured graphs: median host microseconds of one replay() of its smallest shape."""
    import torch

    out = {}
    for name, sub in engine.subservers.items():
        graphs = sub.runner.graphs
        if graphs is None or not graphs.graphs:
            continue
        graph = graphs.graphs[min(graphs.graphs)]
        times = []
        with torch.cuda.stream(sub.runner.stream):
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        out[name] = 1e6 * sorted(times)[len(times) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-requests", type=int, default=16, help="measured requests per concurrency")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, help="also write the report here (markdown)")
    args = ap.parse_args()

    cfg = load_config(args.config)
    engine = Engine(cfg)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.entry.runner.arch.vocab_size
    report = [f"# Loop profile: {args.config}", "", f"- machine: {machine_line(machine_info())}",
              f"- workload: {args.prompt_len}-token prompts, {args.output_len} output tokens, greedy"]
    profilers = {name: StepProfiler(sub) for name, sub in engine.subservers.items()}
    engine.start()
    try:
        for i, c in enumerate(parse_concurrency(ap, args.concurrency)):
            warm = make_prompts(c, args.prompt_len, vocab, set(), seed=1000 + i)
            closed_loop(engine, warm, c, params, timeout_s=600)
            # The same requests unprofiled, then profiled.
            prompts = make_prompts(args.num_requests, args.prompt_len, vocab, set(), seed=i)
            before = {n: s.num_steps for n, s in engine.subservers.items()}
            t0 = time.perf_counter()
            res = closed_loop(engine, prompts, c, params, timeout_s=600)
            plain_s = time.perf_counter() - t0
            for p in profilers.values():
                p.on.set()
            t0 = time.perf_counter()
            closed_loop(engine, make_prompts(args.num_requests, args.prompt_len, vocab, set(), seed=500 + i), c,
                        params, timeout_s=600)
            prof_s = time.perf_counter() - t0
            for p in profilers.values():
                p.on.clear()
            tokens = sum(t.tokens for t in res.tracks)
            report += ["", f"# Concurrency {c}", "",
                       f"Unprofiled: {tokens / plain_s:.1f} output tok/s; profiled: "
                       f"{args.num_requests * args.output_len / prof_s:.1f} tok/s."]
            for name, sub in engine.subservers.items():
                n = sub.num_steps - before[name]
                report.append(f"- {name}: {n} steps unprofiled")
            for p in profilers.values():
                report += ["", p.report(args.top)]
                p.profile, p.steps, p.seconds = cProfile.Profile(), 0, 0.0
        if engine.entry.runner.device.type == "cuda":  # the loops idle now: nothing else replays
            report += ["", "Host time of one CUDAGraph.replay() (smallest shape), us: "
                       + ", ".join(f"{k} {v:.1f}" for k, v in replay_host_us(engine).items())]
    finally:
        engine.shutdown()
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
