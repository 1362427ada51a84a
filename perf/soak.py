"""A served soak: a closed loop of gRPC streaming requests, a share of them cancelled at random points.

    # against a running server
    python perf/soak.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
        --requests 500 --concurrency 8 --cancel-fraction 0.2
    # or start the server for the run (CPU default, or any deployment YAML), soak, stop it
    python perf/soak.py --serve config/r2r/tiny-small_tiny-large.yaml --requests 500 --concurrency 8

Each of `--concurrency` workers holds one gRPC stream and sends one request at a time. A cancelled request
stops the stream with `cancel_requests=True` after a random number of responses (Triton cancels it, the
router aborts it on every model) and the worker opens a new stream. What it checks, and reports:
- every request that is not cancelled ends with exactly one final response and no error;
- the server's own accounting agrees: `tokenrouter_requests_finished_total` grew by the number of requests
  (cancelled ones as `abort`, unless they finished first), and once idle every model holds no request and
  no KV block (`tokenrouter_requests_held`, `tokenrouter_kv_blocks_used`).
Exit code 0 only when all of that holds. Results go to `--out` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "with open(path) as f:\n    for line in f:",
    "# Compute the greatest common divisor\ndef gcd(a, b):",
]


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    extra_finals: int = 0  # requests that saw more than one final response
    missing_finals: int = 0  # requests that timed out without a final response
    output_tokens: int = 0
    elapsed_s: float = 0.0
    finished_delta: dict[str, float] = field(default_factory=dict)  # server's finish reasons during the run
    held_after: dict[str, float] = field(default_factory=dict)  # requests held / KV blocks used once idle

    def problems(self) -> list[str]:
        out = []
        if self.errors:
            out.append(f"{len(self.errors)} request(s) failed, first: {self.errors[0]}")
        if self.extra_finals:
            out.append(f"{self.extra_finals} request(s) got more than one final response")
        if self.missing_finals:
            out.append(f"{self.missing_finals} request(s) got no final response")
        if self.completed + self.cancelled != self.requests:
            out.append(f"{self.completed} completed + {self.cancelled} cancelled != {self.requests} sent")
        if self.finished_delta:
            counted = sum(self.finished_delta.values())
            if counted != self.requests:
                out.append(f"the server counted {counted:.0f} finished requests for {self.requests} sent "
                           f"({self.finished_delta})")
            if self.finished_delta.get("error", 0):
                out.append(f"the server counted {self.finished_delta['error']:.0f} failed request(s)")
        busy = {k: v for k, v in self.held_after.items() if v}
        if busy:
            out.append(f"not idle after the soak: {busy}")
        return out


def stream_inputs(prompt: str, max_tokens: int, *flags: str, sampling: dict[str, Any] | None = None) -> list[Any]:
    """tritonclient gRPC inputs for one streamed request of exactly `max_tokens` tokens (`ignore_eos`), greedy
    unless `sampling` (temperature, top_p, top_k) says otherwise, with the boolean request flags named in
    `flags` (e.g. "return_num_output_tokens") set."""
    import tritonclient.grpc as grpcclient

    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, **(sampling or {"temperature": 0.0})})
    values = [
        ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([sampling.encode()], dtype=np.object_), "BYTES"),
    ] + [(flag, np.array([True]), "BOOL") for flag in flags]
    inputs = []
    for name, arr, dtype in values:
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


class _Worker:
    """One gRPC stream, one request at a time; a cancellation stops the stream and opens a new one."""

    def __init__(self, url: str, result: SoakResult, lock: threading.Lock, timeout: float) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.result, self.lock, self.timeout = result, lock, timeout
        self.responses: queue.Queue = queue.Queue()
        self._open()

    def _open(self) -> None:
        self.responses = queue.Queue()
        q = self.responses  # bound now: a late callback of a stopped stream must not reach the next queue
        self.client.start_stream(callback=lambda result, error: q.put((result, error)))

    def run_one(self, rid: str, prompt: str, max_tokens: int, cancel_after: int | None) -> None:
        inputs = stream_inputs(prompt, max_tokens, "return_num_output_tokens")
        try:
            self.client.async_stream_infer("tokenrouter", inputs, request_id=rid, enable_empty_final_response=True)
        except Exception as e:  # the stream broke (the server went away): this request failed, the next gets a new one
            with self.lock:
                self.result.errors.append(f"{rid}: not sent: {e}")
                self.result.completed += 1
            self._reopen()
            return
        finals, seen, tokens, error = 0, 0, 0, None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                result, err = self.responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if err is not None:
                error = str(err)
                break
            seen += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
                n = result.as_numpy("num_output_tokens")
                tokens = int(n[0]) if n is not None else 0
                # Anything after the final response would be a protocol violation: look briefly.
                try:
                    self.responses.get(timeout=0.01)
                    finals += 1
                except queue.Empty:
                    pass
                break
            if cancel_after is not None and seen >= cancel_after:
                self._reopen()
                with self.lock:
                    self.result.cancelled += 1
                return
        with self.lock:
            if error is not None:
                self.result.errors.append(f"{rid}: {error}")
                # Errors end the request too; count it so the totals add up.
                self.result.completed += 1
            elif finals == 0:
                self.result.missing_finals += 1
                self.result.errors.append(f"{rid}: no final response within {self.timeout:.0f} s")
                self.result.completed += 1
            else:
                self.result.completed += 1
                self.result.extra_finals += finals > 1
                self.result.output_tokens += tokens

    def _reopen(self) -> None:
        """Stop the stream, cancelling what is in flight on it, and open a new one."""
        try:
            self.client.stop_stream(cancel_requests=True)
        except Exception:  # a broken stream cannot be stopped cleanly; it is replaced all the same
            pass
        self._open()

    def close(self) -> None:
        try:
            self.client.stop_stream()
        except Exception:  # a broken stream: nothing left to stop
            pass
        self.client.close()


def scrape(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for the tokenrouter metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenrouter_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _finished(m: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in m.items():
        if k.startswith("tokenrouter_requests_finished_total"):
            out[k.split('finish_reason="')[1].split('"')[0]] = v
    return out


def _held(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith(("tokenrouter_kv_blocks_used", "tokenrouter_requests_held"))}


def wait_idle(metrics_url: str, timeout: float = 30.0) -> dict[str, float]:
    """The held-request and KV gauges once they all read 0 (or whatever they read at the timeout).
    Metrics are updated off the decode loop, every 0.25 s."""
    deadline = time.monotonic() + timeout
    while True:
        held = _held(scrape(metrics_url))
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.3)


def run_soak(
    url: str,
    requests: int,
    concurrency: int,
    cancel_fraction: float = 0.2,
    max_tokens: int = 32,
    metrics_url: str | None = None,
    seed: int = 0,
    timeout: float = 120.0,
    progress: bool = False,
    cancellations: int | None = None,
) -> SoakResult:
    """Run the soak against the gRPC server at `url`; see the module docstring for what is checked.
    `cancellations`, if given, cancels exactly that many requests (chosen at random) instead of each one
    with probability `cancel_fraction`."""
    rng = random.Random(seed)
    if cancellations is not None:
        chosen = set(rng.sample(range(requests), min(cancellations, requests)))
    else:
        chosen = {i for i in range(requests) if rng.random() < cancel_fraction}
    plan = [
        (f"soak-{i}", PROMPTS[i % len(PROMPTS)], rng.randint(1, max_tokens) if i in chosen else None)
        for i in range(requests)
    ]
    result = SoakResult(requests=requests)
    before = _finished(scrape(metrics_url)) if metrics_url else {}
    lock = threading.Lock()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for item in plan:
        todo.put(item)

    def work() -> None:
        worker = _Worker(url, result, lock, timeout)
        try:
            # A request without a final response within `timeout` ends the soak: a server that stopped answering
            # (tritonserver 2.51 once hung in its own crash handler after a segfault in its gRPC stream handler)
            # would otherwise cost every request left its full timeout.
            while not result.missing_finals:
                try:
                    rid, prompt, cancel_after = todo.get_nowait()
                except queue.Empty:
                    return
                worker.run_one(rid, prompt, max_tokens, cancel_after)
        finally:
            worker.close()
            with lock:
                ended.append(time.monotonic())  # (the soak's duration: until its last worker ended)

    ended: list[float] = []
    start = time.monotonic()
    threads = [threading.Thread(target=work, name=f"soak-{i}", daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    gave_up: float | None = None
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)  # (progress; the duration comes from the workers' end times)
        if result.missing_finals and gave_up is None:
            gave_up = time.monotonic()
        if gave_up is not None and time.monotonic() - gave_up > timeout:  # workers stuck on a dead server
            break
        if progress:
            done = result.completed + result.cancelled
            print(f"\r{done}/{requests} requests ({result.cancelled} cancelled, {len(result.errors)} errors)",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    result.elapsed_s = (max(ended) if len(ended) == len(threads) else time.monotonic()) - start
    if metrics_url:
        try:
            _account(result, metrics_url, before)
        except OSError as e:  # the server went away: say so with the rest, rather than lose the result
            result.errors.append(f"the metrics endpoint {metrics_url} did not answer after the load: {e}")
    return result


def _account(result: SoakResult, metrics_url: str, before: dict[str, float]) -> None:
    result.held_after = wait_idle(metrics_url)
    # Cancelled requests are counted by the server once every model released them.
    deadline = time.monotonic() + 30
    while True:
        after = _finished(scrape(metrics_url))
        result.finished_delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
        if sum(result.finished_delta.values()) >= result.requests or time.monotonic() > deadline:
            return
        time.sleep(0.3)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import command_line, machine_info, now_iso, results_path, serving

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="gRPC address of a running server")
    where.add_argument("--serve", metavar="CONFIG", help="start tritonserver for this deployment YAML")
    p.add_argument("--metrics-url", help="the server's Prometheus endpoint (with --url)")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="cancel each request with this probability")
    p.add_argument("--cancellations", type=int, help="cancel exactly this many requests, chosen at random")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON (a bare name goes to perf/results/)")
    args = p.parse_args(argv)

    def soak(url: str, metrics_url: str | None) -> SoakResult:
        return run_soak(url, args.requests, args.concurrency, args.cancel_fraction, args.max_tokens,
                        metrics_url, args.seed, progress=True, cancellations=args.cancellations)

    server_alive = None
    if args.serve:
        import tempfile

        with tempfile.TemporaryDirectory() as work, serving(args.serve, Path(work)) as server:
            result = soak(server.grpc_url, server.metrics_url)
            server_alive = server.proc.poll() is None
    else:
        result = soak(args.url, args.metrics_url)
    problems = result.problems()
    if server_alive is False:
        problems.append("tritonserver exited during the soak")
    print(f"{result.requests} requests at concurrency {args.concurrency} in {result.elapsed_s:.1f} s: "
          f"{result.completed} completed, {result.cancelled} cancelled, {len(result.errors)} errors, "
          f"{result.output_tokens / max(result.elapsed_s, 1e-9):.1f} output tok/s; server: {result.finished_delta}")
    for line in problems:
        print("PROBLEM:", line)
    if args.out:
        path = results_path(args.out, ".json")
        path.write_text(json.dumps({"command": command_line(), "date": now_iso(), "machine": machine_info(),
                                    "result": asdict(result), "server_alive_after": server_alive,
                                    "problems": problems}, indent=2) + "\n")
        print(f"wrote {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
