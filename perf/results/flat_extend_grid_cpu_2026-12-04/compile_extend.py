"""Compile a tree's `_extend_kernel` for sm_90 without a GPU and print ptxas's registers and spills per variant.

    PYTHONPATH=<triton 3.6 site-packages>:backends python compile_extend.py PATH/TO/triton_attention.py

The short-extend tile of the graphs (64 x 64, 4 warps, 2 stages, head_dim 128) for Qwen3-32B (8 query heads per KV
head) and Qwen3-0.6B (2), split and unsplit, with and without decode rows beside it. Triton's own ptxas (the one its
wheel bundles, CUDA 12.8 for Triton 3.6) assembles the PTX.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TYPES = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
         "kv_lens_ptr": "*i32", "sm_scale_log2": "fp32"}


def load(path: str):
    spec = importlib.util.spec_from_file_location("triton_attention_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ta = load(sys.argv[1])
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    kernel = ta._extend_kernel
    for split in (True, False):
        for skip_decode in (True, False):
            for group, q_per_prog in ((8, 8), (2, 32)):
                consts = dict(HEAD_DIM=128, D_PAD=128, GROUP=group, PAGE=16, BLOCK_M=64, BLOCK_N=64,
                              Q_PER_PROG=q_per_prog, SKIP_DECODE=skip_decode, SPLIT=split, PDL=True)
                sig = {n: TYPES.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
                sig.update({c: "constexpr" for c in consts})
                ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                     target=GPUTarget("cuda", 90, 32),
                                     options={"num_warps": 4, "num_stages": 2, "launch_pdl": True}).asm["ptx"]
                with tempfile.TemporaryDirectory() as tmp:
                    src = Path(tmp) / "k.ptx"
                    src.write_text(ptx)
                    info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                                          capture_output=True, text=True, check=True).stderr
                regs = re.search(r"Used (\d+) registers", info).group(1)
                stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
                print(f"split={int(split)} skip_decode={int(skip_decode)} group={group}: {regs} registers, "
                      f"{stores} B spill stores, {loads} B spill loads")


if __name__ == "__main__":
    main()
