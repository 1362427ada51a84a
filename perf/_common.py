"""Small helpers shared by the perf scripts: where results go, what machine produced them, free ports.

Every results file records the command, the date and the machine, because a throughput figure without
those is not reproducible (and CPU figures from the tiny models are plumbing checks, not performance).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent
RESULTS_DIR = PERF_DIR / "results"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def command_line() -> str:
    """The command as typed, relative to the repository root when possible (so it can be re-run)."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(REPO_ROOT))
    except ValueError:
        pass
    return "python " + " ".join(shlex.quote(a) for a in argv)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict[str, Any]:
    """CPU, core count, memory, GPUs and library versions: enough to tell two runs' machines apart."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
        else:
            info["gpus"] = []
    except ImportError:
        pass
    return info


def machine_line(info: dict[str, Any]) -> str:
    gpus = info.get("gpus") or []
    gpu = ", ".join(gpus) if gpus else "no GPU"
    mem = f", {info['memory_gib']} GiB RAM" if "memory_gib" in info else ""
    return f"{info['cpu']} ({info['cpu_cores']} cores{mem}), {gpu}, {info['os']}, torch {info.get('torch', '?')}"


def parse_concurrency(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """`--concurrency "1,4,8"` as integers >= 1, or a usage error naming the flag."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error("--concurrency needs at least one value, each >= 1")
    return values


def results_path(value: str | os.PathLike, suffix: str) -> Path:
    """`value` as given, or under perf/results/ when it is a bare name; with `suffix` if it has none."""
    p = Path(value)
    if p.parent == Path("."):
        p = RESULTS_DIR / p
    if not p.suffix:
        p = p.with_suffix(suffix)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


@contextmanager
def running_server(repo: Path, log: Path, what: str) -> Iterator[Any]:
    """tritonserver on the model repository `repo` (free ports), ready, then stopped; when it fails to start,
    the end of its log is printed (the log often lives in a temporary folder that is about to go)."""
    from tokenrouter.serving.server import TritonServer, free_ports

    http, grpc, metrics = free_ports(3)
    print(f"starting tritonserver for {what} (gRPC :{grpc}); log: {log}", flush=True)
    server = TritonServer(repo, http, grpc, metrics, log_file=log)
    server.start()
    try:
        try:
            server.wait_ready(timeout=600)
        except (RuntimeError, TimeoutError):
            print(log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)", file=sys.stderr)
            raise
        yield server
    finally:
        server.stop()


@contextmanager
def serving(config: str, work: Path, execution_env: Path | None = None) -> Iterator[Any]:
    """Start tritonserver on a repository written for `config` (free ports), yield it, stop it. The
    server's `grpc_url` and `metrics_url` say where it answers. The stubs run `execution_env` (a venv, e.g.
    `tokenrouter stub-env`'s), by default this interpreter's venv."""
    from tokenrouter.serving import triton_install
    from tokenrouter.serving.repository import write_repository
    from tokenrouter.serving.server import ensure_models

    config_path = Path(config).resolve()
    ensure_models(config_path)
    env = execution_env or triton_install.execution_env()
    repo = write_repository(config_path, work / "model_repository", execution_env=env)
    with running_server(repo, work / "tritonserver.log", config) as server:
        yield server


def check_server(url: str, model: str) -> None:
    """Fail early, with a clear message, when nothing serves `model` at the gRPC address `url`."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(url)
        ready = client.is_server_ready() and client.is_model_ready(model)
        client.close()
    except InferenceServerException as e:
        raise SystemExit(
            f"error: no Triton server answers on gRPC {url} ({e}); start one with "
            "`tokenrouter serve --config CFG --grpc-port PORT ...` or pass --serve CFG"
        ) from None
    if not ready:
        raise SystemExit(f"error: the server at {url} is up but model {model!r} is not ready")
