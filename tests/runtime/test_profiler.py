"""`orbitflow profile` on a tiny model: every engine overhead is measured, finite and usable by the simulator."""

import math
import time

import pytest
import torch
from tiny_models import make_llm

from orbitflow.plan.cost_model import edf_stalls
from orbitflow.plan.hardware import HardwareProfile
from orbitflow.runtime.profiler import _fit_prefill, _fit_transfer_latency, profile_executor


def test_profile_measures_every_overhead_and_round_trips(tiny_llama):
    llm = make_llm(tiny_llama, device_kv_blocks=8, host_kv_blocks=256, link_gbps=0.05)
    try:
        p = profile_executor(llm.executor, "tiny@here", contexts=(16, 48, 96), steps=2, batch=3, chunk=16,
                             prefill_sizes=(16, 32))
    finally:
        llm.close()
    for name in ("decode_a", "decode_b", "prefill_a", "prefill_b", "prefill_c", "decode_per_request_s",
                 "transfer_latency_s", "move_latency_s", "mixed_step_overhead_s", "decode_tail_fraction",
                 "step_noise_cv"):
        value = getattr(p, name)
        assert math.isfinite(value) and value >= 0, name
    assert p.link_bytes_per_s == 0.05e9  # the configured throttle
    assert p.device_kv_blocks == 8  # the engine's budget, not the scratch cache's
    assert {"decode_batch_s", "mixed_step_s", "offloaded_stall_s"} <= set(p.extra)
    assert len(p.host_layer_compute_s) == 2  # depths 1 and 2
    assert all(math.isfinite(v) and v >= 0 for v in p.host_layer_compute_s)
    assert [r for r, _ in p.decode_batch_table] == [2, 3]  # every batch size up to the batch measured
    assert p.decode_batch_table[-1][1] == pytest.approx(2 * p.decode_per_request_s)
    assert HardwareProfile.from_json(p.to_json()) == p
    assert llm.kv.usage() == (0, 0)  # measured on a scratch cache


def test_the_scratch_cache_holds_every_phase_at_one_token_per_block(tiny_llama):
    """Block size 1 leaves no rounding slack: the scratch cache must hold every decode step the phases take
    (request "s" decodes 7 * steps + 5 times, 5 * steps + 2 of them all on the host; the batch rows of phase 2
    rewrite one position)."""
    llm = make_llm(tiny_llama, device_kv_blocks=8, host_kv_blocks=256, link_gbps=0.05, block_size=1)
    try:
        p = profile_executor(llm.executor, "tiny@here", contexts=(16, 48, 96), steps=5, batch=3, chunk=16,
                             prefill_sizes=(16, 32))
    finally:
        llm.close()
    assert p.block_size == 1 and 0 <= p.step_noise_cv < 1


def test_transfer_latency_fit_recovers_a_known_latency():
    comp, xfer, hosts = [0.002] * 8, 0.003, list(range(8))
    for latency in (0.0, 0.0004, 0.002):
        stall = sum(edf_stalls(comp, [hosts], [xfer + latency]))
        assert abs(_fit_transfer_latency(comp, stall, xfer, hosts) - latency) < 1e-7


def test_prefill_fit_recovers_the_attention_term_and_stays_non_negative():
    from orbitflow.plan.hardware import attention_pairs

    a, b, c = 1e-3, 0.03, 4e-7
    points = [(n, a * n + b + c * attention_pairs(0, n)) for n in (16, 64, 128, 256, 512, 768)]
    assert _fit_prefill(points) == tuple(pytest.approx(x, rel=1e-6) for x in (a, b, c))
    # a prompt that got cheaper with length (noise) never gives a negative per-token or per-pair cost
    assert all(x >= 0 for x in _fit_prefill([(16, 0.05), (256, 0.04), (768, 0.2)]))


