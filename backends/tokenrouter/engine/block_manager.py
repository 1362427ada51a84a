"""KV block accounting: ref-counted blocks, per-sequence block tables, hash-chained prefix caching.

Only counts; the tensors live in the runner's KV pool. A block whose ref count drops to 0 goes back to
the free list but keeps its hash, so a later prompt with the same prefix can take it back until the block
is handed out for something else (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from tokenrouter.engine.sequence import Sequence


def block_hash(prev: bytes, tokens: list[int]) -> bytes:
    """Chain hash of a full block: it depends on every token before it, not only its own."""
    return hashlib.blake2b(prev + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # Tokens of each hashed block, to confirm a hash hit by comparison.
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks in the order they were freed (ordered dict: O(1) removal when a cached one is revived).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_tokens(self) -> int:
        """The pool's size in tokens (what a model tells the router: Heartbeat.kv_tokens)."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest full-block prefix of `token_ids`, leaving at least one token
        uncomputed (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        bs, prev, blocks = self.block_size, b"", []
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = block_hash(prev, tokens)
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != tuple(tokens):
                break
            blocks.append(b)
            prev = h
        return blocks

    def allocate_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a fresh sequence the matched cached blocks; their KV counts as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(blocks)
        seq.num_hashed_blocks = len(blocks)
        seq.last_block_hash = self.block_hashes[blocks[-1]] if blocks else b""
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.block_size

    def cost_of_prefix(self, blocks: list[int]) -> int:
        """Free blocks that taking `blocks` would consume (cached blocks nobody holds sit in the free list)."""
        return sum(1 for b in blocks if self.ref_count[b] == 0)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full of computed KV, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed_tokens:
            i = seq.num_hashed_blocks
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(seq.last_block_hash, tokens)
            b = seq.block_table[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hashes[b] = h
                self.block_tokens[b] = tuple(tokens)
            seq.last_block_hash = h
            seq.num_hashed_blocks += 1

    def uncache(self, seq: Sequence) -> None:
        """Withdraw `seq`'s blocks from the prefix cache: their KV is suspect (its model computed NaN for it), so a
        later prompt with the same prefix computes its own instead of inheriting the fault."""
        for b in seq.block_table:
            self._forget_hash(b)

    def _forget_hash(self, b: int) -> None:
        """Block `b` no longer backs the cached prefix it held, if any."""
        h = self.block_hashes[b]
        if h is not None:
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hashes[b] = None
            self.block_tokens[b] = None

    # -- allocation ---------------------------------------------------------------------------------

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_tokens` tokens; False (and no change) if blocks are short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        self._forget_hash(b)  # reused for new content
        self.ref_count[b] = 1
        return b

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (finish, abort or preemption)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                # Uncached blocks go to the front: reuse them before evicting a cached prefix.
                self.free[b] = None
                if self.block_hashes[b] is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = b""

    # -- invariants -----------------------------------------------------------------------------------

    def check_integrity(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless ref counts equal the live tables' holds and free == unreferenced."""
        holds = [0] * self.num_blocks
        for seq in live:
            if len(set(seq.block_table)) != len(seq.block_table):
                raise AssertionError(f"sequence {seq.request_id} holds a block twice: {seq.block_table}")
            for b in seq.block_table:
                holds[b] += 1
        for b in range(self.num_blocks):
            if holds[b] != self.ref_count[b]:
                raise AssertionError(f"block {b}: ref count {self.ref_count[b]} but held {holds[b]} times")
            if (self.ref_count[b] == 0) != (b in self.free):
                raise AssertionError(f"block {b}: ref count {self.ref_count[b]}, in free list: {b in self.free}")
        for h, b in self.hash_to_block.items():
            if self.block_hashes[b] != h:
                raise AssertionError(f"prefix cache maps a hash to block {b}, which holds another")
