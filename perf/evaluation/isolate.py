"""Run a measuring job in a process of its own when it uses the GPU.

An in-process engine's GPU memory (weights, KV pool, CUDA graph pools) is not reliably returned when the
engine is dropped while its threads wind down: the next engine of the section then finds no memory for its
KV cache (seen on the H200: the calibration engine's 0.6B + 32B were still resident when the ablation's
first step loaded). A process per job returns everything at exit. The job reports rows as it measures them
(`emit`), so a section cut short keeps every finished point.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from typing import Any

Emit = Callable[[str, Any], None]


def _child(name: str, kwargs: dict[str, Any], events: Any) -> None:
    from evaluation import jobs

    try:
        result = getattr(jobs, name)(lambda kind, value: events.put((kind, value)), **kwargs)
        events.put(("done", result))
    except BaseException:
        events.put(("error", traceback.format_exc()))


def run_job(name: str, on_event: Emit, isolate: bool, **kwargs: Any) -> Any:
    """`evaluation.jobs.<name>(emit, **kwargs)`, in a spawned process when `isolate`; its events go to
    `on_event` as they come; returns its result, or raises RuntimeError with the job's traceback."""
    if not isolate:
        from evaluation import jobs

        return getattr(jobs, name)(on_event, **kwargs)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state inherited, all of it freed at exit
    events = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, kwargs, events), daemon=True)
    proc.start()
    try:
        while True:
            try:
                kind, value = events.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"job {name} died (exit code {proc.exitcode})") from None
                continue
            if kind == "done":
                return value
            if kind == "error":
                raise RuntimeError(f"job {name} failed:\n{value}")
            on_event(kind, value)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
