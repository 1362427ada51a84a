"""The systems compared, each behind one client interface, and the closed loop that drives them.

- `triton`: the product, `tokenrouter serve`'s Triton deployment (router + one subserver per model),
  streamed over gRPC; text in and out (the benchmark tokenizer maps every id to its own piece, so the
  server sees exactly the workload's ids).
- `in-process`: the same deployment as an in-process `Engine` in background mode (no server).
- `std-serving`: one plain single-model Triton server per LLM plus a dispatcher asking for one token per
  call (std_serving/).
- `slm-only` / `llm-only`: the small / large model alone, in-process (the deployment's settings for that
  model, no routing): the cost and speed bounds routing sits between.

A client's `generate(prompt_ids, max_tokens)` returns one record: start / end (seconds of one monotonic clock),
ttft and e2e (seconds), output tokens, output ids, and the routing stats (large-model share, handoffs),
or {"error": ...}. The driver (`run_point`) keeps C sessions in flight; bench_served.summarize turns
records into the reported figures, so every system is measured by the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from evaluation.workloads import Session
from tokenrouter.config import EngineConfig

SYSTEMS = ("in-process", "slm-only", "llm-only", "triton", "std-serving")
REQUEST_TIMEOUT_S = 600.0


class Client(Protocol):
    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Opened:
    """A started system: `client()` makes one client per driving thread; `engine()` is the in-process
    Engine (None for servers)."""

    def __init__(self, client: Callable[[], Client], engine: Callable[[], Any] = lambda: None) -> None:
        self.client, self.engine = client, engine


# -- in process ---------------------------------------------------------------------------------------------


class EngineClient:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        from tokenrouter import SamplingParams

        done = threading.Event()
        rec: dict[str, Any] = {}

        def on_output(out: Any) -> None:
            now = time.perf_counter()
            if out.delta_token_ids and "first" not in rec:
                rec["first"] = now
            if out.finished:
                rec["end"], rec["out"] = now, out
                done.set()

        params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, **sampling)
        start = time.perf_counter()
        try:
            rid = self.engine.add_request(list(prompt_ids), params, listener=on_output)
        except ValueError as e:
            return {"error": str(e)}
        if not done.wait(REQUEST_TIMEOUT_S):
            self.engine.abort(rid)
            return {"error": f"no final output within {REQUEST_TIMEOUT_S:.0f} s"}
        out = rec["out"]
        if out.finish_reason == "error":
            return {"error": out.error}
        end = rec["end"]
        return {
            "start": start, "end": end, "ttft": rec.get("first", end) - start, "e2e": end - start,
            "tokens": len(out.token_ids), "output_ids": list(out.token_ids),
            "routing": {k: out.stats.get(k) for k in ("large_token_share", "handoffs")},
        }

    def close(self) -> None:
        pass


@contextlib.contextmanager
def in_process(cfg: EngineConfig) -> Iterator[Opened]:
    """An Engine for `cfg` in background mode. GPU memory is released after."""
    from tokenrouter import Engine

    # Only `held` refers to the engine, so that it (and its GPU memory) goes when the block ends, even while the
    # caller still holds the factory.
    held = [Engine(cfg)]
    held[0].start()
    try:
        yield Opened(lambda: EngineClient(held[0]), lambda: held[0])
    finally:
        held.pop().shutdown()
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def solo_config(cfg: EngineConfig, which: str) -> EngineConfig:
    """The deployment's small (`slm`) or large (`llm`) model alone, as perf/bench_engine.py's solo baseline."""
    from bench_engine import variant_config

    return variant_config(cfg, "always-small" if which == "slm" else "always-large", "solo", None)


# -- served -------------------------------------------------------------------------------------------------


class TritonClient:
    """One gRPC stream to the `tokenrouter` model (perf/bench_served.py's request, with the text kept)."""

    def __init__(self, url: str, tokenizer: Any) -> None:
        import tritonclient.grpc as grpcclient

        self.tokenizer = tokenizer
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        from bench_served import _one

        try:
            text = self.tokenizer.decode(prompt_ids)
            rec = _one(self.client, self.responses, text, max_tokens, REQUEST_TIMEOUT_S, sampling)
        except queue.Empty:
            return {"error": f"no response within {REQUEST_TIMEOUT_S:.0f} s"}
        if "error" not in rec:
            rec["output_ids"] = self.tokenizer.encode(rec.pop("text"), add_special_tokens=False)
        return rec

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@contextlib.contextmanager
def mps_if_shared(cfg: EngineConfig) -> Iterator[None]:
    """CUDA MPS while the models of `cfg` share a GPU (as `tokenrouter serve` does), unless one runs already."""
    from tokenrouter.serving import mps

    started = False
    if mps.shared_gpus(cfg) and not mps.running():
        mps.start()
        started = True
    try:
        yield
    finally:
        if started:
            mps.stop()


@contextlib.contextmanager
def served(config_path: str, cfg: EngineConfig, execution_env: Path | None = None) -> Iterator[Opened]:
    """The product: tritonserver on the deployment's repository (under MPS when models share a GPU)."""
    from _common import serving

    from tokenrouter.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path)
    with tempfile.TemporaryDirectory(prefix="eval-triton-") as work, mps_if_shared(cfg):
        with serving(config_path, Path(work), execution_env) as server:
            url = f"127.0.0.1:{server.grpc_port}"
            yield Opened(lambda: TritonClient(url, tokenizer))


