"""R2R's router network through the skinny matmul kernel (routing/policies/skinny_router.py) against its torch
modules, via Triton's interpreter (TRITON_INTERPRET=0 on a GPU runs the same checks compiled), and the rule that
decides when the kernel runs."""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET  # first: before anything here imports triton
# isort: on

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the skinny matmul cannot be tested")

from tokenrouter.routing.policies._common import seeded_init_  # noqa: E402
from tokenrouter.routing.policies.r2r import R2RPolicy, R2RRouter  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
HIDDEN, TOP_K, D = 48, 10, 32


def _router(seed: int = 0) -> R2RRouter:
    net = R2RRouter(HIDDEN, TOP_K, D)
    seeded_init_(net, seed)
    with torch.no_grad():  # LayerNorms away from the identity, so a wrong weight or bias shows
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return net.to(DEVICE).eval().requires_grad_(False)


def _inputs(rows: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=gen) * 2 + 0.5
    top = torch.randn(rows, TOP_K, generator=gen).sort(dim=-1, descending=True).values * 4
    emb = torch.randn(rows, HIDDEN, generator=gen)
    return hidden.to(DEVICE), top.to(DEVICE), emb.to(DEVICE)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_skinny_forward_matches_torch(rows: int, split: int, fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused network (LayerNorm into fc1, bias + GELU behind fc1, bias + residual behind fc2) computes what the
    torch modules do, to float32 rounding, unsplit and with every layer split over K (the bias, activation and
    residual applied once, after the reduction), in_proj and mix as they are or folded into one map (as served);
    split-K counters are left zero."""
    if split > 1:  # the heuristic splits none of these small shapes
        monkeypatch.setattr(sg, "config_for", lambda n, k, m, device, dtype=None: sg.GemmConfig(16, 16, split))
    net = _router()
    x = _inputs(rows)
    ref = net(*x)
    if fold:
        net.fold_input_maps()
    assert net.use_skinny_gemm(DEVICE, max_rows=16)
    assert net.skinny(rows)
    out = net(*x)
    # (The logits are O(1): float32 summation order and, compiled, TF32x3 products differ from cuBLAS by ~1e-6.)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert out.shape == (rows,)
    assert int(net.workspace.counts.count_nonzero()) == 0


def test_rows_past_the_cap_run_the_torch_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    net = _router()
    assert net.use_skinny_gemm(DEVICE, max_rows=4)
    calls = []
    monkeypatch.setattr(R2RRouter, "_forward_skinny", lambda self, *a: calls.append(a[0].shape[0]))
    net(*_inputs(4))
    net(*_inputs(5))
    net(*_inputs(0))
    assert calls == [4]


def test_the_table_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a GPU whose table has every one of the network's float32 shapes, each measured faster than cuBLAS with
    its ops, runs the kernel: a bfloat16 entry of the same N x K (a model's matmul) does not count."""
    net = _router()
    shapes = {f.shape for f in net.fused_linears()}
    assert not net.use_skinny_gemm(torch.device("cpu"))  # a CPU never, whatever the table

    def table(entries: dict) -> None:
        monkeypatch.setattr(sg, "_table", lambda device: sg.TunedTable(entries, {}))

    cuda = torch.device("cuda")
    monkeypatch.setattr(sg, "workspace_for", lambda *a: "workspace")  # no GPU memory to take on a CPU
    fast = sg.TunedEntry(sg.GemmConfig(32, 64, 1), 1.0, 2.0)
    table({sg.table_key(n, k, 16): fast for n, k in shapes})  # bfloat16 keys only
    assert not net.use_skinny_gemm(cuda)
    assert "no torch.float32 entries for" in net.skinny_off  # what the policy logs
    f32 = {sg.table_key(n, k, 16, torch.float32): fast for n, k in shapes}
    table(f32)
    assert net.use_skinny_gemm(cuda) and net.skinny_max_m == 16
    slow = dict(f32, **{sg.table_key(D, D, 16, torch.float32): sg.TunedEntry(sg.GemmConfig(32, 64, 1), 50.0, 2.0)})
    net = _router()
    table(slow)  # the mix layer measured far slower than cuBLAS: the sum is too
    assert not net.use_skinny_gemm(cuda) and net.workspace is None


def test_policy_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """`router_kernel: auto` asks the table (a CPU never runs the kernel); `torch` never asks; anything else is a
    clear error when the policy is built."""
    asked = []
    monkeypatch.setattr(R2RRouter, "use_skinny_gemm", lambda self, device: asked.append(device.type) or False)
    for kernel, expect in (("auto", ["cpu"]), ("torch", [])):
        asked.clear()
        args = {"hidden_dim": D, "top_k_logits": TOP_K, "router_kernel": kernel}
        policy = R2RPolicy(["small", "large"], "small", args)
        policy.setup(torch.device("cpu"), torch.float32, HIDDEN, 100)
        assert asked == expect and policy.net.workspace is None
    with pytest.raises(ValueError, match="router_kernel"):
        R2RPolicy(["small", "large"], "small", {"router_kernel": "cublas"})
