"""Served throughput: a closed loop of gRPC streaming clients against the Triton deployment, optionally
side by side with the in-process engine on the same workload.

    # against a running server (e.g. `tokenrouter serve --config CFG`), 100-token prompts, 256 tokens out
    python perf/bench_served.py --url 127.0.0.1:8001 --config CFG --concurrency 1,8,16 \
        --prompt-len 100 --output-len 256 --out served_random
    # join with perf/bench_engine.py's results for the same workload: served / in-process per concurrency
    python perf/bench_served.py --compare perf/results/served_random.json perf/results/engine_random.json \
        --out served_vs_engine_random

Workload: for each concurrency C, `--num-requests` (default max(16, 4 x C)) requests, C in flight at a
time (a finished one is replaced at once), after one warm-up round of C short requests. A prompt is
`--prompt-len` random token ids (seeded, fresh per concurrency; perf/bench_engine.py draws the same shapes)
decoded with the deployment's tokenizer; the benchmark tokenizer of dummy-weight deployments
(`tokenrouter make-bench-tokenizer`) decodes every id to its own piece, so the server re-encodes exactly
those ids. Every request generates exactly `--output-len` tokens (`ignore_eos`, greedy).

Measured per C: output tok/s (all output tokens / first send -> last final response), per-user tok/s
(output tokens / (E2E - TTFT), the mean over requests), TTFT and E2E latency (mean, p50, p99), TTFT by the model
that made the first token, the large model's token share and handoffs per request (from each final response's
routing_stats), failures, and the mean number of requests in flight over the run (the sum of their E2E times /
the run's span): below C by what the run's ramp and drain took. A workload whose requests differ widely in length
(R2R's untrained router sends some requests to the large model for every token) drains behind its longest, so its
output tok/s is then not C's steady state (perf/results/r2r_served_h100_2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import command_line, machine_info, machine_line, now_iso, parse_concurrency, results_path
from soak import stream_inputs


def make_prompts(config: str, n: int, prompt_len: int, seed: int) -> list[str]:
    """n prompts of prompt_len random ids from the deployment's vocabulary, as text (see the module doc)."""
    from tokenrouter.config import load_config
    from tokenrouter.tokenizer import load_tokenizer

    cfg = load_config(config)
    tok = load_tokenizer(cfg.tokenizer_path)
    special = set(tok.all_special_ids)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids = []
        while len(ids) < prompt_len:
            t = rng.randrange(len(tok))
            if t not in special:
                ids.append(t)
        prompts.append(tok.decode(ids))
    return prompts