def test_context_phase_interleaves_so_a_drifting_machine_does_not_tilt_the_per_token_cost():
    """Steps that get slower over time, with no real growth with context: measured one context after another
    the drift reads as a per-token cost; interleaved rounds cancel it."""
    from types import SimpleNamespace

    from orbitflow.runtime.profiler import _measure_context

    calls = [0]
    ctx_of: dict = {}

    def step(rid=None):
        calls[0] += 1
        return SimpleNamespace(step_s=0.05 + 1e-4 * calls[0], layer_compute_s=[0.01, 0.01, 0.01, 0.02])

    def prefill(rid, ctx):
        ctx_of[rid] = ctx
        return step()

    bench = SimpleNamespace(prefill=prefill, decode=lambda ids: step(ids[0]), free=lambda rid: None)
    prefills: list = []
    a, b, tails, _ = _measure_context(bench, (16, 256, 768), 7, prefills)
    assert [ctx for ctx, _ in prefills] == [16, 256, 768]
    drift_per_token = 1e-4 * 15 / (768 - 16)  # what one-context-after-another would fit: ~2 us/token
    assert abs(a) < 0.1 * drift_per_token
    assert tails and all(t == pytest.approx(0.2) for t in tails)


def test_host_layer_compute_is_the_all_host_step_over_its_device_twin_per_depth():
    """Phase 5 reads the extra compute per host layer at each prefetch depth from interleaved steps of "s"
    (every layer on the host) and "t" (same context, on the device), whatever the machine's drift."""
    from types import SimpleNamespace

    from orbitflow.runtime.profiler import _measure_copy_thread

    layers, extra_per_layer = 4, {1: 0.0003, 2: 0.0007}
    transfer = SimpleNamespace(prefetch_slots=1)
    calls, freed = [0], []

    def decode(ids):
        calls[0] += 1
        base = 0.04 + 1e-4 * calls[0]  # drifts: only an interleaved difference cancels it
        host = ids == ["s"]
        per_layer = base / layers + (extra_per_layer[transfer.prefetch_slots] if host else 0.0)
        return SimpleNamespace(compute_s=per_layer * layers, layer_compute_s=[per_layer] * layers,
                               stall_s=0.010 if host else 0.0, step_s=per_layer * layers)

    kv = SimpleNamespace(apply_placement=lambda rid, row: None, transfer=transfer, blocks_for=lambda n: 2,
                         host_pool=SimpleNamespace(bytes_per_block=1000))
    bench = SimpleNamespace(layers=layers, kv=kv, pos={"s": 64}, decode=decode, free=freed.append,
                            prefill=lambda rid, ctx: None)
    deviations: list = []
    extra: dict = {}
    latency, host_layer = _measure_copy_thread(bench, link=1e6, steps=5, extra=extra, deviations=deviations)
    assert host_layer == [pytest.approx(0.0003, abs=1e-4), pytest.approx(0.0007, abs=1e-4)]
    # the jitter sample: every all-host step, 5 per depth plus 15 more back to back at depth 1
    assert len(deviations) == 25 and max(abs(d) for d in deviations) < 0.2
    assert transfer.prefetch_slots == 1 and freed == ["t"]  # the engine's depth back, the twin gone
    # every layer on the host, one slot: each layer waits for its own copy, fetched once the layer before is done,
    # so a step stalls 4 x (2 blocks x 1000 B / 1 MB/s + latency): 10 ms of stall is a latency of 0.5 ms
    assert latency == pytest.approx(0.010 / layers - 2 * 1000 / 1e6, abs=1e-9)
    assert extra == {"offloaded_stall_s": 0.010}


