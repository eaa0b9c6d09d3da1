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


def profile_executor(executor, name: str, contexts=(16, 256, 768), steps: int = 5) -> HardwareProfile:
    """Fit decode and prefill costs of a ModelExecutor.

    Measures on a scratch KV cache (all layers on the device, whatever the configured budget), so a
    small --device-kv-blocks never gets in the way; each context's decode time is the median of
    `steps` steps after one warm-up step.
    """
    from orbitflow.kv.manager import KVManager
    from orbitflow.runtime.executor import ModelExecutor, SeqInput

    kv = executor.kv
    layers = executor.num_layers
    storage = kv.device_pool.storage
    scratch_blocks = layers * (kv.blocks_for(max(contexts) + steps + 2))
    scratch = KVManager(layers, storage.shape[3], storage.shape[4], scratch_blocks, 1, block_size=kv.block_size,
                        dtype=storage.dtype, device=storage.device)
    runner = ModelExecutor(executor.model, executor.config, scratch)
    xs, ys, prefill = [], [], []
    try:
        for ctx in contexts:
            scratch.allocate("profile", 0, [True] * layers)
            prompt = [1 + (j % 100) for j in range(ctx)]
            prefill.append((ctx, runner.step([SeqInput("profile", prompt, 0)]).step_s))
            times = [runner.step([SeqInput("profile", [1], ctx + i)]).step_s for i in range(steps + 1)]
            xs.append(ctx)
            ys.append(float(np.median(times[1:])))
            scratch.free("profile")
    finally:
        scratch.close()
    a, b = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    if a < 0:  # noise on a busy machine: no measurable growth with context
        a, b = 0.0, float(np.median(ys))
    pa, pb = np.polyfit([p[0] for p in prefill], [p[1] for p in prefill], 1)
    link = kv.transfer.link_bytes_per_s or measure_link_bytes_per_s(kv)
    return HardwareProfile(
        name=name,
        num_layers=layers,
        kv_bytes_per_token_per_layer=int(kv.device_pool.bytes_per_block // kv.block_size),
        decode_a=max(float(a), 0.0),
        decode_b=max(float(b), 1e-5),
        link_bytes_per_s=float(link),
        device_kv_blocks=kv.device_pool.num_blocks,
        host_kv_blocks=kv.host_pool.num_blocks,
        block_size=kv.block_size,
        prefill_a=max(float(pa), 1e-7),
        prefill_b=max(float(pb), 1e-5),
        notes="measured by orbitflow profile on this machine",
    )
