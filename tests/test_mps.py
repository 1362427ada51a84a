"""CUDA MPS helpers (serving/mps.py): which models share a GPU, and a process's SM share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenrouter.config import load_config
from tokenrouter.serving import mps


def test_models_on_one_gpu_are_shared(tiny_dir) -> None:
    small, large = str(tiny_dir / "small"), str(tiny_dir / "large")
    cfg = load_config({"models": {"small": {"path": small, "device": "cuda:0", "kv_memory_fraction": 0.2},
                                  "large": {"path": large, "device": "cuda:0", "kv_memory_fraction": 0.7,
                                            "sm_percent": 50}},
                       "entry": "small", "policy": "random"})
    assert mps.shared_gpus(cfg) == {0: ["small", "large"]}
    cfg.models["large"].device = "cuda:1"
    assert mps.shared_gpus(cfg) == {}


def test_limit_sms_sets_the_client_percentage_before_cuda() -> None:
    """In a fresh process (no CUDA context yet) the percentage lands in the environment the driver reads."""
    code = ("import os; from tokenrouter.serving import mps; mps.limit_sms(35); "
            "print(os.environ[mps.THREAD_PERCENTAGE])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "35"


def test_limit_sms_refuses_once_cuda_is_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv(mps.THREAD_PERCENTAGE, raising=False)
    with pytest.raises(RuntimeError, match="initialized CUDA already"):
        mps.limit_sms(50)
    assert mps.THREAD_PERCENTAGE not in os.environ