def test_per_request_phase_measures_every_batch_size_whatever_the_drift():
    """Phase 2 prices each batch size on its own: a 4th request that costs ~8x a 2nd (the CPU's matmul kernel
    change at 4 rows) is in the table, where a line through the batch of 4 would overcharge batches of 2 and 3;
    the rows' extra tokens are priced at decode_a, and the rows keep their lengths (all different)."""
    from types import SimpleNamespace

    from orbitflow.runtime.profiler import _measure_per_request, batch_sizes

    true_extra, decode_a = {1: 0.0, 2: 0.004, 3: 0.008, 4: 0.040}, 2e-5
    calls, pos, freed = [0], {}, []

    def prefill(rid, ctx):
        pos[rid] = ctx

    def decode(ids, advance=True):
        calls[0] += 1
        assert len({pos[r] for r in ids}) == len(ids), "two rows of one length"
        step = 0.05 + 2e-4 * calls[0] + decode_a * sum(pos[r] + 1 for r in ids) + true_extra[len(ids)]
        if advance:
            for r in ids:
                pos[r] += 1
        return SimpleNamespace(step_s=step)

    bench = SimpleNamespace(prefill=prefill, decode=decode, free=freed.append, pos=pos)
    extra: dict = {}
    per_request, table = _measure_per_request(bench, 4, 64, 256, 7, decode_a, extra)
    assert [r for r, _ in table] == [2, 3, 4]
    for r, seconds in table:  # the drift (0.2 ms a step, up to 0.6 ms between a size's step and "s"'s) cancels
        assert seconds == pytest.approx(true_extra[r], abs=1e-6), r
    assert per_request == pytest.approx(0.040 / 3, abs=1e-6)
    assert extra["batch"] == 4 and extra["decode_batch_s"] > extra["decode_one_of_batch_tokens_s"]
    assert sorted(freed) == ["b0", "b1", "b2", "b3"] and "s" in pos  # "s" is left for the next phases
    assert batch_sizes(4) == [2, 3, 4] and batch_sizes(16) == [2, 3, 4, 5, 6, 7, 8, 16]
    assert batch_sizes(40) == [2, 3, 4, 5, 6, 7, 8, 16, 32, 40] and batch_sizes(1) == []
    # noise that makes a bigger batch look cheaper than a smaller one never enters the table
    true_extra[3] = 0.002
    _, table = _measure_per_request(bench, 4, 64, 256, 3, decode_a, {})
    assert [v for _, v in table] == [pytest.approx(0.004, abs=1e-6), pytest.approx(0.004, abs=1e-6),
                                     pytest.approx(0.040, abs=1e-6)]


def test_the_engine_profiles_the_batch_sizes_it_will_run(tiny_llama, monkeypatch):
    """`orbitflow profile --max-num-seqs N` (and an engine measuring its own profile) measures batches up to N,
    at most PROFILE_MAX_BATCH: a profile measured at 4 would price a batch of 8 on a line."""
    from orbitflow.runtime import profiler

    seen = []

    def fake(executor, name, **kw):
        seen.append(kw.get("batch"))
        kv = executor.kv
        return HardwareProfile(name=name, num_layers=executor.num_layers, block_size=kv.block_size,
                               kv_bytes_per_token_per_layer=kv.device_pool.bytes_per_block // kv.block_size,
                               decode_a=0.0, decode_b=1e-3, link_bytes_per_s=1e9,
                               device_kv_blocks=kv.device_pool.num_blocks, host_kv_blocks=kv.host_pool.num_blocks)

    monkeypatch.setattr(profiler, "profile_executor", fake)
    for max_num_seqs, batch in ((6, 6), (1, 2), (64, profiler.PROFILE_MAX_BATCH)):
        make_llm(tiny_llama, device_kv_blocks=8, host_kv_blocks=256, profile="measure",
                 max_num_seqs=max_num_seqs).close()
        assert seen[-1] == batch


def test_step_jitter_is_the_spread_of_repeated_steps_and_ignores_one_pause():
    """The measured jitter is the CV of normal step-to-step noise (what the simulator's noise_cv means), and
    one slow outlier (a GC pause) does not set it."""
    import numpy as np

    from orbitflow.runtime.profiler import step_jitter

    rng = np.random.default_rng(0)
    deviations = (rng.normal(0.0, 0.05, 2000)).tolist()
    assert step_jitter(deviations) == pytest.approx(0.05, rel=0.1)
    assert step_jitter(deviations[:40] + [3.0]) < 0.1
    assert step_jitter([0.0] * 10) == 0.0 and step_jitter([]) == 0.0


