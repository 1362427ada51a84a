"""Starting a real tritonserver for end-to-end tests, and small client helpers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tokenrouter.serving import triton_install
from tokenrouter.serving.repository import write_repository
from tokenrouter.serving.server import TritonServer, free_ports


@contextmanager
def running_server(config_path: Path, workdir: Path, execution_env: Path | None = None):
    env = execution_env or triton_install.execution_env()
    repo = write_repository(config_path, workdir / "model_repository", execution_env=env)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo, http, grpc, metrics, log_file=workdir / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        server.stop()


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


def _events(body: str) -> list[dict]:
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    if not events and body.strip():
        events = [json.loads(body)]
    return events


def metrics(server: TritonServer) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for our metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenrouter_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
