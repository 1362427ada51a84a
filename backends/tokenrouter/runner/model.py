"""Decoder-only transformer for the Qwen3 dense family (also Qwen2 and Llama configs) over a paged KV pool.

Module names follow Hugging Face's so checkpoints load by name; q/k/v and gate/up are packed into one
matmul each (the loader slices them in).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenrouter.runner.arch import ArchConfig
from tokenrouter.runner.attention import AttentionBackend
from tokenrouter.runner.forward_batch import ForwardBatch
from tokenrouter.runner.layers import RMSNorm, RotaryEmbedding, SwiGLU


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        # Views into the shared KV pool, bound by the runner after it sizes the pool.
        self.k_cache: torch.Tensor | None = None  # [num_slots, Hkv, D]
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        batch: ForwardBatch,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(batch.positions, q, k)
        backend.store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        o = backend.forward(q, self.k_cache, self.v_cache, batch, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, h, batch, rope, backend):
        h = h + self.self_attn(self.input_layernorm(h), batch, rope, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)


class CausalLM(nn.Module):
    """`forward` returns the final-norm hidden states of every new token; `compute_logits` projects rows."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, max_positions)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            h = layer(h, batch, self.model.rotary_emb, backend)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k, v in zip(self.model.layers, k_caches, v_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
