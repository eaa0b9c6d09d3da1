"""A tiny random Llama with SmolLM2's real tokenizer (helpers for live servers are in live.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2  # noqa: F401  (session fixtures)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """HF directory of a 4-layer random Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer files:
    real text in and out (gibberish, but deterministic) at a fraction of SmolLM2's step time."""
    import transformers

    from orbitflow.model.loader import _model_dir_for
    from orbitflow.model.registry import resolve_model_path

    smollm2 = _model_dir_for(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-chat")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, path / name)
    return path