def _one(client: Any, responses: queue.Queue, prompt: str, output_len: int, timeout: float,
         sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed request on an open stream (greedy unless `sampling`): timings, the text, and what its
    final response says."""
    start = time.monotonic()  # the server's clock too (perf/timeline.py events): requests join its steps by time
    inputs = stream_inputs(prompt, output_len, "exclude_input_in_output", "return_num_output_tokens",
                           "return_routing_stats", sampling=sampling)
    client.async_stream_infer("tokenrouter", inputs, enable_empty_final_response=True)
    first = None
    pieces: list[bytes] = []
    while True:
        result, error = responses.get(timeout=timeout)
        now = time.monotonic()
        if error is not None:
            return {"error": str(error)}
        text = result.as_numpy("text_output")
        if text is not None:
            pieces.extend(x for x in text.reshape(-1) if len(x))
        if first is None and pieces:
            first = now
        if result.get_response().parameters["triton_final_response"].bool_param:
            n = result.as_numpy("num_output_tokens")
            stats = result.as_numpy("routing_stats")
            return {
                "start": start, "ttft": (first or now) - start, "e2e": now - start, "end": now,
                "tokens": int(n[0]) if n is not None else 0,
                "routing": json.loads(stats[0]) if stats is not None else {},
                "text": b"".join(pieces).decode("utf-8", errors="replace"),
            }


def run_point(url: str, prompts: list[str], concurrency: int, output_len: int, timeout: float) -> list[dict]:
    import tritonclient.grpc as grpcclient

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for p in prompts:
        todo.put(p)
    results: list[dict] = []
    lock = threading.Lock()

    def work() -> None:
        client = grpcclient.InferenceServerClient(url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            while True:
                try:
                    prompt = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    r = _one(client, responses, prompt, output_len, timeout)
                except queue.Empty:
                    r = {"error": f"no response within {timeout:.0f} s"}
                with lock:
                    results.append(r)
        finally:
            client.stop_stream()
            client.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summarize(concurrency: int, rows: list[dict]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    errors = [r["error"] for r in rows if "error" in r]
    out: dict[str, Any] = {"concurrency": concurrency, "requests": len(rows), "errors": len(errors),
                           "first_error": errors[0] if errors else None}
    if not ok:
        return out
    span = max(r["end"] for r in ok) - min(r["start"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    ttft = np.array([r["ttft"] for r in ok]) * 1000
    e2e = np.array([r["e2e"] for r in ok]) * 1000
    per_user = [r["tokens"] / (r["e2e"] - r["ttft"]) for r in ok if r["e2e"] > r["ttft"]]
    large = [r["routing"].get("large_token_share") for r in ok if r["routing"]]
    handoffs = [r["routing"].get("handoffs", 0) for r in ok if r["routing"]]
    out.update({
        "output_tokens": tokens, "duration_s": span, "output_tok_s": tokens / span,
        "per_user_tok_s": float(np.mean(per_user)) if per_user else None,
        "ttft_ms_mean": float(ttft.mean()), "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "e2e_ms_mean": float(e2e.mean()), "e2e_ms_p50": float(np.percentile(e2e, 50)),
        "e2e_ms_p99": float(np.percentile(e2e, 99)),
        "large_share": float(np.mean(large)) if large else None,
        "handoffs_per_request": float(np.mean(handoffs)) if handoffs else None,
        "mean_in_flight": float(e2e.sum() / 1000 / span),
        "ttft_by_first_token_model": ttft_by_first_token_model(ok),
    })
    return out


def ttft_by_first_token_model(ok: list[dict]) -> dict[str, dict[str, float]]:
    """TTFT count / p50 / p99 ms per model that made the request's first token. A first token routed to the large
    model waits for that model's current step and its prefill of the whole prompt: a TTFT tail that routing makes
    by design, kept apart from one a compile or a capture would make (issue 11, point 4)."""
    groups: dict[str, list[float]] = {}
    for r in ok:
        groups.setdefault(r["routing"].get("first_token_model") or "unknown", []).append(r["ttft"] * 1000)
    return {m: {"requests": len(v), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
            for m, v in sorted(groups.items())}


def per_request(rows: list[dict]) -> list[dict[str, Any]]:
    """Each finished request in start order, with the server's id for it, so that a slow one can be found in the
    server's timeline (perf/timeline.py's events name it, on the same monotonic clock)."""
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["start"])
    return [{"request_id": r["routing"].get("request_id"), "start_monotonic": r["start"], "ttft_ms": r["ttft"] * 1000,
             "e2e_ms": r["e2e"] * 1000,
             "tokens": r["tokens"], "handoffs": r["routing"].get("handoffs"),
             "first_token_model": r["routing"].get("first_token_model"),
             "large_share": r["routing"].get("large_token_share")} for r in ok]


def _fmt(v: Any, digits: int = 1) -> str:
    return "n/a" if v is None else (f"{v:,.{digits}f}" if isinstance(v, float) else str(v))


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# {report['title']}", "", f"- Command: `{report['command']}`", f"- Date: {report['date']}",
             f"- Machine: {report['machine_line']}", f"- Workload: {json.dumps(report['workload'])}", ""]
    if "comparison" in report:
        lines += ["| C | served tok/s | in-process tok/s | served / in-process | served TTFT p50 ms | "
                  "in-process TTFT mean ms | served errors |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["comparison"]:
            lines.append(f"| {r['concurrency']} | {_fmt(r['served_tok_s'])} | {_fmt(r['engine_tok_s'])} | "
                         f"{_fmt(r['ratio'], 3)} | {_fmt(r['served_ttft_ms_p50'])} | "
                         f"{_fmt(r['engine_ttft_ms_mean'])} | {r['served_errors']} |")
    else:
        lines += ["| C | requests | errors | output tok/s | per-user tok/s | TTFT mean / p50 / p99 ms | "
                  "E2E mean / p99 ms | large share | handoffs/req | mean in flight |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["results"]:
            point = f"{r['concurrency']} (run {r['run']})" if r.get("run") else str(r["concurrency"])
            lines.append(
                f"| {point} | {r['requests']} | {r['errors']} | {_fmt(r.get('output_tok_s'))} | "
                f"{_fmt(r.get('per_user_tok_s'))} | {_fmt(r.get('ttft_ms_mean'))} / {_fmt(r.get('ttft_ms_p50'))} / "
                f"{_fmt(r.get('ttft_ms_p99'))} | {_fmt(r.get('e2e_ms_mean'))} / {_fmt(r.get('e2e_ms_p99'))} | "
                f"{_fmt(r.get('large_share'), 3)} | {_fmt(r.get('handoffs_per_request'))} | "
                f"{_fmt(r.get('mean_in_flight'), 2)} |")
        split = [(r, m, g) for r in report["results"] for m, g in (r.get("ttft_by_first_token_model") or {}).items()]
        if split:
            lines += ["", "TTFT by the model that made the first token:", "",
                      "| C | run | first token by | requests | TTFT p50 ms | TTFT p99 ms |",
                      "|---:|---:|---|---:|---:|---:|"]
            lines += [f"| {r['concurrency']} | {r.get('run', 0)} | {m} | {g['requests']} | {_fmt(g['p50'])} | "
                      f"{_fmt(g['p99'])} |" for r, m, g in split]
    return "\n".join(lines) + "\n"


def compare(served_path: str, engine_path: str) -> dict[str, Any]:
    served, engine = json.loads(Path(served_path).read_text()), json.loads(Path(engine_path).read_text())
    by_c = {r["concurrency"]: r for r in engine["results"] if r.get("variant", "routed") == "routed"}
    rows = []
    for r in served["results"]:
        e = by_c.get(r["concurrency"])
        if e is None:
            continue
        s_tok, e_tok = r.get("output_tok_s"), e.get("output_tok_s")
        rows.append({"concurrency": r["concurrency"], "served_tok_s": s_tok, "engine_tok_s": e_tok,
                     "ratio": s_tok / e_tok if s_tok and e_tok else None,
                     "served_ttft_ms_p50": r.get("ttft_ms_p50"), "engine_ttft_ms_mean": e.get("ttft_ms_mean"),
                     "served_errors": r["errors"]})
    return {"title": "Served (Triton, gRPC streaming) vs in-process engine, same workload",
            "workload": served["workload"], "served": served_path, "engine": engine_path, "comparison": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="gRPC address of the running server (required, unless --compare)")
    p.add_argument("--config", help="the deployment YAML the server runs, for its tokenizer (required, unless "
                   "--compare)")
    p.add_argument("--compare", nargs=2, metavar=("SERVED_JSON", "ENGINE_JSON"),
                   help="compare a served results JSON with an in-process one (perf/bench_engine.py)")
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--num-requests", type=int, default=0, help="per point; 0: max(16, 4 x C)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured rounds of C short requests per point (0: measure a fresh server's first requests)")
    p.add_argument("--repeat", type=int, default=1, help="measured runs per point (fresh prompts each run)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for any one response")
    p.add_argument("--out", help="results name (a bare name goes to perf/results/); required")
    p.add_argument("--write-prompts", metavar="FILE",
                   help="only write --num-requests prompts (JSON list) for other tools, e.g. perf/perf_analyzer.py")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.repeat < 1:
        p.error("--warmup must be >= 0 and --repeat >= 1")
    if args.write_prompts:
        if not args.config:
            p.error("--write-prompts needs --config")
        prompts = make_prompts(args.config, args.num_requests or 16, args.prompt_len, args.seed)
        Path(args.write_prompts).write_text(json.dumps(prompts))
        return 0
    if not args.out:
        p.error("--out is required")
    info = machine_info()
    meta = {"tool": "perf/bench_served.py", "command": command_line(), "date": now_iso(), "machine": info,
            "machine_line": machine_line(info)}
    path = results_path(args.out, ".json")

    def write(report: dict[str, Any]) -> None:
        report.update(meta)
        path.write_text(json.dumps(report, indent=2) + "\n")
        path.with_suffix(".md").write_text(markdown(report))

    if args.compare:
        report = compare(*args.compare)
        write(report)
    else:
        if not (args.url and args.config):
            p.error("--url and --config are required (or --compare)")
        report = {"title": "Served throughput (Triton deployment, gRPC streaming)", "config": args.config,
                  "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                               "num_requests": args.num_requests or "max(16, 4 x C)", "seed": args.seed},
                  "results": []}
        report["workload"].update(warmup_rounds=args.warmup, repeat=args.repeat)
        for c in parse_concurrency(p, args.concurrency):
            n = args.num_requests or max(16, 4 * c)
            prompts = make_prompts(args.config, n + c, args.prompt_len, args.seed + c)
            for _ in range(args.warmup):  # not measured
                run_point(args.url, prompts[:c], c, 8, args.timeout)
            for run in range(args.repeat):
                # Fresh prompts per run: the same ones would hit the prefix cache the previous run filled.
                todo = prompts[c:] if run == 0 else make_prompts(args.config, n, args.prompt_len,
                                                                 args.seed + c + 7919 * run)
                # The monotonic window lets `perf/timeline.py served --since/--until` cut this run's steps
                # out of a served timeline (CLOCK_MONOTONIC: one clock for the machine's processes).
                since = time.monotonic()
                rows = run_point(args.url, todo, c, args.output_len, args.timeout)
                row = summarize(c, rows)
                row.update(run=run, monotonic_since=since, monotonic_until=time.monotonic(),
                           per_request=per_request(rows))
                report["results"].append(row)
                write(report)  # after every run: a run cut short keeps what it measured
                print(f"C={c} run {run}: {_fmt(row.get('output_tok_s'))} tok/s, TTFT p50 / p99 "
                      f"{_fmt(row.get('ttft_ms_p50'))} / {_fmt(row.get('ttft_ms_p99'))} ms, large share "
                      f"{_fmt(row.get('large_share'), 3)}, {_fmt(row.get('mean_in_flight'), 2)} in flight, "
                      f"{row['errors']} errors; TTFT p50 / p99 ms by first-token "
                      "model: " + ", ".join(f"{m} {_fmt(g['p50'])} / {_fmt(g['p99'])} ({g['requests']})"
                                            for m, g in (row.get("ttft_by_first_token_model") or {}).items()),
                      flush=True)
    print(markdown(report))
    failed = any(r.get("errors") for r in report.get("results", [])) or any(
        r["served_errors"] for r in report.get("comparison", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
