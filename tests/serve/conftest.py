"""Session fixtures: tiny random models, one with SmolLM2's real tokenizer (live servers are in live.py)."""

from tiny_models import tiny_chat_dir, tiny_llama, tiny_qwen2  # noqa: F401
