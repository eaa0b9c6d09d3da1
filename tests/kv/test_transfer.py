from orbitflow.kv.pool import BlockPool
from orbitflow.kv.transfer import TransferEngine

BS, H, D = 16, 2, 8


def make_engine(rate=None):
    device = BlockPool("device", 64, BS, H, D)
    host = BlockPool("host", 64, BS, H, D)
    return TransferEngine(device, host, rate), device, host


def test_prefetch_order_is_earliest_needed_layer_first_one_slot_per_request():
    engine, device, host = make_engine()
    order = []
    original = engine._issue

    def recording_copy(src, src_ids, dst, dst_ids):
        if src is host and dst is device:
            order.append(tuple(src_ids))
        return original(src, src_ids, dst, dst_ids)

    engine._issue = recording_copy
    r0 = {layer: host.allocate(2) for layer in (2, 5)}
    r1 = {layer: host.allocate(3) for layer in (1, 2)}
    engine.start_step({0: [(2, r0[2]), (5, r0[5])], 1: [(1, r1[1]), (2, r1[2])]})
    engine.wait_layer(1, [1])
    engine.release(1, 1, after=engine.device.record_compute())  # request 1 consumed layer 1: its layer 2 may start
    engine.wait_layer(2, [0, 1])
    staged = engine.staged(0, 2)
    assert staged is not None and len(staged) == 2
    engine.release(0, 2, after=engine.device.record_compute())
    engine.release(1, 2, after=engine.device.record_compute())
    engine.wait_layer(5, [0])
    engine.release(0, 5, after=engine.device.record_compute())
    engine.end_step()
    # layer 1 (request 1) before layer 2 (request 0); request 1's layer 2 only after its slot was freed
    assert order == [tuple(r1[1]), tuple(r0[2]), tuple(r1[2]), tuple(r0[5])]
    assert device.num_used == 0
    engine.close()


def test_end_step_frees_slots_of_an_aborted_step():
    engine, device, host = make_engine()
    ids = host.allocate(4)
    engine.start_step({0: [(0, ids[:2]), (3, ids[2:])]})
    engine.wait_layer(0, [0])
    engine.end_step()  # exception path: layer 0 never released, layer 3 never started
    assert device.num_used == 0
    engine.close()


def test_throttled_copy_holds_the_link_for_bytes_over_rate():
    import time

    engine, device, host = make_engine()
    nbytes = 32 * device.bytes_per_block
    engine.link_bytes_per_s = nbytes / 0.05  # 32 blocks should occupy the link for 50 ms
    src, dst = host.allocate(32), device.allocate(32)
    start = time.perf_counter()
    engine.move_to_device(src, dst)
    assert time.perf_counter() - start >= 0.05  # sleep-based throttle: a lower bound, not a speed claim
    assert engine.bytes_h2d == nbytes
    engine.close()


def test_depth_two_lets_the_next_layer_land_before_this_one_is_consumed():
    """Prefetch depth 2 (DeepSpeed): a request's second host layer moves while its first is still in use; its
    third waits for the first to be released. Data arrives intact and every slot is freed."""
    engine, device, host = make_engine()
    engine.prefetch_slots = 2
    ids = {layer: host.allocate(2) for layer in (0, 1, 2)}
    for layer, blocks in ids.items():
        host.storage[:, blocks] = float(layer + 1)  # both planes (K, V) of these blocks
    engine.start_step({0: [(layer, ids[layer]) for layer in (0, 1, 2)]})
    engine.wait_layer(0, [0])
    engine.wait_layer(1, [0])  # at depth 1 this would wait forever: layer 0 is not released yet
    assert (0, 2) not in engine._issued  # the third fetch waits for a free slot
    assert float(device.storage[:, engine.staged(0, 1)].mean()) == 2.0
    engine.release(0, 0, after=engine.device.record_compute())
    engine.wait_layer(2, [0])
    assert float(device.storage[:, engine.staged(0, 2)].mean()) == 3.0
    engine.release(0, 1, after=engine.device.record_compute())
    engine.release(0, 2, after=engine.device.record_compute())
    engine.end_step()
    assert device.num_used == 0
    engine.close()
