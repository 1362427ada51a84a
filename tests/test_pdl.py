"""Programmatic dependent launch (runner/pdl.py): off where it cannot work, and on a Hopper GPU the same results bit
for bit as without it, eagerly and in CUDA graphs (kernels overlapping their predecessors must still see every
write before theirs: the split-K counters and partials one launch leaves for the next, the KV pool, the residual
stream). The GPU cases run on the GPU machine: `TRITON_INTERPRET=0 python -m pytest tests/test_pdl.py`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def _pdl():
    """The module as imported now: a kernel test module that switches to the interpreter (triton_interpreter.py)
    re-imports it, so a reference taken at collection could be a stale one."""
    from tokenrouter.runner import pdl

    return pdl


def _need_hopper():
    """pdl, on a Hopper GPU with compiled kernels and a Triton that launches with PDL; else the test skips (decided
    when the test runs: another module may have switched Triton to its interpreter since collection)."""
    pdl = _pdl()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    if pdl._interpreted() or not pdl._triton_has_pdl():
        pytest.skip("needs compiled kernels and a Triton with the launch_pdl option")
    return pdl


def test_off_where_it_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    pdl = _pdl()
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu)
    assert pdl.launch_args(cpu) == {"PDL": False}  # no launch_pdl option: the interpreter has no such launch
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}  # TOKENROUTER_PDL=0, before any device query


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("False", False), ("1", True), ("", True)])
def test_environment_turns_it_off(value: str, on: bool) -> None:
    import subprocess
    import sys

    code = "from tokenrouter.runner import pdl; print(pdl.ENABLED)"
    env = {**os.environ, "TOKENROUTER_PDL": value}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == str(on)


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor, workspace, configs) -> torch.Tensor:
    """A decoder-like chain of dependent skinny matmuls sharing one split-K workspace: a normed matmul, then a
    residual one, over and over (each launch reads what the one before wrote)."""
    from tokenrouter.runner.skinny_gemm import skinny_linear

    stream = x
    for i in range(0, len(weights), 2):
        h = skinny_linear(stream, weights[i], workspace, prologue="rms_norm", norm_weight=norm, eps=1e-6,
                          config=configs[0])
        stream = skinny_linear(h, weights[i + 1], workspace, residual=stream, config=configs[1])
    return stream


@pytest.mark.parametrize("rows", [1, 8])
def test_skinny_chain_same_with_and_without_pdl(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    pdl = _need_hopper()
    from tokenrouter.runner import skinny_gemm as sg

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden, inter = 1024, 3072
    weights = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) / k**0.5
               for _ in range(12) for n, k in ((inter, hidden), (hidden, inter))]
    norm = torch.rand(hidden, device=dev, generator=g, dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, hidden, device=dev, generator=g, dtype=torch.bfloat16)
    # split-K on both, so consecutive launches hand the same counters and partials to each other
    configs = (sg.GemmConfig(64, 128, 4), sg.GemmConfig(32, 128, 8))
    workspace = sg.SplitKWorkspace(dev, 8 * rows * inter, 128)

    monkeypatch.setattr(pdl, "ENABLED", False)
    ref = _chain(x, weights, norm, workspace, configs)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(dev)
    assert torch.equal(_chain(x, weights, norm, workspace, configs), ref)  # eager
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(x, weights, norm, workspace, configs)  # compile outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = _chain(x, weights, norm, workspace, configs)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    assert int(workspace.counts.count_nonzero()) == 0


def test_model_same_with_and_without_pdl(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    """The tiny model's decode and extend steps through graphs and eagerly (fused ops, attention's split and
    reduce, qk-norm + RoPE + KV write, all launched with PDL): the same logits and KV pool bit for bit."""
    from tokenrouter.config import ModelConfig
    from tokenrouter.engine.block_manager import BlockManager
    from tokenrouter.engine.sequence import Sequence
    from tokenrouter.runner.forward_batch import ScheduledChunk
    from tokenrouter.runner.model_runner import ModelRunner
    from tokenrouter.sampling_params import SamplingParams

    pdl = _need_hopper()
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        cfg = ModelConfig(name="small", path=str(tiny_dir / "small"), dtype="bfloat16", device="cuda:0",
                          kv_cache_tokens=16384)
        runner = ModelRunner(cfg, default_kv_tokens=0)
        runner.setup_step(None)
        assert runner.graphs is not None
        bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        g = torch.Generator().manual_seed(3)
        seqs = [Sequence(f"r{i}", torch.randint(3, 200, (n,), generator=g).tolist(), n, SamplingParams())
                for i, n in enumerate((5, 40, 130, 17))]
        logits = []
        for new in ("prefill", 1, 1, 3, 1):  # prefill (eager), decodes and an extend (graphs)
            chunks = []
            for s in seqs:
                if new != "prefill":
                    s.token_ids += torch.randint(3, 200, (new,), generator=g).tolist()
                assert bm.ensure(s, s.num_tokens)
                chunks.append(ScheduledChunk(s, s.num_tokens - s.num_computed_tokens))
            logits.append(runner.forward(chunks).logits.clone())
            for c in chunks:
                c.seq.num_computed_tokens += c.num_new_tokens
        torch.cuda.synchronize()
        results.append((logits, runner.kv_cache.clone()))
        for s in seqs:
            bm.release(s)
        del runner
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_interpreter_in_any_spelling_keeps_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Triton reads TRITON_INTERPRET as a boolean: under its interpreter, which has no grid-dependency ops, no
    kernel may be launched with PDL, however the variable is spelt."""
    pdl = _pdl()
    monkeypatch.setenv("TRITON_INTERPRET", value)
    pdl._interpreted.cache_clear()  # (asked once per process otherwise)
    assert pdl._interpreted()
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda device: True)
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.undo()
    pdl._interpreted.cache_clear()


