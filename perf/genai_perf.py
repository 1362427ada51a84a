"""genai-perf 0.0.16 against the `tokenrouter` Triton model (gRPC streaming, vllm_backend tensor interface).

    python perf/genai_perf.py --url 127.0.0.1:8001 --concurrency 1,2,4 --max-tokens 64 --input-tokens 128 \
        --name r2r_tiny_cpu
    python perf/genai_perf.py --serve config/r2r/tiny-small_tiny-large.yaml --concurrency 1,2 --name smoke

Artifacts (genai-perf's inputs.json, the perf_analyzer profile export, its CSV/JSON metrics) go to
perf/results/genai-perf/<name>/<model>-triton-vllm-concurrency<N>/, and a summary of all concurrencies
with the command, date and machine to perf/results/genai-perf/<name>/summary.json.

How it is driven, and why:
- `--endpoint-type kserve --backend vllm --streaming`: our router model speaks vllm_backend's tensors
  (text_input, stream, sampling_parameters, exclude_input_in_output -> text_output), so genai-perf's vLLM
  input converter works unchanged. (0.0.16 has no `--service-kind`; `kserve` is its Triton endpoint.)
- genai-perf's `--output-tokens-mean` is not used: its vLLM converter writes `max_tokens` as a JSON
  *string* (and `min_tokens` with `--output-tokens-mean-deterministic`), which our sampling_parameters
  parser rejects (perf_analyzer then exits 99). `sampling_parameters` goes in through `--extra-inputs`
  instead, with an integer max_tokens and ignore_eos, so every request produces exactly --max-tokens.
- genai-perf counts output tokens by re-tokenizing the streamed *text* with `--tokenizer`, not from the
  engine. With the tiny random-weight models the text is arbitrary bytes that re-tokenize to a different
  count (more or fewer than were generated), so its output sequence length and token throughput are off;
  the summary adds `engine_output_tokens_per_s` = request throughput x max_tokens, which is exact
  because of ignore_eos. perf/perf_analyzer.py reads the engine's own count instead.
- genai-perf runs the `perf_analyzer` it finds on PATH: tritonclient 2.51's, from this venv, with the
  library path tweaks it needs (tokenrouter.serving.triton_install.perf_analyzer_env).
- If genai-perf is missing it is pip-installed into this venv with every installed package pinned
  (otherwise its dependencies would move numpy to 2.x under tritonclient and pytriton).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    check_server,
    command_line,
    machine_info,
    machine_line,
    now_iso,
    parse_concurrency,
    serving,
)

GENAI_PERF = "genai-perf==0.0.16"
VERSION = "0.0.16"
VENV_BIN = Path(sys.executable).parent


def ensure_genai_perf(install: bool) -> Path:
    """The genai-perf executable in this venv, installed if missing; SystemExit with the reason if not."""
    exe = VENV_BIN / "genai-perf"
    if not exe.exists():
        if not install:
            raise SystemExit(
                f"error: {exe} is missing; install it with `{VENV_BIN / 'pip'} install {GENAI_PERF}`"
                " (or drop --no-install)"
            )
        print(f"genai-perf is missing: installing {GENAI_PERF} into {VENV_BIN.parent} (installed packages pinned)")
        freeze = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
        ).stdout
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(line for line in freeze.splitlines() if "==" in line) + "\n")
            constraints = f.name
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-c", constraints, GENAI_PERF])
        finally:
            os.unlink(constraints)
        if proc.returncode != 0 or not exe.exists():
            raise SystemExit(
                f"error: could not install {GENAI_PERF} into this venv (pip exit {proc.returncode}). genai-perf "
                "needs pandas, pyarrow, scipy, statsmodels, plotly and optuna wheels for this Python that work "
                "with the venv's pinned numpy; see perf/README.md. perf/perf_analyzer.py needs none of them."
            )
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    version = (out.stdout + out.stderr).strip().split()[-1] if out.returncode == 0 else "?"
    if version != VERSION:
        print(f"warning: genai-perf {version} found; these options were written for {VERSION}", file=sys.stderr)
    return exe


def genai_perf_env(cache: Path) -> dict[str, str]:
    """tritonclient's perf_analyzer first on PATH, with the libraries it looks for findable."""
    from tokenrouter.serving import triton_install

    triton_install.perf_analyzer_path()  # raises with a clear message when tritonclient is missing
    env = triton_install.perf_analyzer_env(cache)
    env["PATH"] = os.pathsep.join((str(VENV_BIN), env.get("PATH", "")))
    return env


def profile_command(args: argparse.Namespace, exe: Path, url: str, concurrency: int, artifacts: Path) -> list[str]:
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": args.temperature}
    requests = args.request_count or max(20, 4 * concurrency)
    return [
        str(exe), "profile",
        "-m", args.model, "--endpoint-type", "kserve", "--backend", "vllm", "--streaming", "-u", url,
        "--tokenizer", args.tokenizer,
        "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--extra-inputs", json.dumps({"sampling_parameters": json.dumps(sampling)}),
        "--concurrency", str(concurrency),
        "--request-count", str(requests), "--warmup-request-count", str(args.warmup_request_count),
        "--num-dataset-entries", str(args.num_dataset_entries), "--random-seed", str(args.seed),
        "--artifact-dir", str(artifacts),
        *args.extra,
    ]  # fmt: skip


