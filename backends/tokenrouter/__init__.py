"""TokenRouter: token-level LLM routing served as NVIDIA Triton Inference Server models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenrouter.config import ConfigError, EngineConfig, ModelConfig, load_config
    from tokenrouter.engine.engine import Engine
    from tokenrouter.engine.outputs import RequestOutput
    from tokenrouter.sampling_params import SamplingParams

__all__ = ["ConfigError", "Engine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams", "load_config"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): a process that needs one light module (the threshold solve's child process,
# engine/autotune.py) would otherwise import torch and the whole engine first, ~2 s per solve.
_EXPORTS = {
    "ConfigError": "tokenrouter.config",
    "EngineConfig": "tokenrouter.config",
    "ModelConfig": "tokenrouter.config",
    "load_config": "tokenrouter.config",
    "Engine": "tokenrouter.engine.engine",
    "RequestOutput": "tokenrouter.engine.outputs",
    "SamplingParams": "tokenrouter.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenrouter' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
