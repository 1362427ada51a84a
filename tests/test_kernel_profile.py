"""The kernel-time grouping the runner reports use (perf/kernel_profile.py): which group a kernel's name lands in
(our skinny matmuls apart from cuBLAS's, our other Triton kernels, the rest), and the per-call totals."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

from kernel_profile import KernelProfile, kind  # noqa: E402


def test_kernel_groups() -> None:
    assert kind("_skinny_gemm_kernel") == "matmul (ours)"
    assert kind("nvjet_sm90_tst_512x8_64x3_4x1_v_bz_TNT") == "matmul"
    assert kind("void cublasLt::splitKreduce_kernel<32, 16>") == "matmul"
    assert kind("void gemmSN_TN_kernel<float, 128>") == "matmul"
    assert kind("_decode_split_kernel") == "triton (ours)"
    assert kind("Memset (Unknown)") == "other"
    prof = KernelProfile({"_skinny_gemm_kernel": (700.0, 112.0), "nvjet_x": (80.0, 1.0),
                          "_decode_split_kernel": (390.0, 28.0), "Memset (Unknown)": (1.5, 2.0)})
    assert prof.total_us == 1171.5 and prof.kernels == 143.0
    assert list(prof.groups().items()) == [("matmul (ours)", 700.0), ("triton (ours)", 390.0), ("matmul", 80.0),
                                           ("other", 1.5)]
    assert [name for name, _, _ in prof.top(2)] == ["_skinny_gemm_kernel", "_decode_split_kernel"]
