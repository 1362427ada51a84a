"""Starting a real tritonserver for end-to-end tests, and small client helpers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tokenrouter.serving import triton_install
from tokenrouter.serving.repository import write_repository
from tokenrouter.serving.server import TritonServer, free_ports

REPO = Path(__file__).resolve().parents[1]
TINY_PAIR = REPO / "config" / "r2r" / "tiny-small_tiny-large.yaml"

# perf/soak.py is the one client that reads the server's Prometheus metrics; the tests use it too.
sys.path.insert(0, str(REPO / "perf"))
from soak import scrape  # noqa: E402


def tiny_deployment(path: Path, tiny_dir: Path, source: Path = TINY_PAIR, *, kv_cache_tokens: int | None = None,
                    batching: dict | None = None, **top: object) -> Path:
    """Write to `path` the shipped deployment `source` (the r2r tiny pair unless given) with its models in
    `tiny_dir` (`tiny_dir / <name>`); `kv_cache_tokens` for every model (None: the shipped value); `top`
    replacing top-level keys (policy, request_timeout_s, ...); `batching` updating keys of the shipped batching
    section. Returns `path`. The models stay in the shipped order (`sort_keys=False`): the entry must be listed
    first, and the policies take the first model as the small one."""
    cfg = yaml.safe_load(source.read_text())
    for name, m in cfg["models"].items():
        m["path"] = str(tiny_dir / name)
        if kv_cache_tokens is not None:
            m["kv_cache_tokens"] = kv_cache_tokens
    cfg.update(top)
    if batching:
        cfg["batching"].update(batching)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@contextmanager
def running_server(config_path: Path, workdir: Path, execution_env: Path | None = None):
    """A tritonserver on the deployment, ready. Like `tokenrouter serve`, it restricts Triton's admin APIs:
    send `server.admin_key` as header `admin-key` (gRPC: `triton-grpc-protocol-admin-key`) to reach them."""
    env = execution_env or triton_install.execution_env()
    repo = write_repository(config_path, workdir / "model_repository", execution_env=env)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo, http, grpc, metrics, log_file=workdir / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(timeout=240)
        yield server
    except Exception:
        # The log lives in pytest's temporary folder: without its end in the report, a crash seen only in CI
        # cannot be diagnosed.
        print(server_state(server, lines=80), file=sys.stderr)
        raise
    finally:
        server.stop()


def server_state(server: TritonServer, lines: int = 25) -> str:
    """Whether tritonserver runs (or its exit status: -11 is a segfault) and the end of its log, start-up
    tables left out: for a test's failure message."""
    code = server.proc.poll() if server.proc else None
    state = "running" if code is None else f"exited with status {code}"
    log = server.log_file
    text = log.read_text(errors="replace") if log and log.exists() else ""
    kept = [line for line in text.splitlines() if not line.startswith(("+", "|"))]
    return f"tritonserver {state}; the end of {log}:\n" + "\n".join(kept[-lines:])


