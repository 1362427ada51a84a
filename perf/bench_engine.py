"""In-process throughput benchmark: a routed deployment and its single-model baselines, side by side.

    # CPU plumbing run (tiny random-weight models; figures are not performance claims)
    python perf/bench_engine.py --config config/r2r/tiny-small_tiny-large.yaml \
        --concurrency 1,4,8 --num-requests 24 --prompt-len 64 --output-len 32
    # one H200, Qwen3-0.6B + Qwen3-32B with dummy weights
    python perf/bench_engine.py --device-check --config config/r2r/qwen3-0.6b_qwen3-32b.yaml
    python perf/bench_engine.py --config config/r2r/qwen3-0.6b_qwen3-32b.yaml \
        --concurrency 1,4,8,16,32,64 --num-requests 256 --prompt-len 512 --output-len 256

For each variant (the routed deployment, always-small, always-large) the engine is built once (in a process
of its own when a model is on a GPU, `--isolate`) and run in background mode (`engine.start()`: one
decoding-loop thread per model plus the coordinator), then for each concurrency C a closed loop keeps C
requests in flight: a request is submitted with `add_request` and a listener; when one finishes, the next
is submitted, until `--num-requests` have finished. Prompts are random token ids of exactly `--prompt-len`
(dummy-weight models have no tokenizer), identical across variants and fresh for each concurrency (so the
prefix cache never hits across points); every request generates exactly `--output-len` tokens (`ignore_eos`).

Measured per (variant, concurrency), all from the listener's timestamps (time.perf_counter at delivery):
- output tok/s: output tokens of all requests / (first submit -> last finish), ramp-up and drain included.
- steady tok/s: tokens delivered from the first submit to the last submit / that span: every slot is busy
  then (a finished request is replaced at once); it leaves out the drain at the end, where fewer than C
  requests are in flight. n/a when --num-requests <= C.
- TTFT: submit -> first delivered token; ITL: per request (last token - first token) / (tokens - 1),
  then the mean over requests (a routed step can deliver several tokens at once; this averages them).
- large share: tokens produced by the deployment's last (largest) model / all tokens; handoffs/request.
- steps and mean batch size per model over the measured run (from each subserver's step statistics).

Baselines (`--baseline-mode`): `solo` (default) loads only that model, with its configuration from the
deployment (same dtype, KV size or memory fraction), and no routing; `always` keeps the whole deployment
and switches the policy to `always: <model>` (so it includes the entry model's prefill and hand-off).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import queue
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _common import REPO_ROOT, RESULTS_DIR, command_line, machine_info, machine_line, now_iso, parse_concurrency

from tokenrouter import Engine, SamplingParams
from tokenrouter.config import EngineConfig, load_config

# -- configuration of the variants --------------------------------------------------------------------------


def parse_policy(value: str | None) -> dict[str, Any] | None:
    """--policy: inline YAML/JSON ({name: random, p: 0.3}) or a file holding that, or a deployment with
    a `policy:` key."""
    if value is None:
        return None
    path = Path(value)
    data = yaml.safe_load(path.read_text()) if path.is_file() else yaml.safe_load(value)
    if isinstance(data, dict) and isinstance(data.get("policy"), dict):
        data = data["policy"]
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise SystemExit(f"error: --policy must be a mapping with a 'name', got {value!r}")
    return data


def resolve_model(cfg: EngineConfig, alias: str) -> str:
    """`small` = the entry model, `large` = the last model listed (what the stats call the large model)."""
    names = list(cfg.models)
    if alias in cfg.models:
        return alias
    if alias == "small":
        return cfg.entry
    if alias == "large":
        return names[-1]
    raise SystemExit(f"error: unknown model {alias!r} in --variants; models: {names} (or small / large)")


def variant_config(cfg: EngineConfig, variant: str, mode: str, policy: dict[str, Any] | None) -> EngineConfig:
    """The EngineConfig of one variant: `routed` or `always-<model|small|large>`."""
    if variant == "routed":
        return dataclasses.replace(cfg, policy=dict(policy or cfg.policy))
    if not variant.startswith("always-"):
        raise SystemExit(f"error: unknown variant {variant!r}: use routed, always-small, always-large, always-<model>")
    model = resolve_model(cfg, variant[len("always-") :])
    if mode == "always":
        return dataclasses.replace(cfg, policy={"name": "always", "model": model})
    thresholds = cfg.batching.thresholds
    if isinstance(thresholds, dict):  # per-model thresholds must only name models that exist
        thresholds = {model: thresholds.get(model, 1)}
    batching = dataclasses.replace(cfg.batching, thresholds=thresholds)
    return dataclasses.replace(
        cfg,
        models={model: cfg.models[model]},
        entry=model,
        policy={"name": "always", "model": model},
        batching=batching,
        # Single-model deployments read the tokenizer from the entry model: keep the deployment's.
        tokenizer=cfg.tokenizer or cfg.entry_model.path,
    )


# -- device check ---------------------------------------------------------------------------------------------


def device_problems(cfg: EngineConfig) -> list[str]:
    """Why this deployment cannot run here (empty when it can)."""
    import torch

    problems = []
    for m in cfg.models.values():
        if not m.device.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            problems.append(
                f"model {m.name!r} is placed on {m.device}, but CUDA is not available ({why}; "
                f"torch {torch.__version__})"
            )
            continue
        index = int(m.device.split(":")[1]) if ":" in m.device else 0
        if index >= torch.cuda.device_count():
            problems.append(
                f"model {m.name!r} is placed on {m.device}, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    return problems


def device_report(cfg: EngineConfig) -> str:
    import torch

    lines = [f"torch {torch.__version__}, CUDA build {torch.version.cuda}, available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            lines.append(
                f"  cuda:{i} {torch.cuda.get_device_name(i)}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
            )
    for m in cfg.models.values():
        kv = (
            f"kv_cache_tokens={m.kv_cache_tokens}"
            if m.kv_cache_tokens
            else f"kv_memory_fraction={m.kv_memory_fraction}"
        )
        lines.append(f"  model {m.name}: {m.path} on {m.device}, {m.dtype}, load_format={m.load_format}, {kv}")
    return "\n".join(lines)


# -- the closed loop --------------------------------------------------------------------------------------------


@dataclass
class Track:
    """One request's timeline, filled in by the listener (coordinator thread)."""

    submit_t: float
    first_t: float | None = None
    last_t: float | None = None
    tokens: int = 0
    final: Any = None


