"""benchmarks/engine_vs_hf.py measures what it says: the whole batch prefills together, as transformers runs it."""

from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("engine_vs_hf")


def _loaded(layers=30, kv_heads=3, head_dim=64):
    return SimpleNamespace(config=SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim))


def _fake_llm(monkeypatch, first_token_s):
    """An LLM whose requests got their first token at `first_token_s[i]`; records the config it was built with."""
    seen = {}

    class FakeLLM:
        def __init__(self, config, **_):
            seen["config"] = config
            self.clock = SimpleNamespace(now=lambda: 0.0)

        def generate(self, prompts, params):
            return [SimpleNamespace(output_ids=[1] * params.max_tokens,
                                    generated_s=[t + i for i in range(params.max_tokens)])
                    for t in first_token_s[:len(prompts)]]

        def close(self):
            pass

    monkeypatch.setattr(bench, "LLM", FakeLLM)
    return seen


def test_the_whole_batch_is_admitted_at_once(monkeypatch):
    """At 8192 x 8 the default running-batch cap (32768 tokens) would hold back half the prompts."""
    seen = _fake_llm(monkeypatch, [1.0] * 8)
    prompts = [[5] * 8192 for _ in range(8)]
    ttft, span, _ = bench.ours_runner(_loaded(), prompts, 16, "none")()
    scheduler = seen["config"].scheduler
    assert scheduler.max_num_seqs == 8 and scheduler.max_num_batched_tokens >= 8 * (8192 + 16)
    assert seen["config"].cache.device_kv_blocks == bench.pool_blocks(_loaded(), 8, 8192, 16)
    assert (ttft, span) == (1.0, 15.0)


def test_a_batch_run_in_waves_is_refused(monkeypatch):
    _fake_llm(monkeypatch, [1.0, 1.0, 9.0])
    with pytest.raises(RuntimeError, match="one step"):
        bench.ours_runner(_loaded(), [[5] * 64] * 3, 4, "none")()


def test_memory_headroom_is_transformers_peak_plus_the_pool_less_ours():
    samples = {"ours": [(1.0, 2.0, 300 * 2**20)], "hf": [(1.0, 2.0, 250 * 2**20)]}
    row = bench.summarize(samples, 4, 512, 16, "ours", "hf", pool_mib=100.0)
    assert row["headroom"] == pytest.approx(50.0)
    assert bench.pool_mib(_loaded(), 1, 16, 0) == pytest.approx((30 + 64) * 2 * 16 * 3 * 64 * 4 / 2**20)
