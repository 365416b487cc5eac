import random

import pytest

from verispec.runtime.kv_cache import HOLE, BlockManager
from verispec.runtime.prefix_cache import extend_chain, identity_key


def check_invariants(bm: BlockManager, lengths: dict) -> None:
    """No block owned twice, free + owned == total, tables cover lengths exactly."""
    owned = []
    for seq_id, length in lengths.items():
        assert bm.has(seq_id)
        assert bm.num_tokens(seq_id) == length
        table = bm.block_table(seq_id)
        assert len(table) == -(-length // bm.block_size)
        owned.extend(table)
    assert len(owned) == len(set(owned))
    assert all(0 <= b < bm.num_blocks for b in owned)
    assert set(owned).isdisjoint(bm._free)
    assert len(owned) + bm.num_free_blocks == bm.num_blocks


def test_constructor_validates():
    for args in [(0, 16), (4, 0), (-1, 16), (4, 2.5), (True, 16)]:
        with pytest.raises(ValueError):
            BlockManager(*args)
    bm = BlockManager(8, 4)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (8, 4, 8)


def test_allocate_append_truncate_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.can_allocate("a", 5)
    bm.allocate("a", 5)
    assert bm.block_table("a") == [0, 1]
    assert bm.num_tokens("a") == 5 and bm.num_free_blocks == 2
    assert bm.slot_mapping("a", 0, 5) == [0, 1, 2, 3, 4]

    # K + 1 = 4 speculative slots: positions 5..8 need a third block.
    assert bm.can_append("a", 4)
    bm.append("a", 4)
    assert bm.block_table("a") == [0, 1, 2] and bm.num_tokens("a") == 9
    assert bm.slot_mapping("a", 5, 9) == [5, 6, 7, 8]

    # Two rejected: length 7 fits in two blocks, so block 2 goes back.
    bm.truncate("a", 2)
    assert bm.block_table("a") == [0, 1] and bm.num_free_blocks == 2
    bm.truncate("a", 0)
    assert bm.num_tokens("a") == 7

    bm.free("a")
    assert not bm.has("a") and bm.num_free_blocks == 4
    bm.free("a")  # unknown id: no-op
    assert bm.num_free_blocks == 4


def test_zero_length_sequence_and_block_boundaries():
    bm = BlockManager(num_blocks=2, block_size=3)
    bm.allocate(7, 0)
    assert bm.block_table(7) == [] and bm.slot_mapping(7, 0, 0) == []
    bm.append(7, 3)  # exactly one full block
    assert bm.block_table(7) == [0]
    assert bm.can_append(7, 3) and not bm.can_append(7, 4)
    bm.append(7, 1)
    assert bm.block_table(7) == [0, 1]
    bm.truncate(7, 4)
    assert bm.block_table(7) == [] and bm.num_free_blocks == 2


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("x", 2)  # block 0
    bm.allocate("y", 2)  # block 1
    bm.append("x", 3)  # blocks 2, 3
    assert bm.block_table("x") == [0, 2, 3]
    assert bm.slot_mapping("x", 1, 5) == [1, 4, 5, 6]
    with pytest.raises(ValueError, match="start=3, end=6"):
        bm.slot_mapping("x", 3, 6)
    with pytest.raises(ValueError):
        bm.slot_mapping("x", 3, 2)


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)
    bm.allocate("b", 2)
    assert not bm.can_allocate("c", 1)
    bm.free("a")
    assert bm.can_allocate("c", 4)
    bm.allocate("c", 4)
    assert sorted(bm.block_table("c")) == [0, 1]


def test_acting_without_room_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 4)
    assert not bm.can_allocate("b", 5)
    with pytest.raises(RuntimeError, match=r"seq_id='b'.*5 tokens need 2 blocks, 1 free"):
        bm.allocate("b", 5)
    assert not bm.has("b") and bm.num_free_blocks == 1
    assert not bm.can_append("a", 5)
    with pytest.raises(RuntimeError, match=r"append 5 tokens to seq_id='a'"):
        bm.append("a", 5)
    assert bm.num_tokens("a") == 4 and bm.block_table("a") == [0]


def test_bad_arguments_raise_value_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 3)
    assert not bm.can_allocate("a", 1)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        bm.can_allocate("b", -1)
    with pytest.raises(ValueError, match="n=-2"):
        bm.append("a", -2)
    with pytest.raises(ValueError, match="truncate 4 tokens from seq_id='a': its length is 3"):
        bm.truncate("a", 4)
    for method, args in [
        (bm.can_append, (1,)), (bm.append, (1,)), (bm.truncate, (0,)),
        (bm.num_tokens, ()), (bm.block_table, ()), (bm.slot_mapping, (0, 0)),
    ]:
        with pytest.raises(ValueError, match="seq_id='zz' is not allocated"):
            method("zz", *args)


def test_block_table_is_a_copy():
    bm = BlockManager(num_blocks=2, block_size=1)
    bm.allocate("a", 1)
    bm.block_table("a").append(1)
    assert bm.block_table("a") == [0]