@dataclass
class LoopResult:
    tracks: list[Track]
    commits: list[tuple[float, int]]  # (time, tokens) of every delivered delta
    start: float
    end: float
    last_submit: float
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (steps, rows)


def make_prompts(n: int, length: int, vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in avoid] if len(avoid) < vocab else list(range(vocab))
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


def _step_counts(engine: Engine) -> dict[str, tuple[int, int]]:
    """Per model: (forward passes, request rows in them), from the subserver's step statistics."""
    out = {}
    for name, sub in engine.subservers.items():
        counts = dict(sub.stats.latency_count)
        out[name] = (sum(counts.values()), sum(b * c for b, c in counts.items()))
    return out


def closed_loop(
    engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams, timeout_s: float
) -> LoopResult:
    """Keep `concurrency` requests in flight until every prompt has finished."""
    done: queue.SimpleQueue[str] = queue.SimpleQueue()
    tracks: dict[str, Track] = {}
    commits: list[tuple[float, int]] = []

    def listener_for(track: Track) -> Any:
        def on_output(out: Any) -> None:
            now = time.perf_counter()
            if out.delta_token_ids:
                n = len(out.delta_token_ids)
                if track.first_t is None:
                    track.first_t = now
                track.last_t = now
                track.tokens += n
                commits.append((now, n))  # list.append is atomic; read only after the loop
            if out.finished:
                track.final = out
                done.put(out.request_id)

        return on_output

    pending = list(prompts)
    start = time.perf_counter()
    last_submit = start

    def submit() -> None:
        nonlocal last_submit
        prompt = pending.pop(0)
        track = Track(submit_t=time.perf_counter())
        rid = engine.add_request(prompt, params, listener=listener_for(track))
        tracks[rid] = track
        last_submit = track.submit_t

    before = _step_counts(engine)
    for _ in range(min(concurrency, len(pending))):
        submit()
    finished = 0
    while finished < len(prompts):
        try:
            done.get(timeout=timeout_s)
        except queue.Empty:
            for rid in list(tracks):
                engine.abort(rid)
            raise TimeoutError(f"no request finished for {timeout_s:g} s at concurrency {concurrency}") from None
        finished += 1
        if pending:
            submit()
    end = time.perf_counter()
    after = _step_counts(engine)
    steps = {m: (after[m][0] - before[m][0], after[m][1] - before[m][1]) for m in after}
    return LoopResult(list(tracks.values()), commits, start, end, last_submit, steps)


