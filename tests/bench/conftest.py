from tiny_models import tiny_chat_dir, tiny_llama  # noqa: F401  (session fixtures)