def _metric(data: dict[str, Any], key: str, stat: str = "avg") -> float | None:
    value = data.get(key, {}).get(stat)
    return float(value) if value is not None else None


def summarize(run_dir: Path, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """The headline numbers of one genai-perf run (its profile_export_genai_perf.json)."""
    found = sorted(run_dir.glob("**/profile_export_genai_perf.json"))
    if not found:
        raise RuntimeError(f"genai-perf wrote no profile_export_genai_perf.json under {run_dir}")
    data = json.loads(found[-1].read_text())
    req_s = _metric(data, "request_throughput")
    return {
        "concurrency": concurrency,
        "artifacts": str(found[-1].parent),
        "request_throughput_per_s": req_s,
        "output_token_throughput_per_s": _metric(data, "output_token_throughput"),
        "engine_output_tokens_per_s": req_s * max_tokens if req_s is not None else None,
        "output_sequence_length_avg": _metric(data, "output_sequence_length"),
        "input_sequence_length_avg": _metric(data, "input_sequence_length"),
        "ttft_ms_avg": _metric(data, "time_to_first_token"),
        "ttft_ms_p99": _metric(data, "time_to_first_token", "p99"),
        "itl_ms_avg": _metric(data, "inter_token_latency"),
        "itl_ms_p99": _metric(data, "inter_token_latency", "p99"),
        "request_latency_ms_avg": _metric(data, "request_latency"),
        "request_count": _metric(data, "request_count"),
    }


def run(args: argparse.Namespace, url: str, exe: Path, env: dict[str, str], out_dir: Path) -> list[dict[str, Any]]:
    results = []
    for c in args.concurrency:
        cmd = profile_command(args, exe, url, c, out_dir)
        print(f"[c={c}] {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        log = out_dir / f"genai-perf-c{c}.log"
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"error: genai-perf failed at concurrency {c} (exit {proc.returncode}); log: {log}", file=sys.stderr)
            print((proc.stdout + proc.stderr)[-2500:], file=sys.stderr)
            results.append({"concurrency": c, "error": f"genai-perf exit {proc.returncode}; see {log}"})
            continue
        run_dirs = sorted(out_dir.glob(f"*concurrency{c}"))
        r = summarize(run_dirs[-1] if run_dirs else out_dir, c, args.max_tokens)
        results.append(r)
        print(
            f"[c={c}] genai-perf: {r['output_token_throughput_per_s']:.1f} tok/s (re-tokenized, OSL"
            f" {r['output_sequence_length_avg']:.1f}); engine: {r['engine_output_tokens_per_s']:.1f} tok/s;"
            f" {r['request_throughput_per_s']:.2f} req/s, TTFT {r['ttft_ms_avg']:.1f} ms, ITL {r['itl_ms_avg']:.2f} ms",
            flush=True,
        )
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Arguments after `--` go to `genai-perf profile` unchanged."
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default=None, help="gRPC address of a running server (default 127.0.0.1:8001)")
    target.add_argument("--serve", metavar="CONFIG", help="start tritonserver for this deployment YAML, then stop it")
    p.add_argument("--model", default="tokenrouter", help="Triton model name")
    p.add_argument("--name", default="run", help="results go to perf/results/genai-perf/<name>/")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated concurrencies")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length, in tokenizer tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: models/tiny/tokenizer)")
    p.add_argument("--request-count", type=int, default=0, help="measured requests; 0: max(20, 4 x concurrency)")
    p.add_argument("--warmup-request-count", type=int, default=4)
    p.add_argument("--num-dataset-entries", type=int, default=64, help="distinct synthetic prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per genai-perf run")
    p.add_argument("--note", action="append", default=[], help="free text for the summary (repeatable)")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing genai-perf")
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = p.parse_args(argv)
    args.extra = extra
    args.concurrency = parse_concurrency(p, args.concurrency)
    from _common import REPO_ROOT

    args.tokenizer = str(Path(args.tokenizer or REPO_ROOT / "models" / "tiny" / "tokenizer").resolve())
    if not Path(args.tokenizer).is_dir():
        p.error(
            f"tokenizer directory {args.tokenizer} does not exist (build the tiny one: "
            "`tokenrouter make-tiny --out models/tiny`)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exe = ensure_genai_perf(install=not args.no_install)
    out_dir = RESULTS_DIR / "genai-perf" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tr-genai-perf-") as tmp:
        work = Path(tmp)
        env = genai_perf_env(work)
        if args.serve:
            with serving(args.serve, work) as server:
                url = server.grpc_url
                results = run(args, url, exe, env, out_dir)
        else:
            url = args.url or "127.0.0.1:8001"
            check_server(url, args.model)
            results = run(args, url, exe, env, out_dir)
    summary = {
        "tool": f"genai-perf {VERSION}",
        "date": now_iso(),
        "command": command_line(),
        "machine": machine_info(),
        "url": None if args.serve else url,
        "served_config": args.serve,
        "model": args.model,
        "tokenizer": args.tokenizer,
        "max_tokens": args.max_tokens,
        "input_tokens": args.input_tokens,
        "ignore_eos": True,
        "notes": args.note,
        "note": "output_token_throughput_per_s counts re-tokenized text; engine_output_tokens_per_s = "
        "request throughput x max_tokens (exact with ignore_eos)",
        "results": results,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"machine: {machine_line(summary['machine'])}")
    print(f"wrote {out_dir}/summary.json")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
