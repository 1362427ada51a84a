"""Faults on the served CPU default, against a real tritonserver: a model's process killed mid-request, the
KV pool exhausted under load, clients that disconnect mid-stream. Nothing may hang, every request ends
with exactly one final response (or a clear error), and once idle no model holds a request or a KV block."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tokenrouter.tokenizer import encode_prompt, load_tokenizer
from triton_harness import (
    Streams,
    generate_stream,
    killed_while_holding,
    metrics,
    one_stub,
    running_server,
    stream_text,
    stubs_of,
    tiny_deployment,
    wait_metric,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from soak import run_soak, wait_idle  # noqa: E402

LONG = {"max_tokens": 3000, "ignore_eos": True}


def _config(tmp: Path, tiny_dir: Path, kv_cache_tokens: int = 4096, p: float = 0.3, **top) -> Path:
    top.setdefault("policy", {"name": "random", "p": p, "seed": 0})
    return tiny_deployment(tmp / "faults.yaml", tiny_dir, kv_cache_tokens=kv_cache_tokens, **top)


def _body(prompt: str, params: dict) -> dict:
    return {"text_input": prompt, "sampling_parameters": json.dumps(params), "stream": True}


def _fault_under_streams(server, repo: Path, fault, error: str, within_s: float = 60.0) -> int:
    """Four long streams in flight, then `fault(pid)` on the large model's process: each stream ends within
    `within_s` with exactly one final response, an error containing `error`. The process's pid."""
    results: list[tuple[int, list[dict]]] = []
    streams = [
        threading.Thread(target=lambda i=i: results.append(generate_stream(server, _body(f"x{i}", LONG))))
        for i in range(4)
    ]
    for t in streams:
        t.start()
    time.sleep(1.0)  # mid-request: 3,000 tokens take far longer than this
    large = one_stub(repo, "large")
    fault(large)
    begun = time.monotonic()
    for t in streams:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in streams), "a stream hung after the fault"
    assert time.monotonic() - begun < within_s
    for status, events in results:
        errors = [e["error"] for e in events if "error" in e]
        assert status == 200 and len(errors) == 1 and events[-1] == {"error": errors[0]}, events[-3:]
        assert error in errors[0]
    return large


def _served_again(server, repo: Path, old: int, requests: int = 24, seed: int = 5) -> None:
    """The large model reloaded (a new process), and a closed loop of requests served without a problem."""
    assert wait_metric(server, 'tokenrouter_model_up{model="large"}', 1.0, 180) == 1.0
    assert stubs_of(repo, "large") != [old]
    result = run_soak(server.grpc_url, requests=requests, concurrency=4, cancel_fraction=0.0, max_tokens=24,
                      metrics_url=server.metrics_url, seed=seed)
    assert result.problems() == [], result
    assert sum(result.finished_delta.values()) == requests
    assert server.proc.poll() is None


