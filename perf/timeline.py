"""Record what each model does and when, on a running engine or server, and show where the time goes.

    # in process: a closed loop of C requests on a deployment, recorded after one warm-up round
    python perf/timeline.py record --config config/r2r/tiny-small_tiny-large.yaml \\
        --concurrency 8 --num-requests 32 --prompt-len 64 --output-len 64 --out /tmp/timeline
    # served: start the server with TOKENROUTER_TIMELINE_DIR=DIR (every subserver appends its events there),
    # run any load (perf_analyzer, genai-perf, bench_served.py), then (--since/--until: one run's window)
    python perf/timeline.py served DIR --out /tmp/timeline-served
    # the tuning model's prediction for the runs of a bench_served.py json, against what they measured
    python perf/timeline.py predict DIR --bench served_c8.json --out /tmp/predict_c8
    # what `thresholds: auto` would choose at moments of a served run, from what the server had measured by then
    python perf/timeline.py tuner DIR --concurrency 16 --at 145 152 --max-wait-ms 50 --one-device

Each writes OUT/trace.json (open it in https://ui.perfetto.dev or chrome://tracing: one track per model,
each step a slice with `forward` and `route+commit` inside, handoffs as arrows), OUT/summary.json and
OUT/summary.md (busy fraction, batch histograms, idle gaps by cause, handoff transit: perf/timeline_analysis.py).
The recorder is the engine's own (backends/tokenrouter/engine/timeline.py), off unless asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from _common import command_line, machine_info, machine_line, now_iso
from bench_engine import closed_loop, make_prompts, parse_policy
from timeline_analysis import chrome_trace, markdown, summarize

from tokenrouter import Engine, SamplingParams
from tokenrouter.config import ConfigError, load_config
from tokenrouter.engine.timeline import event_time, read_events


def write(out: Path, events: list[dict[str, Any]], title: str, extra: dict[str, Any]) -> dict[str, Any]:
    """OUT/trace.json, OUT/summary.json and OUT/summary.md from `events`; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {**extra, "command": command_line(), "date": now_iso(), "machine": machine_line(machine_info()),
               **summarize(events)}
    (out / "trace.json").write_text(json.dumps(chrome_trace(events)))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    header = [f"- {k}: {v}" for k, v in extra.items()]
    header += [f"- command: `{summary['command']}`", f"- date: {summary['date']}", f"- machine: {summary['machine']}"]
    md = markdown(summary, title).replace("\n\n", "\n\n" + "\n".join(header) + "\n\n", 1)
    (out / "summary.md").write_text(md)
    return summary


def record(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.policy:
        cfg = dataclasses.replace(cfg, policy=parse_policy(args.policy))
    engine = Engine(cfg)
    try:
        engine.start()
        prompts = make_prompts(args.num_requests, args.prompt_len, engine.vocab_size, set(), args.seed)
        params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)
        # One unrecorded round first: kernel compilation and graph capture are not what the trace is for.
        warm = [[(x + 1) % engine.vocab_size for x in p] for p in prompts[: args.concurrency]]
        closed_loop(engine, warm, args.concurrency, SamplingParams(max_new_tokens=8, ignore_eos=True), args.timeout)
        engine.record_timeline()
        res = closed_loop(engine, prompts, args.concurrency, params, args.timeout)
        events = engine.timeline_events()
        engine.record_timeline(False)
        runs = [res]
        # --repeat: the same closed loop again, unrecorded, on the same engine (is the figure stable?)
        # (fresh prompts each: repeated ones would hit the prefix cache the first run filled)
        runs += [closed_loop(engine, make_prompts(args.num_requests, args.prompt_len, engine.vocab_size, set(),
                                                  args.seed + r), args.concurrency, params, args.timeout)
                 for r in range(1, args.repeat)]
    finally:
        engine.shutdown()
    tok_s = [round(sum(t.tokens for t in r.tracks) / max(r.end - r.start, 1e-9), 1) for r in runs]
    extra = {"config": args.config, "policy": json.dumps(cfg.policy), "concurrency": args.concurrency,
             "requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
             "output_tok_s": tok_s[0]}
    if len(tok_s) > 1:
        extra["output_tok_s of every run (the first recorded)"] = tok_s
    summary = write(Path(args.out), events, f"Timeline: {Path(args.config).name} at C={args.concurrency}", extra)
    print((Path(args.out) / "summary.md").read_text())
    return 0 if summary["models"] else 1