def test_context_phase_reports_the_jitter_of_its_repeated_steps():
    from types import SimpleNamespace

    from orbitflow.runtime.profiler import _measure_context

    times = iter([0.05] * 3 + [0.05 * (1.1 if i % 2 else 0.9) for i in range(100)])  # +-10% around the median

    def step():
        return SimpleNamespace(step_s=next(times), layer_compute_s=[0.01, 0.01, 0.01])

    bench = SimpleNamespace(prefill=lambda rid, ctx: step(), decode=lambda ids: step(), free=lambda rid: None)
    *_, jitter = _measure_context(bench, (16, 256, 768), 7, [])
    assert 0.05 < jitter <= 0.1483  # 1.4826 x |10%| at most (the median itself may be one of the two values)


class _QueuedLink:
    """A transfer engine whose moves only queue their copy, which lands ``land_s`` later (as on a CUDA copy
    stream); ``synchronize`` waits for it."""

    def __init__(self, land_s: float):
        self.land_s, self.lands, self.bytes_h2d, self.layer_moves = land_s, None, 0, 0

    def move_to_device(self, host_ids, device_ids):
        self.lands = time.perf_counter() + self.land_s
        self.bytes_h2d += len(host_ids) * 1000
        self.layer_moves += 1

    def synchronize(self):
        if self.lands is not None:
            time.sleep(max(0.0, self.lands - time.perf_counter()))
            self.lands = None


def test_link_rate_is_timed_until_the_copy_lands_not_until_it_is_queued():
    """On CUDA a move returns once its copy is queued: a rate timed to then is the enqueue's. The probe waits for
    the copy (here 1000 blocks of 1 kB landing 50 ms after the call: 20 MB/s), and leaves no traffic counted."""
    from types import SimpleNamespace

    from orbitflow.runtime.profiler import measure_link_bytes_per_s

    pools = [SimpleNamespace(bytes_per_block=1000, num_free=1000,
                             allocate=lambda n: list(range(n)), free=lambda ids: None) for _ in range(2)]
    link = _QueuedLink(land_s=0.05)
    kv = SimpleNamespace(host_pool=pools[0], device_pool=pools[1], transfer=link)
    rate = measure_link_bytes_per_s(kv, repeats=2)  # 32 MB asked, the pools hold 1000 blocks
    assert rate == pytest.approx(1e6 / 0.05, rel=0.3)
    assert link.bytes_h2d == 0 and link.layer_moves == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream's path needs CUDA")
def test_on_cuda_the_link_rate_is_the_pinned_copy_rate():
    """Through the copy stream, the probe measures what a pinned host-to-device copy of the same bytes takes (it
    used to time only the enqueue: 2-5x off on an H200)."""
    from orbitflow.kv.manager import KVManager
    from orbitflow.runtime.profiler import LINK_PROBE_BYTES, measure_link_bytes_per_s

    heads, dim, block = 8, 64, 16
    blocks = LINK_PROBE_BYTES // (2 * heads * dim * block * 4)
    kv = KVManager(1, heads, dim, blocks + 8, blocks + 8, block_size=block, dtype=torch.float32, device="cuda")
    try:
        rate = measure_link_bytes_per_s(kv)
    finally:
        kv.close()
    src = torch.empty(LINK_PROBE_BYTES // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    best = math.inf
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    assert 0.5 < rate / (LINK_PROBE_BYTES / best) < 1.5


def test_the_per_request_batch_is_not_grouped(tiny_llama, monkeypatch):
    """The per-request phase's rows differ in length, as a serving batch's do: rows of one length could share an
    attention call (`row_groups`) and make the measured per-request cost one that unequal rows never get."""
    from orbitflow.model import attention

    real, seen = attention.row_groups, []

    def row_groups(kv, threads, split_k=True):
        seen.append(len(kv))
        groups = real(kv, threads, split_k)
        assert not groups, f"rows grouped while profiling: {groups}"
        return groups

    monkeypatch.setattr(attention, "row_groups", row_groups)
    llm = make_llm(tiny_llama, device_kv_blocks=8, host_kv_blocks=256, link_gbps=0.05)
    try:
        profile_executor(llm.executor, "tiny@here", contexts=(16, 48, 96), steps=2, batch=3, chunk=16,
                         prefill_sizes=(16, 32))
    finally:
        llm.close()
    assert 3 in seen, "the batch of 3 never decoded: the test would prove nothing"
