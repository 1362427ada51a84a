"""runner/top_k.py (R2R's router's top-k logits) against torch.topk, via Triton's interpreter.

TRITON_INTERPRET=1 is in effect when triton is imported (`triton_interpreter`), so CI runs the kernels on the CPU; on
a GPU machine `TRITON_INTERPRET=0 pytest tests/test_top_k.py` runs the same checks compiled, on CUDA tensors. The
values must equal torch.topk's exactly (a selection, no arithmetic): ties, -inf, chunk boundaries and a last partial
chunk included.
"""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET  # first: before anything here imports triton
# isort: on

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the top-k kernels cannot be tested")

from tokenrouter.runner import top_k  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
if not top_k.supported(100):
    pytest.skip("this Triton has no tl.topk", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x, k, dim=-1, sorted=True).values


@pytest.mark.parametrize("rows, n, k, chunk", [
    # A Qwen3 step's logits, R2R's default k: compiled only (the interpreter sorts its 19 chunks in ~2 minutes).
    pytest.param(1, 151_936, 100, None, marks=pytest.mark.skipif(INTERPRET, reason="compiled only: ~2 min here")),
    (1, 9_000, 100, None),  # the default chunk, a partial second one
    (3, 2_000, 100, 256),  # many chunks, the last one partial
    (3, 700, 7, 128),  # k not a power of two, far below the chunk's K_PAD
    (2, 1_000, 256, 256),  # k = MAX_K: one chunk's every column is a candidate
    (4, 100, 100, 128),  # k = n: every column, one partial chunk
    (2, 5_000, 1, 512),  # k = 1: the row's maximum
])
def test_equals_torch_topk(rows: int, n: int, k: int, chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(top_k, "CHUNK", chunk)
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, n, generator=g) * 5
    # Ties (values repeated across chunks) and -inf entries, which masked columns must not outrank.
    x[:, ::7] = x[:, :1]
    x[0, 1::11] = float("-inf")
    x = x.to(DEVICE)
    got = top_k.top_k_values(x, k)
    assert got.shape == (rows, k) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), _reference(x, k).cpu())


def test_rows_are_independent_and_strided(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's result does not depend on the rows beside it, and a row stride wider than the row is honoured."""
    monkeypatch.setattr(top_k, "CHUNK", 256)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 1_200, generator=g).to(DEVICE)
    x = wide[:, :1_000]  # row stride 1,200
    got = top_k.top_k_values(x, 50)
    assert torch.equal(got.cpu(), _reference(x, 50).cpu())
    assert torch.equal(top_k.top_k_values(x[1:2].contiguous(), 50).cpu(), got[1:2].cpu())


def test_fewer_finite_values_than_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a row has fewer than k finite values, the rest of its top k is -inf, as torch's."""
    monkeypatch.setattr(top_k, "CHUNK", 128)
    x = torch.full((2, 300), float("-inf"))
    x[0, [3, 150, 299]] = torch.tensor([1.0, 2.0, 3.0])
    x = x.to(DEVICE)
    assert torch.equal(top_k.top_k_values(x, 8).cpu(), _reference(x, 8).cpu())


def test_no_rows() -> None:
    assert top_k.top_k_values(torch.zeros(0, 500, device=DEVICE), 10).shape == (0, 10)


@pytest.mark.parametrize("x, k, match", [
    (torch.zeros(2, 500, dtype=torch.float16), 10, "float32"),
    (torch.zeros(500), 10, "2-D"),
    (torch.zeros(2, 500), 0, "k must be"),
    (torch.zeros(2, 50), 51, "k must be"),
    (torch.zeros(2, 5_000), top_k.MAX_K + 1, "k must be"),
])
def test_rejects(x: torch.Tensor, k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        top_k.top_k_values(x.to(DEVICE), k)


def test_supported_bounds() -> None:
    assert top_k.supported(1) and top_k.supported(top_k.MAX_K)
    assert not top_k.supported(0) and not top_k.supported(top_k.MAX_K + 1)
