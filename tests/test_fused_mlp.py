"""The one-kernel MLP (runner/fused_mlp.py) against torch and against the skinny path's two launches, and the model
with it against the model without, via Triton's interpreter (TRITON_INTERPRET=0 on a GPU runs the same checks
compiled, the grid barrier included).

The kernel cases cover hidden and intermediate sizes that are not multiples of the tiles or of the programs, last
programs with partial slices, programs with a few columns each, and strided rows; the counters must be zero again
after every launch (a CUDA graph replays the same launch).
"""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET, compile_for_hopper  # first: before anything here imports triton
# isort: on

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the fused MLP cannot be tested")

from test_cuda_graph_runner import TOL as MODEL_TOL  # noqa: E402
from test_cuda_graph_runner import _Driver, _runner  # noqa: E402
from tokenrouter.runner import fused_mlp as fm  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.layers import RMSNorm  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
EPS = 1e-6
# Against torch: the same roundings, then an ulp or two of the 16-bit output from float32 summation order.
TOL = {torch.float16: {"rtol": 4e-3, "atol": 4e-3}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _case(M: int, H: int, I: int, dtype: torch.dtype, seed: int = 0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = _randn(M, H, dtype=dtype, gen=gen)
    norm_w = (1.0 + 0.1 * torch.randn(H, generator=gen)).to(dtype).to(DEVICE)
    gate_up = _randn(2 * I, H, dtype=dtype, gen=gen, scale=H**-0.5)
    down = _randn(H, I, dtype=dtype, gen=gen, scale=I**-0.5)
    return x, norm_w, gate_up, down


def _torch_mlp(x, norm_w, gate_up, down):
    """The eager layer's math: RMSNorm, gate/up, silu(gate) * up, down, residual add, rounded where torch rounds."""
    norm = RMSNorm(x.shape[1], EPS).to(x.device, x.dtype)
    norm.weight.data.copy_(norm_w)
    gu = F.linear(norm(x), gate_up)
    gate, up = gu.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down) + x


def _workspace(I: int, M: int) -> sg.SplitKWorkspace:  # noqa: E741
    return sg.SplitKWorkspace(DEVICE, *fm.workspace_need(I, M))


CASES = [
    (1, 64, 32, fm.MlpConfig(programs=2, block_k=32, block_k2=16)),  # tiles exact: 16 columns of I, 32 of H each
    (3, 200, 72, fm.MlpConfig(programs=5, block_k=64, block_k2=32)),  # 15 and 40 each: the last ones ragged
    (16, 96, 300, fm.MlpConfig(programs=7, block_k=64, block_k2=64)),  # 43 columns of I in a 64 tile, 14 of H in 16
    (8, 1100, 48, fm.MlpConfig(programs=3, block_k=128, block_k2=16)),  # norm statistics over 3 loads
    (2, 64, 32, fm.MlpConfig(programs=8, block_k=64, block_k2=32)),  # 4 columns of I and 8 of H per program
]


# Triton's interpreter multiplies bfloat16 values made inside a kernel (silu(gate) * up here) as their bit patterns
# (triton 3.9): bfloat16 is checked compiled only, where the models run.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason="the interpreter's bfloat16 dot"))


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize(("M", "H", "I", "cfg"), CASES)
def test_matches_torch_and_the_skinny_path(dtype, M, H, I, cfg) -> None:  # noqa: E741
    x, norm_w, gate_up, down = _case(M, H, I, dtype)
    ws = _workspace(I, M)
    out = fm.fused_mlp(x, norm_w, EPS, gate_up, down, ws, cfg)
    assert out.shape == (M, H) and out.dtype == dtype
    torch.testing.assert_close(out, _torch_mlp(x, norm_w, gate_up, down), **TOL[dtype])
    # The skinny path's two launches: the same roundings, so closer than torch's order of operations.
    skinny_ws = sg.SplitKWorkspace(DEVICE, 4 * sg.MAX_M * max(H, 2 * I), 64)
    gu = sg.skinny_linear(x, gate_up, skinny_ws, prologue="rms_norm", norm_weight=norm_w, eps=EPS,
                          config=sg.GemmConfig(32, 32, 1))
    ref = sg.skinny_linear(gu, down, skinny_ws, prologue="silu_mul", residual=x, config=sg.GemmConfig(32, 32, 1))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert int(ws.counts.count_nonzero()) == 0  # zero again for the next launch


def test_strided_rows_and_a_second_launch_agree() -> None:
    """Rows taken from a wider tensor give what the contiguous rows give, bit for bit, and a second launch on the
    same workspace repeats the first (the counters were left zero)."""
    M, H, I, cfg = 5, 96, 80, fm.MlpConfig(programs=3, block_k=32, block_k2=32)  # noqa: E741
    x, norm_w, gate_up, down = _case(M, H, I, torch.float16)
    wide = torch.zeros(M, H + 40, dtype=x.dtype, device=DEVICE)
    wide[:, 8 : 8 + H] = x
    ws = _workspace(I, M)
    first = fm.fused_mlp(x, norm_w, EPS, gate_up, down, ws, cfg)
    strided = fm.fused_mlp(wide[:, 8 : 8 + H], norm_w, EPS, gate_up, down, ws, cfg)
    assert torch.equal(first, strided)
    assert torch.equal(first, fm.fused_mlp(x, norm_w, EPS, gate_up, down, ws, cfg))


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row comes out the same alone and among others: the row tile is fixed and the partials' order too."""
    M, H, I, cfg = 7, 128, 96, fm.MlpConfig(programs=4, block_k=64, block_k2=64)  # noqa: E741
    x, norm_w, gate_up, down = _case(M, H, I, torch.float16, seed=3)
    ws = _workspace(I, M)
    batch = fm.fused_mlp(x, norm_w, EPS, gate_up, down, ws, cfg)
    for row in (0, 4, 6):
        alone = fm.fused_mlp(x[row : row + 1], norm_w, EPS, gate_up, down, ws, cfg)
        assert torch.equal(alone[0], batch[row])


def test_rejects_bad_calls() -> None:
    x, norm_w, gate_up, down = _case(2, 64, 32, torch.float16)
    ws = _workspace(32, fm.MAX_ROWS)
    with pytest.raises(ValueError, match="do not fit"):
        fm.fused_mlp(x, norm_w, EPS, gate_up[:, :32], down, ws)
    with pytest.raises(ValueError, match="do not fit"):
        fm.fused_mlp(x, norm_w, EPS, gate_up[:63], down, ws)  # an odd gate_up: no [gate | up] halves
    with pytest.raises(ValueError, match="rows"):
        fm.fused_mlp(x.new_zeros(fm.MAX_ROWS + 1, 64), norm_w, EPS, gate_up, down, ws)
    with pytest.raises(ValueError, match="one dtype"):
        fm.fused_mlp(x.float(), norm_w, EPS, gate_up, down, ws)
    with pytest.raises(ValueError, match="workspace"):
        fm.fused_mlp(x, norm_w, EPS, gate_up, down, sg.SplitKWorkspace(DEVICE, 16, 2))
    if DEVICE.type == "cuda":  # more programs than SMs could never all meet at the barrier
        with pytest.raises(ValueError, match="resident"):
            fm.fused_mlp(x, norm_w, EPS, gate_up, down, ws, fm.MlpConfig(programs=10_000))


def test_model_with_the_fused_mlp_matches_the_cublas_path(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes and an extend of up to 16 tokens run every layer's MLP as one kernel and give the logits, hidden
    states, greedy tokens and KV of the model without skinny matmuls; longer batches keep the skinny path."""
    monkeypatch.setattr(sg, "max_rows", lambda shapes, device, dtype=None: sg.MAX_M)
    monkeypatch.setattr(sg, "config_for", lambda n, k, m, device, dtype=None: sg.GemmConfig(16, 16, 2))
    monkeypatch.setattr(fm, "MODE", "1")
    calls = []
    real = fm.fused_mlp

    def recorded(x, *a, **kw):
        calls.append(x.shape[0])
        return real(x, *a, **kw)

    monkeypatch.setattr(fm, "fused_mlp", recorded)
    fused = _runner(tiny_dir)
    plain = ModelRunner(dataclasses.replace(fused.cfg, skinny_gemm=False), default_kv_tokens=1024)
    assert fused.model.fused_mlp_max_m == fm.MAX_ROWS and plain.model.fused_mlp_max_m == 0
    gen = torch.Generator().manual_seed(0)
    vocab = fused.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 33)]
    a, b = _Driver(fused, prompts), _Driver(plain, prompts)
    layers = fused.arch.num_layers
    for toks, rows in (([[], []], None), ([[5], [6]], 2), ([[8, 9, 10], [11]], 4), ([list(range(12, 29)), []], None)):
        calls.clear()
        ours, ref = a.step(toks), b.step(toks)
        assert calls == ([] if rows is None else [rows] * layers)  # the prompts and the 17-token extend: not fused
        torch.testing.assert_close(ours[0], ref[0], rtol=MODEL_TOL, atol=MODEL_TOL)  # logits
        torch.testing.assert_close(ours[1], ref[1], rtol=MODEL_TOL, atol=MODEL_TOL)  # hidden
        assert torch.equal(ours[2], ref[2])  # greedy tokens
    torch.testing.assert_close(fused.kv_cache, plain.kv_cache, rtol=MODEL_TOL, atol=MODEL_TOL)
    assert int(fused.model.workspace.counts.count_nonzero()) == 0
    a.release()
    b.release()


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import fused_mlp as fm

kernel = fm._fused_mlp_kernel
for grid_sync, pdl, warps, stages in ((True, True, 4, 3), (True, False, 8, 4), (False, False, 4, 3)):
    consts = dict(BLOCK_M=16, BLOCK_I=32, BLOCK_K=128, BLOCK_NR=16, BLOCK_K2=256,
                  STATS_BLOCK=512, STATS_ITERS=2, GRID_SYNC=grid_sync, FP32_DOT="", PDL=pdl)
    sig = {n: "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32" for n in kernel.arg_names}
    sig.update(h_ptr="*fp32", count_ptr="*i32", **{c: "constexpr" for c in consts})
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "num_stages": stages, "launch_pdl": pdl}).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl
print("compiled")
"""


def test_compiles_for_hopper() -> None:
    """The grid barrier's loop and the gate/up split are what only the compiler checks: compile them for sm_90."""
    compile_for_hopper(_COMPILE_FOR_HOPPER)
