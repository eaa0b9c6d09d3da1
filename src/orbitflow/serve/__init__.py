"""OpenAI-compatible serving: `build_app` (api), `run_server` / `add_serve_parser` (server)."""
