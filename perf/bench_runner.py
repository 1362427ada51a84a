"""Runner benchmark on one GPU: Qwen3-0.6B / 8B / 32B with dummy weights (real shapes, bf16).

Measures, per model: decode step latency at several batch sizes and contexts, extend latency for short
suffixes (what a request returning from another model costs), prefill throughput, and each decode time as
a ratio to the weight-read floor (weight bytes / device-to-device copy bandwidth measured in this run).
Eager mode only: CUDA graphs are not implemented yet, so host overhead is part of every figure.

    python perf/bench_runner.py --out perf/results/runner_h200.json [--models qwen3-0.6b,qwen3-32b]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends"))

from tokenrouter.config import ModelConfig  # noqa: E402
from tokenrouter.engine.block_manager import BlockManager  # noqa: E402
from tokenrouter.engine.scheduler import ScheduledChunk  # noqa: E402
from tokenrouter.engine.sequence import Sequence  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402
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
    """Median seconds of runner.forward over `iters` runs (KV content is irrelevant to timing)."""
    return median_gpu_seconds(lambda: runner.forward(chunks), iters=iters, warmup=3)


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


def release(bm: BlockManager, chunks: list[ScheduledChunk]) -> None:
    for c in chunks:
        bm.release(c.seq)


def bench_model(name: str, bandwidth: float, attention: str, quick: bool) -> dict:
    path = ROOT / "perf" / "models" / name
    kv_tokens = {"qwen3-0.6b": 600_000, "qwen3-8b": 300_000, "qwen3-32b": 160_000}[name]
    cfg = ModelConfig(name=name, path=str(path), dtype="bfloat16", device="cuda:0", load_format="dummy",
                      kv_cache_tokens=kv_tokens, max_model_len=16384, attention=attention)
    runner = ModelRunner(cfg, default_kv_tokens=kv_tokens)
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    arch = runner.arch
    # A decode step reads every weight once except the input embedding (only B rows of it); a tied
    # embedding is read in full as the LM head.
    floor_bytes = arch.weight_bytes(2) - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size * 2)
    floor = floor_bytes / bandwidth
    iters = 5 if quick else 20
    out: dict = {"model": name, "attention": runner.attn_backend.name, "weight_read_floor_ms": floor * 1e3,
                 "decode": [], "extend": [], "prefill": []}
    for context in (1024, 8192):
        for batch in (1, 4, 8, 16, 32, 64):
            if batch * (context + 1) > runner.num_blocks * runner.block_size:
                continue
            chunks = make_chunks(bm, batch, context, 1, arch.vocab_size)
            t = time_forward(runner, chunks, iters)
            release(bm, chunks)
            out["decode"].append({"batch": batch, "context": context, "ms": t * 1e3, "x_floor": t / floor})
            print(f"{name} decode b={batch:3d} ctx={context:5d}: {t * 1e3:7.2f} ms ({t / floor:.2f}x floor)",
                  flush=True)
    for total in (1, 8, 16, 32, 64, 80):
        batch = min(8, total)
        new = max(1, total // batch)
        chunks = make_chunks(bm, batch, 1024, new, arch.vocab_size)
        t = time_forward(runner, chunks, iters)
        release(bm, chunks)
        out["extend"].append({"batch": batch, "suffix": new, "tokens": batch * new, "ms": t * 1e3})
        print(f"{name} extend {batch}x{new} on 1k: {t * 1e3:7.2f} ms", flush=True)
    for length in (100, 8192):
        chunks = make_chunks(bm, 1, 0, length, arch.vocab_size)
        t = time_forward(runner, chunks, max(3, iters // 2))
        release(bm, chunks)
        out["prefill"].append({"tokens": length, "ms": t * 1e3, "tok_per_s": length / t})
        print(f"{name} prefill {length}: {t * 1e3:7.2f} ms ({length / t:,.0f} tok/s)", flush=True)
    bm.check_integrity([])
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def markdown(results: dict) -> str:
    lines = [f"# Runner benchmark ({results['device']}, {results['date']})", "",
             f"Command: `{results['command']}`", "",
             f"Device-to-device copy bandwidth (read + write): {results['copy_bandwidth_tb_s']:.2f} TB/s. "
             "Eager mode (no CUDA graphs yet).", ""]
    for m in results["models"]:
        title = f"## {m['model']} (attention: {m['attention']}, weight-read floor {m['weight_read_floor_ms']:.2f} ms)"
        lines += [title, "", "| decode batch | context | ms/step | x floor |", "|---|---|---|---|"]
        lines += [f"| {d['batch']} | {d['context']} | {d['ms']:.2f} | {d['x_floor']:.2f} |" for d in m["decode"]]
        lines += ["", "| extend | tokens | ms |", "|---|---|---|"]
        lines += [f"| {e['batch']} x {e['suffix']} | {e['tokens']} | {e['ms']:.2f} |" for e in m["extend"]]
        lines += ["", "| prefill tokens | ms | tok/s |", "|---|---|---|"]
        lines += [f"| {p['tokens']} | {p['ms']:.1f} | {p['tok_per_s']:,.0f} |" for p in m["prefill"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3-32b")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "runner.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_runner needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
               "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
               "copy_bandwidth_tb_s": bw / 1e12, "models": []}
    for name in args.models.split(","):
        results["models"].append(bench_model(name, bw, args.attention, args.quick))
        Path(args.out).write_text(json.dumps(results, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
