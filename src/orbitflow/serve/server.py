"""`orbitflow serve`: build the engine from a config and run the OpenAI-compatible API under uvicorn.

Shutdown on SIGTERM or Ctrl-C is graceful: the listening socket closes (a new connection is refused; a new request
on a connection already open gets 503), requests in
flight may finish for `--shutdown-timeout` seconds and are then aborted (their streams end with
finish_reason "abort"), the engine frees every block, and the process exits 0 without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket

from orbitflow.config import (
    PROFILE_FLAG_HELP,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    HelpFormatter,
    ServerConfig,
    add_config_args,
    add_engine_args,
    config_from_args,
    engine_config,
)

log = logging.getLogger("orbitflow.serve")

DEFAULT_MAX_QUEUE_LEN = 256
# A server runs long, so it solves ahead in a planner process whatever the core count (the engine's "auto" picks the
# thread below 4 cores, for short runs and tests; runtime/background_planner.py's docstring has the measurements).
SERVE_BACKGROUND_PLANNER = "process"


def run_server(config: EngineConfig, server: ServerConfig | None = None, profile="measure") -> None:
    import uvicorn

    from orbitflow.llm import LLM
    from orbitflow.serve.api import build_app

    server = server or ServerConfig()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _check_port_free(server.host, server.port)  # before a minute of loading and profiling, not after
    llm = LLM(config, profile=profile)  # the SLO derives from this machine's decode step (measured, or --profile's)
    model_name = server.served_model_name or config.model.name
    app = build_app(llm, model_name, api_key=server.api_key, max_body_bytes=server.max_body_bytes,
                    watchdog_s=server.watchdog_s)
    engine = app.state.server.engine
    log.info(
        "serving %s at http://%s:%d/v1 | device KV %d blocks, host KV %d blocks (block %d tokens) | "
        "SLO %.1f ms/token | policy %s%s",
        model_name, server.host, server.port, config.cache.device_kv_blocks, config.cache.host_kv_blocks,
        config.cache.block_size, 1000 * llm.engine.default_slo_s, config.planner.policy,
        "" if config.planner.token_deposit else " (no Token-Deposit)",
    )

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # the signal handler: start draining, then let uvicorn stop
            if not engine.draining:
                log.info("shutting down: finishing requests in flight for up to %g s", server.shutdown_timeout)
                engine.drain(server.shutdown_timeout)
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal that stopped it once it is done; these handlers take it, so the process
    # ends by returning from main (exit 0) rather than by the default action of SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    uvicorn_server = _Server(uvicorn.Config(app, host=server.host, port=server.port, log_level="info",
                                            timeout_graceful_shutdown=server.shutdown_timeout + 5))
    try:
        uvicorn_server.run()
    finally:
        llm.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")


def _check_port_free(host: str, port: int) -> None:
    """Raise ConfigError naming --host/--port when the address cannot be bound (in use, or not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              formatter_class=HelpFormatter)
    add_config_args(p, ServerConfig, "server")
    p.add_argument("--profile", default=None, metavar="FILE", help=PROFILE_FLAG_HELP)
    add_config_args(p, ClusterConfig, "cluster (Ray Serve; pip install 'orbitflow[cluster]')")
    add_engine_args(p, defaults={"max_queue_len": DEFAULT_MAX_QUEUE_LEN, "deposit_guard_ms": "auto",
                                 "background_planner": SERVE_BACKGROUND_PLANNER},
                    helps={"background_planner": "where an expiry's plan is solved while the steps before it run: "
                                                 "process (never holds the engine's GIL; a server runs long, so it "
                                                 "starts one on any core count), thread or off; auto: process with 4 "
                                                 "or more cores, else thread"})

    def handler(args: argparse.Namespace) -> int:
        from orbitflow.llm import machine_profile

        server, cluster = config_from_args(ServerConfig, args), config_from_args(ClusterConfig, args)
        profile = machine_profile(args.profile)  # a bad file: before a minute of loading, not after
        if cluster.replicas is not None:
            return _run_replicas(engine_config(args), server, cluster, profile)
        run_server(engine_config(args), server, profile)
        return 0

    p.set_defaults(func=handler)
    return p


def _run_replicas(config: EngineConfig, server: ServerConfig, cluster: ClusterConfig, profile="measure") -> int:
    """`serve --replicas N`: the same API on N engine replicas (serve/cluster.py, on Ray Serve)."""
    try:
        from orbitflow.serve.cluster import run_cluster
    except ImportError as exc:
        raise ConfigError(f"--replicas needs Ray Serve ({exc}): pip install 'orbitflow[cluster]'") from None
    if cluster.ray_address is None:  # Serve's proxy listens on this machine: say so before starting Ray, not after
        _check_port_free(server.host, server.port)
    run_cluster(config, cluster.replicas, cluster.ray_address, server.host, server.port, cluster.router,
                shutdown_timeout=server.shutdown_timeout, served_model_name=server.served_model_name,
                api_key=server.api_key,
                max_body_bytes=server.max_body_bytes, watchdog_s=server.watchdog_s, replica_cpus=cluster.replica_cpus,
                replica_gpus=cluster.replica_gpus, profile=profile)
    return 0
