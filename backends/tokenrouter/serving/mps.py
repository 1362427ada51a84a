"""CUDA MPS for models that share a GPU.

Every model of a deployment is its own process (its own Triton Python-backend stub). Without MPS, the
processes on one GPU time-slice it: one context runs at a time, so the small model's short steps queue
behind the large model's long ones and the two never overlap. With the MPS control daemon running, their
kernels share the GPU concurrently (TokenRouter's own deployment shares two A100s this way).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tokenrouter.config import EngineConfig

DAEMON = "nvidia-cuda-mps-control"
_EXTRA_PATHS = ("/usr/local/nvidia/bin", "/usr/bin")


def shared_gpus(config: EngineConfig) -> dict[int, list[str]]:
    """GPU index -> the models placed on it, for GPUs that hold two or more models."""
    by_gpu: dict[int, list[str]] = {}
    for name, m in config.models.items():
        if m.gpu is not None:
            by_gpu.setdefault(m.gpu, []).append(name)
    return {g: names for g, names in by_gpu.items() if len(names) > 1}


def daemon_path() -> str | None:
    found = shutil.which(DAEMON)
    if found:
        return found
    for folder in _EXTRA_PATHS:
        candidate = Path(folder) / DAEMON
        if candidate.is_file():
            return str(candidate)
    return None


def _live_daemon_processes(uid: int | None = None) -> set[int]:
    """Pids of the MPS processes (control daemon, servers) that have not exited, of user `uid` only where given
    (a daemon another user runs, e.g. the machine's own, still counts as running). One that has exited stays
    listed as a zombie until its parent reaps it, and the daemon's parent is init: where init does not reap (a
    container's first process often does not), every daemon that ever quit stays a zombie. Counting those, serve
    took a daemon that had quit for a running one (2026-12-05, on the GPU machine)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]  # the field after "(comm)"
            owner = proc.stat().st_uid
        except (OSError, IndexError):
            continue
        if (uid is None or owner == uid) and comm.startswith("nvidia-cuda-mps") and state not in ("Z", "X"):
            pids.add(int(proc.name))
    return pids


def running() -> bool:
    """An MPS control daemon of this machine is up (a live process of it exists and its control pipe is there)."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    return pipe.exists() and bool(_live_daemon_processes())


def start() -> None:
    """Start the control daemon; RuntimeError naming the command when that is not possible."""
    exe = daemon_path()
    if exe is None:
        raise RuntimeError(
            f"models share a GPU, which needs CUDA MPS, but {DAEMON} is not installed; start MPS yourself "
            f"(`{DAEMON} -d`) or pass --no-mps to let the models time-slice the GPU"
        )
    proc = subprocess.run([exe, "-d"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{exe} -d` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")


def stop(timeout: float = 30.0) -> bool:
    """Ask the daemon to quit; True once it is gone. It waits for its clients to detach first, so a daemon
    that outlives `timeout` is reported (False), not waited on forever."""
    exe = daemon_path()
    if exe is None:
        return True
    deadline = time.monotonic() + timeout
    before = _live_daemon_processes(os.getuid())  # ours: a daemon started later, or another user's, is not waited for
    try:
        subprocess.run([exe], input="quit\n", capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    while before & _live_daemon_processes():  # the control client returns as the daemon begins to exit
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
