"""BlockManager unit tests, no model: allocation, ref counts, prefix matching, eviction, integrity checks."""

from __future__ import annotations

import pytest

from tokenrouter.engine.block_manager import BlockManager, block_hash
from tokenrouter.engine.sequence import Sequence
from tokenrouter.sampling_params import SamplingParams

BS = 4


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """What the scheduler + engine do for a chunk: grow the table, mark KV computed, publish full blocks."""
    upto = seq.num_tokens if upto is None else upto
    assert bm.ensure(seq, upto)
    seq.num_computed_tokens = upto
    bm.register_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Scheduler admission: take over the cached prefix, then cover the rest of the prompt."""
    prefix = bm.match_prefix(seq.token_ids)
    bm.allocate_prefix(seq, prefix)
    compute(bm, seq)
    return prefix


def test_allocate_and_release() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq("a", list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.ensure(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.ref_count[b] == 1 for b in seq.block_table)
    # Growing within the last block takes nothing; crossing a boundary takes exactly one.
    assert bm.ensure(seq, 12) and len(seq.block_table) == 3
    assert bm.ensure(seq, 13) and len(seq.block_table) == 4
    bm.check_integrity([seq])
    bm.release(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks == 8
    assert bm.ref_count == [0] * 8
    bm.check_integrity([])


def test_ensure_fails_without_side_effects() -> None:
    bm = BlockManager(4, BS)
    a, b = make_seq("a", [1] * 12), make_seq("b", [2] * 8)
    assert bm.ensure(a, 12)
    before = (list(b.block_table), bm.num_free_blocks, list(bm.ref_count))
    assert not bm.ensure(b, 8)  # needs 2 blocks, 1 free
    assert (list(b.block_table), bm.num_free_blocks, list(bm.ref_count)) == before
    assert bm.ensure(b, 4)
    assert bm.num_free_blocks == 0
    bm.check_integrity([a, b])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BS)


def test_shared_prefix_ref_counts() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    a = make_seq("a", prompt)
    assert admit(bm, a) == []
    assert a.num_hashed_blocks == 3  # only full blocks of computed KV are published
    b = make_seq("b", prompt[:12] + [7, 8, 9])
    prefix = admit(bm, b)
    assert prefix == a.block_table[:3]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == b.num_tokens == 15
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    for blk in a.block_table[:3]:
        assert bm.ref_count[blk] == 2
    assert bm.ref_count[a.block_table[3]] == 1 and bm.ref_count[b.block_table[3]] == 1
    assert bm.num_free_blocks == 16 - 5
    bm.check_integrity([a, b])

    shared = list(b.block_table[:3])
    bm.release(a)
    for blk in shared:
        assert bm.ref_count[blk] == 1 and blk not in bm.free
    bm.check_integrity([b])
    bm.release(b)
    assert bm.num_free_blocks == 16
    bm.check_integrity([])
    # Freed blocks keep their hashes: a third prompt with the prefix still hits.
    assert bm.match_prefix(prompt) == shared
    assert bm.cost_of_prefix(shared) == 3  # all three sit in the free list


def test_cost_of_prefix_counts_only_unreferenced_blocks() -> None:
    bm = BlockManager(16, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)  # 2 full blocks published, a still holds them
    prefix = bm.match_prefix(list(range(9)))
    assert len(prefix) == 2
    assert bm.cost_of_prefix(prefix) == 0
    bm.release(a)
    assert bm.cost_of_prefix(prefix) == 2


def test_match_prefix_leaves_one_token_uncomputed() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(50, 62))  # exactly 3 blocks
    a = make_seq("a", prompt + [1])
    admit(bm, a)
    assert a.num_hashed_blocks == 3
    # The whole prompt is cached, but its last token must still run to produce logits.
    assert len(bm.match_prefix(prompt)) == 2
    assert len(bm.match_prefix(prompt + [99])) == 3
    assert len(bm.match_prefix(prompt[:4])) == 0
    assert len(bm.match_prefix(prompt[:5])) == 1
    assert bm.match_prefix([]) == []
    assert bm.match_prefix(prompt[:1]) == []


def test_match_prefix_is_position_dependent_and_verified() -> None:
    bm = BlockManager(16, BS)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = make_seq("a", x + y + [0])
    admit(bm, a)
    # The same block content after a different prefix is a different block (chain hash).
    assert bm.match_prefix(y + x + [0]) == []
    assert len(bm.match_prefix(x + [9, 9, 9, 9, 0])) == 1
    assert block_hash(b"", y) != block_hash(block_hash(b"", x), y)
    # A hash hit is confirmed against the stored tokens.
    bm.block_tokens[a.block_table[0]] = (1, 2, 3, 5)
    assert bm.match_prefix(x + y + [0]) == []


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    assert a.num_hashed_blocks == 0 and bm.hash_to_block == {}
    assert bm.match_prefix(list(range(9))) == []
    bm.release(a)
    bm.check_integrity([])


def test_generated_tokens_are_published_when_computed() -> None:
    bm = BlockManager(16, BS)
    a = make_seq("a", [3, 1, 4, 1, 5, 9])
    compute(bm, a, 6)
    assert a.num_hashed_blocks == 1
    a.token_ids.extend([2, 6])  # sampled/appended; not computed yet
    bm.register_full_blocks(a)
    assert a.num_hashed_blocks == 1
    compute(bm, a, 8)
    assert a.num_hashed_blocks == 2
    assert len(bm.match_prefix([3, 1, 4, 1, 5, 9, 2, 6, 5])) == 2


def test_eviction_order() -> None:
    """Uncached free blocks are reused first; cached ones least-recently-freed first, a sequence's tail first."""
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(10)))  # blocks: 2 full (published) + 1 partial
    admit(bm, a)
    a_full, a_partial = a.block_table[:2], a.block_table[2]
    b = make_seq("b", list(range(20, 29)))  # 2 full + 1 partial
    admit(bm, b)
    b_full, b_partial = b.block_table[:2], b.block_table[2]
    never_used = [blk for blk in range(8) if blk not in a.block_table + b.block_table]
    assert len(never_used) == 2
    bm.release(a)
    bm.release(b)
    bm.check_integrity([])
    expected = (
        [b_partial, a_partial]  # uncached, freed last go first: all go to the front
        + never_used
        + [a_full[1], a_full[0], b_full[1], b_full[0]]  # cached: oldest release first, tail before head
    )
    assert sorted(expected) == list(range(8))
    uncached = set(expected[:4])
    c = make_seq("c", [7] * 16)
    assert bm.ensure(c, 16)
    assert set(c.block_table) == uncached
    # The cached prefixes survived the reuse of the uncached blocks.
    assert len(bm.match_prefix(list(range(10)))) == 2
    assert len(bm.match_prefix(list(range(20, 29)))) == 2
    d = make_seq("d", [8] * 4)
    assert bm.ensure(d, 4)
    assert d.block_table == [a_full[1]]  # a's tail, freed before b's blocks
    assert len(bm.match_prefix(list(range(10)))) == 1  # a keeps its first block
    assert bm.block_hashes[a_full[1]] is None
    e = make_seq("e", [9] * 12)
    assert bm.ensure(e, 12)
    assert e.block_table == [a_full[0], b_full[1], b_full[0]]
    assert bm.match_prefix(list(range(10))) == [] and bm.match_prefix(list(range(20, 29))) == []
    assert bm.hash_to_block == {}
    assert bm.num_free_blocks == 0
    bm.check_integrity([c, d, e])
    for s in (c, d, e):
        bm.release(s)
    bm.check_integrity([])
    assert bm.num_free_blocks == 8


