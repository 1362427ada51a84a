"""The sections of perf/evaluate.py: main, ablation, sweep.

main: for each algorithm, its deployment is calibrated on an in-process engine (evaluation/calibrate.py),
which is then measured as the in-process system; the single models and the servers follow, the servers
from the calibrated deployment (in-process first: the servers start CUDA MPS when models share a GPU).

The ablation and the sweep run R2R (calibrated as in the main section) in process on the low-effort
workload. The ablation turns the engine's optimizations on one at a time, each by a deployment setting
(no benchmark-only code in the engine): the settings of every step are in the results. The sweep measures every feasible
threshold vector (sum(B_i - 1) < C, each B_i <= --max-threshold) next to the Markov model's prediction
from the same run's measured step latencies and routing rates, and marks the vector `auto` picks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from evaluation import deployments, systems
from evaluation.harness import Results, calibrated, measure
from evaluation.workloads import Workload, make_workload
from tokenrouter.config import EngineConfig, load_config

SOLO = ("slm-only", "llm-only")


def run_main(args: argparse.Namespace, out_dir: Path, work: Path) -> None:
    workloads = [make_workload(w, args.scale) for w in args.workloads]
    res = Results("main", f"Routed serving vs Std. Serving and single models ({args.models})", out_dir, args.scale,
                  args.note)
    for w in workloads:
        res.data["workloads"][w.name] = w.describe()
    solo_done = False
    for algorithm in args.algorithms:
        try:
            with calibrated(algorithm, args.models, args.seed, res, work) as (path, cfg, engine):
                if "in-process" in args.systems:
                    print(f"== {algorithm} / in-process", flush=True)
                    _measure_all(engine, res, workloads, args, algorithm, "in-process", cfg)
        except Exception as e:  # a failing algorithm is a note, not a lost section
            print(f"!! {algorithm} / calibration or in-process failed: {e!r}", flush=True)
            res.note(f"{algorithm} / calibration or in-process: failed: {e!r}")
            continue
        for system in args.systems:
            if system == "in-process" or (system in SOLO and solo_done):
                continue  # the same small and large model for every algorithm: measured once
            algo = "-" if system in SOLO else algorithm
            print(f"== {algo} / {system}", flush=True)
            try:
                with _open_system(system, path, cfg, args.execution_env) as opened:
                    _measure_all(opened, res, workloads, args, algo, system, cfg)
            except Exception as e:
                print(f"!! {algo} / {system} failed: {e!r}", flush=True)
                res.note(f"{algo} / {system}: failed: {e!r}")
        solo_done = solo_done or any(s in args.systems for s in SOLO)
    res.report()


def _measure_all(opened: systems.Opened, res: Results, workloads: list[Workload], args: argparse.Namespace,
                 algo: str, system: str, cfg: EngineConfig) -> None:
    for w in workloads:
        for c in args.concurrency:
            row = measure(opened, w, c, cfg, args.seed, f"{algo} {system} {w.name} C={c}")
            res.add({"workload": w.name, "algorithm": algo, "system": system, **row})


def _open_system(system: str, path: Path, cfg: EngineConfig, execution_env: Path | None) -> Any:
    if system in SOLO:
        return systems.in_process(systems.system_config(cfg, system))
    if system == "triton":
        return systems.served(str(path), cfg, execution_env)
    if system == "std-serving":
        return systems.std_serving(str(path), cfg, execution_env)
    raise SystemExit(f"error: unknown system {system!r}; known: {', '.join(systems.SYSTEMS)}")

# Cumulative: each step keeps the previous steps' settings. Model-level keys apply to every model.
ABLATION: list[tuple[str, dict[str, Any]]] = [
    ("eager (no CUDA graphs)", {"enforce_eager": True, "route_in_step": False, "independent_loops": False,
                                "thresholds": 1}),
    ("+ CUDA graphs for decode", {"enforce_eager": False, "cuda_graph_max_tokens": 0}),
    ("+ CUDA graphs for extends", {"cuda_graph_max_tokens": 128}),
    ("+ routing inside the step", {"route_in_step": True}),
    ("+ independent loops", {"independent_loops": True}),
    ("+ delayed batching (thresholds auto)", {"thresholds": "auto"}),
]
MODEL_KEYS = ("enforce_eager", "cuda_graph_max_tokens", "route_in_step")


def _overrides(switches: dict[str, Any], batching: dict[str, Any]) -> dict[str, Any]:
    return {
        "models_all": {k: switches[k] for k in MODEL_KEYS if k in switches},
        "independent_loops": switches["independent_loops"],
        "batching": {**batching, "thresholds": switches["thresholds"]},
    }


def run_ablation(args: argparse.Namespace, out_dir: Path, work: Path) -> None:
    c = args.concurrency[0]
    workload = make_workload("low-effort", args.scale)
    res = Results("ablation", f"Cumulative ablation, R2R at C={c}, in process ({args.models})", out_dir,
                  args.scale, args.note + [f"each step's engine is built fresh; workload {workload.name}"])
    res.data["workloads"][workload.name] = workload.describe()
    source = deployments.config_path("r2r", args.models)
    with calibrated("r2r", args.models, args.seed, res, work) as (_, tuned, _):
        pass  # only the calibrated policy is kept: every step builds its own engine
    batching = {"max_wait_ms": tuned.batching.max_wait_ms, "auto_interval_s": tuned.batching.auto_interval_s}
    switches: dict[str, Any] = {}
    for step, (label, change) in enumerate(ABLATION):
        switches = {**switches, **change}
        path = deployments.write_deployment(source, work / f"ablation{step}.yaml", tuned.policy,
                                            _overrides(switches, batching))
        cfg = load_config(path)
        print(f"== ablation {step}: {label}", flush=True)
        try:
            with systems.in_process(cfg) as opened:
                if switches["thresholds"] == "auto":
                    # The tuner solves from measurements every auto_interval_s: give it one unmeasured round.
                    measure(opened, workload, c, cfg, args.seed + 1, f"{label} (tuning round, not kept)")
                row = measure(opened, workload, c, cfg, args.seed, f"ablation {step} C={c}")
                if switches["thresholds"] == "auto":
                    row["tuned_thresholds"] = dict(opened.engine().thresholds)
        except Exception as e:
            print(f"!! ablation step {step} failed: {e!r}", flush=True)
            row = {"concurrency": c, "requests": 0, "errors": 1, "first_error": repr(e)[:300]}
        res.add({"step": step, "label": label, "config": dict(switches), **row})
    res.report()


def predicted(system: Any, thresholds: tuple[int, ...]) -> float:
    """The Markov chain's long-run tok/s for `thresholds` (the simulator when the chain is too large)."""
    from tokenrouter.tuning.markov import expected_throughput
    from tokenrouter.tuning.simulator import simulate

    try:
        return float(expected_throughput(system, thresholds))
    except (ValueError, RuntimeError):
        return float(simulate(system, thresholds).throughput)


