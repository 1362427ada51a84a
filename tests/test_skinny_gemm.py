"""The skinny matmul kernel (runner/skinny_gemm.py) against torch, and the model's skinny path against its cuBLAS
path, via Triton's interpreter (TRITON_INTERPRET=0 on a GPU runs the same checks compiled).

The kernel cases cover each prologue (none, RMSNorm, silu * up, LayerNorm) with and without the residual add, the
bias and activation epilogue of a router's layers, split-K with a ragged last split, stream-K with tiles shared by
programs in every way, N and K that are not multiples of the tiles, and strided rows; the counters of split-K and
stream-K must be zero again after every launch (a CUDA graph replays the same launch).
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

pytest.importorskip("triton", reason="triton is not installed; the skinny matmul cannot be tested")

from test_cuda_graph_runner import TOL as MODEL_TOL  # noqa: E402
from test_cuda_graph_runner import _Driver, _runner  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.layers import RMSNorm  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
EPS = 1e-6
# float32: the dot runs in three TF32 passes (compiled; float32-grade products) or in full precision under the
# interpreter, and the summation order differs from torch (partial sums of ~sqrt(K) in magnitude, so a few 1e-5
# absolute where terms cancel). float16: the prologues round where torch
# does, then an ulp or two from float32 summation order.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _workspace() -> sg.SplitKWorkspace:
    return sg.SplitKWorkspace(DEVICE, 8 * sg.MAX_M * 256, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prologue", sg.PROLOGUES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("M", "N", "K", "cfg"), [
    (1, 96, 80, sg.GemmConfig(32, 32, 1)),  # N and K ragged against the tiles
    (3, 64, 256, sg.GemmConfig(32, 64, 2)),
    (16, 100, 200, sg.GemmConfig(64, 32, 3)),  # 200 = 3 splits of 96, 96, 8: a short last split
    (20, 48, 64, sg.GemmConfig(32, 32, 4)),  # more splits than K blocks: the last split has nothing to add
    (5, 40, 1100, sg.GemmConfig(32, 128, 2)),  # RMSNorm statistics over three loads, the last one partial
    (40, 48, 300, sg.GemmConfig(32, 64, 2)),  # the 64-row tile: statistics in loads of 128 columns, three of them
    # stream-K: 3 tiles x 7 K blocks in runs of 5: programs that end one tile and start the next, tiles of 2-3
    (3, 96, 200, sg.GemmConfig(32, 32, 1, programs=5)),
    (5, 40, 1100, sg.GemmConfig(32, 128, 1, programs=7)),  # 2 tiles x 9 blocks in runs of 3 (6 programs launched)
    (16, 100, 200, sg.GemmConfig(32, 64, 1, programs=2)),  # runs of two whole tiles: stored at once, no partials
    (40, 48, 300, sg.GemmConfig(16, 64, 1, programs=4)),  # the 64-row tile; the last run shorter
])  # fmt: skip
def test_matches_torch(dtype, prologue, residual, M, N, K, cfg) -> None:
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    weight = _randn(N, K, dtype=dtype, gen=gen)
    # x as a column slice of a wider tensor: a row stride larger than its width.
    width = 2 * K if prologue == "silu_mul" else K
    x = _randn(M, width + 5, dtype=dtype, gen=gen)[:, :width]
    norm_w, norm_b = _randn(K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    res = _randn(M, N, dtype=dtype, gen=gen) if residual else None
    ws = _workspace()
    normed = prologue in ("rms_norm", "layer_norm")
    out = sg.skinny_linear(x, weight, ws, prologue=prologue, norm_weight=norm_w if normed else None,
                           norm_bias=norm_b if prologue == "layer_norm" else None, eps=EPS, residual=res, config=cfg)
    ref = F.linear(_prologue(x, prologue, norm_w, norm_b).float(), weight.float()).to(dtype)  # one rounding, as ours
    if residual:
        ref = ref + res
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert out.is_contiguous() and out.shape == (M, N)
    assert int(ws.counts.count_nonzero()) == 0  # ready for the next launch


def _prologue(x: torch.Tensor, prologue: str, norm_w: torch.Tensor, norm_b: torch.Tensor) -> torch.Tensor:
    """What the kernel's prologue computes, in torch's modules (and their roundings)."""
    if prologue == "rms_norm":
        norm = RMSNorm(x.shape[1], EPS).to(DEVICE, x.dtype)
        norm.weight.data.copy_(norm_w)
        return norm(x)
    if prologue == "layer_norm":
        return F.layer_norm(x, (x.shape[1],), norm_w, norm_b, EPS)
    if prologue == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", sg.ACTIVATIONS)
@pytest.mark.parametrize(("prologue", "residual"), [("none", False), ("layer_norm", False), ("none", True)])
@pytest.mark.parametrize(("M", "N", "K", "cfg"), [
    (3, 96, 80, sg.GemmConfig(32, 32, 1)),  # N and K ragged against the tiles
    (9, 40, 1100, sg.GemmConfig(32, 128, 3)),  # split-K; LayerNorm statistics over three loads, the last partial
    (2, 1, 64, sg.GemmConfig(16, 32, 2)),  # one output column (a router's head), split
    (9, 40, 1100, sg.GemmConfig(32, 128, 1, programs=5)),  # stream-K: the epilogue after a shared tile's sum
])  # fmt: skip
def test_bias_and_activation_match_torch(dtype, activation, prologue, residual, M, N, K, cfg) -> None:
    """The epilogue a router's layers need: bias before the product's rounding, then GELU or ReLU on the rounded
    value (torch's Linear then its activation module), then the residual add."""
    gen = torch.Generator().manual_seed(M * 100 + N + K)
    weight, bias = _randn(N, K, dtype=dtype, gen=gen) * 0.1, _randn(N, dtype=dtype, gen=gen)
    x = _randn(M, K, dtype=dtype, gen=gen) * 3 + 1  # a mean away from 0: LayerNorm must subtract it
    norm_w, norm_b = _randn(K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    res = _randn(M, N, dtype=dtype, gen=gen) if residual else None
    ws = _workspace()
    ln = prologue == "layer_norm"
    out = sg.skinny_linear(x, weight, ws, prologue=prologue, norm_weight=norm_w if ln else None,
                           norm_bias=norm_b if ln else None, eps=EPS, bias=bias, activation=activation, residual=res,
                           config=cfg)
    ref = F.linear(_prologue(x, prologue, norm_w, norm_b).float(), weight.float(), bias.float()).to(dtype)
    ref = {"none": lambda t: t, "gelu": F.gelu, "relu": F.relu}[activation](ref)
    if residual:
        ref = ref + res
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert int(ws.counts.count_nonzero()) == 0


@pytest.mark.parametrize("outlier", [False, True])
def test_layer_norm_of_rows_far_from_zero(outlier: bool) -> None:
    """LayerNorm's statistics in one pass stay exact when a row's mean is large against its spread (float32's sum
    of squares minus the squared mean would lose the variance's third digit here), also when the row's first
    column is an outlier (30 sigma), against a float64 reference."""
    gen = torch.Generator().manual_seed(7)
    K = 1100  # three statistics blocks at 16 rows, the last one partial
    x = _randn(4, K, dtype=torch.float32, gen=gen) + 100.0
    if outlier:
        x[:, 0] += 30.0
    weight, norm_w, norm_b = (_randn(*shape, dtype=torch.float32, gen=gen) for shape in ((32, K), (K,), (K,)))
    out = sg.skinny_linear(x, weight, prologue="layer_norm", norm_weight=norm_w, norm_bias=norm_b, eps=EPS,
                           config=sg.GemmConfig(32, 128, 1))
    ref = F.linear(F.layer_norm(x.double(), (K,), norm_w.double(), norm_b.double(), EPS), weight.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs programs in grid order: only compiled can the "
                    "arrival order of the splits vary")
@pytest.mark.parametrize("cfg", [sg.GemmConfig(32, 32, 8), sg.GemmConfig(32, 32, 1, programs=11)])
def test_split_k_is_deterministic(cfg: sg.GemmConfig) -> None:
    """The partials are summed in split (or program) order, not arrival order: the same input gives the same
    bits."""
    gen = torch.Generator().manual_seed(1)
    x, w = _randn(8, 512, dtype=torch.float32, gen=gen), _randn(64, 512, dtype=torch.float32, gen=gen)
    ws = _workspace()
    first = sg.skinny_linear(x, w, ws, config=cfg)
    assert all(torch.equal(first, sg.skinny_linear(x, w, ws, config=cfg)) for _ in range(3))


@pytest.mark.parametrize("prologue", ["rms_norm", "silu_mul"])
def test_rows_do_not_depend_on_the_batch(prologue: str) -> None:
    """Batch invariance within a row tile: a row's output is bit-identical whichever rows share its launch and
    wherever it sits (one config per row tile, each output summed over K in the same order). On a GPU this is
    bfloat16 through the compiled kernel, with the config the runner would pick for 16 rows."""
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    n, k = (48, 96) if INTERPRET else (1024, 3072)
    x = _randn(16, 2 * k if prologue == "silu_mul" else k, dtype=dtype, gen=gen)
    w, norm_w = _randn(n, k, dtype=dtype, gen=gen), _randn(k, dtype=dtype, gen=gen)
    res = _randn(16, n, dtype=dtype, gen=gen)
    cfg = sg.GemmConfig(16, 32, 2) if INTERPRET else sg.config_for(n, k, 16, DEVICE)
    ws = sg.SplitKWorkspace(DEVICE, 16 * 16 * n, 1024)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return sg.skinny_linear(x[rows], w, ws, prologue=prologue, norm_weight=norm_w, eps=EPS, residual=res[rows],
                                config=cfg)

    full = run(torch.arange(16, device=DEVICE))
    for m in (1, 3, 8, 15):
        assert torch.equal(run(torch.arange(m, device=DEVICE)), full[:m])
    flipped = torch.arange(15, -1, -1, device=DEVICE)
    assert torch.equal(run(flipped), full[flipped])


def test_rejects_bad_calls() -> None:
    x, w = torch.zeros(4, 32, device=DEVICE), torch.zeros(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="prologue"):
        sg.skinny_linear(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="activation"):
        sg.skinny_linear(x, w, activation="tanh")
    with pytest.raises(ValueError, match="norm_bias"):
        sg.skinny_linear(x, w, prologue="layer_norm", norm_weight=torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        sg.skinny_linear(x, w, bias=torch.zeros(15, device=DEVICE))
    with pytest.raises(ValueError, match="K >= 1"):
        sg.skinny_linear(x[:, :0], w[:, :0])
    with pytest.raises(ValueError, match="fp32_dot"):
        sg.skinny_linear(x, w, config=sg.GemmConfig(16, 16, 1, fp32_dot="tf32"))
    with pytest.raises(ValueError, match="at most"):
        sg.skinny_linear(torch.zeros(sg.MAX_M + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not fit"):
        sg.skinny_linear(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match="norm_weight"):
        sg.skinny_linear(x, w, prologue="rms_norm")
    with pytest.raises(ValueError, match="workspace"):
        sg.skinny_linear(x, w, config=sg.GemmConfig(16, 16, 2))
    with pytest.raises(ValueError, match="stream-K over 3 programs .* needs a workspace"):
        sg.skinny_linear(x, w, config=sg.GemmConfig(16, 16, 1, programs=3))
    with pytest.raises(ValueError, match="split_k 1"):
        sg.skinny_linear(x, w, _workspace(), config=sg.GemmConfig(16, 16, 2, programs=3))
    assert sg.skinny_linear(x[:0], w).shape == (0, 16)


def _table(monkeypatch: pytest.MonkeyPatch, matmuls: dict, layers: dict | None = None) -> None:
    """A tuned table for a pretend GPU (every lookup sees it)."""
    table = sg.TunedTable(matmuls, layers or {})
    monkeypatch.setattr(sg, "_table", lambda device: table)


def _entry(us: float, baseline_us: float, block_n: int = 32) -> sg.TunedEntry:
    return sg.TunedEntry(sg.GemmConfig(block_n, 64, 2), us, baseline_us)


def test_table_decides_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = [(96, 64), (64, 32)]
    # No table (the CPU, an untuned GPU): never skinny.
    assert sg.max_rows(shapes, torch.device("cpu")) == 0
    # Faster at 16 and 32 rows, slower at 64: up to 32.
    # (each tile its own config: block_n = the row tile)
    table = {sg.table_key(n, k, bm): _entry(3.0 if bm == 64 else 1.0, 2.0, block_n=bm)
             for n, k in shapes for bm in sg.BLOCK_M_SIZES}
    _table(monkeypatch, table)
    assert sg.max_rows(shapes, DEVICE) == 32
    assert sg.config_for(96, 64, 20, DEVICE).block_n == 32  # 20 rows: the 32-row tile's entry
    assert sg.config_for(96, 64, 3, DEVICE).block_n == 16
    # The layer's step-level cap wins when lower, unless caps are off (bench_runner measuring a new one).
    _table(monkeypatch, table, {sg.layer_key(shapes): 4})
    assert sg.max_rows(shapes, DEVICE) == 4
    monkeypatch.setattr(sg, "LAYER_CAPS", False)
    assert sg.max_rows(shapes, DEVICE) == 32
    monkeypatch.setattr(sg, "LAYER_CAPS", True)
    # A matmul missing at a row tile ends the rows there: heuristic configs are not a default.
    del table[sg.table_key(64, 32, 32)]
    _table(monkeypatch, table)
    assert sg.max_rows(shapes, DEVICE) == 16
    # The sum over the layer decides, not each matmul.
    _table(monkeypatch, {sg.table_key(96, 64, 16): _entry(1.0, 3.0), sg.table_key(64, 32, 16): _entry(2.5, 2.0)})
    assert sg.max_rows(shapes, DEVICE) == 16


@pytest.mark.parametrize("gpu, small_rows, rope_rows, large_reason", [
    # The 32B's layer cap is 0 on the H200: no faster at the step, and its skinny steps slowed the 0.6B beside it.
    ("NVIDIA H200", 16, 16, "caps this layer at 0 rows"),
    # The H100 was measured for the 0.6B (and R2R's router) only (perf/results/h100_table_2026-12-05).
    ("NVIDIA H100 80GB HBM3", 32, 64, "no torch.bfloat16 entries for 10240x5120, 5120x8192, 51200x5120, 5120x25600"),
])
def test_shipped_table(monkeypatch: pytest.MonkeyPatch, gpu: str, small_rows: int, rope_rows: int,
                       large_reason: str) -> None:
    """The committed table parses, runs the 0.6B skinny up to its step-level cap on each measured GPU and keeps the
    32B on cuBLAS, saying why."""
    from tokenrouter.runner.arch import ArchConfig
    from tokenrouter.runner.model import layer_shapes

    monkeypatch.setattr(sg, "_table", lambda device: sg._tuned_table(gpu))
    rows, reasons = {}, {}
    for model in ("qwen3-0.6b", "qwen3-32b"):
        arch = ArchConfig.from_dir(Path(__file__).resolve().parents[1] / "perf" / "models" / model)
        rows[model] = sg.max_rows(layer_shapes(arch), DEVICE)
        reasons[model] = sg.cublas_reason(layer_shapes(arch), DEVICE)
    assert rows == {"qwen3-0.6b": small_rows, "qwen3-32b": 0}
    assert large_reason in reasons["qwen3-32b"]
    # The 0.6B's qkv matmul takes the QKRope epilogue where its tuned entry was measured faster, not past it.
    assert sg.qk_rope_pays(4096, 1024, 8, DEVICE) and sg.qk_rope_pays(4096, 1024, rope_rows, DEVICE)
    assert rope_rows == sg.MAX_M or not sg.qk_rope_pays(4096, 1024, 2 * rope_rows, DEVICE)


def test_cublas_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the log says when a layer stays on cuBLAS: a GPU the table never measured names the tuning script."""
    shapes = [(96, 64), (64, 32)]
    assert sg.cublas_reason(shapes, torch.device("cpu")) == "not a CUDA device"
    _table(monkeypatch, {})
    assert "has no entries for" in sg.cublas_reason(shapes, DEVICE)
    assert "perf/gpu_kernels.sh" in sg.cublas_reason(shapes, DEVICE)
    _table(monkeypatch, {sg.table_key(96, 64, 16): _entry(1.0, 2.0)})
    assert "has no torch.bfloat16 entries for 64x32 on" in sg.cublas_reason(shapes, DEVICE)
    both = {sg.table_key(n, k, 16): _entry(1.0, 2.0) for n, k in shapes}
    _table(monkeypatch, both, {sg.layer_key(shapes): 0})
    assert "caps this layer at 0 rows" in sg.cublas_reason(shapes, DEVICE)
    _table(monkeypatch, {key: _entry(3.0, 2.0) for key in both})
    assert "measured cuBLAS faster" in sg.cublas_reason(shapes, DEVICE)


def test_layer_caps_rule() -> None:
    """bench_runner's step-level cap: the largest batch up to which every batch ran no slower skinny; a slower
    or unmeasured batch ends it; batches beyond the run's own row limit do not count."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
    from bench_runner import layer_caps

    def run(skinny: bool, replay: dict, limit: int = 16) -> dict:
        return {"model": "m", "skinny_gemm": skinny, "skinny_max_m": limit if skinny else 0,
                "decode": [{"batch": b, "context": 1024, "replay_ms": ms} for b, ms in replay.items()]
                + [{"batch": 1, "context": 8192, "replay_ms": 9.0}]}

    cublas = {1: 1.3, 4: 1.4, 8: 1.4, 16: 1.7, 32: 2.3}
    assert layer_caps({"models": [run(True, {1: 1.2, 4: 1.35, 8: 1.5, 16: 1.6, 32: 2.0}), run(False, cublas)]}) \
        == {"m": 4}
    assert layer_caps({"models": [run(True, {1: 1.2, 4: None, 8: 1.3}), run(False, cublas)]}) == {"m": 1}
    assert layer_caps({"models": [run(True, {1: 1.2, 4: 1.3, 8: 1.3, 16: 1.6, 32: 2.0}, limit=8),
                                  run(False, cublas)]}) == {"m": 8}
    assert layer_caps({"models": [run(False, cublas)]}) == {}  # not run both ways: no cap


def test_model_skinny_only_where_the_table_says(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An untuned model stays on cuBLAS; a tuned one is capped at its rows; a model with a q/k/v bias (which the
    kernel lacks) never runs skinny; the workspace fits the rows it may run. The table is read for the weights'
    dtype: entries tuned in bfloat16 do not turn the float32 tiny model skinny (its launches would look up
    float32 configs the workspace was not sized for)."""
    from tokenrouter.runner.model import layer_shapes

    runner = _runner(tiny_dir)
    assert not runner.skinny_gemm and runner.model.workspace is None  # no table for the tiny model
    shapes = layer_shapes(runner.arch)
    entries = {sg.table_key(n, k, bm): _entry(1.0, 2.0) for n, k in shapes for bm in sg.BLOCK_M_SIZES}
    _table(monkeypatch, entries, {sg.layer_key(shapes): 8})
    assert not _runner(tiny_dir).skinny_gemm  # bfloat16 entries only
    entries = {sg.table_key(n, k, bm, torch.float32): _entry(1.0, 2.0)
               for n, k in shapes for bm in sg.BLOCK_M_SIZES}
    _table(monkeypatch, entries, {sg.layer_key(shapes): 8})
    runner = _runner(tiny_dir)
    assert runner.skinny_gemm and runner.model.skinny_max_m == 8
    need = max(sg.workspace_need(n, k, 8, DEVICE, torch.float32)[0] for n, k in shapes)
    assert runner.model.workspace.partials.numel() == need  # 2 splits x 8 rows x the widest N
    runner.model.arch = dataclasses.replace(runner.arch, qkv_bias=True)
    runner.model.workspace = None
    assert not runner.model.use_skinny_gemm(DEVICE) and runner.model.workspace is None


def test_heuristic_config_spreads_over_the_sms() -> None:
    # A wide matrix needs no split; a narrow, deep one (down_proj) is split until there are programs enough.
    wide = sg.heuristic_config(51200, 5120, 8, num_sms=132)
    assert wide.split_k == 1 and 51200 // wide.block_n >= 2 * 132
    deep = sg.heuristic_config(1024, 3072, 8, num_sms=132)
    assert deep.split_k > 1 and (1024 // deep.block_n) * deep.split_k >= 132


def test_model_skinny_path_matches_cublas_path(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill (over MAX_M tokens: the cuBLAS path on both), decodes and an extend (the skinny path) give the
    same logits and hidden states, and the same KV in the pool, as the model without skinny matmuls."""
    # The tiny model is in no tuned table: let it run skinny, with two splits for every shape, so that the split-K
    # reduction runs inside the model too.
    monkeypatch.setattr(sg, "max_rows", lambda shapes, device, dtype=None: sg.MAX_M)
    monkeypatch.setattr(sg, "config_for", lambda n, k, m, device, dtype=None: sg.GemmConfig(16, 16, 2))
    # and with the qkv epilogue on a GPU too (where the table decides it, and has no entry for the tiny model)
    monkeypatch.setattr(sg, "qk_rope_pays", lambda *args, **kwargs: True)
    calls = []
    real = sg.skinny_linear

    def recorded(x, *a, **kw):
        calls.append((x.shape[0], kw.get("qk_rope") is not None))
        return real(x, *a, **kw)

    monkeypatch.setattr(sg, "skinny_linear", recorded)
    skinny = _runner(tiny_dir)  # skinny_gemm is on by default
    plain = ModelRunner(dataclasses.replace(skinny.cfg, skinny_gemm=False), default_kv_tokens=1024)
    assert skinny.skinny_gemm and not plain.skinny_gemm and skinny.model.workspace is not None
    gen = torch.Generator().manual_seed(0)
    vocab = skinny.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 33)]
    a, b = _Driver(skinny, prompts), _Driver(plain, prompts)
    layers = skinny.arch.num_layers
    for toks, rows in (([[], []], None), ([[5], [6]], 2), ([[8, 9, 10], [11]], 4), ([[12], []], 1)):
        calls.clear()
        ours, ref = a.step(toks), b.step(toks)
        # 73 prompt tokens: cuBLAS; the decode and extend steps: four skinny matmuls a layer, the first (qkv) with
        # the QKRope epilogue.
        assert calls == ([] if rows is None else [(rows, True), (rows, False), (rows, False), (rows, False)] * layers)
        torch.testing.assert_close(ours[0], ref[0], rtol=MODEL_TOL, atol=MODEL_TOL)  # logits
        torch.testing.assert_close(ours[1], ref[1], rtol=MODEL_TOL, atol=MODEL_TOL)  # hidden
        assert torch.equal(ours[2], ref[2])  # greedy tokens
    torch.testing.assert_close(skinny.kv_cache, plain.kv_cache, rtol=MODEL_TOL, atol=MODEL_TOL)
    assert int(skinny.model.workspace.counts.count_nonzero()) == 0
    a.release()
    b.release()


_COMPILE_FOR_HOPPER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import skinny_gemm as sg

def waits_first(ptx):  # PDL: the grid-dependency wait before the kernel's first global memory access
    body = ptx[ptx.index(".entry"):]
    hits = [i for i in (body.find(op) for op in ("ld.global", "st.global", "atom.", "red.", "cp.async")) if i >= 0]
    return 0 <= body.find("griddepcontrol.wait") < min(hits)

# (the row tiles, block_k, warps and stages the H200 table uses)
# and the float32 router layers (LayerNorm in front, bias and GELU behind; TF32x3 and IEEE dots)
# and launched with PDL (pdl.py); split 0: the stream-K kernel
for prologue, residual, split, bm, bk, warps, stages, dot, bias, act, pdl in (
        (0, True, 1, 16, 128, 4, 4, "", 0, 0, False), (1, False, 2, 16, 256, 4, 3, "", 0, 0, False),
        (2, True, 3, 32, 64, 8, 6, "", 0, 0, False), (1, False, 4, 64, 128, 8, 4, "", 0, 0, False),
        (3, False, 2, 16, 64, 4, 4, "tf32x3", 1, 1, False), (0, True, 4, 16, 128, 4, 3, "ieee", 1, 2, False),
        (1, False, 1, 16, 256, 4, 3, "", 0, 0, True), (2, True, 8, 16, 64, 8, 4, "", 0, 0, True),
        (1, False, 0, 16, 64, 4, 4, "", 0, 0, True), (2, True, 0, 32, 128, 8, 3, "", 0, 0, False),
        (3, False, 0, 16, 64, 4, 4, "tf32x3", 1, 1, True),
        (1, False, -1, 16, 128, 4, 4, "", 0, 0, True), (1, False, -2, 16, 128, 8, 3, "", 0, 0, False)):
    kernel = sg._stream_k_gemm_kernel if split == 0 else sg._skinny_gemm_kernel
    # split -1 / -2: the qkv matmul with the QKRope epilogue (one head of 128 per tile), split 2 / 1, q/k norms or not
    rope = {"QK_ROPE": split < 0, "QK_NORM": split == -1, "NUM_HEADS": 16 if split < 0 else 0,
            "NUM_KV_HEADS": 8 if split < 0 else 0, "SPLIT_K": split if split > 0 else 2 if split == -1 else 1}
    consts = dict(PROLOGUE=prologue, HAS_BIAS=bool(bias), ACTIVATION=act, HAS_RESIDUAL=residual, FP32_DOT=dot,
                  BLOCK_M=bm, BLOCK_N=128 if split < 0 else 64, BLOCK_K=bk, STATS_BLOCK=16 * 512 // bm,
                  STATS_ITERS=2 if prologue in (1, 3) else 0, PDL=pdl, **(rope if split else {}))
    elem = "*fp32" if dot else "*bf16"
    sig = {n: elem if n.endswith("_ptr") else "fp32" if n.endswith("eps") else "i32" for n in kernel.arg_names}
    sig.update(part_ptr="*fp32", count_ptr="*i32", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64",
               **{c: "constexpr" for c in consts})
    sig = {n: t for n, t in sig.items() if n in kernel.arg_names}
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "num_stages": stages, "launch_pdl": pdl}).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl, consts  # PDL: the kernel waits for its predecessor
    assert waits_first(ptx) or not pdl, consts
print("compiled")
"""


def test_compiles_for_hopper() -> None:
    """The interpreter runs kernels as Python and misses what only the compiler rejects (a loop-carried variable
    that changes shape did once); compile each prologue for sm_90 here, no GPU needed (Triton's ptxas)."""
    compile_for_hopper(_COMPILE_FOR_HOPPER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # bfloat16: what the 0.6B serves in
@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize(("K", "cfg"), [
    (64, sg.GemmConfig(32, 32, 1)),  # one program per head
    (100, sg.GemmConfig(32, 32, 3)),  # split-K: the head's last program to finish runs the epilogue
    (96, sg.GemmConfig(16, 64, 2, programs=4)),  # another tuned shape: reshaped to one head per tile
])  # fmt: skip
def test_qk_rope_epilogue_matches_the_separate_kernel(dtype, norms, K, cfg) -> None:
    """The qkv matmul with the QKRope epilogue gives what the matmul and then fused_ops.qk_norm_rope_store give:
    q (normed, rotated) in the output's q columns, k and v at each token's slot of the pool, and nothing written for
    a padding token (slot -1)."""
    from tokenrouter.runner import fused_ops
    from tokenrouter.runner.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(K + norms)
    M, H, HKV, D = 5, 4, 2, 32
    N = (H + 2 * HKV) * D
    x, w = _randn(M, K, dtype=dtype, gen=gen), _randn(N, K, dtype=dtype, gen=gen) * 0.2
    norm_w = _randn(K, dtype=dtype, gen=gen)
    q_w, k_w = (_randn(D, dtype=dtype, gen=gen) if norms else None for _ in range(2))
    rope = RotaryEmbedding(D, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([3, 17, 0, 63, 40], device=DEVICE)
    slots = torch.tensor([7, 2, -1, 11, 5], device=DEVICE)  # (slot 0 is where a clamped -1 would land)
    caches = [torch.full((12, HKV, D), 9.0, dtype=dtype, device=DEVICE) for _ in range(4)]  # k, v: ref; k, v: ours
    ws = _workspace()
    qkv = sg.skinny_linear(x, w, ws, prologue="rms_norm", norm_weight=norm_w, eps=EPS,
                           config=sg.qk_rope_config(cfg, N, K, D))
    q_ref = fused_ops.qk_norm_rope_store(qkv, positions, rope.cos, rope.sin, q_w, k_w, EPS, caches[0], caches[1],
                                         slots, H, HKV, D)
    epi = sg.QKRope(positions, rope.cos, rope.sin, q_w, k_w, EPS, caches[2], caches[3], slots, H, HKV, D)
    out = sg.skinny_linear(x, w, ws, prologue="rms_norm", norm_weight=norm_w, eps=EPS, config=cfg, qk_rope=epi)
    # The matmuls are the same programs summed in the same order; only the epilogue's float32 arithmetic may contract
    # differently (an ulp before the rounding, which can then round the other way: one ulp of the stored dtype).
    tol = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.float16: {"rtol": 1e-3, "atol": 1e-3},
           torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3}}[dtype]
    torch.testing.assert_close(out[:, : H * D].reshape(M, H, D), q_ref, **tol)
    torch.testing.assert_close(caches[2], caches[0], **tol)
    torch.testing.assert_close(caches[3], caches[1], **tol)
    assert bool((caches[2][[0, 1, 3, 4, 6, 8, 9, 10]] == 9.0).all())  # slots no token maps to: untouched
    assert int(ws.counts.count_nonzero()) == 0


def test_qk_rope_rejects_what_it_cannot_do() -> None:
    x, w = torch.zeros(2, 32, device=DEVICE), torch.zeros(8 * 16, 32, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    cos = torch.zeros(4, 8, device=DEVICE)
    cache = torch.zeros(4, 2, 16, device=DEVICE)

    def epi(**kw):
        args = dict(positions=pos, cos=cos, sin=cos, q_norm_weight=None, k_norm_weight=None, eps=EPS, k_cache=cache,
                    v_cache=cache, slot_mapping=slots, num_heads=4, num_kv_heads=2, head_dim=16)
        return sg.QKRope(**{**args, **kw})

    with pytest.raises(ValueError, match="both q/k norms or neither"):
        sg.skinny_linear(x, w, qk_rope=epi(q_norm_weight=torch.ones(16, device=DEVICE)))
    with pytest.raises(ValueError, match="qkv width"):
        sg.skinny_linear(x, w, qk_rope=epi(num_heads=2))
    with pytest.raises(ValueError, match="no bias"):
        sg.skinny_linear(x, w, residual=torch.zeros(2, 128, device=DEVICE), qk_rope=epi())
    with pytest.raises(ValueError, match="must be \\[2\\]"):
        sg.skinny_linear(x, w, qk_rope=epi(positions=pos[:1]))


def test_table_decides_the_qk_rope_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the qkv matmul takes the QKRope epilogue where the table measured it no slower than the plain matmul
    plus the separate kernel (untuned: the separate kernel); off a GPU (no table: the interpreter) always. A tuned
    epilogue entry gives its config (one head per tile)."""
    n, k = 8 * 16, 32
    assert sg.qk_rope_pays(n, k, 4, torch.device("cpu"))
    _table(monkeypatch, {})
    assert not sg.qk_rope_pays(n, k, 4, DEVICE)  # a GPU without the entry
    rope_key = sg.table_key(n, k, 16, epilogue="qk_rope")
    assert rope_key == f"{n}x{k}x16:qk_rope" and sg.table_key(n, k, 16) == f"{n}x{k}x16"
    _table(monkeypatch, {rope_key: sg.TunedEntry(sg.GemmConfig(16, 16, 2), 3.0, 2.0)})
    assert not sg.qk_rope_pays(n, k, 4, DEVICE)
    _table(monkeypatch, {rope_key: sg.TunedEntry(sg.GemmConfig(16, 16, 2), 1.0, 2.0)})
    assert sg.qk_rope_pays(n, k, 4, DEVICE) and not sg.qk_rope_pays(n, k, 40, DEVICE)  # 40 rows: no entry
    assert sg._tuned(n, k, 4, DEVICE, torch.bfloat16, "qk_rope").config == sg.GemmConfig(16, 16, 2)


def test_workspace_holds_a_tuned_qk_rope_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuned epilogue entry may split K further than the plain matmul: the model's workspace is sized for the
    config the epilogue launches with (`qk_rope_config_for`), so a 16-way split of the qkv matmul fits."""
    n, k, d = 8 * 16, 256, 16
    rope_cfg = sg.GemmConfig(d, 16, 16)
    _table(monkeypatch, {sg.table_key(n, k, 16): sg.TunedEntry(sg.GemmConfig(32, 64, 1), 1.0, 2.0),
                         sg.table_key(n, k, 16, epilogue="qk_rope"): sg.TunedEntry(rope_cfg, 1.0, 2.0)})
    assert sg.qk_rope_config_for(n, k, 16, d, DEVICE) == rope_cfg  # one head per tile: kept as tuned
    need = sg._split_k_need(rope_cfg, 16, n, k)
    assert not sg.workspace_for([(n, k)], 16, DEVICE).fits(*need)  # the plain matmul's own needs: none
    assert sg.workspace_for([(n, k)], 16, DEVICE, qkv=(n, k, d)).fits(*need)
