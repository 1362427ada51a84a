"""perf_analyzer against the decoupled `tokenrouter` Triton model (gRPC streaming), one run per concurrency.

    # against a running server (gRPC port)
    python perf/perf_analyzer.py --url 127.0.0.1:8001 --concurrency 1,2,4,8,16 --max-tokens 64 \
        --out perf/results/pa_r2r.csv
    # or start the server for the run, measure, stop it
    python perf/perf_analyzer.py --serve config/r2r/tiny-small_tiny-large.yaml --concurrency 1,2,4 \
        --max-tokens 32 --out perf/results/pa_r2r_tiny_cpu.csv

Writes perf_analyzer's own CSV (one row per concurrency, its columns unchanged) and `<out>.json`, a
summary with what perf_analyzer cannot know about an LLM stream.

What is measured, exactly:
- perf_analyzer's `Inferences/Second` is completed *requests* per second; `Response Throughput` is stream
  *responses* per second. Our model streams one response per engine step per request that produced new
  text (a step's committed tokens as one text delta), then one final response that is usually empty and
  carries `num_output_tokens`. Responses per request is therefore about max_tokens + 1, but not exactly:
  a delta can hold several tokens (an incomplete UTF-8 character is held back until it completes; a handoff
  can commit several tokens at once) and a token that decodes to no text sends nothing. So response
  throughput only approximates output token throughput, and this script does not use it for tokens.
- Output tokens/s = the tokens of requests whose final response arrived inside perf_analyzer's
  measurement windows (each request's own `num_output_tokens`, from its final response in the profile
  export), divided by the windows' total duration. `output_tokens_per_s_pa` cross-checks it as
  perf_analyzer's request throughput times the mean tokens per request. Prompts use `ignore_eos`, so
  every request produces exactly `--max-tokens` tokens unless it reaches the context limit.
- Every figure uses the requests whose final response arrived in perf_analyzer's last three measurement
  windows (the ones its CSV averages), so `output_tokens_per_s` and `output_tokens_per_s_pa` agree.
- perf_analyzer 2.51's latency columns in this mode are whole-request latencies (send -> final response;
  they equal E2E below, although its log says it uses the first response). Time to first token comes from
  the profile export: TTFT is send -> first response, i.e. the first *text* (a first token that is an
  incomplete UTF-8 character arrives together with the next), as the client sees it (gRPC and the Python
  backend included). ITL per request is genai-perf's (E2E - TTFT) / (tokens - 1), averaged over requests.
- perf_analyzer 2.51 exports per-response outputs unreliably (an output a response lacks is exported
  with a stale or uninitialized value), so only the final response's num_output_tokens is read, and it
  must lie in [1, max_tokens]; otherwise max_tokens is assumed and counted in
  `requests_without_token_count`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    check_server,
    command_line,
    machine_info,
    machine_line,
    now_iso,
    parse_concurrency,
    results_path,
    serving,
)

# Prompts for the tiny local tokenizer (trained on Python sources); any tokenizer can encode them.
BUILTIN_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "with open(path) as f:\n    for line in f:",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "try:\n    import json\nexcept ImportError:",
    "# Compute the greatest common divisor\ndef gcd(a, b):",
]


def load_prompts(path: str | None) -> list[str]:
    """`.json`: a list of strings; `.jsonl`: one string or {"prompt"|"text_input"|"text": ...} a line;
    anything else: one prompt per non-empty line."""
    if path is None:
        return list(BUILTIN_PROMPTS)
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".json":
        prompts = json.loads(text)
    elif p.suffix == ".jsonl":
        prompts = []
        for line in text.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, dict):
                item = next((item[k] for k in ("prompt", "text_input", "text") if k in item), None)
            prompts.append(item)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(s, str) and s for s in prompts):
        raise SystemExit(f"error: {path} holds no prompts (or a prompt that is not a non-empty string)")
    return prompts


def input_data(prompts: list[str], max_tokens: int, temperature: float) -> dict[str, Any]:
    """perf_analyzer --input-data: one entry per prompt, used round-robin. The tensors are the
    vllm_backend interface; num_output_tokens on the final response is what tokens/s is computed from."""
    params = json.dumps({"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True})
    return {
        "data": [
            {
                "text_input": [p],
                "stream": [True],
                "exclude_input_in_output": [True],
                "return_num_output_tokens": [True],
                "sampling_parameters": [params],
            }
            for p in prompts
        ]
    }


# -- analysis of perf_analyzer's profile export -----------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def analyze_profile(profile: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Token-level figures for one concurrency from perf_analyzer's --profile-export-file JSON."""
    exp = profile["experiments"][-1]
    bounds = exp.get("window_boundaries") or []
    reqs = [r for r in exp["requests"] if r.get("response_timestamps")]
    if len(bounds) >= 2:
        # perf_analyzer reports the average of its last three (stable) windows; earlier ones were the
        # trials it rejected. Use the same span, so figures here and in its CSV describe the same requests.
        start, end = bounds[max(0, len(bounds) - 4)], bounds[-1]
    else:  # no windows recorded: the whole run
        start = min(r["timestamp"] for r in reqs)
        end = max(r["response_timestamps"][-1] for r in reqs)
    reqs = [r for r in reqs if start <= r["response_timestamps"][-1] <= end]
    ttft, itl, e2e, tokens_in_window, n_in_window, tokens_all = [], [], [], 0, 0, []
    missing_counts = 0
    for r in reqs:
        ts = r["response_timestamps"]
        outs = r.get("response_outputs") or []
        # Only the final response carries num_output_tokens. perf_analyzer 2.51 exports outputs that a
        # response lacks with stale or uninitialized values, so read the final one alone, sanity-checked.
        n_tok = int(outs[-1].get("num_output_tokens") or 0) if len(outs) == len(ts) else 0
        if not 1 <= n_tok <= max_tokens:
            n_tok, missing_counts = max_tokens, missing_counts + 1
        tokens_all.append(n_tok)
        first_s, last_s = (ts[0] - r["timestamp"]) / 1e9, (ts[-1] - r["timestamp"]) / 1e9
        ttft.append(first_s * 1e3)
        e2e.append(last_s * 1e3)
        if n_tok > 1:
            # genai-perf's definition: (request latency - TTFT) / (tokens - 1). It does not need to know
            # which response carried which token (the text per response is not reliable in the export).
            itl.append((last_s - first_s) * 1e3 / (n_tok - 1))
        tokens_in_window += n_tok
        n_in_window += 1
    duration_s = (end - start) / 1e9
    return {
        "window_s": duration_s,
        "requests_in_window": n_in_window,
        "output_tokens_in_window": tokens_in_window,
        "output_tokens_per_s": tokens_in_window / duration_s if duration_s > 0 else None,
        "requests_per_s_profile": n_in_window / duration_s if duration_s > 0 else None,
        "output_tokens_per_request": _mean(tokens_all),
        "requests_without_token_count": missing_counts,
        "ttft_ms_mean": _mean(ttft),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_mean": _mean(itl),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "e2e_ms_mean": _mean(e2e),
        "requests_profiled": len(exp["requests"]),
    }


