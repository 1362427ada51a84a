"""TokenRouter: token-level LLM routing served as NVIDIA Triton Inference Server models."""

from tokenrouter.config import ConfigError, EngineConfig, ModelConfig, load_config
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.outputs import RequestOutput
from tokenrouter.sampling_params import SamplingParams

__all__ = ["ConfigError", "Engine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams", "load_config"]
__version__ = "0.1.0"
