"""Finding a Triton server and laying out its backend directory. Nothing is installed here.

Where the server comes from, first match wins:
1. `$TRITONSERVER_ROOT`: a folder holding `bin/tritonserver` and `backends/python/` (the NGC image's
   `/opt/tritonserver`, or the `pytriton/tritonserver` folder of an unpacked nvidia-pytriton wheel);
2. the nvidia-pytriton 0.7.0 wheel (Triton 2.51) installed in this interpreter's site-packages, which
   `scripts/setup.sh` (or `pip install -e '.[serve]'`) puts there;
3. `/opt/tritonserver` (the Triton NGC image).
Our backend is a Python-based backend: Triton finds it as `<backend dir>/tokenrouter/model.py`, which we
link to this package, beside the Python backend.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
TRITONCLIENT = "tritonclient[all]==2.51.0"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # backends/tokenrouter: holds model.py
NGC_ROOT = Path("/opt/tritonserver")
INSTALL_HINT = (
    f"install one with `bash scripts/setup.sh` (or `pip install -e '.[serve]'`, which brings {PYTRITON}), "
    "or point TRITONSERVER_ROOT at a folder with bin/tritonserver and backends/python (e.g. /opt/tritonserver)"
)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def triton_root() -> Path:
    """The Triton server folder to use; FileNotFoundError naming how to get one."""
    env = os.environ.get("TRITONSERVER_ROOT")
    candidates = [Path(env)] if env else [site_packages() / "pytriton" / "tritonserver", NGC_ROOT]
    for root in candidates:
        if (root / "bin" / "tritonserver").is_file():
            return root
    where = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no Triton server found (looked in {where}); {INSTALL_HINT}")


def _stub_source(root: Path) -> Path | None:
    """The Python-backend stub built for this interpreter's Python version, where the server ships several."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    return stub if stub.is_file() else None


def prepare_backends(root: Path | None = None) -> Path:
    """The backend directory for `--backend-directory`: the Python backend with the stub for this
    interpreter, and our `tokenrouter` backend linked to this package. Returns its path."""
    root = root or triton_root()
    backends = root / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    source = _stub_source(root)
    if source is not None and (not stub.exists() or stub.stat().st_size != source.stat().st_size):
        # In place, so its RPATH still finds the wheel's bundled libraries.
        shutil.copy2(source, stub)
    if not stub.exists():
        raise FileNotFoundError(f"{stub} is missing: this Triton server has no Python backend stub")
    ours = backends / "tokenrouter"
    if ours.is_symlink() and ours.resolve() != PACKAGE_DIR:
        ours.unlink()
    if not ours.exists():
        ours.symlink_to(PACKAGE_DIR, target_is_directory=True)
    return backends


def execution_env() -> Path | None:
    """The Python environment the stubs should run: this interpreter's venv, if it is one. It is given to
    Triton as each model's EXECUTION_ENV_PATH (the Python backend sources its bin/activate), so the stubs
    import exactly the packages this interpreter sees. None outside a venv: the stub's own interpreter is
    then this system Python, which must have the package installed."""
    prefix = Path(sys.prefix)
    if sys.prefix != sys.base_prefix and (prefix / "bin" / "activate").is_file():
        return prefix
    return None


def server_env() -> dict[str, str]:
    """Environment for tritonserver: the stubs must find libpython (the Python backend links it)."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    # Keep torch's CPU threads in check: every model instance is its own process.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def perf_analyzer_path() -> Path:
    """tritonclient's bundled perf_analyzer."""
    exe = Path(sys.executable).parent / "perf_analyzer"
    if not exe.exists():
        raise FileNotFoundError(f"perf_analyzer not found at {exe}; install it with `pip install '{TRITONCLIENT}'`")
    return exe


def perf_analyzer_env(cache: Path) -> dict[str, str]:
    """perf_analyzer 2.51 looks for libb64.so.0d and libcudart.so.12: link the copies the server wheel
    bundles into a folder on its library path."""
    try:
        libs = triton_root().parents[1] / "nvidia_pytriton.libs"  # the wheel's layout, wherever it lies
    except FileNotFoundError:
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
