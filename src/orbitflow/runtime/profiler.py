"""Measure the real engine on this machine and describe it as a HardwareProfile (`orbitflow profile`).

Everything the cost model charges is measured here, on the executor the engine runs, so the planner, the
controller's mismatch check and the simulator (which all predict with `HardwareProfile.cost_model()`)
are calibrated at once:

- decode compute: ``decode_a * tokens + decode_b``, fitted from single-request decode steps at a few
  context lengths (median of several steps each);
- ``decode_batch_table`` / ``decode_per_request_s``: batches of 2, 3, ... up to ``batch`` requests (the engine's
  ``--max-num-seqs``, at most ``PROFILE_MAX_BATCH``; of different lengths) against one request, over what their extra
  tokens cost (``decode_a``), each read against the single request's steps around it so a drifting machine shifts
  both alike; the per-request figure is the largest batch's over its R - 1. Every batch size is measured (up to
  8, then powers of two): the cost is not linear in R (on the CPU, torch's float32 matmul takes a slower kernel
  path from 4 rows up), and a line through the largest batch over-predicted the steps of 2 and 3 requests by 13-28%;
- ``transfer_latency_s``: decode steps of one request with every layer on the host; the latency per
  transfer that makes the cost model's `edf` stalls, over the step's own measured per-layer compute,
  equal the measured stalls (the copy thread's wake-up and dispatch, beyond bytes / link rate);
- ``host_layer_compute_s``: the same steps, each beside a step of a request of the same context on the device:
  the extra compute per layer that reads prefetched KV (the copy thread's work beside the compute), at prefetch
  depths 1 and 2;
- ``move_latency_s``: placement changes (a request's layers to the host and back), their time beyond
  bytes / link rate, per moved layer;
- ``decode_tail_fraction``: the share of a decode step after the last layer's attention (LM head, sampling),
  which no transfer can overlap;
- ``mixed_step_overhead_s``: a prefill chunk beside a decode against the two run apart (interleaved);
- prefill: ``prefill_a * tokens + prefill_b + prefill_c * pairs`` (``pairs``: the (query, key) pairs its causal
  attention scores), fitted (non-negative, relative least squares) to prompts of several lengths;
- the link rate: the configured throttle, or the measured host-to-device block copy rate (a copy of up to 32 MB, as
  much as the scratch pools hold, timed until it has landed);
- ``step_noise_cv``: the spread of the repeated all-host decode steps (the copy-thread phase) around their
  median (a robust CV: 1.4826 x the median absolute relative deviation): the step-to-step jitter the simulator
  adds as noise. Steps that wait on the copy thread are the jittery ones on a CPU (the copy thread, the compute
  and torch's threads share the cores and the GIL); the all-device steps of phase 1 are steadier (their CV is
  kept in ``extra['step_jitter_device']``).

Each figure is a median over interleaved repeats; the profile's ``extra`` keeps the raw medians.
"""

from __future__ import annotations

import time

import numpy as np

from orbitflow.plan.cost_model import edf_stalls
from orbitflow.plan.hardware import HardwareProfile

CONTEXTS = (16, 256, 768)  # context lengths decode compute is fitted at (phase 1); the second sizes phase 2
LINK_PROBE_BYTES = 32 << 20  # the link rate's probe copy (less if the pools hold less), its fixed costs amortised
PROFILE_MAX_BATCH = 16  # the largest batch phase 2 measures for an engine (beyond: decode_per_request_s a request)


