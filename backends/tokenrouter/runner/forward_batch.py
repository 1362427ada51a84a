"""The tensors one forward pass needs, built once per step and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class ChunkSequence(Protocol):
    """What the runner reads of a request (the engine's `Sequence` is one): its tokens, how many already have
    KV, where that KV lives; it counts the tokens it runs for the request into `num_forwarded_tokens`."""

    token_ids: list[int]
    num_computed_tokens: int
    num_forwarded_tokens: int
    block_table: list[int]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class ScheduledChunk:
    """`num_new_tokens` of `seq`'s tokens, from `seq.num_computed_tokens` on, to run in one forward pass."""

    seq: ChunkSequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so the next token is sampled from it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class HostBatch:
    """A batch's index lists on the host, built once from the scheduled chunks (the eager path turns them into
    fresh tensors, the CUDA-graph path writes them into its static buffers)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    kv_lens: list[int]
    logits_indices: list[int]  # last token of every chunk that samples

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], block_size: int) -> HostBatch:
        b = cls([], [], [], [0], [], [])
        for c in chunks:
            seq, start, n = c.seq, c.seq.num_computed_tokens, c.num_new_tokens
            table = seq.block_table
            b.input_ids += seq.token_ids[start : start + n]
            b.positions += range(start, start + n)
            b.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
            b.cu_seqlens_q.append(len(b.input_ids))
            b.kv_lens.append(start + n)
            if c.samples:
                b.logits_indices.append(len(b.input_ids) - 1)
        return b


@dataclass
class ForwardBatch:
    """A mixed batch: each sequence contributes `q_len` new tokens on top of `kv_len - q_len` cached ones.

    Prefill (nothing cached), extend (k >= 1 known tokens appended to cached KV) and decode (one token)
    are the same operation with different lengths, so one batch can hold all three.
    """

    input_ids: torch.Tensor  # [T] int64, all sequences' new tokens back to back
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, KV pool slot each new token is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 (int64 in CUDA-graph batches)
    kv_lens: torch.Tensor  # [B] int32 (int64 in CUDA-graph batches), cached + new tokens
    logits_indices: torch.Tensor  # [S] int64, rows of the hidden states that need logits
    # Host copies of the lengths for backends that loop on the host (empty in CUDA-graph batches, whose
    # lengths only live on the device).
    q_lens_cpu: list[int] = field(default_factory=list)
    kv_lens_cpu: list[int] = field(default_factory=list)
    block_size: int = 16
    # Attention-backend-specific precomputation (e.g. per-sequence gather indices), set by `prepare`.
    attn_state: Any = None

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