@pytest.mark.slow
def test_a_stopped_subserver_is_killed_by_the_watchdog_and_reloaded(tiny_dir: Path, tmp_path: Path) -> None:
    """A model process that stands still without exiting (stopped here; a thread holding Python's lock alike)
    closes no socket: its requests waited for ever (found by a fault-injection pass). The router kills a model
    that sent nothing, not even its heartbeat, for watchdog_timeout_s; its requests fail saying so, and it is
    reloaded."""
    repo = tmp_path / "model_repository"
    with running_server(_config(tmp_path, tiny_dir, watchdog_timeout_s=3), tmp_path) as server:
        stopped: list[int] = []
        try:
            # Before any request: the router connects to every model once it listens, so this one is watched too.
            idle = one_stub(repo, "large")
            stopped.append(idle)
            os.kill(idle, signal.SIGSTOP)
            deadline = time.monotonic() + 60
            while stubs_of(repo, "large") in ([idle], []):
                assert time.monotonic() < deadline, "a model stopped before any request was not replaced"
                time.sleep(0.5)
            assert wait_metric(server, 'tokenrouter_model_up{model="large"}', 1.0, 60) == 1.0
            large = _fault_under_streams(
                server, repo, lambda pid: (stopped.append(pid), os.kill(pid, signal.SIGSTOP)),
                "'large' went away during the request (its process made no progress for 3 s", within_s=30)
            _served_again(server, repo, large)
        finally:
            for pid in stopped:  # the watchdog did not kill it: let the server stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_subserver_whose_loop_is_stuck_exits_and_is_reloaded(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A decoding loop stuck inside a step (a hung GPU kernel, a deadlock) while the process's other threads run
    on: its heartbeats satisfy the router. The process watches its own loop and exits, with the loop's stack in
    the log; the router fails what it held and reloads it."""
    flag, repo = tmp_path / "stall", tmp_path / "model_repository"
    # The stubs import the test policy from their working directory, tritonserver's (they do not get PYTHONPATH).
    monkeypatch.chdir(Path(__file__).parent)
    policy = {"name": "test_stall", "module": "stall_policy", "p": 0.3, "seed": 0, "stall_model": "large",
              "stall_file": str(flag)}
    with running_server(_config(tmp_path, tiny_dir, watchdog_timeout_s=3, policy=policy), tmp_path) as server:
        large = _fault_under_streams(server, repo, lambda pid: flag.touch(),
                                     "'large' went away during the request (its process exited", within_s=30)
        log = (tmp_path / "tritonserver.log").read_text()
        assert "large: the decoding loop has not gone round for" in log and "in route" in log, log[-3000:]
        flag.unlink()
        _served_again(server, repo, large)


def _routed_then_small(tiny_dir: Path, prompt: str, text: str, n: int) -> bool:
    """Whether `text` is the whole deployment's greedy output (the naive reference) up to some token, then the
    small model's greedy continuation from there: what a request the small model took back must give."""
    from test_routing_vs_naive import hf_model, naive_generate

    tok = load_tokenizer(str(tiny_dir / "small"))
    ids = encode_prompt(tok, prompt)
    routed, _ = naive_generate(tiny_dir, ["small", "large"], {"name": "random", "p": 0.3, "seed": 0}, ids, n)
    small = hf_model(str(tiny_dir / "small"))
    for f in range(n, -1, -1):  # where it was taken back: the last point whose routed text `text` begins with
        head = routed[:f]
        if not text.startswith(tok.decode(head, skip_special_tokens=True)):
            continue
        tokens = ids + head
        with torch.no_grad():
            while len(tokens) < len(ids) + n:
                tokens.append(int(small(torch.tensor([tokens])).logits[0, -1].argmax()))
        if tok.decode(tokens[len(ids):], skip_special_tokens=True) == text:
            return True
    return False


@pytest.mark.slow
def test_routing_around_a_killed_subserver(tiny_dir: Path, tmp_path: Path) -> None:
    """model_down: route_around. The large model killed mid-request: every request goes on, those it was decoding
    at the small model from the KV that one kept, and ends normally with all its tokens; while it is down new
    requests are served (by the small model alone); once it is back it is routed to again, from a first visit."""
    repo = tmp_path / "model_repository"
    n = 200
    params = {"max_tokens": n, "ignore_eos": True, "temperature": 0}

    def request(prompt: str) -> tuple[int, list[dict]]:
        return generate_stream(server, {**_body(prompt, params), "return_finish_reason": True,
                                        "return_num_output_tokens": True, "return_routing_stats": True})

    def assert_whole(status: int, events: list[dict]) -> dict:
        assert status == 200 and not any("error" in e for e in events), events[-3:]
        final = events[-1]
        assert final["finish_reason"] == "length" and final["num_output_tokens"] == n, final
        return json.loads(final["routing_stats"])["tokens_per_model"]

    with running_server(_config(tmp_path, tiny_dir, model_down="route_around"), tmp_path) as server:
        prompts = [f"def f{i}(x):" for i in range(6)]
        streams = Streams(request, prompts)
        with killed_while_holding(server, repo, "large") as large:
            results = streams.join(120, "a stream hung after its model died")
            for prompt in prompts:
                assert_whole(*results[prompt])
                text = stream_text(results[prompt][1])
                assert _routed_then_small(tiny_dir, prompt, text, n), prompt
            assert metrics(server)['tokenrouter_model_up{model="large"}'] == 0.0
            assert assert_whole(*request("while it is down")) == {"small": n}
        assert wait_metric(server, 'tokenrouter_model_up{model="large"}', 1.0, 180) == 1.0
        assert stubs_of(repo, "large") != [large]
        after = assert_whole(*request("after it is back"))
        assert after.get("large", 0) > 0, after  # routed to again: a first visit to the new process
        held = wait_idle(server.metrics_url)
        assert not any(held.values()), held  # every KV block and request released on both models
        log = (tmp_path / "tritonserver.log").read_text()
        assert "goes on with it from its own KV" in log


