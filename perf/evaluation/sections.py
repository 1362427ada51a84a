"""The sections of perf/evaluate.py: main, ablation, sweep.

main: for each algorithm, its deployment is calibrated on an in-process engine (evaluation/calibrate.py),
which is then measured as the in-process system; the single models and the servers follow, the servers
from the calibrated deployment (in-process first: the servers start CUDA MPS when models share a GPU).

The ablation and the sweep run R2R (calibrated as in the main section) in process on the low-effort
workload. The ablation turns the engine's optimizations on one at a time, each by a deployment setting
(no benchmark-only code in the engine): the settings of every step are in the results. The sweep
measures every feasible threshold vector (sum(B_i - 1) < C, each B_i <= --max-threshold) next to the
Markov model's prediction from the same run's measured step latencies and routing rates, and marks the
vector `auto` picks. Jobs that hold models run in a process of their own on the GPU (evaluation/isolate.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from evaluation import deployments, systems
from evaluation.harness import Results, measure
from evaluation.isolate import run_job
from evaluation.workloads import Workload, make_workload
from tokenrouter.config import EngineConfig, ModelConfig, load_config

SOLO = ("slm-only", "llm-only")


def _recorder(res: Results) -> Any:
    def on_event(kind: str, value: Any) -> None:
        if kind == "row":
            res.add(value)
        elif kind == "calibration":
            algorithm, record = value
            res.data["calibration"][algorithm] = record
            res.save()

    return on_event


def _uses_gpu(models: str) -> bool:
    # The qwen3 deployments place every model on CUDA, the tiny ones on the CPU.
    return load_config(deployments.config_path("r2r", models)).entry_model.device.startswith("cuda")


def _calibrate(args: argparse.Namespace, res: Results, work: Path, algorithm: str, measure_too: bool,
               workloads: list[str] | None = None) -> dict[str, Any]:
    """Calibrate `algorithm` on the prompts the section measures (`workloads`, default --workloads, at
    --concurrency) and, with `measure_too`, measure it in process."""
    return run_job(
        "calibrate_and_measure", _recorder(res), _uses_gpu(args.models), algorithm=algorithm, models=args.models,
        seed=args.seed, work=str(work), workloads=workloads or args.workloads, scale=args.scale,
        concurrency=args.concurrency, measure_too=measure_too,
    )


def run_main(args: argparse.Namespace, out_dir: Path, work: Path) -> None:
    workloads = [make_workload(w, args.scale) for w in args.workloads]
    res = Results("main", f"Routed serving vs Std. Serving and single models ({args.models})", out_dir, args.scale,
                  args.note)
    for w in workloads:
        res.data["workloads"][w.name] = w.describe()
    solo_done = False
    for algorithm in args.algorithms:
        try:
            deployment = _calibrate(args, res, work, algorithm, "in-process" in args.systems)
        except Exception as e:  # a failing algorithm is a note, not a lost section
            print(f"!! {algorithm} / calibration or in-process failed: {e!r}", flush=True)
            res.note(f"{algorithm} / calibration or in-process: failed: {e!r}")
            continue
        path = Path(deployment["path"])
        cfg = load_config(path)
        for system in args.systems:
            if system == "in-process" or (system in SOLO and solo_done):
                continue  # the same small and large model for every algorithm: measured once
            algo = "-" if system in SOLO else algorithm
            print(f"== {algo} / {system}", flush=True)
            try:
                if system in SOLO:
                    run_job("measure_in_process", _recorder(res), _uses_gpu(args.models), config=str(path),
                            system=system, algorithm=algo, workloads=args.workloads, scale=args.scale,
                            concurrency=args.concurrency, seed=args.seed)
                else:
                    with _open_server(system, path, cfg, args.execution_env) as opened:
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


def _open_server(system: str, path: Path, cfg: EngineConfig, execution_env: Path | None) -> Any:
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
    ("+ CUDA graphs for extends", {"cuda_graph_max_tokens": ModelConfig.cuda_graph_max_tokens}),  # the default
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
    calibrated = load_config(_calibrate(args, res, work, "r2r", False, [workload.name])["path"])
    batching = {"max_wait_ms": calibrated.batching.max_wait_ms, "auto_interval_s": calibrated.batching.auto_interval_s}
    switches: dict[str, Any] = {}
    for step, (label, change) in enumerate(ABLATION):
        switches = {**switches, **change}
        path = deployments.write_deployment(source, work / f"ablation{step}.yaml", calibrated.policy,
                                            _overrides(switches, batching))
        print(f"== ablation {step}: {label}", flush=True)
        try:
            run_job("measure_in_process", _recorder(res), _uses_gpu(args.models), config=str(path),
                    system="in-process", algorithm="r2r", workloads=[workload.name], scale=args.scale,
                    concurrency=[c], seed=args.seed, extra={"step": step, "label": label, "config": dict(switches)},
                    tuning_round=switches["thresholds"] == "auto")
        except Exception as e:
            print(f"!! ablation step {step} failed: {e!r}", flush=True)
            res.add({"step": step, "label": label, "config": dict(switches), "concurrency": c, "requests": 0,
                     "errors": 1, "first_error": repr(e)[-300:]})
    res.report()


def predicted(system: Any, thresholds: tuple[int, ...]) -> float:
    """The Markov chain's long-run tok/s for `thresholds` (the simulator when the chain is too large, or the
    measured system has handoff transit, which only the simulator models)."""
    from tokenrouter.tuning.choose import simulated_throughput
    from tokenrouter.tuning.markov import expected_throughput

    try:
        return float(expected_throughput(system, thresholds))
    except (ValueError, RuntimeError):
        return float(simulated_throughput(system, thresholds))


def run_sweep(args: argparse.Namespace, out_dir: Path, work: Path) -> None:
    workload = make_workload("low-effort", args.scale)
    res = Results("sweep", f"Threshold sweep, R2R, in process ({args.models})", out_dir, args.scale,
                  args.note + [f"thresholds B_i <= {args.max_threshold}; workload {workload.name}"])
    res.data["workloads"][workload.name] = workload.describe()
    source = deployments.config_path("r2r", args.models)
    calibrated = load_config(_calibrate(args, res, work, "r2r", False, [workload.name])["path"])
    path = deployments.write_deployment(source, work / "sweep.yaml", calibrated.policy, {
        "batching": {"thresholds": 1, "max_wait_ms": calibrated.batching.max_wait_ms}})
    try:
        run_job("sweep", _recorder(res), _uses_gpu(args.models), config=str(path), concurrency=args.concurrency,
                max_threshold=args.max_threshold, seed=args.seed, scale=args.scale)
    except Exception as e:
        print(f"!! sweep failed: {e!r}", flush=True)
        res.note(f"sweep: failed: {e!r}")
    res.report()