def generate_stream(server: TritonServer, body: dict, timeout: float = 60) -> tuple[int, list[dict]]:
    """POST generate_stream; (HTTP status, SSE events as dicts). Errors come back as a status >= 400 or an
    event with an "error" key."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v2/models/tokenrouter/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _events(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, _events(e.read().decode())


def served_again(server: TritonServer, body: dict, within_s: float, failure: str,
                 context: Callable[[], str] = lambda: "", request_timeout_s: float = 30) -> list[dict]:
    """Send `body` every 0.5 s until `server` serves it without an error, within `within_s` (plus at most one
    `request_timeout_s`: the last try is not cut short); the events of the one served. No answer at all (a router
    or a server not back yet; none within `request_timeout_s`; a connection dropped mid-answer) counts as not yet.
    On time out: AssertionError with `failure`, the last answer and `context()` (a log's tail)."""
    deadline, last = time.monotonic() + within_s, "no answer"
    while True:
        try:
            status, events = generate_stream(server, body, timeout=request_timeout_s)
            if status == 200 and not any("error" in e for e in events):
                return events
            last = f"{status} {events}"[:2000]
        except (OSError, http.client.HTTPException) as e:
            last = repr(e)
        assert time.monotonic() < deadline, f"{failure}: {last}\n{context()}"
        time.sleep(0.5)


def stream_text(events: list[dict]) -> str:
    """The text of a stream's responses (how the router grouped the tokens into responses is timing's)."""
    return "".join(e.get("text_output") or "" for e in events)


def _events(body: str) -> list[dict]:
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    if not events and body.strip():
        events = [json.loads(body)]
    return events


def metrics(server: TritonServer) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for our metrics."""
    return scrape(server.metrics_url)


def wait_metric(server: TritonServer, key: str, want: float, timeout: float = 30.0) -> float | None:
    """Poll metric `key` until it equals `want` or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = metrics(server).get(key)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def stubs_of(repo: Path, model: str = "") -> list[int]:
    """Python-backend stub processes of the repository at `repo` (their command line names the model.py
    they serve), of one model if given."""
    return [pid for pid, _ in stub_regions_of(repo, model)]


def one_stub(repo: Path, model: str, timeout: float = 10.0) -> int:
    """The pid of `model`'s stub process, once exactly one process has its command line. A CI run (2026-12-05) saw
    two for a model that was serving, with no fault injected yet (what the second was is not known): wait up to
    `timeout` for one, and otherwise fail with what was there, parents and states included."""
    deadline = time.monotonic() + timeout
    while len(pids := stubs_of(repo, model)) != 1:
        if time.monotonic() > deadline:
            shown = subprocess.run(["ps", "-ww", "-o", "pid=,ppid=,stat=,args="] + [f"-p{p}" for p in pids],
                                   capture_output=True, text=True).stdout if pids else ""
            raise AssertionError(f"{len(pids)} stub processes of {repo}/{model} for {timeout:g} s:\n{shown}")
        time.sleep(0.1)
    return pids[0]


def stub_regions_of(repo: Path, model: str = "") -> list[tuple[int, str]]:
    """(pid, shared-memory region) of each Python-backend stub of `repo` (of one model if given): a stub's
    command line is the model.py it serves, then its /dev/shm region."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    where = f"{repo}/{model}/" if model else f"{repo}/"
    stubs = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        argv = args.split()
        if len(argv) > 2 and argv[0].endswith("triton_python_backend_stub") and argv[1].startswith(where):
            stubs.append((int(pid), argv[2]))
    return stubs


class Streams:
    """`fn(prompt)` for each prompt, each on a thread of its own (started at once): `join` waits for them all and
    returns their results by prompt, failing the test on a thread that hung or raised (with what it raised)."""

    def __init__(self, fn: Callable[[str], Any], prompts: list[str]) -> None:
        self.results: dict[str, Any] = {}
        self.failures: list[BaseException] = []

        def run(prompt: str) -> None:
            try:
                self.results[prompt] = fn(prompt)
            except BaseException as e:  # (reported by `join`, on the test's thread)
                self.failures.append(e)

        self.threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in self.threads:
            t.start()

    def join(self, timeout: float, hung: str) -> dict[str, Any]:
        for t in self.threads:
            t.join(timeout=timeout)
        assert not any(t.is_alive() for t in self.threads), hung
        assert not self.failures, self.failures[0]
        return self.results


@contextmanager
def killed_while_holding(server: TritonServer, repo: Path, model: str, timeout: float = 60.0):
    """Once `model` holds a request (a fault injected at a fixed time often found none there), kill its process
    with its settings hidden, so that its revival fails until the block ends: what is checked inside runs while
    it is down. Yields the dead process's pid; the settings are back afterwards."""
    deadline = time.monotonic() + timeout
    while metrics(server).get(f'tokenrouter_requests_held{{model="{model}"}}', 0) < 1:
        assert time.monotonic() < deadline, f"no request reached the {model} model"
        time.sleep(0.05)
    pid = one_stub(repo, model)
    settings = repo / model / "1" / "model.json"
    settings.rename(settings.with_suffix(".hidden"))
    try:
        os.kill(pid, signal.SIGKILL)
        yield pid
    finally:
        settings.with_suffix(".hidden").rename(settings)
