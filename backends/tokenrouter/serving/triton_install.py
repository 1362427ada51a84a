"""Installing and laying out a real Triton server from PyPI, inside the project's venv.

The `nvidia-pytriton` wheel bundles the Triton 2.51 server binary, the Python backend and its stubs; we
use only those binaries. Our backend is a Python-based backend: Triton finds it as
`<backend dir>/tokenrouter/model.py`, which we link to this package, beside the Python backend itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
TRITONCLIENT = "tritonclient[all]==2.51.0"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # backends/tokenrouter: holds model.py


def ensure_installed() -> None:
    """pip-install the server wheel and the client if they are missing (idempotent)."""
    try:
        import pytriton  # noqa: F401
        import tritonclient.grpc  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", PYTRITON, TRITONCLIENT], check=True)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def triton_root() -> Path:
    root = site_packages() / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise FileNotFoundError(f"no tritonserver binary under {root}; run `tokenrouter serve` to install it")
    return root


def prepare_backends() -> Path:
    """The backend directory for `--backend-directory`: the Python backend with the stub for this
    interpreter, and our `tokenrouter` backend linked to this package. Returns its path."""
    root = triton_root()
    backends = root / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    if not stub.exists():
        # In place, so its RPATH still finds the wheel's bundled libraries.
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy2(root / "python_backend_stubs" / version / "triton_python_backend_stub", stub)
    ours = backends / "tokenrouter"
    if ours.is_symlink() and ours.resolve() != PACKAGE_DIR:
        ours.unlink()
    if not ours.exists():
        ours.symlink_to(PACKAGE_DIR, target_is_directory=True)
    return backends


def server_env() -> dict[str, str]:
    """Environment for tritonserver: the stub must run this venv's Python and find libpython."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    # Keep torch's CPU threads in check: every model instance is its own process.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def perf_analyzer_path() -> Path:
    """tritonclient's bundled perf_analyzer, with the two libraries it looks for made findable."""
    exe = Path(sys.executable).parent / "perf_analyzer"
    if not exe.exists():
        raise FileNotFoundError(f"perf_analyzer not found at {exe} (installed by {TRITONCLIENT})")
    return exe


def perf_analyzer_env(cache: Path) -> dict[str, str]:
    libs = site_packages() / "nvidia_pytriton.libs"
    links = cache / "perf-analyzer-libs"
    links.mkdir(parents=True, exist_ok=True)
    for prefix, name in (("libb64", "libb64.so.0d"), ("libcudart", "libcudart.so.12")):
        target = next(libs.glob(f"{prefix}-*"), None)
        link = links / name
        if target is not None and not link.exists():
            link.symlink_to(target)
    env = server_env()
    env["LD_LIBRARY_PATH"] = os.pathsep.join((str(links), env["LD_LIBRARY_PATH"]))
    return env
