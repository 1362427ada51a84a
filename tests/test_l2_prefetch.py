"""The weights' L2 prefetch (runner/l2_prefetch.py): each matmul's weight is asked for `distance` matmuls before it
runs, only while a CUDA graph is captured, only for weights that fit the L2; the kernel compiles to prefetch
instructions and nothing else; and on a GPU the captured steps give the same results bit for bit with it and without.
The GPU case runs on the GPU machine: `TRITON_INTERPRET=0 python -m pytest tests/test_l2_prefetch.py`."""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET, compile_for_hopper  # first: before anything here imports triton
# isort: on

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from test_cuda_graph_runner import _Driver, _runner  # noqa: E402
from tokenrouter.runner import l2_prefetch  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import l2_prefetch

for evict_last, op in ((True, "prefetch.global.L2::evict_last ["), (False, "prefetch.global.L2 [")):
    k = l2_prefetch._prefetch_kernel
    consts = {"LINES": 1024, "LINE": 128, "EVICT_LAST": evict_last}
    sig = {"base": "i64", "num_lines": "i32", **{c: "constexpr" for c in consts}}
    ptx = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    # one prefetch per line a thread owns (1024 lines / 128 threads), kept although its result is unused
    assert body.count(op) == 8, (evict_last, body.count(op))
    for moves in ("ld.global", "st.global", "atom.", "cp.async"):
        assert moves not in body, moves  # it asks the cache for lines and moves no data
print("compiled")
"""


def test_compiles_to_prefetches_only() -> None:
    compile_for_hopper(_COMPILE)


class _Recorder(l2_prefetch.WeightPrefetcher):
    """Records which weight it asks for instead of launching, as if a graph were being captured."""

    def __init__(self, weights, log, capturing: bool = True, distance: int = 1) -> None:
        super().__init__(weights, torch.device("cpu"), distance=distance)
        self.log, self.capturing = log, capturing

    def _capturing(self) -> bool:
        return self.capturing

    def _issue(self, j: int) -> None:
        self.log.append(("ask", j))


def _skinny_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """The tiny model with every decode on the skinny path (it is in no tuned table), the prefetch on."""
    monkeypatch.setattr(l2_prefetch, "MODE", "last")
    monkeypatch.setattr(sg, "max_rows", lambda shapes, device, dtype=None: sg.MAX_M)
    monkeypatch.setattr(sg, "config_for", lambda n, k, m, device, dtype=None: sg.GemmConfig(16, 16, 1))
    return _runner(tiny_dir)


@pytest.mark.parametrize("distance", [1, 2])
def test_each_weight_is_asked_for_before_its_matmul(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    distance: int) -> None:
    runner = _skinny_model(tiny_dir, monkeypatch)
    model = runner.model
    weights = [w for layer in model.model.layers for w in layer.matmul_weights()]
    log: list[tuple[str, int]] = []
    model.prefetcher = _Recorder(weights, log, distance=distance)
    real = sg.skinny_linear

    def recorded(x, weight, *a, **kw):
        log.append(("matmul", next(i for i, w in enumerate(weights) if w is weight)))
        return real(x, weight, *a, **kw)

    monkeypatch.setattr(sg, "skinny_linear", recorded)
    drv = _Driver(runner, [[5, 6, 7], [8, 9]])
    drv.step([[], []])  # the prompts (5 tokens: the skinny path too)
    log.clear()
    drv.step([[11], [12]])  # a decode
    n = len(weights)
    want = [("ask", j) for j in range(distance)]
    for j in range(n):
        if j + distance < n:
            want.append(("ask", j + distance))
        want.append(("matmul", j))
    assert log == want
    assert not model.prefetcher._active  # the pass ended with join
    drv.release()


def test_nothing_asked_for_outside_a_capture(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _skinny_model(tiny_dir, monkeypatch)
    weights = [w for layer in runner.model.model.layers for w in layer.matmul_weights()]
    log: list[tuple[str, int]] = []
    runner.model.prefetcher = _Recorder(weights, log, capturing=False)
    drv = _Driver(runner, [[5, 6, 7]])
    drv.step([[]])
    drv.step([[9]])
    assert log == []
    monkeypatch.setattr(l2_prefetch, "MODE", "off")  # and off, even while capturing
    runner.model.prefetcher = _Recorder(weights, log)
    drv.step([[10]])
    assert log == []
    drv.release()


def test_only_weights_that_fit_the_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    def meta(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")

    small = [meta(4096, 1024), meta(1024, 2048), meta(6144, 1024), meta(1024, 3072)]  # Qwen3-0.6B's layer
    large = [meta(10240, 5120), meta(5120, 8192), meta(51200, 5120), meta(5120, 25600)]  # Qwen3-32B's
    assert not l2_prefetch.fits(small, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(L2_cache_size=50 << 20))
    cuda = torch.device("cuda", 0)
    assert l2_prefetch.fits(small, cuda)
    assert not l2_prefetch.fits(large, cuda)
    assert not l2_prefetch.fits(small[:2] + [meta(9216, 1024)], cuda)  # 18 MiB: over a third of 50 MiB
    with pytest.raises(ValueError, match="distance"):
        l2_prefetch.WeightPrefetcher(small, cuda, distance=0)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU and compiled kernels")
def test_captured_steps_equal_without_prefetch(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs captured with the prefetch forks replay to the same logits, hidden states and KV, bit for bit."""
    with_pf = _skinny_model(tiny_dir, monkeypatch)
    with_pf.setup_step(None)
    assert with_pf.model.prefetcher is not None and with_pf.graphs is not None and with_pf.graphs.graphs
    monkeypatch.setattr(l2_prefetch, "MODE", "off")
    without = ModelRunner(dataclasses.replace(with_pf.cfg), default_kv_tokens=1024)
    without.setup_step(None)
    assert without.model.prefetcher is None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, with_pf.arch.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    a, b = _Driver(with_pf, prompts), _Driver(without, prompts)
    for toks in ([[], [], []], [[5], [6], [7]], [[8, 9], [10], [11, 12, 13]], [[14], [15], [16]]):
        ours, ref = a.step(toks), b.step(toks)
        for x, y in zip(ours, ref):
            assert (x is None and y is None) or torch.equal(x, y)  # (step values: None without a step hook)
    assert torch.equal(with_pf.kv_cache, without.kv_cache)
    a.release()
    b.release()
