"""Triton's interpreter for the kernel tests, even when triton was already imported compiled.

Import this before triton in a kernel test module. TRITON_INTERPRET=1 (the default here) must be in effect when
triton is imported: triton decorates its own standard library (tl.max, tl.sum, ...) at import, as compiled or
interpreted functions. conftest.py sets it early on machines without a GPU, but when triton was imported compiled
anyway (transformers pulls it in through torch._dynamo), its tl.* functions cannot be called by the interpreter.
`ensure_interpreted` then drops triton's pure-Python modules so the next import re-decorates them (the native
extension triton._C stays: it cannot be initialised twice), and drops our kernel modules whose kernels were
decorated compiled, so they are imported again with interpreted kernels.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
KERNEL_MODULES = (
    # pdl's jit helper is called from the others' kernels: a compiled one cannot be called by interpreted kernels
    "tokenrouter.runner.pdl", "tokenrouter.runner.fused_ops", "tokenrouter.runner.triton_attention",
    "tokenrouter.runner.skinny_gemm", "tokenrouter.runner.top_k",
)


def _drop_module(name: str) -> None:
    """Forget a submodule so the next import runs it again. The parent package's attribute must go too:
    `from tokenrouter.runner import fused_ops` would otherwise hand back the stale module."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)


def _has_compiled_kernels(module: object) -> bool:
    return any(type(v).__name__ == "JITFunction" for v in vars(module).values())


def ensure_interpreted() -> None:
    if not INTERPRET:
        return
    std = sys.modules.get("triton.language.standard")
    if std is not None and type(std.max).__name__ != "InterpretedFunction":
        for name in [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]:
            sys.modules.pop(name, None)
        for name in KERNEL_MODULES:
            _drop_module(name)
    for name in KERNEL_MODULES:
        if name in sys.modules and _has_compiled_kernels(sys.modules[name]):
            _drop_module(name)


ensure_interpreted()


def compile_for_hopper(script: str) -> None:
    """Run `script` (which compiles kernels with triton.compile for sm_90 and prints "compiled") in a fresh Python
    without the interpreter: the interpreter runs kernels as Python and misses what only the compiler rejects, and
    Triton's own ptxas compiles without a GPU. Skips where this triton has no CUDA backend."""
    import subprocess
    from pathlib import Path

    import pytest
    import triton

    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip(f"triton {triton.__version__} has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "backends"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
