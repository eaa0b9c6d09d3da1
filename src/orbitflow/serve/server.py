"""`orbitflow serve`: build the engine from a config and run the OpenAI-compatible API under uvicorn.

Shutdown on SIGTERM or Ctrl-C is graceful: the listening socket closes, new requests get 503, requests in
flight may finish for `--shutdown-timeout` seconds and are then aborted (their streams end with
finish_reason "abort"), the engine frees every block, and the process exits 0 without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable

from orbitflow.config import ConfigError, EngineConfig

log = logging.getLogger("orbitflow.serve")

DEFAULT_MAX_QUEUE_LEN = 256


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    shutdown_timeout_s: float = 10.0,
    max_body_bytes: int | None = None,
    watchdog_s: float | None = None,
) -> None:
    import uvicorn

    from orbitflow.llm import LLM
    from orbitflow.serve.api import DEFAULT_MAX_BODY_BYTES, DEFAULT_WATCHDOG_S, build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(config, profile="measure")  # the SLO derives from this machine's measured decode step
    model_name = served_model_name or config.model
    app = build_app(llm, model_name, api_key=api_key, max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                    watchdog_s=watchdog_s or DEFAULT_WATCHDOG_S)
    engine = app.state.server.engine
    log.info(
        "serving %s at http://%s:%d/v1 | device KV %d blocks, host KV %d blocks (block %d tokens) | "
        "SLO %.1f ms/token | policy %s%s",
        model_name, host, port, config.device_kv_blocks, config.host_kv_blocks, config.block_size,
        1000 * llm.engine.default_slo_s, config.policy, "" if config.token_deposit else " (no Token-Deposit)",
    )

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # the signal handler: start draining, then let uvicorn stop
            if not engine.draining:
                log.info("shutting down: finishing requests in flight for up to %.0f s", shutdown_timeout_s)
                engine.drain(shutdown_timeout_s)
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal that stopped it once it is done; these handlers take it, so the process
    # ends by returning from main (exit 0) rather than by the default action of SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                    timeout_graceful_shutdown=shutdown_timeout_s + 5))
    try:
        server.run()
    finally:
        llm.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")


def add_serve_parser(
    subparsers,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_config: Callable[..., EngineConfig],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    g = p.add_argument_group("robustness")
    g.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                   help="requests that may wait for admission; more get 503 with Retry-After")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, let requests in flight finish for S seconds, then abort them")
    g.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get 413")
    g.add_argument("--watchdog-s", type=float, default=60.0, metavar="S",
                   help="/health answers 503 when the engine loop has not advanced for S seconds with work pending")
    c = p.add_argument_group("cluster (Ray Serve; pip install 'orbitflow[cluster]')")
    c.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas behind this API on Ray Serve (default: one engine in this process)")
    c.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'ray://head:10001'); default: start Ray on this machine")
    c.add_argument("--router", default="slo-aware", choices=("slo-aware", "least-loaded", "round-robin"),
                   help="how requests pick a replica: slo-aware (power of two choices by the replicas' planned "
                        "SLO headroom, else least loaded), least-loaded, or round-robin")
    c.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each engine replica")
    add_engine_args(p)

    def handler(args: argparse.Namespace) -> int:
        if not 0 < args.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {args.port}")
        for flag, value in (("--shutdown-timeout", args.shutdown_timeout), ("--max-body-bytes", args.max_body_bytes),
                            ("--watchdog-s", args.watchdog_s)):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        if args.replicas is not None:
            return _run_replicas(args, engine_config(args, max_queue_len=args.max_queue_len))
        if args.ray_address is not None:
            raise ConfigError("--ray-address needs --replicas N")
        run_server(engine_config(args, max_queue_len=args.max_queue_len), host=args.host, port=args.port,
                   api_key=args.api_key, served_model_name=args.served_model_name,
                   shutdown_timeout_s=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                   watchdog_s=args.watchdog_s)
        return 0

    p.set_defaults(func=handler)
    return p


def _run_replicas(args: argparse.Namespace, config: EngineConfig) -> int:
    """`serve --replicas N`: the same API on N engine replicas (serve/cluster.py, on Ray Serve)."""
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
    try:
        from orbitflow.serve.cluster import run_cluster
    except ImportError as exc:
        raise ConfigError(f"--replicas needs Ray Serve ({exc}): pip install 'orbitflow[cluster]'") from None
    run_cluster(config, args.replicas, args.ray_address, args.host, args.port, args.router,
                served_model_name=args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                watchdog_s=args.watchdog_s, replica_cpus=args.replica_cpus)
    return 0