def run_sweep(args: argparse.Namespace, out_dir: Path, work: Path) -> None:
    from tokenrouter.engine.autotune import solve_thresholds, system_model
    from tokenrouter.tuning.system import feasible_thresholds

    concurrency = args.concurrency
    workload = make_workload("low-effort", args.scale)
    res = Results("sweep", f"Threshold sweep, R2R, in process ({args.models})", out_dir, args.scale,
                  args.note + [f"thresholds B_i <= {args.max_threshold}; workload {workload.name}"])
    res.data["workloads"][workload.name] = workload.describe()
    source = deployments.config_path("r2r", args.models)
    with calibrated("r2r", args.models, args.seed, res, work) as (_, tuned, _):
        pass  # the sweep's engine has fixed thresholds: built below
    path = deployments.write_deployment(source, work / "sweep.yaml", tuned.policy,
                                        {"batching": {"thresholds": 1, "max_wait_ms": tuned.batching.max_wait_ms}})
    cfg = load_config(path)
    names = list(cfg.models)
    with systems.in_process(cfg) as opened:
        engine = opened.engine()
        for c in concurrency:
            vectors = [v for v in feasible_thresholds(len(names), c) if max(v) <= args.max_threshold]
            measured: dict[tuple[int, ...], dict[str, Any]] = {}

            def run(v: tuple[int, ...], c: int = c, measured: dict = measured) -> None:
                # The coordinator reads the configured thresholds at every admission.
                engine.config.batching.thresholds = dict(zip(names, v))
                measured[v] = measure(opened, workload, c, cfg, args.seed, f"sweep C={c} B={'/'.join(map(str, v))}")

            for v in vectors:
                run(v)
            model = system_model(names, {m: s.stats for m, s in engine.subservers.items()}, c)
            tuned = solve_thresholds(names, {m: s.stats for m, s in engine.subservers.items()}, c)
            auto = tuple(tuned.thresholds[m] for m in names) if tuned is not None else None
            if auto is not None and auto not in measured:
                run(auto)
            for v, row in measured.items():
                res.add({
                    "concurrency": c, "thresholds": dict(zip(names, v)),
                    "measured_tok_s": row.get("output_tok_s"),
                    "predicted_tok_s": predicted(model, v) if model is not None else None,
                    "auto": v == auto, "errors": row.get("errors", 0), "ttft_ms_p50": row.get("ttft_ms_p50"),
                    "large_share": row.get("large_share"),
                })
    res.report()
