"""benchmarks/tensor_parallel.py's batch runner drives an executor the way the engine's scheduler does (KV grown
before each step), on a tiny model at TP=1 (the comparison itself is a benchmark, not run here)."""

from types import SimpleNamespace

import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_models import make_llm


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tensor_parallel")


@pytest.fixture(scope="module")
def tiny_1k(tmp_path_factory):
    """A tiny random Llama whose vocabulary covers the benchmark's token ids (10..999)."""
    import transformers

    from orbitflow.model.loader import load_weights

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2))
    path = tmp_path_factory.mktemp("tiny-1k")
    hf.save_pretrained(path)
    model, config = load_weights(path)
    return SimpleNamespace(model=model, config=config, path=path)


def test_run_batch_measures_every_decode_step_and_frees_its_blocks(bench, tiny_1k):
    llm = make_llm(tiny_1k, device_kv_blocks=256, host_kv_blocks=512)
    try:
        rows = bench._run_batch(llm, "distance:2", SimpleNamespace(batch=2, context=20, steps=3), seed=0)
        assert len(rows) == 2  # the first decode step is a warm-up
        assert all(step > 0 and predicted > 0 for step, _, predicted, _ in rows)
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()
