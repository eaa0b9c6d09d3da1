from orbitflow.kv.pool import BlockPool, block_tensor, head_planes
from orbitflow.kv.transfer import TransferEngine, host_copy

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


def test_closing_under_a_waiting_step_fails_it_instead_of_hanging_it():
    """Shutdown closes the KV while the engine thread may still be in a step: a layer whose fetch can no longer be
    issued raised nothing and waited forever (its request's blocks never came back); now the step fails, ends, and
    frees its slots, and a later step is refused."""
    import threading

    import pytest

    engine, device, host = make_engine()
    ids = host.allocate(4)
    engine.start_step({0: [(0, ids[:2]), (3, ids[2:])]})  # one slot: layer 3 waits for layer 0's release
    engine.wait_layer(0, [0])
    raised = []

    def step():
        try:
            engine.wait_layer(3, [0])
        except RuntimeError as exc:
            raised.append(str(exc))

    waiter = threading.Thread(target=step, daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting, as it should while the transfer engine is open
    engine.close()
    waiter.join(5)
    assert not waiter.is_alive() and raised and "closed" in raised[0]
    engine.end_step()  # the failed step's clean-up
    assert device.num_used == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.start_step({0: [(0, ids[:2])]})


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


# ---- strict async emulation: each protocol step, removed, is a race that strict mode catches ---------------
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from orbitflow.kv.events import AsyncRaceError, StrictAsync  # noqa: E402

LATE = StrictAsync(enabled=True, max_delay_s=0.2)  # copies and queued kernels complete 0.1-0.2 s late


def strict_engine():
    device = BlockPool("device", 64, BS, H, D)
    host = BlockPool("host", 64, BS, H, D)
    return TransferEngine(device, host, strict=LATE), device, host


def fill_host(host, layers, blocks=2):
    ids = {layer: host.allocate(blocks) for layer in layers}
    for layer, b in ids.items():
        host.storage[:, b] = float(layer + 1)
    return ids


def test_strict_release_needs_a_compute_event_recorded_after_the_last_read():
    engine, device, host = strict_engine()
    ids = fill_host(host, [0])
    engine.start_step({0: [(0, ids[0])]})
    before_read = engine.device.record_compute()
    engine.wait_layer(0, [0])
    engine.staged(0, 0)  # READ
    with pytest.raises(AsyncRaceError, match="released without a compute-stream event"):
        engine.release(0, 0, after=None)  # protocol step removed: no fence at all
    with pytest.raises(AsyncRaceError, match="after its last read"):
        engine.release(0, 0, after=before_read)  # a fence that does not cover the read
    engine.release(0, 0, after=engine.device.record_compute())  # the protocol: accepted
    engine.end_step()
    assert device.num_used == 0
    engine.close()


def test_strict_read_before_the_copy_event_raises_and_would_read_garbage(monkeypatch):
    engine, device, host = strict_engine()
    ids = fill_host(host, [0, 1])
    engine.start_step({0: [(0, ids[0])], 1: [(1, ids[1])]})
    engine.wait_layer(0, [0])  # the protocol: the compute stream waits on the copy event
    assert float(device.storage[:, engine.staged(0, 0)].mean()) == 1.0
    monkeypatch.setattr(engine.device, "compute_wait", lambda event: None)  # remove the wait
    engine.wait_layer(1, [1])  # returns once the copy is issued; it lands 0.1-0.2 s later
    slot = engine._fetches[(1, 1)].staging
    with pytest.raises(AsyncRaceError, match="read of staged KV"):
        engine.staged(1, 1)
    assert torch.isnan(device.storage[:, slot]).all()  # what a kernel would have read: the poisoned slot
    monkeypatch.undo()
    engine.end_step()
    assert device.num_used == 0
    engine.close()


def test_strict_slot_refill_waits_for_the_kernels_that_read_it(monkeypatch):
    """Depth 1: the request's second fetch reuses the first one's slot; the copy stream must wait on the
    release fence (a compute event whose kernels are still queued) before refilling it."""
    engine, device, host = strict_engine()
    ids = fill_host(host, [0, 1])
    engine.start_step({0: [(0, ids[0]), (1, ids[1])]})
    engine.wait_layer(0, [0])
    first_slot = list(engine.staged(0, 0))
    engine.release(0, 0, after=engine.device.record_compute())
    engine.wait_layer(1, [0])  # the protocol: the refill waited on the fence
    assert list(engine.staged(0, 1)) == first_slot  # the same blocks were reused
    assert float(device.storage[:, first_slot].mean()) == 2.0
    engine.release(0, 1, after=engine.device.record_compute())
    engine.end_step()

    engine.device.host_sync("test: the previous step's kernels are done")
    original = engine._wait_fences  # remove the fence wait for device blocks only
    monkeypatch.setattr(engine, "_wait_fences",
                        lambda pool, *a, **k: None if pool is device else original(pool, *a, **k))
    engine.start_step({0: [(0, ids[0]), (1, ids[1])]})
    engine.wait_layer(0, [0])
    engine.staged(0, 0)
    engine.release(0, 0, after=engine.device.record_compute())
    with pytest.raises(RuntimeError, match="KV prefetch failed") as caught:
        engine.wait_layer(1, [0])
    assert isinstance(caught.value.__cause__, AsyncRaceError) and "slot refill" in str(caught.value.__cause__)
    engine.end_step()
    assert device.num_used == 0
    engine.close()


def test_strict_prefetch_of_host_blocks_waits_for_their_device_to_host_write(monkeypatch):
    engine, device, host = strict_engine()
    for remove_wait in (False, True):
        ids = host.allocate(2)
        k = torch.full((2 * BS, H, D), 5.0)
        engine.write_host(ids, 0, k, k + 1)  # lands 0.1-0.2 s late
        if remove_wait:
            original = engine._wait_fences
            monkeypatch.setattr(engine, "_wait_fences",
                                lambda pool, *a, wait=original, **kw: None if pool is host else wait(pool, *a, **kw))
        engine.start_step({0: [(0, ids)]})
        if remove_wait:
            with pytest.raises(RuntimeError, match="KV prefetch failed") as caught:
                engine.wait_layer(0, [0])
            assert "prefetch reads" in str(caught.value.__cause__)
        else:
            engine.wait_layer(0, [0])
            slot = engine.staged(0, 0)
            assert float(device.storage[0, slot].mean()) == 5.0 and float(device.storage[1, slot].mean()) == 6.0
            engine.release(0, 0, after=engine.device.record_compute())
        engine.end_step()
        engine.synchronize()
        host.free(ids)
    assert device.num_used == 0 and host.num_used == 0
    engine.close()


def test_placement_moves_wait_for_pending_host_writes_and_fence_what_they_free():
    engine, device, host = strict_engine()
    ids = host.allocate(2)
    k = torch.full((2 * BS, H, D), 7.0)
    engine.write_host(ids, 0, k, k)
    dst = device.allocate(2)
    engine.move_to_device(ids, dst)  # the copy waits on the pending write's event, so the data is there
    assert float(device.storage[:, dst].mean()) == 7.0
    engine.close()


def test_strict_mode_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ORBITFLOW_STRICT_ASYNC", "1")
    assert StrictAsync.from_env().enabled
    monkeypatch.setenv("ORBITFLOW_STRICT_ASYNC", "0")
    assert not StrictAsync.from_env().enabled
    monkeypatch.setenv("ORBITFLOW_STRICT_ASYNC", "1")
    monkeypatch.setenv("ORBITFLOW_STRICT_ASYNC_DELAY_S", "soon")
    with pytest.raises(ValueError, match="ORBITFLOW_STRICT_ASYNC_DELAY_S"):
        StrictAsync.from_env()


def test_scattered_copies_are_per_run_slice_copies_and_keep_the_data():
    from orbitflow.kv.transfer import _runs

    assert _runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    assert _runs([4, 5, 9, 10, 2], [0, 1, 2, 3, 4]) == [(4, 0, 2), (9, 2, 2), (2, 4, 1)]
    assert _runs([], []) == []
    engine, device, host = make_engine()
    src = [7, 3, 4, 20]
    for i, b in enumerate(src):
        host.storage[0, b], host.storage[1, b] = float(i), float(-i)
    dst = [1, 2, 9, 5]
    engine.move_to_device(src, dst)
    for i, b in enumerate(dst):
        assert float(device.storage[0, b].mean()) == i and float(device.storage[1, b].mean()) == -i
    engine.close()


# ---- the preemptive link: a fetch yields the link between chunks to a more urgent one -----------------------
LONG = 24  # blocks of request 0's layer 5: on the throttled link it takes 0.3 s, 6 chunks of 4


def until(condition, timeout_s=5.0):
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "the copy worker never got there"
        time.sleep(0.001)


def overtaking_step(link, strict=None, device_blocks=64, abort=False, on="cpu"):
    """Request 0 fetches a long layer 5; request 1 fetches layers 0 and 1 (2 and 8 blocks), so its layer 1 is
    released (its layer 0 consumed) while request 0's layer 5 is on the link. Returns the order in which fetches
    were handed to the compute stream, the preemptions, and the long fetch (its progress). ``on``: the device
    pool's device ("cuda": the copy stream's path, host blocks pinned)."""
    device = BlockPool("device", device_blocks, BS, H, D, device=on)
    host = BlockPool("host", 64, BS, H, D, pin_memory=on == "cuda")
    engine = TransferEngine(device, host, LONG * host.bytes_per_block / 0.3, strict=strict)
    engine.link, engine.chunk_s = link, 0.05  # 4 blocks
    long, short = host.allocate(LONG), {0: host.allocate(2), 1: host.allocate(8)}
    for i, b in enumerate(long):
        host.storage[0, b], host.storage[1, b] = float(i + 1), float(-i - 1)
    for layer, ids in short.items():
        host.storage[:, ids] = 100.0 + layer
    handed, original = [], engine._hand_over
    engine._hand_over = lambda fetch, event: (handed.append((fetch.batch_index, fetch.layer)), original(fetch, event))
    copy, land_late = engine._copy, engine._land_chunk_late  # the chunks issued, in order, with what had been
    engine.copies = []  # handed over by then (strict emulation issues a chunk to land late instead of copying it)
    engine._copy = lambda fetch, a, b: (engine.copies.append(((fetch.batch_index, fetch.layer), a, b, len(handed))),
                                        copy(fetch, a, b))
    engine._land_chunk_late = lambda event, fetch, a, b, *when: (
        engine.copies.append(((fetch.batch_index, fetch.layer), a, b, len(handed))),
        land_late(event, fetch, a, b, *when))
    if abort:  # the step ends right after the long fetch yields, before the urgent one starts: nothing is queued
        yield_ = engine._yield_to_urgent  # after its chunk, which is the last copy issued

        def yield_then_wait_for_end_step(fetch):
            if not yield_(fetch):
                return False
            until(lambda: not engine._ready)  # end_step has dropped every fetch not started
            return True

        engine._yield_to_urgent = yield_then_wait_for_end_step
    engine.start_step({0: [(5, long)], 1: [(0, short[0]), (1, short[1])]})
    engine.wait_layer(0, [1])
    assert float(torch.as_tensor(device.storage[:, engine.staged(1, 0)]).mean()) == 100.0
    fetch = engine._fetches[(0, 5)]
    until(lambda: fetch.staging is not None or fetch.scratch is not None)  # request 0's layer 5 is on the link
    engine.release(1, 0, after=engine.device.record_compute())
    if abort:  # the step ends while the long fetch is set aside: its slot must come back all the same
        until(lambda: engine.preemptions > 0)
        engine.end_step()
        assert device.num_used == 0 and engine.overflow_blocks == 0
        assert fetch.partial is None or fetch.partial.query(), "its slot was freed before its chunk landed"
        engine.close()
        return handed, engine.preemptions, fetch
    engine.wait_layer(1, [1])
    assert float(device.storage[:, engine.staged(1, 1)].mean()) == 101.0
    engine.release(1, 1, after=engine.device.record_compute())
    engine.wait_layer(5, [0])
    staged = engine.staged(0, 5)
    data = staged[:, :LONG] if isinstance(staged, torch.Tensor) else device.storage[:, staged]
    assert torch.equal(data.cpu(), host.storage[:, long])  # every chunk landed in its place
    engine.release(0, 5, after=engine.device.record_compute())
    engine.end_step()
    assert device.num_used == 0 and engine.overflow_blocks == 0
    assert engine.bytes_h2d == (LONG + 10) * host.bytes_per_block
    engine.close()
    overtaking_step.copies = engine.copies
    return handed, engine.preemptions, fetch



def test_edf_link_makes_the_urgent_fetch_wait_for_the_long_one():
    handed, preemptions, _ = overtaking_step("edf")
    assert handed == [(1, 0), (0, 5), (1, 1)] and preemptions == 0


@pytest.mark.parametrize("device_blocks", [64, 16], ids=["slot", "scratch"])
def test_preemptive_link_lets_the_urgent_fetch_overtake_and_resumes_the_long_one(device_blocks):
    handed, preemptions, fetch = overtaking_step("preemptive", device_blocks=device_blocks)
    assert handed == [(1, 0), (1, 1), (0, 5)] and preemptions == 1
    assert fetch.done == LONG


def test_a_fetch_no_earlier_layer_can_overtake_moves_in_one_chunk():
    """The long fetch moves in chunks of 4 blocks while request 1's layer 1 is still to be copied; once that one
    has been handed over nothing can preempt it, and its rest moves in one copy (a chunk costs a host round trip
    on CUDA). On the EDF link it moves in one copy from the start."""
    _, preemptions, _ = overtaking_step("preemptive")
    long = [(a, b, handed) for key, a, b, handed in overtaking_step.copies if key == (0, 5)]
    assert preemptions == 1 and len(long) >= 2
    before = [(a, b) for a, b, handed in long if handed < 2]  # while (1, 1) was still to be copied: chunks
    after = [(a, b) for a, b, handed in long if handed >= 2]  # once it was handed over: the rest, in one copy
    assert before and all(b - a == 4 for a, b in before)
    assert after == [(before[-1][1], LONG)]
    overtaking_step("edf")
    assert [(a, b) for key, a, b, _ in overtaking_step.copies if key == (0, 5)] == [(0, LONG)]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream's path needs CUDA")


@CUDA
@pytest.mark.parametrize("device_blocks", [64, 16], ids=["slot", "scratch"])
@pytest.mark.parametrize("link", ["edf", "preemptive"])
def test_on_cuda_the_link_order_holds_and_every_chunk_lands(link, device_blocks):
    """The same step through the copy stream: the EDF link makes the urgent fetch wait, the preemptive one lets
    it overtake; data intact, every slot back."""
    handed, preemptions, fetch = overtaking_step(link, device_blocks=device_blocks, on="cuda")
    if link == "edf":
        assert handed == [(1, 0), (0, 5), (1, 1)] and preemptions == 0
    else:
        assert handed == [(1, 0), (1, 1), (0, 5)] and preemptions == 1 and fetch.done == LONG


@CUDA
@pytest.mark.parametrize("link", ["edf", "preemptive"])
def test_on_cuda_an_emulated_slow_link_hands_a_fetch_on_only_once_it_has_moved_it(link):
    """With --link-gbps on a GPU the real copy is done long before the emulated link would have moved it: the
    fetch is handed to the compute stream only then (a step reading it sooner would run faster than the link it
    emulates and release the request's next fetch early), and the link's busy time is the emulated link's."""
    device = BlockPool("device", 64, BS, H, D, device="cuda")
    host = BlockPool("host", 64, BS, H, D, pin_memory=True)
    engine = TransferEngine(device, host, LONG * host.bytes_per_block / 0.3)  # 0.3 s for the fetch
    engine.link, engine.chunk_s = link, 0.05
    ids = host.allocate(LONG)
    host.storage[:, ids] = 3.0
    start = time.perf_counter()
    engine.start_step({0: [(2, ids)]})
    engine.wait_layer(2, [0])
    assert time.perf_counter() - start >= 0.3
    assert engine.busy_s >= 0.3
    assert float(device.storage[:, engine.staged(0, 2)].mean()) == 3.0
    engine.release(0, 2, after=engine.device.record_compute())
    engine.end_step()
    assert device.num_used == 0
    engine.close()


@pytest.mark.parametrize("link", ["edf", "preemptive"])
def test_strict_emulation_lands_a_prefetch_no_sooner_than_the_throttled_link_moves_it(link):
    """Strict emulation hands a copy's event on when the copy is issued and lands it late; on a throttled link not
    before the link has moved it, or a step could read a layer the link is still moving (and release the request's
    next fetch early: the link order the tests of the preemptive link rely on would not hold there). Request 1's
    layer 1 stays to come, so on the preemptive link request 0's layer 5 moves in 6 chunks, each landing when the
    link has moved it and every chunk before it."""
    device, host = BlockPool("device", 64, BS, H, D), BlockPool("host", 64, BS, H, D)
    engine = TransferEngine(device, host, LONG * host.bytes_per_block / 0.3,
                            strict=StrictAsync(enabled=True, max_delay_s=0.002))
    engine.link, engine.chunk_s = link, 0.05  # 4 blocks
    chunks, land_late = [], engine._land_chunk_late
    engine._land_chunk_late = lambda event, fetch, a, b, *when: (chunks.append((fetch.layer, a, b)),
                                                                land_late(event, fetch, a, b, *when))
    long, short = host.allocate(LONG), {0: host.allocate(2), 1: host.allocate(2)}
    host.storage[:, long] = 7.0
    start = time.perf_counter()
    engine.start_step({0: [(5, long)], 1: [(0, short[0]), (1, short[1])]})
    engine.wait_layer(5, [0])
    assert time.perf_counter() - start >= 0.3  # request 1's layer 0 and then 24 blocks: 0.325 s on this link
    assert float(device.storage[:, engine.staged(0, 5)].mean()) == 7.0
    assert [(a, b) for layer, a, b in chunks if layer == 5] == (
        [(a, a + 4) for a in range(0, LONG, 4)] if link == "preemptive" else [(0, LONG)])
    engine.end_step()
    engine.close()


def test_preemptive_link_under_strict_emulation_keeps_the_protocol():
    """Copies and kernels land late (strict mode): every read still waits on its copy event, every slot refill
    on its fence, and the chunks of a preempted fetch all land before its event completes."""
    handed, preemptions, _ = overtaking_step("preemptive", strict=StrictAsync(enabled=True, max_delay_s=0.05))
    assert handed == [(1, 0), (1, 1), (0, 5)] and preemptions == 1


@pytest.mark.parametrize("device_blocks", [64, 16], ids=["slot", "scratch"])
@pytest.mark.parametrize("strict", [None, StrictAsync(enabled=True, max_delay_s=0.2)], ids=["cpu", "strict"])
def test_a_fetch_set_aside_when_the_step_ends_frees_its_slot(device_blocks, strict):
    """Request 1's layer 1 makes request 0's layer 5 yield, and the step ends then: neither runs on, and the long
    fetch's slot is freed only after its chunk has landed (strict: it lands 0.1-0.2 s late, as a set-aside fetch's
    chunks may still be on the copy stream, with no later copy behind them that end_step would wait for)."""
    _, preemptions, fetch = overtaking_step("preemptive", strict=strict, device_blocks=device_blocks, abort=True)
    assert preemptions == 1 and 0 < fetch.done < LONG and fetch.staging is None and fetch.scratch is None
    if strict is not None:
        assert fetch.partial is not None  # its chunk was on the (emulated) stream: end_step waited for it


def test_the_link_order_is_checked_and_the_config_offers_the_same_ones():
    from orbitflow.config import LINK_CHOICES, CacheConfig
    from orbitflow.kv.transfer import CHUNK_S, LINKS

    engine, _, _ = make_engine()
    with pytest.raises(ValueError, match="link must be one of edf, preemptive"):
        engine.link = "fair"
    assert LINK_CHOICES == LINKS
    assert CacheConfig().kv_link_chunk_ms == pytest.approx(1e3 * CHUNK_S)  # one default, written in two layers
    engine.close()


def test_a_failure_between_two_fetches_fails_the_step_not_the_copy_worker(monkeypatch):
    """An error while the worker waits for room on the copy stream (CUDA) reaches wait_layer as 'KV prefetch
    failed'; the worker goes on, so the next step runs (it used to die silently and every later step hung)."""
    engine, device, host = make_engine()
    ids = fill_host(host, [0, 1])

    def no_room():
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(engine, "_make_room", no_room)
    engine._queued.append(engine.device.done_event())  # as if a chunk were queued on the copy stream
    engine.start_step({0: [(0, ids[0]), (1, ids[1])]})
    failed = []

    def step():
        try:
            engine.wait_layer(0, [0])
            engine.release(0, 0, after=engine.device.record_compute())
            engine.wait_layer(1, [0])  # the error comes after the first fetch, at the latest
        except RuntimeError as exc:
            failed.append(exc)

    waiter = threading.Thread(target=step, daemon=True)
    waiter.start()
    waiter.join(5)
    assert not waiter.is_alive(), "the step hangs: the copy worker died"
    assert "KV prefetch failed" in str(failed[0]) and "illegal memory access" in str(failed[0].__cause__)
    engine.end_step()
    monkeypatch.undo()
    engine.start_step({0: [(0, ids[0])]})
    engine.wait_layer(0, [0])
    assert float(device.storage[:, engine.staged(0, 0)].mean()) == 1.0
    engine.release(0, 0, after=engine.device.record_compute())
    engine.end_step()
    assert device.num_used == 0
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_copy_copies_strided_runs_bit_for_bit(dtype):
    """The CPU link's copy (NumPy's, so the copy thread starts no OpenMP team): a run of head-major planes into
    another pool's, any dtype (bfloat16 has no NumPy dtype), nothing outside the destination run touched."""
    gen = torch.Generator().manual_seed(0)
    src = head_planes(block_tensor(12, 4, 3, 8, dtype, "cpu"))
    src.copy_(torch.randn(src.shape, generator=gen).to(dtype))
    dst = head_planes(block_tensor(12, 4, 3, 8, dtype, "cpu"))
    dst.zero_()
    host_copy(dst[:, :, 5:9], src[:, :, 2:6])
    assert torch.equal(dst[:, :, 5:9].view(torch.uint8), src[:, :, 2:6].view(torch.uint8))
    assert not dst[:, :, :5].any() and not dst[:, :, 9:].any()
