"""--device: where the engine runs, and errors that name the flag."""

import pytest
import torch
from tiny_models import make_llm, tiny_llama  # noqa: F401  (session fixture)

from orbitflow.config import ConfigError, EngineConfig
from orbitflow.llm import resolve_device


def test_device_flag_is_checked():
    with pytest.raises(ConfigError, match="--device"):
        EngineConfig.build(device="gpu")
    assert EngineConfig.build(device="cpu").model.device == "cpu"


def test_auto_and_explicit_devices():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ConfigError, match="--device cuda"):
            resolve_device("cuda")


def test_cpu_runs_on_the_cpu_even_with_a_gpu(tiny_llama):  # noqa: F811
    llm = make_llm(tiny_llama, device="cpu")
    try:
        assert llm.kv.device_pool.storage.device.type == "cpu"
    finally:
        llm.close()


def test_max_model_len_past_the_models_context_is_said(tiny_llama, monkeypatch):  # noqa: F811
    """Positions past the model's own context were never trained: allowed (as transformers does; the engine-vs-HF
    benchmark decodes past 8192), but said (vLLM refuses it by default); before, nothing was said. (The warning is
    read off the logger itself: other tests' serving set-up may stop 'orbitflow' propagating to caplog's handler.)"""
    import orbitflow.llm

    warned: list[str] = []
    monkeypatch.setattr(orbitflow.llm.log, "warning", lambda msg, *args: warned.append(msg % args))
    limit = tiny_llama.config.max_position_embeddings
    for max_model_len, said in ((limit, False), (limit + 1, True)):
        warned.clear()
        make_llm(tiny_llama, max_model_len=max_model_len).close()
        assert any(f"--max-model-len {limit + 1} exceeds tiny's context of {limit}" in m for m in warned) == said


def test_kv_pools_larger_than_memory_are_an_error_naming_the_flags(tiny_llama):  # noqa: F811
    """The allocator's failure was a traceback out of `orbitflow generate`, `serve` and `profile`."""
    with pytest.raises(ConfigError, match="cannot allocate the KV pools of --device-kv-blocks 100000000000000 and "
                                          "--host-kv-blocks"):
        make_llm(tiny_llama, device_kv_blocks=10**14)


def test_a_guard_the_measured_slo_refuses_is_an_error_that_leaves_no_copy_thread(tiny_llama, monkeypatch):  # noqa: F811
    """The SLO is known only once the profile is in: the engine refuses a guard at or over it, and the LLM closes
    the KV manager it built (its copy thread; a tensor-parallel executor's ranks close with it)."""
    from orbitflow.kv.manager import KVManager

    closed = []
    close = KVManager.close
    monkeypatch.setattr(KVManager, "close", lambda self: (closed.append(self), close(self))[1])
    with pytest.raises(ConfigError, match="--deposit-guard-ms"):
        make_llm(tiny_llama, deposit_guard_ms=1e6)
    assert len(closed) == 1 and not closed[0].transfer._thread.is_alive()


def test_generate_that_a_later_prompt_fails_leaves_nothing_queued(tiny_llama):  # noqa: F811
    """A prompt the engine refuses after earlier prompts of the same call were queued: the call raises and aborts
    those too. Before, they stayed queued, ran to completion inside the next generate() and held KV meanwhile."""
    from orbitflow.runtime.engine import RequestRejected
    from orbitflow.runtime.sampling import SamplingParams

    llm = make_llm(tiny_llama, max_model_len=64)
    try:
        with pytest.raises(RequestRejected):
            llm.generate([[5, 6, 7], [5] * 100], SamplingParams(max_tokens=20, ignore_eos=True))
        assert not llm.engine.has_work()
        assert llm.kv.usage() == (0, 0)
        out = llm.generate([[9, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert [len(r.output_ids) for r in out] == [2]
        assert [r.request_id for r in llm.engine.finished if r.finish_reason != "abort"] == [out[0].request_id]
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()
