import pytest
import torch

from orbitflow.kv.manager import KVManager
from orbitflow.kv.pool import BlockPool, OutOfBlocks

L, H, D, BS = 4, 2, 8, 16


def make_kv(device_blocks=64, host_blocks=128, **kw) -> KVManager:
    return KVManager(L, H, D, device_blocks, host_blocks, block_size=BS, **kw)


def test_pool_allocate_free_and_exhaustion():
    pool = BlockPool("device", 8, BS, H, D)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5 and pool.num_used == 5
    with pytest.raises(OutOfBlocks, match="wanted 4 blocks, 3 free of 8"):
        pool.allocate(4)
    pool.free(ids)
    assert pool.num_free == 8 and pool.peak_used == 5


def test_allocation_follows_each_layers_tier():
    kv = make_kv()
    placement = [True, False, True, False]
    kv.allocate("a", 40, placement)  # 3 blocks per layer
    table = kv.tables["a"]
    assert table.blocks_per_layer == 3
    assert kv.usage() == (6, 6)
    assert kv.grow("a", 49) is None  # crosses into a 4th block: new blocks land in each layer's own tier
    assert kv.usage() == (8, 8)
    kv.free("a")
    kv.free("a")  # idempotent
    assert kv.usage() == (0, 0)
    kv.close()


def _fill(kv: KVManager, rid: str, tokens: int) -> list[torch.Tensor]:
    written = []
    for layer in range(L):
        k = torch.randn(tokens, H, D)
        v = torch.randn(tokens, H, D)
        kv.write(rid, layer, 0, k, v)
        written.append((k, v))
    return written


def _read_layer(kv: KVManager, rid: str, layer: int, tokens: int):
    table = kv.tables[rid]
    if table.on_device[layer]:
        return kv.read(kv.block_index(table.blocks[layer], tokens), tokens)
    staging = kv.device_pool.allocate(table.blocks_per_layer)
    kv.transfer.move_to_device(table.blocks[layer], staging)
    out = kv.read(kv.block_index(staging, tokens), tokens)
    kv.device_pool.free(staging)
    return out


def test_apply_placement_moves_only_changed_layers_and_keeps_data():
    kv = make_kv()
    tokens = 37
    kv.allocate("a", tokens, [True, True, False, False])
    written = _fill(kv, "a", tokens)
    before_h2d, before_d2h = kv.transfer.bytes_h2d, kv.transfer.bytes_d2h
    kv.apply_placement("a", [True, False, True, False])  # layer 1 -> host, layer 2 -> device
    per_layer = 3 * kv.device_pool.bytes_per_block
    assert kv.transfer.bytes_d2h - before_d2h == per_layer
    assert kv.transfer.bytes_h2d - before_h2d == per_layer
    for layer, (k, v) in enumerate(written):
        k2, v2 = _read_layer(kv, "a", layer, tokens)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    kv.free("a")
    assert kv.usage() == (0, 0)
    kv.close()


def test_paused_request_is_evicted_lazily_layer_by_layer():
    kv = make_kv(device_blocks=12)
    kv.allocate("old", 32, [True] * L)  # 2 blocks x 4 layers = 8 device blocks
    written = _fill(kv, "old", 32)
    kv.pause("old")
    assert kv.usage() == (8, 0)  # nothing moves until the space is needed
    kv.allocate("new", 32, [True, True, True, False])  # needs 6 device blocks, 4 free: evict 1 layer
    assert kv.tables["old"].evicted_layers == {3}
    assert kv.tables["old"].on_device == [True, True, True, False]
    kv.free("new")
    kv.apply_placement("old", [True] * L)  # resume: only the evicted layer comes back
    assert kv.tables["old"].evicted_layers == set()
    for layer, (k, v) in enumerate(written):
        k2, v2 = _read_layer(kv, "old", layer, 32)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    kv.free("old")
    assert kv.usage() == (0, 0)
    kv.close()


def test_failed_allocation_leaves_nothing_behind():
    kv = make_kv(device_blocks=4, host_blocks=4)
    assert kv.allocate("big", 100, [True, False, True, False]) is None  # an expected shortage: no exception
    assert kv.usage() == (0, 0) and "big" not in kv.tables
    kv.close()


def test_shortage_is_an_answer_naming_the_tier_and_changes_nothing():
    kv = make_kv(device_blocks=8, host_blocks=8)
    assert kv.allocate("a", 16, [True, True, False, False]) is not None  # 1 block per layer: 2 + 2
    short = kv.grow("a", 16 * 4)  # 3 more blocks on each layer: 6 of 6 free in each pool
    assert short is None and kv.usage() == (8, 8)
    short = kv.grow("a", 16 * 5)  # one more block per layer: the device pool is full
    assert short is not None and short.tier == "device" and (short.wanted, short.free) == (2, 0)
    assert "device KV pool exhausted: wanted 2 blocks, 0 free of 8" == str(short)
    assert kv.tables["a"].blocks_per_layer == 4 and kv.usage() == (8, 8)
    short = kv.apply_placement("a", [True, True, True, False])  # a host layer to a full device
    assert short is not None and short.tier == "device" and kv.tables["a"].on_device == [True, True, False, False]
    kv.free("a")
    kv.close()


