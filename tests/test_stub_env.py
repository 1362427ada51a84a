"""The stubs' Python environment and numpy 2.

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
from triton_harness import generate_stream, running_server

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config" / "random" / "tiny-small_tiny-large.yaml"


def _stub() -> Path:
    return triton_install.prepare_backends() / "python" / "triton_python_backend_stub"


def test_this_triton_stub_predates_numpy2() -> None:
    # The premise of the check below: if a newer Triton is installed, the refusal is not needed.
    assert not stub_env.stub_knows_numpy2(_stub())


@pytest.mark.slow
def test_serve_refuses_numpy2_stubs_and_names_the_fix(tmp_path: Path) -> None:
    env = stub_env.make(tmp_path / "np2-env", numpy_spec="numpy>=2,<3")
    assert stub_env.numpy_major(env) == 2
    proc = subprocess.run(
        [sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(CONFIG), "--execution-env", str(env),
         "--model-repository", str(tmp_path / "repo")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "numpy 2.x" in proc.stderr and "tokenrouter stub-env" in proc.stderr
    assert "Traceback" not in proc.stderr


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