# -- running perf_analyzer ------------------------------------------------------------------------------------


def run_one(
    args: argparse.Namespace, url: str, concurrency: int, data_path: Path, work: Path
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """One perf_analyzer run at one concurrency: (CSV header, CSV row, profile export)."""
    from tokenrouter.serving import triton_install

    csv_path, profile_path = work / f"c{concurrency}.csv", work / f"c{concurrency}.json"
    count = args.measurement_request_count or max(16, 4 * concurrency)
    cmd = [
        args.perf_analyzer or str(triton_install.perf_analyzer_path()),
        "-m", args.model, "-u", url, "-i", "grpc", "--streaming",
        "--input-data", str(data_path),
        "--concurrency-range", f"{concurrency}:{concurrency}",
        # Count windows, not time windows: an LLM request lasts seconds, a 5 s window would hold few.
        "--measurement-mode", "count_windows", "--measurement-request-count", str(count),
        "--stability-percentage", str(args.stability_percentage), "--max-trials", str(args.max_trials),
        "-f", str(csv_path), "--verbose-csv", "--profile-export-file", str(profile_path),
        *args.pa_arg,
    ]  # fmt: skip
    print(f"[c={concurrency}] {' '.join(cmd)}", flush=True)
    env = triton_install.perf_analyzer_env(work)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not csv_path.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"perf_analyzer failed at concurrency {concurrency} (exit {proc.returncode}):\n{tail}")
    rows = list(csv.reader(io.StringIO(csv_path.read_text())))
    header, row = rows[0], rows[1]
    if args.keep_profile:
        keep = args.out.with_suffix(".profile")
        keep.mkdir(parents=True, exist_ok=True)
        (keep / profile_path.name).write_text(profile_path.read_text())
    return header, dict(zip(header, row)), json.loads(profile_path.read_text())


