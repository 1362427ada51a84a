"""The fused decoder-layer kernels against the torch reference (layers.py / model.py math), via Triton's interpreter.

TRITON_INTERPRET=1 is in effect when triton is imported (`triton_interpreter`), so CI runs the kernels on the CPU;
on a GPU machine `TRITON_INTERPRET=0 pytest tests/test_fused_ops.py` runs the same checks compiled, on CUDA tensors
(and then also in bfloat16, which the interpreter cannot round correctly, see `_dtype_params`).
Shapes are tiny but cover the awkward cases: a hidden size that is not a power of two, GQA with padded head tiles,
arbitrary positions, scattered slots with padding (-1) tokens, strided inputs and KV pool views.
"""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET  # first: before anything here imports triton
# isort: on

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the fused Triton ops cannot be tested")

from tokenrouter.runner import fused_ops  # noqa: E402
from tokenrouter.runner.attention import AttentionBackend  # noqa: E402
from tokenrouter.runner.layers import RMSNorm, RotaryEmbedding, SwiGLU  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
EPS = 1e-6

# float32: torch.testing's defaults (rtol 1.3e-6, atol 1e-5); only summation order and, compiled, FMA contraction
# differ from torch. 16-bit: the kernels round where torch does, so outputs differ by at most an ulp or two where a
# float32 intermediate lands next to a rounding boundary (fp16 ulp is 2**-10 relative, bf16 2**-7).
TOL = {
    torch.float32: {},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


def _dtype_params() -> list:
    # The interpreter's float32 -> bfloat16 cast truncates instead of rounding to nearest even (compiled Triton
    # and torch round), so bf16 results there are off by an ulp for about half the elements; only test it compiled.
    bf16 = pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(INTERPRET, reason="Triton's interpreter truncates float32 -> bfloat16 casts"),
    )
    return [torch.float32, torch.float16, bf16]


DTYPES = _dtype_params()


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0, shift: float = 0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)


def _strided(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The same values as a column slice of a wider tensor: row stride > width, last dim contiguous."""
    wide = _randn(x.shape[0], x.shape[1] + 7, dtype=x.dtype, gen=gen)
    wide[:, 3 : 3 + x.shape[1]] = x
    view = wide[:, 3 : 3 + x.shape[1]]
    assert view.stride(0) == x.shape[1] + 7 and view.stride(-1) == 1
    return view


def _norm_module(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    """An RMSNorm with a non-trivial weight, cast to the activation dtype as the model runner loads it."""
    norm = RMSNorm(dim, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + 1.0)
    # layers.RMSNorm can itself dispatch to fused_ops; the reference must be its torch path.
    assert not getattr(norm, "fused", False)
    return norm.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H", [48, 64])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(dtype: torch.dtype, T: int, H: int, strided: bool) -> None:
    gen = torch.Generator().manual_seed(T * 100 + H)
    norm = _norm_module(H, dtype, gen)
    x = _randn(T, H, dtype=dtype, gen=gen, scale=3.0)
    if strided:
        x = _strided(x, gen)
    with torch.no_grad():
        ref = norm(x)
    out = fused_ops.rms_norm(x, norm.weight.detach(), EPS)
    assert out.shape == (T, H) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_add_rms_norm(dtype: torch.dtype, T: int) -> None:
    H = 48
    gen = torch.Generator().manual_seed(T)
    norm = _norm_module(H, dtype, gen)
    x = _randn(T, H, dtype=dtype, gen=gen)
    residual = _strided(_randn(T, H, dtype=dtype, gen=gen, scale=4.0), gen)
    x_before, residual_before = x.clone(), residual.clone()
    ref_residual = x + residual
    with torch.no_grad():
        ref = norm(ref_residual)
    out, new_residual = fused_ops.add_rms_norm(x, residual, norm.weight.detach(), EPS)
    # The residual stream must be exactly what the unfused layer carries forward: torch's rounded x + residual.
    assert new_residual.dtype == dtype and torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be modified"


def _qk_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v exactly as Attention.forward in model.py computes them from the qkv_proj output."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(T, num_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    with torch.no_grad():
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(positions, q, k)
    return q, k, v


def _slots(T: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct scattered slots, never the first or last pool row (a -1 slot that leaked through as an index
    would land there), with every third token from the second on a padding token (-1)."""
    slots = (torch.randperm(num_slots - 2, generator=gen)[:T] + 1).to(torch.int64)
    slots[1::3] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (3, 1)])
@pytest.mark.parametrize("head_dim", [16, 24, 32])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store(
    dtype: torch.dtype, T: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool
) -> None:
    gen = torch.Generator().manual_seed(T * 1000 + num_heads * 100 + head_dim + qk_norm)
    max_pos, num_slots = 4096, 64
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, None).to(DEVICE)
    q_norm = _norm_module(head_dim, dtype, gen) if qk_norm else None
    k_norm = _norm_module(head_dim, dtype, gen) if qk_norm else None
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # qkv as a column slice of a wider tensor (e.g. a fused projection with extra outputs): row stride != width.
    qkv = _strided(_randn(T, width, dtype=dtype, gen=gen, scale=2.0), gen)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)  # arbitrary, not 0..T-1
    slot_mapping = _slots(T, num_slots, gen).to(DEVICE)
    # K and V are interleaved views of one pool, so the cache row stride (2 * Hkv * D) is not Hkv * D.
    pool = _randn(num_slots, 2, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    pool_before = pool.clone()

    ref_q, ref_k, ref_v = _qk_reference(qkv, positions, rope, q_norm, k_norm, num_heads, num_kv_heads, head_dim)
    written = slot_mapping >= 0
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    AttentionBackend.store_kv(ref_k[written], ref_v[written], ref_k_cache, ref_v_cache, slot_mapping[written])

    q = fused_ops.qk_norm_rope_store(
        qkv, positions, rope.cos, rope.sin,
        None if q_norm is None else q_norm.weight.detach(), None if k_norm is None else k_norm.weight.detach(), EPS,
        k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
    )  # fmt: skip

    assert q.shape == (T, num_heads, head_dim) and q.dtype == dtype and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_k_cache, **TOL[dtype])
    assert torch.equal(v_cache, ref_v_cache), "v must be copied bit for bit"
    # Every pool row that no real token owns, including those a -1 slot could alias, is untouched.
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[written]] = False
    assert torch.equal(pool[untouched], pool_before[untouched])


