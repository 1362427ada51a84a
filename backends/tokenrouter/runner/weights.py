"""Weights: Hugging Face safetensors (single file or sharded index) or seeded random ("dummy")."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from tokenrouter.runner.model import CausalLM

# Checkpoint projection -> (packed module, shard index): q/k/v and gate/up are stored packed here.
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r} (use load_format: dummy for random)")
    return [os.path.join(path, f) for f in files]


def _shard_rows(model: CausalLM, module: str, shard: int) -> tuple[int, int]:
    a = model.arch
    if module == "qkv_proj":
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
    else:
        sizes = [a.intermediate_size, a.intermediate_size]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


@torch.no_grad()
def load_safetensors(model: CausalLM, path: str) -> None:
    """Copy every checkpoint tensor into its (possibly packed) parameter; fail on anything missing."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # parameter -> rows (or 1) filled, to detect missing shards
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                tensor = f.get_tensor(name)
                m = _PACKED_RE.search(name)
                if m:
                    module, shard = _PACKED[m.group(1)]
                    target = name[: m.start()] + f".{module}.{m.group(2)}"
                    if target not in params:
                        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                    lo, hi = _shard_rows(model, module, shard)
                    _copy(params[target].data[lo:hi], tensor, name)
                    filled[target] = filled.get(target, 0) + (hi - lo)
                else:
                    if name not in params:
                        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                    _copy(params[name].data, tensor, name)
                    filled[name] = params[name].shape[0]
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint in {path!r} lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights of the right shapes (for benchmarks: figures depend on shapes, not values)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.uniform_(-0.02, 0.02, generator=gen)
