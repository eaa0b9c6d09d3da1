from tiny_models import tiny_chat_dir  # noqa: F401  (session fixture)
