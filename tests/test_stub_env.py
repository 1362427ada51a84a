"""The stubs' Python environment and numpy 2 (clients with numpy 2 are tested here too).

Triton 2.51's Python backend reads numpy dtypes with the numpy-1 layout (its pybind11 predates numpy 2):
with numpy 2 in a stub, a string input reaches the model as its first byte repeated and the stub aborts.
So with numpy 2 in the stubs' environment `tokenrouter serve` refuses to start and names the fix, and
`tokenrouter stub-env` makes the fix: a venv with numpy<2 layered over the current environment, which
serves the deployment end to end (the path a numpy-2 image such as the GPU machine's takes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenrouter.serving import stub_env, triton_install
from tokenrouter.serving.server import free_ports
from triton_harness import generate_stream, running_server

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config" / "random" / "tiny-small_tiny-large.yaml"


def _stub() -> Path:
    return triton_install.prepare_backends() / "python" / "triton_python_backend_stub"


def test_this_triton_stub_predates_numpy2() -> None:
    # The premise of the check below: if a newer Triton is installed, the refusal is not needed.
    assert not stub_env.stub_knows_numpy2(_stub())


@pytest.fixture(scope="module")
def np2_env(tmp_path_factory) -> Path:
    """This environment with numpy 2 in front (what most current images ship)."""
    env = stub_env.make(tmp_path_factory.mktemp("np2") / "env", numpy_spec="numpy>=2,<3")
    assert stub_env.numpy_major(env) == 2
    return env


@pytest.mark.slow
def test_serve_refuses_numpy2_stubs_and_names_the_fix(tmp_path: Path, np2_env: Path) -> None:
    ports = [str(p) for p in free_ports(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(CONFIG), "--execution-env", str(np2_env),
         "--model-repository", str(tmp_path / "repo"), "--http-port", ports[0], "--grpc-port", ports[1],
         "--metrics-port", ports[2]],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "numpy 2.x" in proc.stderr and "tokenrouter stub-env" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_numpy2_clients_soak_the_served_deployment(tmp_path: Path, np2_env: Path, tiny_dir: Path) -> None:
    """Only the stubs need numpy<2: gRPC clients running numpy 2 stream, cancel and finish cleanly."""
    with running_server(CONFIG, tmp_path) as server:
        proc = subprocess.run(
            [str(np2_env / "bin" / "python"), str(REPO / "perf" / "soak.py"), "--url", server.grpc_url,
             "--metrics-url", server.metrics_url, "--requests", "60", "--concurrency", "4", "--max-tokens", "16"],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "60 requests at concurrency 4" in proc.stdout and "PROBLEM" not in proc.stdout


@pytest.mark.slow
def test_stub_env_with_numpy1_serves(tmp_path: Path, tiny_dir: Path) -> None:
    env = stub_env.make(tmp_path / "stub-env")
    assert stub_env.numpy_major(env) == 1
    assert stub_env.check(_stub(), env) is None
    with running_server(CONFIG, tmp_path, execution_env=env) as server:
        body = {"text_input": "def main():", "stream": True, "exclude_input_in_output": True,
                "return_finish_reason": True,
                "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0, "ignore_eos": True})}
        status, events = generate_stream(server, body)
        assert status == 200, events
        assert events[-1]["finish_reason"] == "length"
        # Every model's stub runs inside that environment (its bin/activate set VIRTUAL_ENV).
        venvs = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                if b"triton_python_backend_stub" in cmdline and str(tmp_path).encode() in cmdline:
                    environ = dict(
                        kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv
                    )
                    venvs.append(environ.get("VIRTUAL_ENV"))
            except (OSError, ValueError):
                continue
        assert venvs == [str(env)] * 3, venvs