@pytest.mark.parametrize("seed", range(5))
def test_random_speculative_workload_keeps_invariants(seed):
    """Random allocate / append(K+1) / truncate(rejected) / free, as a speculative scheduler
    does, with the pool small enough that both checks often say no."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=64, block_size=rng.choice([1, 3, 4, 16]))
    start_free = bm.num_free_blocks
    lengths: dict[int, int] = {}
    next_id = 0
    refused = {"allocate": 0, "append": 0}
    for _ in range(3000):
        op = rng.random()
        if op < 0.15 or not lengths:
            num_tokens = rng.randint(0, 100)
            ok = bm.can_allocate(next_id, num_tokens)
            assert ok == (-(-num_tokens // bm.block_size) <= bm.num_free_blocks)
            if ok:
                bm.allocate(next_id, num_tokens)
                lengths[next_id] = num_tokens
            else:
                refused["allocate"] += 1
                with pytest.raises(RuntimeError):
                    bm.allocate(next_id, num_tokens)
            next_id += 1
        elif op < 0.9:
            seq_id = rng.choice(list(lengths))
            k = rng.randint(0, 7)
            if bm.can_append(seq_id, k + 1):
                bm.append(seq_id, k + 1)
                lengths[seq_id] += k + 1
                check_invariants(bm, lengths)
                rejected = k - rng.randint(0, k)  # accepted tokens + 1 emitted stay
                bm.truncate(seq_id, rejected)
                lengths[seq_id] -= rejected
            else:
                refused["append"] += 1
                before = bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.append(seq_id, k + 1)
                assert bm.num_free_blocks == before
        else:
            seq_id = rng.choice(list(lengths))
            bm.free(seq_id)
            del lengths[seq_id]
        check_invariants(bm, lengths)
        # Slots of all live sequences are pairwise distinct.
        slots = [s for sid, n in lengths.items() for s in bm.slot_mapping(sid, 0, n)]
        assert len(slots) == len(set(slots))
    assert refused["allocate"] > 0 and refused["append"] > 0
    for seq_id in list(lengths):
        bm.free(seq_id)
    assert bm.num_free_blocks == start_free


def test_release_behind_the_window_leaves_holes():
    # window 6, blocks of 4: once queries sit at 10 or later, keys 0..4 are never read again,
    # so block 0 (positions 0-3) goes; block 1 (4-7) still holds position 5.
    bm = BlockManager(8, 4, window=6)
    bm.allocate("a", 10)
    assert bm.release_behind("a", 10) == 1
    assert bm.block_table("a") == [HOLE, 1, 2] and bm.block_table("a", hole=0) == [0, 1, 2]
    assert (bm.num_holes("a"), bm.num_free_blocks, bm.num_tokens("a")) == (1, 6, 10)
    assert bm.release_behind("a", 10) == 0  # idempotent
    assert bm.slot_mapping("a", 4, 6) == [4, 5]
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 3, 5)  # reads a released block
    with pytest.raises(ValueError):
        bm.truncate("a", 7)  # would cut into the released block
    with pytest.raises(ValueError):
        bm.release_behind("a", 11)  # past its length
    bm.append("a", 3)  # positions 10..12: one more block, the hole still counts as a table entry
    assert bm.block_table("a") == [HOLE, 1, 2, 0]  # block 0 was free again
    assert bm.release_behind("a", 13) == 1 and bm.block_table("a") == [HOLE, HOLE, 2, 0]
    bm.free("a")
    assert bm.num_free_blocks == 8 and sorted(bm._free) == list(range(8))
    # Without a window nothing is released.
    plain = BlockManager(8, 4)
    plain.allocate("a", 30)
    assert plain.release_behind("a", 30) == 0 and HOLE not in plain.block_table("a")


def test_window_with_prefix_caching():
    """A released published block stays cached; a hit maps its blocks behind the window as
    holes; a block released before publication breaks the chain, and later blocks are not
    published."""
    root = identity_key("window-test")
    bm = BlockManager(8, 2, prefix_root=root, window=3)
    tokens = list(range(7))
    hashes = extend_chain([], root, tokens, 2, 6)
    bm.allocate("a", 6)
    bm.publish("a", hashes, tokens)
    assert bm.release_behind("a", 6) == 2  # keys 0..3 are behind position 6's window
    assert bm.prefix.num_evictable == 2 and bm.prefix.num_cached == 3
    hit = bm.cached_prefix(hashes, tokens)
    assert hit == [HOLE, HOLE, 2]  # a query at 6 reads 4 and 5 only
    assert bm.blocks_taken(hit) == 0 and bm.can_allocate("b", 1, hit)
    bm.allocate("b", 1, cached=hit)
    assert bm.num_holes("b") == 2 and bm.ref_count(2) == 2 and bm.prefix.num_evictable == 2
    with pytest.raises(ValueError):
        bm.allocate("c", 0, cached=[2, HOLE])  # holes only come first
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    # Released before publication: plain free, and the chain after it is never published.
    fresh = BlockManager(8, 2, prefix_root=root, window=3)
    fresh.allocate("a", 6)
    fresh.release_behind("a", 6)
    fresh.publish("a", hashes, tokens)
    assert fresh.prefix.num_cached == 0 and fresh.num_free_blocks == 7
