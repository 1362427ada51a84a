"""`num_sms`: a model's steps on a CUDA green context (its own share of the GPU's SMs). On the GPU: the runner
steps on the green context's stream, captures its graphs there, and generates what the model generates on the
whole GPU; a share the GPU cannot give fails the model's start naming the setting. Skipped without CUDA; run on
the GPU machine with `TRITON_INTERPRET=0 python -m pytest tests/test_green.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(tiny_dir: Path, num_sms: int):
    from tokenrouter import Engine

    cfg = {"models": {"small": {"path": str(tiny_dir / "small"), "dtype": "bfloat16", "device": "cuda:0",
                                "kv_cache_tokens": 16384, "num_sms": num_sms}}}
    return Engine.from_config(cfg)


def test_green_context_generates_the_same_tokens(tiny_dir: Path) -> None:
    from torch.cuda import green_contexts

    from tokenrouter import SamplingParams

    if not green_contexts.SUPPORTED:
        pytest.skip("this torch has no CUDA green contexts")
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    whole = _engine(tiny_dir, 0)
    prompts = [torch.randint(3, whole.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 64, 130)]
    expected = [o.token_ids for o in whole.generate(prompts, params)]
    del whole
    green = _engine(tiny_dir, 16)
    assert green.runner.green_context is not None and green.runner.graphs is not None
    assert green.runner.graphs.stream is green.runner.stream  # captured on the green context's stream
    assert [o.token_ids for o in green.generate(prompts, params)] == expected
    assert green.runner.graphs.num_replays > 0  # the captured graphs ran on the green context's stream


def test_more_sms_than_the_gpu_has_fails_naming_the_setting(tiny_dir: Path) -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(RuntimeError, match=rf"num_sms: {total + 8}: GPU 0 has only {total} SMs"):
        _engine(tiny_dir, total + 8)
