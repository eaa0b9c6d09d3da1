from tiny_models import tiny_llama, tiny_qwen2  # noqa: F401  (session fixtures)