def measure_link_bytes_per_s(kv, nbytes: int = LINK_PROBE_BYTES, repeats: int = 3) -> float:
    """Host-to-device copy rate of whole blocks through the transfer engine (honours any throttle): the fastest of
    ``repeats`` copies of about ``nbytes``, each timed until it has landed (on CUDA a move only queues the copy on
    the copy stream, so the time until it returns is the enqueue's, not the link's)."""
    per_block = kv.host_pool.bytes_per_block
    blocks = min(max(1, -(-nbytes // per_block)), kv.device_pool.num_free, kv.host_pool.num_free)
    if blocks == 0:
        return 1e9
    host = kv.host_pool.allocate(blocks)
    dev = kv.device_pool.allocate(blocks)
    try:
        best = float("inf")
        kv.transfer.synchronize()  # nothing queued before the probe is timed with it
        for _ in range(repeats):
            start = time.perf_counter()
            kv.transfer.move_to_device(host, dev)
            kv.transfer.synchronize()
            best = min(best, time.perf_counter() - start)
        kv.transfer.bytes_h2d -= repeats * blocks * per_block  # not real traffic
        kv.transfer.layer_moves -= repeats
    finally:
        kv.host_pool.free(host)
        kv.device_pool.free(dev)
    return blocks * per_block / max(best, 1e-9)


def _fit_transfer_latency(compute: list[float], stall_s: float, xfer_s: float, hosts: list[int]) -> float:
    """The per-transfer latency at which `edf` predicts `stall_s` for one request (bisection; stall grows
    monotonically with the latency)."""

    def stall(lat: float) -> float:
        return sum(edf_stalls(compute, [hosts], [xfer_s + lat]))

    if stall(0.0) >= stall_s:
        return 0.0
    lo, hi = 0.0, max(xfer_s, 1e-3)
    while stall(hi) < stall_s and hi < 10.0:
        hi *= 2
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if stall(mid) < stall_s else (lo, mid)
    return 0.5 * (lo + hi)


class _Bench:
    """A scratch KV cache big enough for every measurement, whatever the configured budget, so a small
    --device-kv-blocks never gets in the way; same model, link throttle and dtype as the engine's."""

    def __init__(self, executor, device_tokens: int, host_tokens: int):
        from orbitflow.kv.manager import KVManager
        from orbitflow.runtime.executor import ModelExecutor

        kv = executor.kv
        self.layers = executor.num_layers
        storage = kv.device_pool.storage
        self.kv = KVManager(self.layers, storage.shape[3], storage.shape[4], self.layers * kv.blocks_for(device_tokens),
                            max(1, self.layers * kv.blocks_for(host_tokens)), block_size=kv.block_size,
                            dtype=storage.dtype, device=storage.device, link_bytes_per_s=kv.transfer.link_bytes_per_s)
        self.runner = ModelExecutor(executor.model, executor.config, self.kv)
        self.pos: dict[str, int] = {}

    def prefill(self, rid: str, ctx: int, on_device: bool = True):
        from orbitflow.runtime.executor import SeqInput

        self.kv.allocate(rid, 0, [on_device] * self.layers)
        result = self.run([SeqInput(rid, [1 + (j % 100) for j in range(ctx)], 0)])
        self.pos[rid] = ctx
        return result

    def decode(self, rids: list[str], advance: bool = True):
        """One decode step of ``rids``; ``advance=False`` writes the same position again (the same work, the
        lengths kept)."""
        from orbitflow.runtime.executor import SeqInput

        result = self.run([SeqInput(r, [1], self.pos[r]) for r in rids])
        if advance:
            for r in rids:
                self.pos[r] += 1
        return result

    def run(self, seqs):
        """One step of `seqs`, their KV grown first (the engine's scheduler does this for the engine)."""
        for s in seqs:
            short = self.kv.grow(s.req_id, s.start_pos + len(s.token_ids))
            if short is not None:
                raise RuntimeError(f"profiling KV cache too small: {short}")
        return self.runner.step(seqs)

    def free(self, rid: str) -> None:
        self.kv.free(rid)
        self.pos.pop(rid, None)

    def close(self) -> None:
        self.kv.close()


def _measure_context(bench: _Bench, contexts, steps: int,
                     prefill: list[tuple[int, float]]) -> tuple[float, float, list[float], float]:
    """Phase 1: decode compute of one request against its context (a + b*ctx) and the last layer's share
    beyond a middle one (LM head and sampling) per step; each context's prefill goes to `prefill`.

    One request per context, all prefilled first, then decoded in interleaved rounds (the order reversed
    every other round), `2 * steps` rounds: a machine that speeds up or slows down while it is measured
    shifts every context alike instead of tilting the fitted per-token cost (measured one context after
    another, it ranged 1.9-23 us/token between runs on a busy 2-core machine)."""
    ids = [f"p{i}" for i in range(len(contexts))]
    for rid, ctx in zip(ids, contexts):
        prefill.append((ctx, bench.prefill(rid, ctx).step_s))
    results: dict[str, list] = {rid: [] for rid in ids}
    for round_ in range(2 * steps + 1):
        for rid in (ids if round_ % 2 == 0 else ids[::-1]):
            r = bench.decode([rid])
            if round_:  # the first round warms each request up
                results[rid].append(r)
    xs, ys, tails, deviations = [], [], [], []
    for rid, ctx in zip(ids, contexts):
        median = float(np.median([r.step_s for r in results[rid]]))
        deviations += [r.step_s / median - 1.0 for r in results[rid]]
        for r in results[rid]:
            comp = r.layer_compute_s
            if len(comp) > 2:
                tails.append(max(0.0, comp[-1] - float(np.median(comp[1:-1]))) / max(sum(comp), 1e-12))
        xs.append(ctx)
        ys.append(median)
        bench.free(rid)
    a, b = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    if a < 0:  # noise on a busy machine: no measurable growth with context
        a, b = 0.0, float(np.median(ys))
    return float(a), float(b), tails, step_jitter(deviations)


def step_jitter(deviations: list[float]) -> float:
    """Robust CV of repeated steps from their relative deviations from their median: 1.4826 x the median
    absolute deviation (the standard deviation for normal jitter; one GC pause does not set it)."""
    if not deviations:
        return 0.0
    return min(float(1.4826 * np.median(np.abs(deviations))), 0.99)


def _measure_prefill(bench: _Bench, sizes, repeats: int, prefill: list[tuple[int, float]]) -> None:
    """Phase 1b: prefill steps of fresh prompts of each size (interleaved repeats), appended to `prefill`."""
    for _ in range(repeats):
        for n in sizes:
            prefill.append((n, bench.prefill("q", n).step_s))
            bench.free("q")


def _fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``(a, b, c)`` >= 0 of ``a * tokens + b + c * pairs`` for fresh prompts, least squares on the relative
    error (a 16-token prompt counts as much as a 768-token one). Non-negative by trying every subset of the
    three terms and keeping the best fit whose coefficients are all >= 0."""
    n = np.asarray([p[0] for p in points], dtype=float)
    y = np.asarray([p[1] for p in points], dtype=float)
    features = np.stack([n, np.ones_like(n), n * (n + 1) / 2], axis=1) / y[:, None]
    best, coef = np.inf, np.array([0.0, float(np.median(y)), 0.0])
    for mask in ([0, 1, 2], [0, 1], [1, 2], [0, 2], [0], [1], [2]):
        sol, *_ = np.linalg.lstsq(features[:, mask], np.ones_like(y), rcond=None)
        if np.all(sol >= 0):
            err = float(np.sum((features[:, mask] @ sol - 1.0) ** 2))
            if err < best:
                best, coef = err, np.zeros(3)
                coef[mask] = sol
    return float(coef[0]), float(coef[1]), float(coef[2])


def batch_sizes(batch: int) -> list[int]:
    """The batch sizes phase 2 measures: every one from 2 to 8, then powers of two, and ``batch`` itself."""
    sizes = {r for r in range(2, min(batch, 8) + 1)} | {1 << k for k in range(4, batch.bit_length())} | {batch}
    return sorted(r for r in sizes if 2 <= r <= batch)


def _measure_per_request(bench: _Bench, batch: int, per_req: int, single: int, steps: int, decode_a: float,
                         extra: dict) -> tuple[float, list[list[float]] | None]:
    """Phase 2: per-request overhead: the first R of `batch` requests of about per_req tokens, for each R of
    `batch_sizes`, against one request ("s", left allocated for the next phases) of batch * per_req, less what
    their extra tokens cost (``decode_a`` a token). Each round runs every size between two steps of "s" (the order
    reversed every other round); a size's step is read against "s" interpolated to its place in the round, so a
    machine drifting through the phase shifts both alike. The batch's lengths differ by 2 tokens a row, as a
    serving batch's do: rows of one length may share an attention call (`attention.row_groups`), which rows of
    different lengths never get; its steps rewrite the same position (`decode(advance=False)`), so they stay
    different. Returns the per-request cost of the whole batch and the table of every size (None for a batch of 1);
    a size never costs less than a smaller one (the running max: that bias up is the smaller size's noise)."""
    if batch < 2:
        bench.prefill("s", single)
        return 0.0, None
    ids = [f"b{i}" for i in range(batch)]
    low = max(per_req - (batch - 1), 4)
    for i, rid in enumerate(ids):
        bench.prefill(rid, low + 2 * i)
    bench.prefill("s", single)
    sizes = batch_sizes(batch)
    refs = [bench.decode(["s"], advance=False).step_s]
    diffs: dict[int, list[float]] = {r: [] for r in sizes}
    many: dict[int, list[float]] = {r: [] for r in sizes}
    for round_ in range(steps + 1):
        order = sizes if round_ % 2 == 0 else sizes[::-1]
        times = [bench.decode(ids[:r], advance=False).step_s for r in order]
        refs.append(bench.decode(["s"], advance=False).step_s)
        if round_ == 0:  # the first round warms every size up
            continue
        before, after = refs[-2], refs[-1]
        for j, (r, t) in enumerate(zip(order, times)):
            diffs[r].append(t - (before + (after - before) * (j + 1) / (len(order) + 1)))
            many[r].append(t)
    tokens_one = bench.pos["s"] + 1
    table, floor = [], 0.0
    for r in sizes:
        tokens = sum(bench.pos[rid] + 1 for rid in ids[:r])
        floor = max(floor, float(np.median(diffs[r])) - decode_a * (tokens - tokens_one))
        table.append([r, floor])
    for rid in ids:
        bench.free(rid)
    extra.update(decode_one_of_batch_tokens_s=float(np.median(refs[1:])), decode_batch_s=float(np.median(many[batch])),
                 batch=batch)
    return table[-1][1] / (batch - 1), table


def _measure_mixed_step(bench: _Bench, chunk: int, steps: int, extra: dict) -> float:
    """Phase 3: a prefill chunk beside the decode of "s", against the two run apart."""
    from orbitflow.runtime.executor import SeqInput

    mixed, apart = [], []
    chunk_ids = [1 + (j % 100) for j in range(chunk)]
    for i in range(steps + 1):
        rid = f"m{i}"
        bench.kv.allocate(rid, 0, [True] * bench.layers)
        mixed.append(bench.run([SeqInput("s", [1], bench.pos["s"]), SeqInput(rid, chunk_ids, 0)]).step_s)
        bench.pos["s"] += 1
        bench.free(rid)
        bench.kv.allocate(rid, 0, [True] * bench.layers)
        alone = bench.run([SeqInput(rid, chunk_ids, 0)]).step_s
        bench.free(rid)
        apart.append(alone + bench.decode(["s"]).step_s)
    extra.update(mixed_step_s=float(np.median(mixed[1:])), apart_s=float(np.median(apart[1:])), chunk=chunk)
    return max(0.0, float(np.median(mixed[1:])) - float(np.median(apart[1:])))


def _measure_moves(bench: _Bench, link: float) -> float:
    """Phase 4: placement changes: every layer of "s" to the host and back, beyond the bytes over the link (each
    timed until its copies have landed: on CUDA the step that follows a move waits for them)."""
    moves = []
    layers = bench.layers
    layer_bytes = bench.kv.tables["s"].blocks_per_layer * bench.kv.host_pool.bytes_per_block
    transfer = bench.kv.transfer
    for _ in range(3):
        for target in (False, True):
            transfer.synchronize()
            start = time.perf_counter()
            bench.kv.apply_placement("s", [target] * layers)
            transfer.synchronize()
            moves.append((time.perf_counter() - start - layers * layer_bytes / link) / layers)
    return max(0.0, float(np.median(moves)))


def _measure_copy_thread(bench: _Bench, link: float, steps: int, extra: dict, deviations: list[float],
                         depths: tuple[int, ...] = (1, 2)) -> tuple[float, list[float]]:
    """Phase 5: decode steps of "s" with every layer on the host, each beside one of "t" (the same context, on
    the device): the copy thread's latency per transfer (at depth 1) and, per prefetch depth, the extra compute
    of a layer that reads prefetched KV (the median per-layer compute of "s" over "t"'s, steps interleaved).
    The relative deviations of the "s" steps from their median per depth go to `deviations` (step jitter)."""
    layers = bench.layers
    bench.kv.apply_placement("s", [False] * layers)
    bench.prefill("t", bench.pos["s"])
    transfer = bench.kv.transfer
    lats, stalls, host_layer = [], [], []
    try:
        for depth in depths:
            transfer.prefetch_slots = depth
            diffs, host_steps = [], []
            for i in range(steps + 1):
                r, alone = bench.decode(["s"]), bench.decode(["t"])
                if i == 0:
                    continue
                host_steps.append(r.step_s)
                diffs.append((r.compute_s - alone.compute_s) / layers)
                if depth == 1 and r.stall_s > 0:
                    xfer = bench.kv.blocks_for(bench.pos["s"] - 1) * bench.kv.host_pool.bytes_per_block / link
                    lats.append(_fit_transfer_latency(list(r.layer_compute_s), r.stall_s, xfer, list(range(layers))))
                    stalls.append(r.stall_s)
            host_layer.append(max(0.0, float(np.median(diffs))))
            groups = [host_steps]
            if depth == 1:  # more steps that wait on the copy thread, back to back as the engine runs them
                groups.append([bench.decode(["s"]).step_s for _ in range(3 * steps)])
            for group in groups:  # each around its own median: the two ways of running may differ in level
                deviations += [t / float(np.median(group)) - 1.0 for t in group]
    finally:
        transfer.prefetch_slots = 1
        bench.free("t")
    extra.update(offloaded_stall_s=float(np.median(stalls)) if stalls else 0.0)
    return (float(np.median(lats)) if lats else 0.0), host_layer


def profile_executor(executor, name: str, contexts=CONTEXTS, steps: int = 7, batch: int = 4,
                     chunk: int = 64, prefill_sizes=(16, 64, 128, 256, 512)) -> HardwareProfile:
    """Fit every cost of a ModelExecutor that the cost model charges (see the module docstring)."""
    kv = executor.kv
    # decode steps a request may take beyond its prompt: "s" takes 1 (phase 2 rewrites one position), 2 * (steps + 1)
    # (phase 3) and 2 * (steps + 1) + 3 * steps (phase 5, all on the host), 7 * steps + 5 in all
    spare = 8 * steps + 8
    batch = max(int(batch), 1)
    per_req = max(contexts[1] // batch, 16)
    single = per_req * batch  # the single request holding as many tokens as the batch
    # phase 1 holds one request per context at once; later phases hold the rest
    first = max(sum(contexts) + len(contexts) * spare, max(prefill_sizes) + spare)
    device_tokens = first + batch * (per_req + spare) + 2 * (single + spare) + 2 * (chunk + spare)
    bench = _Bench(executor, device_tokens, single + spare)
    link = kv.transfer.link_bytes_per_s or measure_link_bytes_per_s(bench.kv)
    extra: dict = {"steps_per_point": steps}
    try:
        # 0. warm-up (first calls pay for lazy initialisation), discarded.
        bench.prefill("w", contexts[0])
        for _ in range(3):
            bench.decode(["w"])
        bench.free("w")
        prefill: list[tuple[int, float]] = []
        a, b, tails, device_jitter = _measure_context(bench, contexts, steps, prefill)
        _measure_prefill(bench, prefill_sizes, 2, prefill)
        pa, pb, pc = _fit_prefill(prefill)
        extra["prefill_points"] = [[int(t), round(s, 6)] for t, s in sorted(prefill)]
        per_request, batch_table = _measure_per_request(bench, batch, per_req, single, steps, a, extra)
        mixed_overhead = _measure_mixed_step(bench, chunk, steps, extra)
        move_latency = _measure_moves(bench, link)
        host_deviations: list[float] = []
        transfer_latency, host_layer = _measure_copy_thread(bench, link, steps, extra, host_deviations)
        extra["step_jitter_device"] = round(device_jitter, 4)
        bench.free("s")
    finally:
        bench.close()
    return HardwareProfile(
        name=name,
        num_layers=executor.num_layers,
        kv_bytes_per_token_per_layer=int(kv.device_pool.bytes_per_block // kv.block_size),
        decode_a=max(a, 0.0),
        decode_b=max(b, 1e-5),
        link_bytes_per_s=float(link),
        device_kv_blocks=kv.device_pool.num_blocks,
        host_kv_blocks=kv.host_pool.num_blocks,
        block_size=kv.block_size,
        prefill_a=max(pa, 1e-7),
        prefill_b=max(pb, 1e-5),
        prefill_c=pc,
        decode_per_request_s=per_request,
        decode_batch_table=batch_table,
        transfer_latency_s=transfer_latency,
        host_layer_compute_s=host_layer,
        move_latency_s=move_latency,
        mixed_step_overhead_s=mixed_overhead,
        decode_tail_fraction=min(float(np.median(tails)), 0.9) if tails else 0.0,
        step_noise_cv=round(step_jitter(host_deviations), 4),
        notes="measured by orbitflow profile on this machine",
        extra={k: (round(v, 7) if isinstance(v, float) else v) for k, v in extra.items()},
    )
