"""Attention over the paged KV pool, behind one interface so the GPU kernels can replace the torch path."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from tokenrouter.runner.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Writes new K/V into the pool and attends the new queries over each sequence's whole context."""

    name: str = ""
    # Whether `graph_state` exists: the backend's launches depend only on shapes fixed per graph, not on
    # host-side lengths, so a forward pass through it can be captured in a CUDA graph.
    supports_cuda_graphs: bool = False

    def prepare(self, batch: ForwardBatch) -> None:
        """Precompute per-batch state once, before the layers run (layers share it)."""

    def precompile(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                   scale: float) -> int:
        """Compile, without running, every kernel variant a forward pass over batches like `batch` can launch
        (a backend whose kernels compile on first use); returns how many it compiled or found compiled."""
        return 0

    def graph_context_bounds(self, max_model_len: int) -> list[int]:
        """Context bounds below `max_model_len` worth a graph of their own: batches whose every context is within
        one replay a graph whose launch (`graph_state` with that bound) is cheaper. None by default."""
        return []

    def graph_state(self, num_seqs: int, num_tokens: int, has_extend: bool, max_kv_len: int,
                    min_tokens: int = 1) -> Any:
        """Launch state for every batch that a CUDA graph of this shape will replay (lengths unknown on the
        host: only bounds; `min_tokens`: the fewest new tokens such a batch has). Set as `batch.attn_state`
        instead of calling `prepare`."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in a CUDA graph")

    @staticmethod
    def store_kv(
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class TorchAttention(AttentionBackend):
    """Reference path on any device: gather each sequence's context and call SDPA. Exact, not fast."""

    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        bs = batch.block_size
        offsets = torch.arange(bs, device=batch.block_tables.device)
        gathers = []
        for i, kv_len in enumerate(batch.kv_lens_cpu):
            nblk = -(-kv_len // bs)
            blocks = batch.block_tables[i, :nblk].long()
            gathers.append((blocks[:, None] * bs + offsets).flatten()[:kv_len])
        batch.attn_state = gathers

    def forward(self, q, k_cache, v_cache, batch, scale):
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens_cpu, batch.kv_lens_cpu)):
            slots = batch.attn_state[i]
            qi = q[start : start + q_len].transpose(0, 1)  # [Hq, q, D]
            ki = k_cache[slots].transpose(0, 1)  # [Hkv, kv, D]
            vi = v_cache[slots].transpose(0, 1)
            mask = None
            if q_len > 1:
                # Query j sits at absolute position kv_len - q_len + j and sees keys up to it.
                qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)
                mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]
            if ki.shape[0] != qi.shape[0]:
                # Expanding K/V to every query head is much faster on the CPU than SDPA's enable_gqa path.
                group = qi.shape[0] // ki.shape[0]
                ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start : start + q_len] = oi.transpose(0, 1)
            start += q_len
        return out


BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def get_backend(name: str) -> AttentionBackend:
    if name == "triton" and name not in BACKENDS:
        # Imported on demand: triton is only needed where its kernels run (GPU, or the interpreter in CI).
        from tokenrouter.runner.triton_attention import TritonAttention

        BACKENDS[name] = TritonAttention
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS | {'triton': None})}")
    return BACKENDS[name]()