@pytest.mark.slow
def test_killed_subserver_fails_its_requests_and_is_reloaded(tiny_dir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "model_repository"
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        large = _fault_under_streams(server, repo, lambda pid: os.kill(pid, signal.SIGKILL),
                                     "'large' went away during the request")

        # Until it is back (the router reloads it), requests are refused at once with a message that says
        # why; then they are served again.
        # The reload must not stall the router: answers come at once (the reload takes seconds).
        start = time.monotonic()
        status, events = generate_stream(server, _body("y", {"max_tokens": 8}))
        assert time.monotonic() - start < 5.0, "the router stalled while the model was reloaded"
        if "error" in events[-1]:
            assert "'large' is unavailable" in events[-1]["error"] and "restarted" in events[-1]["error"]
        _served_again(server, repo, large, requests=40, seed=3)


@pytest.mark.slow
def test_kv_exhaustion_under_load_queues_and_preempts_never_fails(tiny_dir: Path, tmp_path: Path) -> None:
    """A KV pool of 512 tokens per model under 8 concurrent requests that need ~160 each: requests wait or
    are preempted and recomputed; all finish, and the pool is whole again afterwards."""
    with running_server(_config(tmp_path, tiny_dir, kv_cache_tokens=512), tmp_path) as server:
        result = run_soak(server.grpc_url, requests=48, concurrency=8, cancel_fraction=0.1, max_tokens=150,
                          metrics_url=server.metrics_url, seed=4, timeout=300)
        assert result.problems() == [], result
        # A prompt longer than the pool can hold is refused for that request alone, with the limit: by the router
        # (it knows the pools from the models' heartbeats, long since the soak began).
        status, events = generate_stream(server, _body("word " * 600, {"max_tokens": 4}))
        assert "but the context limit is 512, the smallest KV pool" in events[-1].get("error", ""), events
        assert server.proc.poll() is None


_GRPC_CLIENT = """
import sys, queue, numpy as np
sys.path.insert(0, {perf!r})
import tritonclient.grpc as grpcclient
from soak import stream_inputs
c = grpcclient.InferenceServerClient({url!r})
q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put((result, error)))
c.async_stream_infer("tokenrouter", stream_inputs("def f(x):", 3000), request_id="gone")
for _ in range(3):
    r, e = q.get(timeout=60)
    assert e is None, e
print("streaming", flush=True)
import os; os._exit(0)  # no cancel, no goodbye: the process is simply gone
"""


@pytest.mark.slow
def test_clients_that_disconnect_mid_stream_have_their_kv_freed(tiny_dir: Path, tmp_path: Path) -> None:
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        abort = 'tokenrouter_requests_finished_total{finish_reason="abort",model="tokenrouter"}'
        before = metrics(server).get(abort, 0)
        # gRPC: the client process exits mid-stream.
        code = _GRPC_CLIENT.format(perf=str(REPO / "perf"), url=server.grpc_url)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "streaming" in out.stdout, out.stderr[-2000:]
        # HTTP: the client closes its connection after the first events.
        body = json.dumps(_body("def g(y):", LONG)).encode()
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            s.sendall(
                b"POST /v2/models/tokenrouter/generate_stream HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            # (the response's headers may arrive before its first event, in a read of their own)
            seen = b""
            while b"data:" not in seen and (chunk := s.recv(4096)):
                seen += chunk
            assert b"data:" in seen, seen
        # Both are cancelled (not run to their 3,000 tokens): the router counts them as aborted, and every
        # model frees what they held.
        assert wait_metric(server, abort, before + 2, 60) == before + 2
        held = wait_idle(server.metrics_url, timeout=30)
        assert not any(held.values()), held


@pytest.mark.slow
def test_stubs_exit_when_tritonserver_dies(tiny_dir: Path, tmp_path: Path) -> None:
    """tritonserver crashing (here SIGSEGV, as a 100,000-deep JSON body does to Triton 2.51's HTTP parser)
    must not leave model processes behind holding memory and sockets."""
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        repo = tmp_path / "model_repository"
        assert len(stubs_of(repo)) == 3
        server.proc.send_signal(signal.SIGSEGV)
        server.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while stubs_of(repo) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stubs_of(repo) == []