@contextlib.contextmanager
def std_serving(config_path: str, cfg: EngineConfig, execution_env: Path | None = None) -> Iterator[Opened]:
    """Std. Serving: single-model servers plus the per-token dispatcher, with the deployment's policy."""
    from std_serving.dispatcher import StdClient
    from std_serving.repository import serving_std

    with tempfile.TemporaryDirectory(prefix="eval-std-") as work:
        with serving_std(config_path, Path(work), execution_env) as server:
            url = f"127.0.0.1:{server.grpc_port}"
            yield Opened(lambda: _StdAdapter(StdClient(url, cfg, dict(cfg.policy))))


class _StdAdapter:
    """StdClient's records in the shape bench_served.summarize reads."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        rec = self.client.generate(prompt_ids, max_tokens, sampling=sampling)
        if "error" not in rec:
            share = rec["large_tokens"] / rec["tokens"] if rec["tokens"] else 0.0
            rec["routing"] = {"large_token_share": share, "handoffs": rec["handoffs"]}
        return rec

    def close(self) -> None:
        self.client.close()


# -- the closed loop ----------------------------------------------------------------------------------------


def run_point(
    system: Opened, sessions: list[Session], concurrency: int, progress: Any = None
) -> list[dict[str, Any]]:
    """Keep `concurrency` sessions in flight (a worker takes the next session when its own ends) and return
    one record per request. A turn's prompt is the session so far (earlier prompts and their outputs)
    plus its new tokens; a failed turn ends its session."""
    todo: queue.SimpleQueue[Session] = queue.SimpleQueue()
    for s in sessions:
        todo.put(s)
    records: list[dict[str, Any]] = []

    def work() -> None:
        client = system.client()
        try:
            while True:
                try:
                    session = todo.get_nowait()
                except queue.Empty:
                    return
                context: list[int] = []
                for turn in session.turns:
                    prompt = context + turn
                    rec = client.generate(prompt, session.max_tokens, session.sampling)
                    records.append(rec)  # list.append is atomic
                    if progress is not None:
                        progress.update(1)
                    if "error" in rec:
                        break
                    context = prompt + rec.pop("output_ids")
        finally:
            client.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(concurrency, len(sessions)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def warm_up(system: Opened, prompt: list[int], concurrency: int) -> None:
    """One round of `concurrency` short requests, not measured (graphs, allocator, connections)."""
    run_point(system, [Session([list(prompt)], 8) for _ in range(concurrency)], concurrency)


def system_config(cfg: EngineConfig, system: str) -> EngineConfig:
    if system == "slm-only":
        return solo_config(cfg, "slm")
    if system == "llm-only":
        return solo_config(cfg, "llm")
    return dataclasses.replace(cfg)
