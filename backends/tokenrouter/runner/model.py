"""Decoder-only transformer for the Qwen3 dense family (also Qwen2 and Llama configs) over a paged KV pool.

Module names follow Hugging Face's so checkpoints load by name; q/k/v and gate/up are packed into one
matmul each (the loader slices them in). With `fused=True` (the GPU path) the chains of small ops between
the matmuls run as Triton kernels (`fused_ops`): add + RMSNorm, qk-norm + RoPE + KV write, SiLU * up. That
takes a decode step from ~60 kernels per layer to ~9, which matters even inside a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenrouter.runner.arch import ArchConfig
from tokenrouter.runner.attention import AttentionBackend
from tokenrouter.runner.forward_batch import ForwardBatch
from tokenrouter.runner.layers import RMSNorm, RotaryEmbedding, SwiGLU

if TYPE_CHECKING:
    from tokenrouter.runner.skinny_gemm import QKRope, SplitKWorkspace


def layer_matmuls(arch: ArchConfig) -> list[tuple[str, int, int, str, bool]]:
    """A decoder layer's matmuls as `DecoderLayer.forward_stream` runs them: (name, N, K, prologue, residual)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    return [("qkv_proj", q + 2 * kv, h, "rms_norm", False), ("o_proj", h, q, "none", True),
            ("gate_up_proj", 2 * inter, h, "rms_norm", False), ("down_proj", h, inter, "silu_mul", True)]


def layer_shapes(arch: ArchConfig) -> list[tuple[int, int]]:
    """(N, K) of a layer's matmuls: what the skinny-matmul table is keyed by."""
    return [(n, k) for _, n, k, _, _ in layer_matmuls(arch)]


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.eps = arch.rms_norm_eps
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
        qkv = self.qkv_proj(x)
        if self.fused:
            return self.o_proj(self.attend(qkv, batch, rope, backend))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(batch.positions, q, k)
        backend.store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        o = backend.forward(q, self.k_cache, self.v_cache, batch, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))

    def qk_rope(self, batch: ForwardBatch, rope: RotaryEmbedding) -> QKRope:
        """The qkv matmul's epilogue that does `attend`'s q/k norm, RoPE and KV write (skinny path; whether this
        layer takes it, `CausalLM.forward` decides)."""
        from tokenrouter.runner.skinny_gemm import QKRope

        q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
        return QKRope(batch.positions, rope.cos, rope.sin, None if q_norm is None else q_norm.weight,
                      None if k_norm is None else k_norm.weight, self.eps, self.k_cache, self.v_cache,
                      batch.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)

    def attend(
        self, qkv: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, backend: AttentionBackend,
        roped: bool = False,
    ) -> torch.Tensor:  # [T, Hq * D], the input of o_proj
        """The fused path between qkv_proj and o_proj: q/k norm, RoPE and the KV write in one kernel, then
        attention. `roped`: the qkv matmul's epilogue did the first part already (`qk_rope`); q is read in place."""
        from tokenrouter.runner import fused_ops

        if roped:
            q = qkv[:, : self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim)
        else:
            q = fused_ops.qk_norm_rope_store(
                qkv, batch.positions, rope.cos, rope.sin,
                self.q_norm.weight if hasattr(self, "q_norm") else None,
                self.k_norm.weight if hasattr(self, "k_norm") else None,
                self.eps, self.k_cache, self.v_cache, batch.slot_mapping,
                self.num_heads, self.num_kv_heads, self.head_dim,
            )  # fmt: skip
        o = backend.forward(q, self.k_cache, self.v_cache, batch, self.scale)
        return o.reshape(qkv.shape[0], self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, fused: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(arch, fused)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size, fused)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)

    def forward(self, h, residual, batch, rope, backend):
        # The residual stream travels beside h so that each norm also does the preceding residual add.
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, batch, rope, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_stream(
        self,
        stream: torch.Tensor,  # [T, hidden] residual stream: the previous layer's output plus its residual
        batch: ForwardBatch,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        workspace: SplitKWorkspace,
        qk_rope: bool = False,
    ) -> torch.Tensor:  # the next residual stream
        """The layer for a few tokens: four skinny matmuls with the norms, q/k-norm + RoPE + the KV write,
        SwiGLU's activation and the residual adds fused into them, so the layer is six kernels (attention's split
        and reduce included; seven without the qkv epilogue, `qk_rope` False; eleven on cuBLAS). Same roundings as
        `forward`: the stream is what `forward`'s norms compute as x + residual."""
        from tokenrouter.runner.skinny_gemm import skinny_linear

        attn, mlp = self.self_attn, self.mlp
        qkv = skinny_linear(stream, attn.qkv_proj.weight, workspace, prologue="rms_norm",
                            norm_weight=self.input_layernorm.weight, eps=self.input_layernorm.eps,
                            qk_rope=attn.qk_rope(batch, rope) if qk_rope else None)
        o = attn.attend(qkv, batch, rope, backend, roped=qk_rope)
        stream = skinny_linear(o, attn.o_proj.weight, workspace, residual=stream)
        gate_up = skinny_linear(stream, mlp.gate_up_proj.weight, workspace, prologue="rms_norm",
                                norm_weight=self.post_attention_layernorm.weight,
                                eps=self.post_attention_layernorm.eps)
        return skinny_linear(gate_up, mlp.down_proj.weight, workspace, prologue="silu_mul", residual=stream)


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, fused) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)


