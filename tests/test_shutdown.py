"""Stopping a served deployment while clients are connected (TritonServer.stop, as `tokenrouter serve` does
on SIGINT/SIGTERM).

Signalled, Triton 2.51 first waits, up to its 30 s exit timeout, for every open HTTP connection to close: one
idle keep-alive client made it give up on unloading the models ("Exit timeout expired. Exiting immediately"),
its model processes killed with their shared memory left in /dev/shm, at times with a segfault. The server
now unloads the models through model control first, and the router does not take that for a dead model to
reload; the router, which a client's open gRPC stream keeps loaded, holds no request by then, and what is
left of the server is killed with its shared memory removed."""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenrouter.serving.server import TritonServer, _stub_regions
from triton_harness import running_server, tiny_deployment

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from soak import stream_inputs  # noqa: E402


def _config(tmp: Path, tiny_dir: Path) -> Path:
    return tiny_deployment(tmp / "deployment.yaml", tiny_dir, kv_cache_tokens=4096,
                           policy={"name": "random", "p": 0.3, "seed": 0})


def test_stop_with_a_keep_alive_client_and_a_stream_in_flight_unloads_every_model(tiny_dir: Path,
                                                                                  tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        keep_alive = socket.create_connection((server.host, server.http_port))
        keep_alive.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert keep_alive.recv(64).startswith(b"HTTP/1.1 200")
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("tokenrouter", stream_inputs("def main():", 3000), request_id="long",
                                  enable_empty_final_response=True)
        first, error = responses.get(timeout=60)  # under way
        assert error is None, error
        assert first.get_response().parameters["triton_final_response"].bool_param is False
        regions = _stub_regions(server.proc.pid)
        assert len(regions) == 3, regions
        errors: list[str] = []

        def client_closes_on_its_error() -> None:  # what a client whose request failed does with its stream
            while not errors:
                result, error = responses.get(timeout=60)
                if error is not None:
                    errors.append(str(error))
            client.stop_stream()

        closer = threading.Thread(target=client_closes_on_its_error)
        closer.start()
        server.stop()
        closer.join()
        assert not [r for r in regions if Path(f"/dev/shm/{r}").exists()]
        log = server.log_file.read_text(errors="replace")
        assert "went away during the request" in errors[0], errors
        client.close()
        keep_alive.close()
    assert "Exit timeout expired" not in log and "Signal (11)" not in log, log[-3000:]
    for model in ("small", "large", "tokenrouter"):
        assert f"successfully unloaded '{model}'" in log, log[-3000:]
    assert "reloading it" not in log, log[-3000:]


def test_a_model_unloaded_by_an_admin_stays_unloaded_until_loaded_again(tiny_dir: Path, tmp_path: Path) -> None:
    """The router reloads a model whose process died, but not one Triton unloaded on request: requests are
    refused with a message that says so, and serving resumes once the admin loads it again."""
    import time

    from tokenrouter.serving.server import control_request, model_states
    from triton_harness import generate_stream

    body = {"text_input": "def main():", "stream": True,
            "sampling_parameters": '{"max_tokens": 8, "temperature": 0, "ignore_eos": true}'}
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        url = f"http://{server.host}:{server.http_port}"
        control_request(url, "/v2/repository/models/large/unload", server.admin_key)
        deadline = time.monotonic() + 60
        while True:
            status, events = generate_stream(server, body)
            refused = status >= 400 or any("error" in e for e in events)
            if refused and "unloaded 'large' on request" in str(events):
                break
            assert time.monotonic() < deadline, (status, events)
            time.sleep(0.5)
        time.sleep(3)  # the router keeps checking; it must not reload it meanwhile
        assert model_states(url, server.admin_key)["large"] == ("UNAVAILABLE", "unloaded")
        control_request(url, "/v2/repository/models/large/load", server.admin_key)
        deadline = time.monotonic() + 90
        while True:
            status, events = generate_stream(server, body)
            if status == 200 and not any("error" in e for e in events):
                break
            assert time.monotonic() < deadline, (status, events)
            time.sleep(0.5)
        # Loaded by the admin, it is only reconnected: not reloaded by the router on top.
        assert "reloading it" not in server.log_file.read_text(errors="replace")


def test_the_drain_keeps_to_its_deadline_against_a_stalled_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each model-control call of the drain gets only what is left of the drain's time: a server that accepts
    connections and never answers held it 5 s a call before, past its bound."""
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):  # urllib would send 127.0.0.1 through one
        monkeypatch.delenv(var, raising=False)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(16)  # connections are accepted by the kernel and never answered
    try:
        server = TritonServer(tmp_path, http_port=stalled.getsockname()[1])
        t0 = time.monotonic()
        assert server.drain(timeout=1.0) is False
        assert time.monotonic() - t0 < 3.0
    finally:
        stalled.close()