def test_can_allocate_counts_both_pools_and_what_holders_already_hold():
    kv = make_kv(device_blocks=8, host_blocks=8)
    assert kv.can_allocate(4 * L, ["a"])  # 4 blocks per layer x 4 layers = 16 = both pools
    assert not kv.can_allocate(4 * (L + 1), ["a"])  # plus a prefetch layer: 20 > 16
    kv.allocate("a", 32, [True] * L)  # holds 2 blocks per layer (8 device blocks)
    assert kv.can_allocate(4 * L, ["a"]) and not kv.can_allocate(4 * L, [])  # its own blocks count for it only
    kv.free("a")
    kv.close()


def test_a_pool_asked_past_its_budget_is_a_bug_and_raises():
    pool = BlockPool("host", 2, BS, H, D)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(3)
    assert info.value.shortage.tier == "host" and info.value.shortage.wanted == 3


def test_pool_hands_out_runs_that_grow_in_place_and_stop_at_a_neighbour():
    pool = BlockPool("device", 16, BS, H, D, address_blocks=32)
    a = pool.allocate(4)
    assert a == list(range(a[0], a[0] + 4))
    assert pool.extend(a[-1], 2) == [a[-1] + 1, a[-1] + 2]
    b = pool.allocate(3)  # lands in the middle of the largest gap, not right after `a`
    assert b[0] > a[-1] + 3
    blocker = pool.extend(b[-1], 1)
    assert pool.extend(b[-1], 1) is None  # the next address is taken: the run cannot grow there
    assert pool.num_used == 10
    with pytest.raises(OutOfBlocks, match="wanted 7 blocks, 6 free of 16"):
        pool.allocate(7)  # the budget binds, not the address space
    pool.free(a + [a[-1] + 1, a[-1] + 2] + b + blocker)
    assert pool.num_used == 0 and pool.allocate(2, placement="first") == [0, 1]


def test_kv_of_a_run_is_a_view_and_a_fragmented_list_reads_the_same_values():
    pool = BlockPool("device", 16, BS, H, D, address_blocks=32)
    run = pool.allocate(3)
    scattered = [9, 3, 20]
    k, v = torch.randn(40, H, D), torch.randn(40, H, D)
    for ids in (run, scattered):
        pool.write(ids, 0, k[:30], v[:30])
        pool.write(ids, 30, k[30:31], v[30:31])  # one decode token
        pool.write(ids, 31, k[31:], v[31:])
        k2, v2 = pool.kv_view(ids, 40)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    k_run, _ = pool.kv_view(run, 40)
    assert k_run.data_ptr() == pool.storage[0, run[0]].data_ptr()  # no copy: attention reads the pool


def test_heads_view_is_sdpa_layout_of_the_same_tokens_and_each_head_is_contiguous():
    pool = BlockPool("device", 16, BS, H, D, address_blocks=32)
    run, scattered = pool.allocate(3), [9, 3, 20]
    k, v = torch.randn(37, H, D), torch.randn(37, H, D)
    for ids in (run, scattered):
        pool.write(ids, 0, k, v)
        for tokens in (1, BS, 37):
            k4, v4 = pool.heads_view(ids, tokens)
            assert k4.shape == v4.shape == (1, H, tokens, D)
            assert torch.equal(k4[0], k[:tokens].transpose(0, 1)) and torch.equal(v4[0], v[:tokens].transpose(0, 1))
    k4, v4 = pool.heads_view(run, 37)
    assert k4.data_ptr() == pool.storage[0, run[0]].data_ptr() and v4.data_ptr() == pool.storage[1, run[0]].data_ptr()
    assert all(k4[0, h].is_contiguous() for h in range(H))  # the layout attention kernels read fastest


def test_a_run_that_cannot_grow_in_place_moves_with_its_data():
    kv = make_kv()
    kv.allocate("a", 32, [True] * L)  # 2 blocks per layer, each layer one run
    written = _fill(kv, "a", 32)
    table = kv.tables["a"]
    neighbour = kv.device_pool.extend(table.blocks[0][-1], 1)  # someone owns the block after layer 0's run
    assert neighbour is not None
    assert kv.grow("a", 33) is None
    assert table.blocks[0] == list(range(table.blocks[0][0], table.blocks[0][0] + 3))  # moved, still a run
    assert neighbour[0] not in table.blocks[0]
    for layer, (k, v) in enumerate(written):
        k2, v2 = kv.layer_kv("a", layer, 32)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    kv.device_pool.free(neighbour)
    kv.free("a")
    assert kv.usage() == (0, 0)
    kv.close()


def test_pool_refuses_a_double_free():
    from orbitflow.kv.pool import BlockPool

    pool = BlockPool("device", 8, 16, 2, 8)
    ids = pool.allocate(3)
    pool.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([ids[1], ids[1]])
    assert pool.num_used == 2  # neither bad call changed the count
    pool.free(ids[1:])
    assert pool.num_used == 0