class CausalLM(nn.Module):
    """`forward` returns the final-norm hidden states of every new token; `compute_logits` projects rows."""

    def __init__(self, arch: ArchConfig, max_positions: int, fused: bool = False) -> None:
        super().__init__()
        self.arch = arch
        self.fused = fused
        self.model = DecoderModel(arch, max_positions, fused)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

        # Split-K scratch of the skinny matmuls; set by `use_skinny_gemm`, None keeps every batch on cuBLAS.
        self.workspace: SplitKWorkspace | None = None
        self.skinny_max_m = 0
        # (N, K, head_dim) of the qkv matmul where its layers can take the QKRope epilogue; set by `use_skinny_gemm`.
        self.qk_rope_qkv: tuple[int, int, int] | None = None
        # Why `use_skinny_gemm` kept the matmuls on cuBLAS, in words for the log ("" when it did not).
        self.skinny_off = ""

    def use_skinny_gemm(self, device: torch.device) -> bool:
        """Route batches of up to `skinny_max_m` tokens (skinny_gemm.max_rows: what the tuned table measured faster
        on this device, for the weights' dtype) through `DecoderLayer.forward_stream` (fused path only; that path
        passes no q/k/v bias). Returns whether it did."""
        if not self.fused or self.arch.qkv_bias:
            self.skinny_off = "q/k/v biases (the skinny layer has none)" if self.fused else "the unfused (torch) path"
            return False
        from tokenrouter.runner import skinny_gemm

        shapes = layer_shapes(self.arch)
        dtype = self.model.embed_tokens.weight.dtype  # float32 weights have table entries (and kernels) of their own
        self.skinny_max_m = skinny_gemm.max_rows(shapes, device, dtype)
        if self.skinny_max_m == 0:
            self.skinny_off = skinny_gemm.cublas_reason(shapes, device, dtype)
            return False
        a = self.arch
        if skinny_gemm.QKRope.supports(a.head_dim, a.qk_norm, a.qk_norm):
            self.qk_rope_qkv = (shapes[0][0], shapes[0][1], a.head_dim)
        self.workspace = skinny_gemm.workspace_for(shapes, self.skinny_max_m, device, dtype, self.qk_rope_qkv)
        return True

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(batch.input_ids)
        if self.workspace is not None and h.shape[0] <= self.skinny_max_m:
            from tokenrouter.runner.skinny_gemm import qk_rope_pays

            # Decided once a step: every layer has the same qkv shape.
            qk = self.qk_rope_qkv
            qk_rope = qk is not None and qk_rope_pays(qk[0], qk[1], h.shape[0], h.device, h.dtype)
            for layer in self.model.layers:
                h = layer.forward_stream(h, batch, self.model.rotary_emb, backend, self.workspace, qk_rope)
            return self.model.norm(h)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch, self.model.rotary_emb, backend)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Computed in the model's dtype and widened: the r2r policy takes the top k back in that dtype, exactly.
        return torch.nn.functional.linear(hidden, weight).float()

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k, v in zip(self.model.layers, k_caches, v_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
