"""The measuring jobs that hold models in this process (each run by evaluation/isolate.py, in a process of its
own on the GPU). Every job reports through `emit(kind, value)`: ("row", row) per measured point,
("calibration", (algorithm, record)) once calibrated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evaluation import systems
from evaluation.harness import calibrated, measure
from evaluation.isolate import Emit
from evaluation.workloads import make_workload
from tokenrouter.config import load_config


def calibrate_and_measure(
    emit: Emit, algorithm: str, models: str, seed: int, work: str, workloads: list[str], scale: float,
    concurrency: list[int], measure_too: bool,
) -> dict[str, Any]:
    """Calibrate `algorithm` on the prompts of `workloads` x `concurrency`, then (`measure_too`) measure the
    calibrated engine as the in-process system on them. Returns the calibrated deployment's path and policy."""
    with calibrated(algorithm, models, seed, Path(work), workloads, scale, concurrency) as (path, cfg, opened, record):
        emit("calibration", (algorithm, record))
        for name in workloads if measure_too else []:
            if name == workloads[0]:
                print(f"== {algorithm} / in-process", flush=True)
            w = make_workload(name, scale)
            for c in concurrency:
                row = measure(opened, w, c, cfg, seed, f"{algorithm} in-process {w.name} C={c}")
                emit("row", {"workload": w.name, "algorithm": algorithm, "system": "in-process", **row})
        return {"path": str(path), "policy": dict(cfg.policy)}


def measure_in_process(
    emit: Emit, config: str, system: str, algorithm: str, workloads: list[str], scale: float,
    concurrency: list[int], seed: int, extra: dict[str, Any] | None = None, tuning_round: bool = False,
) -> None:
    """An in-process engine of the deployment at `config` (`slm-only` / `llm-only`: one of its models alone)
    measured over `workloads` x `concurrency`; `extra` is merged into every row. `tuning_round`: one
    unmeasured round per point first (thresholds `auto` solves from measurements every few seconds)."""
    cfg = load_config(config)
    cfg = systems.system_config(cfg, system) if system in ("slm-only", "llm-only") else cfg
    with systems.in_process(cfg) as opened:
        for name in workloads:
            w = make_workload(name, scale)
            for c in concurrency:
                label = f"{algorithm} {system} {w.name} C={c}"
                if tuning_round:
                    measure(opened, w, c, cfg, seed + 1, f"{label} (tuning round, not kept)")
                row = measure(opened, w, c, cfg, seed, label)
                if tuning_round:
                    row["tuned_thresholds"] = dict(opened.engine().thresholds)
                emit("row", {"workload": w.name, "algorithm": algorithm, "system": system, **(extra or {}), **row})


def sweep(emit: Emit, config: str, concurrency: list[int], max_threshold: int, seed: int, scale: float) -> None:
    """Every feasible threshold vector with B_i <= max_threshold at each concurrency, measured on one engine,
    next to the Markov model's prediction from this engine's own measurements; `auto`'s pick marked (and
    measured when outside the grid)."""
    from evaluation.sections import predicted
    from tokenrouter.engine.autotune import solve_thresholds, system_model
    from tokenrouter.tuning.system import feasible_thresholds

    cfg = load_config(config)
    names = list(cfg.models)
    workload = make_workload("low-effort", scale)
    with systems.in_process(cfg) as opened:
        engine = opened.engine()
        for c in concurrency:
            measured: dict[tuple[int, ...], dict[str, Any]] = {}

            def run(v: tuple[int, ...], c: int = c, measured: dict = measured) -> None:
                # The coordinator reads the configured thresholds at every admission.
                engine.config.batching.thresholds = dict(zip(names, v))
                measured[v] = measure(opened, workload, c, cfg, seed, f"sweep C={c} B={'/'.join(map(str, v))}")

            for v in feasible_thresholds(len(names), c):
                if max(v) <= max_threshold:
                    run(v)
            stats = {m: s.stats for m, s in engine.subservers.items()}
            model = system_model(names, stats, c)
            tuned = solve_thresholds(names, stats, c)
            auto = tuple(tuned.thresholds[m] for m in names) if tuned is not None else None
            if auto is not None and auto not in measured:
                run(auto)
            for v, row in measured.items():
                emit("row", {
                    "concurrency": c, "thresholds": dict(zip(names, v)), "measured_tok_s": row.get("output_tok_s"),
                    "predicted_tok_s": predicted(model, v) if model is not None else None,
                    "auto": v == auto, "errors": row.get("errors", 0), "ttft_ms_p50": row.get("ttft_ms_p50"),
                    "large_share": row.get("large_share"),
                })