def test_revived_cached_block_leaves_free_list() -> None:
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    bm.release(a)
    b = make_seq("b", list(range(9)))
    prefix = admit(bm, b)
    assert len(prefix) == 2
    for blk in prefix:
        assert blk not in bm.free and bm.ref_count[blk] == 1
    assert bm.num_free_blocks == 4 - 3
    bm.check_integrity([b])
    bm.release(b)
    bm.check_integrity([])


def test_integrity_detects_bumped_ref_count() -> None:
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    bm.check_integrity([a])
    bm.ref_count[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="ref count 2 but held 1"):
        bm.check_integrity([a])


def test_integrity_detects_leaked_block() -> None:
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    # Forgetting a live sequence = its blocks are referenced by nobody the engine knows about.
    with pytest.raises(AssertionError, match="held 0 times"):
        bm.check_integrity([])


def test_integrity_detects_free_list_corruption() -> None:
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    bm.free[a.block_table[0]] = None  # a referenced block in the free list
    with pytest.raises(AssertionError, match="in free list"):
        bm.check_integrity([a])


def test_integrity_detects_block_held_twice() -> None:
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    a.block_table.append(a.block_table[0])
    bm.ref_count[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="holds a block twice"):
        bm.check_integrity([a])


def test_integrity_detects_stale_hash_map() -> None:
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    bm.block_hashes[a.block_table[0]] = b"not-the-hash"
    with pytest.raises(AssertionError, match="prefix cache maps a hash"):
        bm.check_integrity([a])