def served(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not folder.is_dir() or not any(folder.glob("*.jsonl")):
        print(f"error: no timeline files (*.jsonl) in {folder}: start the server with "
              f"TOKENROUTER_TIMELINE_DIR={folder} and run some load first", file=sys.stderr)
        return 2
    per_model: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        per_model.setdefault(path.name.rsplit(".", 2)[0], []).append(path.name)
    for model, names in per_model.items():
        if len(names) > 1:  # a reloaded model, or an earlier server's files: their windows add up
            print(f"warning: {len(names)} files for model {model!r} ({', '.join(names)}): events of several "
                  "processes are merged; use a fresh folder per run", file=sys.stderr)
    events = read_events(folder)
    extra: dict[str, Any] = {"source": str(folder)}
    if args.since is not None or args.until is not None:
        since = float("-inf") if args.since is None else args.since
        until = float("inf") if args.until is None else args.until
        events = [e for e in events if since <= event_time(e) <= until]
        extra["window"] = f"monotonic {args.since} .. {args.until}"
    write(Path(args.out), events, f"Timeline: served deployment ({folder})", extra)
    print((Path(args.out) / "summary.md").read_text())
    return 0


def predict(args: argparse.Namespace) -> int:
    from timeline_predict import markdown as predict_markdown
    from timeline_predict import predict as predict_window

    runs = json.loads(Path(args.bench).read_text())["results"]
    since, until = min(r["monotonic_since"] for r in runs), max(r["monotonic_until"] for r in runs)
    events = [e for e in read_events(Path(args.folder)) if since <= event_time(e) <= until]
    result = predict_window(events, runs, None if args.max_wait_ms is None else args.max_wait_ms / 1e3)
    text = predict_markdown(result)
    print(text)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    return 0


def tuner(args: argparse.Namespace) -> int:
    from timeline_tuner import replay

    events = read_events(Path(args.folder))
    wait = None if args.max_wait_ms is None else args.max_wait_ms / 1e3
    for moment in args.at:
        print(replay(events, args.concurrency, moment, wait, args.one_device, args.commit_on_move))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run a closed loop in process and record it")
    r.add_argument("--config", required=True)
    r.add_argument("--policy", help="routing policy override: inline YAML/JSON or a file (default: the config's)")
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--num-requests", type=int, default=32)
    r.add_argument("--prompt-len", type=int, default=100)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds without any request finishing: abort")
    r.add_argument("--repeat", type=int, default=1,
                   help="closed loops in all, fresh prompts each; only the first is recorded")
    r.add_argument("--out", required=True, help="output folder")
    s = sub.add_parser("served", help="merge the files a server wrote with TOKENROUTER_TIMELINE_DIR")
    s.add_argument("folder")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--since", type=float, help="only events at or after this time.monotonic() second "
                   "(perf/bench_served.py writes each run's monotonic_since / monotonic_until)")
    s.add_argument("--until", type=float, help="only events at or before this time.monotonic() second")
    q = sub.add_parser("predict", help="the tuning model's prediction for a served window against what it measured")
    q.add_argument("folder", help="the server's TOKENROUTER_TIMELINE_DIR")
    q.add_argument("--bench", required=True, help="perf/bench_served.py's json for the runs of that window")
    q.add_argument("--max-wait-ms", type=float, help="the deployment's batching.max_wait_ms (default: no bounded wait)")
    q.add_argument("--out", help="write OUT.md and OUT.json")
    t = sub.add_parser("tuner", help="what `thresholds: auto` would choose at moments of a served run")
    t.add_argument("folder", help="the server's TOKENROUTER_TIMELINE_DIR")
    t.add_argument("--concurrency", type=int, required=True, help="the concurrency the tuner solves for")
    t.add_argument("--at", type=float, nargs="+", required=True,
                   help="moments (time.monotonic() seconds, as in the events): the tuner sees what ended by then")
    t.add_argument("--max-wait-ms", type=float, help="the deployment's batching.max_wait_ms (default: none)")
    t.add_argument("--one-device", action="store_true", help="every model shares one GPU (as the deployment's)")
    t.add_argument("--commit-on-move", type=float, default=0.0,
                   help="the share of rows leaving the entry model that commit their token (R2R, random: 0)")
    args = p.parse_args(argv)
    if args.cmd == "predict":
        return predict(args)
    if args.cmd == "tuner":
        if args.concurrency < 1 or not 0.0 <= args.commit_on_move <= 1.0:
            p.error("--concurrency must be >= 1 and --commit-on-move within [0, 1]")
        return tuner(args)
    if args.cmd == "record":
        for name in ("concurrency", "num_requests", "prompt_len", "output_len", "repeat"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1")
        try:
            load_config(args.config)
        except ConfigError as e:
            p.error(str(e))
        return record(args)
    return served(args)


if __name__ == "__main__":
    sys.exit(main())
