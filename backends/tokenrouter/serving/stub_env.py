"""The Python environment the Triton Python-backend stubs run, and the numpy it must have.

Triton 2.51's Python backend (python_backend r24.10) is built with a pybind11 that predates numpy 2: it
reads numpy's dtype descriptors with the numpy-1 layout. With numpy 2 in the stubs' interpreter, every
array the stub builds from Triton memory gets a zero item size, so a string (TYPE_STRING) input such as
`text_input` arrives as its first byte repeated, and string outputs come out corrupt. Newer stubs (whose
pybind11 knows `numpy._core`) do not have that problem. So when the server's stub is the old kind and
the stubs' environment has numpy 2, `tokenrouter serve` refuses to start and names the fix:
`tokenrouter stub-env`, which makes a small venv that layers numpy<2 over the current environment
(everything else is shared), given to the stubs as their EXECUTION_ENV_PATH.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

NUMPY_FOR_OLD_STUBS = "numpy>=1.23,<2"
# Packages that libraries we import probe for optionally (transformers imports scikit-learn when it is
# installed). An image built for numpy 2 can have ones that fail to import beside numpy<2.
OPTIONAL_PROBED = ("sklearn", "scipy", "pandas", "numba", "cupy", "jax", "tensorflow", "torchvision", "torchaudio")
_PROBE = """
import importlib, importlib.util, sys
broken = []
for name in sys.argv[1:]:
    if importlib.util.find_spec(name) is None:
        continue
    try:
        importlib.import_module(name)
        if name == "sklearn":
            importlib.import_module("sklearn.metrics")  # what transformers takes from it
    except Exception:
        broken.append(name)
print(" ".join(broken))
"""


def stub_knows_numpy2(stub: Path) -> bool:
    """Whether the stub's pybind11 handles numpy 2 (it then imports `numpy._core`, which numpy 2 has)."""
    return b"numpy._core" in stub.read_bytes()


def numpy_major(env: Path | None) -> int | None:
    """numpy's major version in the environment the stubs run (None: numpy is missing there)."""
    python = (env / "bin" / "python") if env is not None else Path(sys.executable)
    proc = subprocess.run([str(python), "-c", "import numpy; print(numpy.__version__)"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return int(proc.stdout.strip().split(".")[0])


def check(stub: Path, env: Path | None) -> str | None:
    """A message explaining why these stubs cannot serve in this environment, or None when they can."""
    if stub_knows_numpy2(stub):
        return None
    major = numpy_major(env)
    if major is None or major < 2:
        return None
    where = env or Path(sys.prefix)
    return (
        f"the stubs' Python environment ({where}) has numpy {major}.x, but this Triton server's Python backend "
        "(2.51) was built before numpy 2 and corrupts string tensors with it; make an environment with "
        "numpy<2 for the stubs and serve with it:\n"
        "  tokenrouter stub-env --out .cache/stub-env [--find-links DIR_WITH_A_NUMPY_1_WHEEL]\n"
        "  tokenrouter serve --execution-env .cache/stub-env ..."
    )


def make(out: Path, find_links: str | None = None, numpy_spec: str = NUMPY_FOR_OLD_STUBS) -> Path:
    """A venv at `out` with its own numpy (numpy<2 unless told otherwise) and, behind it, every package of
    this interpreter's environment (a .pth adds this environment's site-packages after the venv's own)."""
    out = out.resolve()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(out)], check=True)
    site = Path(subprocess.run(
        [str(out / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), numpy_spec]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    subprocess.run(cmd, check=True)
    # addsitedir (not a bare path) so this environment's own .pth files (editable installs) apply too.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    lines = [f"import site; site.addsitedir({p!r})" for p in sorted(ours)]
    (site / "zz-shared-environment.pth").write_text("\n".join(lines) + "\n")
    python = str(out / "bin" / "python")
    broken = subprocess.run([python, "-c", _PROBE, *OPTIONAL_PROBED], capture_output=True, text=True,
                            check=True).stdout.split()
    if broken:
        # None in sys.modules is Python's own "not installed" marker: importlib.util.find_spec returns None,
        # so optional probes skip these instead of failing on them.
        (site / "zz-hidden-packages.pth").write_text(f"import sys; sys.modules.update(dict.fromkeys({broken!r}))\n")
    check = subprocess.run([python, "-c", "import torch, transformers; from transformers import AutoTokenizer, "
                            "GenerationMixin; import tokenrouter.serving.tensors"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"the stub environment at {out} cannot import the package:\n{check.stderr[-2000:]}")
    return out
