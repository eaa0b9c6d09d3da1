"""Tiny random Llama / Qwen2 / Mistral checkpoints: our model must reproduce transformers exactly."""

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from orbitflow.model import DenseKVAttention, ModelConfig, greedy_generate, load_weights

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # large random weights give varied (non-degenerate) greedy continuations
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

ARCHITECTURES = {
    "llama3": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    ),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)
    ),
}

PROMPT_LENGTHS = (5, 11, 17)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(1234)
    hf = ARCHITECTURES[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    # Small shards exercise the sharded-safetensors (index.json) path.
    hf.save_pretrained(path, max_shard_size="200KB")
    return hf, path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_config_is_read(checkpoint) -> None:
    hf, path = checkpoint
    _, config = load_weights(path)
    assert (
        config.num_layers == 3
        and config.num_heads == 4
        and config.num_kv_heads == 2
        and config.head_dim == 16
    )
    assert config.architecture == hf.config.model_type
    assert config.attention_bias == (config.architecture == "qwen2")
    assert config.kv_bytes_per_token_per_layer() == 2 * 2 * 16 * 4
    if config.architecture == "llama":
        assert config.rope_scaling["rope_type"] == "llama3"
    assert (path / "model.safetensors.index.json").exists()


@torch.inference_mode()
def test_packed_prefill_logits_match_hf(checkpoint) -> None:
    hf, path = checkpoint
    model, config = load_weights(path)
    prompts = _prompts()
    backend = DenseKVAttention(config.num_layers)
    backend.set_batch(["a", "b", "c"], [len(p) for p in prompts])
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    logits = model.compute_logits(model(input_ids, positions, backend))
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), 256)

    start = 0
    for prompt in prompts:
        expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=1e-5, rtol=1e-5)
        start += len(prompt)


@torch.inference_mode()
def test_chunked_prefill_matches_full_prefill(checkpoint) -> None:
    _, path = checkpoint
    model, config = load_weights(path)
    prompt = torch.tensor(_prompts()[2])
    full_backend = DenseKVAttention(config.num_layers)
    full_backend.set_batch([0], [len(prompt)])
    full = model.compute_logits(model(prompt, torch.arange(len(prompt)), full_backend))

    chunked_backend = DenseKVAttention(config.num_layers)
    chunks = []
    for start, end in [(0, 6), (6, 13), (13, len(prompt))]:
        chunked_backend.set_batch([0], [end - start])
        positions = torch.arange(start, end)
        chunks.append(model.compute_logits(model(prompt[start:end], positions, chunked_backend)))
    torch.testing.assert_close(torch.cat(chunks), full, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_greedy_decode_matches_hf_generate(checkpoint) -> None:
    hf, path = checkpoint
    model, _ = load_weights(path)
    prompts = _prompts()
    ours = greedy_generate(model, prompts, max_new_tokens=20)
    for prompt, generated in zip(prompts, ours):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert generated == expected[0, len(prompt) :].tolist()
    assert len({tuple(g) for g in ours}) == len(ours)  # the random model is not degenerate


def test_from_hf_config_legacy_rope_keys() -> None:
    config = ModelConfig.from_hf_config(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128009],
            "bos_token_id": 128000,
        }
    )
    assert config.num_kv_heads == 2 and config.head_dim == 4
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    assert config.eos_token_ids == (128001, 128009)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
