"""Block manager: allocation, slot arithmetic, errors and the ownership invariants."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from adapt.errors import RuntimeConfigError
from adapt.runtime.cache.block_manager import BlockManager, OutOfBlocksError


def check_invariants(bm: BlockManager) -> None:
    owned = [b for sid in list(bm._tables) for b in bm.block_table(sid)]
    assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    assert set(owned).isdisjoint(bm._free), "a block is both free and owned"
    assert sorted(owned + list(bm._free)) == list(range(bm.num_blocks))
    for sid in bm._tables:
        assert bm.blocks_needed(bm.num_tokens(sid)) == len(bm.block_table(sid))


def test_allocate_and_slots() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(1, 6)
    assert table == [0, 1]
    assert bm.num_free_blocks == 6
    assert bm.slot_mapping(1, 0, 6) == [0, 1, 2, 3, 4, 5]
    assert bm.slot(1, 5) == 5
    bm.allocate(2, 3)
    assert bm.block_table(2) == [2]
    assert bm.slot_mapping(2, 0, 3) == [8, 9, 10]
    # append fills block 1 then takes a new block at the boundary
    assert [bm.append_slot(1), bm.append_slot(1)] == [6, 7]
    assert bm.append_slot(1) == 3 * 4
    assert bm.block_table(1) == [0, 1, 3]
    assert bm.num_tokens(1) == 9
    check_invariants(bm)


def test_free_returns_everything_and_reuses() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(7, 8)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1)
    bm.free(7)
    assert bm.num_free_blocks == 4 and 7 not in bm
    assert bm.usage().used_blocks == 0
    bm.allocate(8, 3)
    check_invariants(bm)


def test_zero_token_allocation_then_append() -> None:
    bm = BlockManager(2, 4)
    assert bm.allocate(1, 0) == []
    assert bm.can_append(1)
    assert bm.append_slot(1) == 0
    check_invariants(bm)


def test_usage_and_watermark() -> None:
    bm = BlockManager(10, 16)
    bm.allocate(0, 17)
    u = bm.usage()
    assert (u.used_blocks, u.total_blocks, u.used_tokens, u.capacity_tokens) == (2, 10, 17, 160)
    assert u.block_fraction == pytest.approx(0.2)
    assert bm.can_allocate(16 * 8)
    assert not bm.can_allocate(16 * 8, watermark_blocks=1)


def test_errors() -> None:
    bm = BlockManager(2, 4)
    with pytest.raises(OutOfBlocksError, match="needs 3 KV blocks"):
        bm.allocate(1, 9)
    assert bm.num_free_blocks == 2  # a failed allocate takes nothing
    bm.allocate(1, 8)
    with pytest.raises(RuntimeConfigError, match="already has"):
        bm.allocate(1, 1)
    assert not bm.can_append(1)
    with pytest.raises(OutOfBlocksError, match="no free KV block"):
        bm.append_slot(1)
    for call in (bm.free, bm.block_table, bm.append_slot, bm.can_append):
        with pytest.raises(RuntimeConfigError, match="unknown sequence id 99"):
            call(99)
    with pytest.raises(RuntimeConfigError, match="outside"):
        bm.slot_mapping(1, 0, 9)
    with pytest.raises(RuntimeConfigError):
        BlockManager(0, 4)
    with pytest.raises(RuntimeConfigError):
        BlockManager(4, 0)
    assert issubclass(OutOfBlocksError, RuntimeConfigError)


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    bm = BlockManager(32, 4)
    live: set[int] = set()
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, 20)
            if bm.can_allocate(n):
                bm.allocate(step, n)
                live.add(step)
        elif op < 0.8 and live:
            sid = rng.choice(sorted(live))
            if bm.can_append(sid):
                before = bm.num_tokens(sid)
                slot = bm.append_slot(sid)
                assert bm.slot_mapping(sid, before, before + 1) == [slot]
        elif live:
            sid = rng.choice(sorted(live))
            bm.free(sid)
            live.discard(sid)
        check_invariants(bm)
    all_slots = [s for sid in live for s in bm.slot_mapping(sid, 0, bm.num_tokens(sid))]
    assert len(all_slots) == len(set(all_slots)), "two tokens share a slot"
    for sid in list(live):
        bm.free(sid)
    assert bm.num_free_blocks == 32


def test_no_torch_import() -> None:
    import adapt.runtime.cache.block_manager as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "torch" for name in names)


def test_window_returns_blocks_that_left_it():
    # W = 5, BS = 4: once token n has its slot, blocks wholly before n + 1 - 5 go back to the pool
    bm = BlockManager(8, 4, window=5)
    bm.allocate(0, 6)  # positions 0..5, blocks 2
    assert bm.block_table(0)[0] >= 0
    bm.append_slot(0)  # position 6 sees 2..6: block 0 (0..3) still needed
    assert bm.block_table(0)[0] >= 0 and bm.num_free_blocks == 6
    for _ in range(2):
        bm.append_slot(0)  # positions 7, 8: position 8 sees 4..8, block 0 is gone
    table = bm.block_table(0)
    assert table[0] == -1 and bm.num_free_blocks == 6 and bm.usage().used_blocks == 2
    for _ in range(40):  # a long sequence holds at most ceil(W / BS) + 1 blocks
        bm.append_slot(0)
        assert sum(b >= 0 for b in bm.block_table(0)) <= 3
    assert bm.num_tokens(0) == 49 and bm.usage().used_tokens <= 12
    bm.free(0)
    assert bm.num_free_blocks == 8 and bm.usage().used_tokens == 0
    with pytest.raises(RuntimeConfigError, match="window"):
        BlockManager(8, 4, window=0)