def summarize(res: LoopResult, large: str, concurrency: int, output_len: int) -> dict[str, Any]:
    tracks = res.tracks
    total = sum(t.tokens for t in tracks)
    errors = [t.final.error for t in tracks if t.final is not None and t.final.finish_reason == "error"]
    ttft = [t.first_t - t.submit_t for t in tracks if t.first_t is not None]
    itl = [(t.last_t - t.first_t) / (t.tokens - 1) for t in tracks if t.first_t is not None and t.tokens > 1]
    per_model: dict[str, int] = {}
    handoffs = 0
    for t in tracks:
        stats = t.final.stats if t.final is not None else {}
        handoffs += stats.get("handoffs", 0)
        for m, n in stats.get("tokens_per_model", {}).items():
            per_model[m] = per_model.get(m, 0) + n
    produced = sum(per_model.values())
    # Until the last submit every slot is busy (a finished request is replaced at once); after it the loop
    # drains with fewer than C in flight. No span when all requests were submitted at the start (N <= C).
    span = res.last_submit - res.start
    in_span = sum(n for ts, n in res.commits if ts <= res.last_submit)
    steady = in_span / span if span > 0 and in_span > 0 else None
    duration = res.end - res.start
    return {
        "concurrency": concurrency,
        "requests": len(tracks),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": total,
        "short_requests": sum(1 for t in tracks if t.tokens != output_len),
        "duration_s": duration,
        "output_tok_s": total / duration if duration > 0 else None,
        "steady_tok_s": steady,
        "steady_span_s": span if span > 0 else 0.0,
        "ttft_ms_mean": 1e3 * sum(ttft) / len(ttft) if ttft else None,
        "ttft_ms_p99": 1e3 * sorted(ttft)[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "itl_ms_mean": 1e3 * sum(itl) / len(itl) if itl else None,
        "large_share": per_model.get(large, 0) / produced if produced else 0.0,
        "tokens_per_model": per_model,
        "handoffs_per_request": handoffs / len(tracks) if tracks else 0.0,
        "steps": {m: s for m, (s, _) in res.steps.items()},
        "mean_batch": {m: (rows / s if s else 0.0) for m, (s, rows) in res.steps.items()},
    }


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def free_device_memory() -> None:
    """Between variants: drop the previous engine's weights and KV before the next one sizes its pool."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_variant(
    name: str, cfg: EngineConfig, args: argparse.Namespace, large: str, prompts_for: dict[int, list[list[int]]]
) -> list[dict[str, Any]]:
    print(f"\n== {name}: models {list(cfg.models)}, policy {cfg.policy}", flush=True)
    t = time.perf_counter()
    engine = Engine(cfg)
    print(f"   loaded in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    try:
        engine.start()
        params = SamplingParams(
            max_new_tokens=args.output_len,
            temperature=args.temperature,
            ignore_eos=True,
            seed=args.seed if args.temperature > 0 else None,
        )
        warm = SamplingParams(max_new_tokens=min(8, args.output_len), temperature=0.0, ignore_eos=True)
        for c in args.concurrency:
            prompts = prompts_for[c]
            # Warm-up at this concurrency (first-use kernel compilation, allocator growth); distinct prompts.
            if args.warmup:
                warm_prompts = [[(x + 1) % engine.vocab_size for x in p] for p in prompts[: args.warmup * c]]
                closed_loop(engine, warm_prompts, c, warm, args.timeout)
            res = closed_loop(engine, prompts, c, params, args.timeout)
            row = {"variant": name, **summarize(res, large, c, args.output_len)}
            rows.append(row)
            print(
                f"   c={c:3d}: {_fmt(row['output_tok_s'], '9.1f')} tok/s (steady {_fmt(row['steady_tok_s'], '9.1f')}),"
                f" TTFT {_fmt(row['ttft_ms_mean'], '8.1f')} ms, ITL {_fmt(row['itl_ms_mean'], '7.2f')} ms,"
                f" large {100 * row['large_share']:5.1f} %, handoffs/req {row['handoffs_per_request']:.2f}"
                + (f", {row['errors']} errors: {row['first_error']}" if row["errors"] else ""),
                flush=True,
            )
            if args.check_integrity:
                deadline = time.monotonic() + 10
                while engine.requests and time.monotonic() < deadline:
                    time.sleep(0.05)
                engine.check_integrity()
    finally:
        engine.shutdown()
        del engine
        free_device_memory()
    return rows


# -- report ------------------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = report["results"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    baseline = next((v for v in variants if v.startswith("always-") and v.endswith(report["large_model"])), None)
    lines = [
        f"# Engine throughput: {report['deployment']} ({report['policy']['name']})",
        "",
        f"- Date: {report['date']}",
        f"- Machine: {machine_line(report['machine'])}",
        f"- Command: `{report['command']}`",
        f"- Workload: closed loop, {w['num_requests']} requests per point, prompt {w['prompt_len']} token ids "
        f"(random, seed {w['seed']}), output {w['output_len']} tokens (ignore_eos), temperature {w['temperature']}, "
        f"warm-up {w['warmup']} x C requests per point",
        f"- Policy: `{json.dumps(report['policy'])}`; baselines: {report['baseline_mode']} "
        f"(large model = `{report['large_model']}`)",
    ]
    lines += [f"- Note: {n}" for n in report.get("notes", [])]
    if not report["machine"].get("gpus"):
        lines.append(
            "- **CPU run with tiny random-weight models: these figures check the plumbing; they are not "
            "performance claims.**"
        )
    lines += [
        "",
        "| C | variant | output tok/s | steady tok/s | TTFT ms | ITL ms | large share | handoffs/req "
        "| steps (mean batch) per model | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for c in dict.fromkeys(w["concurrency"]):  # a concurrency given twice has its rows listed once
        for r in (r for r in rows if r["concurrency"] == c):
            steps = ", ".join(f"{m} {r['steps'][m]} ({r['mean_batch'][m]:.1f})" for m in r["steps"])
            lines.append(
                f"| {c} | {r['variant']} | {_fmt(r['output_tok_s'], '.1f')} | {_fmt(r['steady_tok_s'], '.1f')} "
                f"| {_fmt(r['ttft_ms_mean'], '.1f')} | {_fmt(r['itl_ms_mean'], '.2f')} "
                f"| {100 * r['large_share']:.1f} % | {r['handoffs_per_request']:.2f} | {steps} | {r['errors']} |"
            )
    if baseline is not None and len(variants) > 1:
        lines += ["", f"Output tok/s side by side (ratio: routed / {baseline}):", ""]
        lines.append("| C | " + " | ".join(variants) + " | ratio |")
        lines.append("|---:|" + "---:|" * (len(variants) + 1))
        for c in dict.fromkeys(w["concurrency"]):
            by = {r["variant"]: r for r in rows if r["concurrency"] == c}
            cells = [_fmt(by[v]["output_tok_s"], ".1f") if v in by else "n/a" for v in variants]
            ratio = None
            if "routed" in by and baseline in by and by[baseline]["output_tok_s"]:
                ratio = by["routed"]["output_tok_s"] / by[baseline]["output_tok_s"]
            lines.append(f"| {c} | " + " | ".join(cells) + f" | {_fmt(ratio, '.2f')} |")
    for f in report.get("failures", []):
        lines += ["", f"**{f['variant']} failed:** `{f['error']}`"]
    lines += [
        "",
        "Definitions: output tok/s = all output tokens / (first submit -> last finish); steady tok/s = "
        "tokens delivered from the first to the last submit (all C slots busy; the final drain left out) / "
        "that span; TTFT = submit -> first token; ITL = per request (last - first token) / (tokens - 1), mean "
        "over requests; large share = tokens written by the large model. Times are taken in process (no "
        "server, no network). "
        "See perf/README.md.",
        "",
    ]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="deployment YAML (the routed deployment)")
    p.add_argument("--policy", help="routing policy override: inline YAML/JSON or a file (default: the config's)")
    p.add_argument(
        "--variants",
        default="routed,always-small,always-large",
        help="comma-separated: routed, always-small, always-large, always-<model>",
    )
    p.add_argument(
        "--baseline-mode",
        choices=("solo", "always"),
        default="solo",
        help="solo: the baseline model alone; always: the whole deployment with policy always",
    )
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--num-requests", type=int, default=0, help="finished requests per point; 0: max(16, 4 x C)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds of C short requests per point (0: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without any request finishing: abort")
    p.add_argument("--check-integrity", action="store_true", help="verify KV accounting after every point")
    p.add_argument(
        "--text",
        action="store_true",
        help="keep a generated bench tokenizer the config names, so outputs are also decoded to text every step "
        "(default: token ids only, as with no tokenizer)",
    )
    p.add_argument("--device-check", action="store_true", help="print what the config needs and what is here; exit")
    p.add_argument("--name", help="results name (default: bench_engine_<policy>_<config>)")
    p.add_argument("--note", action="append", default=[], help="a line for the markdown header (repeatable)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument(
        "--isolate",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each variant in its own process (auto: when a model is on a GPU, so that each variant starts "
        "with the whole device: an in-process run once kept a previous variant's memory on an H200)",
    )
    p.add_argument("--rows-out", help=argparse.SUPPRESS)  # internal: a child of --isolate writes its rows here
    args = p.parse_args(argv)
    args.concurrency = parse_concurrency(p, args.concurrency)
    if args.prompt_len < 1 or args.output_len < 1:
        p.error("--prompt-len and --output-len must be >= 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    return args


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv minus the given options and their values (`--opt value` and `--opt=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(f"{n}=" for n in names)):
            out.append(a)
    return out


def run_variant_in_child(name: str, argv: list[str] | None) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """One variant in a fresh interpreter (same arguments otherwise): its device memory ends with it."""
    base = _without_options(sys.argv[1:] if argv is None else argv, ("--variants", "--isolate", "--rows-out"))
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *base, "--variants", name, "--isolate", "off",
               "--rows-out", str(rows_path)]  # fmt: skip
        rc = subprocess.run(cmd).returncode
        if not rows_path.is_file():
            return [], [{"variant": name, "error": f"the variant's process exited with code {rc} and no results"}]
        data = json.loads(rows_path.read_text())
    return data["results"], data["failures"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config_path = Path(args.config)
    if not config_path.is_file():
        print(f"error: config file {args.config!r} does not exist", file=sys.stderr)
        return 2
    if "models/tiny/" in config_path.read_text() and not (REPO_ROOT / "models" / "tiny" / "MANIFEST.json").exists():
        from tokenrouter.tools.make_tiny import make_tiny

        make_tiny(REPO_ROOT / "models" / "tiny")
    from tokenrouter.tools.bench_tokenizer import ensure_bench_tokenizer, is_bench_tokenizer

    ensure_bench_tokenizer(config_path)  # load_config refuses a tokenizer directory that is missing
    cfg = load_config(config_path)
    if not args.text and is_bench_tokenizer(cfg.tokenizer):
        # Prompts are token ids and only token counts are read, so the generated tokenizer would only add the
        # coordinator's per-step detokenization to this process (a served deployment does that in the router's
        # process): on an H200 it cut Qwen3-0.6B's output tok/s by about 20 % at C=8 and 45 % at C=64.
        cfg = dataclasses.replace(cfg, tokenizer=None)
    policy = parse_policy(args.policy) or dict(cfg.policy)
    problems = device_problems(cfg)
    if args.device_check:
        print(device_report(cfg))
        for line in problems:
            print(f"NOT RUNNABLE HERE: {line}")
        print("device check: " + ("FAILED" if problems else "ok"))
        return 2 if problems else 0
    if problems:
        print("error: this deployment cannot run on this machine:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print(
            "Run it on a machine with the GPU(s) it names, or use a CPU deployment such as "
            "config/r2r/tiny-small_tiny-large.yaml.",
            file=sys.stderr,
        )
        return 2
    large = list(cfg.models)[-1]
    configs = {v: variant_config(cfg, v, args.baseline_mode, policy) for v in args.variants}
    for c in configs.values():
        c.validate()
    # Prompts once, from the routed deployment's vocabulary (all variants share it), fresh per concurrency.
    from tokenrouter.runner.arch import ArchConfig

    arch = ArchConfig.from_dir(cfg.entry_model.path)
    avoid = set(arch.eos_token_ids)
    n_for = {c: args.num_requests or max(16, 4 * c) for c in args.concurrency}
    prompts_for = {
        c: make_prompts(n_for[c], args.prompt_len, arch.vocab_size, avoid, args.seed * 1000 + c)
        for c in args.concurrency
    }
    results: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    stem = args.name or f"bench_engine_{policy['name']}_{config_path.stem}"
    report = {
        "tool": "perf/bench_engine.py",
        "date": now_iso(),
        "command": command_line(),
        "machine": machine_info(),
        "deployment": str(config_path),
        "policy": policy,
        "baseline_mode": args.baseline_mode,
        "large_model": large,
        "workload": {
            "concurrency": args.concurrency,
            "num_requests": args.num_requests or "max(16, 4 x C)",
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "temperature": args.temperature,
            "seed": args.seed,
            "warmup": args.warmup,
        },
        "notes": args.note,
        "results": results,
        "failures": failures,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    isolate = args.isolate == "on" or (
        args.isolate == "auto" and any(m.device.startswith("cuda") for c in configs.values() for m in c.models.values())
    )
    for name, vcfg in configs.items():
        if isolate and args.rows_out is None:
            rows, failed = run_variant_in_child(name, argv)
            results += rows
            failures += failed
        else:
            try:
                results += run_variant(name, vcfg, args, large, prompts_for)
            except Exception as e:  # one variant failing (say, out of memory) must not lose the others' figures
                traceback.print_exc()
                failures.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
        if args.rows_out is not None:
            continue
        # Written after every variant, so a long GPU sweep that dies late keeps what it measured.
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / f"{stem}.md").write_text(markdown(report))
    if args.rows_out is not None:
        Path(args.rows_out).write_text(json.dumps({"results": results, "failures": failures}))
        return 0
    print(f"\nwrote {out_dir / stem}.json and .md")
    return 1 if failures or any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