_EVERY_KERNEL_WAITS_FIRST = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import fused_ops as f, skinny_gemm as sg, triton_attention as ta

# Every kernel the runner launches, each with the constexprs of one layer of a Qwen3-0.6B-like model.
KERNELS = [
    (f._rms_norm_kernel, dict(N=1024, BLOCK=1024)),
    (f._add_rms_norm_kernel, dict(N=1024, BLOCK=1024)),
    (f._qk_norm_rope_store_kernel, dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HQ_PAD=16, HKV_PAD=8, HALF_PAD=64,
                                        HAS_Q_NORM=True, HAS_K_NORM=True)),
    (f._silu_mul_kernel, dict(INTER=3072, BLOCK=1024)),
    (f._layer_norm_dot_kernel, dict(N=1024, BLOCK=1024)),
    (ta._decode_split_kernel, dict(NUM_HEADS=16, HEAD_DIM=128, D_PAD=128, GROUP=2, GROUP_PAD=16, PAGE=16, BLOCK_N=64,
                                   DIRECT_OUT=False)),
    (ta._decode_reduce_kernel, dict(NUM_HEADS=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, SPLITS_PAD=4)),
    (ta._extend_kernel, dict(HEAD_DIM=128, D_PAD=128, GROUP=2, PAGE=16, BLOCK_M=64, BLOCK_N=64, Q_PER_PROG=32,
                             SKIP_DECODE=True, SPLIT=True)),
    (ta._extend_reduce_kernel, dict(HEAD_DIM=128, D_PAD=128, GROUP=2, GROUP_PAD=2, SPLITS_PAD=16, Q_PER_PROG=32,
                                    BLOCK_N=64, SKIP_DECODE=True)),
    # (the qkv matmul with its QKRope epilogue: one head of 128 per tile)
    (sg._skinny_gemm_kernel, dict(PROLOGUE=1, HAS_BIAS=False, ACTIVATION=0, HAS_RESIDUAL=False, FP32_DOT="", BLOCK_M=16,
                                  BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, STATS_BLOCK=512, STATS_ITERS=2, QK_ROPE=True,
                                  QK_NORM=True, NUM_HEADS=16, NUM_KV_HEADS=8)),
    (sg._stream_k_gemm_kernel, dict(PROLOGUE=2, HAS_BIAS=False, ACTIVATION=0, HAS_RESIDUAL=True, FP32_DOT="",
                                    BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, STATS_BLOCK=512, STATS_ITERS=0)),
]
POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "mid_o_ptr": "*fp32",
            "mid_lse_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32", "block_tables_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32", "kv_lens_ptr": "*i32"}
MEMORY = ("ld.global", "st.global", "atom.", "red.", "cp.async")
found = {v.fn.__name__ for m in (f, sg, ta) for v in vars(m).values()
         if type(v).__name__ == "JITFunction" and v.fn.__name__.endswith("_kernel")}
assert found == {k.fn.__name__ for k, _ in KERNELS}, found  # a new kernel must be listed here
for kernel, consts in KERNELS:
    consts = {**consts, "PDL": True}
    assert {p.name for p in kernel.params if p.is_constexpr} == set(consts), kernel.fn.__name__
    sig = {n: POINTERS.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n in ("eps", "rope_eps", "sm_scale_log2")
           else "i32"
           for n in kernel.arg_names}
    sig.update({c: "constexpr" for c in consts})
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 2, "launch_pdl": True}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    first = min(i for i in (body.find(op) for op in MEMORY) if i >= 0)
    assert body.count("griddepcontrol.wait") == 1 and body.index("griddepcontrol.wait") < first, kernel.fn.__name__
print("compiled")
"""


def test_every_kernel_waits_before_touching_memory() -> None:
    """The PDL rule, checked where it matters, in the compiled code: each of the runner's Triton kernels, launched
    with PDL, has its one grid-dependency wait before its first global load, store or atomic (compiled for sm_90 on
    the CPU with Triton's ptxas). A kernel added to those modules fails here until it is listed, with its wait."""
    from triton_interpreter import compile_for_hopper

    compile_for_hopper(_EVERY_KERNEL_WAITS_FIRST)
