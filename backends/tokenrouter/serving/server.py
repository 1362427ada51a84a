"""`tokenrouter serve`: write the model repository, start CUDA MPS if models share a GPU, start tritonserver.

Also the `TritonServer` process wrapper the end-to-end tests and benchmarks use.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from tokenrouter.config import ConfigError, load_config
from tokenrouter.serving import mps, stub_env, triton_install
from tokenrouter.serving.repository import write_repository

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO_ROOT / "config" / "r2r" / "tiny-small_tiny-large.yaml"


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on the loopback (bound together so they differ, released before use)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ensure_models(config_path: Path) -> None:
    """Build what a config points at and this repository generates, if it is missing: the tiny local
    models and the benchmark tokenizer of dummy-weight deployments (nothing is fetched)."""
    from tokenrouter.tools.bench_tokenizer import ensure_bench_tokenizer
    from tokenrouter.tools.make_tiny import make_tiny

    ensure_bench_tokenizer(config_path)
    cfg_text = config_path.read_text()
    tiny = REPO_ROOT / "models" / "tiny"
    if "models/tiny/" in cfg_text and not (tiny / "MANIFEST.json").exists():
        make_tiny(tiny)


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class TritonServer:
    """A tritonserver process on a model repository; `with TritonServer(...) as s:` waits until ready."""

    def __init__(
        self,
        model_repository: Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log_file: Path | None = None,
        verbose: int = 0,
    ) -> None:
        self.repo = Path(model_repository)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = log_file
        self.verbose = verbose
        self.proc: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        backends = triton_install.prepare_backends()
        cmd = [
            str(triton_install.triton_root() / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.verbose}",
            "--exit-on-error=true",
        ]
        if not _gpu_available():
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false"]
        return cmd

    def start(self) -> None:
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (kept open for the child)
        # Its own process group, so stop() can reach the model stubs even if the server dies first.
        self.proc = subprocess.Popen(
            self.command(), env=triton_install.server_env(), stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the server answers ready (True), or `cancelled()` says to give up (False)."""
        where = f"; see {self.log_file}" if self.log_file else " (its log is above)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancelled():
                return False
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}{where}")
            if self.ready():
                return True
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{where}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Stubs that outlived the server (it crashed, or one ignored the shutdown) must not linger.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML (default: tiny r2r pair)")
    p.add_argument("--model-repository", default=str(REPO_ROOT / ".cache" / "model_repository"))
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--execution-env", help="Python environment (a venv folder) for the model stubs; default: "
                   "this interpreter's venv (see `tokenrouter stub-env`)")
    p.add_argument("--no-mps", action="store_true",
                   help="do not start CUDA MPS when models share a GPU (they then time-slice it)")


def _ports_in_use(ports: list[int]) -> list[int]:
    """Ports something already listens on: the server would fail on them, and our readiness probe would
    reach that other process and report ready."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(port)
    return busy


def serve_main(args: argparse.Namespace) -> int:
    config_path = Path(args.config).resolve()
    busy = _ports_in_use([args.http_port, args.grpc_port, args.metrics_port])
    if busy:
        print(f"error: port(s) {busy} already in use; pick others with --http-port/--grpc-port/--metrics-port",
              file=sys.stderr)
        return 2
    try:
        ensure_models(config_path)
        config = load_config(config_path)  # fail fast, with the config's own error message
        backends = triton_install.prepare_backends()
    except (ConfigError, FileNotFoundError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = Path(args.execution_env).resolve() if args.execution_env else triton_install.execution_env()
    if env is not None and not (env / "bin" / "activate").is_file():
        print(f"error: --execution-env {env} is not a Python environment (no bin/activate)", file=sys.stderr)
        return 2
    problem = stub_env.check(backends / "python" / "triton_python_backend_stub", env)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    repo = write_repository(config_path, args.model_repository, execution_env=env)
    started_mps = False
    shared = mps.shared_gpus(config)
    if shared and not args.no_mps and not mps.running():
        try:
            mps.start()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        started_mps = True
        print(f"started CUDA MPS: models share GPU(s) {shared}", flush=True)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, verbose=args.log_verbose)
    print(f"starting tritonserver on {repo} (HTTP :{args.http_port}, gRPC :{args.grpc_port}, "
          f"metrics :{args.metrics_port})", flush=True)
    server.start()
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if server.wait_ready(cancelled=lambda: stop):
            print(f"ready: try `python clients/grpc_stream.py --url localhost:{args.grpc_port} "
                  "--prompt 'def main():'`", flush=True)
        while not stop and server.proc.poll() is None:
            time.sleep(0.5)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
    finally:
        server.stop()
        if started_mps and not mps.stop():
            print("warning: the CUDA MPS daemon did not quit within 30 s; stop it with "
                  "`echo quit | nvidia-cuda-mps-control`", file=sys.stderr)
    return 0 if stop else (server.proc.returncode or 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tokenrouter-serve")
    add_arguments(parser)
    sys.exit(serve_main(parser.parse_args()))

