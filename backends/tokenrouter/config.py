"""Deployment config: YAML (or the same dict) -> validated dataclasses, parsed once.

Example::

    models:
      small: {path: models/tiny/small, dtype: float32, device: cpu}
    entry: small

Relative model paths resolve against the YAML file's folder (or the working directory for a dict);
`$VARS` and `~` expand.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A deployment config that cannot be served: the message names the offending key."""


DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class ModelConfig:
    """One model (one subserver): where its weights are, where it runs, and how its KV cache is sized."""

    name: str
    path: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    load_format: Literal["auto", "dummy"] = "auto"
    # Seed of the random weights when load_format is dummy.
    seed: int = 0
    # Context limit; None takes max_position_embeddings from config.json.
    max_model_len: int | None = None
    block_size: int = 16
    # KV pool size: an explicit token budget wins; otherwise, on CUDA, this model may use
    # kv_memory_fraction of the whole GPU for its weights plus its KV pool (models sharing a GPU split it:
    # their fractions must sum to <= 1); on the CPU, `cpu_kv_cache_tokens`.
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    # Attention backend: torch (exact, any device), triton (GPU kernels), auto (triton on CUDA when
    # the triton package is importable, else torch).
    attention: Literal["auto", "torch", "triton"] = "auto"
    # CUDA graphs (GPU with the triton attention backend): decode steps of up to cuda_graph_max_batch
    # sequences and extends of up to cuda_graph_max_tokens tokens (in steps of 16) replay captured graphs; 0 or
    # enforce_eager turns them off. Capture takes memory (one shared pool) and a few seconds at startup.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 64
    cuda_graph_max_tokens: int = 128
    max_num_seqs: int = 256
    # Token budget of one forward pass; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = 2048

    @property
    def gpu(self) -> int | None:
        """The index of the GPU this model is placed on (`cuda` means GPU 0), or None on the CPU."""
        if self.device == "cpu":
            return None
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def validate(self) -> None:
        where = f"models.{self.name}"
        if self.dtype not in DTYPES:
            raise ConfigError(f"{where}.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"{where}.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ConfigError(f"{where}.attention must be auto, torch or triton, got {self.attention!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"{where}.device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if not os.path.isdir(self.path):
            raise ConfigError(f"{where}.path: model directory {self.path!r} does not exist")
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"{where}.path: {self.path!r} has no config.json")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("cuda_graph_max_batch", "cuda_graph_max_tokens"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{where}.{key} must be an integer >= 0, got {v!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"{where}.enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"{where}.kv_cache_tokens must hold at least one block ({self.block_size})")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ConfigError(f"{where}.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"{where}.max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class BatchingConfig:
    """Delayed batching: a subserver steps once `thresholds[model]` requests are ready, or the oldest ready
    one waited `max_wait_ms`. `auto` re-solves thresholds from measured latencies and routing rates."""

    thresholds: dict[str, int] | int | str = 1
    max_wait_ms: float = 5.0
    # With thresholds: auto, how often the Markov-chain model is re-solved while serving.
    auto_interval_s: float = 2.0

    def validate(self, models: list[str]) -> None:
        t = self.thresholds
        if isinstance(t, str):
            if t != "auto":
                raise ConfigError(f"batching.thresholds must be an integer, a per-model mapping or 'auto', got {t!r}")
        elif isinstance(t, dict):
            unknown = sorted(set(t) - set(models))
            if unknown:
                raise ConfigError(f"batching.thresholds names unknown model(s) {unknown}; models: {models}")
            if any(not isinstance(v, int) or v < 1 for v in t.values()):
                raise ConfigError(f"batching.thresholds must be integers >= 1, got {t}")
        elif isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ConfigError(f"batching.thresholds must be >= 1, got {t!r}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"batching.max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.auto_interval_s <= 0:
            raise ConfigError(f"batching.auto_interval_s must be > 0, got {self.auto_interval_s}")

    def threshold_of(self, model: str) -> int:
        t = self.thresholds
        if isinstance(t, dict):
            return t.get(model, 1)
        return 1 if isinstance(t, str) else t


@dataclass
class EngineConfig:
    models: dict[str, ModelConfig]
    entry: str
    # Routing policy: {name: <registered policy>, ...its arguments}; default: everything stays on `entry`.
    policy: dict[str, Any] = field(default_factory=lambda: {"name": "always"})
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Tokenizer directory; defaults to the entry model's directory.
    tokenizer: str | None = None
    # KV pool size on the CPU when kv_cache_tokens is not given.
    cpu_kv_cache_tokens: int = 65536
    source: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if not self.models:
            raise ConfigError("'models' must name at least one model")
        if self.entry not in self.models:
            raise ConfigError(f"entry {self.entry!r} is not one of the models {sorted(self.models)}")
        for m in self.models.values():
            m.validate()
        if not isinstance(self.policy, dict) or not isinstance(self.policy.get("name"), str):
            raise ConfigError("'policy' must be a mapping with a 'name' (e.g. {name: r2r, threshold: 0.5})")
        self.batching.validate(list(self.models))
        self._validate_shared_devices()
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            hint = ""
            if os.path.basename(self.tokenizer).startswith("bench-tokenizer"):
                # Generated, not shipped (models/ is not in git): say how to make it.
                hint = f" (build it: tokenrouter make-bench-tokenizer --out {self.tokenizer} --vocab-size <vocab_size>)"
            raise ConfigError(f"tokenizer directory {self.tokenizer!r} does not exist{hint}")

    def _validate_shared_devices(self) -> None:
        """Models sized by memory fraction on one GPU split that GPU: their fractions may not add up past 1
        (each model checks only its own share when it loads, so an overcommit would surface as an out-of-memory
        error in whichever model loads last)."""
        shares: dict[str, list[ModelConfig]] = {}
        for m in self.models.values():
            if m.gpu is not None and m.kv_cache_tokens is None:
                shares.setdefault(f"cuda:{m.gpu}", []).append(m)
        for device, ms in shares.items():
            total = sum(m.kv_memory_fraction for m in ms)
            if len(ms) > 1 and total > 1.0 + 1e-9:
                parts = ", ".join(f"{m.name}: {m.kv_memory_fraction}" for m in ms)
                raise ConfigError(
                    f"models on {device} claim kv_memory_fraction {total:g} of it in total ({parts}); "
                    "the fractions of models sharing a GPU must sum to <= 1"
                )

    def policy_spec(self) -> tuple[str, dict[str, Any]]:
        """(policy name, its arguments); `always` without a model keeps everything on the entry model."""
        args = dict(self.policy)
        name = args.pop("name")
        if name == "always" and "model" not in args:
            args["model"] = self.entry
        return name, args

    @property
    def entry_model(self) -> ModelConfig:
        return self.models[self.entry]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.entry_model.path


def resolve_path(value: str, base: Path) -> str:
    """A config path as the config means it: `$VARS` and `~` expanded, relative ones against `base`."""
    expanded = os.path.expanduser(os.path.expandvars(str(value)))
    p = Path(expanded)
    return str(p if p.is_absolute() else (base / p).resolve())


def _build(cls: type, data: dict[str, Any], where: str, **fixed: Any) -> Any:
    """Dataclass from a dict, refusing keys the dataclass does not know."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} - set(fixed) - {"source"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) in {where}: {unknown}; known keys: {sorted(known)}")
    try:
        return cls(**fixed, **data)
    except TypeError as e:  # missing required key
        raise ConfigError(f"{where}: {e}") from None


def load_config(source: str | os.PathLike | dict[str, Any] | EngineConfig) -> EngineConfig:
    """Parse and validate a deployment config from a YAML path, a dict of the same shape, or pass one through."""
    if isinstance(source, EngineConfig):
        source.validate()
        return source
    if isinstance(source, dict):
        data, base, origin = dict(source), Path.cwd(), None
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        base, origin = path.resolve().parent, str(path)
    if not isinstance(data, dict):
        raise ConfigError("config must be a mapping with 'models' and 'entry'")
    data = dict(data)
    raw_models = data.pop("models", None)
    if not isinstance(raw_models, dict) or not raw_models:
        raise ConfigError("config needs 'models': a mapping of model name -> {path, dtype, device, ...}")
    models = {}
    for name, m in raw_models.items():
        m = dict(m or {})
        if "path" in m:
            m["path"] = resolve_path(m["path"], base)
        models[name] = _build(ModelConfig, m, f"models.{name}", name=str(name))
    if "entry" not in data and len(models) == 1:
        data["entry"] = next(iter(models))
    if "batching" in data:
        data["batching"] = _build(BatchingConfig, data["batching"] or {}, "batching")
    if isinstance(data.get("policy"), str):
        data["policy"] = {"name": data["policy"]}
    if data.get("tokenizer") is not None:
        data["tokenizer"] = resolve_path(data["tokenizer"], base)
    cfg = _build(EngineConfig, data, "config", models=models)
    cfg.source = origin
    cfg.validate()
    return cfg
