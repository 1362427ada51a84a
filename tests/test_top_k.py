"""The radix-select top k (runner/top_k.py) against torch.topk, bit for bit, via Triton's interpreter
(TRITON_INTERPRET=0 on a GPU runs the same checks compiled)."""

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
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:  # many chunks a row at a size the interpreter runs quickly
        monkeypatch.setattr(top_k, "CHUNK", 256)


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """A bfloat16 model's logits as the runner hands them over: bfloat16 values widened to float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).bfloat16().float()


def _check(x: torch.Tensor, k: int, ws: top_k.TopKWorkspace) -> None:
    out = top_k.top_k_values(x.to(DEVICE), k, ws)
    ref = torch.topk(x.float(), k, dim=-1, sorted=True).values
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], k)
    assert torch.equal(out.cpu(), ref), (out.cpu() - ref).abs().max()
    # Every counter and histogram is zero again, ready for the next launch (a graph replays without a memset).
    assert int(ws.hist.count_nonzero()) == 0 and int(ws.state[:, :4].count_nonzero()) == 0


@pytest.mark.parametrize("rows,vocab,k", [(1, 1000, 100), (3, 1500, 128), (2, 777, 1), (4, 1200, 37), (1, 100, 100)])
def test_matches_torch(rows: int, vocab: int, k: int) -> None:
    ws = top_k.TopKWorkspace(8, DEVICE)
    for seed in range(2):  # the same workspace twice: nothing left over from the first launch
        _check(_logits(rows, vocab, seed), k, ws)


def test_ties_infinities_and_one_chunk_holding_the_top() -> None:
    """Many logits equal to the k-th (the fill), +-inf, a row whose top k all lie in its first chunk, a row of one
    value, a row of negatives only, signed zeros, and bfloat16 input as well as widened float32."""
    x = _logits(6, 1300, seed=7)
    x[0, :150] = x[0, :150].abs() + 40.0  # the whole top in chunk 0
    x[1, ::3] = 2.0  # hundreds of ties across the k-th
    x[2, 5], x[2, 900], x[2, 17] = float("inf"), float("inf"), float("-inf")
    x[2, 1000:] = float("-inf")
    x[3] = -1.0
    x[4] = -x[4].abs() - 1.0
    x[5, :] = torch.linspace(-8, 8, 1300)  # many distinct low bytes in one high-byte bucket
    x[3, :40:2], x[3, 1:40:2] = 0.0, -0.0
    x[3, 40] = 0.75
    x = x.bfloat16().float()
    ws = top_k.TopKWorkspace(8, DEVICE)
    _check(x, 100, ws)
    # Zeros keep their signs, +0.0 above -0.0 (a sort of float values had turned some -0.0 into +0.0).
    zeros = top_k.top_k_values(x[3:4].to(DEVICE), 100, ws).cpu()[0, 1:41]
    assert zeros.signbit().tolist() == [False] * 20 + [True] * 20
    out = top_k.top_k_values(x.bfloat16().to(DEVICE), 64, ws)
    assert torch.equal(out.cpu(), torch.topk(x, 64, dim=-1).values)


def test_nan_ranks_above_everything_as_in_torch() -> None:
    """Every NaN (either sign) is the largest, as torch.topk ranks it; the rest of the row stays exact."""
    x = _logits(3, 900, seed=11)
    x[0, 7] = float("nan")
    x[1, [3, 500, 899]] = float("nan")
    x[1, 4] = float("inf")
    x[2, 600] = -float("nan")
    ws = top_k.TopKWorkspace(4, DEVICE)
    out = top_k.top_k_values(x.to(DEVICE), 6, ws).cpu()
    ref = torch.topk(x, 6, dim=-1).values
    assert torch.equal(out.isnan(), ref.isnan()) and int(out.isnan().sum()) == 5
    assert torch.equal(out.nan_to_num(nan=123.0), ref.nan_to_num(nan=123.0))


def test_refuses_what_does_not_fit() -> None:
    ws = top_k.TopKWorkspace(2, DEVICE)
    x = _logits(3, 500, seed=0).to(DEVICE)
    for bad in ((x, 10), (x[:2], top_k.MAX_K + 1), (x[:2, :5], 6), (x[:2].half(), 10), (x[:2].double(), 10)):
        with pytest.raises(ValueError, match="top_k_values"):
            top_k.top_k_values(*bad, ws)


def test_r2r_policy_routes_the_same_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """R2R's policy takes its top k through the kernel (a GPU with a bfloat16 small model finds it on its own) and
    its router logits are bit-identical to torch.topk's; `router_kernel: torch` keeps torch's."""
    from torch import nn

    from tokenrouter.routing.policies.r2r import R2RPolicy
    from tokenrouter.routing.policy import StepResult

    args = {"hidden_dim": 32, "top_k_logits": 100}
    kernel, plain = R2RPolicy(["s", "l"], "s", args), R2RPolicy(["s", "l"], "s", args)
    cublas = R2RPolicy(["s", "l"], "s", {**args, "router_kernel": "torch"})
    for policy in (kernel, plain, cublas):
        policy.setup(DEVICE, torch.bfloat16, 48, 1000)
    assert cublas.top_k_workspace is None
    assert (kernel.top_k_workspace is None) == (DEVICE.type == "cpu")  # found on its own only on a GPU
    kernel.top_k_workspace = kernel.top_k_workspace or top_k.TopKWorkspace(8, DEVICE)
    plain.top_k_workspace = None
    calls = []
    real = top_k.top_k_values
    monkeypatch.setattr(top_k, "top_k_values", lambda *a: calls.append(a[1]) or real(*a))
    emb = nn.Embedding(1000, 48).to(DEVICE)
    result = StepResult(logits=_logits(5, 1000, seed=3).to(DEVICE), hidden=torch.randn(5, 48, device=DEVICE),
                        token_ids=torch.randint(0, 1000, (5,), device=DEVICE), embed_tokens=emb)
    assert torch.equal(kernel.logits(result), plain.logits(result))
    assert calls == [100]


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import top_k as tk

for kernel in (tk._high_byte_kernel, tk._low_byte_kernel, tk._gather_kernel):
    for logits in ("*fp32", "*bf16"):
        consts = {"CHUNK": tk.CHUNK, "BINS": 256, "MAX_K": tk.MAX_K, "STATE": 8}
        sig = {n: "*i32" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
        sig.update(logits_ptr=logits, out_ptr="*fp32", **{c: "constexpr" for c in consts})
        sig = {n: t for n, t in sig.items() if n in kernel.arg_names}
        consts = {n: v for n, v in consts.items() if n in kernel.arg_names}
        triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
print("compiled")
"""


def test_compiles_for_hopper() -> None:
    """What only the compiler rejects (types, shapes), for sm_90 without a GPU (Triton's ptxas)."""
    from triton_interpreter import compile_for_hopper

    compile_for_hopper(_COMPILE_FOR_HOPPER)
