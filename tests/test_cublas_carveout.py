"""`cublas_sm_carveout`: a model's graphs captured through cuBLASLt with SMs carved out of its matmuls, only those of
bandwidth-bound size. On the CPU: which graphs, the runner's wiring, and what a torch cannot do. On the GPU:
the graphs replay and generate what the model generates eagerly, torch's process-wide BLAS settings are back as
they were after the capture, and a carve-out the GPU cannot give fails the model's start naming the setting.
The GPU tests are skipped without CUDA; on the GPU machine: `TRITON_INTERPRET=0 python -m pytest
tests/test_cublas_carveout.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_only_graphs_of_bandwidth_bound_size_are_carved() -> None:
    from tokenrouter.runner.cuda_graph import GraphShape, graph_shapes
    from tokenrouter.runner.model_runner import CARVEOUT_MAX_TOKENS, carves

    shapes = graph_shapes(64, 512, 64)
    carved = {s for s in shapes if carves(s)}
    # Every graph of up to 112 tokens (decode and short extends); none where compute binds the 32B's matmuls
    # on 84 SMs (128 tokens and more, prefills).
    assert {s for s in shapes if s.num_tokens <= 112} == carved and CARVEOUT_MAX_TOKENS == 112
    assert GraphShape(64, 64) in carved and GraphShape(112, 16) in carved
    assert GraphShape(128, 16) not in carved and GraphShape(192, 16) not in carved


def _engine(tiny_dir: Path, carveout: int, **kw):
    from tokenrouter import Engine

    # float32 (no TF32): cuBLASLt's and cuBLAS's kernels sum in different orders, which bf16 greedy tokens of a
    # random tiny model may tell apart; float32 keeps the comparison to what the setting changes.
    cfg = {"models": {"small": {"path": str(tiny_dir / "small"), "dtype": "float32", "device": "cuda:0",
                                "kv_cache_tokens": 16384, "cublas_sm_carveout": carveout, **kw}}}
    return Engine.from_config(cfg)


def test_the_runner_captures_graphs_of_up_to_112_tokens_carved(tiny_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: each graph's capture enters the carve-out the runner asks for it (on the CPU, where nothing is
    captured, through a capture that only enters each shape's context, and a recording carve-out)."""
    import contextlib

    from tokenrouter.config import ModelConfig
    from tokenrouter.runner import model_runner as mr
    from tokenrouter.runner.cuda_graph import CudaGraphRunner

    asked: list[int] = []

    @contextlib.contextmanager
    def recording(device: torch.device, carveout: int):
        asked.append(carveout)
        yield

    per_shape = {}

    def capture(self: CudaGraphRunner, context=None) -> None:
        for shape in sorted(self.shapes, reverse=True):
            with context(shape):
                per_shape[shape] = asked[-1]

    monkeypatch.setattr(mr, "carved_cublas", recording)
    monkeypatch.setattr(CudaGraphRunner, "capture", capture)
    monkeypatch.setattr(mr.ModelRunner, "cuda_graphs_possible", property(lambda self: True))
    cfg = ModelConfig(name="small", path=str(tiny_dir / "small"), dtype="float32", device="cpu",
                      kv_cache_tokens=1024, attention="triton", cuda_graph_max_batch=8, cuda_graph_max_tokens=256,
                      cublas_sm_carveout=48)
    mr.ModelRunner(cfg, default_kv_tokens=1024).setup_step(None)
    assert asked[0] == 48  # checked once before the first capture
    assert per_shape and {s.num_tokens for s in per_shape} >= {1, 8, 128, 192, 256}
    assert all(c == (48 if s.num_tokens <= 112 else 0) for s, c in per_shape.items()), per_shape


def test_what_this_torch_or_gpu_cannot_do_fails_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tokenrouter.runner.model_runner import carved_cublas

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA (and cuBLASLt): the CPU build is the one without")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    lib = torch.backends.cuda.preferred_blas_library()
    with pytest.raises(RuntimeError, match=r"cublas_sm_carveout: 48: .*cuBLASLt.*; set cublas_sm_carveout: 0"):
        with carved_cublas(torch.device("cuda:0"), 48):
            pass
    assert torch.backends.cuda.preferred_blas_library() == lib
    with pytest.raises(RuntimeError, match=r"cublas_sm_carveout: 132: the GPU has only 132 SMs"):
        with carved_cublas(torch.device("cuda:0"), 132):
            pass
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    with pytest.raises(RuntimeError, match=r"cublas_sm_carveout: 48: this torch .* has no SM carve-out; set"):
        with carved_cublas(torch.device("cuda:0"), 48):
            pass


@gpu
def test_carved_graphs_generate_what_eager_steps_do(tiny_dir: Path) -> None:
    from tokenrouter import SamplingParams

    lib, carve = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    eager = _engine(tiny_dir, 0, enforce_eager=True)
    prompts = [torch.randint(3, eager.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 64, 130)]
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    del eager
    carved = _engine(tiny_dir, 48)
    assert carved.runner.graphs is not None and carved.runner.graphs.graphs
    # The settings were the capture's only: the rest of the process runs as before.
    assert torch.backends.cuda.preferred_blas_library() == lib
    assert torch._C._get_sm_carveout_experimental() == carve
    assert [o.token_ids for o in carved.generate(prompts, params)] == expected
    assert carved.runner.graphs.num_replays > 0


@gpu
def test_a_carveout_of_every_sm_fails_naming_the_setting(tiny_dir: Path) -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(RuntimeError, match=rf"cublas_sm_carveout: {total}: the GPU has only {total} SMs"):
        _engine(tiny_dir, total)