def _float(row: dict[str, str], key: str) -> float | None:
    try:
        return float(row[key])
    except (KeyError, ValueError):
        return None


def measure(args: argparse.Namespace, url: str, work: Path) -> dict[str, Any]:
    prompts = load_prompts(args.prompt_file)
    data_path = work / "input_data.json"
    data_path.write_text(json.dumps(input_data(prompts, args.max_tokens, args.temperature)))
    header: list[str] | None = None
    rows: list[dict[str, str]] = []
    results: list[dict[str, Any]] = []
    for c in args.concurrency:
        try:
            header, row, profile = run_one(args, url, c, data_path, work)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"error: {e}", file=sys.stderr)
            results.append({"concurrency": c, "error": str(e)[-1000:]})
            continue
        rows.append(row)
        derived = analyze_profile(profile, args.max_tokens)
        req_s, resp_s = _float(row, "Inferences/Second"), _float(row, "Response Throughput")
        per_req = derived["output_tokens_per_request"]
        results.append({
            "concurrency": c,
            "requests_per_s": req_s,
            "responses_per_s": resp_s,
            "responses_per_request": resp_s / req_s if req_s and resp_s else None,
            **derived,
            "output_tokens_per_s_pa": req_s * per_req if req_s and per_req else None,
            "pa_avg_latency_ms": (_float(row, "Avg latency") or 0) / 1000 or None,
        })  # fmt: skip
        r = results[-1]
        print(
            f"[c={c}] {r['output_tokens_per_s']:.1f} output tok/s"
            f" (PA req/s x tok/req: {r['output_tokens_per_s_pa']:.1f}), {req_s:.2f} req/s, {resp_s:.1f} resp/s,"
            f" TTFT {r['ttft_ms_mean']:.1f} ms, ITL {r['itl_ms_mean'] or float('nan'):.2f} ms",
            flush=True,
        )
    if header is not None:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(rows)
    return {
        "tool": "perf_analyzer",
        "date": now_iso(),
        "command": command_line(),
        "machine": machine_info(),
        "url": url,
        "served_config": args.serve,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,
        "num_prompts": len(prompts),
        "prompt_file": args.prompt_file,
        "csv": str(args.out),
        "notes": args.note,
        "results": results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default=None, help="gRPC address of a running server (default 127.0.0.1:8001)")
    target.add_argument("--serve", metavar="CONFIG", help="start tritonserver for this deployment YAML, then stop it")
    p.add_argument("--model", default="tokenrouter", help="Triton model name")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrencies")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-file", help=".json list, .jsonl, or one prompt per line (default: built-in)")
    p.add_argument("--out", default="perf_analyzer.csv", help="CSV path; a bare name goes to perf/results/")
    p.add_argument("--measurement-request-count", type=int, default=0, help="per window; 0: max(16, 4 x conc.)")
    p.add_argument("--stability-percentage", type=float, default=20.0)
    p.add_argument("--max-trials", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per perf_analyzer run")
    p.add_argument("--perf-analyzer", help="perf_analyzer binary (default: tritonclient's, in the venv)")
    p.add_argument("--pa-arg", action="append", default=[], help="extra perf_analyzer argument (repeatable)")
    p.add_argument("--note", action="append", default=[], help="free text for the summary (repeatable)")
    p.add_argument("--keep-profile", action="store_true", help="keep profile exports in <out>.profile/")
    args = p.parse_args(argv)
    args.concurrency = parse_concurrency(p, args.concurrency)
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    args.out = results_path(args.out, ".csv")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tr-pa-") as tmp:
        work = Path(tmp)
        if args.serve:
            with serving(args.serve, work) as server:
                url = server.grpc_url
                summary = measure(args, url, work)
        else:
            url = args.url or "127.0.0.1:8001"
            check_server(url, args.model)
            summary = measure(args, url, work)
    summary_path = args.out.with_suffix(".json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"machine: {machine_line(summary['machine'])}")
    print(f"wrote {args.out} and {summary_path}")
    return 0 if all("error" not in r for r in summary["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
