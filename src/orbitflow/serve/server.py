"""`orbitflow serve`: build the engine from a config and run the OpenAI-compatible API under uvicorn."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from orbitflow.config import ConfigError, EngineConfig

log = logging.getLogger("orbitflow.serve")


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> None:
    import uvicorn

    from orbitflow.llm import LLM
    from orbitflow.serve.api import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(config, profile="measure")  # the SLO derives from this machine's measured decode step
    model_name = served_model_name or config.model
    app = build_app(llm, model_name, api_key=api_key)
    log.info(
        "serving %s at http://%s:%d/v1 | device KV %d blocks, host KV %d blocks (block %d tokens) | "
        "SLO %.1f ms/token | policy %s%s",
        model_name, host, port, config.device_kv_blocks, config.host_kv_blocks, config.block_size,
        1000 * llm.engine.default_slo_s, config.policy, "" if config.token_deposit else " (no Token-Deposit)",
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        llm.close()


def add_serve_parser(
    subparsers,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_config: Callable[[argparse.Namespace], EngineConfig],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    add_engine_args(p)

    def handler(args: argparse.Namespace) -> int:
        if not 0 < args.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {args.port}")
        run_server(engine_config(args), host=args.host, port=args.port, api_key=args.api_key,
                   served_model_name=args.served_model_name)
        return 0

    p.set_defaults(func=handler)
    return p
