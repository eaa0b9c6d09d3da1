"""Measure the real engine on this machine and describe it as a HardwareProfile (`orbitflow profile`).

Decode step time is fitted as A * tokens_in_batch + B from a few decode steps at different context
lengths; the link rate is the configured throttle, or the measured host-to-device block copy rate.
"""

from __future__ import annotations

import time

import numpy as np

from orbitflow.sim.profiles import HardwareProfile


def measure_link_bytes_per_s(kv, blocks: int = 64, repeats: int = 3) -> float:
    """Host-to-device copy rate of whole blocks through the transfer engine (honours any throttle)."""
    blocks = min(blocks, kv.device_pool.num_free, kv.host_pool.num_free)
    if blocks == 0:
        return 1e9
    host = kv.host_pool.allocate(blocks)
    dev = kv.device_pool.allocate(blocks)
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            kv.transfer.move_to_device(host, dev)
            best = min(best, time.perf_counter() - start)
        kv.transfer.bytes_h2d -= repeats * blocks * kv.host_pool.bytes_per_block  # not real traffic
    finally:
        kv.host_pool.free(host)
        kv.device_pool.free(dev)
    return blocks * kv.host_pool.bytes_per_block / max(best, 1e-9)


def profile_executor(executor, name: str, contexts=(16, 256, 768), steps: int = 4) -> HardwareProfile:
    """Fit decode and prefill costs of a ModelExecutor whose KV pools are empty."""
    from orbitflow.runtime.executor import SeqInput

    kv = executor.kv
    layers = executor.num_layers
    xs, ys, prefill = [], [], []
    all_device = [True] * layers
    for i, ctx in enumerate(contexts):
        rid = f"__profile_{i}"
        kv.allocate(rid, 0, all_device)
        try:
            prompt = [1 + (j % 100) for j in range(ctx)]
            result = executor.step([SeqInput(rid, prompt, 0)])
            prefill.append((ctx, result.step_s))
            pos = ctx
            for _ in range(steps):
                result = executor.step([SeqInput(rid, [1], pos)])
                pos += 1
                xs.append(pos)
                ys.append(result.step_s)
        finally:
            kv.free(rid)
    a, b = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1) if len(set(xs)) > 1 else (0.0, ys[-1])
    b = max(float(b), 1e-5)
    a = max(float(a), 0.0)
    pa, pb = np.polyfit([p[0] for p in prefill], [p[1] for p in prefill], 1)
    kv_bytes = kv.device_pool.bytes_per_block // kv.block_size
    link = kv.transfer.link_bytes_per_s or measure_link_bytes_per_s(kv)
    return HardwareProfile(
        name=name,
        num_layers=layers,
        kv_bytes_per_token_per_layer=int(kv_bytes),
        decode_a=a,
        decode_b=b,
        link_bytes_per_s=float(link),
        device_kv_blocks=kv.device_pool.num_blocks,
        host_kv_blocks=kv.host_pool.num_blocks,
        block_size=kv.block_size,
        prefill_a=max(float(pa), 1e-7),
        prefill_b=max(float(pb), 1e-5),
        notes="measured by orbitflow profile on this machine",
    )
