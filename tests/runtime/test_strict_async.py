"""The transfer protocol end to end: one host sync per decode step, and a correctness subset (token identity
under placements, Pause-Resume, aborts) run under the strict async emulation (copies and kernels complete late,
freed slots are poisoned, a read before its event raises). The whole suite runs strict with
`ORBITFLOW_STRICT_ASYNC=1 pytest tests/runtime tests/kv`."""

import pytest
import torch
from scripted_policies import OvertakingPolicy
from tiny_models import hf_greedy, make_llm

from orbitflow.plan.hardware import HardwareProfile
from orbitflow.policies import FixedPlacementPolicy
from orbitflow.runtime.sampling import SamplingParams


def prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[int(x) for x in torch.randint(3, 250, (length + 7 * i,), generator=g)] for i in range(n)]


def tiny_profile(device_kv_blocks, link_bytes_per_s=1e9):
    return HardwareProfile(name="tiny", num_layers=6, kv_bytes_per_token_per_layer=2 * 2 * 16 * 4,
                           decode_a=1e-6, decode_b=6e-3, link_bytes_per_s=link_bytes_per_s,
                           device_kv_blocks=device_kv_blocks, host_kv_blocks=4096, block_size=16)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("ORBITFLOW_STRICT_ASYNC", "1")


def test_a_decode_step_syncs_the_host_once(tiny_llama):
    """Counted by the protocol: with host-resident layers (prefetches, device-to-host writes of the new
    tokens) every step makes exactly one host sync, the one that reads the sampled tokens."""
    llm = make_llm(tiny_llama, FixedPlacementPolicy("distance:2"), max_num_seqs=3, device="cpu")
    try:
        engine, device = llm.engine, llm.kv.transfer.device
        for i, p in enumerate(prompts(3, 20)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
        per_step, moved = [], 0
        while engine.has_work():
            before = device.host_syncs
            result = engine.step()
            if result is not None:
                per_step.append(device.host_syncs - before)
                moved += result.bytes_h2d
        assert moved > 0, "no host-resident layer was prefetched: the count would prove nothing"
        assert per_step and all(n == 1 for n in per_step), per_step
        assert set(device.sync_reasons) == {"sampled tokens"}
    finally:
        llm.close()


def test_a_step_that_samples_nothing_still_ends_in_one_sync(tiny_llama):
    """A non-final prefill chunk samples no token, so there are no logits to read; the step must still end in
    its one host sync, or on CUDA the layer clock's events are read before they complete (and step_s would be
    the host's enqueue time, not the GPU's)."""
    llm = make_llm(tiny_llama, FixedPlacementPolicy("distance:2"), max_num_seqs=1, chunked_prefill=16, device="cpu")
    try:
        engine, device = llm.engine, llm.kv.transfer.device
        engine.add_request("r0", prompts(1, 40)[0], SamplingParams(max_tokens=4, ignore_eos=True))
        per_step = []
        while engine.has_work():
            before = device.host_syncs
            if engine.step() is not None:
                per_step.append(device.host_syncs - before)
        assert len(per_step) >= 2 + 4, per_step  # two chunks that sample nothing, then the last one and decodes
        assert all(n == 1 for n in per_step), per_step
        assert device.sync_reasons["step timing"] == 2
    finally:
        llm.close()


def test_strict_tokens_match_hf_under_placements(tiny_llama, strict):
    ps = prompts(3, 20, seed=3)
    reference = [hf_greedy(tiny_llama.hf, p, 12) for p in ps]
    for spec in ("distance:2", "all"):
        llm = make_llm(tiny_llama, FixedPlacementPolicy(spec), max_num_seqs=3, device="cpu")
        try:
            assert llm.kv.transfer.device.strict.enabled
            reqs = llm.generate(ps, SamplingParams(max_tokens=12))
            assert [r.output_ids for r in reqs] == reference, spec
            assert llm.kv.usage() == (0, 0)
        finally:
            llm.close()


def test_strict_preemptive_link_tokens_match_hf(tiny_llama, strict):
    """Preempted fetches under strict emulation: a resumed fetch's chunks all land before its copy event
    completes, and its slot is only refilled after its release fence."""
    ps = prompts(3, 20, seed=3)
    reference = [hf_greedy(tiny_llama.hf, p, 12) for p in ps]
    llm = make_llm(tiny_llama, OvertakingPolicy(), max_num_seqs=3, device="cpu", kv_link="preemptive",
                   link_gbps=0.002, kv_link_chunk_ms=1e-6)
    try:
        reqs = llm.generate(ps, SamplingParams(max_tokens=12))
        assert [r.output_ids for r in reqs] == reference
        assert llm.kv.usage() == (0, 0)
        assert llm.kv.transfer.preemptions > 0
    finally:
        llm.close()


def test_strict_pause_resume_and_abort(tiny_llama, strict):
    ps = prompts(4, 40)
    ps[0] = ps[0] + ps[1][:24]  # the most KV: the victim (see test_engine)
    reference = [hf_greedy(tiny_llama.hf, p, 24) for p in ps]
    # The planner believes in a slow link: the batch cannot all run within 24 device blocks (see test_engine).
    llm = make_llm(tiny_llama, profile=tiny_profile(24, link_bytes_per_s=2e6), device_kv_blocks=24,
                   max_num_seqs=4, slo_ms=30, window_min=1, window_max=8, device="cpu")
    try:
        reqs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=False))
        assert llm.engine.stats.pauses >= 1 and llm.engine.stats.resumes >= 1
        assert [r.output_ids for r in reqs] == reference
        assert llm.kv.usage() == (0, 0)
        engine = llm.engine
        for i, p in enumerate(ps[:3]):
            engine.add_request(f"a{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert llm.kv.usage() != (0, 0)
        for i in range(3):
            engine.abort(f"a{i}")
        engine.step()
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_strict_catches_the_executor_releasing_a_slot_without_its_fence(tiny_llama, strict, monkeypatch):
    """The race the protocol removes: the executor frees a staging slot while the kernels that read it may
    still be queued. Drop the fence the executor passes, and the first decode step with a prefetch fails."""
    from orbitflow.kv.transfer import TransferEngine

    release = TransferEngine.release
    monkeypatch.setattr(TransferEngine, "release", lambda self, b, layer, after: release(self, b, layer, None))
    llm = make_llm(tiny_llama, FixedPlacementPolicy("all"), max_num_seqs=1, device="cpu")
    try:
        with pytest.raises(Exception, match="released without a compute-stream event"):
            llm.generate(prompts(1, 20), SamplingParams(max_tokens=4))
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()
