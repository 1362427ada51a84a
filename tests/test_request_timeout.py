"""request_timeout_s on a real tritonserver: a request still unfinished at its deadline is aborted on every
model (its KV freed) and its client gets a clear error, counted as a `timeout`; the server keeps serving.
This is what bounds a non-streaming HTTP request whose client went away (Triton 2.51 does not report it)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from triton_harness import generate_stream, running_server, tiny_deployment, wait_metric

TIMEOUT_S = 1.5


def _config(tmp: Path, tiny_dir: Path) -> Path:
    return tiny_deployment(tmp / "timeout.yaml", tiny_dir, kv_cache_tokens=8192,
                           policy={"name": "random", "p": 0.3, "seed": 0},  # routed: the abort must reach both models
                           request_timeout_s=TIMEOUT_S)


def _generate(server, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST generate (not streaming): (HTTP status, the JSON answer)."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/tokenrouter/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_request_timeout_aborts_and_answers_with_an_error(tiny_dir: Path, tmp_path: Path) -> None:
    long = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0.0}
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        t0 = time.monotonic()
        status, answer = _generate(server, {"text_input": "def main():", "sampling_parameters": json.dumps(long)})
        elapsed = time.monotonic() - t0
        assert status >= 400 and "request_timeout_s" in answer.get("error", ""), (status, answer)
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 20, elapsed
        # A stream that outlives the deadline ends with the same error as its one final event.
        status, events = generate_stream(server, {"text_input": "x", "sampling_parameters": json.dumps(long),
                                                  "stream": True})
        assert "request_timeout_s" in json.dumps(events[-1]) and sum("error" in e for e in events) == 1, events
        # The server keeps serving; once idle no model holds a request or a KV block.
        short = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
        status, answer = _generate(server, {"text_input": "def main():", "sampling_parameters": json.dumps(short)})
        assert status == 200 and answer["text_output"], answer
        timeouts = 'tokenrouter_requests_finished_total{finish_reason="timeout",model="tokenrouter"}'
        assert wait_metric(server, timeouts, 2.0) == 2.0
        for model in ("small", "large"):
            assert wait_metric(server, f'tokenrouter_kv_blocks_used{{model="{model}"}}', 0.0) == 0.0
            assert wait_metric(server, f'tokenrouter_requests_held{{model="{model}"}}', 0.0) == 0.0
