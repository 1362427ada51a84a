"""Where a running engine's decoding loops spend their host time: each model's step, function by function.

    python perf/profile_loop.py --config config/random/qwen3-0.6b_qwen3-32b.yaml --concurrency 1,8
    python perf/profile_loop.py --config config/random/tiny-small_tiny-large.yaml --concurrency 1 \
        --num-requests 4 --output-len 64       # CPU plumbing run

The deployment runs in process in background mode (one loop thread per model, as `bench_engine.py` runs it),
closed loop at each concurrency after one warm-up round. One model's `step` (`--model`, the entry model by
default: schedule -> prepare and launch -> GPU wait -> route and commit) runs under cProfile, enabled in its
loop thread for the measured requests only. (One model at a time: from Python 3.12 on, cProfile is one
profiler per process, and while it is on it also records the other threads.) Printed: the steps, their mean
wall time under the profiler, and the functions that took the most time of their own (tottime) and in total
(cumtime; a graph replay's host cost is the `replay` method's line). cProfile roughly doubles pure-Python
costs: the unprofiled throughput beside the profiled one says by how much the profiler slowed the loop.
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


class ReplayClock:
    """Host time of every CUDA graph replay (the launch call's wall time, not the GPU's), per thread, while `on`:
    torch.cuda.CUDAGraph.replay wrapped for the process. Measured without cProfile."""

    def __init__(self) -> None:
        import torch

        self.on = False
        self.seconds: dict[str, list[float]] = {}
        self._replay = torch.cuda.CUDAGraph.replay
        clock = self

        def replay(graph) -> None:
            if not clock.on:
                return clock._replay(graph)
            t0 = time.perf_counter()
            clock._replay(graph)
            clock.seconds.setdefault(threading.current_thread().name, []).append(time.perf_counter() - t0)

        torch.cuda.CUDAGraph.replay = replay

    def lines(self) -> list[str]:
        out = []
        for thread, times in sorted(self.seconds.items()):
            times = sorted(times)
            out.append(f"- graph replay host time, thread {thread}: {len(times)} replays, median "
                       f"{1e6 * times[len(times) // 2]:.1f} us, p90 {1e6 * times[int(0.9 * (len(times) - 1))]:.1f} us")
        self.seconds = {}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-requests", type=int, default=16, help="measured requests per concurrency")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--model", help="the model whose steps are profiled (default: the entry model)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, help="also write the report here (markdown)")
    args = ap.parse_args()

    cfg = load_config(args.config)
    engine = Engine(cfg)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.entry.runner.arch.vocab_size
    report = [f"# Loop profile: {args.config}", "", f"- machine: {machine_line(machine_info())}",
              f"- workload: {args.prompt_len}-token prompts, {args.output_len} output tokens, greedy"]
    profiled = args.model or cfg.entry
    if profiled not in engine.subservers:
        ap.error(f"--model {profiled!r} is not a model of the deployment ({', '.join(engine.subservers)})")
    profilers = {profiled: StepProfiler(engine.subservers[profiled])}
    replays = ReplayClock()
    engine.start()
    try:
        for i, c in enumerate(parse_concurrency(ap, args.concurrency)):
            warm = make_prompts(c, args.prompt_len, vocab, set(), seed=1000 + i)
            closed_loop(engine, warm, c, params, timeout_s=600)
            # The same requests unprofiled, then profiled.
            prompts = make_prompts(args.num_requests, args.prompt_len, vocab, set(), seed=i)
            before = {n: s.num_steps for n, s in engine.subservers.items()}
            t0 = time.perf_counter()
            replays.on = True
            res = closed_loop(engine, prompts, c, params, timeout_s=600)
            replays.on = False
            plain_s = time.perf_counter() - t0
            plain_steps = {n: s.num_steps - before[n] for n, s in engine.subservers.items()}
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
            for name, n in plain_steps.items():
                report.append(f"- {name}: {n} steps unprofiled")
            report += replays.lines()
            for p in profilers.values():
                report += ["", p.report(args.top)]
                p.profile, p.steps, p.seconds = cProfile.Profile(), 0, 0.0
    finally:
        engine.shutdown()
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
