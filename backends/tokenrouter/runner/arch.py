"""The architecture of a decoder-only model, read from a Hugging Face config.json.

Qwen3 (q/k RMSNorm, no bias), Qwen2 (qkv bias) and Llama (optional attention bias, llama3 RoPE scaling)
share one code path; the differences are the flags below.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}


@dataclass(frozen=True)
class ArchConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str) -> ArchConfig:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        eos = _eos_ids(path, cfg)
        return cls.from_dict(cfg, eos)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ArchConfig:
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if family is None:
            family = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {sorted(SUPPORTED)}"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 writes RoPE settings under rope_parameters.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_token_ids or _as_tuple(cfg.get("eos_token_id")),
        )

    def weight_bytes(self, elem_size: int) -> int:
        """Bytes of all weights (what a decode step must read, the embedding counted once when tied)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return elem_size * (self.num_layers * per_layer + emb + self.hidden_size)


def _as_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, list | tuple) else (int(v),)


def _eos_ids(path: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json lists every end token (Qwen's chat models stop on two).
    gen = os.path.join(path, "generation_config.json")
    ids = _as_tuple(cfg.get("eos_token_id"))
    if os.path.isfile(gen):
        with open(gen) as f:
            ids = tuple(dict.fromkeys(ids + _as_tuple(json.load(f).get("eos_token_id"))))
    return ids


def declared_context_limit(config: Any) -> int:
    """The smallest context limit among a deployment's models, from its config alone (no weights loaded;
    a model's KV pool may lower its own limit further, which that model enforces)."""
    return min(m.max_model_len or ArchConfig.from_dir(m.path).max_position_embeddings for m in config.models.values())


def shared_vocab_size(config: Any) -> int:
    """The vocabulary size all of a deployment's models share, from their configs alone (no weights loaded);
    a ValueError when they differ: routed models hand each other token ids."""
    vocab = {n: ArchConfig.from_dir(m.path).vocab_size for n, m in config.models.items()}
    if len(set(vocab.values())) > 1:
        raise ValueError(f"routed models must share one vocabulary; vocab sizes: {vocab}")
    return next(iter(vocab.values()))
