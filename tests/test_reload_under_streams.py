"""A model reloaded through this server's model control while HTTP streams are in flight: every stream still gets
all its responses, its final one included. Triton 2.51 runs an HTTP load or unload on the HTTP worker thread that
took the request, for as long as it lasts; the streams that thread serves have their responses queued on a
non-blocking command socket, and once that is full Triton drops the rest without a word (sendto: EAGAIN). Routing
around a killed model (test_faults.py) lost the final responses of the streams the small model finished meanwhile:
they never ended."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tokenrouter.serving.model_control import reload_model
from tokenrouter.serving.server import ADMIN_KEY_ENV, CONTROL_GRPC_ENV, CONTROL_URL_ENV
from triton_harness import generate_stream, running_server, stubs_of, tiny_deployment, wait_metric

N = 1500


def _config(tmp: Path, tiny_dir: Path) -> Path:
    # The large model idles: its reload touches no request.
    return tiny_deployment(tmp / "reload.yaml", tiny_dir, policy={"name": "always", "model": "small"})


@pytest.mark.slow
def test_a_reload_loses_no_response_of_the_streams_in_flight(tiny_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    with running_server(_config(tmp_path, tiny_dir), tmp_path) as server:
        # What the router's reviver is given (TritonServer.start): this test reloads as it would.
        monkeypatch.setenv(CONTROL_URL_ENV, f"http://127.0.0.1:{server.http_port}")
        monkeypatch.setenv(CONTROL_GRPC_ENV, server.grpc_url)
        monkeypatch.setenv(ADMIN_KEY_ENV, server.admin_key)
        body = {"sampling_parameters": json.dumps({"max_tokens": N, "ignore_eos": True, "temperature": 0}),
                "stream": True, "return_num_output_tokens": True}
        results: dict[int, tuple[int, list[dict]]] = {}
        streams = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, generate_stream(server, {**body, "text_input": f"def f{i}(x):"}, timeout=30))) for i in range(6)]
        for t in streams:
            t.start()
        (before,) = stubs_of(tmp_path / "model_repository", "large")
        time.sleep(0.3)  # streaming
        begun = time.monotonic()
        reload_model("large", pb_utils=None)
        reloaded = time.monotonic() - begun
        for t in streams:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in streams)
        assert sorted(results) == list(range(6)), f"streams that never ended (reload took {reloaded:.1f} s)"
        for status, events in results.values():
            assert status == 200 and not any("error" in e for e in events), events[-3:]
            assert events[-1].get("num_output_tokens") == N, (len(events), events[-2:], f"reload took {reloaded:.1f} s")
        assert stubs_of(tmp_path / "model_repository", "large") not in ([before], [])  # it was reloaded
        assert wait_metric(server, 'tokenrouter_model_up{model="large"}', 1.0, 60) == 1.0
