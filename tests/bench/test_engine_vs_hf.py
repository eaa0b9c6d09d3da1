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


def test_each_figure_is_compared_with_transformers_best_cache():
    """Transformers' default DynamicCache copies the whole cache every step; StaticCache decodes faster on long
    contexts. Each figure goes against the better side for it, named: here static decodes faster, dynamic prefills
    faster and takes less memory."""
    samples = {"ours": [(1.0, 3.0, 100 * 2**20)] * 3,  # (seconds to first token, decode span, peak RSS bytes)
               "static": [(2.0, 2.0, 300 * 2**20)] * 3,
               "dynamic": [(1.5, 6.0, 200 * 2**20)] * 3}
    row = bench.summarize(samples, batch=2, context=100, new_tokens=4, a="ours", b=["static", "dynamic"])
    assert (row["decode_by"], row["prefill_by"], row["rss_by"]) == ("static", "dynamic", "dynamic")
    assert row["ratio"] == pytest.approx(2 / 3) and row["pratio"] == pytest.approx(1.5)
    assert (row["decode_static"], row["decode_dynamic"]) == (3.0, 1.0) and row["rss_b"] == 200
    assert bench.cache_list("dynamic,static,static") == ["dynamic", "static"]
    with pytest.raises(Exception, match="comma list"):
        bench.cache_list("paged")


def test_where_we_lose_names_every_point_behind():
    rows = [{"context": 512, "batch": 1, "ratio": 1.2, "range": "0.93-1.43", "pratio": 0.94, "prange": "0.91-1.01",
             "decode_by": "static", "prefill_by": "dynamic", "headroom": 27.0},
            {"context": 2048, "batch": 4, "ratio": 0.91, "range": "0.79-1.02", "pratio": 1.1, "prange": "1.05-1.2",
             "decode_by": "static", "prefill_by": "static", "headroom": -3.0}]
    text = bench.where_we_lose(rows)
    assert "decode at 2048 x 4 (0.91 against static)" in text and "prefill at 512 x 1 (0.94 against dynamic)" in text
    assert "decode not shown ahead at 512 x 1 (range 0.93-1.43)" in text and "memory over the bound at 2048 x 4" in text
    rows[1].update(ratio=1.1, range="1.0-1.2", headroom=5.0)
    rows[0].update(pratio=1.0, prange="1.0-1.1", range="1.0-1.4")
    assert bench.where_we_lose(rows) == "Where we lose: nowhere in this grid."
    # a median ahead whose 95% CI still reaches under 1 is not shown ahead; a CI all under 1 is said so
    rows[0]["ci"] = (0.98, 1.3)
    rows[1].update(ratio=0.9, ci=(0.85, 0.95))
    text = bench.where_we_lose(rows)
    assert "decode not shown ahead at 512 x 1 (range 1.0-1.4, CI [0.98, 1.30])" in text
    assert "decode at 2048 x 4 (0.90 against static, CI [0.85, 0.95] all under 1)" in text
    # a median behind whose CI holds 1 is no significant difference, not a loss (the page's rule)
    rows[1]["ci"] = (0.89, 1.01)
    text = bench.where_we_lose(rows)
    assert "decode behind at the median only, the CI holding 1 (no significant difference), at 2048 x 4 (0.90" in text
    assert "decode at 2048 x 4" not in text


def test_the_ratio_interval_is_the_geometric_means_t_interval():
    low, high = bench.ratio_ci([0.9, 1.0, 1.1])
    center = (0.9 * 1.0 * 1.1) ** (1 / 3)
    assert low < center < high and low * high == pytest.approx(center ** 2)
    assert high / center == pytest.approx(1.283, abs=0.01)  # t(0.975, 2) = 4.303 x sd of the logs / sqrt(3)
    assert bench.ratio_ci([1.0]) is None and bench.ratio_ci([1.2, 1.2]) == pytest.approx((1.2, 1.2))
    row = bench.summarize({"ours": [(1.0, 3.0, 0)] * 3, "hf": [(1.0, 2.0, 0)] * 3}, 1, 10, 4, "ours", "hf")
    assert row["ci_text"] == "[0.67, 0.67]" and row["pci_text"] == "[1.00, 1.00]"