def test_qk_norm_rope_store_all_padding() -> None:
    """A CUDA-graph padding batch (every slot -1) still returns q but leaves the whole pool as it was."""
    gen = torch.Generator().manual_seed(7)
    T, num_heads, num_kv_heads, head_dim, num_slots = 4, 4, 2, 16, 8
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    qkv = _randn(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32, gen=gen)
    positions = torch.tensor([0, 5, 63, 2], device=DEVICE)
    k_cache = _randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    v_cache = _randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=DEVICE)
    q = fused_ops.qk_norm_rope_store(
        qkv, positions, rope.cos, rope.sin, None, None, EPS, k_cache, v_cache, slot_mapping,
        num_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    ref_q, _, _ = _qk_reference(qkv, positions, rope, None, None, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(q, ref_q)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_qk_norm_rope_store_rejects_bad_shapes() -> None:
    qkv = torch.zeros(2, (4 + 2 * 2) * 16, device=DEVICE)
    cache = torch.zeros(8, 2, 16, device=DEVICE)
    table = torch.zeros(32, 8, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="qkv width"):
        fused_ops.qk_norm_rope_store(qkv, pos, table, table, None, None, EPS, cache, cache, slots, 4, 1, 16)
    with pytest.raises(ValueError, match="dtype"):
        half = cache.half()
        fused_ops.qk_norm_rope_store(qkv, pos, table, table, None, None, EPS, half, half, slots, 4, 2, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("inter", [40, 64])
def test_silu_mul(dtype: torch.dtype, T: int, inter: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 16-column block makes I=40 span three column programs, the last one partial.
    monkeypatch.setattr(fused_ops, "_SILU_BLOCK", 16)
    gen = torch.Generator().manual_seed(T + inter)
    gate_up = _strided(_randn(T, 2 * inter, dtype=dtype, gen=gen, scale=4.0), gen)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up  # as in SwiGLU.forward
    out = fused_ops.silu_mul(gate_up)
    assert out.shape == (T, inter) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_swiglu_with_silu_mul_matches_module() -> None:
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    mlp = SwiGLU(48, 40).to(DEVICE)
    assert not getattr(mlp, "fused", False)  # the reference is the module's torch path
    x = _randn(5, 48, dtype=torch.float32, gen=gen)
    with torch.no_grad():
        fused = mlp.down_proj(fused_ops.silu_mul(mlp.gate_up_proj(x)))
        ref = mlp(x)
    torch.testing.assert_close(fused, ref)


def test_empty_batch() -> None:
    w = torch.ones(48, device=DEVICE)
    x = torch.zeros(0, 48, device=DEVICE)
    assert fused_ops.rms_norm(x, w, EPS).shape == (0, 48)
    out, res = fused_ops.add_rms_norm(x, x, w, EPS)
    assert out.shape == res.shape == (0, 48)
    assert fused_ops.silu_mul(torch.zeros(0, 80, device=DEVICE)).shape == (0, 40)


@pytest.mark.parametrize("rows,n,eps", [(1, 48, 1e-5), (5, 1024, 1e-5), (16, 100, 0.5)])
def test_layer_norm_dot_matches_torch(rows: int, n: int, eps: float) -> None:
    """A router's head in one kernel equals LayerNorm then Linear(n, 1), to float32 summation order, also for rows
    far from zero (the variance taken around the mean, not from the raw second moment) and with a large eps."""
    gen = torch.Generator().manual_seed(n)
    norm, head = torch.nn.LayerNorm(n, eps=eps).to(DEVICE), torch.nn.Linear(n, 1).to(DEVICE)
    with torch.no_grad():
        for p in (*norm.parameters(), *head.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = (torch.randn(rows, n, generator=gen) + 300.0 * torch.arange(rows)[:, None]).to(DEVICE)
    out = fused_ops.layer_norm_dot(x, norm, head)
    with torch.no_grad():
        ref = head(norm(x)).squeeze(-1)
        exact = head.double()(norm.double()(x.double())).squeeze(-1)  # (.double() converts the modules in place)
    assert out.shape == (rows,) and out.dtype == torch.float32
    # As close to the float64 result as torch's float32 modules are (rows at 300 * i carry float32 input rounding
    # that both amplify alike); a one-pass variance would be far off there.
    assert (out.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-5
    for bad in ((x.half(), norm, head), (x, torch.nn.LayerNorm(n, bias=False).to(DEVICE), head),
                (x, norm, torch.nn.Linear(n + 1, 1).to(DEVICE)), (x[:, :-1], norm, head)):
        with pytest.raises(ValueError, match="layer_norm_dot"):
            fused_ops.layer_norm_dot(*bad)
